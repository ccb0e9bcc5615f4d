"""End-to-end training runs: real ranks, real DeepSpeed, gloo on CPU.

The runs share one recipe so that they double as equivalence checks: every layout must reproduce
the single-process run step by step, with dropout on.

| run | launched by                                | layout      | ZeRO | micro-batch       |
| --- | ------------------------------------------ | ----------- | ---- | ----------------- |
| A   | ``parallel-latent train``, in this process | TP=1 x DP=1 | 2    | 8                 |
| B   | ``parallel-latent --nproc 2``, AC          | TP=2 x DP=1 | 2    | 8                 |
| C   | the trainer on 2 pool ranks                | TP=1 x DP=2 | 2    | 4                 |
| D   | launch/torchrun_multi_node.sh x 2, AC      | TP=2 x DP=2 | 1    | 4                 |
| E   | ``torchrun`` 4 ranks, one killed; resumed  | TP=2 x DP=2 | 1    | 4                 |
|     | by the trainer on 4 pool ranks             |             |      |                   |
| F   | ``parallel-latent train``, in this process | TP=1 x DP=1 | 2    | 4 x 2 accumulated |

AC = activation checkpointing of the Perceiver blocks (model.activation_checkpointing). The
``parallel-latent`` commands run as ``parallel_latent.cli.main`` inside the test process
(tests/helpers/in_process_cli.py), which pays the imports once: one process trains right there,
``--nproc N`` starts torchrun and its N real ranks from there, as a shell's command does. The runs
that test the training rather than its launch (data and sequence parallelism, resumes onto more or
fewer processes, the resume after a kill) run on the worker's 2 and 4 gloo ranks (tests/conftest.py),
as the trainer each launched rank runs.

The comparison recipe runs in float64 with SGD and momentum, so that summation order cannot hide
or fake a difference: the layouts compute the same sums in other orders (TP splits the GEMMs and
the vocabulary, DP all-reduces gradients), which moves an fp64 result by at most
``order_bound(n, |value|, float64)`` (tests/helpers/tp_compare.py) with n the reduction length of the
model (its vocabulary of 50,259 dominates). SGD adds each step's gradient error to the weights once
(momentum sums it at most 1/(1 - momentum) times), so after k steps the curves may differ by at most
k / (1 - momentum) single-step bounds; Adam would divide errors by sqrt(v) + eps instead. A real
wiring bug (a DP rank weighted wrongly, padding counted, a replicated parameter counted twice in the
norm, a stale gradient) moves them by 1e-4 or more. The data order is compared exactly: every
step's token and sample counts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from parallel_latent.cli import build_parser
from parallel_latent.config import load_config
from tests.helpers.in_process_cli import run_main, train_on_pool
from tests.helpers.tp_compare import autoencoder_reduction_length, order_bound
from tests.helpers.trainer_runs import (
    TINY,
    TINY_CONFIG,
    describe,
    kill_tree,
    losses,
    rank_env,
    rank_pids,
    run_two_nodes,
    torchrun_command,
    train_args,
    train_records,
    wait_for_step,
)

pytestmark = pytest.mark.slow

STEPS, MOMENTUM = 10, 0.9
RECIPE = [
    "model.dropout=0.1",
    "training.precision=fp64",
    "optimizer.name=sgd",
    "optimizer.lr=0.5",
    f"optimizer.momentum={MOMENTUM}",
    f"training.max_steps={STEPS}",
    "checkpoint.save_every=5",
    "training.eval_every=5",
]


# TP=2 x DP=1 at ZeRO-2 with the reference's global batch.
TP2_ZERO2 = ["parallel.tensor_parallel=2", "parallel.zero_stage=2", "training.micro_batch_size=8"]


def curve_bound(step: int) -> float:
    """Relative bound on a logged value at ``step`` (see the module docstring)."""
    model_cfg = load_config(TINY_CONFIG, [*TINY, "model.vocab_size=50259"]).model
    n = autoencoder_reduction_length(model_cfg, tokens=8 * model_cfg.max_length, tp=2) + 2  # + DP
    return order_bound(n, 1.0, torch.float64) * (1 + step / (1 - MOMENTUM))


def launch(run_dir: Path, *overrides: str, nproc: int | None = None):
    """``parallel-latent train`` on the tiny recipe, in this process (tests/helpers/in_process_cli.py):
    one process trains here; ``nproc`` N > 1 launches N real ranks under torchrun from here, as a
    shell's ``parallel-latent train --nproc N`` does."""
    return run_main([*train_args(run_dir, *overrides), *([f"--nproc={nproc}"] if nproc else [])])


