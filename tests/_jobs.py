"""Jobs that run on every rank of a test cluster, and their single-process references.

A model is named by a *factory*: a picklable callable (module-level function or
functools.partial of one) returning the model with seeded weights, so every rank and the
reference start from the same weights; batches are seeded the same way.
"""

from __future__ import annotations

import functools

import torch

from autoplan.runtime.engine import cross_entropy_loss

SEQ = 16
LR = 1e-3


def _preset(name: str, seed: int, overrides: dict):
    from autoplan.models import build_model

    torch.manual_seed(seed)
    return build_model(name, device="cpu", **overrides)


def preset(name: str, seed: int = 0, **overrides):
    """Factory for a model preset (HF config) with seeded random weights."""
    return functools.partial(_preset, name, seed, overrides)


def vocab_of(model) -> int:
    if hasattr(model, "config") and hasattr(model.config, "vocab_size"):
        return model.config.vocab_size
    return model.vocab_size


def logits(model, x):
    out = model(x, use_cache=False) if hasattr(model, "config") and hasattr(
        model.config, "use_cache") else model(x)
    return out.logits if hasattr(out, "logits") else out


def batches(vocab: int, steps: int, batch: int, seq: int = SEQ, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (steps, batch, seq + 1), generator=g)
    return x[..., :-1], x[..., 1:]


def adamw(params):
    """AdamW with eps = 1e-6. Reduction order differs between one process and N ranks, so a
    gradient that is (nearly) zero -- GPT-2's key bias has an exactly zero one, softmax being
    shift-invariant -- carries rounding noise dg ~ 1e-10 of its own size. Adam turns it into a
    parameter step of up to lr * |dg| / eps: 1e-5 with torch's default eps = 1e-8 (over the
    1e-6 tolerance, for reasons that have nothing to do with parallelism), 1e-7 with 1e-6."""
    return torch.optim.AdamW(params, lr=LR, eps=1e-6)


def reference(factory, steps: int, batch: int, *, accumulation: int = 1,
              max_grad_norm: float | None = None, seq: int = SEQ):
    """Single-process training: (losses per step, parameters after the last step, grad norms
    before clipping)."""
    model = factory()
    opt = adamw(model.parameters())
    x, y = batches(vocab_of(model), steps, batch, seq)
    losses, norms = [], []
    for i in range(steps):
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x[i].chunk(accumulation), y[i].chunk(accumulation)):
            loss = cross_entropy_loss(logits(model, xm), ym) / accumulation
            loss.backward()
            total += loss.item()
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                              max_grad_norm)))
        opt.step()
        losses.append(total)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return losses, params, norms


def memory_budget(factory, batch: int, overrides: dict, fraction: float, seq: int = SEQ):
    """A per-device memory budget `fraction` of what the plan needs with ample memory: under
    it the planner has to split weights on the tp axis instead of replicating them (tiny
    models are latency-bound, so with ample memory replication wins)."""
    from autoplan.api import autoparallel

    ample = autoparallel(factory(), global_batch=batch, seq_len=seq, **overrides).plan
    return ample.prediction.memory_bytes * fraction


def train(factory, steps: int, batch: int, overrides: dict, *, max_grad_norm=None,
          seq: int = SEQ, memory_fraction: float | None = None):
    """On every rank: plan with `overrides` (fixing some of the solver's choices), train, and
    return (losses, this rank's full parameters, plan JSON, gradient norms before clipping)."""
    from autoplan.api import autoparallel

    budget = None
    if memory_fraction is not None:
        budget = memory_budget(factory, batch, overrides, memory_fraction, seq)
    model = factory()
    ap = autoparallel(model, global_batch=batch, seq_len=seq, optimizer=adamw,
                      max_grad_norm=max_grad_norm, device_memory_bytes=budget, **overrides)
    x, y = batches(vocab_of(model), steps, batch, seq)
    losses, norms = [], []
    for i in range(steps):
        losses.append(ap.step(x[i], y[i]))
        norms.append(ap._engine.grad_norm)
    return losses, ap.state_dict(), ap.plan.to_json(), norms


def _preset_via_meta(name: str, seed: int, overrides: dict):
    """Build on the meta device, then materialise: to_empty + HF init_weights (which also
    recomputes non-persistent buffers such as rotary inv_freq)."""
    from autoplan.models import build_model

    model = build_model(name, device="meta", **overrides)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def preset_via_meta(name: str, seed: int = 0, **overrides):
    return functools.partial(_preset_via_meta, name, seed, overrides)


def train_resume(factory, batch: int, first: dict, second: dict, path: str, *, seq: int = SEQ):
    """On every rank: 1 step under plan `first`, save; a new model under plan `second` (same
    ranks) loads the checkpoint and takes 1 more step. Returns (losses, params, the rotary
    buffer values each stage graph holds after loading)."""
    from autoplan.api import autoparallel

    x, y = batches(vocab_of(factory()), 2, batch, seq)
    a = autoparallel(factory(), global_batch=batch, seq_len=seq, optimizer=adamw, **first)
    losses = [a.step(x[0], y[0])]
    a.save(path)
    b = autoparallel(factory(), global_batch=batch, seq_len=seq, optimizer=adamw, **second)
    # garbage weights: everything must come from the checkpoint
    with torch.no_grad():
        for p in b.module.parameters():
            p.normal_()
    b.load(path)
    losses.append(b.step(x[1], y[1]))
    buffers = [sg.gm.get_buffer(n.target).clone()
               for sg in b._engine.stage_graphs.values() for n in sg.gm.graph.nodes
               if n.op == "get_attr" and n.target.endswith("inv_freq")]
    return losses, b.state_dict(), buffers
