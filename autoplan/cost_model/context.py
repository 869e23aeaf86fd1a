"""Context parallelism's facts for the cost model: the fused attention ops of a graph, the
bytes of their keys and values, and the time of the cp group's K/V collectives. How the
planner uses them: [Note: context parallelism] in autoplan/solver/context.py."""

from __future__ import annotations

import torch
import torch.fx

from autoplan.cost_model.comm import collective_time_s
from autoplan.cost_model.compute import ATTENTION_OPS, VIEW_OPS, op_name
from autoplan.graph import CapturedGraph
from autoplan.topology import Topology

__all__ = ["attention_nodes", "kv_bytes", "kv_comm_s"]


def attention_nodes(graph: CapturedGraph) -> list[str]:
    """Names of the fused attention nodes of the captured graph (ATTENTION_OPS)."""
    return [name for name, info in graph.nodes.items()
            if op_name(info.target) in ATTENTION_OPS]


def _fx(graph: CapturedGraph, name: str) -> torch.fx.Node:
    for node in graph.gm.graph.nodes:
        if node.name == name:
            return node
    raise KeyError(name)


def _numel(node) -> int:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.numel() if isinstance(val, torch.Tensor) else 0


def kv_bytes(graph: CapturedGraph, name: str) -> tuple[float, int]:
    """(bytes of K plus V before GQA's expansion, at the captured batch and sequence;
    key/value heads) of attention node `name`: each of its args 1 and 2 (B, H, S, D) traced
    back through view-like ops (HF's repeat_kv: expand + reshape) to its smallest form."""
    node = _fx(graph, name)
    total, heads = 0.0, 0
    for arg in node.args[1:3]:
        val = arg.meta["val"]
        smallest, cur = val.numel(), arg
        while isinstance(cur, torch.fx.Node) and op_name(str(cur.target)) in VIEW_OPS and \
                cur.args and isinstance(cur.args[0], torch.fx.Node):
            cur = cur.args[0]
            if _numel(cur):
                smallest = min(smallest, _numel(cur))
        total += smallest * val.element_size()
        heads = max(1, round(val.shape[1] * smallest / val.numel()))
    return total, heads


def kv_comm_s(kv_nbytes: float, cp: int, tp: int, topology: Topology) -> tuple[float, float]:
    """(forward, backward) seconds of the cp group's K/V collectives for `kv_nbytes` (K and V
    together, the whole sequence, per rank): an all-gather of each forward, a reduce-scatter
    of each gradient backward ([Note: context parallelism])."""
    if cp == 1 or kv_nbytes <= 0:
        return 0.0, 0.0
    one = kv_nbytes / 2
    fwd = 2 * collective_time_s("all_gather", one, cp, topology, stride=tp)
    bwd = 2 * collective_time_s("reduce_scatter", one, cp, topology, stride=tp)
    return fwd, bwd