def on_ranks(pool, run_dir: Path, *overrides: str):
    """The tiny recipe trained by the ranks of ``pool`` (rank 0's output, as a launched job's)."""
    return train_on_pool(pool, TINY_CONFIG, train_args(run_dir, *overrides)[3:])  # without "train --config FILE"


def assert_same_curve(run_dir: Path, reference_dir: Path) -> None:
    mine, reference = train_records(run_dir), train_records(reference_dir)
    assert [r["step"] for r in mine] == [r["step"] for r in reference] == list(range(1, STEPS + 1))
    for ours, theirs in zip(mine, reference, strict=True):
        step = ours["step"]
        assert (ours["tokens"], ours["samples"]) == (theirs["tokens"], theirs["samples"]), f"data at step {step}"
        for field in ("loss", "grad_norm", "token_accuracy"):
            bound = curve_bound(step) * abs(theirs[field])
            if field == "grad_norm":
                # DeepSpeed sums the squared norm over the ranks (<= 4) in a float32 tensor.
                bound += order_bound(4, abs(theirs[field]), torch.float32)
            assert abs(ours[field] - theirs[field]) <= bound, (
                f"{field} at step {step}: {ours[field]} vs reference {theirs[field]} (bound {bound:.3g})"
            )


def assert_trained(run_dir: Path, steps: int = STEPS) -> None:
    """metrics.jsonl valid and complete, loss went down, a published checkpoint."""
    text = (run_dir / "metrics.jsonl").read_text()
    records = [json.loads(line) for line in text.splitlines()]  # every line is strict JSON
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for record in train:
        for key in (
            "loss",
            "token_accuracy",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "samples_per_s",
            "step_time_s",
            "mfu",
            "peak_memory_gb",
        ):
            assert isinstance(record[key], float) and math.isfinite(record[key]), (key, record)
    assert train[-1]["loss"] < train[0]["loss"] - 0.1
    assert any(r["kind"] == "eval" for r in records)
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{steps:08d}"
    assert (run_dir / "checkpoints" / latest / "checkpoint.json").is_file()


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("A") / "run"
    result = launch(
        run_dir,
        *RECIPE,
        "parallel.tensor_parallel=1",
        "parallel.zero_stage=2",
        "training.micro_batch_size=8",
        "checkpoint.export_portable=true",
    )
    assert result.returncode == 0, describe(result)
    return run_dir


def test_single_process_trains_evaluates_and_checkpoints(run_a):
    assert_trained(run_a)
    assert (run_a / "checkpoints" / f"step_{STEPS:08d}" / "model" / "manifest.json").is_file()
    assert (run_a / "config.yaml").is_file() and (run_a / "deepspeed_config.json").is_file()
    # Not DeepSpeed's recovery scripts (they stop on a TP > 1 checkpoint): the commands that read it.
    checkpoints = run_a / "checkpoints"
    assert not list(checkpoints.glob("zero_to_*.py"))
    note = (checkpoints / "CONVERTING.txt").read_text()
    named = {line.split()[1] for line in note.splitlines() if line.strip().startswith("parallel-latent ")}
    assert named == {"consolidate", "export", "reshard", "inspect"}
    for name in named:  # a command of this program: its --help exits 0
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args([name, "--help"])
        assert exited.value.code == 0, name


