"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Every rank writes the shards it holds -- parameters (DTensors under tp and FSDP2, plain tensors
otherwise) and their optimizer states -- keyed by the model's own FQNs (`model.<fqn>`,
`optim.<fqn>.<state>`), so a checkpoint does not depend on the plan that wrote it: loading
into a model planned for another mesh or world size reshards (DCP reads the pieces each new
shard needs). Replicated copies (dp replicas, a tied weight held by two pipeline stages) are
written once (DCP deduplicates identical chunks).

A learning-rate scheduler's state (`lr_scheduler=`) is saved as `lr_scheduler` and restored
with the learning rate it had set; a checkpoint without one leaves the schedule as it is.

Buffers are not saved: they are recomputed (rotary tables) or part of the graph (lifted
constants) -- see case C5.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

__all__ = ["save", "load", "check_files", "CheckpointError"]


def _optimizer(model):
    opt = model.optimizer
    return getattr(opt, "inner", opt)  # ShardedOptimizer (ZeRO-1) wraps the owner's optimizer


def _no_offload(model, what: str) -> None:
    """Checkpoints key optimizer states by the model's parameters; an offloaded optimizer
    (runtime/offload.py) keys them by its host copies, which this module does not map yet."""
    offload = getattr(getattr(model, "plan", None), "offload", "none")
    if offload != "none":
        raise NotImplementedError(
            f"{what} of a plan with offload {offload!r}: sharded checkpoints of offloaded "
            f"optimizer states are not supported yet; plan with offload='none' to checkpoint")


def _whole_states(model) -> dict[int, dict] | None:
    """ZeRO-1's states as on one process, for the parameters this rank writes (collective:
    `ShardedOptimizer.full_states`, [Note: ZeRO-1 partition] in runtime/zero1.py); None for
    any other optimizer, whose state is keyed by the parameters themselves."""
    full_states = getattr(model.optimizer, "full_states", None)
    return full_states() if full_states is not None else None


def _state_dict(model, whole: dict[int, dict] | None = None) -> tuple[dict, dict[str, list]]:
    """The DCP state dict of this rank, and the extra local copies of tied weights;
    `whole`: ZeRO-1's states by parameter (`_whole_states`)."""
    _no_offload(model, "checkpoint")
    opt = _optimizer(model)
    sd: dict[str, object] = {}
    copies: dict[str, list] = {}
    for _, module in model.stages:
        for fqn, p in module.named_parameters():
            if f"model.{fqn}" in sd:
                copies.setdefault(fqn, []).append(p)
                continue
            sd[f"model.{fqn}"] = p
            if whole is not None:
                state = whole.get(id(p), {})
            else:
                state = opt.state.get(p, {}) if opt is not None else {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    sd[f"optim.{fqn}.{key}"] = value
    return sd, copies


def save(model, path: str | os.PathLike) -> None:
    """Write `model` (a DistributedModel) to the DCP directory `path` (collective)."""
    sd, _ = _state_dict(model, _whole_states(model))
    if getattr(model, "lr_scheduler", None) is not None:
        sd["lr_scheduler"] = model.lr_scheduler.state_dict()
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


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded: missing, not written by `save`, or with
    files shorter than its metadata says (a copy cut short)."""


def check_files(path: str | os.PathLike) -> None:
    """Check that `path` is a complete DCP checkpoint before anything is read into a model:
    its `.metadata` parses and every data file it names exists with at least the bytes its
    records span. Raises CheckpointError naming the directory or the file at fault."""
    from autoplan._torch_compat import checkpoint_extents

    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"load: checkpoint directory {str(path)!r} does not exist")
    if not (root / ".metadata").is_file():
        raise CheckpointError(f"load: {str(path)!r} has no .metadata file: not a checkpoint "
                              "written by save() (or its copy is incomplete)")
    try:
        extents = checkpoint_extents(root)
    except Exception as e:  # noqa: BLE001 - unpickling a damaged file raises anything
        raise CheckpointError(f"load: {root / '.metadata'} cannot be read "
                              f"({type(e).__name__}: {e})") from None
    for name, needed in sorted(extents.items()):
        file = root / name
        if not file.is_file():
            raise CheckpointError(f"load: {file} is missing (named by {root / '.metadata'})")
        size = file.stat().st_size
        if size < needed:
            raise CheckpointError(f"load: {file} holds {size} bytes; the checkpoint's "
                                  f"metadata needs {needed} (a truncated copy?)")


@torch.no_grad()
def load(model, path: str | os.PathLike) -> None:
    """Load the DCP directory `path` into `model` (collective), resharding as needed.

    Raises NotImplementedError for a plan with offload, and CheckpointError for a missing
    directory, one not written by `save`, or a truncated file, both before anything is
    changed; whatever DCP raises for a missing key or a shape mismatch (it names the key).
    """
    from autoplan._torch_compat import checkpoint_keys

    _no_offload(model, "load")  # before the optimizer's zero step changes anything
    check_files(path)
    _initialise_optimizer_state(model)
    whole = _whole_states(model)
    sd, copies = _state_dict(model, whole)
    scheduler = getattr(model, "lr_scheduler", None)
    if scheduler is not None and any(k.startswith("lr_scheduler.") for k in
                                     checkpoint_keys(path)):
        sd["lr_scheduler"] = scheduler.state_dict()  # the shape DCP fills
    dcp.load(sd, checkpoint_id=str(path))
    opt = _optimizer(model)
    if "lr_scheduler" in sd:  # the schedule where it was, and the lr it had set
        scheduler.load_state_dict(sd["lr_scheduler"])
        for group, lr in zip(opt.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
    for fqn, others in copies.items():
        first = sd[f"model.{fqn}"]
        for p in others:
            p.copy_(first)
            state = whole.get(id(p), {}) if whole is not None else \
                opt.state.get(p, {}) if opt is not None else {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.copy_(sd[f"optim.{fqn}.{key}"])
    if whole is not None:  # back into every rank's rows
        model.optimizer.scatter_states(whole)
