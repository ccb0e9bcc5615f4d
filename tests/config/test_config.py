"""YAML configs: typed validation, one-line errors, overrides, world-size checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from parallel_latent.config import (
    Config,
    ConfigError,
    ExportConfig,
    FeatureModelConfig,
    ModelConfig,
    build_dataclass,
    config_from_dict,
    config_to_dict,
    export_config_from_dict,
    load_config,
    save_config,
)
from parallel_latent.training.world import dp_size, resolved_global_batch_size, validate_world

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
GPT2 = REPO / "configs" / "gpt2.yaml"


def write_yaml(tmp_path: Path, data: object, name: str = "x.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def config_error(data: dict, source: str = "configs/x.yaml") -> str:
    """The message of the ConfigError that ``data`` raises; asserts it is one line."""
    with pytest.raises(ConfigError) as caught:
        config_from_dict(data, source)
    message = str(caught.value)
    assert "\n" not in message, message
    assert message.startswith(f"{source}: "), message
    return message


# --------------------------------------------------------------------------- #
# The shipped configs.
# --------------------------------------------------------------------------- #


def test_tiny_yaml_loads_with_demo_values():
    cfg = load_config(TINY)
    assert (cfg.model.d_model, cfg.model.n_heads) == (64, 4)
    assert (cfg.model.n_encoder_layers, cfg.model.n_decoder_layers) == (1, 1)
    assert cfg.model.max_length == 16 and cfg.model.dropout == 0.0
    assert cfg.feature_model.pretrained is False
    assert (cfg.feature_model.n_layer, cfg.feature_model.n_head, cfg.feature_model.n_embd) == (
        4,
        4,
        64,
    )
    assert (cfg.parallel.tensor_parallel, cfg.parallel.zero_stage) == (2, 2)
    assert cfg.training.max_steps == 500 and cfg.training.micro_batch_size == 16
    assert cfg.optimizer.lr == 2.5e-3 and cfg.optimizer.betas == [0.9, 0.95]
    assert cfg.model.head == "tied" and cfg.training.eval_batches == 7
    assert cfg.training.log_every == 10 and cfg.training.eval_every == 100
    assert cfg.logging.run_dir == "runs/tiny"


def test_tiny_yaml_spells_out_every_key_and_loads_faithfully():
    raw = yaml.safe_load(TINY.read_text())
    defaults = config_to_dict(Config())
    assert {section: set(values) for section, values in raw.items()} == {
        section: set(values) for section, values in defaults.items()
    }
    # Every value in the file arrives unchanged in the typed config.
    assert config_to_dict(load_config(TINY)) == raw


def test_gpt2_yaml_loads_with_realistic_values():
    cfg = load_config(GPT2)
    assert cfg.feature_model.name_or_path == "gpt2" and cfg.feature_model.pretrained is True
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.max_length) == (768, 12, 64)
    assert (cfg.model.n_encoder_layers, cfg.model.n_decoder_layers) == (6, 6)
    assert cfg.training.precision == "bf16" and cfg.training.micro_batch_size == 32
    assert (cfg.parallel.tensor_parallel, cfg.parallel.zero_stage) == (1, 2)
    assert cfg.optimizer.lr == 3e-4 and cfg.training.max_steps == 20000


def test_empty_file_and_missing_sections_mean_defaults(tmp_path):
    assert load_config(write_yaml(tmp_path, "")) == Config()
    assert config_from_dict({"model": None, "data": {}}) == Config()


# --------------------------------------------------------------------------- #
# Unknown keys and types.
# --------------------------------------------------------------------------- #


def test_unknown_key_names_file_dotted_key_and_known_keys():
    message = config_error({"model": {"n_headz": 4}})
    assert message.startswith("configs/x.yaml: model.n_headz: unknown key")
    assert "did you mean 'n_heads'" in message
    assert "known: d_model, n_heads," in message


def test_unknown_section():
    message = config_error({"modle": {}})
    assert message.startswith("configs/x.yaml: modle: unknown key, did you mean 'model'?")


@pytest.mark.parametrize(
    "section, key, value, expected",
    [
        ("model", "d_model", "64", "model.d_model: expected int, got str '64'"),
        ("model", "d_model", True, "model.d_model: expected int, got bool True"),
        ("model", "d_model", 64.0, "model.d_model: expected int, got float 64.0"),
        ("model", "dropout", "a tenth", "model.dropout: expected float, got str 'a tenth'"),
        ("model", "dropout", False, "model.dropout: expected float, got bool False"),
        (
            "model",
            "activation_checkpointing",
            1,
            "model.activation_checkpointing: expected bool, got int 1",
        ),
        ("data", "path", 3, "data.path: expected str, got int 3"),
        ("optimizer", "betas", 0.9, "optimizer.betas: expected list of float, got float 0.9"),
        ("optimizer", "betas", [0.9, "x"], "optimizer.betas[1]: expected float, got str 'x'"),
        (
            "training",
            "precision",
            "fp8",
            "training.precision: 'fp8' is not one of fp32, bf16, fp16, fp64",
        ),
        (
            "schedule",
            "decay",
            "exp",
            "schedule.decay: 'exp' is not one of cosine, constant, linear",
        ),
        ("data", "format", "xml", "data.format: 'xml' is not one of auto, text, jsonl, parquet, csv"),
        ("data", "sample_unit", "word", "data.sample_unit: 'word' is not one of line, paragraph"),
        ("parallel", "backend", "mpi", "parallel.backend: 'mpi' is not one of auto, gloo, nccl"),
        ("training", "device", "tpu", "training.device: 'tpu' is not one of auto, cpu, cuda"),
    ],
)
def test_wrong_types_are_one_line_errors(section, key, value, expected):
    assert config_error({section: {key: value}}) == f"configs/x.yaml: {expected}"


def test_section_must_be_a_mapping():
    assert "model: expected ModelConfig, got list" in config_error({"model": [1, 2]})


def test_int_is_accepted_for_float_and_converted():
    cfg = config_from_dict({"model": {"dropout": 0}, "optimizer": {"lr": 1, "betas": [0, 0]}})
    assert cfg.model.dropout == 0.0 and isinstance(cfg.model.dropout, float)
    assert isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.betas == [0.0, 0.0] and all(isinstance(b, float) for b in cfg.optimizer.betas)


def test_tuple_betas_are_accepted_as_a_list():
    cfg = config_from_dict({"optimizer": {"betas": (0.8, 0.9)}})
    assert cfg.optimizer.betas == [0.8, 0.9]


@dataclass
class _Inner:
    width: int = 1


@dataclass
class _Schema:
    maybe_size: int | None = None
    pair: tuple[int, str] = (1, "a")
    sizes: tuple[int, ...] = ()
    inner: _Inner = field(default_factory=_Inner)


def test_generic_validator_optional_and_tuple_fields():
    built = build_dataclass(_Schema, {"maybe_size": None, "pair": [2, "b"], "sizes": [1, 2, 3]})
    assert built == _Schema(maybe_size=None, pair=(2, "b"), sizes=(1, 2, 3), inner=_Inner())
    assert build_dataclass(_Schema, {"maybe_size": 5}).maybe_size == 5
    with pytest.raises(ConfigError, match=r"^f.yaml: maybe_size: expected int or null, got str 'x'$"):
        build_dataclass(_Schema, {"maybe_size": "x"}, "f.yaml")
    with pytest.raises(ConfigError, match=r"^f.yaml: pair: expected 2 items, got 3$"):
        build_dataclass(_Schema, {"pair": [1, "a", 2]}, "f.yaml")
    with pytest.raises(ConfigError, match=r"^f.yaml: pair\[1\]: expected str, got int 2$"):
        build_dataclass(_Schema, {"pair": [1, 2]}, "f.yaml")
    with pytest.raises(ConfigError, match=r"^f.yaml: inner.depth: unknown key"):
        build_dataclass(_Schema, {"inner": {"depth": 2}}, "f.yaml")


# --------------------------------------------------------------------------- #
# Cross-field constraints.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "data, expected",
    [
        (
            {"parallel": {"tensor_parallel": 3}},
            "parallel.tensor_parallel=3 does not divide model.n_heads=4",
        ),
        (
            {"parallel": {"tensor_parallel": 0}},
            "parallel.tensor_parallel=0 must be >= 1",
        ),
        (
            {"model": {"n_heads": 3}},
            "model.n_heads=3 does not divide model.d_model=64",
        ),
        (
            {"model": {"d_model": 32}},
            "feature_model.n_embd=64 must equal model.d_model=32 (feature_model.pretrained is false)",
        ),
        ({"model": {"dropout": 1.0}}, "model.dropout=1.0 must be in [0, 1)"),
        ({"model": {"dropout": -0.1}}, "model.dropout=-0.1 must be in [0, 1)"),
        ({"parallel": {"zero_stage": 4}}, "parallel.zero_stage=4 must be 0, 1, 2 or 3"),
        (
            {"model": {"max_length": 64}, "feature_model": {"n_positions": 32}},
            "model.max_length=64 exceeds feature_model.n_positions=32",
        ),
        ({"model": {"n_encoder_layers": 0}}, "model.n_encoder_layers=0 must be >= 1"),
        ({"training": {"micro_batch_size": 0}}, "training.micro_batch_size=0 must be >= 1"),
        ({"training": {"global_batch_size": -1}}, "training.global_batch_size=-1 must be >= 0"),
        (
            {"training": {"micro_batch_size": 4, "grad_accum_steps": 2, "global_batch_size": 12}},
            "training.global_batch_size=12 is not a multiple of training.micro_batch_size*training.grad_accum_steps=8",
        ),
        ({"optimizer": {"lr": 0}}, "optimizer.lr=0.0 must be > 0"),
        ({"optimizer": {"betas": [0.9]}}, "optimizer.betas must have 2 items, got 1"),
        ({"optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas[1]=1.0 must be in [0, 1)"),
        ({"schedule": {"min_lr_ratio": 1.5}}, "schedule.min_lr_ratio=1.5 must be in [0, 1]"),
        ({"data": {"eval_fraction": 1.0}}, "data.eval_fraction=1.0 must be in [0, 1)"),
        (
            {"model": {"vocab_size": 100}},
            "model.mask_token_id=50257 must be in [0, model.vocab_size=100)",
        ),
        (
            {"feature_model": {"n_layer": 1}},
            "feature_model.n_layer=1 has no hidden state -3 (feature_model.hidden_state; a 1-layer decoder's are "
            "0 to 1, or -2 to -1)",
        ),
        ({"feature_model": {"n_layer": 0}}, "feature_model.n_layer=0 must be >= 1"),
        (
            {"feature_model": {"hidden_state": 5}},
            "feature_model.n_layer=4 has no hidden state 5 (feature_model.hidden_state; a 4-layer decoder's are "
            "0 to 4, or -5 to -1)",
        ),
        (
            {"feature_model": {"n_kv_head": 3}},
            "feature_model.n_kv_head=3 is for architecture llama (grouped-query attention), not gpt2",
        ),
        (
            {"feature_model": {"architecture": "llama", "n_kv_head": 3}},
            "feature_model.n_kv_head=3 does not divide feature_model.n_head=4",
        ),
        (
            {"feature_model": {"architecture": "bert"}},
            "feature_model.architecture: 'bert' is not one of gpt2, gpt_neox, llama",
        ),
        ({"model": {"num_latents": -1}}, "model.num_latents=-1 must be >= 0"),
        (
            {"model": {"max_length": 16, "num_latents": 17}},
            "model.num_latents=17 exceeds model.max_length=16: at most one latent per position",
        ),
        (
            {"model": {"latent_dim": 65}},
            "model.latent_dim=65 exceeds model.d_model=64: a bottleneck narrows",
        ),
        (
            {"model": {"max_length": 32, "num_latents": 6}},
            "model.num_latents=6: a latent covers up to 6 of the model.max_length=32 positions, more than "
            "model.n_heads=4 (each position starts in a head of its own: raise num_latents or n_heads)",
        ),
        (
            {"model": {"max_length": 32, "num_latents": 16, "encoder_context_positions": False}},
            "model.num_latents=16 < model.max_length=32 needs model.encoder_context_positions: true "
            "(the encoder's latents start reading their own positions)",
        ),
        (
            {
                "model": {"max_length": 32, "num_latents": 10},
                "parallel": {"sequence_parallel": True, "tensor_parallel": 4},
            },
            "parallel.sequence_parallel: model.num_latents=10 is not divisible by parallel.tensor_parallel=4 "
            "(each rank holds num_latents / tensor_parallel latents)",
        ),
    ],
)
def test_impossible_combinations_are_one_line_errors(data, expected):
    assert config_error(data) == f"configs/x.yaml: {expected}"


def test_feature_width_is_not_checked_for_pretrained_models():
    cfg = config_from_dict({"model": {"d_model": 128}, "feature_model": {"pretrained": True}})
    assert cfg.model.d_model == 128


def test_valid_tensor_parallel_degrees():
    for tp in (1, 2, 4):
        assert config_from_dict({"parallel": {"tensor_parallel": tp}}).parallel.tensor_parallel == tp


# --------------------------------------------------------------------------- #
# Overrides.
# --------------------------------------------------------------------------- #


def test_overrides_are_parsed_as_yaml_and_applied_before_validation():
    cfg = load_config(
        TINY,
        [
            "training.max_steps=10",
            "model.dropout=0.0",
            "data.path=/x",
            "optimizer.betas=[0.8, 0.9]",
            "logging.tensorboard=false",
            "checkpoint.resume=never",
        ],
    )
    assert cfg.training.max_steps == 10
    assert cfg.model.dropout == 0.0
    assert cfg.data.path == "/x"
    assert cfg.optimizer.betas == [0.8, 0.9]
    assert cfg.logging.tensorboard is False
    assert cfg.checkpoint.resume == "never"


def test_override_of_a_string_field_keeps_the_text():
    cfg = load_config(TINY, ["logging.run_dir=2024", "data.path=", "tokenizer.name_or_path=null"])
    assert cfg.logging.run_dir == "2024"
    assert cfg.data.path == ""
    assert cfg.tokenizer.name_or_path == "null"


def test_override_of_a_whole_section_updates_it():
    cfg = load_config(TINY, ["model={d_model: 128, n_heads: 8}", "feature_model.n_embd=128"])
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.n_encoder_layers) == (128, 8, 1)


def test_override_errors_name_the_override():
    with pytest.raises(ConfigError) as caught:
        load_config(TINY, ["model.n_headz=3"])
    assert str(caught.value).startswith(
        f"{TINY}: override 'model.n_headz=3': unknown key model.n_headz, did you mean 'n_heads'?"
    )
    with pytest.raises(ConfigError, match=r"override 'trainin.max_steps=1': unknown key trainin"):
        load_config(TINY, ["trainin.max_steps=1"])
    with pytest.raises(ConfigError, match=r"override 'training.max_steps': expected key.sub=value"):
        load_config(TINY, ["training.max_steps"])
    with pytest.raises(ConfigError, match=r"unknown key model.d_model.x"):
        load_config(TINY, ["model.d_model.x=1"])


def test_override_values_are_validated():
    with pytest.raises(ConfigError, match=r"training.max_steps: expected int, got str 'ten'"):
        load_config(TINY, ["training.max_steps=ten"])
    with pytest.raises(ConfigError, match=r"parallel.tensor_parallel=3 does not divide"):
        load_config(TINY, ["parallel.tensor_parallel=3"])


# --------------------------------------------------------------------------- #
# Files: errors, saving and reading back.
# --------------------------------------------------------------------------- #


def test_file_errors_are_one_line(tmp_path):
    cases = [
        (tmp_path / "missing.yaml", "config file not found"),
        (write_yaml(tmp_path, "model: [1, 2\n", "bad.yaml"), "invalid YAML at line"),
        (write_yaml(tmp_path, "- 1\n- 2\n", "list.yaml"), "expected a mapping of sections"),
    ]
    for path, expected in cases:
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        message = str(caught.value)
        assert message.startswith(f"{path}: ") and expected in message and "\n" not in message


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    """YAML keeps the second of two equal keys and loses the first without a word: a section or a
    setting written twice is refused, naming the dotted key and both lines."""
    section = write_yaml(tmp_path, "training:\n  max_steps: 5\nmodel:\n  d_model: 32\ntraining:\n  seed: 3\n")
    with pytest.raises(ConfigError) as caught:
        load_config(section)
    assert str(caught.value) == f"{section}: training: given twice, at lines 1 and 5"
    setting = write_yaml(tmp_path, "model:\n  d_model: 32\n  n_heads: 4\n  d_model: 64\n", "setting.yaml")
    with pytest.raises(ConfigError) as caught:
        load_config(setting)
    assert str(caught.value) == f"{setting}: model.d_model: given twice, at lines 2 and 4"
    nested = write_yaml(tmp_path, "data:\n  sources:\n    - {path: a, path: b}\n", "nested.yaml")
    with pytest.raises(ConfigError, match=r": data.sources.path: given twice, at lines 3 and 3$"):
        load_config(nested)


def test_error_names_the_yaml_file(tmp_path):
    path = write_yaml(tmp_path, {"model": {"n_headz": 4}})
    with pytest.raises(ConfigError, match=rf"^{path}: model.n_headz: unknown key"):
        load_config(path)


def test_save_and_load_round_trip(tmp_path):
    cfg = load_config(GPT2, ["training.max_steps=7", "optimizer.betas=[0.5, 0.25]"])
    saved = tmp_path / "run" / "config.yaml"
    save_config(cfg, saved)
    assert load_config(saved) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert isinstance(config_to_dict(cfg)["optimizer"]["betas"], list)


def test_configs_work_with_dataclasses_replace():
    cfg = Config()
    changed = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=32))
    assert changed.model.d_model == 32 and cfg.model.d_model == 64
    assert isinstance(changed.model, ModelConfig)


# --------------------------------------------------------------------------- #
# World size.
# --------------------------------------------------------------------------- #


def test_world_size_checks():
    cfg = load_config(TINY)  # TP=2, micro 16, accum 1
    validate_world(cfg, 2)
    validate_world(cfg, 4)
    assert dp_size(cfg, 4) == 2 and dp_size(cfg, 2) == 1
    assert resolved_global_batch_size(cfg, 4) == 32
    with pytest.raises(ConfigError) as caught:
        validate_world(cfg, 3, "configs/tiny.yaml")
    assert str(caught.value) == ("configs/tiny.yaml: world size 3 is not divisible by parallel.tensor_parallel=2")
    with pytest.raises(ConfigError):
        dp_size(cfg, 3)


def test_global_batch_size_must_match_the_world():
    cfg = load_config(TINY, ["training.global_batch_size=64", "training.grad_accum_steps=2"])
    validate_world(cfg, 4)  # 16 x 2 x dp 2 = 64
    with pytest.raises(ConfigError) as caught:
        validate_world(cfg, 8, "configs/tiny.yaml")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("configs/tiny.yaml: training.global_batch_size=64 != ")
    assert "micro_batch_size=16" in message and "grad_accum_steps=2" in message
    assert "data-parallel size 4" in message and message.endswith("= 128")


@pytest.mark.parametrize("written", ["5e-3", "1e-4", "3E-5", "2.5E+1", ".5", "7"])
def test_floats_as_people_write_them(tmp_path, written):
    """YAML 1.1 (PyYAML) reads 5e-3 as a string; wherever a float is expected it is the number,
    in a file and on the command line."""
    path = write_yaml(tmp_path, f"optimizer:\n  lr: {written}\n  eps: {written}\n")
    from_file = load_config(path)
    assert from_file.optimizer.lr == from_file.optimizer.eps == float(written)
    overridden = load_config(TINY, [f"optimizer.lr={written}", f"model.init_std={written}"])
    assert overridden.optimizer.lr == overridden.model.init_std == float(written)


@pytest.mark.parametrize("written", ["1e-3x", "inf", "nan", "1_000", "five"])
def test_strings_that_are_not_numbers_stay_errors(written):
    message = config_error({"optimizer": {"lr": written}})
    assert f"optimizer.lr: expected float, got str '{written}'" in message


def test_floats_inside_lists_too():
    assert load_config(TINY, ["optimizer.betas=[9E-1, 9.5e-1]"]).optimizer.betas == [0.9, 0.95]


def test_an_integer_key_does_not_take_a_float_literal():
    assert "training.max_steps: expected int, got str '1e3'" in config_error({"training": {"max_steps": "1e3"}})


@pytest.mark.parametrize(
    ("world", "tp", "micro", "saved", "want"),
    [
        (4, 2, 8, 8, (4, 1, None)),  # DP 2: each rank's 4 samples in one micro-batch
        (2, 2, 8, 8, (8, 1, "unchanged")),  # the same layout: nothing to do
        (1, 1, 4, 16, (4, 4, None)),  # DP 1: accumulate 4 micro-batches of the configured 4
        (8, 2, 16, 24, (6, 1, None)),  # DP 4: 6 per rank, micro-batches of at most 16
        (2, 1, 5, 40, (5, 4, None)),  # 20 per rank: 4 x 5
        (2, 1, 6, 40, (5, 4, None)),  # 20 per rank: 6 does not divide it, the largest divisor below does
    ],
)
def test_resume_keeps_the_checkpoints_global_batch(world, tp, micro, saved, want):
    from parallel_latent.training.world import keep_global_batch

    cfg = config_from_dict({"parallel": {"tensor_parallel": tp}, "training": {"micro_batch_size": micro}})
    kept, note = keep_global_batch(cfg, world, saved, "ck")
    training = kept.training
    assert (training.micro_batch_size, training.grad_accum_steps) == want[:2]
    assert training.micro_batch_size * training.grad_accum_steps * (world // tp) == saved
    if want[2] == "unchanged":
        assert note is None and kept is cfg
    else:
        assert note.startswith(f"global batch {saved} kept from the checkpoint: micro-batch {want[0]} x {want[1]}")


def test_resume_refuses_what_cannot_be_kept_in_one_line():
    from parallel_latent.training.world import keep_global_batch

    cfg = config_from_dict({"parallel": {"tensor_parallel": 1}})
    with pytest.raises(ConfigError, match=r"global batch of 16, which does not split over 3 data-parallel ranks"):
        keep_global_batch(cfg, 3, 16, "ck")
    explicit = config_from_dict({"training": {"micro_batch_size": 4, "global_batch_size": 8}})
    with pytest.raises(ConfigError, match=r"global_batch_size=8 but ck was trained with a global batch of 16"):
        keep_global_batch(explicit, 2, 16, "ck")
    assert keep_global_batch(explicit, 2, 8, "ck") == (explicit, None)


# --------------------------------------------------------------------------- #
# The schema documents itself: each key's meaning and bound sit next to the key.
# --------------------------------------------------------------------------- #


def every_key() -> list[str]:
    return [f"{section}.{key}" for section, values in config_to_dict(Config()).items() for key in values]


def test_every_key_is_in_the_schema_listing_with_a_meaning():
    from parallel_latent.config import Config, schema_keys

    keys = schema_keys(Config)
    assert [key for key, *_ in keys] == every_key()
    assert [key for key, _, doc, _ in keys if not doc] == []


def test_config_list_prints_every_key_with_its_default_and_meaning(capsys):
    from parallel_latent.cli import main

    assert main(["config", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    export_keys = [f"export.{item.name}" for item in dataclasses.fields(ExportConfig)]
    assert [line.split()[0] for line in lines] == every_key() + export_keys
    dropout = next(line for line in lines if line.startswith("model.dropout "))
    assert " 0.1 " in dropout and "must be in [0, 1)" in dropout


def test_export_settings_are_checked_with_their_line():
    assert export_config_from_dict({}) == ExportConfig()
    for values, words in [
        ({"batch_size": 0}, "x: export.batch_size=0 must be >= 1"),
        ({"shard_size": 0}, "x: export.shard_size=0 must be >= 1"),
        ({"precision": "fp16"}, "x: export.precision: 'fp16' is not one of fp32, bf16"),
        ({"batch_size": 8, "shard_size": 12}, "x: export.shard_size=12 is not a multiple of export.batch_size=8"),
        ({"batch": 8}, "x: export.batch: unknown key"),
    ]:
        with pytest.raises(ConfigError) as caught:
            export_config_from_dict(values, "x")
        assert str(caught.value).startswith(words), str(caught.value)


def just_outside(bound_words: str, default):
    """A value that breaks a bound, from the bound's own words."""
    if bound_words.startswith("must be >= "):
        return type(default)(float(bound_words.removeprefix("must be >= ")) - 1)
    if bound_words == "must be > 0":
        return type(default)(0)
    if bound_words.startswith("must be in [0, 1"):
        return 1.5
    if bound_words == "must be 0, 1, 2 or 3":
        return 4
    if bound_words.startswith("must have 2 items"):
        return [0.9, 1.0]
    return ""  # must not be empty / must be auto, never or a path


