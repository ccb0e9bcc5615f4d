"""The trainer's checkpoints written in the background (``checkpoint.background``, the default): the
steps after a save go on while its files are written, ``latest`` moves only once they are complete,
at most one save is in flight (the next save waits for it), and the run ends only once the last is
published; with ``checkpoint.background=false`` training waits for the files instead. A real run in
one process, its save held just before it publishes (the publish pause of the checkpoint code): in
this test's process (``parallel_latent.cli.main``, watched from a thread) where nothing kills it,
in a process of its own where it is killed."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable

import pytest

from parallel_latent.checkpoint.saving import PAUSE_BEFORE_PUBLISH_ENV, PAUSE_MARKER
from tests.helpers.in_process_cli import run_main
from tests.helpers.trainer_runs import REPO, cli_command, describe, rank_env, train_args, train_records

pytestmark = pytest.mark.slow

EVERY, STEPS, PAUSE_S = 4, 12, 60
RECIPE = ["parallel.tensor_parallel=1", f"training.max_steps={STEPS}", f"checkpoint.save_every={EVERY}"]


def steps_while_paused(run_dir, running: Callable[[], bool], expected: int) -> list[int]:
    """The steps recorded while the step-4 save is held before its publish: sampled until they reach
    ``expected`` (a condition, not a clock), then for 2 s more, in which a step past it would show.
    ``running``: whether the run goes on."""
    marker = run_dir / "checkpoints" / f".tmp-step_{EVERY:08d}" / PAUSE_MARKER
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert running() and time.monotonic() < deadline, "the step-4 save never reached its publish"
        time.sleep(0.1)
    seen, last_change, previous = [], time.monotonic(), None
    while marker.exists() and (max(previous or [0]) < expected or time.monotonic() - last_change < 2.0):
        steps = [r["step"] for r in train_records(run_dir)]
        if steps != previous:
            previous, last_change = steps, time.monotonic()
        seen = steps
        assert not (run_dir / "checkpoints" / "latest").exists(), "published before it was complete"
        time.sleep(0.1)
    assert marker.exists(), "the pause ended before the steps stopped moving"
    marker.unlink()  # ends the pause: the save publishes now
    return seen


@pytest.mark.parametrize(("background", "steps_during_the_save"), [(True, 2 * EVERY), (False, EVERY)])
def test_the_steps_after_a_save_go_on_while_it_is_written(background, steps_during_the_save, tmp_path):
    run_dir = tmp_path / "run"
    finished, watched = threading.Event(), {}

    def watch() -> None:  # what the test sees while the run goes on in its main thread
        try:
            watched["seen"] = steps_while_paused(run_dir, lambda: not finished.is_set(), steps_during_the_save)
        except BaseException as error:  # re-raised below (the held save publishes after PAUSE_S)
            watched["error"] = error

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = run_main(
            train_args(run_dir, *RECIPE, f"checkpoint.background={str(background).lower()}"),
            env={PAUSE_BEFORE_PUBLISH_ENV: f"{PAUSE_S}@{EVERY}"},
        )
    finally:
        finished.set()
        watcher.join(timeout=60)
    if "error" in watched:
        raise watched["error"]
    seen = watched["seen"]
    # Background: training went on to the next save, which waits for this one; otherwise it
    # waited at this one.
    assert max(seen) == steps_during_the_save, seen
    assert result.returncode == 0, describe(result)
    stdout = result.stdout
    assert [r["step"] for r in train_records(run_dir)] == list(range(1, STEPS + 1))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_")) == [
        f"step_{2 * EVERY:08d}",
        f"step_{STEPS:08d}",
    ]
    assert f"checkpoint: {run_dir / 'checkpoints' / f'step_{STEPS:08d}'}" in stdout


def test_a_kill_in_the_middle_of_a_background_write_leaves_latest_on_the_previous_checkpoint(tmp_path):
    """kill -9 while the step-8 save is still being written (held before its publish): ``latest``
    names step 4, the unfinished save is left unpublished, and the same command resumes from step 4
    and goes on exactly as the killed run went on (the same losses, one record per step)."""
    run_dir = tmp_path / "run"
    command = cli_command(run_dir, *RECIPE, "checkpoint.background=true")
    job = subprocess.Popen(
        command, cwd=REPO, env=rank_env({PAUSE_BEFORE_PUBLISH_ENV: f"600@{2 * EVERY}"}),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    checkpoints = run_dir / "checkpoints"
    marker = checkpoints / f".tmp-step_{2 * EVERY:08d}" / PAUSE_MARKER
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert job.poll() is None, job.stderr.read()
            assert time.monotonic() < deadline, "the step-8 save never reached its publish"
            time.sleep(0.1)
    finally:
        job.kill()
        job.wait()
    assert (checkpoints / "latest").read_text().strip() == f"step_{EVERY:08d}"
    assert not (checkpoints / f"step_{2 * EVERY:08d}").exists()
    killed = {r["step"]: r for r in train_records(run_dir)}
    assert max(killed) >= 2 * EVERY

    rerun = run_main(train_args(run_dir, *RECIPE, "checkpoint.background=true"))  # the same command, in this process
    assert rerun.returncode == 0, describe(rerun)
    assert f"resumed from {checkpoints / f'step_{EVERY:08d}'} at step {EVERY}" in rerun.stdout
    got = train_records(run_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for record in got:
        if record["step"] in killed:
            assert record["loss"] == killed[record["step"]]["loss"], record["step"]
    assert (checkpoints / "latest").read_text().strip() == f"step_{STEPS:08d}"
