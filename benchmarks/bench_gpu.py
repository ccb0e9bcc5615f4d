"""The runs behind benchmarks/gpu.sh (docs/development.md, On a GPU): configs/gpt2.yaml in bf16 through
the real trainer, one short run per row of the performance model's matrix, then ``encode-corpus``, each
within its own timeout inside the deadline; one table; then, if time is left, the rows' projection in a
process that sees no GPU. NPROC is clamped to the visible GPUs; ZeRO-2 at DP=1, ZeRO-1 beyond.

Environment: NPROC (1), STEPS (40), LOG_EVERY (10), DEADLINE_S (480, from gpu.sh's start: its
GPU_SH_STARTED_AT), ROWS (names of :data:`ROWS`, all by default), PRETRAINED (false: a random GPT-2
of gpt2's shape), ALLOW_CPU (1: run on the CPU, for tests), GPU_TESTS_XML (the GPU tests' junit file:
if the compiled dropout kernel failed there, the rows run eager dropout), PROJECTION (1; 0: none).
Arguments: --quick (a shrunk model, micro-batches 8 and 4, the CPU's timeouts), --json PATH, then
config overrides for every run.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from benchmarks.gpu_table import print_table, report_rows, training_row
from benchmarks.harness import GPT2, QUIET_RUN, REPO, SMALLEST, Report, command, visible_gpus
from benchmarks.processes import child_environment
from benchmarks.step_projection import matrix, setting_label
from parallel_latent.config import load_config

# name -> (timeout s on a GPU, on a CPU with --quick): the performance model's rows (its matrix, their
# settings and goals), then the export. On a GPU the timeouts (350 s) leave the deadline's other
# 130 s to an install (60 s) and the GPU tests (GPU_TESTS_S, 60 s); a CPU compiles slowly.
ROWS = {"default": (55, 120), "compile": (120, 300), "micro32": (40, 120), "dropout0": (40, 120),
        "dropout0 micro32": (35, 120), "encode-corpus": (60, 120)}  # fmt: skip
DROPOUT_TEST = "test_on_cuda_the_compiled_mask_kernel_gives_the_eager_bits"
PROFILE_STEP = 2  # in the first window: the profiler's overhead stays out of the steady ones


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def compiled_dropout_passed(junit: str | None) -> bool | None:
    """The GPU tests' verdict on the compiled dropout kernel (None: not run, or no such file)."""
    if not junit or not Path(junit).is_file():
        return None
    case = next((c for c in ElementTree.parse(junit).iter("testcase") if c.get("name") == DROPOUT_TEST), None)
    if case is None or case.find("skipped") is not None:
        return None
    return case.find("failure") is None and case.find("error") is None


def chosen_rows(quick: bool, compile_dropout: bool) -> list[tuple[str, dict, float]]:
    """(name, setting, timeout) of the rows to run, in their order."""
    names = os.environ.get("ROWS", "").split(",") if os.environ.get("ROWS") else list(ROWS)
    if unknown := [n for n in names if n not in ROWS]:
        raise SystemExit(f"bench_gpu: ROWS names {', '.join(unknown)}: expected some of {', '.join(ROWS)}")
    settings = {name: setting for name, setting, _ in matrix(quick)}
    eager = {} if compile_dropout else {"training.compile_dropout": "false"}
    return [(name, {**settings.get(name, {}), **(eager if name != "encode-corpus" else {})}, ROWS[name][quick])
            for name in names]  # fmt: skip


def run_process(command: list[str], log: Path, timeout: float, done=lambda: True) -> dict | None:
    """``command`` in its own session (a timeout takes down its ranks too), its output in ``log``: None if it
    exits 0 and ``done()``, else the row's outcome: timed out, or failed with its last 20 lines."""
    env = child_environment()
    if os.environ.get("PRETRAINED", "false") != "true":
        env.setdefault("HF_HUB_OFFLINE", "1")
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            status = process.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return {"timeout": True}
    return None if status == 0 and done() else {"error": log.read_text(errors="replace").splitlines()[-20:]}


