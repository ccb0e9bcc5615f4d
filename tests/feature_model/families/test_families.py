"""Any decoder family as the feature model: tiny GPT-2, GPT-NeoX and Llama decoders saved as the hub
ships them (tests/helpers/decoders.py), their features against transformers' own hidden states, only
the layers a hidden state needs held, their own tokenizer, random builds from a few keys, a bad
choice in one line, and a checkpoint that rebuilds each family from its record alone, in one process
and at TP=4."""

from __future__ import annotations

import dataclasses
import logging
import shutil

import pytest
import torch
from transformers import AutoModel, BertConfig, OPTConfig, T5Config

from parallel_latent.api import load_autoencoder
from parallel_latent.checkpoint import save_portable
from parallel_latent.config import (
    Config,
    ConfigError,
    FeatureModelConfig,
    TokenizerConfig,
    config_from_dict,
)
from parallel_latent.feature_model import FeatureModel
from parallel_latent.feature_model.families import load_config
from parallel_latent.feature_model.sharded import _weights_directory
from parallel_latent.feature_model.tokenizer import apply_tokenizer_facts, load_tokenizer, tokenizer_facts
from parallel_latent.model import LatentAutoencoder, build_model
from parallel_latent.parallel import initialize_model_parallel
from tests.helpers.checkpoint_stack import gathered_state
from tests.helpers.decoders import (
    FAMILIES,
    LAYERS,
    WIDTH,
    into_hub_cache,
    offline_hub,
    reduction_length,
    save_tiny_decoder,
    small_tokenizer,
)
from tests.helpers.tp_compare import autoencoder_reduction_length, order_bound, terms_scale

