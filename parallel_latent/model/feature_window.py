"""``model.feature_window``: each position's features mixed with its neighbours' before the encoder reads them.

A pretrained decoder's late hidden state says what a token means in its context more than which token
it is; part of what identifies token t sits in the features of positions t-1 and t+1 (a ridge probe
from the three reaches 0.78 held out, from position t alone 0.67: docs/quality.md). A learned
convolution over ``model.feature_window`` positions (odd) gives each position its neighbours'
features from the first step, where the encoder's attention, which starts as a sharp lookup of its
own position, would have to learn to look there. It starts as the identity (the centre tap the
identity matrix, the others zero), so a model starts as it would without it; padding is zeroed first,
so a sample's features never depend on what its padding holds. Replicated on every TP rank: it runs
before the encoder's first TP region, on the whole sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FeatureWindow"]


class FeatureWindow(nn.Module):
    def __init__(self, width: int, window: int):
        super().__init__()
        if window < 1 or window % 2 == 0:
            raise ValueError(f"a feature window of {window} positions: it must be odd")
        self.window = window
        weight = torch.zeros(width, width, window)
        weight[:, :, window // 2] = torch.eye(width)
        self.weight = nn.Parameter(weight)  # [out, in, window]: Conv1d's layout
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, features: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T, f] features (padding zeroed) mixed over ``window`` positions around each."""
        features = features * attention_mask.unsqueeze(-1).to(features.dtype)
        mixed = F.conv1d(features.transpose(1, 2), self.weight, self.bias, padding=self.window // 2)
        return mixed.transpose(1, 2)
