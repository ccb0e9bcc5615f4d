"""The runs behind benchmarks/gpu.sh: configs/gpt2.yaml in bf16 through the real trainer (so each run
is also a smoke test of the GPU path: NCCL, bf16, DeepSpeed ZeRO, the compiled dropout kernel), one
short run per setting, then one table. Built to be run blind on a machine lent for minutes:

* first the facts (torch, CUDA, DeepSpeed, Triton, transformers, the device, a C compiler), then a
  check that the compiled dropout kernel gives the eager bits on this device for two shapes (if it
  does not, or does not compile, the runs use eager dropout and the table says so);
* NPROC is clamped to the visible GPUs; ZeRO-2 alone at DP=1 (stages 1 and 2 are the same there);
* the matrix, most informative first: dropout 0.1 / 0.0 x micro-batch 256 / 32, then
  ``training.compile=true`` at dropout 0.1, micro-batch 256 (last: compiling may take minutes); with
  more than one data-parallel rank (NPROC / TP > 1) each row runs with ``parallel.zero_overlap_comm``
  on and off (launch/README.md says why both);
* no run writes a checkpoint (``checkpoint.save_final=false``: a final save of gpt2.yaml is ~1.5 GB);
* every run has a timeout, and the whole a deadline (DEADLINE_S, default 420 s, start-up
  included): when it is hit, the table of the runs finished so far, and which ran out;
* a failed run shows the last 20 lines of its output;
* per row: tokens/s (real tokens, padding excluded), MFU, peak memory, the host-device
  synchronisations of one step after warm-up (``logging.count_syncs_at_step``:
  torch.cuda.set_sync_debug_mode), the first window's time (start-up of the step: allocator, kernel
  selection, compilation), positions/s (every position of the batch, padding included: what MFU
  counts), and what fell back to eager because compiling failed (from the run's warnings);
* beside the measured columns, the projected ones where ``benchmarks/bench_projection.py`` (its
  ``project_row(setting)``) is importable.

Environment: NPROC (1), STEPS (40), LOG_EVERY (10), DEADLINE_S (420, from gpu.sh's start: its
GPU_SH_STARTED_AT), RUN_TIMEOUT_S (180),
DROPOUTS ("0.1 0.0"), MICRO_BATCHES ("256 32"), COMPILE_ROW (1), PRETRAINED (false: a random GPT-2
of gpt2's shape; the weights do not change the cost), ALLOW_CPU (1: run on the CPU, for tests).
Arguments: --quick (a shrunk model, micro-batches 8 and 4, no compile row: the CPU test), --json
PATH, then config overrides for every run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, Report, add_common_arguments, run

# A model small enough for a CPU test of the whole script.
QUICK_OVERRIDES = [
    "model.d_model=32", "model.n_heads=2", "model.n_encoder_layers=1", "model.n_decoder_layers=1",
    "model.max_length=8", "feature_model.n_layer=3", "feature_model.n_head=2", "feature_model.n_embd=32",
    "data.max_samples=400",
]  # fmt: skip
MFU_GOALS = {256: 0.35, 32: 0.20}  # at dropout 0.1, TP=1, bf16, one H200 (the host-free step's goals)


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def print_facts() -> None:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device (CPU run)"
    compiler = next((shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    print(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), DeepSpeed {version('deepspeed')}, "
        f"Triton {version('triton')}, transformers {version('transformers')}; device: {device}; "
        f"C compiler: {compiler or 'none'}",
        flush=True,
    )


# The dropout check: several sites of one model (layer ids) at several steps and sample offsets, as
# training calls the kernel (constant keys would compile a variant training never uses).
DROPOUT_CHECK_SITES = 3
DROPOUT_CHECK_KEYS = ((7, 0), (8, 32), (9, 96))  # (step, sample_offset)
DROPOUT_CHECK_SHAPES = ((32, 64, 768), (8, 64, 3072))


def compiled_dropout_matches_eager() -> bool:
    """The compiled dropout kernel against eager, on this GPU (bits), over the sites, keys and
    shapes above."""
    import torch

    from parallel_latent.parallel import DropoutRNG, ParallelDropout

    if not torch.cuda.is_available():
        print("compiled dropout check: skipped (no CUDA device; the CPU runs dropout eagerly)", flush=True)
        return True
    started = time.perf_counter()
    eager_rng, compiled_rng = DropoutRNG(seed=3, compile_devices=()), DropoutRNG(seed=3)
    eager = [ParallelDropout(0.1, eager_rng).train() for _ in range(DROPOUT_CHECK_SITES)]
    compiled = [ParallelDropout(0.1, compiled_rng).train() for _ in range(DROPOUT_CHECK_SITES)]
    same = True
    for (step, offset), shape in itertools.product(DROPOUT_CHECK_KEYS, DROPOUT_CHECK_SHAPES):
        for rng in (eager_rng, compiled_rng):
            rng.step, rng.sample_offset = step, offset
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        same &= all(torch.equal(c(x), e(x)) for c, e in zip(compiled, eager, strict=True))
    failure = getattr(compiled_rng.kernel(torch.device("cuda")), "failure", None)
    seconds = time.perf_counter() - started
    if failure:
        print(f"compiled dropout check: compiling failed ({failure}): the runs use eager dropout", flush=True)
        return False
    checked = f"{DROPOUT_CHECK_SITES} sites x {len(DROPOUT_CHECK_KEYS)} keys x {len(DROPOUT_CHECK_SHAPES)} shapes"
    print(
        f"compiled dropout check: {'the same bits as eager' if same else 'DIFFERENT bits from eager'} for {checked} "
        f"({seconds:.0f} s with compilation){'' if same else ': the runs use eager dropout'}",
        flush=True,
    )
    return same


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def settings(compile_ok: bool, quick: bool, data_parallel: int) -> list[dict]:
    dropouts = os.environ.get("DROPOUTS", "0.1 0.0").split()
    micro_batches = os.environ.get("MICRO_BATCHES", "8 4" if quick else "256 32").split()
    pairs = itertools.product(dropouts, micro_batches)
    matrix = [{"model.dropout": d, "training.micro_batch_size": m} for d, m in pairs]
    # Compiling the blocks takes minutes on a CPU: no compile row in the CPU test unless asked. On a
    # GPU it runs last, so that a slow compilation costs only its own row.
    if os.environ.get("COMPILE_ROW", "0" if quick else "1") == "1":
        matrix.append({**matrix[0], "training.compile": "true"})
    if data_parallel > 1:  # DeepSpeed's overlapped reduction synchronises the device: measure both
        matrix = [{**s, "parallel.zero_overlap_comm": overlap} for s in matrix for overlap in ("on", "off")]
    if not compile_ok:
        for setting in matrix:
            setting["training.compile_dropout"] = "false"
    return matrix


def train_command(setting: dict, extra: list[str], run_dir: Path, nproc: int, zero_stage: int) -> list[str]:
    steps, log_every = os.environ.get("STEPS", "40"), os.environ.get("LOG_EVERY", "10")
    return [
        sys.executable, "-m", "parallel_latent", "train", "--config", "configs/gpt2.yaml", "--nproc", str(nproc),
        f"feature_model.pretrained={os.environ.get('PRETRAINED', 'false')}", "training.precision=bf16",
        f"parallel.zero_stage={zero_stage}", f"training.max_steps={steps}", f"training.log_every={log_every}",
        f"logging.count_syncs_at_step={int(log_every) + 1}", "training.eval_every=0", "checkpoint.save_every=0",
        "checkpoint.save_final=false", "checkpoint.export_portable=false", "checkpoint.resume=never",
        "logging.print_samples=0", f"logging.run_dir={run_dir}", "logging.tensorboard=false",
        "logging.progress_bar=false",
        *[f"{key}={value}" for key, value in setting.items()], *extra,
    ]  # fmt: skip


# CompiledWithFallback's warning when compiling fails and the function runs eagerly instead.
FALLBACK_WARNING = re.compile(r"torch\.compile of (?P<what>.+?) failed \((?P<why>.*)\); running it eagerly")
FALLBACK_NAMES = {"block": "blocks", "dropout": "dropout", "loss": "loss"}  # a word of `what` -> the column


def fallbacks(log_text: str) -> dict[str, str]:
    """Short name -> cause of each compiled function that fell back to eager, from a run's log."""
    found = {}
    for match in FALLBACK_WARNING.finditer(log_text):
        what = match.group("what")
        name = next((short for word, short in FALLBACK_NAMES.items() if word in what), what.split()[-1])
        found.setdefault(name, f"{what}: {match.group('why')}")
    return found


