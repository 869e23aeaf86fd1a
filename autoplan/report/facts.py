"""What the report says, derived from a `Plan` (and, when given, its graph and topology).

Renderers (markdown.py, html.py) only format these facts, so Markdown, HTML and the CLI summary
cannot disagree. Everything is SI: seconds, bytes (1 GB = 1e9 B), FLOP/s.

[Note: block roles]
A repeated block appears `total_layers` times in the real model but only `num_layers` times in
the captured graph (often 2), and a plan lists parameters and redistributions per captured node.
The report groups them per *role*: a parameter `model.layers.3.mlp.up_proj.weight` has role
`model.layers.*.mlp.up_proj.weight`; a redistribution has the role of its consumer, which is the
consumer's position in its block's op sequence (blocks align by position, see
`CapturedGraph.layer_nodes`). A role present in every captured block occurs `total_layers` times.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from dataclasses import dataclass

import torch.fx

from autoplan.cost_model.comm import (
    backward_redistribution, group_layout, hop_crosses_nodes, pipeline_hops, redistribute_time_s,
)
from autoplan.cost_model.compute import (NO_GRAD_OPS, at_tokens, backward_time_s,
                                         dtensor_dispatches, module_input_bytes, op_name,
                                         op_time_s)
from autoplan.cost_model.context import attention_nodes, kv_bytes, kv_comm_s
from autoplan.cost_model.memory import selective_saves
from autoplan.graph import CapturedGraph
from autoplan.plan import Plan
from autoplan.strategies import constant_like_nodes, node_tensor_meta
from autoplan.topology import Topology
from autoplan.units import fmt_bytes, fmt_count, fmt_flops, fmt_pct, fmt_si, fmt_time, plural

__all__ = [
    "MEMORY_KINDS", "AxisFacts", "ParamGroup", "RedistributionGroup", "PartCost",
    "fmt_si", "fmt_bytes", "fmt_time", "fmt_count", "fmt_flops", "fmt_pct", "plural",
    "model_num_params", "trainable_text", "sharded_params", "mesh_axes",
    "param_groups", "redistribution_groups", "part_costs", "tokens_per_s", "memory_rows",
    "host_share_bytes", "OFFLOAD_TEXT",
]

MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "temporaries", "comm_buffers")
"""Display order of `Prediction.memory_breakdown` keys; other keys follow, "peak" is dropped."""


# --- number formatting: autoplan/units.py ([Note: number format]) ------------------------------

# --- model and mesh ----------------------------------------------------------------------------

def model_num_params(graph: CapturedGraph, *, trainable_only: bool = False) -> int:
    """Parameters of the real model, frozen ones included (`trainable_only`: those the
    optimizer steps, `ParamInfo.trainable`): parameters outside the blocks plus the captured
    blocks' parameters scaled to `total_layers` ([Note: block roles]); tied weights once."""
    params = [p for p in graph.params.values()
              if not p.is_buffer and (p.trainable or not trainable_only)]
    outside = sum(p.numel for p in params if p.layer_id is None)
    inside = sum(p.numel for p in params if p.layer_id is not None)
    if graph.num_layers:
        inside = inside * graph.total_layers // graph.num_layers
    return outside + inside


def trainable_text(plan: Plan, graph: CapturedGraph | None, *, short: bool = False) -> str:
    """What trains, in words, for a model with frozen parameters ("" when every parameter
    trains, or without the graph): "207 M of 70.8 G parameters train (0.293 %)", what is
    priced for them and how the frozen ones are held (`Plan.frozen_dtype`; [Note: frozen
    dtype] in autoplan/solver/frozen.py); `short`: one terminal line's worth."""
    if graph is None:
        return ""
    total, trainable = model_num_params(graph), model_num_params(graph, trainable_only=True)
    if trainable == total:
        return ""
    share = fmt_pct(trainable / total) if total else "0 %"
    held = (f"in {plan.frozen_dtype} only (no fp32 master)"
            if plan.frozen_dtype and plan.frozen_dtype != "float32"
            else "in float32" if plan.dtype == "float32"
            else "as fp32 masters (saved bit-identical)")
    text = f"{fmt_count(trainable)} of {fmt_count(total)} parameters train ({share})"
    if short:
        return f"{text}; the frozen ones held {held}"
    return (f"{text}: gradients, their dp reduction and optimizer states for those only; "
            f"the {fmt_count(total - trainable)} frozen ones held {held}")


