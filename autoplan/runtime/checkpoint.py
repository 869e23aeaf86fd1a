"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Every rank writes the shards it holds -- parameters (DTensors under tp and FSDP2, plain tensors
otherwise) and their optimizer states -- keyed by the model's own FQNs (`model.<fqn>`,
`optim.<fqn>.<state>`), so a checkpoint does not depend on the plan that wrote it: loading
into a model planned for another mesh or world size reshards (DCP reads the pieces each new
shard needs). Replicated copies (dp replicas, a tied weight held by two pipeline stages) are
written once (DCP deduplicates identical chunks).

Buffers are not saved: they are recomputed (rotary tables) or part of the graph (lifted
constants) -- see case C5.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp

__all__ = ["save", "load"]


def _optimizer(model):
    opt = model.optimizer
    return getattr(opt, "inner", opt)  # ShardedOptimizer (ZeRO-1) wraps the owner's optimizer


def _state_dict(model) -> tuple[dict, dict[str, list]]:
    """The DCP state dict of this rank, and the extra local copies of tied weights."""
    opt = _optimizer(model)
    sd: dict[str, object] = {}
    copies: dict[str, list] = {}
    for _, module in model.stages:
        for fqn, p in module.named_parameters():
            if f"model.{fqn}" in sd:
                copies.setdefault(fqn, []).append(p)
                continue
            sd[f"model.{fqn}"] = p
            state = opt.state.get(p, {}) if opt is not None else {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    sd[f"optim.{fqn}.{key}"] = value
    return sd, copies


def save(model, path: str | os.PathLike) -> None:
    """Write `model` (a DistributedModel) to the DCP directory `path` (collective)."""
    sd, _ = _state_dict(model)
    dcp.save(sd, checkpoint_id=str(path))


@torch.no_grad()
def _initialise_optimizer_state(model) -> None:
    """Create the optimizer's state tensors (zeros) without moving any parameter: one step with
    zero gradients and lr 0. DCP then loads the saved values into them in place."""
    opt = _optimizer(model)
    if opt is None:
        return
    params = [p for group in opt.param_groups for p in group["params"]]
    if all(opt.state.get(p) for p in params):
        return
    saved_lr = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in params:
        p.grad = None
    for g, lr in zip(opt.param_groups, saved_lr):
        g["lr"] = lr


@torch.no_grad()
def load(model, path: str | os.PathLike) -> None:
    """Load the DCP directory `path` into `model` (collective), resharding as needed.

    Raises whatever DCP raises for a missing key or a shape mismatch (it names the key).
    """
    _initialise_optimizer_state(model)
    sd, copies = _state_dict(model)
    dcp.load(sd, checkpoint_id=str(path))
    opt = _optimizer(model)
    for fqn, others in copies.items():
        first = sd[f"model.{fqn}"]
        for p in others:
            p.copy_(first)
            if opt is not None:
                for key, value in opt.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        value.copy_(sd[f"optim.{fqn}.{key}"])