T = 12


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{family: directory} of tiny decoders sharing one small tokenizer."""
    tokenizer = small_tokenizer()
    root = tmp_path_factory.mktemp("decoders")
    return {family: save_tiny_decoder(root / family, family, tokenizer) for family in FAMILIES}


def loaded(directory, **keys) -> FeatureModelConfig:
    return FeatureModelConfig(name_or_path=str(directory), pretrained=True, **keys)


def padded_batch(vocab: int):
    ids = torch.randint(0, vocab, (3, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    return ids, mask


@pytest.mark.parametrize("index", [-1, -2, -3, 1])
@pytest.mark.parametrize("family", FAMILIES)
def test_features_are_the_full_models_hidden_state(saved, family, index):
    tokenizer = load_tokenizer(TokenizerConfig(name_or_path=str(saved[family])))
    vocab = len(tokenizer)  # the saved vocabulary plus mask and pad
    features = FeatureModel(loaded(saved[family], hidden_state=index), vocab)
    full = AutoModel.from_pretrained(saved[family]).eval()
    full.resize_token_embeddings(vocab)
    full.get_input_embeddings().weight.data.copy_(features.token_table)  # the resize's random rows
    ids, mask = padded_batch(vocab)
    with torch.no_grad():
        want = full(input_ids=ids, output_hidden_states=True).hidden_states[index]
        padded = full(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[index]
        got = features(ids, mask)
    keep = index % (LAYERS + 1)
    n = reduction_length(family, T, keep)
    bound = order_bound(n, terms_scale(want.abs().max().item(), n))
    assert (got - want).abs().max().item() <= bound
    # Causal: the padding changes only the features at pad positions, which the encoder masks out.
    real = mask.bool()
    assert (got[real] - padded[real]).abs().max().item() <= bound
    with torch.no_grad():  # a layer skipped or the final norm misplaced is far outside the bound
        other = full(input_ids=ids, output_hidden_states=True).hidden_states[index - 1]
    assert (other - want).abs().max().item() > 10 * bound

    # Only what that hidden state needs is held: its layers, the final norm only for the last one.
    assert features.blocks == keep and features.width == WIDTH
    layers = getattr(full, features.family.layers)
    norm = getattr(full, features.family.final_norm)
    held = sum(p.numel() for p in features.parameters())
    needed = full.get_input_embeddings().weight.numel() + sum(p.numel() for p in layers[:keep].parameters())
    needed += sum(p.numel() for p in norm.parameters()) if index == -1 else 0
    needed += full.wpe.weight.numel() if family == "gpt2" else 0
    assert held == needed


def test_its_own_tokenizer_from_the_same_directory(saved):
    cfg = config_from_dict(
        {
            "feature_model": {"name_or_path": str(saved["llama"]), "pretrained": True},
            "tokenizer": {"name_or_path": "feature_model"},
        }
    )
    assert cfg.tokenizer.name_or_path == str(saved["llama"])  # recorded as what it names
    tokenizer = load_tokenizer(cfg.tokenizer)
    facts = tokenizer_facts(tokenizer)
    assert facts["vocab_size"] == 514 and {facts["mask_token_id"], facts["pad_token_id"]} == {512, 513}
    assert tokenizer.decode(tokenizer("It is a truth universally acknowledged")["input_ids"]).startswith("It is a")


def test_random_builds_of_each_family_are_announced_once(caplog):
    for family, kv in (("gpt2", 0), ("gpt_neox", 0), ("llama", 2)):
        cfg = FeatureModelConfig(architecture=family, n_layer=4, n_head=4, n_embd=32, n_kv_head=kv)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            features = FeatureModel(cfg, 300)
        notices = [r.getMessage() for r in caplog.records if "RANDOM" in r.getMessage()]
        assert len(notices) == 1 and f"the {features.family.title} features are RANDOM" in notices[0], notices
        assert features.family.name == family and features.blocks == 2 and features.token_table.shape == (300, 32)
    attention = features.llama.layers[0].self_attn
    assert attention.k_proj.out_features == 2 * attention.head_dim  # two kv heads of four


def write_config(directory, config) -> str:
    directory.mkdir()
    config.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize(
    "config, expected",
    [
        (T5Config(d_model=32, num_layers=2, num_heads=4, d_kv=8, d_ff=64), "is an encoder-decoder model"),
        (BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4), "is model_type 'bert'"),
        (OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64), "is model_type 'opt'"),
    ],
    ids=["encoder-decoder", "encoder-only", "another-decoder"],
)
def test_a_model_that_is_not_a_supported_decoder_is_one_line(tmp_path, config, expected):
    where = write_config(tmp_path / "model", config)  # its config alone: refused before any weight is read
    with pytest.raises(ValueError) as refused:
        FeatureModel(loaded(where), 300)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"feature_model.name_or_path={where} {expected}")
    assert message.endswith("gpt2 (gpt2); gpt_neox (gpt_neox); llama (llama, mistral, qwen2, qwen3)")


def test_a_hidden_state_that_does_not_exist_is_one_line(saved):
    with pytest.raises(ValueError, match=r"^feature_model\.hidden_state: hidden state 5 does not exist in a 4-layer "):
        FeatureModel(loaded(saved["gpt_neox"], hidden_state=5), 514)
    with pytest.raises(ValueError, match=r"hidden state -6 does not exist in a 4-layer Llama"):
        FeatureModel(loaded(saved["llama"], hidden_state=-6), 514)


@pytest.mark.parametrize(
    "keys, expected",
    [
        ({}, r"is a Llama decoder but tokenizer\.name_or_path=offline is GPT-2's BPE: set tokenizer\.name_or_path="),
        ({"model": {"max_length": 200}}, r"model\.max_length=200 exceeds the 128 positions of feature_model\."),
        ({"feature_model": {"hidden_state": 9}}, r"hidden state 9 does not exist in a 4-layer Llama"),
    ],
    ids=["gpt2-tokenizer", "positions", "hidden-state"],
)
def test_a_bad_choice_is_refused_from_the_decoders_config_alone(tmp_path, keys, expected):
    """Checked against config.json before any weight is read: the directory holds nothing else."""
    from transformers import LlamaConfig

    where = write_config(
        tmp_path / "llama",
        LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=128),
    )
    tokenizer = {} if keys == {} else {"tokenizer": {"name_or_path": "feature_model"}}
    section = {"name_or_path": where, "pretrained": True, **keys.get("feature_model", {})}
    cfg = config_from_dict({"model": keys.get("model", {}), "feature_model": section, **tokenizer})
    with pytest.raises((ConfigError, ValueError), match=expected):
        build_model(cfg)


@pytest.mark.parametrize("window, refused", [(4, True), (16, False), (None, False)])
def test_a_sliding_window_shorter_than_max_length_is_refused(tmp_path, window, refused):
    """A Mistral attends over its last ``sliding_window`` tokens; the feature model's layers run
    full causal attention, the same thing only when the window holds every position."""
    from transformers import MistralConfig

    from parallel_latent.feature_model.features import check_feature_model

    config = MistralConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, sliding_window=window
    )
    where = write_config(tmp_path / "mistral", config)
    section = {"name_or_path": where, "pretrained": True}
    cfg = config_from_dict(
        {"model": {"max_length": 16}, "feature_model": section, "tokenizer": {"name_or_path": "feature_model"}}
    )
    if not refused:
        check_feature_model(cfg)
        return
    with pytest.raises(ConfigError) as caught:
        check_feature_model(cfg)
    assert str(caught.value) == (
        f"feature_model.name_or_path={where} has sliding_window=4 (each token attends to the last 4 only), "
        "shorter than model.max_length=16: the feature model runs full causal attention, which would give other "
        "features from position 4 on"
    )


# ----------------------------------------------------------------------------- checkpoints


def autoencoder_config(directory, family: str, parallel: str = "replicate", tp: int = 1) -> tuple[Config, object]:
    cfg = config_from_dict(
        {
            "model": {"d_model": WIDTH, "n_heads": 4, "n_encoder_layers": 1, "n_decoder_layers": 1, "max_length": T},
            "feature_model": {"name_or_path": str(directory), "pretrained": True, "parallel": parallel},
            "tokenizer": {"name_or_path": "feature_model"},
            "parallel": {"tensor_parallel": tp},
        }
    )
    tokenizer = load_tokenizer(cfg.tokenizer)
    return apply_tokenizer_facts(cfg, tokenizer_facts(tokenizer)), tokenizer


@torch.no_grad()
def loss_of(model: LatentAutoencoder) -> float:
    ids, mask = padded_batch(model.model_cfg.vocab_size - 2)
    return model.eval()(ids.masked_fill(mask == 0, model.model_cfg.pad_token_id), mask).loss.item()


@pytest.fixture(scope="module")
def portable(saved, tmp_path_factory):
    """{family: (portable directory, its loss, its weights)}: each saved from a model loaded from its
    directory, which is then removed (as a hub model is absent on a machine without the hub)."""
    out = {}
    for family in FAMILIES:
        source = tmp_path_factory.mktemp(family) / "decoder"
        shutil.copytree(saved[family], source)
        cfg, tokenizer = autoencoder_config(source, family)
        model = build_model(cfg)
        directory = tmp_path_factory.mktemp(family) / "portable"
        save_portable(model, directory, cfg, tokenizer_facts(tokenizer))
        shutil.rmtree(source)
        out[family] = directory, loss_of(model), gathered_state(model, None)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_rebuilds_its_family_from_the_record_alone(portable, family):
    directory, loss, state = portable[family]
    model = load_autoencoder(directory)
    assert model.feature_model.family.name == family and model.feature_cfg.pretrained is False
    assert loss_of(model) == loss
    got = gathered_state(model, None)
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    assert any(key.startswith(f"feature_model.{family}.") for key in state)
    record = model.checkpoint_record()["feature_model_architecture"]
    if family != "gpt2":  # GPT-2 keeps the shape-only record older checkpoints have
        assert record["architecture"] == family and record["transformers_config"]["model_type"] == family


def load_at_tp_task(tp: int, directory: str):
    state = initialize_model_parallel(tp)
    model = load_autoencoder(directory, state.tp_group)
    return loss_of(model), gathered_state(model, state.tp_group)


def test_each_familys_checkpoint_loads_at_tp4(pool4, portable):
    for family in FAMILIES:
        directory, loss, state = portable[family]
        got_loss, got_state = pool4.run(load_at_tp_task, 4, str(directory))[0]
        cfg = load_autoencoder(directory).model_cfg
        k = autoencoder_reduction_length(cfg, 3 * T, 4)
        assert abs(got_loss - loss) <= order_bound(k, terms_scale(abs(loss), k)), family
        assert all(torch.equal(got_state[name], state[name]) for name in state), family


# ----------------------------------------------------------------------------- by hub name

HUB_FAMILIES = ("llama", "gpt_neox")
MISSING, CONFIG_ONLY = "tiny-org/missing", "tiny-org/config-only"


def hub_name(family: str) -> str:
    return f"tiny-org/{family}"


@pytest.fixture(scope="module")
def hub_cache(saved, tmp_path_factory):
    """A hub cache holding the tiny Llama and NeoX under hub names (as a download leaves them), and
    a model whose snapshot has its config.json but no weights."""
    cache = tmp_path_factory.mktemp("hub")
    for family in HUB_FAMILIES:
        into_hub_cache(cache, hub_name(family), saved[family])
    config_only = tmp_path_factory.mktemp("config-only")
    shutil.copy(saved["llama"] / "config.json", config_only)
    into_hub_cache(cache, CONFIG_ONLY, config_only)
    return cache


@torch.no_grad()
def features_and_state(model: LatentAutoencoder, tp_group) -> tuple[torch.Tensor, dict]:
    ids, mask = padded_batch(model.model_cfg.vocab_size - 2)
    return model.feature_model(ids, mask), gathered_state(model, tp_group)


def assert_bit_for_bit(by_name: tuple, by_path: tuple, where: str) -> None:
    (features, state), (want_features, want_state) = by_name, by_path
    assert torch.equal(features, want_features), where
    assert state.keys() == want_state.keys() and all(torch.equal(state[k], want_state[k]) for k in state), where


@pytest.mark.parametrize("family", HUB_FAMILIES)
def test_a_hub_name_builds_what_its_directory_builds(saved, hub_cache, family):
    """``feature_model.name_or_path: org/name`` with its own tokenizer, read offline from the hub
    cache: the same tokenizer, weights and features as the directory itself, bit for bit."""
    with offline_hub(hub_cache):
        cfg, tokenizer = autoencoder_config(hub_name(family), family)
        by_name = build_model(cfg)
    path_cfg, path_tokenizer = autoencoder_config(saved[family], family)
    assert cfg.tokenizer.name_or_path == hub_name(family) and cfg.model == path_cfg.model
    text = "It is a truth universally acknowledged"
    assert tokenizer(text)["input_ids"] == path_tokenizer(text)["input_ids"]
    assert by_name.feature_model.family.name == family
    assert_bit_for_bit(features_and_state(by_name, None), features_and_state(build_model(path_cfg), None), family)


def hub_shard_task(tp: int, cache: str, names: list[str], refused: list[str]) -> dict:
    """Each of ``names`` built as the autoencoder at ``tp`` with its decoder sharded, offline from
    ``cache``: its features and whole tensors; each of ``refused``'s sharded decoder: its one line."""
    group = initialize_model_parallel(tp).tp_group
    out = {}
    with offline_hub(cache):
        for name in names:
            model = build_model(autoencoder_config(name, "", "shard", tp)[0], group)
            assert model.feature_model.sharded
            out[name] = features_and_state(model, group)
        for name in refused:
            with pytest.raises(ConfigError) as error:
                FeatureModel(loaded(name, parallel="shard"), 514, tp_group=group)
            out[name] = str(error.value)
    return out