def test_every_evaluation_measures_the_latent_space_and_every_checkpoint_records_its_statistics(run_a):
    """metrics.jsonl carries the latent evaluations under their names; the checkpoint (and the
    model loaded from it) carries the per-feature statistics of its own step, one per feature."""
    from parallel_latent.api import TextAutoencoder
    from parallel_latent.evaluation.latent_space import NOISE_LEVELS
    from parallel_latent.files import read_jsonl

    last = [r for r in read_jsonl(run_a / "metrics.jsonl") if r["kind"] == "eval"][-1]
    width = 32  # TINY_MODEL's d_model: no bottleneck, one latent per position
    assert last["eval_floats_per_token"] == width and last["eval_compression"] == 1.0
    for level in NOISE_LEVELS:
        assert 0.0 <= last[f"eval_token_accuracy_noise_{level}"] <= 1.0 and f"eval_bleu_noise_{level}" in last
    assert 0 < last["eval_latent_std_min"] <= last["eval_latent_std_median"] <= last["eval_latent_std_max"]
    assert 0.1 <= last["eval_latent_top10_variance_share"] <= 1.0 and "eval_length_accuracy" not in last
    manifest = json.loads((run_a / "checkpoints" / f"step_{STEPS:08d}" / "model" / "manifest.json").read_text())
    stats = manifest["latent_stats"]
    assert stats["step"] == STEPS and len(stats["mean"]) == len(stats["std"]) == width
    assert stats["samples"] == last["eval_samples"]
    loaded = TextAutoencoder.from_checkpoint(run_a).latent_stats
    assert loaded.std.tolist() == stats["std"] and min(stats["std"]) == pytest.approx(last["eval_latent_std_min"])


def test_reconstruct_reads_what_training_saved(run_a):
    result = run_main(["reconstruct", "--checkpoint", str(run_a), "It is a truth universally acknowledged."])
    assert result.returncode == 0, describe(result)
    assert "reconstructed:" in result.stdout


def test_resuming_another_model_is_one_line_and_keeps_the_checkpoint(run_a, tmp_path):
    """A training checkpoint made for another model (here: another vocabulary head) stops the run
    with one line naming the key, exit 2, and the checkpoint is left as it was."""
    run_dir = tmp_path / "other"
    latest = run_a / "checkpoints" / f"step_{STEPS:08d}"
    before = sorted(p.relative_to(run_a) for p in run_a.rglob("*"))
    result = launch(
        run_dir,
        *RECIPE,
        "parallel.tensor_parallel=1",
        "parallel.zero_stage=2",
        "training.micro_batch_size=8",
        "model.head=normal",
        f"checkpoint.resume={latest}",
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("parallel-latent: error:")]
    assert result.returncode == 2 and len(errors) == 1, describe(result)
    assert "config mismatch: model.head is 'tied' in the checkpoint but 'normal' in the model" in errors[0]
    assert "Traceback" not in result.stderr
    assert sorted(p.relative_to(run_a) for p in run_a.rglob("*")) == before


def test_from_checkpoint_accepts_every_path_the_cli_accepts(run_a, tmp_path):
    """A run directory, its checkpoints directory, a step directory, the portable weights inside it
    and a consolidated copy all load the same model, with the run's tokenizer."""
    from parallel_latent.api import TextAutoencoder
    from parallel_latent.checkpoint import consolidate

    step_dir = run_a / "checkpoints" / f"step_{STEPS:08d}"
    single = consolidate(step_dir, tmp_path / "single")
    texts = ["It is a truth universally acknowledged.", "Mr. Darcy bowed."]
    results = []
    for path in (run_a, run_a / "checkpoints", step_dir, step_dir / "model", single):
        autoencoder = TextAutoencoder.from_checkpoint(path)
        latents = autoencoder.encode(texts)
        results.append((latents.latents, autoencoder.reconstruct(texts)))
    for latents, decoded in results[1:]:
        assert torch.equal(latents, results[0][0]) and decoded == results[0][1]


def test_save_pretrained_of_a_run_carries_its_held_out_evaluation(run_a, tmp_path, capsys):
    """`parallel-latent save-pretrained RUN OUT`: the card's metadata is the run's own last
    evaluation (of exactly these weights, from metrics.jsonl), and OUT reconstructs as the run does."""
    from huggingface_hub import ModelCard

    from parallel_latent.api import TextAutoencoder
    from parallel_latent.cli import main
    from parallel_latent.files import read_jsonl

    out = tmp_path / "shared"
    assert main(["save-pretrained", str(run_a), str(out)]) == 0
    assert "evaluating" not in capsys.readouterr().out  # recorded by the run: nothing to evaluate
    last = [r for r in read_jsonl(run_a / "metrics.jsonl") if r["kind"] == "eval"][-1]
    assert last["step"] == STEPS
    card = ModelCard.load(out / "README.md")
    assert {r.metric_type: r.metric_value for r in card.data.eval_results} == {
        "accuracy": round(last["eval_token_accuracy"], 4),
        "exact_match": round(last["eval_exact_match"], 4),
        "bleu": round(last["eval_bleu"], 4),
    }
    assert json.loads((out / "config.json").read_text())["training"]["steps"] == STEPS
    assert "| floats per token | 32.0000 |" in card.text and "| bleu noise 0.5 |" in card.text
    texts = ["It is a truth universally acknowledged.", "Mr. Darcy bowed."]
    shared, original = TextAutoencoder.from_pretrained(out), TextAutoencoder.from_checkpoint(run_a)
    assert torch.equal(shared.encode(texts).latents, original.encode(texts).latents)
    assert shared.reconstruct(texts) == original.reconstruct(texts)
    assert torch.equal(shared.latent_stats.mean, original.latent_stats.mean)  # config.json and the manifest