@dataclass(frozen=True)
class AxisFacts:
    """One mesh axis and the topology level its groups map to ([Note: group layout] in
    cost_model/comm.py).

    Attributes:
        name, degree: "pp" | "dp" | "tp" and its size.
        stride: rank distance between members of one group.
        per_node, num_nodes: members of one group per node, nodes one group spans (0, 0 when the
            layout is invalid for the topology).
        level: "-" (degree 1), "intra-node", "inter-node", "hierarchical" or "invalid".
        text: one line for humans.
    """

    name: str
    degree: int
    stride: int
    per_node: int
    num_nodes: int
    level: str
    text: str


def mesh_text(mesh) -> str:
    """"pp 1 x dp 128 x cp 32 x tp 4" (cp only when > 1)."""
    cp = f" x cp {mesh.cp}" if getattr(mesh, "cp", 1) > 1 else ""
    return f"pp {mesh.pp} x dp {mesh.dp}{cp} x tp {mesh.tp}"


def mesh_axes(plan: Plan, topology: Topology | None) -> list[AxisFacts]:
    """The mesh axes, innermost (tp) first, with the link each axis's groups use: tp, cp
    (when > 1: stride tp), dp (stride cp x tp), pp."""
    mesh = plan.mesh
    cp = getattr(mesh, "cp", 1)
    axes = [("tp", mesh.tp, 1)] + ([("cp", cp, mesh.tp)] if cp > 1 else []) + [
        ("dp", mesh.dp, mesh.tp * cp), ("pp", mesh.pp, mesh.tp * cp * mesh.dp)]
    result = []
    for name, degree, stride in axes:
        if degree == 1:
            result.append(AxisFacts(name, 1, stride, 1, 1, "-", "degree 1: no communication"))
            continue
        if topology is None:
            result.append(AxisFacts(name, degree, stride, 0, 0, "unknown",
                                    f"{degree} ranks, stride {stride} (topology not given)"))
            continue
        try:
            per_node, num_nodes = group_layout(degree, stride, topology)
        except ValueError as e:
            result.append(AxisFacts(name, degree, stride, 0, 0, "invalid", str(e)))
            continue
        intra, inter = topology.intra_node, topology.inter_node
        if name == "pp":
            result.append(_pp_axis(plan, stride, per_node, num_nodes, topology))
            continue
        if num_nodes == 1:
            level, text = "intra-node", f"{degree} ranks inside one node over {intra.name}"
        elif per_node == 1:
            level, text = "inter-node", f"{degree} ranks on {num_nodes} nodes over {inter.name}"
        else:
            level = "hierarchical"
            text = (f"{per_node} ranks per node over {intra.name} x {num_nodes} nodes over "
                    f"{inter.name} (hierarchical)")
        result.append(AxisFacts(name, degree, stride, per_node, num_nodes, level, text))
    return result


def _pp_axis(plan: Plan, stage_ranks: int, per_node: int, num_nodes: int,
             topology: Topology) -> AxisFacts:
    """The pp row: its hops, not a collective, at the level of the slowest ([Note: pipeline
    hops] in cost_model/comm.py, as the step time prices them)."""
    pp, intra, inter = plan.mesh.pp, topology.intra_node, topology.inter_node
    hops = pipeline_hops(pp, plan.num_virtual_stages)
    across = sum(hop_crosses_nodes(a, b, stage_ranks, topology) for a, b in hops)
    if not across:
        level, text = "intra-node", f"{pp} stages inside one node over {intra.name}"
    elif across == len(hops):
        level, text = "inter-node", f"{pp} stages, every hop across nodes over {inter.name}"
    else:
        level = "inter-node"
        text = (f"{pp} stages on {num_nodes} nodes: {plural(across, 'hop')} of "
                f"{len(hops)} across nodes over {inter.name} (the pipeline's pace), the "
                f"others over {intra.name}")
    return AxisFacts("pp", pp, stage_ranks, per_node, num_nodes, level, text)


def tokens_per_s(plan: Plan) -> float:
    step = plan.prediction.step_time_s
    return plan.global_batch * plan.seq_len / step if step > 0 else 0.0


def host_share_bytes(plan: Plan, topology: Topology | None) -> float:
    """Host memory per rank: the node's, shared by its ranks (0 without a topology or host
    figures; [Note: offload] in autoplan/solver/offload.py)."""
    if topology is None or not topology.host_mem_bytes:
        return 0.0
    return topology.host_mem_bytes / max(1, min(topology.devices_per_node,
                                                plan.mesh.world_size))


OFFLOAD_TEXT = {
    "none": "none",
    "optimizer": "optimizer states in host memory, the optimizer step on the host (gradients "
                 "down, updated parameters up over PCIe every step)",
    "optimizer+params": "parameter shards, gradients and optimizer states in host memory "
                        "(FSDP2 CPUOffloadPolicy), the optimizer step on the host",
}
"""What each `Plan.offload` means, for the summary ([Note: offload] in solver/offload.py)."""


