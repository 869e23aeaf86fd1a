"""FSDP2 units as the runtime wraps them (runtime/parallel.py), on a fake 4-rank world."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from autoplan._torch_compat import implicit_replication
from autoplan.runtime import parallel


class _Block(nn.Module):
    def __init__(self, tp_mesh):
        super().__init__()
        self.w = nn.Parameter(distribute_tensor(torch.randn(4, 4), tp_mesh, [Replicate()]))

    def forward(self, x, bias):  # `bias` is handed over and left unused
        return x @ self.w


class _Model(nn.Module):
    def __init__(self, tp_mesh, use_bias: bool):
        super().__init__()
        self.table = nn.Parameter(distribute_tensor(torch.randn(4, 4), tp_mesh, [Replicate()]))
        self.blocks = nn.ModuleList(_Block(tp_mesh) for _ in range(3))
        self.use_bias = use_bias

    def forward(self, x):
        bias = self.table * 2
        h = x + bias if self.use_bias else x
        for block in self.blocks:
            h = block(h, bias)
        return h.sum()


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
@pytest.mark.parametrize("use_bias", [False, True])
def test_unit_inputs_without_a_gradient_stay_dtensor(fake_world, zero_stage, use_bias):
    """[Note: unit inputs without a gradient]: a DTensor handed to FSDP2 units that leave it
    unused gets FSDP2's materialized plain zeros from each; the parameter behind it then
    received a plain gradient and FSDP2 failed ("Expected DTensor"). With the runtime's
    wrapper it gets no gradient where nothing uses it (as one process: None) and its DTensor
    gradient where something does."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = _Model(mesh["tp"], use_bias)
    for module in [*model.blocks, model]:
        if zero_stage == 0:
            parallel.replicate(module, mesh["dp"])
        else:
            parallel.fully_shard(module, mesh["dp"], reshard_after_forward=zero_stage == 3)
    x = distribute_tensor(torch.randn(4, 4), mesh["tp"], [Replicate()])
    with implicit_replication():
        model(x).backward()
    assert all(isinstance(b.w.grad, DTensor) for b in model.blocks)
    if use_bias:
        assert isinstance(model.table.grad, DTensor)
    else:
        assert model.table.grad is None
