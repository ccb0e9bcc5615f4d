"""A damaged newest checkpoint: found before any rank loads it, moved aside, and the run resumes from
the newest intact one exactly as an uninterrupted run went on from there (2 ranks, gloo).

One straight run (the trainer on the 2 ranks of a pool that lives for this module,
tests/helpers/pool_training.py) saves a checkpoint at every step; every test reads it or damages a
copy of it. The fallback under ``train --nproc 2`` is one run over a copy whose newest checkpoints each
hold one kind of damage: it passes over every one of them, saying each in its own line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from parallel_latent.checkpoint import checkpoint_damage, resumable
from parallel_latent.checkpoint.integrity import file_record
from parallel_latent.cli import main
from tests.helpers.corruption import rewrite_file_record
from tests.helpers.pool_training import shared_pool, train_in_pool
from tests.helpers.trainer_runs import cli_command, describe, run, train_args, train_records

FIXTURE_RUN = Path(__file__).parent / "fixtures" / "v1" / "run"
# A checkpoint at every step: the newest (STEPS) is damaged, HALF is the newest before it; the
# fallback run damages STEPS, STEPS - 1, ... one kind each and resumes from step 1.
STEPS, HALF = 5, 4
RECIPE = [
    f"training.max_steps={STEPS}",
    "checkpoint.save_every=1",
    "checkpoint.keep_last=0",
    "checkpoint.export_portable=true",
    "parallel.tensor_parallel=2",
    "model.dropout=0.1",
]
OPTIMIZER_SHARD = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL_STATES = "mp_rank_01_model_states.pt"

DAMAGE = {
    "truncated optimizer shard": (OPTIMIZER_SHARD, lambda p: p.write_bytes(p.read_bytes()[:-4096])),
    "truncated model states": (MODEL_STATES, lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])),
    "zero-byte RNG file": ("rng/rank_00001.json", lambda p: p.write_bytes(b"")),
    "deleted shard": ("model/model-tp01-of-02.safetensors", lambda p: p.unlink()),
}


@pytest.fixture(scope="module")
def pool(request):
    """Two ranks shared with the other checkpoint and data modules (tests/helpers/pool_training.py)."""
    return shared_pool(request, 2)


@pytest.fixture(scope="module")
def straight(pool, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    train_in_pool(pool, run_dir, *RECIPE)
    return run_dir


def damaged_copy(straight: Path, tmp_path: Path, kind: str, step: int = STEPS) -> Path:
    copy = tmp_path / "run"
    if not copy.exists():
        shutil.copytree(straight, copy)
    name, damage = DAMAGE[kind]
    damage(copy / "checkpoints" / f"step_{step:08d}" / name)
    return copy


# Each kind of damage in its own checkpoint: the newest for the first kind, the one before for the next.
DAMAGED_STEP = {kind: STEPS - i for i, kind in enumerate(sorted(DAMAGE))}


@pytest.fixture(scope="module")
def fallback_run(straight, tmp_path_factory):
    """``train --nproc 2`` on a copy of the straight run whose newest checkpoints are damaged, one
    kind each (steps 5, 4, 3, 2); the run resumes from step 1."""
    tmp_path = tmp_path_factory.mktemp("fallback")
    for kind, step in DAMAGED_STEP.items():
        copy = damaged_copy(straight, tmp_path, kind, step)
    result = run(cli_command(copy, *RECIPE, nproc=2), timeout=400)
    assert result.returncode == 0, describe(result)
    return copy, result


@pytest.mark.slow
def test_a_checkpoint_records_its_files_when_published(straight):
    step_dir = straight / "checkpoints" / f"step_{STEPS:08d}"
    record = json.loads((step_dir / "checkpoint.json").read_text())["files"]
    assert record == file_record(step_dir)  # nothing changed since
    assert {OPTIMIZER_SHARD, MODEL_STATES, "rng/rank_00001.json", "model/manifest.json"} <= set(record)
    assert checkpoint_damage(step_dir) is None


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_each_kind_of_damage_is_found_and_passed_over(straight, tmp_path, kind):
    copy = damaged_copy(straight, tmp_path, kind)
    newest = copy / "checkpoints" / f"step_{STEPS:08d}"
    damage = checkpoint_damage(newest)
    assert damage is not None and damage.startswith(str(newest / DAMAGE[kind][0]))
    intact, passed_over = resumable(copy / "checkpoints")
    assert intact == copy / "checkpoints" / f"step_{HALF:08d}"
    assert passed_over == [(newest, damage)]


def test_checkpoints_saved_before_the_record_are_checked_for_what_can_be(tmp_path):
    fixture = FIXTURE_RUN / "checkpoints" / "step_00000060"
    assert "files" not in json.loads((fixture / "checkpoint.json").read_text())
    assert checkpoint_damage(fixture) is None  # a missing record is not damage
    copy = tmp_path / "step_00000060"
    shutil.copytree(fixture, copy)
    shard = copy / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert checkpoint_damage(copy) == f"{shard}: not a whole torch file (no zip directory at its end)"
    shard.write_bytes(b"")
    assert checkpoint_damage(copy) == f"{shard}: empty"


@pytest.mark.slow
def test_the_run_falls_back_to_the_newest_intact_checkpoint_and_goes_on_as_before(pool, straight, tmp_path):
    copy = damaged_copy(straight, tmp_path, "truncated optimizer shard")
    stdout, _ = train_in_pool(pool, copy, *RECIPE)
    newest = f"step_{STEPS:08d}"
    [line] = [line for line in stdout.splitlines() if "truncated or damaged" in line]
    assert line == (
        f"{copy / 'checkpoints' / newest / OPTIMIZER_SHARD}: "
        f"{(copy / 'checkpoints' / f'.damaged-{newest}' / OPTIMIZER_SHARD).stat().st_size} bytes, "
        f"{(straight / 'checkpoints' / newest / OPTIMIZER_SHARD).stat().st_size} when it was saved: "
        f"checkpoint {newest} is truncated or damaged; moved to .damaged-{newest}; resuming from step_{HALF:08d}"
    )
    assert f"at step {HALF}" in stdout
    want = {r["step"]: r for r in train_records(straight)}
    got = train_records(copy)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # one record per step
    for record in got:
        for key in ("loss", "grad_norm", "token_accuracy", "lr"):
            assert record[key] == want[record["step"]][key], (record["step"], key)
    side = [json.loads(line) for line in (copy / f"metrics.after-step_{HALF:08d}.jsonl").read_text().splitlines()]
    assert [r["step"] for r in side if r["kind"] == "train"] == list(range(HALF + 1, STEPS + 1))
    assert (copy / "checkpoints" / "latest").read_text().strip() == newest  # the new save of step 20
    assert checkpoint_damage(copy / "checkpoints" / newest) is None


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_the_fallback_says_which_file_how_and_where_it_went_once(fallback_run, kind):
    """Under ``train --nproc 2`` (one run for every kind, fallback_run): one line names the damaged
    file, what is wrong with it and where the checkpoint was moved, and nothing else on the terminal
    speaks of the damaged checkpoint."""
    copy, result = fallback_run
    damaged = f"step_{DAMAGED_STEP[kind]:08d}"
    said = [line for line in (result.stdout + result.stderr).splitlines() if damaged in line and "latest" not in line]
    [line] = [line for line in said if "truncated or damaged" in line]
    assert line.startswith(str(copy / "checkpoints" / damaged / DAMAGE[kind][0]) + ": "), line
    assert line.endswith(
        f"checkpoint {damaged} is truncated or damaged; moved to .damaged-{damaged}; resuming from step_{1:08d}"
    )
    assert "which is not a complete checkpoint" not in result.stdout + result.stderr, describe(result)


@pytest.mark.slow
def test_an_explicitly_named_damaged_checkpoint_stops_with_one_line(straight, tmp_path, capfd):
    copy = damaged_copy(straight, tmp_path, "zero-byte RNG file")
    step_dir = copy / "checkpoints" / f"step_{STEPS:08d}"
    status = main([*train_args(copy, *RECIPE, f"checkpoint.resume={step_dir}"), "--nproc=2"])
    stderr = capfd.readouterr().err
    assert status == 2, stderr
    assert (
        stderr.strip()
        .splitlines()[-1]
        .endswith(
            f"{step_dir / 'rng' / 'rank_00001.json'}: 0 bytes, "
            f"{(straight / 'checkpoints' / f'step_{STEPS:08d}' / 'rng' / 'rank_00001.json').stat().st_size} when it "
            f"was saved: the checkpoint {step_dir} is truncated or damaged; not loaded"
        )
    )
    assert step_dir.is_dir()  # nothing moved, nothing removed


class Payload:
    """What an attacker's pickle holds: unpickling it would run a command."""

    def __reduce__(self):
        return (print, ("pwned",))


