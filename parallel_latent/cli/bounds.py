"""The numeric options of the commands, each checked against a range before anything runs: a value
outside ends the command in one line (rc 2), never in minutes of work or a machine out of memory
(``interpolate --steps 100000000`` would decode a hundred million texts)."""

from __future__ import annotations

from parallel_latent.errors import UsageError

# Processes one machine starts (--nproc): more than any host has cores for.
MAX_LOCAL_PROCESSES = 1024
MAX_RESTARTS = 1000
MAX_WAIT_FOR_LOCK_S = 7 * 24 * 3600
# Texts an interpolation decodes (one batch: every point is one sample of it).
MAX_INTERPOLATION_STEPS = 1000
# Samples one evaluation batch holds (features and logits of the whole batch at once).
MAX_BATCH_SIZE = 4096


def check_range(option: str, value: float | None, low: float, high: float, why: str = "") -> None:
    """``value`` of ``option`` within [low, high], or a UsageError that names both (None: not given)."""
    if value is None or low <= value <= high:
        return
    low_, value_, high_ = (f"{x:g}" if isinstance(x, float) else str(x) for x in (low, value, high))
    raise UsageError(f"{option} {value_}: must be between {low_} and {high_}" + (f" ({why})" if why else ""))
