"""encode / decode / evaluate from the command line, on a portable checkpoint of a tiny model."""

import json
import re

import pytest
import torch

from parallel_latent.api import TextAutoencoder
from parallel_latent.checkpoint import save_portable
from parallel_latent.cli import main
from parallel_latent.config import Config, FeatureModelConfig, ModelConfig
from parallel_latent.data import tokenize_samples
from parallel_latent.evaluation.bleu import corpus_bleu
from parallel_latent.evaluation.held_out import evaluate_texts
from parallel_latent.evaluation.records import detokenize
from parallel_latent.feature_model.tokenizer import apply_tokenizer_facts, load_tokenizer, tokenizer_facts
from parallel_latent.model import build_model
from tests.helpers.tp_compare import autoencoder_reduction_length, max_abs, order_bound, terms_scale

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


def bad_latents(latents: torch.Tensor, mask: torch.Tensor) -> dict[str, tuple[dict, str]]:
    """name -> (the tensors of a latents file, what the one line says)."""
    nan = latents.clone()
    nan[0, 0, 0] = float("nan")
    return {
        "NaN": ({"latents": nan, "attention_mask": mask}, "latents hold 1 value that is not finite"),
        "inf": ({"latents": latents * float("inf"), "attention_mask": mask}, "values that are not finite"),
        "1e30": ({"latents": torch.full_like(latents, 1e30), "attention_mask": mask}, "latents too large"),
        "int64": ({"latents": latents.long(), "attention_mask": mask}, "latents of dtype torch.int64"),
        "float mask": ({"latents": latents, "attention_mask": mask.float()}, "attention_mask of dtype"),
        "mask of 7s": ({"latents": latents, "attention_mask": mask * 7}, "values other than 0 and 1"),
        "8 of 12 latents": ({"latents": latents[:, :8], "attention_mask": mask}, "do not fit this model"),
        "0-d": ({"latents": latents[0, 0, 0], "attention_mask": mask}, r"latents of shape \(\): expected 3 dim"),
        "2-d": ({"latents": latents[0], "attention_mask": mask}, r"latents of shape \(12, 32\): expected 3 dim"),
        "4-d": ({"latents": latents[None], "attention_mask": mask}, r"latents of shape \(1, 1, 12, 32\)"),
    }


@pytest.mark.parametrize("case", list(bad_latents(torch.zeros(1, 12, 32), torch.ones(1, 12, dtype=torch.long))))
def test_decode_refuses_latents_it_cannot_read_in_one_line(checkpoint, tmp_path, capsys, case):
    """Latents that are not finite, too large to decode, of an integer dtype, with a mask that is not
    0/1 integers, or of another shape than the model's: one line naming the file and status 2 from
    the command; the same ValueError from the API."""
    from safetensors.torch import save_file

    directory, model, tokenizer = checkpoint
    autoencoder = TextAutoencoder(model, tokenizer)
    good = autoencoder.encode(TEXTS[:1])
    tensors, expected = bad_latents(good.latents, good.attention_mask)[case]
    path = tmp_path / "bad.safetensors"
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path))
    assert main(["decode", "--checkpoint", str(directory), str(path)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"parallel-latent: error: {path}: ") and re.search(expected, line), line
    with pytest.raises(ValueError, match=expected):
        autoencoder.decode(tensors["latents"], tensors["attention_mask"])


def test_evaluate_reports_bleu_of_reconstructions_against_what_the_model_saw(checkpoint, tmp_path, capsys):
    """Another corpus (out of domain, one line cut at max_length) through --data: BLEU is corpus BLEU
    of what reconstruct returns against the texts as far as the model saw them."""
    directory, model, tokenizer = checkpoint
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "Stocks rallied on Tuesday as technology shares rose for a third day in a row on strong earnings.",
    ]
    data = tmp_path / "news.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert main(["evaluate", "--checkpoint", str(directory), "--data", str(data)]) == 0
    got = json.loads(capsys.readouterr().out)
    autoencoder = TextAutoencoder(model, tokenizer)
    batch = tokenize_samples(texts, tokenizer, model.model_cfg.max_length, model.model_cfg.pad_token_id)
    seen = detokenize(tokenizer, batch.input_ids, batch.attention_mask)
    assert seen[0] == texts[0] and texts[1].startswith(seen[1]) and seen[1] != texts[1]
    assert (got["samples"], got["truncated"]) == (2, 1)
    assert got["bleu"] == corpus_bleu(autoencoder.reconstruct(texts), seen)


