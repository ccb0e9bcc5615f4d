"""What benchmarks/gpu.sh's rows report (benchmarks/bench_gpu.py runs them): a finished training row's
figures from its metrics records and its log, the table, and the figures."""

from __future__ import annotations

import re
import statistics

from benchmarks.harness import Report
from benchmarks.performance import MFU_GOALS
from benchmarks.step_projection import setting_label

EXPORT_GOAL = 0.9  # export / bare encode loop samples/s

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


def attention_kernels(names: dict) -> str:
    """The SDPA backends among a step's attention kernel names."""
    kinds = {"fmha": "efficient", "flash": "flash", "cudnn": "cudnn"}
    found = sorted({kind for name in names for word, kind in kinds.items() if word in name.lower()})
    return "+".join(found) or ("math" if names else "-")


def training_row(records: list[dict], log_text: str, positions_per_sample: int) -> dict:
    """A training row's figures from its metrics.jsonl records."""
    train, first_of_kind = [r for r in records if r["kind"] == "train"], {r["kind"]: r for r in reversed(records)}
    first, syncs, kernels = (first_of_kind.get(kind) for kind in ("first_step", "syncs", "kernels"))
    steady = train[1:] or train  # the first window holds the first step (allocator, kernel selection, compile)

    def mean(key: str) -> float:
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.mean(values) if values else float("nan")

    return {
        "steps": f"{steady[0]['step'] - steady[0]['steps_in_window'] + 1}-{steady[-1]['step']}",
        "tokens_per_s": mean("tokens_per_s"), "step_ms": mean("step_time_s") * 1e3, "mfu": mean("mfu"),
        "peak_gib": max(r["peak_memory_gb"] for r in train), "syncs": syncs["count"] if syncs else None,
        "kernels": kernels["count"] if kernels else None,
        "attention": attention_kernels(kernels["attention"]) if kernels else "-",
        "first_step_s": first["seconds"] if first else float("nan"),
        "startup_s": first["since_start_s"] - first["seconds"] if first else float("nan"), "loss": steady[-1]["loss"],
        "positions_per_s": mean("samples_per_s") * positions_per_sample, "fallbacks": fallbacks(log_text),
    }  # fmt: skip


def print_table(rows: list[tuple[str, dict, dict]], projected: dict) -> None:
    """The training rows (tests and readers parse the first three columns: they keep their places), then export."""
    print(f"{'dropout':>7} {'micro':>5} {'compile':>7} {'tokens/s':>12} {'step ms':>8} {'MFU %':>6} "
          f"{'peak GiB':>8} {'syncs':>5} {'kernels':>7} {'start-up s':>10} {'1st step s':>10} "
          f"{'attention':>10} {'fallback':>12} {'proj ms':>8} {'proj MFU %':>10}")  # fmt: skip
    for name, setting, r in [row for row in rows if row[0] != "encode-corpus"]:
        p = projected.get(name)
        cells = [
            f"{setting['model.dropout']:>7}", f"{setting['training.micro_batch_size']:>5}",
            f"{setting.get('training.compile', 'false'):>7}", f"{r['tokens_per_s']:>12,.0f}", f"{r['step_ms']:>8.1f}",
            f"{r['mfu'] * 100:>6.1f}", f"{r['peak_gib']:>8.2f}", f"{r['syncs'] if r['syncs'] is not None else '-':>5}",
            f"{r['kernels'] if r['kernels'] is not None else '-':>7}", f"{r['startup_s']:>10.1f}",
            f"{r['first_step_s']:>10.1f}", f"{r['attention']:>10}", f"{','.join(r['fallbacks']) or '-':>12}",
            f"{p['step_ms_overlapped'] if p else float('nan'):>8.1f}",
            f"{p['mfu_overlapped'] * 100 if p else float('nan'):>10.1f}",
        ]  # fmt: skip
        print(" ".join(cells))
    for name, _, r in rows:
        if name == "encode-corpus":
            print(f"encode-corpus: export {r['export samples/s']:,.0f} samples/s, bare encode loop "
                  f"{r['bare samples/s']:,.0f} samples/s: {r['ratio']:.3f}x")  # fmt: skip
    for _, setting, r in rows:
        for cause in r.get("fallbacks", {}).values():
            print(f"fell back to eager in {setting_label(setting)}: {cause}")


def report_rows(rows, report: Report, gpus: int, quick: bool) -> None:
    for name, _, r in rows:
        if name == "encode-corpus":
            goal = EXPORT_GOAL if gpus and not quick else None
            report.figure("encode-corpus export / bare encode loop", r["ratio"], "x", at_least=goal)
            report.figure("encode-corpus export samples/s", r["export samples/s"], "samples/s")
            continue
        goal = MFU_GOALS.get(name) if gpus and not quick else None
        for label, key, unit in (("tokens/s", "tokens_per_s", "tokens/s"), ("MFU", "mfu", ""),
                                 ("steady step", "step_ms", "ms"), ("first step", "first_step_s", "s"),
                                 ("start-up to the first step", "startup_s", "s"), ("host syncs per step", "syncs", ""),
                                 ("kernels per step", "kernels", "")):  # fmt: skip
            if r[key] is not None:
                report.figure(f"{label}, {name}", r[key], unit, at_least=goal if key == "mfu" else None)
