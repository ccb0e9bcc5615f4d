"""The H200 step of configs/gpt2.yaml, projected on a CPU for each row of benchmarks/gpu.sh's matrix: one
``Trainer.train_step`` traced (the model on the meta device, the rest of the step from a real CPU step),
every operator charged with the kernels CUDA launches for it, then the performance model's pinned
roofline. ``--feature-model NAME`` (a decoder of benchmarks/published_decoders.py's MODELS): the rows'
model over that decoder, its frozen pass per TP degree and layout, and one rank's whole step at each.
The method in full: docs/development.md, Benchmarks.

Usage: python -m benchmarks.bench_projection [--quick] [--feature-model NAME] [--json PATH]
"""

from __future__ import annotations

from collections import defaultdict

from benchmarks import published_decoders
from benchmarks.harness import Report, command
from benchmarks.meta_trace import row_config
from benchmarks.performance import ASSUMPTIONS, DEEPSPEED_KERNEL_GOALS, HOOK_CALL_GOAL, PINNED, kernels_of, projection
from benchmarks.step_projection import matrix, project, rest_of_step, setting_label


def report_deepspeed(args, report: Report) -> None:
    """DeepSpeed's kernels per step at DP 1 and 2, the step's host syncs and Python hook calls."""
    for data_parallel in (1, 2):
        rest, hooks = rest_of_step(args.quick, data_parallel)
        ours = [op for op in rest if op.part in ("deepspeed backward", "optimizer")]
        counted = projection(kernels_of(ours), 0.0)
        backward = len(kernels_of([op for op in ours if op.part == "deepspeed backward"]))
        syncs = sum(op.name.startswith("aten._local_scalar_dense") for op in rest)
        print(f"DeepSpeed at DP={data_parallel} (ZeRO-2 bf16, counted on the CPU): {counted['kernels']} kernels "
              f"({backward} in backward, {counted['kernels'] - backward} in its step), {counted['device_ms']:.2f} ms "
              f"device + {counted['launch_ms']:.2f} ms launches; the step: {syncs} host syncs, "
              f"{hooks} Python hook calls")  # fmt: skip
        goal = None if args.quick else DEEPSPEED_KERNEL_GOALS[data_parallel]
        report.figure(f"DeepSpeed kernels per step, DP={data_parallel}", counted["kernels"], at_most=goal)
        report.figure(f"DeepSpeed kernels in backward, DP={data_parallel}", backward)
        report.figure(f"DeepSpeed device + launch per step, DP={data_parallel}",
                      counted["device_ms"] + counted["launch_ms"], "ms")  # fmt: skip
        report.figure(f"host synchronisations per step, DP={data_parallel}", syncs)
        report.figure(f"Python hook calls per step, DP={data_parallel}", hooks, at_most=HOOK_CALL_GOAL)


def sensitivity_table(results: dict[str, dict]) -> list[str]:
    """Per row, the MFU each assumption takes from the pinned one at its pessimistic value; then the largest."""
    header = f"{'row':18s} {'pinned':>7s} " + " ".join(f"{a:>12s}" for a in [*ASSUMPTIONS, "all"])
    lines = ["", "Sensitivity: points of MFU (overlapped) lost when one assumption is pessimistic", header]
    largest = []
    for name, result in results.items():
        pinned = result["mfu_overlapped"]
        lost = {a: pinned - result["ranges"][a]["mfu_overlapped"] for a in [*ASSUMPTIONS, "pessimistic"]}
        lines.append(f"{name:18s} {pinned * 100:6.1f}% " + " ".join(f"{x * 100:12.1f}" for x in lost.values()))
        largest.append(f"{name}: the {max(ASSUMPTIONS, key=lost.get)}")
    return [*lines, "The largest uncertainty, by row: " + "; ".join(largest)]


