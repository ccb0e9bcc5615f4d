"""The trainer over each decoder family, end to end: ``parallel-latent train --nproc 2`` (TP=2, ZeRO-2)
with a tiny GPT-2, GPT-NeoX and Llama decoder saved as the hub ships them, each with its own
tokenizer (tests/helpers/decoders.py), reconstructs the bundled corpus's held-out sentences; the
Llama run's checkpoint then works without the decoder's directory: it decodes, becomes a
save-pretrained directory whose card names the family, encodes a corpus and resumes at TP=1."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from parallel_latent.api import TextAutoencoder
from tests.helpers.decoders import CORPUS, FAMILIES, save_tiny_decoder, small_tokenizer
from tests.helpers.filesystems import directory_bytes
from tests.helpers.in_process_cli import run_main
from tests.helpers.trainer_runs import TINY_CONFIG, rank_env

pytestmark = pytest.mark.slow

STEPS = 150  # at a constant learning rate each family is past 0.99 held-out token accuracy here
RUN = [
    f"training.max_steps={STEPS}",
    f"training.eval_every={STEPS}",
    "schedule.decay=constant",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "training.hang_timeout_s=30",
]
HELD_OUT = re.compile(r"^held-out: loss [0-9.]+, token accuracy ([0-9.]+)", re.MULTILINE)


def train_argv(decoder, run_dir, *overrides: str) -> list[str]:
    return [
        "train", "--config", str(TINY_CONFIG), f"feature_model.name_or_path={decoder}", "feature_model.pretrained=true",
        "tokenizer.name_or_path=feature_model", f"logging.run_dir={run_dir}", *RUN, *overrides,
    ]  # fmt: skip


def train(decoder, run_dir, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "parallel_latent", *train_argv(decoder, run_dir, *overrides), "--nproc=2"]
    return subprocess.run(command, env=rank_env(), capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """{family: (run directory, the run's output)}, trained on first use. Each decoder directory
    is removed once its run is trained, as a hub model is absent where a checkpoint is used next."""
    tokenizer, runs = small_tokenizer(), {}
    root = tmp_path_factory.mktemp("families")

    def run(family: str):
        if family not in runs:
            decoder = save_tiny_decoder(root / f"{family}-decoder", family, tokenizer)
            result = train(decoder, root / family)
            shutil.rmtree(decoder)
            assert result.returncode == 0, result.stderr[-4000:]
            runs[family] = root / family, result.stdout
        return runs[family]

    return run


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_to_reconstruction_under_nproc_2(trained, family):
    run_dir, output = trained(family)
    assert "2 rank(s) = TP 2 x DP 1, ZeRO stage 2" in output
    [accuracy] = HELD_OUT.findall(output)
    assert float(accuracy) > 0.98, output[-3000:]
    # The checkpoint holds the decoder's own tokenizer beside the weights.
    assert (run_dir / "checkpoints" / f"step_{STEPS:08d}" / "model" / "tokenizer.json").is_file()


def test_a_llama_checkpoint_is_used_without_the_decoders_directory(trained, tmp_path):
    run_dir, _ = trained("llama")
    sentence = "It is a truth universally acknowledged"
    decoded = run_main(["reconstruct", "--checkpoint", str(run_dir), sentence])
    assert decoded.returncode == 0, decoded.stderr
    assert "reconstructed: It is a truth" in decoded.stdout

    saved = run_main(["save-pretrained", str(run_dir), str(tmp_path / "pretrained"), "--no-evaluate"])
    assert saved.returncode == 0, saved.stderr
    card = (tmp_path / "pretrained" / "README.md").read_text()
    assert "(Llama), hidden state -3" in card and "- llama" in card
    autoencoder = TextAutoencoder.from_pretrained(tmp_path / "pretrained")
    assert autoencoder.model.feature_model.family.name == "llama"
    assert autoencoder.reconstruct([sentence])[0].startswith("It is a truth")

    exported = run_main(
        ["encode-corpus", "--checkpoint", str(run_dir), "--data", str(CORPUS), "--out", str(tmp_path / "latents")]
    )
    assert exported.returncode == 0, exported.stderr
    assert "16x64 float32 latents" in exported.stdout


def test_a_llama_run_resumes_at_another_tensor_parallel_degree(trained, tmp_path):
    run_dir, _ = trained("llama")
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    decoder = save_tiny_decoder(tmp_path / "decoder", "llama", small_tokenizer())  # the same weights again
    result = train(decoder, copy, f"training.max_steps={STEPS + 10}", "parallel.tensor_parallel=1")
    assert result.returncode == 0, result.stderr[-4000:]
    output = result.stdout + result.stderr
    assert "2 rank(s) = TP 1 x DP 2" in output and f"step_{STEPS:08d} at step {STEPS}" in output
    [accuracy] = HELD_OUT.findall(output)
    assert float(accuracy) > 0.98


def test_a_resume_over_a_decoder_of_another_shape_is_one_line_and_changes_nothing(trained, tmp_path):
    """The decoder's directory now holds another Llama (its MLP 128 wide, not 176): every config key
    is the same, so only the decoder's own config tells; refused before any weight is read, where
    DeepSpeed's state-dict load would end every rank with its traceback."""
    run_dir, _ = trained("llama")
    before = directory_bytes(run_dir)
    other = save_tiny_decoder(tmp_path / "decoder", "llama", small_tokenizer(), intermediate_size=128)
    # One rank in this process: the refusal comes before the engine, whatever the layout.
    result = run_main([*train_argv(other, run_dir, "parallel.tensor_parallel=1"), f"training.max_steps={STEPS + 10}"])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0] == (
        f"parallel-latent: error: {run_dir / 'checkpoints' / f'step_{STEPS:08d}'}: config mismatch: "
        f"feature_model.name_or_path={other} is another decoder than the checkpoint's: "
        "its layers.0.mlp.gate_proj.weight is 128x64, the checkpoint's 176x64"
    )
    assert directory_bytes(run_dir) == before
