"""Fault injection for the trainer tests (never imported by the package): :func:`nan_losses_at`
makes the model's loss NaN at the listed training steps (1-based, :func:`parse_steps`), so the
non-finite path of a run in the test's own process goes through the real DeepSpeed optimizer
wrappers (or our stage-0 guard)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def parse_steps(text: str) -> set[int]:
    steps: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        steps.update(range(int(low), int(high or low) + 1))
    return steps


@contextlib.contextmanager
def nan_losses_at(nan_steps: set[int]) -> Iterator[None]:
    """Every ``LatentAutoencoder`` built inside the block returns NaN losses at ``nan_steps``."""
    from parallel_latent.model import LatentAutoencoder

    forward = LatentAutoencoder.forward

    def poisoned_forward(self, input_ids, attention_mask, **kwargs):
        out = forward(self, input_ids, attention_mask, **kwargs)
        step = self.dropout_rng.step + 1  # the trainer sets the (0-based) optimizer step first
        if self.training and step in nan_steps:
            out.loss_sum = out.loss_sum * float("nan")
            out.trained_loss_sum = out.trained_loss_sum * float("nan")  # what backward uses
            out.loss = out.loss * float("nan")
        return out

    LatentAutoencoder.forward = poisoned_forward
    try:
        yield
    finally:
        LatentAutoencoder.forward = forward
