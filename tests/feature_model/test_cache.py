"""The feature cache (parallel_latent/feature_model/cache.py): the frozen decoder's features of every
sample computed once, in parallel, into checksummed memory-mapped shards under a key of everything
that changes a feature, and read instead of running the decoder.

With the cache the autoencoder's loss and gradients equal those without it at TP 1, TP 2 x DP 2,
sequence parallelism and a decoder sharded over TP 3 (real gloo ranks, which build the cache
together); the key changes with the weights, the hidden state, the dtype and the corpus, and not
with the seed of a pretrained decoder or the layout; a killed build continues from its published
shards; a flipped byte is found and rebuilt; a disk too small is refused before anything is
written; bf16 halves the cache and rounds the features. The trainer end to end is
tests/training/test_feature_cache_runs.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from parallel_latent.config import config_from_dict
from parallel_latent.errors import DataError
from parallel_latent.feature_model import cache as feature_cache
from parallel_latent.feature_model.features import random_features_unannounced
from parallel_latent.model import build_model
from parallel_latent.parallel import initialize_model_parallel
from tests.helpers.decoders import WIDTH, save_tiny_decoder, small_tokenizer
from tests.helpers.tp_compare import order_bound, terms_scale

T, D, HEADS, VOCAB, MASK, PAD, ROWS, B = 8, 48, 6, 300, 298, 299, 40, 4


class Rows:
    """The reading side of a prepared copy, in memory: ``ROWS`` random samples, right-padded."""

    max_length = T

    def __init__(self, seed: int = 0, fingerprint: str = "corpus-a"):
        gen = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, MASK, (ROWS, T), generator=gen).numpy()
        self.lengths = torch.randint(1, T + 1, (ROWS,), generator=gen).numpy()
        self.input_ids[np.arange(T) >= self.lengths[:, None]] = PAD
        self.fingerprint, self.content_digest = fingerprint, f"{fingerprint}-content"

    def __len__(self) -> int:
        return ROWS

    def rows(self, rows) -> dict[str, torch.Tensor]:
        rows = np.asarray(rows)
        mask = np.arange(T) < self.lengths[rows][:, None]
        return {"input_ids": torch.from_numpy(self.input_ids[rows]), "attention_mask": torch.from_numpy(mask).long()}


def cache_config(cache_dir: Path, tp: int = 1, **sections):
    """A tiny model (d=48, 6 heads: TP 2 and 3 divide it) over a 3-layer random GPT-2, the cache on."""
    feature = {"n_layer": 3, "n_head": HEADS, "n_embd": D, "n_positions": 64, "cache": "on", **sections.pop("fm", {})}
    model = {"d_model": D, "n_heads": HEADS, "n_encoder_layers": 1, "n_decoder_layers": 1, "max_length": T}
    model.update(vocab_size=VOCAB, mask_token_id=MASK, pad_token_id=PAD, dropout=0.1)
    model.update(sections.pop("model", {}))
    return config_from_dict(
        {
            "model": model,
            "feature_model": feature,
            "data": {"cache_dir": str(cache_dir)},
            "parallel": {"tensor_parallel": tp, **sections.pop("parallel", {})},
            "training": {"micro_batch_size": B, **sections.pop("training", {})},
        }
    )


def one_process_cache(cfg, data=None, model=None, **kwargs):
    with random_features_unannounced():
        model = model or build_model(cfg)
    data = data or Rows()
    return feature_cache.job_cache(cfg, model.feature_model, data, len(data), announce=False, **kwargs), model


# --------------------------------------------------------------------------- #
# With the cache, the same model.
# --------------------------------------------------------------------------- #


def equality_task(tp: int, cache_dir: str, overrides: dict) -> dict:
    """On every rank: the cache built by the job's ranks together, then one forward and backward of
    this DP rank's share of a batch with the cached features and with the computed ones."""
    state = initialize_model_parallel(tp) if tp > 1 else None  # TP=1: this process alone, no group
    cfg = cache_config(Path(cache_dir), tp, **overrides)
    with random_features_unannounced():
        model = build_model(cfg, state and state.tp_group).train()
    data = Rows()
    cache = feature_cache.job_cache(cfg, model.feature_model, data, len(data), state, "cpu", announce=False)
    dp_rank = state.dp_rank if state else 0
    rows = np.arange(dp_rank * B, (dp_rank + 1) * B) + 7
    batch = data.rows(rows)
    outcomes = []
    for features in (None, cache.rows(rows)):
        model.zero_grad(set_to_none=True)
        model.dropout_rng.step = 3  # the same masks both ways (dropout 0.1 is on)
        out = model(batch["input_ids"], batch["attention_mask"], features=features)
        out.loss.backward()
        outcomes.append((out.loss.item(), [p.grad.clone() for p in model.trainable_parameters()]))
    (loss, grads), (cached_loss, cached_grads) = outcomes
    computed = model.features(batch["input_ids"], batch["attention_mask"])
    computed = computed.masked_fill(batch["attention_mask"].unsqueeze(-1) == 0, 0.0)
    return {
        "built": sorted(p.name for p in Path(cache.spec.directory).iterdir()),
        "features": (computed - cache.rows(rows)).abs().max().item(),
        "feature_scale": computed.abs().max().item(),
        "loss": (loss, cached_loss),
        "grads": max((a - b).abs().max().item() for a, b in zip(grads, cached_grads, strict=True)),
        "grad_scale": max(g.abs().max().item() for g in grads),
    }