def _pickle(path: Path) -> None:
    import torch

    torch.save({"x": torch.ones(2), "payload": Payload()}, path)


# Files that hold what no resume can use, with the record rewritten to match them (an attacker's or
# a careless copy's checkpoint): each is found by what it holds, not by its size or checksum.
CRAFTED = {
    "a pickle in the optimizer states": (OPTIMIZER_SHARD, _pickle, "holds pickled objects of"),
    "client state of other keys": (
        "client_state.json",
        lambda p: p.write_text('{"x": 1}'),
        "x is not a key this file holds",
    ),
    "an RNG state without keys": ("rng/rank_00001.json", lambda p: p.write_text("{}"), "python is missing"),
    "rank 0's RNG state in rank 1's file": (
        "rng/rank_00001.json",
        lambda p: p.write_text(p.with_name("rank_00000.json").read_text()),
        "rank 0's RNG state, in rank 1's file",
    ),
    "RNG states swapped between ranks": (
        "rng/rank_00001.json",
        lambda p: p.rename(p.with_name("rank_00002.json")),
        "RNG states for the 2 ranks",
    ),
    "client state of another step": (
        "client_state.json",
        lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "step": 3})),
        f"step 3, the checkpoint's is {STEPS}",
    ),
}


def crafted_copy(straight: Path, tmp_path: Path, kind: str) -> tuple[Path, Path]:
    """A copy of the straight run whose newest checkpoint holds CRAFTED[kind], its record consistent."""
    copy = tmp_path / "run"
    shutil.copytree(straight, copy)
    step_dir = copy / "checkpoints" / f"step_{STEPS:08d}"
    name, craft, _ = CRAFTED[kind]
    craft(step_dir / name)
    rewrite_file_record(step_dir)
    return copy, step_dir