def run_training(setting: dict, extra: list[str], run_dir: Path, timeout: float, context: dict) -> dict:
    steps, log_every = os.environ.get("STEPS", "40"), os.environ.get("LOG_EVERY", "10")
    nproc, zero_stage = context["nproc"], context["zero_stage"]
    command = [sys.executable, "-m", "parallel_latent", "train", "--config", "configs/gpt2.yaml", "--nproc", str(nproc),
               f"feature_model.pretrained={os.environ.get('PRETRAINED', 'false')}", "training.precision=bf16",
               f"parallel.zero_stage={zero_stage}", f"training.max_steps={steps}", f"training.log_every={log_every}",
               f"logging.count_syncs_at_step={int(log_every) + 1}", f"logging.profile_kernels_at_step={PROFILE_STEP}",
               *QUIET_RUN, "checkpoint.save_final=false", "logging.print_samples=0", f"logging.run_dir={run_dir}",
               *[f"{key}={value}" for key, value in setting.items()], *extra]  # fmt: skip
    log = run_dir.with_suffix(".log")
    if failed := run_process(command, log, timeout):
        return failed
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return training_row(records, log.read_text(errors="replace"), context["positions"])


def run_export(run_dir: Path, timeout: float, context: dict) -> dict:
    """benchmarks/bench_export.py's throughput part on this device: export / bare encode samples/s."""
    device, figures = "cuda" if context["gpus"] else "cpu", run_dir.with_suffix(".json")
    lines, shard, config = ("500", "64", "tiny") if context["quick"] else ("20000", "2048", "gpt2")
    command = [sys.executable, "-m", "benchmarks.bench_export", "--throughput-only", "--device", device, "--config",
               f"configs/{config}.yaml", "--lines", lines, "--shard-size", shard, "--repeats", "1", "--json",
               str(figures)]  # fmt: skip
    if failed := run_process(command, run_dir.with_suffix(".log"), timeout, done=figures.is_file):
        return failed
    values = {f["name"]: f["value"] for f in json.loads(figures.read_text())["figures"]}
    return {"export samples/s": values["export samples/s"], "bare samples/s": values["bare encode samples/s"],
            "ratio": values["export / bare encode loop, samples per second"]}  # fmt: skip


PROJECT_ROWS = ("import json, sys\nfrom benchmarks.step_projection import project_row\n"
                "rows = {name: project_row(setting, quick=sys.argv[2] == '1') for name, setting in "
                "json.loads(sys.argv[1])}\nprint(json.dumps(rows))\n")  # fmt: skip


def projection_after(rows: list[tuple[str, dict, dict]], quick: bool, seconds: float) -> dict:
    """name -> projected step and MFU per training row, by a process that sees no GPU, in ``seconds``; else {}."""
    if os.environ.get("PROJECTION", "1") != "1":
        return {}
    if seconds < 30:
        print(f"projection: skipped ({seconds:.0f} s left; python -m benchmarks.bench_projection on any CPU)")
        return {}
    settings = [(name, {k: v for k, v in s.items() if k != "training.compile_dropout"})
                for name, s, _ in rows if name != "encode-corpus"]  # fmt: skip
    env = child_environment(cpu=True, CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-c", PROJECT_ROWS, json.dumps(settings), "1" if quick else "0"]
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=seconds, check=False)
    except subprocess.TimeoutExpired:
        print(f"projection: not finished in the {seconds:.0f} s left; measured columns only")
        return {}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        print(f"projection failed (exit {done.returncode}); measured columns only")
        return {}
    return {name: row for name, row in json.loads(lines[-1]).items() if row}