@pytest.fixture(scope="module")
def run_b(tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("B") / "run"
    result = launch(
        run_dir,
        *RECIPE,
        *TP2_ZERO2,
        "model.activation_checkpointing=true",
        "parallel.sequence_parallel=false",
        nproc=2,
    )
    assert result.returncode == 0, describe(result)
    return run_dir, result.stdout


def test_tp2_via_nproc_matches_tp1(run_a, run_b):
    """TP=2 x DP=1 (the CLI re-executing itself under torchrun) = TP=1 x DP=1, ZeRO-2; and
    DeepSpeed's reported gradient norm agrees: replicated parameters are counted once. The frozen
    feature pass is split over the two ranks (the default)."""
    run_dir, stdout = run_b
    assert "frozen feature pass split over the TP group" in stdout
    assert_trained(run_dir)
    assert_same_curve(run_dir, run_a)


def test_sequence_parallel_matches_tp1(run_a, pool2, tmp_path):
    """TP=2 with sequence parallelism and dropout on, ZeRO-2: the gradients of the parameters used
    on half the positions (LayerNorms, biases, positions) are summed over the TP group before
    DeepSpeed reduces them, and the run is the single-process run."""
    run_dir = tmp_path / "G"
    result = on_ranks(
        pool2, run_dir, *RECIPE, *TP2_ZERO2, "parallel.sequence_parallel=true", "parallel.tp_overlap_comm=false"
    )
    assert result.returncode == 0, describe(result)
    assert "sequence parallel; backward collective not overlapped" in result.stdout
    assert_trained(run_dir)
    assert_same_curve(run_dir, run_a)


def test_a_checkpoint_saved_without_sequence_parallelism_resumes_with_it(run_b, pool2, tmp_path):
    """B's step-5 checkpoint (no sequence parallelism) resumed with it on: steps 6-10 are B's."""
    source, _ = run_b
    resumed = tmp_path / "resumed"
    tag = "step_00000005"
    shutil.copytree(source / "checkpoints" / tag, resumed / "checkpoints" / tag)
    (resumed / "checkpoints" / "latest").write_text(tag + "\n")
    result = on_ranks(pool2, resumed, *RECIPE, *TP2_ZERO2, "parallel.sequence_parallel=true")
    assert result.returncode == 0, describe(result)
    assert "at step 5" in result.stdout and "resharded" not in result.stdout
    mine, theirs = train_records(resumed), {r["step"]: r for r in train_records(source)}
    assert [r["step"] for r in mine] == list(range(6, STEPS + 1))
    for record in mine:
        step = record["step"]
        assert (record["tokens"], record["samples"]) == (theirs[step]["tokens"], theirs[step]["samples"])
        assert abs(record["loss"] - theirs[step]["loss"]) <= curve_bound(step) * abs(theirs[step]["loss"])


def test_gradient_accumulation_matches_the_doubled_micro_batch(run_a, tmp_path):
    """Two accumulated micro-batches of 4 = one of 8: the loss is normalised by the tokens of
    the whole step, not averaged per micro-batch."""
    run_dir = tmp_path / "accumulate"
    result = launch(
        run_dir,
        *RECIPE,
        "parallel.tensor_parallel=1",
        "parallel.zero_stage=2",
        "training.micro_batch_size=4",
        "training.grad_accum_steps=2",
    )
    assert result.returncode == 0, describe(result)
    assert_same_curve(run_dir, run_a)


def test_dp2_matches_dp1_with_doubled_micro_batch(run_a, pool2, tmp_path):
    """Two data-parallel ranks (the trainer each launched rank runs, on a pool's ranks: plain torchrun
    launches the killed-rank job below) with half A's micro-batch: A's run."""
    run_dir = tmp_path / "C"
    result = on_ranks(
        pool2, run_dir, *RECIPE, "parallel.tensor_parallel=1", "parallel.zero_stage=2", "training.micro_batch_size=4"
    )
    assert result.returncode == 0, describe(result)
    assert_trained(run_dir)
    assert_same_curve(run_dir, run_a)


def test_two_nodes_on_one_machine(run_a, tmp_path):
    """launch/torchrun_multi_node.sh twice (NNODES=2, NODE_RANK=0/1, 2 ranks each, c10d
    rendezvous on 127.0.0.1): one 4-rank TP=2 x DP=2 job at ZeRO-1, with activation
    checkpointing, that trains, checkpoints and reproduces the single-process reference. (ZeRO-3
    trains, resumes and reshards in tests/checkpoint/test_trainer_resume.py; fp64 needs ZeRO 1-2.)"""
    run_dir = tmp_path / "D"
    overrides = train_args(
        run_dir,
        *RECIPE,
        "parallel.tensor_parallel=2",
        "parallel.zero_stage=1",
        "training.micro_batch_size=4",
        "model.activation_checkpointing=true",
    )[3:]  # drop "train --config FILE"
    agents, outputs = run_two_nodes(overrides)
    for node, (agent, output) in enumerate(zip(agents, outputs, strict=True)):
        assert agent.returncode == 0, f"node {node}: exit {agent.returncode}\n{output[-5000:]}"
    assert "4 rank(s) = TP 2 x DP 2, ZeRO stage 1" in "".join(outputs)  # rank 0 is on either node
    assert_trained(run_dir)
    assert_same_curve(run_dir, run_a)


def test_killed_rank_fails_fast_and_restart_resumes(pool4, tmp_path):
    """kill -9 one rank of a 4-rank torchrun job: the job exits non-zero within 60 s; the same
    training on four ranks then resumes from the last complete checkpoint and finishes. (The
    relaunch is the trainer on a pool's ranks: a launcher resuming on its own is
    tests/training/test_restarts.py's.)"""
    run_dir = tmp_path / "E"
    steps = 12
    overrides = [
        "model.dropout=0.0",
        f"training.max_steps={steps}",
        "checkpoint.save_every=2",
        "parallel.tensor_parallel=2",
        "parallel.zero_stage=1",
        "training.micro_batch_size=4",
    ]
    command = torchrun_command(run_dir, *overrides, nproc=4)
    job = subprocess.Popen(
        command, env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        wait_for_step(run_dir, 5, job, timeout=300)
        ranks = rank_pids(job.pid)
        assert len(ranks) == 4, ranks
        victim = ranks[-1]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        output = job.communicate(timeout=400)[0]
        elapsed = time.monotonic() - killed_at
    finally:
        for pid in rank_pids(job.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        kill_tree(job)
    assert job.returncode != 0, output[-3000:]
    # Only a hang fails this (a peer blocked in a collective until gloo's own timeout): ~10x the usual.
    assert elapsed < 300, f"job took {elapsed:.0f}s to exit after a rank died"
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    saved_step = int(latest.split("_")[1])
    assert 2 <= saved_step < steps

    result = on_ranks(pool4, run_dir, *overrides)
    assert result.returncode == 0, describe(result)
    assert f"resumed from {run_dir / 'checkpoints' / latest} at step {saved_step}" in result.stdout
    steps_logged = [r["step"] for r in train_records(run_dir)]
    assert steps_logged == list(range(1, steps + 1))  # lines past the checkpoint were replaced, none lost
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps:08d}"
    assert losses(run_dir)[-1] < losses(run_dir)[0]


def test_resume_on_more_then_fewer_processes_continues_the_same_run(run_b, pool2, pool4, tmp_path):
    """B (TP=2 x DP=1, ZeRO-2) stopped at step 5 and resumed with the same overrides on 4 processes
    (TP=2 x DP=2, ZeRO-1); that run "crashes" after its step-8 checkpoint and is resumed on 2
    processes again (ZeRO-2). Nobody touches the batch settings: the global batch of 8 is kept
    (micro-batch 4 on each of the 2 DP ranks, then 8), and every step equals B's (the data exactly,
    the losses within the curve bound, the learning rate exactly), the metrics file holding each
    step once."""
    source, _ = run_b
    run_dir = tmp_path / "elastic"
    checkpoints = run_dir / "checkpoints"
    shutil.copytree(source / "checkpoints" / "step_00000005", checkpoints / "step_00000005")
    (checkpoints / "latest").write_text("step_00000005\n")
    shutil.copy(source / "metrics.jsonl", run_dir / "metrics.jsonl")  # steps 6-10 are dropped on resume
    same_overrides = [*RECIPE, *TP2_ZERO2]  # micro-batch 8: 16 samples a step at DP=2, unless kept
    grown = on_ranks(
        pool4, run_dir, *same_overrides, "parallel.zero_stage=1", "checkpoint.save_every=4", "checkpoint.keep_last=0"
    )
    assert grown.returncode == 0, describe(grown)
    assert "at step 5 (resharded from another layout)" in grown.stdout
    assert "global batch 8 kept from the checkpoint: micro-batch 4 x 1 accumulation x DP 2" in grown.stdout
    shutil.rmtree(checkpoints / "step_00000010")  # the 4-process run dies after its step-8 checkpoint
    (checkpoints / "latest").write_text("step_00000008\n")
    shrunk = on_ranks(pool2, run_dir, *same_overrides)
    assert shrunk.returncode == 0, describe(shrunk)
    assert "at step 8 (resharded from another layout)" in shrunk.stdout
    assert "kept from the checkpoint" not in shrunk.stdout  # micro-batch 8 at DP=1 is the batch of 8
    mine, theirs = train_records(run_dir), {r["step"]: r for r in train_records(source)}
    assert [r["step"] for r in mine] == list(range(1, STEPS + 1))
    for record in mine[5:]:
        step = record["step"]
        assert (record["tokens"], record["samples"]) == (theirs[step]["tokens"], theirs[step]["samples"]), step
        assert abs(record["loss"] - theirs[step]["loss"]) <= curve_bound(step) * abs(theirs[step]["loss"]), step
        assert record["lr"] == theirs[step]["lr"], step


def test_resume_from_tp2_in_one_process_continues_the_same_run(run_a, run_b, tmp_path):
    """B's step-5 checkpoint (TP=2, micro-batch 8) resumed by one process (TP=1) whose configured
    micro-batch is 4: the global batch of 8 is kept as 4 x 2 accumulated, and steps 6-10 equal A's."""
    source, _ = run_b
    run_dir = tmp_path / "tp1"
    tag = "step_00000005"
    shutil.copytree(source / "checkpoints" / tag, run_dir / "checkpoints" / tag)
    (run_dir / "checkpoints" / "latest").write_text(tag + "\n")
    result = launch(run_dir, *RECIPE, "parallel.tensor_parallel=1", "parallel.zero_stage=2")
    assert result.returncode == 0, describe(result)
    assert "at step 5 (resharded from another layout)" in result.stdout
    assert "global batch 8 kept from the checkpoint: micro-batch 4 x 2 accumulation x DP 1" in result.stdout
    mine, theirs = train_records(run_dir), {r["step"]: r for r in train_records(run_a)}
    assert [r["step"] for r in mine] == list(range(6, STEPS + 1))
    for record in mine:
        step = record["step"]
        assert (record["tokens"], record["samples"]) == (theirs[step]["tokens"], theirs[step]["samples"]), step
        assert abs(record["loss"] - theirs[step]["loss"]) <= curve_bound(step) * abs(theirs[step]["loss"]), step


def test_a_global_batch_that_cannot_be_kept_is_one_line_before_any_rank_starts(run_b, tmp_path, capsys):
    """B's global batch of 8 over 3 data-parallel ranks: refused by the launching process."""
    from parallel_latent import cli

    source, _ = run_b
    run_dir = tmp_path / "three"
    tag = "step_00000005"
    shutil.copytree(source / "checkpoints" / tag, run_dir / "checkpoints" / tag)
    (run_dir / "checkpoints" / "latest").write_text(tag + "\n")
    argv = [*train_args(run_dir, *RECIPE, "parallel.tensor_parallel=1"), "--nproc=3"]
    assert cli.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "was trained with a global batch of 8, which does not split over 3 data-parallel" in err[0]
    assert "(1, 2, 4, 8)" in err[0]