def memory_rows(plan: Plan) -> list[tuple[str, float]]:
    """(kind, bytes) of the most loaded rank, in MEMORY_KINDS order, "peak" left out."""
    breakdown = plan.prediction.memory_breakdown
    kinds = [k for k in MEMORY_KINDS if k in breakdown]
    kinds += sorted(k for k in breakdown if k not in MEMORY_KINDS and k != "peak")
    return [(k, float(breakdown[k])) for k in kinds]


# --- parameter placements and redistributions, grouped per block role --------------------------

def _block_role(fqn: str, prefix: str) -> tuple[str, int | None]:
    """("model.layers.*.mlp.up_proj.weight", 3) for "model.layers.3.mlp.up_proj.weight"."""
    if prefix:
        m = re.match(re.escape(prefix) + r"\.(\d+)(\.|$)", fqn)
        if m:
            return f"{prefix}.*{fqn[m.end(1):]}", int(m.group(1))
        return fqn, None
    m = re.search(r"\.(\d+)\.", fqn)  # no graph: the first numbered component is the block
    if m:
        return f"{fqn[:m.start(1)]}*{fqn[m.end(1):]}", int(m.group(1))
    return fqn, None


def _occurrences(layers: set[int], num_layers: int, total_layers: int) -> int:
    """How often a role seen in captured blocks `layers` occurs in the real model."""
    if not num_layers or len(layers) >= num_layers:
        return total_layers or len(layers)
    if layers == {0}:
        return 1  # fed from outside the blocks: the first block only
    if 0 not in layers and len(layers) == num_layers - 1:
        return total_layers - 1  # fed by the previous block
    return round(len(layers) * total_layers / num_layers)


@dataclass(frozen=True)
class ParamGroup:
    """Parameters with one role and one placement on the tp axis.

    Attributes:
        role: FQN with the block index replaced by "*" (the FQN itself outside the blocks).
        placement: "R" | "S(d)".
        shape: global shape (empty when no graph was given).
        count: how many such parameters the real model has.
        tied_to: the canonical FQN when this is another name of a tied weight, else "".
        is_buffer: a registered buffer (e.g. rotary inv_freq), not a trainable parameter
            (False without a graph, which alone knows).
    """

    role: str
    placement: str
    shape: tuple[int, ...]
    count: int
    tied_to: str = ""
    is_buffer: bool = False


def param_groups(plan: Plan, graph: CapturedGraph | None = None) -> list[ParamGroup]:
    """Plan.param_placements grouped per block role ([Note: block roles]), in FQN order of each
    role's first parameter."""
    prefix = graph.layer_prefix if graph is not None else ""
    num_layers = graph.num_layers if graph is not None else 0
    total = graph.total_layers if graph is not None else 0
    groups: dict[tuple[str, str, str], tuple[tuple, set[int], int]] = {}
    buffers = set()
    canonical = {}  # any FQN (tied aliases too) -> its ParamInfo
    for info in (graph.params.values() if graph is not None else ()):
        canonical.update({name: info for name in (info.fqn, *info.aliases)})
    for fqn, placement in plan.param_placements:
        role, layer = _block_role(fqn, prefix)
        info = canonical.get(fqn)
        shape = info.shape if info is not None else ()
        tied = _block_role(info.fqn, prefix)[0] if info is not None and info.fqn != fqn else ""
        key = (role, placement, tied)
        if info is not None and info.is_buffer:
            buffers.add(key)
        old_shape, layers, n = groups.get(key, (shape, set(), 0))
        if layer is not None:
            layers.add(layer)
        groups[key] = (old_shape, layers, n + 1)
    result = []
    for (role, placement, tied), (shape, layers, n) in groups.items():
        count = _occurrences(layers, num_layers, total) if layers and graph is not None else n
        result.append(ParamGroup(role, placement, tuple(shape), count, tied,
                                 (role, placement, tied) in buffers))
    return result


def sharded_params(plan: Plan, graph: CapturedGraph | None = None) -> tuple[int, int]:
    """(parameters sharded on the tp axis, parameters) of the real model: `param_groups`
    counts, a tied weight once, buffers left out. Without a graph these are the plan's
    `param_placements` entries: names of the captured blocks only, a tied weight under each
    of its names (the plan alone cannot tell)."""
    own = [g for g in param_groups(plan, graph) if not g.tied_to and not g.is_buffer]
    return sum(g.count for g in own if g.placement != "R"), sum(g.count for g in own)


