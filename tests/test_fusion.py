"""[Note: pointwise fusion]: bytes of memory-bound ops inside fused kernels, and who prices them.

A chain of elementwise ops reads its inputs once and writes only what leaves it; a device that
fuses (the GPU presets) prices each op by those bytes, CPU ranks by the op's own in + out bytes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autoplan.capture import capture
from autoplan.capture.fusion import fused_bytes
from autoplan.cost_model.compute import backward_time_s, op_time_s
from autoplan.topology import Topology, preset

B, T, D = 2, 16, 32
ELEM = B * T * D * 4  # one (B, T, D) fp32 activation, bytes


class GeluMLP(nn.Module):
    """linear -> tanh-GeLU spelled out (6 elementwise ops, as GPT-2's gelu_new) -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.up(x)
        g = 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3))))
        return self.down(g)


@pytest.fixture(scope="module")
def graph():
    return capture(GeluMLP(), (torch.randn(B, T, D),), model_name="gelu-mlp")


def _chain(graph):
    return [n for n in graph.nodes.values() if n.fused_bytes is not None]


def test_a_chain_reads_its_input_once_and_writes_its_output_once(graph):
    chain = _chain(graph)
    names = {n.target.split(".")[1] for n in chain}
    assert {"pow", "mul", "add", "tanh"} <= names, names
    # the chain reads the up-projection's output (by each op that takes it: pow, add, mul)
    # and writes the one tensor the down-projection reads
    total = sum(n.fused_bytes for n in chain)
    unfused = sum(n.in_bytes + n.out_bytes for n in chain)
    assert total <= 4 * ELEM, (total, ELEM)
    assert unfused >= 3 * total, (unfused, total)
    last = [n for n in chain if n.fused_bytes >= ELEM and n.out_bytes == ELEM]
    assert last, "the op whose output the down projection reads must write it"


def test_interior_ops_move_nothing_and_cost_nothing_on_a_fusing_device(graph):
    device = preset("dgx-h100").device
    assert device.fuses_pointwise
    interior = [n for n in _chain(graph) if n.fused_bytes == 0]
    assert interior, "tanh's input and output stay inside the chain"
    for n in interior:
        assert op_time_s(n, device, "float32") == 0.0
        assert backward_time_s(n, device, "float32") == 0.0


def test_a_device_that_does_not_fuse_prices_every_op_by_its_own_bytes(graph):
    fusing = preset("dgx-h100").device
    eager = dataclasses.replace(fusing, fuses_pointwise=False)
    chain = _chain(graph)
    t_fused = sum(op_time_s(n, fusing, "float32") for n in chain)
    t_eager = sum(op_time_s(n, eager, "float32") for n in chain)
    assert t_eager > 2 * t_fused, (t_eager, t_fused)
    assert not preset("local-cpu").device.fuses_pointwise  # CPU ranks run eager, as calibrated
    # a matmul is priced alike either way
    mm = next(n for n in graph.nodes.values() if n.fused_bytes is None and n.flops > 0)
    assert op_time_s(mm, fusing, "float32") == op_time_s(mm, eager, "float32")


def test_views_do_not_break_a_chain():
    class Viewed(nn.Module):
        def forward(self, x):
            y = torch.relu(x).view(B, T * D)
            return (y * 2.0).view(B, T, D) @ torch.ones(D, D)

    g = capture(Viewed(), (torch.randn(B, T, D),), model_name="viewed")
    relu = next(n for n in g.nodes.values() if n.target.startswith("aten.relu"))
    mul = next(n for n in g.nodes.values() if n.target.startswith("aten.mul"))
    assert relu.fused_bytes == ELEM  # reads the input, its output stays in the chain
    assert mul.fused_bytes == ELEM   # reads nothing from memory, writes what the matmul reads


def test_fused_bytes_of_a_graph_without_fusible_ops_is_empty():
    g = capture(nn.Linear(D, D), (torch.randn(B, D),), model_name="linear")
    assert fused_bytes(g.gm) == {}


def test_topology_files_take_fuses_pointwise_and_refuse_a_non_bool(tmp_path):
    data = preset("dgx-h100").to_dict()
    assert data["device"]["fuses_pointwise"] is True
    assert Topology.from_dict(data).device.fuses_pointwise
    data["device"]["fuses_pointwise"] = "yes"
    with pytest.raises(ValueError, match="fuses_pointwise: expected true or false"):
        Topology.from_dict(data, where="t.yaml")
