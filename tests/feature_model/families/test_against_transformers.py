"""Every decoder family, and every ``model_type`` it takes, as transformers builds it: the feature
model's features, replicated and sharded over TP=2 (read slice by slice from the saved safetensors),
equal transformers' own ``output_hidden_states`` at an early, a middle and the last hidden state
(the final norm), within a bound derived from the reduction lengths; the hidden state next to it is
far outside that bound. The variants are drawn from the registry, so a new family is covered here
by adding it. Real gloo ranks (tests/conftest.py's pool)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModel

from parallel_latent.config import FeatureModelConfig
from parallel_latent.feature_model import FeatureModel
from parallel_latent.feature_model.families import FAMILIES
from parallel_latent.parallel import initialize_model_parallel
from tests.helpers.tp_compare import order_bound, terms_scale

VOCAB, LAYERS, HEADS, KV_HEADS, WIDTH, POSITIONS, LENGTH, TP = 300, 4, 4, 2, 32, 64, 12, 2
INDICES = (1, -3, -1)
VARIANTS = [(family.name, model_type) for family in FAMILIES.values() for model_type in family.model_types]
# Config options that change a family's computation and that its layers (transformers' own) carry out.
OPTIONS = {
    "gpt2": {"scale_attn_by_inverse_layer_idx": True, "reorder_and_upcast_attn": True, "n_inner": 48},
    "gpt_neox": {"use_parallel_residual": False, "rotary_pct": 0.5, "attention_bias": False},
    "llama": {"attention_bias": True, "mlp_bias": True, "head_dim": 16},
}
CASES = [(name, model_type, {}) for name, model_type in VARIANTS] + [(name, name, OPTIONS[name]) for name in FAMILIES]


def save_variant(directory, family_name: str, model_type: str, options: dict):
    """A random base decoder of ``model_type`` in ``family_name``'s shape keys, saved with safetensors.
    A model type other than the family's own takes the family's config keys (transformers' defaults
    for the rest: Qwen2's q/k/v biases, Qwen3's per-head q/k norms, Mistral's window)."""
    config = FAMILIES[family_name].random_config(VOCAB, LAYERS, HEADS, WIDTH, POSITIONS, KV_HEADS)
    if config.model_type != model_type:
        keys = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        config = AutoConfig.for_model(model_type, **keys)
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(directory)
    return directory


def reduction_length(replicated: FeatureModel) -> int:
    """Terms summed on the path through the held layers, counted from the family's own plan on the
    replicated decoder: two norms, every projection's input width (q, k, v counted apart: an
    over-count, so a safe bound), scores (head width), softmax and weighted sums (T each), two
    all-reduces of a sharded layer (TP terms each) and 16 roundings for elementwise activations and
    rotary steps."""
    layer = getattr(replicated.decoder, replicated.family.layers)[0]
    inputs = 0
    for path in replicated.family.projections:
        module = layer.get_submodule(path)  # nn.Linear: weight [out, in]; GPT-2's Conv1D: [in, out]
        inputs += module.weight.shape[1] if isinstance(module, torch.nn.Linear) else module.weight.shape[0]
    head = replicated.width // getattr(replicated.decoder_config, replicated.family.heads_key)
    return replicated.blocks * (2 * replicated.width + inputs + head + 2 * LENGTH + 2 * TP + 16)


def against_transformers_task(tp: int, directory: str) -> list[dict]:
    group = initialize_model_parallel(tp).tp_group
    ids = torch.randint(0, VOCAB, (3, LENGTH), generator=torch.Generator().manual_seed(1))
    reference = AutoModel.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden_states = reference(input_ids=ids, output_hidden_states=True).hidden_states
    rows, n = [], 0
    for index in INDICES:
        for layout in ("replicate", "shard"):
            cfg = FeatureModelConfig(name_or_path=directory, pretrained=True, hidden_state=index, parallel=layout)
            model = FeatureModel(cfg, VOCAB, tp_group=group)
            with torch.no_grad():
                got = model(ids, torch.ones_like(ids))
            want, neighbour = hidden_states[index], hidden_states[index - 1]
            if layout == "replicate":  # the sharded layout sums the same terms, in another order
                n = reduction_length(model)
            rows.append({
                "where": f"hidden state {index}, {layout}",
                "sharded": model.sharded,
                "diff": (got - want).abs().max().item(),
                "bound": order_bound(n, terms_scale(want.abs().max().item(), n)),
                "neighbour": (neighbour - want).abs().max().item(),
            })  # fmt: skip
    return rows


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    return {
        (model_type, bool(options)): str(save_variant(root / f"{model_type}-{len(options)}", name, model_type, options))
        for name, model_type, options in CASES
    }


@pytest.mark.parametrize(
    ("family", "model_type", "options"), CASES, ids=[f"{t}{'-options' if o else ''}" for _, t, o in CASES]
)
def test_features_replicated_and_sharded_are_transformers_hidden_states(pool4, saved, family, model_type, options):
    for rank, rows in enumerate(pool4.run(against_transformers_task, TP, saved[model_type, bool(options)])):
        assert [row["sharded"] for row in rows] == [False, True] * len(INDICES), f"{model_type}: layouts"
        for row in rows:
            where = f"{family} ({model_type}) rank {rank}, {row['where']}"
            assert row["diff"] <= row["bound"], f"{where}: {row['diff']:.3g} from transformers > {row['bound']:.3g}"
            assert row["neighbour"] > 10 * row["bound"], f"{where}: the bound cannot tell the next hidden state"


def test_every_model_type_is_covered_and_the_config_offers_every_family():
    """The variants above come from the registry; the config's choices of a random build are its names."""
    import typing

    from parallel_latent.config import FeatureModelConfig as Section

    assert {name for name, _ in VARIANTS} == set(FAMILIES)
    assert set(typing.get_args(typing.get_type_hints(Section)["architecture"])) == set(FAMILIES)
