"""A corruption fuzzer for checkpoints: every file of a training checkpoint and of a portable
checkpoint, mutated (truncated, emptied, bytes flipped, a JSON value of the wrong type, a key
missing or added, JSON nested 100,000 deep (a safetensors header too), NaN, a huge number, swapped
with another rank's file, the same file of the step before, a pickle, a symlink out of the
directory, a symlink loop), with its record (``checkpoint.json``'s file record; the manifest's file
sizes) rewritten to match it or not. Each case runs what a user runs:

- training, ``runner="command"``: the real ``parallel-latent train --nproc 2`` (its launcher in this
  process, its ranks and all) with ``checkpoint.resume`` naming the damaged checkpoint (refused:
  exit status 2, one line naming a file of it, the run directory's tree as it was) or ``auto`` (the
  documented fallback: the damaged checkpoint moved aside in one line, the run resumed from the
  newest intact one and trained to its end);
- training, ``runner="acceptance"``: the launcher's acceptance alone
  (:func:`parallel_latent.cli.train.accept_job`, which makes the plan the ranks carry out), in this
  process: the same verdicts in a fraction of the time, for the thousands of cases;
- portable: ``parallel-latent reconstruct --checkpoint DIR`` (refused in one line, or it reconstructs).

Every case must end without a traceback and, unless it resumed, with the run directory's (or the
portable directory's) tree as it was: paths, sizes, modification times and the bytes of every
file; a pickle's payload must never run.
``tests/checkpoint/test_corruption.py`` runs a bounded sample; ``python -m tests.helpers.corruption
--cases 2000`` runs many and prints the table of docs/failures.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

STEPS = 2  # the base run: a checkpoint at every step; the newest is damaged, the one before is the fallback
BASE_RECIPE = [
    f"training.max_steps={STEPS}",
    "checkpoint.save_every=1",
    "checkpoint.keep_last=0",
    "checkpoint.export_portable=true",
    "parallel.tensor_parallel=2",
]
MUTATIONS = (
    "truncated",
    "empty",
    "bytes flipped",
    "wrong JSON type",
    "missing key",
    "extra key",
    "deeply nested",
    "NaN",
    "huge number",
    "swapped between ranks",
    "the step before's",
    "a pickle",
    "symlink out",
    "symlink loop",
)
JSON_MUTATIONS = ("wrong JSON type", "missing key", "extra key", "NaN", "huge number")
DEEP = 100_000
TEXT = "It is a truth universally acknowledged."


class Payload:
    """What an attacker's pickle holds: unpickling it creates the file it names (the fuzzer checks
    that no case ever did)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _json_slots(value, path=()) -> list[tuple]:
    """Every (container path, key) of a JSON value."""
    slots = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        slots.append((path, key))
        if len(slots) < 5000:
            slots += _json_slots(inner, (*path, key))
    return slots


def _at(value, path):
    for key in path:
        value = value[key]
    return value


OTHER_TYPES = (None, True, -1, 1.5, "x", [], {})


def _mutate_json(path: Path, rng: random.Random, how: str) -> str | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    slots = _json_slots(value)
    if how == "missing key":
        slots = [(p, k) for p, k in slots if isinstance(_at(value, p), dict)]
    if how in ("NaN", "huge number"):
        slots = [(p, k) for p, k in slots if type(_at(value, (*p, k))) in (int, float)]
    if how == "extra key":
        objects = [()] * isinstance(value, dict) + [(*p, k) for p, k in slots if isinstance(_at(value, (*p, k)), dict)]
        if not objects:
            return None
        where = rng.choice(objects)
        _at(value, where)["fuzz_extra"] = 1
        done = f"{_dotted(where)}.fuzz_extra added"
    elif not slots:
        return None
    else:
        where, key = rng.choice(slots)
        container = _at(value, where)
        if how == "missing key":
            del container[key]
            done = f"{_dotted((*where, key))} removed"
        elif how in ("NaN", "huge number"):
            old = container[key]
            container[key] = float("nan") if how == "NaN" else (1e300 * 1e10 if isinstance(old, float) else 10**30)
            done = f"{_dotted((*where, key))} = {json.dumps(container[key])}"
        else:
            old = container[key]
            container[key] = rng.choice([v for v in OTHER_TYPES if type(v) is not type(old)])
            done = f"{_dotted((*where, key))} = {json.dumps(container[key])}"
    _rewrite(path, json.dumps(value).encode())
    return done


