"""Feature standardisation: each feature of the frozen decoder's hidden state shifted by its corpus
mean and divided by its corpus deviation, before the encoder reads it (``model.feature_norm``).

Why: a pretrained decoder's residual stream has "massive activations". SmolLM2-135M's hidden state
-3 has a median |x| of 9.4 while one feature reaches 27,000 (on the first position and on a few
content tokens) and a handful of others sit at constant offsets of several hundred. The encoder
normalises each token's features over their width (a LayerNorm): those few features then take all
of its scale, and what tells one token from another is left in the last few bits. Standardising
each feature over the corpus first gives every feature the same say. A random-weight decoder has no
such features, and its configs keep ``none``.

The statistics are measured once, at the start of a fresh run, from the training corpus
(:func:`measure_feature_statistics`), and are then part of the model: persistent buffers, so they
travel in the training checkpoint, the portable checkpoint, ``save-pretrained`` and every model
loaded from them, and a resume at any layout reads them instead of measuring again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["FEATURE_NORMS", "FeatureStandardizer", "measure_feature_statistics"]

FEATURE_NORMS = ("none", "standardize")
# A feature whose deviation is below this fraction of the median feature's is constant for the
# encoder's purpose: it is centred and left at that scale instead of being blown up from noise.
MIN_RELATIVE_STD = 1e-6


class FeatureStandardizer(nn.Module):
    """``(features - mean) / std`` per feature, from measured statistics (persistent buffers,
    replicated on every rank). Before it is measured (``tokens == 0``) it refuses to run: an
    unmeasured standardiser would pass the massive features through unchanged, silently."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("std", torch.ones(width))
        self.register_buffer("tokens", torch.zeros((), dtype=torch.int64))
        # Checked on the first forward only: reading ``tokens`` is a host-device sync, and once
        # measured (or loaded measured) the statistics never become unmeasured again.
        self._checked = False

    @property
    def measured(self) -> bool:
        return int(self.tokens) > 0

    def set_statistics(self, count: int, mean: torch.Tensor, variance: torch.Tensor) -> None:
        """Keep ``mean`` and the deviation of ``variance`` (float64 [width]) measured over ``count`` tokens."""
        if count <= 0:
            raise ValueError("feature statistics need at least one token")
        std = variance.clamp(min=0).sqrt()
        floor = MIN_RELATIVE_STD * float(std.median())
        with torch.no_grad():
            self.mean.copy_(mean.to(self.mean.dtype))
            self.std.copy_(torch.where(std > floor, std, torch.ones_like(std)).to(self.std.dtype))
            self.tokens.fill_(count)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if not self._checked and not self.measured:
            raise RuntimeError(
                "model.feature_norm=standardize: the feature statistics were never measured (a fresh run measures "
                "them from its corpus; a checkpoint carries them)"
            )
        self._checked = True
        return (features - self.mean) / self.std


def _combine(parts: list[tuple[float, torch.Tensor, torch.Tensor]]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Chan et al.'s pairwise update of (count, mean, sum of squared deviations), in list order."""
    count, mean, m2 = 0, torch.zeros_like(parts[0][1]), torch.zeros_like(parts[0][2])
    for n, part_mean, part_m2 in parts:
        if n == 0:
            continue
        total = count + n
        delta = part_mean - mean
        mean = mean + delta * (n / total)
        m2 = m2 + part_m2 + delta * delta * (count * n / total)
        count = total
    return int(count), mean, m2


def measure_feature_statistics(
    features_of: Callable[..., torch.Tensor],
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device | str = "cpu",
    dp_group=None,
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(token count, mean, variance) in float64 of the features of every non-pad token of
    ``batches`` (this rank's share; ``features_of(input_ids, attention_mask)`` -> [B, T, f], called
    with the batch's ``features`` third where it carries them from the feature cache), combined over
    ``dp_group`` in rank order, so that every rank gets the same numbers. Each batch contributes its
    own (count, mean, squared deviations): no sum of squares of the massive features loses the small
    ones' variance to cancellation."""
    parts = []
    with torch.no_grad():
        for batch in batches:
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            cached = batch.get("features")  # the feature cache's, where the batches come from it
            features = features_of(ids, mask) if cached is None else features_of(ids, mask, cached.to(device))
            tokens = features[mask.bool()].double()
            if tokens.shape[0]:
                mean = tokens.mean(0)
                parts.append((tokens.shape[0], mean, ((tokens - mean) ** 2).sum(0)))
    local = _combine(parts) if parts else None
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        # [count, mean, m2] per rank, gathered and combined in rank order on every rank; a rank
        # with no tokens sends its count 0 (its width comes from any rank that has some).
        width = torch.tensor([0 if local is None else local[1].numel()], device=device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=dp_group)
        mine = torch.zeros(1 + 2 * int(width), dtype=torch.float64, device=device)
        if local is not None:
            mine[0], mine[1 : 1 + int(width)], mine[1 + int(width) :] = local[0], local[1], local[2]
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(dp_group))]
        dist.all_gather(rows, mine, group=dp_group)
        w = int(width)
        parts = [(int(r[0]), r[1 : 1 + w], r[1 + w :]) for r in rows if int(r[0])]
        local = _combine(parts) if parts else None
    if local is None:
        raise ValueError("no tokens to measure the feature statistics on")
    count, mean, m2 = local
    return count, mean.cpu(), (m2 / count).cpu()
