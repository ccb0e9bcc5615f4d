"""The corruption fuzzer (tests/helpers/corruption.py) on one straight run's newest checkpoint: a
bounded sample, every mutation of every target with its record made consistent and not, each on a
file it applies to. Every case ends refused in one line (exit status 2, naming a file of the
checkpoint), in the documented fallback to the newest intact checkpoint, or accepted; never in a
traceback, never with the run directory (or the portable directory) changed, never with a pickle's
payload run. A case the acceptance lets through with the checkpoint named explicitly is then
resumed for real: what was accepted must train. A few cases of the kinds that used to reach the
ranks run the real ``train --nproc 2``, ranks and all. ``python -m tests.helpers.corruption`` runs
thousands (docs/failures.md)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.helpers.corruption import BASE_RECIPE, JSON_MUTATIONS, MUTATIONS, STEPS, Case, all_cases, run_case
from tests.helpers.pool_training import shared_pool, train_in_pool
from tests.helpers.trainer_runs import train_args


@pytest.fixture(scope="module")
def pool(request):
    return shared_pool(request, 2)


@pytest.fixture(scope="module")
def base_run(pool, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("fuzz-base") / "run"
    train_in_pool(pool, run_dir, *BASE_RECIPE)
    return run_dir


def train_argv(run_dir: Path, resume: str) -> list[str]:
    return [*train_args(run_dir, *BASE_RECIPE, f"checkpoint.resume={resume}"), "--nproc=2"]


def bounded_sample(base_run: Path, seed: int = 1) -> list[Case]:
    """One case per (target, mutation, record consistent or not), on a file it applies to, the
    training cases alternating between naming the checkpoint and ``auto``."""
    rng = random.Random(seed)
    cases = all_cases(base_run, seed)
    chosen = []
    for target in ("training", "portable"):
        for mutation in MUTATIONS:
            for consistent in (False, True):
                fits = [
                    c
                    for c in cases
                    if (c.target, c.mutation, c.consistent) == (target, mutation, consistent)
                    and (c.file.endswith(".json") or mutation not in (*JSON_MUTATIONS, "extra key"))
                    and (c.file.endswith((".json", ".safetensors")) or mutation != "deeply nested")
                    and (any(ch.isdigit() for ch in c.file) or mutation != "swapped between ranks")
                    and c.mode == ("reconstruct" if target == "portable" else ("named", "auto")[len(chosen) % 2])
                ]
                chosen.append(rng.choice(fits))
    return chosen


@pytest.mark.slow
def test_every_mutation_ends_in_one_line_or_a_fallback_with_the_run_untouched(pool, base_run, tmp_path):
    outcomes = [
        run_case(case, base_run, tmp_path / f"case-{i}", train_argv) for i, case in enumerate(bounded_sample(base_run))
    ]
    applied = [o for o in outcomes if o.applies]
    assert len(applied) >= len(outcomes) - 4, [o.case for o in outcomes if not o.applies]
    bad = [(o.case, o.done, o.kind, o.changed[:2], o.lines[-2:]) for o in applied if not o.ok]
    assert not bad, bad
    kinds = {o.kind for o in applied}
    assert {"refused", "fallback"} <= kinds, kinds  # the sample reaches both documented endings
    for outcome in applied:
        if outcome.kind == "refused":  # the line starts with the path of a file of the damaged checkpoint
            named = Path(outcome.lines[-1].removeprefix("parallel-latent: error: ").split(": ")[0])
            assert f"step_{STEPS:08d}" in named.parts, (outcome.case, outcome.lines[-1])


@pytest.mark.parametrize("file", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"])
@pytest.mark.slow
def test_files_swapped_between_ranks_are_refused_with_the_record_rewritten(base_run, tmp_path, file):
    """DeepSpeed's files name no rank; each carries the name it was written as, so two ranks' files
    swapped (sizes and hashes in checkpoint.json rewritten to match) are refused, not resumed as
    another rank's shard."""
    case = Case("training", file, "swapped between ranks", True, "named", 7)
    outcome = run_case(case, base_run, tmp_path, train_argv)
    assert outcome.kind == "refused" and outcome.ok, (outcome.kind, outcome.lines)
    assert "(files swapped or renamed)" in outcome.lines[-1] and file in outcome.lines[-1], outcome.lines


@pytest.mark.slow
def test_what_the_acceptance_lets_through_resumes(pool, base_run, tmp_path):
    """A key no reader knows, in the trainer's open part of client_state.json (a caller of the
    checkpoint package may keep its own state there), with the record rewritten to match, is
    accepted (docs/failures.md); such a checkpoint resumes and trains."""
    case = Case("training", "client_state.json", "extra key", True, "named", 2)
    outcome = run_case(case, base_run, tmp_path / "case", train_argv, keep=True)
    assert outcome.kind == "accepted" and outcome.ok and outcome.done == "client.fuzz_extra added", outcome
    run_dir = tmp_path / "case" / "run"
    stdout, _ = train_in_pool(
        pool,
        run_dir,
        *BASE_RECIPE,
        f"training.max_steps={STEPS + 1}",
        f"checkpoint.resume={run_dir / 'checkpoints' / f'step_{STEPS:08d}'}",
    )
    assert f"at step {STEPS}" in stdout and (run_dir / "checkpoints" / f"step_{STEPS + 1:08d}").is_dir()


COMMAND_CASES = [  # what only the ranks met before the launcher's plan was theirs
    Case("training", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "the step before's", True, "auto", 3, "command"),
    Case("training", "client_state.json", "NaN", True, "auto", 4, "command"),
    Case("training", "checkpoint.json", "deeply nested", False, "named", 5, "command"),
    Case("training", "rng/rank_00001.json", "huge number", True, "named", 6, "command"),
    Case("training", "mp_rank_01_model_states.pt", "symlink loop", True, "named", 7, "command"),
    Case("training", "model/model-tp00-of-02.safetensors", "deeply nested", True, "named", 8, "command"),
]


@pytest.mark.slow
def test_the_real_command_refuses_in_one_line_or_falls_back_with_the_run_untouched(base_run, tmp_path):
    """The real ``train --nproc 2`` (ranks and all) on the kinds of damage the ranks used to meet
    first: refused in one line naming the file, the run directory byte for byte as it was; or under
    ``auto`` the damaged checkpoint moved aside in one line, as it was, and the run resumed from the
    one before and trained to its end."""
    outcomes = [run_case(case, base_run, tmp_path / f"case-{i}", train_argv) for i, case in enumerate(COMMAND_CASES)]
    assert all(o.applies for o in outcomes), [o.case for o in outcomes if not o.applies]
    bad = [(o.case.file, o.case.mutation, o.done, o.kind, o.changed[:2], o.lines[-3:]) for o in outcomes if not o.ok]
    assert not bad, bad
    assert [o.kind for o in outcomes] == ["fallback"] * 2 + ["refused"] * 4, [(o.kind, o.lines[-2:]) for o in outcomes]