def report_whole_steps(name: str, row: str, setting: dict, steps: list[dict], report: Report) -> None:
    print(f"\n{name}, {setting_label(setting)}: the whole step per rank (forward and backward, the optimizer left "
          "out): the Perceiver, its TP collectives and the frozen pass, one after the other")  # fmt: skip
    print(f"{'TP':>3} {'layout':>9} {'Perceiver ms':>12} {'matmul ms':>9} {'collectives':>24} {'frozen ms':>9} "
          f"{'step ms':>8} {'tokens/s per rank':>17} {'MFU per rank':>12}")  # fmt: skip
    for step in steps:
        tp, layout = step["tp"], step["layout"]
        if "refused" in step:
            print(f"{tp:>3} {layout:>9} refused: {step['refused']}")
            continue
        ours = step["perceiver"]
        collectives = f"{len(ours['collectives'])} x, {sum(b for _, b in ours['collectives']) / 2**20:.0f} MiB, "
        collectives += f"{ours['collective_ms']:.2f} ms"
        print(f"{tp:>3} {layout:>9} {ours['compute']['step_ms_overlapped']:>12.2f} {ours['matmul_ms']:>9.2f} "
              f"{collectives:>24} {step['frozen_ms']:>9.2f} {step['step_ms']:>8.2f} {step['tokens_per_s']:>17,.0f} "
              f"{step['mfu'] * 100:>11.1f}%")  # fmt: skip
    for step in [s for s in steps if "refused" not in s]:
        where = f"{step['layout']}, TP={step['tp']}, {row}"
        report.figure(f"{name}: whole step per rank, {where}", step["step_ms"], "ms")
        report.figure(f"{name}: tokens/s per rank, whole step, {where}", step["tokens_per_s"], "tokens/s")
        report.figure(f"{name}: MFU per rank, whole step, {where}", step["mfu"])
        if step["layout"] == "replicate":  # the Perceiver's own figures, the same in both layouts
            ours, where = step["perceiver"], f"TP={step['tp']}, {row}"
            report.figure(f"{name}: Perceiver TP collectives per step, {where}", len(ours["collectives"]))
            report.figure(f"{name}: Perceiver TP collective bytes per step, {where}",
                          sum(b for _, b in ours["collectives"]) / 2**20, "MiB")  # fmt: skip


def feature_model_body(args, report: Report) -> None:
    name = args.feature_model
    extra, recorded = published_decoders.feature_model_setting(name), published_decoders.feature_model_record(name)
    rows = [(row, setting) for row, setting, _ in matrix(args.quick) if row in ("default", "micro32")]
    held, length = published_decoders.held_on_meta(name), row_config({}, args.quick).model.max_length
    for row, setting in rows:
        result = project({**setting, **extra}, args.quick, rest=False, recorded=recorded)
        traced = sum(k.device_s for k in result["kernel_list"] if k.part == "features") * 1e3
        micro = int(setting["training.micro_batch_size"])
        roofline = published_decoders.frozen_seconds(held, 1, "replicate", micro, length) * 1e3
        print(f"{name}, {setting_label(setting)}: model alone {result['step_ms_overlapped']:.1f} ms, MFU "
              f"{result['mfu_overlapped'] * 100:.1f}%; traced / model FLOPs "
              f"{result['traced_flops'] / result['model_flops']:.4f}; its frozen pass as traced {traced:.1f} ms "
              f"of device time (bench_feature_models' roofline, no elementwise work: {roofline:.1f} ms)")  # fmt: skip
        report.figure(f"{name}: projected MFU overlapped, model alone, {row}", result["mfu_overlapped"])
        report.figure(f"{name}: traced / model FLOPs, {row}", result["traced_flops"] / result["model_flops"], "x")
        report.figure(f"{name}: frozen pass as traced at TP=1, device, {row}", traced, "ms")
    micro = int(rows[0][1]["training.micro_batch_size"])
    for layout, tp, refusal, gib, ms in published_decoders.frozen_rows(held, micro, length):
        if refusal:
            print(f"{name}, frozen pass at TP={tp}, shard: refused ({refusal})")
            continue
        print(f"{name}, frozen pass at TP={tp}, {layout}: {ms:.2f} ms, {gib:.2f} GiB per rank")
        report.figure(f"{name}: frozen pass per rank, {layout}, TP={tp}", ms, "ms")
    for row, setting in rows:
        report_whole_steps(name, row, setting, published_decoders.whole_steps(name, setting, args.quick), report)


