"""A job's plan of its pretrained decoder (:class:`.preflight.JobPlan`'s ``decoder_config``): its
weight files read whole and its ``config.json`` read and checked once, against the config and
against the decoder of the checkpoint the plan resumes. The ranks build the decoder, and a
tokenizer of its own, from that config without reading the file again. Apart from
:mod:`.preflight` because it imports transformers, which the launcher of a random-weight decoder
never needs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from parallel_latent.checkpoint.layout import INFO_FILE, read_info
from parallel_latent.config import Config
from parallel_latent.errors import CheckpointError
from parallel_latent.feature_model.features import planned_decoder
from parallel_latent.feature_model.from_record import loaded_decoder_difference

from .preflight import JobPlan

__all__ = ["require_same_decoder", "with_planned_decoder"]


def with_planned_decoder(cfg: Config, plan: JobPlan) -> JobPlan:
    """``plan`` with the pretrained decoder's config (unchanged for a random decoder); ConfigError
    or CheckpointError in one line, before anything is written."""
    if not cfg.feature_model.pretrained:
        return plan
    decoder_config = planned_decoder(cfg)
    require_same_decoder(cfg, plan.resume_path, decoder_config)
    return dataclasses.replace(plan, decoder_config=decoder_config)


def require_same_decoder(cfg: Config, path: Path | None, decoder_config: dict | None) -> None:
    """CheckpointError (one line) when the pretrained decoder ``cfg`` names (``decoder_config``, as
    planned) is now another decoder than the one the checkpoint at ``path`` was trained over
    (another family, head count or parameter shape): found from both configs, not by the engine's
    load of the weights."""
    if path is None or decoder_config is None:
        return
    record = read_info(path).get("model_record") or {}
    if problem := loaded_decoder_difference(cfg.feature_model, record, str(path / INFO_FILE), decoder_config):
        raise CheckpointError(f"{path}: config mismatch: {problem}")