def test_a_hub_name_shards_as_its_directory_does_at_tp2(pool4, saved, hub_cache):
    """``parallel: shard`` reads the snapshot's safetensors slice by slice (``snapshot_download``
    with ``local_files_only``): what the directory gives, bit for bit; a snapshot without weights,
    or a name not in the cache, refused in one line."""
    names = [hub_name("llama"), str(saved["llama"])]
    for rank, got in enumerate(pool4.run(hub_shard_task, 2, str(hub_cache), names, [CONFIG_ONLY, MISSING])):
        assert_bit_for_bit(got[names[0]], got[names[1]], f"rank {rank}")
        assert got[CONFIG_ONLY].startswith(
            f"feature_model.name_or_path={CONFIG_ONLY}: feature_model.parallel=shard reads the weights slice by slice "
            "from local safetensors files, and its snapshot in the hub cache ("
        )
        assert got[CONFIG_ONLY].endswith(
            "holds no model.safetensors (or model.safetensors.index.json): download its safetensors weights first"
        )
        assert got[MISSING].startswith(f"feature_model.name_or_path={MISSING}: its config.json does not load: ")
        assert "\n" not in got[CONFIG_ONLY] + got[MISSING]


def test_a_hub_name_not_in_the_cache_is_one_line(hub_cache):
    """Offline, a name the cache lacks (or whose weights it lacks) is one line naming the key, as
    the command reports it (exit status 2), not transformers' traceback; a job checks the feature
    model when it plans, before any rank loads the tokenizer that is its own, so the line names
    feature_model."""
    from parallel_latent.feature_model.features import planned_decoder

    def refused(build) -> str:
        with pytest.raises(ConfigError) as error:
            build()
        message = str(error.value)
        assert "\n" not in message, message
        return message

    hub = "no such directory, and as a hub name: We couldn't connect to 'https://huggingface.co'"
    cfg = config_from_dict(
        {"feature_model": {"name_or_path": MISSING, "pretrained": True}, "tokenizer": {"name_or_path": "feature_model"}}
    )
    with offline_hub(hub_cache):
        message = refused(lambda: planned_decoder(cfg))
        assert message.startswith(f"feature_model.name_or_path={MISSING}: no such directory, and not in the Hugging ")
        message = refused(lambda: load_config(MISSING, f"feature_model.name_or_path={MISSING}"))
        assert message.startswith(f"feature_model.name_or_path={MISSING}: its config.json does not load: {hub}")
        message = refused(lambda: load_tokenizer(cfg.tokenizer))
        assert message.startswith(f"tokenizer.name_or_path={MISSING}: the tokenizer does not load: {hub}")
        message = refused(lambda: FeatureModel(loaded(CONFIG_ONLY), 514))
        assert message.startswith(f"feature_model.name_or_path={CONFIG_ONLY}: its weights do not load: ")
        message = refused(lambda: _weights_directory(MISSING))  # shard's own look-up in the cache
        assert message.endswith("it is neither a local directory nor in the hub cache: download it first")