def test_interpolate_ends_at_the_two_reconstructions(checkpoint, capsys):
    """The line between two texts' latents: its endpoints are exactly their reconstructions (each
    decoded with its own mask), and the command prints one line per point."""
    directory, model, tokenizer = checkpoint
    autoencoder = TextAutoencoder(model, tokenizer)
    first, second = TEXTS[0], TEXTS[1]
    line = autoencoder.interpolate(first, second, steps=4)
    assert len(line) == 4 and [line[0], line[-1]] == autoencoder.reconstruct([first, second])
    assert autoencoder.interpolate(first, second, steps=2) == autoencoder.reconstruct([first, second])
    assert main(["interpolate", "--checkpoint", str(directory), first, second, "--steps", "4"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"{i / 3:.3f}  {text}" for i, text in enumerate(line)]
    for steps in ("1", "100000000"):  # refused at once, before the checkpoint is read
        assert main(["interpolate", "--checkpoint", str(directory), first, second, "--steps", steps]) == 2
        assert f"--steps {steps}: must be between 2 and 1000" in capsys.readouterr().err


def test_evaluate_reports_the_latent_evaluations_and_a_mask_is_needed_without_predict_length(checkpoint):
    _, model, tokenizer = checkpoint
    result = evaluate_texts(TextAutoencoder(model, tokenizer), TEXTS)
    assert result["floats_per_token"] == 32.0 and result["compression"] == 1.0
    assert {"bleu_noise_0.1", "token_accuracy_noise_0.5", "latent_std_median"} <= set(result)
    assert "length_accuracy" not in result  # no predicted length
    latents = TextAutoencoder(model, tokenizer).encode(TEXTS).latents
    with pytest.raises(ValueError, match="attention_mask"):
        TextAutoencoder(model, tokenizer).decode(latents)


# --------------------------------------------------------------------------- #
# The Python text API at TP=2: every rank of the group calls it with the same texts.
# --------------------------------------------------------------------------- #


def text_api_at_tp2(directory: str, texts: list[str]):
    from parallel_latent.parallel import initialize_model_parallel

    state = initialize_model_parallel(2)
    autoencoder = TextAutoencoder.from_checkpoint(directory, tp_group=state.tp_group)
    latents = autoencoder.encode(texts)
    return (
        latents.latents,
        latents.attention_mask,
        autoencoder.decode_ids(latents.latents, latents.attention_mask),
        autoencoder.decode(latents),
        autoencoder.reconstruct(texts),
    )


def test_text_api_round_trip_in_one_process_and_at_tp2(checkpoint, pool2):
    directory, _, _ = checkpoint
    single = TextAutoencoder.from_checkpoint(directory)
    latents = single.encode(TEXTS)
    assert latents.truncated.tolist() == [False, False, False]
    assert single.decode(latents) == single.reconstruct(TEXTS)
    with torch.no_grad():
        logits = single.model.decoder(latents.latents, latents.attention_mask.shape[1])[
            ..., : single.model.model_cfg.vocab_size
        ]
    cfg = single.model.model_cfg
    k = autoencoder_reduction_length(cfg, 3 * cfg.max_length, 2)
    latents_bound = order_bound(k, terms_scale(max_abs([latents.latents]), k))
    logits_bound = order_bound(k, terms_scale(max_abs([logits]), k))
    top2 = logits.topk(2, dim=-1).values
    decided = ((top2[..., 0] - top2[..., 1]) > 2 * logits_bound) | (latents.attention_mask == 0)

    results = pool2.run(text_api_at_tp2, str(directory), TEXTS)
    for rank, (tp_latents, mask, ids, decoded, reconstructed) in enumerate(results):
        # Encode then decode is reconstruct, on every rank, and every rank gets the same answer.
        assert decoded == reconstructed, f"rank {rank}"
        assert torch.equal(tp_latents, results[0][0]) and decoded == results[0][3], f"rank {rank}"
        # The same model as in one process: latents within the summation-order bound, and the same
        # tokens wherever the choice is decided (all of them for this checkpoint, in practice).
        assert torch.equal(mask, latents.attention_mask)
        assert (tp_latents - latents.latents).abs().max().item() <= latents_bound
        assert torch.equal(ids[decided], single.decode_ids(latents.latents, latents.attention_mask)[decided])
        if bool(decided.all()):
            assert decoded == single.decode(latents)


def test_the_text_api_is_importable_from_the_package():
    import parallel_latent
    from parallel_latent import api

    assert parallel_latent.TextAutoencoder is api.TextAutoencoder and parallel_latent.Latents is api.Latents
    with pytest.raises(AttributeError):
        parallel_latent.NoSuchThing  # noqa: B018