def run_rows(planned, extra, deadline: float, context: dict):
    """Each row within its timeout or what is left of the deadline; (finished rows, unfinished)."""
    rows, unfinished = [], []
    budget = sum(timeout for *_, timeout in planned)
    print(f"rows: {', '.join(n for n, *_ in planned)}; timeouts {budget:.0f} s in all, "
          f"{deadline - time.monotonic():.0f} s left of the deadline", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="parallel-latent-gpu-bench.") as scratch:
        for index, (name, setting, timeout) in enumerate(planned):
            left = deadline - time.monotonic()
            if left < 5:
                unfinished.append((name, "not started: deadline reached"))
                continue
            run_dir, limit = Path(scratch) / f"row{index}", min(timeout, left)
            result = (run_export(run_dir, limit, context) if name == "encode-corpus"
                      else run_training(setting, extra, run_dir, limit, context))  # fmt: skip
            if "timeout" in result:
                unfinished.append((name, f"ran out of time ({'its timeout' if limit == timeout else 'deadline'}, "
                                         f"{limit:.0f} s)"))  # fmt: skip
                print(f"{name}: ran out of time", flush=True)
            elif "error" in result:
                unfinished.append((name, "failed"))
                print(f"{name}: FAILED; its last lines:\n" + "\n".join(f"    {line}" for line in result["error"]))
            else:
                rows.append((name, setting, result))
                shown = {k: v for k, v in result.items() if k != "fallbacks"}
                print(f"{name} ({setting_label(setting)}): {json.dumps(shown)}", flush=True)
    return rows, unfinished


def body(args, report: Report) -> None:
    # From gpu.sh's start where it says when that was (its install, import check and tests count too).
    started_ago = time.time() - float(os.environ.get("GPU_SH_STARTED_AT", time.time()))
    deadline = time.monotonic() + float(os.environ.get("DEADLINE_S", "480")) - max(0.0, started_ago)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device (CPU run)"
    compiler = next((shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), DeepSpeed {version('deepspeed')}, "
          f"Triton {version('triton')}, transformers {version('transformers')}; device: {device}; "
          f"C compiler: {compiler or 'none'}", flush=True)  # fmt: skip
    gpus, nproc = visible_gpus(), int(os.environ.get("NPROC", "1"))
    if gpus and nproc > gpus:
        print(f"NPROC={nproc} clamped to the {gpus} visible GPU(s)", flush=True)
        nproc = gpus
    elif not gpus and os.environ.get("ALLOW_CPU") != "1":
        raise RuntimeError("no CUDA device visible (ALLOW_CPU=1 runs on the CPU)")
    extra = [*(SMALLEST if args.quick else []), *args.overrides]
    tp = next((int(a.split("=", 1)[1]) for a in extra if a.startswith("parallel.tensor_parallel=")), 1)
    verdict = compiled_dropout_passed(os.environ.get("GPU_TESTS_XML"))
    if verdict is False:
        print("the compiled dropout kernel failed its GPU test: the rows run eager dropout", flush=True)
    # positions: T, those of one sample: every one is computed (and counted by MFU), padding or not.
    context = {"nproc": nproc, "zero_stage": 2 if nproc // tp == 1 else 1, "gpus": gpus, "quick": args.quick,
               "positions": load_config(GPT2, extra).model.max_length}  # fmt: skip
    planned = chosen_rows(args.quick, compile_dropout=verdict is not False)
    rows, unfinished = run_rows(planned, extra, deadline, context)
    projected = projection_after(rows, args.quick, deadline - time.monotonic() - 5)
    dropout = "compiled" if verdict is not False and gpus else "eager"
    print(f"\nconfigs/gpt2.yaml, bf16, {nproc} process(es), ZeRO-{context['zero_stage']}, dropout kernel {dropout}:")
    print_table(rows, projected)
    for name, why in unfinished:
        print(f"not in the table: {name}: {why}")
    report_rows(rows, report, gpus, args.quick)
    if not rows:  # nothing finished: say so, but the script did its job within the deadline
        report.figure("runs finished within the deadline", 0, "")


def arguments(parser) -> None:
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (section.key=value)")


main = command("bench_gpu", __doc__, body, arguments, __name__)