def assert_same_model(results: list[dict], where: str) -> None:
    """The features of the cache within the derived bound of those computed (the decoder's
    reduction length: 3 GPT-2 layers of width 48), and the loss and gradients through them within
    the bound of the autoencoder's on top (they are identical where the features are)."""
    decoder_k = 3 * (2 * D + D + D // HEADS + 2 * T + 2 * D + 4 * D + 16)
    model_k = decoder_k + 2 * (3 * D + D // HEADS + 4 * T + 2 * D + 5 * D) + 2 * D + VOCAB + B * T
    for rank, res in enumerate(results):
        bound = order_bound(decoder_k, terms_scale(res["feature_scale"], decoder_k))
        assert res["features"] <= bound, f"{where} rank {rank}: features differ by {res['features']:.3g} > {bound:.3g}"
        loss, cached = res["loss"]
        loss_bound = order_bound(model_k, terms_scale(abs(loss), model_k)) if res["features"] else 0.0
        assert abs(loss - cached) <= loss_bound, f"{where} rank {rank}: loss {loss} with the cache {cached}"
        grad_bound = order_bound(model_k, terms_scale(res["grad_scale"], model_k)) if res["features"] else 0.0
        assert res["grads"] <= grad_bound, f"{where} rank {rank}: gradients differ by {res['grads']:.3g}"
    assert all(res["built"] == results[0]["built"] for res in results), where
    assert "index.json" in results[0]["built"], where


def test_with_the_cache_the_same_model_in_one_process(tmp_path):
    assert_same_model([equality_task(1, str(tmp_path), {})], "TP=1")


@pytest.mark.parametrize(
    ("tp", "overrides"),
    [(2, {}), (2, {"parallel": {"sequence_parallel": True}}), (4, {"fm": {"parallel": "shard", "n_head": 4}})],
    ids=["tp2xdp2", "sequence-parallel", "shard-tp4"],
)
def test_with_the_cache_the_same_model_on_four_ranks(pool4, tmp_path, tp, overrides):
    """TP 2 x DP 2 (four builders, one shard each), sequence parallelism, and a decoder sharded over
    TP 4 (one builder per DP group: the TP group encodes together, its rank 0 writes)."""
    if tp == 4:
        overrides = {**overrides, "model": {"n_heads": 4}}
    assert_same_model(pool4.run(equality_task, tp, str(tmp_path), overrides), f"tp={tp} {overrides}")


@pytest.fixture(scope="module")
def pool3(request):
    from tests.helpers.pool_training import shared_pool

    return shared_pool(request, 3)


def test_with_the_cache_the_same_model_sharded_over_three_ranks(pool3, tmp_path):
    """``feature_model.parallel=shard`` at TP 3 (6 heads, 2 per rank), as configs/smollm2.yaml runs
    SmolLM2's 3 key/value heads; the layout is not in the key: TP=1 then reads the same cache."""
    results = pool3.run(equality_task, 3, str(tmp_path), {"fm": {"parallel": "shard"}})
    assert_same_model(results, "shard tp=3")
    again = equality_task(1, str(tmp_path), {})
    assert again["built"] == results[0]["built"]  # the same directory, nothing added
    assert len([p for p in tmp_path.glob("features/*") if p.is_dir()]) == 1


# --------------------------------------------------------------------------- #
# The key.
# --------------------------------------------------------------------------- #


def test_the_key_holds_what_changes_a_feature_and_nothing_else(tmp_path):
    """A pretrained decoder's key: its files' content, the hidden state, the dtype and the corpus;
    not the seed (whose draws only touch the mask and pad rows, absent from every real token) nor
    the layout. A random build's key is its weights, so its seed."""
    directory = save_tiny_decoder(tmp_path / "decoder", "gpt2", small_tokenizer())
    vocab = {"d_model": WIDTH, "n_heads": 4, "vocab_size": 514, "mask_token_id": 512, "pad_token_id": 513}

    def key(data=None, **sections) -> str:
        fm = {"name_or_path": str(directory), "pretrained": True, **sections.pop("fm", {})}
        cfg = cache_config(tmp_path, fm=fm, model=vocab, **sections)
        model = build_model(cfg)
        data = data or Rows()
        return feature_cache.job_spec(cfg, model.feature_model, data, len(data)).key

    base = key()
    assert key(training={"seed": 99}) == base
    assert key(parallel={"split_feature_model": False}) == base
    assert key(fm={"hidden_state": -2}) != base
    assert key(fm={"sink_token_id": 0}) != base
    assert key(fm={"cache_dtype": "bf16"}) != base
    assert key(Rows(fingerprint="corpus-b")) != base  # another tokenizer or max_length: another fingerprint
    with_mask = Rows()
    with_mask.input_ids[0, 0] = 512  # the mask token, as a real token whose row is the seed's: the seed enters the key
    assert key(with_mask) != key(with_mask, training={"seed": 99})
    weights = directory / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-3] ^= 0x01  # the same file name, other weights
    weights.write_bytes(bytes(raw))
    assert key() != base

    random = cache_config(tmp_path)
    seeds = {feature_cache.job_spec(c, build_model(c).feature_model, Rows(), ROWS).key for c in
             (random, cache_config(tmp_path, training={"seed": 5}))}  # fmt: skip
    assert len(seeds) == 2


# --------------------------------------------------------------------------- #
# Building, damage and reading.
# --------------------------------------------------------------------------- #


def test_a_killed_build_continues_from_its_published_shards(tmp_path, monkeypatch):
    """Shards of 8 rows: the build dies in its third shard; no index, two shards kept; the rerun
    encodes the other three only, and reads what an uninterrupted build would."""
    monkeypatch.setattr(feature_cache, "SHARD_BYTES", 8 * T * D * 4)
    cfg = cache_config(tmp_path)
    with random_features_unannounced():
        model = build_model(cfg)
    encoded = []

    def dying(ids, mask):
        if len(encoded) == 2 * 2:  # two shards of two batches each
            raise KeyboardInterrupt
        encoded.append(ids.shape[0])
        return model.feature_model(ids, mask)

    spec = feature_cache.job_spec(cfg, model.feature_model, Rows(), ROWS)
    with pytest.raises(KeyboardInterrupt):
        feature_cache.open_or_build(spec, Rows(), dying, feature_cache.Builders(1, 0, True), B, announce=False)
    assert not (spec.directory / "index.json").exists()
    assert sorted(p.name for p in spec.directory.glob("*.json")) == ["shard_00000.json", "shard_00001.json"]
    assert "partly built (2 shards published" in feature_cache.status(spec)
    encoded.clear()

    def counting(ids, mask):
        encoded.append(ids.shape[0])
        return model.feature_model(ids, mask)

    cache = feature_cache.open_or_build(spec, Rows(), counting, feature_cache.Builders(1, 0, True), B, announce=False)
    assert sum(encoded) == 3 * 8  # shards 2, 3 and 4
    assert len(cache.shards) == 5 and "complete (5 shards" in feature_cache.status(spec)
    fresh, _ = one_process_cache(cache_config(tmp_path / "fresh"), model=model)
    assert torch.equal(cache.rows(np.arange(ROWS)), fresh.rows(np.arange(ROWS)))


def test_a_flipped_byte_is_said_in_one_line_and_the_shard_built_again(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(feature_cache, "SHARD_BYTES", 8 * T * D * 4)
    cache, model = one_process_cache(cache_config(tmp_path))
    want = cache.rows(np.arange(ROWS))
    shard = cache.spec.directory / "shard_00003.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    shard.write_bytes(bytes(raw))
    capsys.readouterr()
    again, _ = one_process_cache(cache_config(tmp_path), model=model)
    lines = [line for line in capsys.readouterr().out.splitlines() if "damaged" in line]
    assert lines == [
        f"{shard}: feature cache shard is damaged (its checksum does not match its sidecar): building it again"
    ]
    assert torch.equal(again.rows(np.arange(ROWS)), want)


def test_a_disk_too_small_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(feature_cache.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    with pytest.raises(DataError, match=r"needs 0 MiB and 0 MiB are free; set feature_model.cache_dir") as error:
        one_process_cache(cache_config(tmp_path))
    assert "\n" not in str(error.value)
    assert not list(tmp_path.glob("features/*/*"))


def test_bf16_halves_the_cache_and_rounds_the_features(tmp_path):
    exact, model = one_process_cache(cache_config(tmp_path))
    half, _ = one_process_cache(cache_config(tmp_path, fm={"cache_dtype": "bf16"}), model=model)
    assert half.spec.directory != exact.spec.directory
    assert half.nbytes * 2 == exact.nbytes
    want, got = exact.rows(np.arange(ROWS)), half.rows(np.arange(ROWS))
    assert torch.equal(got, want.to(torch.bfloat16).float())  # round to nearest, read back exactly
    assert not torch.equal(got, want)
    index = json.loads((half.spec.directory / "index.json").read_text())
    assert index["record"]["dtype"] == "bf16"


def test_features_at_padding_are_zeros_and_rows_come_back_in_any_order(tmp_path):
    cache, model = one_process_cache(cache_config(tmp_path))
    data, rows = Rows(), np.array([39, 0, 17, 17, 5])
    batch = data.rows(rows)
    got = cache.rows(rows)
    assert bool((got[batch["attention_mask"] == 0] == 0).all())
    with torch.no_grad():
        computed = model.feature_model(batch["input_ids"], batch["attention_mask"])
    real = batch["attention_mask"].bool()
    decoder_k = 3 * (2 * D + D + D // HEADS + 2 * T + 2 * D + 4 * D + 16)
    bound = order_bound(decoder_k, terms_scale(computed.abs().max().item(), decoder_k))
    assert (got[real] - computed[real]).abs().max().item() <= bound  # encoded in other batches
    with pytest.raises(IndexError):
        cache.rows(np.array([ROWS]))


def test_an_index_that_does_not_cover_the_rows_is_refused_in_one_line(tmp_path):
    cache, _ = one_process_cache(cache_config(tmp_path))
    index_path = cache.spec.directory / "index.json"
    index = json.loads(index_path.read_text())
    index["shards"] = [[0, ROWS - 1]]
    index_path.write_text(json.dumps(index))
    with pytest.raises(DataError, match="its shards do not cover the cache's 40 rows") as error:
        feature_cache.FeatureCache(cache.spec)
    assert "\n" not in str(error.value)


def test_a_bf16_run_caches_the_features_its_decoder_computes_under_its_own_key(tmp_path):
    """DeepSpeed's bf16 casts the frozen decoder too: its features are the bf16 decoder's, kept in
    the cache exactly (fp32 holds every bf16 value) under another key than an fp32 run's."""
    exact, model = one_process_cache(cache_config(tmp_path))
    half_model = model.to(torch.bfloat16)
    half, _ = one_process_cache(cache_config(tmp_path), model=half_model)
    assert half.spec.directory != exact.spec.directory
    assert half.spec.record["decoder"]["computed_in"] == "torch.bfloat16"
    data, rows = Rows(), np.arange(8)
    batch = data.rows(rows)
    with torch.no_grad():
        computed = half_model.features(batch["input_ids"], batch["attention_mask"])
        cached = half_model.features(batch["input_ids"], batch["attention_mask"], half.rows(rows))
    real = batch["attention_mask"].bool()
    assert cached.dtype == torch.bfloat16
    decoder_k = 3 * (2 * D + D + D // HEADS + 2 * T + 2 * D + 4 * D + 16)
    bound = order_bound(decoder_k, terms_scale(computed.float().abs().max().item(), decoder_k), torch.bfloat16)
    assert (cached[real].float() - computed[real].float()).abs().max().item() <= bound
