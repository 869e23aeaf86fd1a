"""Constants the model's own code creates keep their values when a model on meta is captured.

[Note: lifted constants on meta]
torch.export lifts tensors that forward creates from Python values -- the index list of
`t[..., [-2], :]` (Falcon's `_split_heads`), `torch.tensor(0.5, device=x.device)` -- out of
the code as graph constants (`lifted_tensor_k` attributes). Their values come from the code,
never from the weights, so the runtime needs them as captured. On a model whose parameters
are meta tensors they are created on the meta device, straight from the Python data (torch's
indexing builds the index tensor on `self`'s device), and their values are lost: the graph
then holds meta constants nothing can fill in (`materialize` names them as missing).

The cure is the device the trace claims, not the storage: `fake_cpu` swaps a meta model's
parameters and buffers, in place, for fake tensors (torch._subclasses.FakeTensor) that
claim the CPU while storing nothing (their storage is a meta tensor), and gives the inputs
the same treatment. torch.export then traces on those fakes in the same FakeTensorMode (it
takes the mode of fake inputs), so what the code creates from Python values is a real CPU
constant, lifted with its value (`aten.lift_fresh_copy`), exactly as when a model with real
CPU weights is captured. Nothing is allocated: a 405B model is still captured on meta
storage. The swap is undone on exit, so the caller's module, its hooks and its FQNs stay as
they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_map

T = TypeVar("T")

__all__ = ["fake_cpu"]


def _on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


@contextlib.contextmanager
def fake_cpu(model: nn.Module, inputs: T) -> Iterator[T]:
    """While open, `model`'s meta parameters and buffers are CPU-claiming fake tensors of one
    FakeTensorMode (tied tensors stay one tensor); yields `inputs` -- any pytree of tensors,
    e.g. export's (args, kwargs) -- with its meta tensors as fakes of the same mode (others as
    they are). A model with no meta tensor is left alone and its inputs yielded unchanged
    ([Note: lifted constants on meta])."""
    if not _on_meta(model):
        yield inputs
        return
    from autoplan._torch_compat import cpu_claiming_fakes

    as_cpu = cpu_claiming_fakes()
    fakes: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            storage = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            f = as_cpu(storage)
            if isinstance(t, nn.Parameter):
                f = nn.Parameter(f, requires_grad=t.requires_grad)
            fakes[id(t)] = f
        return fakes[id(t)]

    swapped: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is not None and t.is_meta:
                        swapped.append((table, name, t))
                        table[name] = fake(t)
        yield tree_map(lambda t: as_cpu(t) if isinstance(t, torch.Tensor) and t.is_meta else t,
                       inputs)
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t
