"""Jobs of tests/test_frozen.py: models with frozen parameters (`requires_grad=False`), trained
on every rank of a test cluster and on one process ([Note: frozen parameters] in
autoplan/runtime/engine.py)."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from _jobs import SEQ, _preset, adamw, batches, vocab_of

VOCAB = 64


class FrozenPositions(nn.Module):
    """Token embedding, a frozen learned position table, two linears: the issue's minimal
    case (forward(ids (B, T)) -> logits (B, T, VOCAB))."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 32)
        self.pos = nn.Embedding(SEQ, 32)
        self.pos.weight.requires_grad_(False)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, VOCAB)
        self.vocab_size = VOCAB

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.down(torch.relu(self.up(self.tok(ids) + self.pos(positions))))


def _positions(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return FrozenPositions()


def positions(seed: int = 0):
    """Factory of `FrozenPositions` with seeded weights."""
    return functools.partial(_positions, seed)


def _frozen_preset(name: str, seed: int, frozen: tuple[str, ...]) -> nn.Module:
    model = _preset(name, seed, {})
    for fqn in frozen:
        model.get_parameter(fqn).requires_grad_(False)
    return model


def frozen_preset(name: str, frozen: tuple[str, ...], seed: int = 0):
    """Factory of preset `name` with seeded weights and the parameters `frozen` frozen."""
    return functools.partial(_frozen_preset, name, seed, tuple(frozen))


def train(factory, steps: int, batch: int, overrides: dict, *, max_grad_norm=None,
          device_memory_bytes=None):
    """On every rank: plan, train `steps` AdamW steps and return (losses, full parameters,
    plan JSON, gradient norms, the FQNs the optimizer holds state for on this rank, the
    frozen FQNs that hold a gradient after the last step)."""
    from autoplan.api import autoparallel

    model = factory()
    ap = autoparallel(model, global_batch=batch, seq_len=SEQ, optimizer=adamw,
                      max_grad_norm=max_grad_norm, device_memory_bytes=device_memory_bytes,
                      **overrides)
    x, y = batches(vocab_of(model), steps, batch)
    losses, norms = [], []
    for i in range(steps):
        losses.append(ap.step(x[i], y[i]))
        norms.append(ap._engine.grad_norm)
    engine = ap._engine
    opt = getattr(engine.optimizer, "inner", engine.optimizer)
    names = {id(p): n for n, p in engine._unique_named_params()}
    param_of = getattr(engine.optimizer, "param_of", {})  # ZeRO-1: its rows' shards
    with_state = sorted(names[id(param_of.get(id(p), p))] for p, s in opt.state.items() if s)
    frozen_grads = sorted(n for _, m in engine.stages for n, p in m.named_parameters()
                          if not p.requires_grad and p.grad is not None)
    return losses, ap.state_dict(), ap.plan.to_json(), norms, with_state, frozen_grads