def run_one(command: list[str], run_dir: Path, timeout: float, positions_per_sample: int) -> dict:
    """One training run in its own session (so a timeout takes down its ranks too)."""
    env = dict(os.environ)
    if os.environ.get("PRETRAINED", "false") != "true":
        env.setdefault("HF_HUB_OFFLINE", "1")
    log = run_dir.with_suffix(".log")
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            status = process.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return {"timeout": True}
    if status != 0:
        return {"error": log.read_text(errors="replace").splitlines()[-20:]}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    syncs = [r for r in records if r["kind"] == "syncs"]
    steady = train[1:] or train  # the first window holds warm-up (allocator, kernel selection, compile)

    def mean(key: str) -> float:
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.mean(values) if values else float("nan")

    return {
        "steps": f"{steady[0]['step'] - steady[0]['steps_in_window'] + 1}-{steady[-1]['step']}",
        "tokens_per_s": mean("tokens_per_s"),
        "step_ms": mean("step_time_s") * 1e3,
        "mfu": mean("mfu"),
        "peak_gib": max(r["peak_memory_gb"] for r in train),
        "syncs": syncs[0]["count"] if syncs else None,
        "warmup_s": train[0]["step_time_s"] * train[0]["steps_in_window"],
        "loss": steady[-1]["loss"],
        "positions_per_s": mean("samples_per_s") * positions_per_sample,
        "fallbacks": fallbacks(log.read_text(errors="replace")),
    }