def _dotted(path: tuple) -> str:
    return ".".join(str(key) for key in path) or "(top)"


def _rewrite(path: Path, data: bytes) -> None:
    """New bytes for ``path`` in a new inode: the fuzzer's copies share the base run's big files."""
    path.unlink()
    path.write_bytes(data)


def _rank_sibling(path: Path) -> Path | None:
    """Another rank's file of the same kind beside ``path`` (names differing only in digits)."""
    pattern = re.sub(r"\d+", lambda m: rf"\d{{{len(m.group())}}}", re.escape(path.name))
    if pattern == re.escape(path.name):
        return None
    siblings = sorted(p for p in path.parent.iterdir() if p != path and re.fullmatch(pattern, p.name))
    return siblings[0] if siblings else None


def _deeply_nested(path: Path, data: bytes) -> str | None:
    """A JSON file, or a safetensors file's JSON header, made a list nested :data:`DEEP` deep."""
    nested = b"[" * DEEP + b"]" * DEEP
    if path.suffix == ".json":
        _rewrite(path, nested)
        return f"the file: a list nested {DEEP} deep"
    if path.suffix == ".safetensors" and len(data) >= 8:
        length = int.from_bytes(data[:8], "little")
        _rewrite(path, len(nested).to_bytes(8, "little") + nested + data[8 + length :])
        return f"its header: a list nested {DEEP} deep"
    return None


def mutate(
    path: Path, how: str, rng: random.Random, outside: Path, marker: Path, before: Path | None = None
) -> str | None:
    """Apply the mutation ``how`` to the file ``path``: what was done, or None when it does not
    apply to that file."""
    data = path.read_bytes()
    if how == "truncated":
        if len(data) < 2:
            return None
        _rewrite(path, data[: (keep := rng.randrange(1, len(data)))])
        return f"{keep} of {len(data)} bytes kept"
    elif how == "empty":
        _rewrite(path, b"")
    elif how == "bytes flipped":
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            flipped[rng.randrange(len(flipped))] ^= rng.randrange(1, 256)
        _rewrite(path, bytes(flipped))
    elif how in (*JSON_MUTATIONS, "extra key"):
        return _mutate_json(path, rng, how) if path.suffix == ".json" else None
    elif how == "deeply nested":
        return _deeply_nested(path, data)
    elif how == "the step before's":
        if before is None or not before.is_file() or before.read_bytes() == data:
            return None
        _rewrite(path, before.read_bytes())
    elif how == "swapped between ranks":
        if (sibling := _rank_sibling(path)) is None:
            return None
        other = sibling.read_bytes()
        _rewrite(sibling, data)
        _rewrite(path, other)
    elif how == "a pickle":
        if path.suffix == ".pt":
            import torch

            buffer = io.BytesIO()
            torch.save({"state": torch.ones(2), "payload": Payload(marker)}, buffer)
            _rewrite(path, buffer.getvalue())
        else:
            _rewrite(path, pickle.dumps({"payload": Payload(marker)}))
    elif how == "symlink out":
        outside.mkdir(parents=True, exist_ok=True)
        target = outside / f"{path.parent.name}-{path.name}"
        shutil.move(path, target)
        path.symlink_to(target)
    elif how == "symlink loop":
        path.unlink()
        path.symlink_to(path.with_name(path.name + ".loop"))
        path.with_name(path.name + ".loop").symlink_to(path.name)
    else:
        raise ValueError(how)
    return how