def report_cache_rows(result: dict, report: Report) -> None:
    """What the feature cache saves where the frozen decoder is 10x and 50x the trainable model: the row's
    step less its traced frozen pass, against that plus a frozen pass of so many times the trainable
    forward's FLOPs (a third of the traced rest) at the traced frozen pass's FLOPs per device second."""
    frozen = [k for k in result["kernel_list"] if k.part == "features"]
    frozen_ms, frozen_flops = sum(k.device_s for k in frozen) * 1e3, sum(k.flops for k in frozen)
    trainable = sum(k.flops for k in result["kernel_list"] if k.part != "features") / 3
    rest_ms = result["step_ms_overlapped"] - frozen_ms
    for factor in (10, 50):
        saved = (rest_ms + factor * trainable * frozen_ms / frozen_flops) / rest_ms
        print(f"    a frozen decoder {factor}x the trainable model: step without / with the feature cache {saved:.1f}x")
        report.figure(f"projected step, frozen decoder {factor}x the trainable model, no cache / cache", saved, "x")


def body(args, report: Report) -> None:
    if args.feature_model:
        return feature_model_body(args, report)
    report_deepspeed(args, report)
    results = {}
    for name, setting, goal in matrix(args.quick):
        result = results[name] = project(setting, args.quick)
        loss = [k for k in result["kernel_list"] if k.part == "loss"]
        loss_ms = sum(k.device_s + PINNED.launch_s for k in loss) * 1e3
        phases = defaultdict(float)
        for k in result["kernel_list"]:
            phases["matmul" if k.flops else "memory-bound"] += k.device_s * 1e3
        print(f"\n{setting_label(setting)}: {result['step_ms_overlapped']:.1f}-{result['step_ms_summed']:.1f} ms "
              f"(overlapped-summed), MFU {result['mfu_overlapped'] * 100:.1f}-{result['mfu_summed'] * 100:.1f}%; "
              f"{result['kernels']:,} kernels, device {result['device_ms']:.1f} ms ("
              f"{', '.join(f'{kind} {ms:.1f} ms' for kind, ms in sorted(phases.items()))}), launches "
              f"{result['launch_ms']:.1f} ms; traced / model FLOPs {result['traced_flops'] / result['model_flops']:.4f}"
              f"; the loss {loss_ms:.2f} ms in {len(loss)} kernels")  # fmt: skip
        for cost_label, ms, count in result["top"]:
            print(f"    {ms:8.2f} ms  {count:5d} x {cost_label}")
        quick_goal = None if args.quick else goal
        report.figure(f"projected MFU overlapped, {name}", result["mfu_overlapped"], at_least=quick_goal)
        report.figure(f"projected MFU summed, {name}", result["mfu_summed"])
        # The same trace timed again by the pessimistic roofline, and with each assumption pessimistic alone.
        ranges = result["ranges"]
        print(f"    MFU overlapped: pinned {result['mfu_overlapped'] * 100:.1f}%, pessimistic "
              f"{ranges['pessimistic']['mfu_overlapped'] * 100:.1f}%; one assumption pessimistic alone: "
              + ", ".join(f"{a} {ranges[a]['mfu_overlapped'] * 100:.1f}%" for a in ASSUMPTIONS))  # fmt: skip
        report.figure(f"projected MFU overlapped, pessimistic, {name}", ranges["pessimistic"]["mfu_overlapped"])
        report.figure(f"projected MFU summed, pessimistic, {name}", ranges["pessimistic"]["mfu_summed"])
        for assumption in ASSUMPTIONS:
            report.figure(f"projected MFU overlapped, {assumption} pessimistic alone, {name}",
                          ranges[assumption]["mfu_overlapped"])  # fmt: skip
        report.figure(f"projected step overlapped, {name}", result["step_ms_overlapped"], "ms")
        report.figure(f"projected step summed, {name}", result["step_ms_summed"], "ms")
        report.figure(f"kernels per step, {name}", result["kernels"])
        report.figure(f"traced / model FLOPs, {name}", result["traced_flops"] / result["model_flops"], "x")
        report.figure(f"the loss, device + launch, {name}", loss_ms, "ms")
        if name == "default":
            report_cache_rows(result, report)
        if name in ("default", "compile", "micro32"):  # the goals' rows' top ten on the page (all printed above)
            for rank, (cost_label, ms, count) in enumerate(result["top"], 1):
                report.figure(f"top cost {rank}, {name}: {count} x {cost_label}", ms, "ms")
    print("\n".join(sensitivity_table(results)))


def arguments(parser) -> None:
    parser.add_argument("--feature-model", default=None, help="a decoder of published_decoders.MODELS (see above)")


main = command("bench_projection", __doc__, body, arguments, __name__)
