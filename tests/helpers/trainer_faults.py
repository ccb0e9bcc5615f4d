"""Fault injection for the trainer tests (never imported by the package).

    python -m tests.helpers.trainer_faults 3,4,7-99 -- train --config ... [overrides]

runs ``parallel-latent`` with a model whose loss is NaN at the listed training steps (1-based),
so the non-finite path runs through the real DeepSpeed optimizer wrappers (or our stage-0 guard).
"""

from __future__ import annotations

import sys


def parse_steps(text: str) -> set[int]:
    steps: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        steps.update(range(int(low), int(high or low) + 1))
    return steps


def poison(nan_steps: set[int]) -> None:
    import parallel_latent.model as model_package

    original_build = model_package.build_model

    def build_model(cfg, tp_group=None):
        model = original_build(cfg, tp_group)
        forward = model.forward

        def poisoned_forward(input_ids, attention_mask, **kwargs):
            out = forward(input_ids, attention_mask, **kwargs)
            step = model.dropout_rng.step + 1  # the trainer sets the (0-based) optimizer step first
            if model.training and step in nan_steps:
                out.loss_sum = out.loss_sum * float("nan")
                out.trained_loss_sum = out.trained_loss_sum * float("nan")  # what backward uses
                out.loss = out.loss * float("nan")
            return out

        model.forward = poisoned_forward
        return model

    model_package.build_model = build_model


if __name__ == "__main__":
    separator = sys.argv.index("--")
    poison(parse_steps(sys.argv[1]))
    from parallel_latent.cli import main

    sys.exit(main(sys.argv[separator + 1 :]))