def test_every_bound_is_enforced_with_its_line():
    """For each bounded key, a value just outside its bound is refused in one line naming the key."""
    from parallel_latent.config import Config, schema_keys

    bounded = [(key, default, bound) for key, default, _, bound in schema_keys(Config) if bound is not None]
    assert len(bounded) >= 40
    for key, default, bound in bounded:
        section, name = key.split(".")
        with pytest.raises(ConfigError) as caught:
            config_from_dict({section: {name: just_outside(bound.must, default)}}, "x.yaml")
        assert str(caught.value).startswith(f"x.yaml: {key}") and "must" in str(caught.value), key


@pytest.mark.parametrize("written", ["parallel.zero_overlap_comm=on", "parallel.zero_overlap_comm=off"])
def test_on_and_off_choices_survive_yaml_booleans_in_overrides_and_files(written, tmp_path):
    """YAML 1.1 reads an unquoted on / off as a bool; a key whose choices are auto | on | off still
    gets the word, from the command line and from a file alike."""
    word = written.split("=")[1]
    assert load_config(TINY, [written]).parallel.zero_overlap_comm == word
    path = tmp_path / "c.yaml"
    path.write_text(f"parallel:\n  zero_overlap_comm: {word}\noptimizer:\n  fused: {word}\n")
    cfg = load_config(path)
    assert (cfg.parallel.zero_overlap_comm, cfg.optimizer.fused) == (word, word)


