"""encode / decode / evaluate from the command line, on a portable checkpoint of a tiny model."""

import json

import pytest
import torch

from parallel_latent.api import TextAutoencoder
from parallel_latent.checkpoint import save_portable
from parallel_latent.cli import main
from parallel_latent.config import Config, FeatureModelConfig, ModelConfig
from parallel_latent.inference import evaluate_texts
from parallel_latent.model import build_model
from parallel_latent.model.tokenizer import apply_tokenizer_facts, load_tokenizer, tokenizer_facts

TEXTS = ["It is a truth universally acknowledged.", "Mr. Darcy bowed.", "She smiled at her sister."]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tokenizer = load_tokenizer(Config().tokenizer)
    cfg = Config(
        model=ModelConfig(d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, max_length=12, dropout=0.0),
        feature_model=FeatureModelConfig(n_layer=3, n_head=2, n_embd=32),
    )
    cfg = apply_tokenizer_facts(cfg, tokenizer_facts(tokenizer))
    model = build_model(cfg)
    # A few steps on the texts so the decoder's output is not constant.
    from parallel_latent.data import tokenize_samples

    batch = tokenize_samples(TEXTS, tokenizer, cfg.model.max_length, cfg.model.pad_token_id)
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=3e-3)
    for _ in range(5):
        model(batch.input_ids, batch.attention_mask).loss.backward()
        opt.step()
        opt.zero_grad()
    directory = tmp_path_factory.mktemp("inference") / "ckpt"
    save_portable(model, directory, cfg, tokenizer_facts(tokenizer), step=5)
    return directory, model.eval(), tokenizer


def test_encode_then_decode_equals_reconstruct(checkpoint, tmp_path, capsys):
    directory, model, tokenizer = checkpoint
    latents_file = tmp_path / "latents.safetensors"
    assert main(["encode", "--checkpoint", str(directory), "--out", str(latents_file), *TEXTS]) == 0
    capsys.readouterr()
    assert main(["decode", "--checkpoint", str(directory), str(latents_file)]) == 0
    decoded = capsys.readouterr().out.splitlines()
    autoencoder = TextAutoencoder(model, tokenizer)
    assert decoded == autoencoder.reconstruct(TEXTS)
    latents = autoencoder.encode(TEXTS)
    assert latents.latents.shape == (3, 12, 32) and latents.attention_mask.shape == (3, 12)
    assert autoencoder.decode(latents) == decoded
    assert autoencoder.decode(latents.latents, latents.attention_mask) == decoded


def test_evaluate_matches_the_forward_pass(checkpoint, tmp_path, capsys):
    directory, model, tokenizer = checkpoint
    data = tmp_path / "held_out.txt"
    data.write_text("\n".join(TEXTS) + "\n")
    assert main(["evaluate", "--checkpoint", str(directory), "--data", str(data)]) == 0
    got = json.loads(capsys.readouterr().out)
    want = evaluate_texts(TextAutoencoder(model, tokenizer), TEXTS)
    # The same weights (loaded bit for bit), the same batch, the same kernels: the same numbers.
    assert got == want


def test_decode_rejects_a_wrong_file(checkpoint, tmp_path, capsys):
    directory, _, _ = checkpoint
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not safetensors")
    assert main(["decode", "--checkpoint", str(directory), str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a readable latents file" in err[0]