@dataclass(frozen=True)
class RedistributionGroup:
    """Redistributions with one consumer role, argument, placement change and collective.

    Attributes:
        where: the consumer's module path (block index as "*") and op, e.g.
            "model.layers.*.self_attn.o_proj: linear"; "graph output" for the output.
        producer, consumer, arg_index: the edge of the first occurrence (fx node names).
        src, dst, collective: the placement change on the tp axis and its collective.
        bytes: bytes of the tensor moved by one occurrence.
        time_s: predicted forward time of one occurrence, seconds.
        count: occurrences in the real model per microbatch.
        part: "pre" | "block" | "post": where the consumer is ("?" without a graph).
    """

    where: str
    producer: str
    consumer: str
    arg_index: int
    src: str
    dst: str
    collective: str
    bytes: float
    time_s: float
    count: int
    part: str

    @property
    def edge(self) -> str:
        return f"{self.producer} -> {self.consumer}[{self.arg_index}]"


def _parts(graph: CapturedGraph) -> dict[str, str]:
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


def redistribution_groups(plan: Plan,
                          graph: CapturedGraph | None = None) -> list[RedistributionGroup]:
    """Plan.redistributions grouped per consumer role ([Note: block roles]); without a graph,
    one group per redistribution."""
    if graph is None:
        return [RedistributionGroup(r.consumer, r.producer, r.consumer, r.arg_index, r.src,
                                    r.dst, r.collective, r.bytes, r.time_s, 1, "?")
                for r in plan.redistributions]
    position = {n: i for names in graph.layer_nodes.values() for i, n in enumerate(names)}
    parts = _parts(graph)
    groups: dict[tuple, tuple[RedistributionGroup, set[int], list[int]]] = {}
    for r in plan.redistributions:
        info = graph.nodes.get(r.consumer)  # None: the graph output
        layer = info.layer_id if info is not None else None
        role = ("block", position[r.consumer]) if layer is not None else ("node", r.consumer)
        key = (*role, r.arg_index, r.src, r.dst, r.collective)
        if key not in groups:
            if info is None:
                where, part = "graph output", "post"
            else:
                path = _block_role(info.module_path, graph.layer_prefix)[0] or "<root>"
                where, part = f"{path}: {op_name(info.target)}", parts[r.consumer]
            first = RedistributionGroup(where, r.producer, r.consumer, r.arg_index, r.src,
                                        r.dst, r.collective, r.bytes, r.time_s, 0, part)
            groups[key] = (first, set(), [0])
        _, layers, seen = groups[key]
        seen[0] += 1
        if layer is not None:
            layers.add(layer)
    return [dataclasses.replace(
        first, count=_occurrences(layers, graph.num_layers, graph.total_layers) if layers
        else seen[0]) for first, layers, seen in groups.values()]


# --- compute and communication per part ----------------------------------------------------------

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
            the ops "selective" does not keep, cost_model.memory [Note: selective saved set]).
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


def part_costs(plan: Plan, graph: CapturedGraph, topology: Topology) -> list[PartCost]:
    """Compute and communication per part, per microbatch of `plan.microbatch_size` samples,
    recomputed from the plan's per-node placements with the cost model (see PartCost).

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

    parts = _parts(graph)
    sums = {p: [0.0, 0.0, 0.0, 0.0] for p in ("pre", "block", "post")}
    fx_nodes = {node.name: node for node in graph.gm.graph.nodes}
    device = topology.device
    speed = device.speed(min(topology.devices_per_node, plan.mesh.world_size))
    constants = constant_like_nodes(graph)
    for name, info in graph.nodes.items():
        if parts[name] == "block" and rep.get(name) != name or name in constants:
            continue  # the first block stands for all ([Note: block roles])
        scaled = at_tokens(info, scale, module_input_bytes(fx_nodes[name]))
        factor = factor_of(name)
        fwd = op_time_s(scaled, device, plan.dtype, shard_factor=factor) / speed
        host = device.dtensor_op_overhead_s * dtensor_dispatches(info) if tp > 1 else 0.0
        sums[parts[name]][0] += fwd + host / 2
        sums[parts[name]][1] += backward_time_s(scaled, device, plan.dtype,
                                                shard_factor=factor) / speed + host / 2
        if _recomputed(plan, info):
            sums[parts[name]][1] += fwd
    for group in redistribution_groups(plan, graph):
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


def error_band_text(plan: Plan, kind: str) -> str:
    """"expected error -17% to +1% (10 plans on ..., bench/fidelity.py)" for `kind`
    ("step_time" | "peak_memory") of the plan's [Note: error bands]; "" when the plan has none
    (written before they existed)."""
    band = plan.prediction.error_bands.get(kind)
    if not band:
        return ""
    text = (f"expected error {band['low'] * 100:+.0f}% to {band['high'] * 100:+.0f}% "
            f"(predicted vs measured over {band['rows']} {band['covers']}, {band['source']})")
    return text + (f"; not covered: {band['not_covered']}" if band.get("not_covered") else "")
