"""Small models for the field cases of docs/reference/CASES.md (factories are picklable)."""

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


class InPlaceAndIndexing(nn.Module):
    """C6: an in-place clamp_ right after a row-parallel matmul (a Partial value under tp), a
    `+=` on a view of a module output, and advanced indexing `t[..., [-2], :]`."""

    def __init__(self, vocab: int = 16, hidden: int = 8):
        super().__init__()
        self.vocab_size = vocab
        self.embed = nn.Embedding(vocab, hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx):
        x = self.embed(idx)                      # (B, T, h)
        h = self.down(F.gelu(self.up(x)))        # row-parallel under tp: Partial before clamp
        h.clamp_(-0.5, 0.5)
        p = self.proj(x)
        p.view(-1)[::2] += 1.0                   # in-place on a view of a module output
        second_last = x[..., [-2], :]            # (B, 1, h): advanced indexing, position T-2
        return self.head(h + p + second_last)


def _in_place(seed: int) -> InPlaceAndIndexing:
    torch.manual_seed(seed)
    return InPlaceAndIndexing()


def in_place(seed: int = 0):
    return functools.partial(_in_place, seed)


class DataDependentLoop(nn.Module):
    """C7: a submodule called a number of times that depends on the input values."""

    def __init__(self, vocab: int = 16, hidden: int = 8):
        super().__init__()
        self.vocab_size = vocab
        self.embed = nn.Embedding(vocab, hidden)
        self.step = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        for _ in range(int(idx[0, 0]) % 3 + 1):   # depends on the token values
            x = x + torch.tanh(self.step(x))
        return self.head(x)


class TinyMoE(nn.Module):
    """C7: a top-1 mixture-of-experts layer whose tokens per expert depend on the data."""

    def __init__(self, vocab: int = 16, hidden: int = 8, num_experts: int = 4):
        super().__init__()
        self.vocab_size = vocab
        self.embed = nn.Embedding(vocab, hidden)
        self.router = nn.Linear(hidden, num_experts)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_experts))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx):
        x = self.embed(idx)                                   # (B, T, h)
        flat = x.reshape(-1, x.shape[-1])                     # (N, h)
        choice = self.router(flat).argmax(-1)                 # (N,)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = torch.nonzero(choice == e).squeeze(-1)     # data-dependent count
            out = out.index_add(0, rows, expert(flat[rows]))
        return self.head(out.reshape(x.shape))