PROJECT_ROWS = (
    "import json, sys\n"
    "from bench_projection import project_row\n"
    "rows = [project_row(setting, quick=sys.argv[2] == '1') for setting in json.loads(sys.argv[1])]\n"
    "print(json.dumps(rows))\n"
)


class BackgroundProjection:
    """The projected step time and MFU of every setting (``project_row`` of
    benchmarks/bench_projection.py), computed while the GPU runs, in a process that sees no GPU: its
    DeepSpeed step runs on the CPU and must share neither this process's CUDA context nor its
    DeepSpeed accelerator, nor the runs' cores beyond a few threads."""

    def __init__(self, settings: list[dict], quick: bool):
        self.settings = settings
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "2"}
        self.process = subprocess.Popen(
            [sys.executable, "-c", PROJECT_ROWS, json.dumps(settings), "1" if quick else "0"],
            cwd=Path(__file__).resolve().parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, start_new_session=True,
        )  # fmt: skip

    def lookup(self, timeout: float):
        """``setting -> projection or None``, or None when the projection did not finish in ``timeout``
        seconds or failed (the table then shows what was measured)."""
        try:
            out, _ = self.process.communicate(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.communicate()
            print("projection: not finished within the deadline; measured columns only", flush=True)
            return None
        lines = out.strip().splitlines()
        if self.process.returncode != 0 or not lines:
            print(f"projection failed (exit {self.process.returncode}); measured columns only", flush=True)
            return None
        projected = {
            json.dumps(s, sort_keys=True): row for s, row in zip(self.settings, json.loads(lines[-1]), strict=True)
        }
        return lambda setting: projected.get(json.dumps(setting, sort_keys=True))


def start_projection(settings: list[dict], quick: bool) -> BackgroundProjection | None:
    """A :class:`BackgroundProjection` where benchmarks/bench_projection.py is importable."""
    if importlib.util.find_spec("bench_projection") is None:
        return None
    return BackgroundProjection(settings, quick)


def positions_per_sample(extra: list[str]) -> int:
    """T, the positions of one sample: every one is computed (and counted by MFU), padding or not."""
    from parallel_latent.config import load_config

    return load_config(REPO / "configs" / "gpt2.yaml", extra).model.max_length


def label(setting: dict) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in setting.items() if k != "training.compile_dropout")


def span(low: float, high: float, scale: float = 1.0) -> str:
    return f"{low * scale:.0f}-{high * scale:.0f}"


def print_table(rows: list[tuple[dict, dict]], project) -> None:
    """The measured columns (the first nine keep their places: tests and readers parse them), then
    positions/s, what fell back to eager, the ZeRO overlap setting, and the projection if any."""
    projected = ["proj ms", "proj MFU %"] if project else []
    print(f"{'dropout':>7} {'micro':>5} {'compile':>7} {'tokens/s':>12} {'step ms':>8} {'MFU %':>6} {'peak GiB':>8} "
          f"{'syncs':>5} {'warm-up s':>9} {'positions/s':>12} {'fallback':>15} {'zero_ovl':>8}"
          + "".join(f" {name:>10}" for name in projected))  # fmt: skip
    for setting, r in rows:
        cells = [
            f"{setting['model.dropout']:>7}", f"{setting['training.micro_batch_size']:>5}",
            f"{setting.get('training.compile', 'false'):>7}", f"{r['tokens_per_s']:>12,.0f}", f"{r['step_ms']:>8.1f}",
            f"{r['mfu'] * 100:>6.1f}", f"{r['peak_gib']:>8.2f}", f"{r['syncs'] if r['syncs'] is not None else '-':>5}",
            f"{r['warmup_s']:>9.1f}", f"{r['positions_per_s']:>12,.0f}", f"{','.join(r['fallbacks']) or '-':>15}",
            f"{setting.get('parallel.zero_overlap_comm', '-'):>8}",
        ]  # fmt: skip
        if project:
            p = project(setting)
            cells += [f"{span(p['step_ms_overlapped'], p['step_ms_summed']) if p else '-':>10}",
                      f"{span(p['mfu_summed'], p['mfu_overlapped'], 100) if p else '-':>10}"]  # fmt: skip
        print(" ".join(cells))
    for setting, r in rows:
        for cause in r["fallbacks"].values():
            print(f"fell back to eager in {label(setting)}: {cause}")


