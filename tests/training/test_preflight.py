"""The checks ``train --nproc N`` runs in its own process before it launches a rank."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.trainer_runs import TINY, TINY_CONFIG, run

CHECK = """
import sys

import pytest
from parallel_latent.config import load_config
from parallel_latent.training.preflight import preflight
preflight(load_config(sys.argv[1], sys.argv[3:]), 2, sys.argv[1], processes_per_node=2)
print(sorted(name for name in ("transformers", "deepspeed") if name in sys.modules))
"""


def test_the_launchers_checks_load_neither_transformers_nor_deepspeed(tmp_path):
    """The launching process waits for its checks before any rank starts: they import torch only,
    not the seconds of transformers (the frozen GPT-2) and DeepSpeed that every rank imports anyway."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-c", CHECK, str(TINY_CONFIG), "-", *TINY, f"logging.run_dir={run_dir}"]
    result = run(command, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert not run_dir.exists()  # the checks write nothing


def _checkpoint_saved_over(tmp_path, cfg, name_or_path: str):
    """A checkpoint directory whose recorded config is ``cfg`` over the decoder ``name_or_path``."""
    import dataclasses
    import json

    step_dir = tmp_path / "checkpoints" / "step_00000001"
    step_dir.mkdir(parents=True)
    config = dataclasses.asdict(cfg)
    config["feature_model"]["name_or_path"] = name_or_path
    (step_dir / "checkpoint.json").write_text(json.dumps({"step": 1}))
    (step_dir / "client_state.json").write_text(json.dumps({"step": 1, "config": config}))
    return step_dir


def test_a_resume_over_another_pretrained_decoder_says_the_checkpoints_is_kept(tmp_path, caplog):
    """The frozen decoder's weights are in the checkpoint: resuming with another
    feature_model.name_or_path (same shapes, same keys) keeps the saved one, said in one line by the
    plan's check and not by the ranks' check after it; the same directory written another way says
    nothing."""
    from parallel_latent.config import load_config
    from parallel_latent.training.preflight import require_same_model, require_same_vocabulary

    cfg = load_config(TINY_CONFIG, ["feature_model.pretrained=true"])
    (tmp_path / "trained").mkdir()
    (tmp_path / "other").mkdir()
    step_dir = _checkpoint_saved_over(tmp_path, cfg, str(tmp_path / "trained"))
    cfg.feature_model.name_or_path = str(tmp_path / "trained" / ".." / "trained")
    with caplog.at_level("WARNING", logger="parallel_latent"):
        require_same_model(cfg, step_dir)
        assert not caplog.records
        cfg.feature_model.name_or_path = str(tmp_path / "other")
        require_same_model(cfg, step_dir)
        require_same_vocabulary(cfg, step_dir)  # the ranks' check once the tokenizer is loaded: no notice
    assert [r.getMessage() for r in caplog.records] == [
        f"{step_dir} keeps the decoder it was trained over ({tmp_path / 'trained'}, its weights saved in the "
        f"checkpoint): feature_model.name_or_path={tmp_path / 'other'} is replaced by it"
    ]


def test_the_plan_reads_a_pretrained_decoders_config_once_and_the_model_is_built_from_it(tmp_path):
    """A pretrained decoder's files are read and its config.json checked when the job is planned,
    once; the ranks build the decoder from the plan's config (carried in the environment as JSON):
    a config.json broken after planning is not read again (the same tokenizer and weights load), where a model
    built without the plan would read it and be refused; a plan over it is refused in one line, with
    nothing written."""
    import torch

    from parallel_latent.config import ConfigError, load_config
    from parallel_latent.feature_model.tokenizer import apply_tokenizer_facts, load_tokenizer, tokenizer_facts
    from parallel_latent.model import build_model
    from parallel_latent.training.decoder_plan import with_planned_decoder
    from parallel_latent.training.preflight import JobPlan, preflight
    from tests.helpers.decoders import save_tiny_decoder, small_tokenizer

    decoder = save_tiny_decoder(tmp_path / "decoder", "llama", small_tokenizer())
    run_dir = tmp_path / "run"
    overrides = [f"feature_model.name_or_path={decoder}", "feature_model.pretrained=true",
                 "tokenizer.name_or_path=feature_model", f"logging.run_dir={run_dir}"]  # fmt: skip
    cfg = load_config(TINY_CONFIG, overrides)
    plan = JobPlan.from_json(with_planned_decoder(cfg, preflight(cfg, 2, "job.yaml")).to_json())  # as a rank gets it
    assert plan.decoder_config["model_type"] == "llama"
    tokenizer = load_tokenizer(cfg.tokenizer)
    cfg = apply_tokenizer_facts(cfg, tokenizer_facts(tokenizer))
    read_here = build_model(cfg).feature_model.state_dict()
    (decoder / "config.json").write_text("{")
    again = load_tokenizer(cfg.tokenizer, decoder_config=plan.decoder_config)
    assert again.get_vocab() == tokenizer.get_vocab()
    planned = build_model(cfg, None, plan.decoder_config).feature_model.state_dict()
    assert planned.keys() == read_here.keys()
    assert all(torch.equal(planned[name], read_here[name]) for name in read_here)
    for refused in (lambda: build_model(cfg), lambda: with_planned_decoder(cfg, preflight(cfg, 2, "job.yaml"))):
        with pytest.raises(ConfigError) as error:
            refused()
        message = str(error.value)
        assert message.startswith(f"feature_model.name_or_path={decoder}: ") and "\n" not in message, message
    assert not run_dir.exists()
