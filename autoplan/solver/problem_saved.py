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
    PARAM_PREFIX, SavedTensor, attention_dropout_scores, grad_carriers, node_producers,
    saved_tensors
)
from autoplan.graph import CapturedGraph
from autoplan.op_classes import ATTENTION_OPS, VIEW_OPS, op_name, selective_saves
from autoplan.passes.kernels import kernel_patterns
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
    grads = grad_carriers(graph.gm, graph.params)
    items = saved_tensors(infos, producers=node_producers(graph.gm), dtype_bytes=dtype_bytes,
                          attention_dropout=attention_dropout_scores(graph.gm),
                          grads=grads, value_numel=value_numel)
    # the saved bytes as the fused kernels keep them; the ops that hold a gathered input as
    # its shard both ways: a pattern the plan cuts with a redistribution runs unfused, and an
    # uncut one has no gather inside it ([Note: fused kernels' saved tensors])
    _unfused, regathered = _through_flat_views(graph, prob, items)
    items, prob.regathered = _through_flat_views(
        graph, prob, _as_fused(graph, items, dtype_bytes, grads))
    for node, saver in regathered.items():
        prob.regathered.setdefault(node, saver)
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


# [Note: fused kernels' saved tensors]
# The runtime runs each RMSNorm and SwiGLU pattern of a stage graph as one fused op
# (passes/kernels.py [Note: kernel fusion], `kernels=True`, its default), whose autograd saves
# what its backward reads: its inputs (kernels/ops.py: RMSNorm x and the weight, its rstd
# recomputed in the backward; SwiGLU gate and up) -- not the pattern's intermediates the
# captured ops would save (RMSNorm: the fp32 upcast, rsqrt's output and the normalized product;
# SwiGLU: silu's output). So the saved tensors of a pattern's ops are replaced by the fused
# op's activation inputs, each its producer's value (counted once with what other ops save of
# it). Measured (bench/dryrun.py, llama3-8b on one H200 with optimizer offload, 32 blocks at
# 4K tokens, no recomputation): 23.13 GB of activations at the peak, priced 27.51 GB as
# captured. Where the plan cuts a pattern with a redistribution the runtime runs it unfused,
# and its saved tensors are the captured ops' (priced here as fused: a plan that reshards
# inside a norm is one the cost of that redistribution makes rare -- the final norm under
# sequence parallelism may gather there, the all-gather back to Replicate before the head).
# Which ops hold a gathered input as its shard (Problem.regathered, [Note: gathered inputs
# saved sharded]) is taken from both: an all-gather inside a pattern is its captured ops'.
# `kernels=False` runs the captured ops and saves more than planned.
def _as_fused(graph: CapturedGraph, items: list, dtype_bytes, grads: frozenset[str]) -> list:
    """`items` (saved_tensors) with each kernel pattern's saved tensors those of its fused op
    ([Note: fused kernels' saved tensors])."""
    patterns = kernel_patterns(graph.gm)
    if not patterns:
        return items
    inside = {n.name for _op, _args, nodes in patterns for n in nodes}
    out = [it for it in items if it.consumer not in inside]
    for _op, args, nodes in patterns:
        inputs = [a for a in args if isinstance(a, torch.fx.Node)]
        if not any(a.name in grads or (a.op == "get_attr" and PARAM_PREFIX + str(a.target)
                                       in grads) for a in inputs):
            continue  # autograd records no fused op none of whose inputs requires a gradient
        for a in inputs:
            if a.op != "call_function":
                continue  # a parameter, buffer or graph input: not an activation saved here
            # one entry per pattern op reading it (counted once: saved_entries keys by owner),
            # so that an all-gather into any of them is held as its shard as the runtime
            # holds it ([Note: gathered inputs saved sharded])
            for reader in (n for n in nodes if a in n.all_input_nodes):
                out.append(SavedTensor(a.name, "out", reader.name,
                                       tensor_bytes(graph, a, 0, dtype_bytes), "fused_kernel"))
    return out


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
    """Problem.kept_selective: the outputs of the block ops "selective" keeps (a fused
    attention's with its per-row log-sum-exp)."""
    n_cap, total = max(graph.num_layers, 1), graph.total_layers
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    out = []
    for name, info in graph.nodes.items():
        if (layer_of.get(name) is None or name not in prob.cands or name in prob.constants
                or not selective_saves(info.target)):
            continue
        nbytes = sum(tensor_bytes(graph, nodes[name], i, dtype_bytes)
                     for i in range(len(info.shapes)))
        if op_name(str(info.target)) in ATTENTION_OPS and info.shapes and info.shapes[0]:
            # the fp32 log-sum-exp per row (B x heads x T) the fused attention kernels return
            # beside the output: kept with it ([Note: saved tensors])
            nbytes += math.prod(info.shapes[0][:-1]) * 4
        ilp = prob.rep[name]
        out.append((ilp, nbytes, total / n_cap, prob.part.get(ilp, "layer")))
    return out
