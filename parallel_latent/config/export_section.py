"""The ``export`` section: how ``parallel-latent encode-corpus`` encodes a corpus into a latent
dataset. Not part of a training config (given on that command's line as ``export.key=value``);
:mod:`.sections` re-exports it beside the training sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .schema import at_least, require, setting

__all__ = ["EXPORT_SECTION", "ExportConfig"]

EXPORT_SECTION = "export"


@dataclass
class ExportConfig:
    """``parallel-latent encode-corpus``: how a corpus is encoded into a latent dataset (not part of a
    training config; given on that command's line as ``export.key=value``)."""

    batch_size: int = setting(
        64,
        "samples per export batch: the encoder sees the same batches whatever the number of processes, so the "
        "output does not depend on --nproc",
        at_least(1),
    )
    shard_size: int = setting(
        8192,
        "samples per shard file (a multiple of export.batch_size): the unit of work of a data-parallel rank and "
        "of resuming (a killed export re-encodes at most the shards that were being written)",
        at_least(1),
    )
    precision: Literal["fp32", "bf16"] = setting(
        "fp32",
        "the dtype the model encodes in and the latents are stored in; bf16 is stored as its 16-bit pattern "
        "(uint16: Arrow has no bfloat16; open_latents gives torch.bfloat16 back)",
    )

    def validate(self, source: str) -> None:
        require(
            self.shard_size % self.batch_size == 0,
            source,
            f"export.shard_size={self.shard_size} is not a multiple of export.batch_size={self.batch_size}",
        )
