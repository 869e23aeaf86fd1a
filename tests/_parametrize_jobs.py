"""Models for tests/test_parametrize.py: a weight-normalised convolution under a linear head,
and a tiny wav2vec2 (its positional convolution is weight-normalised over the kernel dim,
LayerDrop in its encoder); each a picklable factory with seeded batches of named inputs."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

CLASSES = 10
AUDIO_SAMPLES = 400  # -> (400 - 10) // 5 + 1 = 79 frames -> (79 - 3) // 2 + 1 = 39 frames
AUDIO_FRAMES = 39


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


class Wav2Vec2Logits(nn.Module):
    """A tiny Wav2Vec2ForCTC (2 layers of width 32, dropout 0.1 as configured by default)
    returning its logits (B, AUDIO_FRAMES, CLASSES): the loss is autoplan's cross-entropy
    against frame labels (HF's CTC loss has a data-dependent target length)."""

    def __init__(self, layerdrop: float):
        super().__init__()
        from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

        config = Wav2Vec2Config(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
            num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, vocab_size=CLASSES,
            layerdrop=layerdrop, mask_time_prob=0.0)
        self.model = Wav2Vec2ForCTC(config)

    def forward(self, input_values: torch.Tensor) -> torch.Tensor:
        return self.model(input_values).logits


def wav2vec2(layerdrop: float = 0.0):
    return functools.partial(Wav2Vec2Logits, layerdrop)


def audio_batches(steps: int, samples: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_values": torch.randn(samples, AUDIO_SAMPLES, generator=g),
             "labels": torch.randint(0, CLASSES, (samples, AUDIO_FRAMES), generator=g)}
            for _ in range(steps)]
