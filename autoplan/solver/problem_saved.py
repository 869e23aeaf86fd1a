"""What the placement ILP's activation memory reads of a captured graph, per ILP node: the
tensors autograd saves (Problem.saved, with those "core-attention" drops and what its
checkpoints hold besides; cost_model/activations.py [Note: saved tensors]), the inputs held as
their gathered shard (Problem.regathered), the outputs "selective" keeps
(Problem.kept_selective), and the bytes of one value (`tensor_bytes`). build_problem
(problem.py) fills the Problem with them.
"""

from __future__ import annotations

import dataclasses
import math

import torch.fx

from autoplan.cost_model.activations import (
    attention_dropout_scores, grad_carriers, node_producers, saved_tensors
)
from autoplan.graph import CapturedGraph
from autoplan.op_classes import VIEW_OPS, op_name, selective_saves
from autoplan.strategies import node_tensor_meta

__all__ = ["tensor_bytes", "saved_entries", "kept_selective"]


def tensor_bytes(graph, node: torch.fx.Node, index: int, dtype_bytes: int) -> float:
    """Bytes of output `index` of fx `node` of `graph` (a CapturedGraph), floating tensors at
    `dtype_bytes` per element, others at their dtype's size; 0.0 when it has no tensor meta."""
    meta = node_tensor_meta(graph, node)
    if index >= len(meta) or meta[index] is None:
        return 0.0
    shape, dtype = meta[index]
    width = dtype_bytes if dtype.is_floating_point else dtype.itemsize
    numel = 1
    for s in shape:
        numel *= s
    return float(numel * width)


def saved_entries(graph: CapturedGraph, prob: "Problem", layer_of,
           dtype_bytes) -> tuple[list[tuple], list[tuple], list[tuple]]:
    """(every saved tensor, those "core-attention" drops, what its checkpoints hold besides)
    as Problem.saved entries: a tensor saved by several ops is one entry; it is dropped when
    its owner and every op saving it are in the attention cores (`prob.core_nodes`); a core's
    input that no op saves is held by the core's checkpoint."""
    infos = [info for name, info in graph.nodes.items()
             if name in prob.cands and name not in prob.constants]
    value_numel = {name: math.prod(info.shapes[0]) for name, info in graph.nodes.items()
                   if info.shapes}
    items = saved_tensors(infos, producers=node_producers(graph.gm), dtype_bytes=dtype_bytes,
                          attention_dropout=attention_dropout_scores(graph.gm),
                          grads=grad_carriers(graph.gm, graph.params), value_numel=value_numel)
    items, prob.regathered = _through_flat_views(graph, prob, items)
    seen: dict[tuple, float] = {}
    outside: set[tuple] = set()  # saved by an op outside the cores, or owned outside them
    for it in items:
        seen[(it.owner, it.slot)] = it.nbytes
        if it.owner not in prob.core_nodes or it.consumer not in prob.core_nodes:
            outside.add((it.owner, it.slot))
    n_cap, total = max(graph.num_layers, 1), graph.total_layers
    out, dropped = [], []
    for (owner, slot), nbytes in seen.items():
        layer = layer_of.get(owner)
        mult = total / n_cap if layer is not None else 1.0
        ilp = prob.rep.get(owner) if owner in prob.cands else None
        part = prob.part.get(ilp, "pre") if ilp is not None else "pre"
        out.append((ilp, nbytes, mult, part))
        if (owner, slot) not in outside:
            dropped.append(out[-1])
    held = []
    fx_nodes = {n.name: n for n in graph.gm.graph.nodes}
    inputs = {a.name: a for name in prob.core_nodes for a in fx_nodes[name].all_input_nodes
              if a.name not in prob.core_nodes and a.op == "call_function"}
    for name, node in inputs.items():
        if (name, "out") in seen or name not in prob.cands:
            continue
        mult = total / n_cap if layer_of.get(name) is not None else 1.0
        ilp = prob.rep.get(name)
        held.append((ilp, tensor_bytes(graph, node, 0, dtype_bytes), mult,
                     prob.part.get(ilp, "pre")))
    return out, dropped, held


_FLAT_VIEWS = frozenset({"view", "_unsafe_view", "reshape", "_reshape_alias", "flatten",
                         "unflatten", "alias", "view_as"})


def _through_flat_views(graph: CapturedGraph, prob: "Problem",
                        items: list) -> tuple[list, dict[str, str]]:
    """([Note: gathered inputs saved sharded] in autoplan/passes/regather.py) `items` with every
    saved operand that is a flattening view (view, reshape, flatten: same elements, contiguous)
    of an activation owned by the view chain's root (unless that is a strided view, which
    the reshape copies) -- the tensor the runtime holds: the gather's
    shard when the chain's input was all-gathered, the root's own value otherwise -- and the
    map Problem.regathered: node -> the op that saves its input (itself, or through flat views):
    an all-gather on an edge into the node is held as its shard and gathered again in the
    backward."""
    fx_nodes = {n.name: n for n in graph.gm.graph.nodes}

    def flat_view(name: str) -> bool:
        node = fx_nodes.get(name)
        return (node is not None and node.op == "call_function" and bool(node.args)
                and isinstance(node.args[0], torch.fx.Node)
                and op_name(str(node.target)) in _FLAT_VIEWS)

    out, regathered = [], {}
    for it in items:
        if it.slot != "out" or it.owner == it.consumer:
            out.append(it)
            continue
        regathered.setdefault(it.consumer, it.consumer)
        owner = it.owner
        while flat_view(owner):
            regathered.setdefault(owner, it.consumer)
            root = fx_nodes[owner].args[0]
            # a reshape of a transposed (strided) value is a copy, not a view of it
            if (root.op != "call_function" or root.name in prob.constants
                    or (op_name(str(root.target)) in VIEW_OPS and not flat_view(root.name))):
                break
            owner = root.name
        out.append(dataclasses.replace(it, owner=owner) if owner != it.owner else it)
    return out, regathered


def kept_selective(graph: CapturedGraph, prob: "Problem", layer_of,
                    dtype_bytes) -> list[tuple]:
    """Problem.kept_selective: the outputs of the block ops "selective" keeps."""
    n_cap, total = max(graph.num_layers, 1), graph.total_layers
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    out = []
    for name, info in graph.nodes.items():
        if (layer_of.get(name) is None or name not in prob.cands or name in prob.constants
                or not selective_saves(info.target)):
            continue
        nbytes = sum(tensor_bytes(graph, nodes[name], i, dtype_bytes)
                     for i in range(len(info.shapes)))
        ilp = prob.rep[name]
        out.append((ilp, nbytes, total / n_cap, prob.part.get(ilp, "layer")))
    return out