def tree(directory: Path) -> dict[str, tuple]:
    """Every path under ``directory`` (itself included) with its size, modification time and, for a
    file, the SHA-256 of its bytes (a link: where it points)."""

    def entry(p: Path) -> tuple:
        stat = p.lstat()
        if p.is_symlink():
            return stat.st_size, stat.st_mtime_ns, os.readlink(p)
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        return stat.st_size, stat.st_mtime_ns, digest

    return {str(p): entry(p) for p in [directory, *directory.rglob("*")]}


def _copy_run(base: Path, to: Path) -> None:
    """A copy whose big files are hard links (mutations write new inodes: the base stays whole)."""

    def link_or_copy(source, destination):
        if Path(source).stat().st_size > 65536:
            Path(destination).hardlink_to(source)
        else:
            shutil.copy2(source, destination)

    shutil.copytree(base, to, copy_function=link_or_copy)


@dataclass(frozen=True)
class Case:
    target: str  # "training" (a run's newest checkpoint) or "portable" (its model/ directory alone)
    file: str  # relative to the checkpoint
    mutation: str
    consistent: bool  # the record rewritten to match the mutated file
    mode: str  # training: "named" (checkpoint.resume=DIR) or "auto"; portable: "reconstruct"
    seed: int
    runner: str = "acceptance"  # training: "acceptance" (the launcher's, in this process) or "command" (ranks and all)


@dataclass
class Outcome:
    case: Case
    applies: bool = True
    done: str = ""  # what the mutation did
    status: int | None = None
    lines: list[str] = field(default_factory=list)
    kind: str = ""  # "refused", "fallback", "accepted", "traceback"
    changed: list[str] = field(default_factory=list)
    payload_ran: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        ended = self.kind in ("refused", "fallback", "accepted")
        return not self.applies or (ended and not self.changed and not self.payload_ran)


def checkpoint_files(step_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file())


def rewrite_file_record(step_dir: Path) -> None:
    """``checkpoint.json``'s file record made to match the files as they are now: what a bad copy
    that also rewrote the record (or an attacker) leaves; only what the files hold can tell."""
    from parallel_latent.checkpoint.integrity import file_record

    info_path = step_dir / "checkpoint.json"
    info = json.loads(info_path.read_text())
    _rewrite(info_path, json.dumps({**info, "files": file_record(step_dir)}).encode())


def _make_consistent(case: Case, step_dir: Path) -> None:
    if case.target == "training":
        if case.file != "checkpoint.json":
            rewrite_file_record(step_dir)
        return
    manifest_path = step_dir / "manifest.json"
    if case.file == "manifest.json":
        return
    manifest = json.loads(manifest_path.read_text())
    for name, info in manifest.get("files", {}).items():
        if (step_dir / name).exists():
            info["bytes"] = (step_dir / name).stat().st_size
    _rewrite(manifest_path, json.dumps(manifest).encode())


