"""Small models for the field cases of ../shared/cases/CASES.md (factories are picklable)."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.models.nanogpt import GPT, GPTConfig


def _nanogpt(seed: int, kwargs: dict) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**kwargs))


def nanogpt(seed: int = 0, **kwargs):
    """nanoGPT with a tied embedding / head."""
    return functools.partial(_nanogpt, seed, kwargs)


class SharedUse(nn.Module):
    """C2: a weight used twice on one path (`x @ w @ w`) and a submodule called twice."""

    def __init__(self, vocab: int = 16, hidden: int = 8):
        super().__init__()
        self.vocab_size = vocab
        self.embed = nn.Embedding(vocab, hidden)
        self.w = nn.Parameter(torch.randn(hidden, hidden) / hidden ** 0.5)
        self.block = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                   nn.Linear(4 * hidden, hidden))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx):
        x = self.embed(idx)          # (B, T, h)
        x = x @ self.w @ self.w      # the same weight twice on one path
        x = x + self.block(x)        # the same submodule ...
        x = x + self.block(x)        # ... called twice
        return self.head(F.layer_norm(x, x.shape[-1:]))


def _shared_use(seed: int) -> SharedUse:
    torch.manual_seed(seed)
    return SharedUse()


def shared_use(seed: int = 0):
    return functools.partial(_shared_use, seed)