def test_flops_count_the_loaded_decoders_own_products(saved):
    """A Llama's gated MLP and grouped-query attention have other products than GPT-2's 12 f^2: the
    FLOPs follow the weights the loaded layers hold."""
    from torch.utils.flop_counter import FlopCounterMode

    from parallel_latent.training.flops import model_flops_per_sample

    cfg, _ = autoencoder_config(saved["llama"], "llama")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.0))
    features = build_model(cfg).feature_model
    parts = model_flops_per_sample(cfg, features.blocks, features.width, features.matmul_weights)
    gpt2_like = model_flops_per_sample(cfg, features.blocks, features.width)
    assert parts["feature_linear"] != gpt2_like["feature_linear"]
    ids = torch.randint(0, 500, (2, T))
    with FlopCounterMode(display=False) as counter:
        features(ids, torch.ones_like(ids))
    assert counter.get_total_flops() / 2 == pytest.approx(parts["feature_linear"], rel=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_feature_forward_waits_for_nothing_and_builds_nothing_from_python_data(saved, family):
    """As GPT-2's: no device read, no data-dependent shape, no mask or tensor built on the host (each
    would stall a GPU's queue at every step); rotary positions are computed on the device."""
    from tests.helpers.op_counter import HostSyncCounter

    features = FeatureModel(loaded(saved[family]), 514)
    ids, mask = padded_batch(514)
    with HostSyncCounter() as counter:
        features(ids, mask)
    assert not counter.syncs, counter.syncs
    assert not counter.from_python_callers, counter.from_python_callers