def _run_in_process(call: Callable[[], int]) -> tuple[int, list[str], bool]:
    """``call``'s exit status, the lines it wrote, and whether it ended in a traceback."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = call()
        except Exception:  # what the command line would end with: Python's traceback
            import traceback

            return 1, [*err.getvalue().splitlines(), *traceback.format_exc().splitlines()], True
    return int(status), [line for line in (out.getvalue() + err.getvalue()).splitlines() if line.strip()], False


def _accept_training(argv: list[str]) -> int:
    """``train --nproc 2``'s acceptance phase, its errors as the command line reports them; an
    accepted job is given back (its lock file as found) instead of launched."""
    from parallel_latent.cli import build_parser
    from parallel_latent.cli.train import accept_job
    from parallel_latent.config import load_config
    from parallel_latent.errors import ExitStatus, error_line, exit_status, one_line

    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        lock, plan = accept_job(cfg, args)
    except Exception as error:
        status = exit_status(error)
        if status is ExitStatus.FAILURE:
            raise
        print(error_line(one_line(error)), file=sys.stderr)
        return status
    print(f"accepted: resumes from {plan.resume}")
    if lock is not None:
        lock.release(undo=True)
    return 0


def run_case(
    case: Case, base_run: Path, work: Path, train_argv: Callable[[Path, str], list[str]], keep: bool = False
) -> Outcome:
    """One case on a fresh copy of ``base_run`` under ``work`` (removed after, unless ``keep``)."""
    from parallel_latent.cli import main

    started = time.perf_counter()
    outcome = Outcome(case)
    run_dir, outside, marker = work / "run", work / "outside", work / "payload-ran"
    _copy_run(base_run, run_dir)
    newest = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    step_dir = newest if case.target == "training" else newest / "model"
    rng = random.Random(case.seed)
    older = run_dir / "checkpoints" / f"step_{STEPS - 1:08d}"
    before_file = (older if case.target == "training" else older / "model") / case.file
    try:
        done = mutate(step_dir / case.file, case.mutation, rng, outside, marker, before_file)
        if done is None:
            outcome.applies = False
            return outcome
        outcome.done = done
        if case.consistent:
            _make_consistent(case, step_dir)
        watched = run_dir if case.target == "training" else step_dir
        before = tree(watched)
        resume = str(newest) if case.mode == "named" else "auto"
        if case.target == "training" and case.runner == "command":
            outcome.status, outcome.lines, crashed = _run_command(train_argv(run_dir, resume))
        elif case.target == "training":
            call = lambda: _accept_training(train_argv(run_dir, resume))  # noqa: E731
            outcome.status, outcome.lines, crashed = _run_in_process(call)
        else:
            call = lambda: main(["reconstruct", "--checkpoint", str(step_dir), TEXT])  # noqa: E731
            outcome.status, outcome.lines, crashed = _run_in_process(call)
        outcome.payload_ran = marker.exists()
        outcome.kind = _kind(outcome, crashed, newest)
        outcome.changed = _changed(before, tree(watched), outcome, newest)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
        outcome.seconds = time.perf_counter() - started
    return outcome


def _run_command(argv: list[str]) -> tuple[int, list[str], bool]:
    """The real ``parallel-latent train --nproc 2``: its launcher in this process, its ranks real
    processes (tests/helpers/in_process_cli.py)."""
    from tests.helpers.in_process_cli import run_main

    result = run_main(argv)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    return result.returncode, lines, "Traceback" in result.stderr


def _changed(before: dict, after: dict, outcome: Outcome, newest: Path) -> list[str]:
    """What changed that must not have: anything, for a job that did not run (the acceptance alone,
    a refusal, a reconstruction); for a job that ran, the damaged checkpoint it passed over, which
    must be where its line says, as it was (the rest is the run's to write)."""
    ran = outcome.case.runner == "command" and outcome.kind in ("fallback", "accepted")
    if not ran:
        return sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    if outcome.kind == "accepted":
        return []
    moved = newest.with_name(f".damaged-{newest.name}")
    inside = {p: entry for p, entry in before.items() if Path(p).is_relative_to(newest) and Path(p) != newest}
    return sorted(p for p, entry in inside.items() if after.get(str(moved / Path(p).relative_to(newest))) != entry)


def _kind(outcome: Outcome, crashed: bool, newest: Path) -> str:
    errors = [line for line in outcome.lines if line.startswith("parallel-latent: error:")]
    if crashed or any("Traceback" in line for line in outcome.lines):
        return "traceback"
    if outcome.status == 2 and len(errors) == 1 and str(newest) in errors[0]:
        return "refused"
    if outcome.status == 0 and outcome.case.mode == "auto" and outcome.case.runner == "command":
        moved = [
            line for line in outcome.lines if f"checkpoint {newest.name} is truncated or damaged; moved to" in line
        ]
        return (
            "fallback" if len(moved) == 1 and moved[0].endswith(f"resuming from step_{STEPS - 1:08d}") else "accepted"
        )
    if outcome.status == 0 and outcome.case.mode == "auto":
        resumed = [line for line in outcome.lines if line.startswith("accepted: resumes from")]
        return "fallback" if resumed and not resumed[0].endswith(newest.name) else "accepted"
    if outcome.status == 0 and not errors:
        return "accepted"
    return f"status {outcome.status}, {len(errors)} error lines"


def all_cases(base_run: Path, seed: int = 0) -> list[Case]:
    """Every (target, file, mutation, consistent, mode) once, with a seed of its own."""
    newest = base_run / "checkpoints" / f"step_{STEPS:08d}"
    cases = []
    for target, directory, modes in (
        ("training", newest, ("named", "auto")),
        ("portable", newest / "model", ("reconstruct",)),
    ):
        for name in checkpoint_files(directory):
            for mutation in MUTATIONS:
                for consistent in (False, True):
                    for mode in modes:
                        cases.append(Case(target, name, mutation, consistent, mode, seed * 100003 + len(cases)))
    return cases


def sample(cases: list[Case], count: int, seed: int) -> list[Case]:
    """``count`` cases drawn with replacement over the kinds, each with a new seed."""
    rng = random.Random(seed)
    drawn = [rng.choice(cases) for _ in range(count)]
    return [dataclasses.replace(c, seed=rng.randrange(2**31)) for c in drawn]


def table(outcomes: list[Outcome], seconds: float) -> str:
    """The markdown table of docs/failures.md: per target and mutation, how the cases ended."""
    applied = [o for o in outcomes if o.applies]
    rows = Counter((o.case.target, o.case.mutation) for o in applied)
    kinds = ("refused", "fallback", "accepted")
    lines = [
        "| checkpoint | mutation | cases | refused (rc 2, one line) | fallback | accepted | tracebacks "
        "| changed run directories |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (target, mutation), count in sorted(rows.items()):
        group = [o for o in applied if (o.case.target, o.case.mutation) == (target, mutation)]
        tally = Counter(o.kind for o in group)
        lines.append(
            f"| {target} | {mutation} | {count} | "
            + " | ".join(str(tally[k]) for k in kinds)
            + f" | {tally['traceback']} | {sum(bool(o.changed) for o in group)} |"
        )
    tally = Counter(o.kind for o in applied)
    lines.append(
        f"| all | | {len(applied)} | "
        + " | ".join(str(tally[k]) for k in kinds)
        + f" | {tally['traceback']} | {sum(bool(o.changed) for o in applied)} |"
    )
    return "\n".join(lines) + (
        f"\n\n{len(outcomes)} cases drawn, {len(applied)} applied (a mutation that does not apply to a file, "
        f"such as a JSON edit of a binary file, is drawn again as another case), {seconds:.0f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.corruption", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000, help="cases to run (drawn over every kind)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", choices=("refused", "fallback", "accepted"), help="print each case that ended so")
    parser.add_argument(
        "--runner", choices=("acceptance", "command"), default="acceptance",
        help="training cases: the launcher's acceptance in this process, or the real train --nproc 2 (ranks and all)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    from tests.helpers.trainer_runs import cli_command, train_args

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="parallel-latent-fuzz-") as scratch:
        base = Path(scratch) / "base"
        result = subprocess.run(cli_command(base, *BASE_RECIPE, nproc=2), capture_output=True, text=True, check=False)
        if result.returncode != 0:
            print(result.stdout + result.stderr, file=sys.stderr)
            return 1

        def train_argv(run_dir: Path, resume: str) -> list[str]:
            return [*train_args(run_dir, *BASE_RECIPE, f"checkpoint.resume={resume}"), "--nproc=2"]

        outcomes, failures = [], 0
        drawn = sample(all_cases(base, args.seed), args.cases, args.seed)
        for i, case in enumerate(dataclasses.replace(c, runner=args.runner) for c in drawn):
            outcome = run_case(case, base, Path(scratch) / f"case-{i}", train_argv)
            outcomes.append(outcome)
            if not outcome.ok:
                failures += 1
                print(f"FAILED {case}: {outcome.kind}, changed {outcome.changed[:3]}", *outcome.lines[-3:], sep="\n  ")
            elif args.show and outcome.applies and outcome.kind == args.show:
                print(f"{outcome.kind}: {case}", f"mutation: {outcome.done}", *outcome.lines[-2:], sep="\n  ")
    print(table(outcomes, time.perf_counter() - started))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
