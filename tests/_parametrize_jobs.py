"""Models for tests/test_parametrize.py: a weight-normalised convolution under a linear head,
and a tiny wav2vec2 (its positional convolution is weight-normalised over the kernel dim,
LayerDrop in its encoder); each a picklable factory with seeded batches of named inputs."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

CLASSES = 10


class WeightNormConv(nn.Module):
    """x (B, 32, L) -> conv (weight_norm over dim 2, the kernel) -> (B, L - 2, CLASSES)."""

    def __init__(self):
        super().__init__()
        self.conv = weight_norm(nn.Conv1d(32, 32, 3), dim=2)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).transpose(1, 2))  # (B, L - 2, CLASSES)


def conv_batches(steps: int, samples: int = 4, length: int = 10) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(samples, 32, length, generator=g),
             "labels": torch.randint(0, CLASSES, (samples, length - 2), generator=g)}
            for _ in range(steps)]
