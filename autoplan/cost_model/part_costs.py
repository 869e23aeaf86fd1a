"""Compute and communication per part of the model (pre, one block, post) on one rank, per
microbatch, of a plan: what the report's per-part table and pipeline timeline show
(autoplan/report/facts.py `part_costs` calls `part_costs` here with the plan's redistributions
grouped per block role). Priced with the cost model's functions as the solver prices the plan.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch.fx

from autoplan.cost_model.comm import backward_redistribution, redistribute_time_s
from autoplan.cost_model.compute import (
    at_tokens, backward_time_s, dtensor_dispatches, module_input_bytes, op_time_s
)
from autoplan.cost_model.context_parallel import attention_nodes, kv_bytes, kv_comm_s
from autoplan.cost_model.float8 import eligible, float8_times_s
from autoplan.float8 import as_linear
from autoplan.graph import CapturedGraph
from autoplan.op_classes import NO_GRAD_OPS, op_name, selective_saves
from autoplan.plan import Plan
from autoplan.strategies import constant_like_nodes, node_tensor_meta
from autoplan.topology import Topology

__all__ = ["PartCost", "node_parts", "part_costs"]


@dataclass(frozen=True)
class PartCost:
    """Per-microbatch cost of one part of the model on one rank, seconds.

    Attributes:
        part: "pre" (before the blocks: embeddings), "block" (ONE repeated block), "post"
            (after the blocks: final norm, head).
        count: how many times the part occurs (total_layers for "block", else 1).
        compute_fwd_s, compute_bwd_s: roofline compute (cost_model.compute) at the plan's
            per-node shard factors and the node's speed while its devices all compute
            (DeviceSpec.speed), plus DTensor's per-op host time under tp; the backward includes
            the forward that activation checkpointing runs again (every block op under "full",
            the ops "selective" does not keep, autoplan/op_classes.py [Note: selective saved set]).
        comm_fwd_s, comm_bwd_s: the tp redistributions whose consumer is in the part, forward
            (Plan's figure) and backward (the dual redistribution, cost_model.comm), plus the
            backward-only all-reduce of a replicated value that split ops read (Megatron's f,
            once per value and block: the consumers' gradients add up first); the backward
            includes the forward redistributions a recomputation runs again.
    """

    part: str
    count: int
    compute_fwd_s: float
    compute_bwd_s: float
    comm_fwd_s: float
    comm_bwd_s: float

    @property
    def total_s(self) -> float:
        return self.compute_fwd_s + self.compute_bwd_s + self.comm_fwd_s + self.comm_bwd_s


def node_parts(graph: CapturedGraph) -> dict[str, str]:
    """node -> "pre" | "block" | "post" (outside the blocks, before or after the first block
    op in graph order)."""
    parts, seen_block = {}, False
    for name, info in graph.nodes.items():
        if info.layer_id is not None:
            seen_block = True
            parts[name] = "block"
        else:
            parts[name] = "post" if seen_block else "pre"
    return parts


def _shard_factor(strategy, tp: int) -> float:
    """tp when an input or output is sharded, else 1 (strategies.Candidate.shard_factor)."""
    if strategy is None:
        return 1.0
    return float(tp) if any(p.startswith("S(") for p in strategy.inputs + strategy.outputs) \
        else 1.0


def _recomputed(plan: Plan, info) -> bool:
    """Whether activation checkpointing runs block op `info`'s forward again."""
    if info.layer_id is None or plan.checkpointing == "none":
        return False
    return plan.checkpointing == "full" or not selective_saves(info.target)


def _with_grad(graph: CapturedGraph) -> set[str]:
    """Nodes whose floating output depends on a trainable parameter (a gradient flows)."""
    params = {name for info in graph.params.values() if not info.is_buffer
              for name in (info.fqn, *info.aliases)}
    out: set[str] = set()
    for node in graph.gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in params:
            out.add(node.name)
        elif node.op == "call_function" and any(
                a.name in out for a in node.all_input_nodes) and any(
                m is not None and m[1].is_floating_point for m in node_tensor_meta(graph, node)):
            out.add(node.name)
    return out


def _f_all_reduces(plan: Plan, graph: CapturedGraph, factor_of, parts, scale: float,
                   topology: Topology) -> dict[str, float]:
    """Backward seconds per part of the f operator: a value that stays Replicate into split
    consumers gets partial-sum gradients, all-reduced once per (value, block or part) -- as
    solver/costs.py prices an R -> R edge into a split op ([Note: one redistribution per value]
    in solver/problem.py)."""
    tp, grads = plan.mesh.tp, _with_grad(graph)
    if tp == 1:
        return {}
    strategies = {s.node: s for s in plan.strategies}
    placed = dict(plan.param_placements)
    width = {"float32": 4, "float64": 8}.get(plan.dtype, 2)
    seen, out = set(), {}
    for node in graph.gm.graph.nodes:
        s = strategies.get(node.name)
        info = graph.nodes.get(node.name)
        if s is None or info is None or factor_of(node.name) <= 1 or \
                op_name(info.target) in NO_GRAD_OPS or node.target is operator.getitem:
            continue
        flat = []
        torch.fx.node.map_arg((node.args, node.kwargs), flat.append)
        for arg, dst in zip(flat, s.inputs):
            if dst != "R" or arg.name not in grads:
                continue
            src = placed.get(str(arg.target), "R") if arg.op == "get_attr" else \
                (strategies[arg.name].outputs[0] if arg.name in strategies else "R")
            key = (arg.name, info.layer_id if info.layer_id is not None else parts[node.name])
            if src != "R" or key in seen:
                continue
            seen.add(key)
            meta = node_tensor_meta(graph, arg)[0]
            if meta is None:
                continue
            nbytes = math.prod(meta[0]) * (width if meta[1].is_floating_point
                                           else meta[1].itemsize)
            nbytes *= 1.0 if arg.op == "get_attr" else scale
            t = redistribute_time_s("P", "R", nbytes, tp, topology)[1]
            out[parts[node.name]] = out.get(parts[node.name], 0.0) + t
    return out


def _cp_collectives(plan: Plan, graph: CapturedGraph, factor_of, parts, scale: float,
                    topology: Topology) -> dict[str, tuple[float, float]]:
    """(forward, backward) seconds per part of context parallelism's K/V all-gathers and
    gradient reduce-scatters, every captured attention op, as solver/context.py prices them
    (the all-gather again in the backward when checkpointing recomputes attention's
    inputs)."""
    cp, tp = plan.mesh.cp, plan.mesh.tp
    out: dict[str, tuple[float, float]] = {}
    if cp == 1:
        return out
    for name in attention_nodes(graph):
        whole, heads = kv_bytes(graph, name)
        whole *= scale * cp
        per_rank = whole / min(tp, heads) if factor_of(name) > 1 else whole
        fwd, bwd = kv_comm_s(per_rank, cp, tp, topology)
        if plan.checkpointing != "none":
            bwd += fwd
        f0, b0 = out.get(parts[name], (0.0, 0.0))
        out[parts[name]] = (f0 + fwd, b0 + bwd)
    return out


def part_costs(plan: Plan, graph: CapturedGraph, topology: Topology,
               redistributions) -> list[PartCost]:
    """Compute and communication per part, per microbatch of `plan.microbatch_size` samples,
    recomputed from the plan's per-node placements with the cost model (see PartCost).
    `redistributions`: the plan's redistributions grouped per consumer role, each with its
    `consumer` (fx node name), `part` (as `node_parts`), `count` (occurrences per microbatch
    in the real model), `src`, `dst`, `bytes` and `time_s` (forward seconds of one
    occurrence): report/roles.py `redistribution_groups(plan, graph)`.

    The captured graph's shapes are scaled linearly in tokens to the microbatch, as the solver
    does (solver/costs.py, `token_scale`). Raises ValueError from the cost model (e.g. a dtype
    the device lists no peak for).
    """
    cp = plan.mesh.cp  # each cp rank holds seq_len / cp tokens ([Note: context parallelism])
    scale = plan.microbatch_size * plan.seq_len / cp / (
        graph.batch_size * (graph.seq_len or plan.seq_len))
    tp = plan.mesh.tp
    strategies = {s.node: s for s in plan.strategies}
    first_block = graph.layer_nodes[min(graph.layer_nodes)] if graph.layer_nodes else ()
    rep = {n: first_block[i] for names in graph.layer_nodes.values()  # block k -> block 0
           for i, n in enumerate(names) if i < len(first_block)}

    def factor_of(node: str) -> float:
        return _shard_factor(strategies.get(node) or strategies.get(rep.get(node, "")), tp)

    parts = node_parts(graph)
    sums = {p: [0.0, 0.0, 0.0, 0.0] for p in ("pre", "block", "post")}
    fx_nodes = {node.name: node for node in graph.gm.graph.nodes}
    device = topology.device
    speed = device.speed(min(topology.devices_per_node, plan.mesh.world_size))
    constants = constant_like_nodes(graph)
    fp8 = {n: fqn for n, fqn in eligible(graph).items() if fqn in plan.float8_linears} \
        if plan.float8_linears else {}
    for name, info in graph.nodes.items():
        if parts[name] == "block" and rep.get(name) != name or name in constants:
            continue  # the first block stands for all ([Note: block roles])
        scaled = at_tokens(info, scale, module_input_bytes(fx_nodes[name]))
        factor = factor_of(name)
        fwd = op_time_s(scaled, device, plan.dtype, shard_factor=factor,
                        routing_skew=plan.routing_skew) / speed
        bwd = backward_time_s(scaled, device, plan.dtype, shard_factor=factor,
                              routing_skew=plan.routing_skew) / speed
        if name in fp8:  # [Note: float8 pricing]
            chosen = strategies.get(name) or strategies[rep[name]]
            x, w, _bias = as_linear(fx_nodes[name].target, chosen.inputs)
            t = float8_times_s(scaled, x, w,
                               shard_factor=factor, tp=tp, topology=topology, dtype=plan.dtype,
                               weight_trainable=graph.params[fp8[name]].trainable)
            fwd, bwd = t.forward_s / speed, t.backward_s / speed
        host = device.dtensor_op_overhead_s * dtensor_dispatches(info) if tp > 1 else 0.0
        sums[parts[name]][0] += fwd + host / 2
        sums[parts[name]][1] += bwd + host / 2
        if _recomputed(plan, info):
            sums[parts[name]][1] += fwd
    for group in redistributions:
        per_part = group.count / graph.total_layers if group.part == "block" else group.count
        # the gradient of a replicated input of a split op is a partial sum (Megatron's f),
        # as solver/costs.py prices it
        grad = "P" if group.dst == "R" and factor_of(group.consumer) > 1 else None
        try:
            gd, gs = backward_redistribution(group.src, group.dst, grad_placement=grad)
            bwd = redistribute_time_s(gd, gs, group.bytes, tp, topology)[1]
        except ValueError:
            bwd = 0.0  # DTensor has no such backward redistribution: nothing is priced
        info = graph.nodes.get(group.consumer)
        if info is not None and _recomputed(plan, info):
            bwd += group.time_s  # the recomputation redistributes again
        sums[group.part][2] += group.time_s * per_part
        sums[group.part][3] += bwd * per_part
    per_block = {"block": 1 / max(graph.num_layers, 1)}
    for part, t in _f_all_reduces(plan, graph, factor_of, parts, scale, topology).items():
        sums[part][3] += t * per_block.get(part, 1.0)
    for part, (fwd, bwd) in _cp_collectives(plan, graph, factor_of, parts, scale,
                                             topology).items():
        sums[part][2] += fwd * per_block.get(part, 1.0)
        sums[part][3] += bwd * per_block.get(part, 1.0)
    counts = {"pre": 1, "block": graph.total_layers, "post": 1}
    return [PartCost(p, counts[p], *sums[p]) for p in ("pre", "block", "post")
            if p != "block" or graph.num_layers]
