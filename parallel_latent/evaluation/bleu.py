"""Reconstruction BLEU: corpus BLEU of reconstructions against their inputs.

BLEU is the field's measure of a text autoencoder (LD4LG reports 97.6 on ROCStories and 98.8 on
AG News): sacrebleu's corpus BLEU with its default 13a tokenisation, as papers report it (0-100).
The reference of a sample is its text *as the model saw it*: its first ``max_length`` tokens,
detokenised, so a cut sentence is not counted as an error of the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["corpus_bleu", "reconstruction_bleu"]


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """sacrebleu's corpus BLEU (0-100) of ``hypotheses`` against one reference each; NaN for none."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not hypotheses:
        return math.nan
    import sacrebleu

    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def reconstruction_bleu(records: list[dict]) -> float:
    """Corpus BLEU of reconstruction records (:func:`.records.reconstruction_records`) against their inputs."""
    return corpus_bleu([r["reconstruction"] for r in records], [r["input"] for r in records])
