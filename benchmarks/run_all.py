"""Run every CPU benchmark at full size, one after another, and write the page of figures the README
quotes (docs/benchmarks.md), from the JSON each script leaves in docs/benchmarks/.

    python -m benchmarks.run_all                          # everything (a few hours on 2 cores)
    python -m benchmarks.run_all --only bench_model bench_parallel   # re-run these, keep the others
    python -m benchmarks.run_all --render                 # only rewrite the page from the JSON files
    python -m benchmarks.run_all --quick --results /tmp/r --page /tmp/r/page.md   # a smoke run

Each script runs in its own process; one that fails is named on the page (its previous figures,
if any, are kept and marked with their date) and makes this script exit non-zero at the end. The
GPU table (benchmarks/gpu.sh) is run when a CUDA device is visible; otherwise its section keeps
the last GPU run's figures or says that none has run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import REPO, Spread, format_value, visible_gpus

RESULTS = REPO / "docs" / "benchmarks"
PAGE = REPO / "docs" / "benchmarks.md"
# tiny.yaml's 16 tokens in 8 latents of 32 features (16 floats a token), one process.
TINY_COMPRESSED = ["model.num_latents=8", "model.latent_dim=32", "model.predict_length=true",
                   "parallel.tensor_parallel=1"]  # fmt: skip
QUALITY = ["-m", "benchmarks.bench_quality", "--config"]

# name -> (what it measures, the command after `python`; --json is added). In page order.
BENCHMARKS: dict[str, tuple[str, list[str]]] = {
    "bench_model": ("The autoencoder at TP=1 against a plain PyTorch twin, the truncated GPT-2 against the full one, "
                    "and the host work of one training step", ["-m", "benchmarks.bench_model"]),
    "bench_parallel": ("The tensor-parallel core: TP=1 overhead, TP=2 against torch's DTensor, the frozen pass split "
                       "over TP, sequence parallelism's activation memory, the TP switches' step time",
                       ["-m", "benchmarks.bench_parallel"]),
    "bench_train": ("The trainer's step against a plain PyTorch loop; trainable-part memory per rank at TP2 x DP2 "
                    "ZeRO-2", ["-m", "benchmarks.bench_train"]),
    "bench_checkpoint": ("Portable safetensors checkpoints against torch.save, and the training loop's stall per "
                         "training checkpoint written in the background against a synchronous one, configs/gpt2.yaml's "
                         "model", ["-m", "benchmarks.bench_checkpoint"]),
    "bench_restart": ("A job that heals itself: configs/tiny.yaml under train --nproc 2 --max-restarts 1, one rank "
                      "killed mid-run, the time from the kill to the first step after it",
                      ["-m", "benchmarks.bench_restart"]),
    "bench_data": ("Preparing a corpus, random batches from the prepared copy, time and memory to the first step at "
                   "10M lines", ["-m", "benchmarks.bench_data"]),
    "bench_feature_cache": ("The feature cache: configs/smollm2.yaml's step on a warm cache against the frozen "
                            "decoder's, the cache's build, a reader's private memory at 10x the corpus",
                            ["-m", "benchmarks.bench_feature_cache"]),
    "bench_export": ("encode-corpus on configs/tiny.yaml's model: export / bare encode throughput, peak RSS against "
                     "the corpus size, a rerun after a kill at 50%", ["-m", "benchmarks.bench_export"]),
    "bench_projection": ("configs/gpt2.yaml's whole step on one H200, projected (the model traced on the meta device, "
                         "the rest of the step, DeepSpeed's included, from a real CPU step; pinned roofline: 989 "
                         "TFLOP/s MFU peak, matmuls at 700/593 TFLOP/s, 4.0 TB/s, at least 2 us per kernel, 5 us per "
                         "eager launch); goals on the overlapped MFU at dropout 0.1 and on DeepSpeed's kernels and the "
                         "hook calls per step", ["-m", "benchmarks.bench_projection"]),
    "bench_feature_models": ("The frozen feature model at realistic sizes (GPT-2, Pythia, Llama, Mistral, Qwen; built "
                             "on the meta device from their published configs): bytes per rank and the frozen pass's "
                             "projected time per rank, replicated against sharded over the TP group, at TP 1/2/4/8",
                             ["-m", "benchmarks.bench_feature_models"]),
    "quality_tiny": ("Held-out reconstruction of configs/tiny.yaml (the README's first command) over seeds 1-20",
                     [*QUALITY, "configs/tiny.yaml", "--seeds", *(str(s) for s in range(1, 21))]),
    "quality_small": ("Held-out reconstruction of configs/small.yaml over three seeds",
                      [*QUALITY, "configs/small.yaml", "--seeds", "1", "2", "1234"]),
    "quality_smollm2": ("Held-out and out-of-domain reconstruction over the real pretrained SmolLM2-135M "
                        "(configs/smollm2.yaml, on the feature cache its first seed builds) over three seeds",
                        [*QUALITY, "configs/smollm2.yaml", "--seeds", "1", "2", "3", "--out-of-domain"]),
    "quality_tiny_compressed": ("configs/tiny.yaml with 8 latents of 32 features for its 16 tokens (16 floats per "
                                "token), one process, over seeds 1-10, with the per-position accuracy: the lookup "
                                "start with fewer latents than positions",
                                [*QUALITY, "configs/tiny.yaml", "--nproc", "1", *TINY_COMPRESSED,  # before --seeds,
                                 "--seeds", *(str(s) for s in range(1, 11))]),  # which would take them for seeds
    "bench_readout": ("What limits narrow latents, without training: a k-dimensional code of a token read back over "
                      "the whole vocabulary by the tied head's inner product and by the nearest head's nearest "
                      "normalised code, and how much of a token a k-dimensional linear map of the frozen GPT-2's "
                      "features holds", ["-m", "benchmarks.bench_readout"]),
    "quality_frontier": ("The compression frontier: configs/compressed.yaml and its points (N latents x k features "
                         "for T = 32 tokens), each over the seeds its command names: held-out BLEU, exact match, BLEU "
                         "under noise, length accuracy, out-of-domain BLEU, wall time",
                         ["-m", "benchmarks.bench_frontier"]),
}  # fmt: skip

GPU = "gpu"
GPU_TITLE = "configs/gpt2.yaml on one GPU, bf16, through the real trainer (benchmarks/gpu.sh)"
NO_GPU_RUN = ("no GPU run has been recorded: the development machines have no GPU, and no session that was lent one "
              "has run `benchmarks/gpu.sh --json docs/benchmarks/gpu.json` yet.")  # fmt: skip


def run_benchmark(name: str, results: Path, quick: bool) -> bool:
    command = ["bash", "benchmarks/gpu.sh"] if name == GPU else [sys.executable, *BENCHMARKS[name][1]]
    command += ["--json", str(results / f"{name}.json"), *(["--quick"] if quick else [])]
    print(f"== {name}: {' '.join(command)}", flush=True)
    started = time.perf_counter()
    status = subprocess.run(command, cwd=REPO, check=False).returncode
    print(f"== {name}: exit {status} after {time.perf_counter() - started:.0f} s", flush=True)
    return status == 0


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def value_cell(figure: dict) -> str:
    value = f"{format_value(figure['value'])} {figure['unit']}".strip()
    return f"{value} ({Spread(**figure['spread']).words()})" if figure.get("spread") else value


def render_section(results: Path, name: str, title: str, failed: set[str], missing_reason: str) -> list[str]:
    path = results / f"{name}.json"
    if not path.exists():
        return [f"## {title}", "", f"Not measured: {missing_reason}", ""]
    record = json.loads(path.read_text())
    machine = record.get("machine", {})
    where = ", ".join(f"{k} {v}" for k, v in machine.items() if k not in ("cpu", "cores"))
    quick = " (quick mode: tiny shapes, not a measurement)" if record.get("quick") else ""
    when = f"`{record['command']}`: {record['date']}, {machine.get('cpu', '?')} ({machine.get('cores', '?')} cores)"
    lines = [f"## {title}", "", f"{when}, {where}{quick}", ""]
    if name in failed:
        lines += ["**The last run of this benchmark failed; the figures below are from the run dated above.**", ""]
    lines += ["| figure | value | goal | met |", "| --- | --- | --- | --- |"]
    for figure in record["figures"]:
        met = "" if figure["met"] is None else ("yes" if figure["met"] else "**no**")
        lines.append(f"| {_cell(figure['name'])} | {value_cell(figure)} | {_cell(figure['goal'])} | {met} |")
    return [*lines, ""]


def render_page(results: Path, failed: set[str] = frozenset()) -> str:
    """The page, from whatever JSON files ``results`` holds (pure: no benchmark is run)."""
    lines = ["# Benchmark figures", "",
             "Written by `python -m benchmarks.run_all` from the JSON files in `docs/benchmarks/` (one per script; "
             "`--only NAME` re-runs one, `--render` rewrites this page). A timing is a ratio against a baseline run "
             "in the same process, one repeat of each in turn: the median of the per-repeat ratios, then in brackets "
             "their min-max, the ratio of CPU time (steadier than wall time on a shared machine), the load average "
             'while it ran, and "unstable" where the two halves of the repeats still disagreed by more than 2.5% on '
             "the median after the most repeats the script allows (it repeats until they agree). A goal not met "
             "is reported here, not hidden. Each section names the command, date and machine of its figures.",
             ""]  # fmt: skip
    for name, (title, _) in BENCHMARKS.items():
        lines += render_section(results, name, title, failed, "the script has not been run on this page yet")
    lines += render_section(results, GPU, GPU_TITLE, failed, NO_GPU_RUN)
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=[*BENCHMARKS, GPU], default=None, help="run just these")
    parser.add_argument("--render", action="store_true", help="run nothing; rewrite the page from the JSON files")
    parser.add_argument("--quick", action="store_true", help="every script in its quick mode (a smoke run)")
    parser.add_argument("--results", default=str(RESULTS), help="where the JSON files go")
    parser.add_argument("--page", default=str(PAGE), help="the page to write")
    args = parser.parse_args()
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    names = [] if args.render else args.only or [*BENCHMARKS, *([GPU] if visible_gpus() else [])]
    failed = {name for name in names if not run_benchmark(name, results, args.quick)}
    Path(args.page).write_text(render_page(results, failed))
    print(f"wrote {args.page}" + (f"; FAILED: {', '.join(sorted(failed))}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