def test_latent_keys_at_their_default_are_the_model_of_zero():
    """num_latents = max_length and latent_dim = d_model describe the model of 0 (no compression):
    a checkpoint written either way loads into the other; checkpoints written before the keys
    existed (the v1 fixture) mean 0 and no predicted length."""
    zero = ModelConfig(max_length=16, d_model=64)
    spelled = dataclasses.replace(zero, num_latents=16, latent_dim=64)
    assert zero.difference(dataclasses.asdict(spelled)) is None
    assert spelled.difference(dataclasses.asdict(zero)) is None
    old = {
        k: v for k, v in dataclasses.asdict(zero).items() if k not in ("num_latents", "latent_dim", "predict_length")
    }
    assert spelled.difference(old) is None
    compressed = dataclasses.replace(zero, num_latents=8)
    assert compressed.difference(old) == "model.num_latents is 0 in the checkpoint but 8 in the model"
    assert dataclasses.replace(zero, predict_length=True).difference(old) == (
        "model.predict_length is False in the checkpoint but True in the model"
    )


def test_a_feature_model_that_chooses_another_decoder_is_a_difference():
    """The keys that choose the decoder differ (and the ones a built one is built from); the layout
    (parallel), where a loaded decoder's files are and its unused build keys do not; keys a checkpoint
    predates (the v1 fixture: no hidden_state, architecture, n_kv_head, parallel) mean their default."""
    built = FeatureModelConfig(n_layer=3, n_head=2, n_embd=16, n_positions=8)
    v1 = {"name_or_path": "gpt2", "pretrained": False, "frozen": True, "n_layer": 3, "n_head": 2, "n_embd": 16,
          "n_positions": 8}  # fmt: skip
    assert built.difference(v1) is None and built.difference(None) is None
    assert dataclasses.replace(built, parallel="shard").difference(v1) is None
    assert dataclasses.replace(built, name_or_path="elsewhere").difference(v1) is None  # a build reads no files
    assert dataclasses.replace(built, n_kv_head=2).difference(v1) is None  # 0 kv heads: one per head
    for key, value in (("hidden_state", -2), ("n_layer", 4), ("architecture", "llama"), ("frozen", False)):
        changed = dataclasses.replace(built, **{key: value})
        assert changed.difference(v1) == (
            f"feature_model.{key} is {v1.get(key, getattr(built, key))!r} in the checkpoint but {value!r} in the config"
        )
    loaded = dataclasses.replace(built, pretrained=True, name_or_path="/models/pythia")
    record = dataclasses.asdict(loaded)
    assert dataclasses.replace(loaded, n_layer=12).difference(record) is None  # read from the decoder's config
    # Its files moved (a resume takes the decoder's weights from the checkpoint).
    assert dataclasses.replace(loaded, name_or_path="/elsewhere/pythia").difference(record) is None
    assert loaded.difference(v1) == "feature_model.pretrained is False in the checkpoint but True in the config"