def body(args, report: Report) -> None:
    # From gpu.sh's start where it says when that was (its import check and install count too).
    started_ago = time.time() - float(os.environ.get("GPU_SH_STARTED_AT", time.time()))
    deadline = time.monotonic() + float(os.environ.get("DEADLINE_S", "420")) - max(0.0, started_ago)
    run_timeout = float(os.environ.get("RUN_TIMEOUT_S", "180"))
    print_facts()
    gpus = visible_gpus()
    nproc = int(os.environ.get("NPROC", "1"))
    if gpus and nproc > gpus:
        print(f"NPROC={nproc} clamped to the {gpus} visible GPU(s)", flush=True)
        nproc = gpus
    elif not gpus and os.environ.get("ALLOW_CPU") != "1":
        raise RuntimeError("no CUDA device visible (ALLOW_CPU=1 runs on the CPU)")
    extra = [*(QUICK_OVERRIDES if args.quick else []), *args.overrides]
    tp = next((int(a.split("=", 1)[1]) for a in extra if a.startswith("parallel.tensor_parallel=")), 1)
    zero_stage = 2 if nproc // tp == 1 else 1  # at DP=1 ZeRO 1 and 2 do the same; else the cheaper one
    compile_ok = compiled_dropout_matches_eager() if not args.quick else True
    positions = positions_per_sample(extra)
    rows, unfinished = [], []
    matrix = settings(compile_ok, args.quick, nproc // tp)
    projection = start_projection(matrix, args.quick)
    with tempfile.TemporaryDirectory(prefix="parallel-latent-gpu-bench.") as scratch:
        for index, setting in enumerate(matrix):
            left = deadline - time.monotonic()
            if left < 5:
                unfinished.append((setting, "not started: deadline reached"))
                continue
            run_dir = Path(scratch) / f"run{index}"
            command = train_command(setting, extra, run_dir, nproc, zero_stage)
            result = run_one(command, run_dir, min(run_timeout, left), positions)
            if "timeout" in result:
                why = "deadline" if left <= run_timeout else "RUN_TIMEOUT_S"
                unfinished.append((setting, f"ran out of time ({why}, {min(run_timeout, left):.0f} s)"))
                print(f"{label(setting)}: ran out of time", flush=True)
                continue
            if "error" in result:
                unfinished.append((setting, "failed"))
                print(f"{label(setting)}: FAILED; its last lines:", flush=True)
                print("\n".join(f"    {line}" for line in result["error"]), flush=True)
                continue
            rows.append((setting, result))
            print(
                f"{label(setting)}, steps {result['steps']}: {result['tokens_per_s']:,.0f} tokens/s "
                f"({result['positions_per_s']:,.0f} positions/s), MFU {result['mfu'] * 100:.1f}%, "
                f"peak {result['peak_gib']:.2f} GiB, syncs/step {result['syncs']}, "
                f"first window {result['warmup_s']:.1f} s"
                + (f", fell back to eager: {', '.join(result['fallbacks'])}" if result["fallbacks"] else ""),
                flush=True,
            )
    print(f"\nconfigs/gpt2.yaml, bf16, {nproc} process(es), ZeRO-{zero_stage}, dropout kernel "
          f"{'compiled' if compile_ok and gpus else 'eager'}:")  # fmt: skip
    print_table(rows, projection.lookup(deadline - time.monotonic()) if projection else None)
    for setting, why in unfinished:
        print(f"not in the table: {label(setting)}: {why}")
    for setting, r in rows:
        name = label(setting)
        micro, dropout = int(setting["training.micro_batch_size"]), float(setting["model.dropout"])
        goal = MFU_GOALS.get(micro) if dropout > 0 and gpus and not args.quick else None
        report.figure(f"tokens/s, {name}", r["tokens_per_s"], "tokens/s")
        report.figure(f"positions/s, {name}", r["positions_per_s"], "positions/s")
        report.figure(f"MFU, {name}", r["mfu"], "", at_least=goal)
        if r["syncs"] is not None:
            report.figure(f"host syncs per step, {name}", r["syncs"], "")
    if not rows:  # nothing finished: say so, but the script did its job within the deadline
        report.figure("runs finished within the deadline", 0, "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (section.key=value)")
    return run("bench_gpu", parser, body)


if __name__ == "__main__":
    sys.exit(main())