def tree(directory: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``directory`` (itself included) with its size and modification time."""
    paths = [directory, *directory.rglob("*")]
    return {str(p): (p.lstat().st_size if p.is_file() else 0, p.lstat().st_mtime_ns) for p in paths}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(CRAFTED))
def test_a_checkpoint_whose_record_matches_is_read_for_what_it_holds(straight, tmp_path, kind):
    copy, step_dir = crafted_copy(straight, tmp_path, kind)
    damage = checkpoint_damage(step_dir)
    assert damage is not None and CRAFTED[kind][2] in damage, damage
    assert resumable(copy / "checkpoints")[0] == copy / "checkpoints" / f"step_{HALF:08d}"
    # The ranks of a job whose launcher read it whole check its record alone, which matches.
    assert checkpoint_damage(step_dir, contents=False) is None


@pytest.mark.slow
def test_crafted_checkpoints_named_explicitly_end_in_one_line_with_the_run_untouched(straight, tmp_path, capfd):
    """The issue's three crafted checkpoints, each named by checkpoint.resume: rc 2, one line naming
    the file, and the run directory's tree (paths, sizes, modification times) as it was."""
    for kind in ("a pickle in the optimizer states", "client state of other keys", "an RNG state without keys"):
        copy, step_dir = crafted_copy(straight, tmp_path / kind.replace(" ", "-"), kind)
        before = tree(copy)
        status = main([*train_args(copy, *RECIPE, f"checkpoint.resume={step_dir}"), "--nproc=2"])
        lines = capfd.readouterr().err.strip().splitlines()
        assert status == 2 and len(lines) == 1, lines
        assert str(step_dir / CRAFTED[kind][0]) in lines[0] and lines[0].endswith("truncated or damaged; not loaded")
        assert tree(copy) == before, kind


@pytest.mark.slow
def test_the_checkpoint_commands_read_a_training_checkpoint_whole_first(straight, tmp_path, capfd):
    """reshard, export, consolidate and inspect check a training checkpoint as a resume does: a
    crafted one is one line naming the file, rc 2, nothing written beside it or into it."""
    copy, step_dir = crafted_copy(straight, tmp_path, "a pickle in the optimizer states")
    before = tree(copy)
    commands = [
        ["reshard", str(step_dir)],
        ["export", str(step_dir), str(tmp_path / "exported")],
        ["consolidate", str(step_dir), str(tmp_path / "consolidated")],
        ["inspect", str(copy / "checkpoints")],
    ]
    for argv in commands:
        status = main(argv)
        lines = capfd.readouterr().err.strip().splitlines()
        assert status == 2 and len(lines) == 1 and str(step_dir / OPTIMIZER_SHARD) in lines[0], (argv, lines)
    assert tree(copy) == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.slow
@pytest.mark.parametrize("named", ["../x", "/x", "step_00000010/../../x", "model"])
def test_a_latest_that_names_anything_but_a_checkpoint_beside_it_is_refused(straight, tmp_path, named, capfd):
    from parallel_latent.checkpoint import CheckpointError, find_latest_checkpoint

    copy = tmp_path / "run"
    shutil.copytree(straight / "checkpoints", copy / "checkpoints")
    (copy / "checkpoints" / "latest").write_text(named + "\n")
    with pytest.raises(CheckpointError) as error:
        find_latest_checkpoint(copy / "checkpoints")
    assert (
        str(error.value)
        == f"{copy / 'checkpoints' / 'latest'}: names {named!r}, not a checkpoint directory beside it; not read"
    )
    if named != "../x":
        return  # one command line is enough: the message is the function's
    status = main([*train_args(copy, *RECIPE), "--nproc=2"])
    stderr = capfd.readouterr().err
    assert status == 2 and stderr.strip().splitlines()[-1].endswith(str(error.value)), stderr


@pytest.mark.slow
def test_entries_that_are_not_their_steps_own_checkpoint_are_passed_over(straight, tmp_path):
    """A step directory whose name and record disagree (step 5 under the name of step 9), one that
    is a link (to another checkpoint of the run), and a name that is no step's: the first two are
    damage, said in one line each and passed over newest first, the third is not a checkpoint at all."""
    import os

    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(straight / "checkpoints", checkpoints)
    os.rename(checkpoints / f"step_{STEPS:08d}", checkpoints / "step_00000009")
    os.symlink(checkpoints / f"step_{HALF:08d}", checkpoints / "step_00000008")
    shutil.copytree(checkpoints / f"step_{HALF:08d}", checkpoints / "step_99")
    (checkpoints / "latest").write_text("step_00000009\n")
    intact, passed_over = resumable(checkpoints)
    assert intact == checkpoints / f"step_{HALF:08d}"
    assert passed_over == [
        (
            checkpoints / "step_00000009",
            f"{checkpoints / 'step_00000009' / 'checkpoint.json'}: records step {STEPS}, in the directory of step 9",
        ),
        (
            checkpoints / "step_00000008",
            f"{checkpoints / 'step_00000008'}: a link to {checkpoints / f'step_{HALF:08d}'}, "
            "not a checkpoint directory of this run",
        ),
    ]


@pytest.mark.slow
def test_a_latest_that_is_a_link_is_refused_in_one_line(straight, tmp_path):
    import os

    from parallel_latent.checkpoint import CheckpointError, find_latest_checkpoint

    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(straight / "checkpoints", checkpoints)
    (checkpoints / "latest").unlink()
    os.symlink("latest.loop", checkpoints / "latest")
    os.symlink("latest", checkpoints / "latest.loop")
    with pytest.raises(CheckpointError, match=r"latest: a link to latest\.loop, not the file a save writes; not read"):
        find_latest_checkpoint(checkpoints)
