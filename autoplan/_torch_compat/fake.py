"""Fake tensors (torch's private `torch._subclasses.fake_tensor`): the capture's CPU-claiming
fakes of lifted constants, and the dry run's fake mode (autoplan/runtime/dryrun.py).
"""

from __future__ import annotations

import torch
import torch._subclasses.fake_tensor as _fake  # loaded by `import torch` already

__all__ = ["cpu_claiming_fakes", "outside_fake_mode", "fake_tensor_mode", "is_fake",
           "active_fake_mode", "concrete_value"]


def cpu_claiming_fakes():
    """A function turning a meta tensor into a fake tensor (torch's private
    `torch._subclasses.FakeTensor`) that claims the CPU device and stores nothing, all of one
    FakeTensorMode, which torch.export then traces in ([Note: lifted constants on meta] in
    autoplan/capture/constants.py)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode, cpu = FakeTensorMode(), torch.device("cpu")
    return lambda meta: FakeTensor(mode, meta, cpu)


def outside_fake_mode():
    """A context in which no FakeTensorMode is active (torch's private `unset_fake_temporarily`;
    a no-op where none is): for tensors that are the runtime's own bookkeeping, read back as
    Python values (a DeviceMesh's rank table), never memory of a training step. Outside a dry run
    no fake mode is active and this changes nothing."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def fake_tensor_mode():
    """A FakeTensorMode (torch's private `torch._subclasses.FakeTensorMode`) for a dry run:
    real tensors met inside (lifted constants, the pipeline's bookkeeping) become fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(t) -> bool:
    """Whether `t` is a fake tensor (torch's private `is_fake`; a DTensor of fake shards is).
    A FakeTensor is answered by its type first: a dry run asks for every tensor of every op,
    and torch's function (subclasses, functional wrappers) cost it a percent of its time."""
    return isinstance(t, _fake.FakeTensor) or _fake.is_fake(t)


def active_fake_mode():
    """The FakeTensorMode active now, or None: the dispatcher's FAKE mode slot, where torch's
    FakeTensorMode puts itself (what torch's private `_guards.active_fake_mode` finds on the
    mode stack, at a C call's cost: a dry run asks once per op)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


def concrete_value(t: torch.Tensor, if_fake: float) -> float:
    """`t.item()` as a float; `if_fake` for a fake tensor, which has no value (a dry run,
    autoplan/runtime/dryrun.py: the caller states what stands in, NaN where nothing can)."""
    if is_fake(t):
        return if_fake
    return t.item()
