"""Private torch APIs the runtime uses (to be merged into autoplan/_torch_compat.py)."""

from __future__ import annotations

import contextlib

import torch.nn as nn

__all__ = ["replicate_module", "implicit_replication"]


def replicate_module(module: nn.Module, dp_mesh) -> nn.Module:
    """DDP on FSDP2's machinery (`torch.distributed._composable.replicate_with_fsdp`), which
    composes with DTensor tensor parallelism and torch.distributed.pipelining."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate(module, mesh=dp_mesh)


@contextlib.contextmanager
def implicit_replication():
    """Like torch.distributed.tensor.experimental.implicit_replication, but re-entrant: it
    restores the previous setting on exit instead of switching it off, so a stage forward
    nested inside a step's forward+backward does not end the step's replication early."""
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    before = dispatcher._allow_implicit_replication
    dispatcher._allow_implicit_replication = True
    try:
        yield
    finally:
        dispatcher._allow_implicit_replication = before
