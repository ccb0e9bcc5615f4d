"""The benchmarks: scripts run as ``python -m benchmarks.NAME`` from the repository root (run_all.py runs
them all), over one harness (harness.py) and one performance model (performance.py). Not part of the
wheel: pyproject.toml's package discovery takes ``parallel_latent`` alone."""
