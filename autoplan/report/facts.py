"""What the report says, derived from a `Plan` (and, when given, its graph and topology).

Renderers (markdown.py, html.py) only format these facts, so Markdown, HTML and the CLI summary
cannot disagree. Everything is SI: seconds, bytes (1 GB = 1e9 B), FLOP/s.

Grouped per block role: autoplan/report/roles.py ([Note: block roles]); compute and
communication per part: autoplan/cost_model/part_costs.py (`part_costs` below).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cost_model import part_costs as priced_parts
from autoplan.cost_model.comm import group_layout, hop_crosses_nodes, pipeline_hops
from autoplan.cost_model.config import blocks_text, stages_of
from autoplan.cost_model.expert_parallel import EXPERTS_REASON, expert_weights
from autoplan.cost_model.part_costs import PartCost
from autoplan.graph import CapturedGraph
from autoplan.plan import Plan
from autoplan.report.roles import (ParamGroup, RedistributionGroup, param_groups,
                                   redistribution_groups, sharded_params)
from autoplan.topology import Topology
from autoplan.units import fmt_bytes, fmt_count, fmt_flops, fmt_pct, fmt_si, fmt_time, plural

__all__ = [
    "MEMORY_KINDS", "AxisFacts", "ParamGroup", "RedistributionGroup", "PartCost",
    "fmt_si", "fmt_bytes", "fmt_time", "fmt_count", "fmt_flops", "fmt_pct", "plural",
    "model_num_params", "trainable_text", "sharded_params", "mesh_axes",
    "param_groups", "redistribution_groups", "part_costs", "tokens_per_s", "memory_rows",
    "host_share_bytes", "OFFLOAD_TEXT", "searched_split",
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


def experts_text(plan: Plan, graph: CapturedGraph | None) -> str:
    """How the routed experts of a mixture-of-experts model are laid out over the ranks, next
    to the dense layers' mesh, in words ("" for a model without experts, or without the
    graph): the expert mesh -- expert tp (tp splitting each expert), ep (the ranks holding
    disjoint experts: tp's split of whole experts, Shard(0), times the ep groups over dp) and
    the experts' dp -- folded over the dense tp x dp ranks of a stage (Megatron-Core's
    "MoE parallel folding", Liu et al. 2025, arXiv 2504.14960), a rank's share of each MoE layer it runs (its
    pipeline stage's), what holds that share (under ep the slice whole, outside ZeRO; without
    ep ZeRO as for the dense weights) and why, from the plan's runner-up that prices the other
    layout (solver/outcome.py `expert_layout`) -- [Note: expert parallelism] in
    cost_model/expert_parallel.py, [Note: experts over ep and tp] in
    runtime/expert_parallel.py."""
    if graph is None or graph.gm is None:
        return ""
    weights = expert_weights(graph)
    if not weights:
        return ""
    m = plan.mesh
    weight = weights[0]
    num_experts = graph.params[weight].shape[0] if weight in graph.params else 0
    place = plan.placement_of(weight)
    whole_tp = m.tp if place == "S(0)" else 1  # tp ranks holding disjoint whole experts
    expert_tp = m.tp if place not in ("S(0)", "R") else 1  # tp ranks splitting each expert
    ep = m.ep * whole_tp
    edp = m.dp * m.tp // (ep * expert_tp)
    folded = [f"tp {whole_tp}"] * (whole_tp > 1) + [f"{m.ep} of the dp ranks"] * (m.ep > 1)
    mesh = (f"expert mesh ep {ep} x edp {edp} x etp {expert_tp}"
            + (f" (ep folds {' with '.join(folded)})" if len(folded) > 1 else
               f" (ep on {folded[0]})" if folded else ""))
    share = num_experts // ep if num_experts else 0
    layer = "every MoE layer" + (" of its stage" if m.pp > 1 else "")
    dense = f"the dense layers on dp {m.dp} x tp {m.tp}"
    where = (f"{mesh}: a rank holds {share} of the {num_experts} experts of {layer}"
             if ep > 1 else f"{mesh}: all {num_experts} experts of {layer} on every rank"
             + (f", each split over tp {expert_tp}" if expert_tp > 1 else ""))
    if m.ep > 1:
        outer = m.dp // m.ep
        held = (f"that slice whole, outside ZeRO, on {outer} dp rank"
                f"{'s' if outer != 1 else ''} (dp {m.dp} / ep {m.ep}); "
                f"tokens exchanged by all-to-all within each ep group")
    elif plan.zero_stage == 3 and m.dp > 1:
        held = f"sharded over dp {m.dp} by ZeRO-3 between uses, as the dense weights"
    else:
        held = f"held as the dense weights are (ZeRO-{plan.zero_stage})"
    why = next((a.reason for a in plan.alternatives
                if a.reason.startswith(EXPERTS_REASON)), "")
    return f"{where}, {held}; {dense}" + (f". Why: {why}" if why else "")


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
    """"pp 1 x dp 128 x cp 32 x tp 4", "pp 4 x dp 64 (ep 8) x tp 8" (cp and ep only when
    > 1; ep inside dp)."""
    cp = f" x cp {mesh.cp}" if getattr(mesh, "cp", 1) > 1 else ""
    ep = f" (ep {mesh.ep})" if getattr(mesh, "ep", 1) > 1 else ""
    return f"pp {mesh.pp} x dp {mesh.dp}{ep}{cp} x tp {mesh.tp}"


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


def part_costs(plan: Plan, graph: CapturedGraph, topology: Topology) -> list[PartCost]:
    """Compute and communication per part of the model on one rank, per microbatch (PartCost):
    cost_model/part_costs.py over the plan's redistributions grouped per block role. Raises
    ValueError from the cost model (e.g. a dtype the device lists no peak for)."""
    return priced_parts.part_costs(plan, graph, topology, redistribution_groups(plan, graph))


def tokens_per_s(plan: Plan) -> float:
    step = plan.prediction.step_time_s
    return plan.global_batch * plan.seq_len / step if step > 0 else 0.0


def host_share_bytes(plan: Plan, topology: Topology | None) -> float:
    """Host memory per rank: the node's, shared by its ranks (0 without a topology or host
    figures; [Note: offload] in autoplan/cost_model/offload.py)."""
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
"""What each `Plan.offload` means, for the summary ([Note: offload] in cost_model/offload.py)."""


def memory_rows(plan: Plan) -> list[tuple[str, float]]:
    """(kind, bytes) of the most loaded rank, in MEMORY_KINDS order, "peak" left out."""
    breakdown = plan.prediction.memory_breakdown
    kinds = [k for k in MEMORY_KINDS if k in breakdown]
    kinds += sorted(k for k in breakdown if k not in MEMORY_KINDS and k != "peak")
    return [(k, float(breakdown[k])) for k in kinds]


def error_band_text(plan: Plan, kind: str, topology: Topology | None = None) -> str:
    """"expected error -17% to +1% (10 plans on ..., bench/fidelity.py)" for `kind`
    ("step_time" | "peak_memory") of the plan's [Note: error bands]; "no measured band (...)"
    where the bench measured no plan of its kind (`fidelity.uncovered`); "" when the plan has
    none (written before they existed)."""
    from autoplan.cost_model.fidelity import uncovered

    band = plan.prediction.error_bands.get(kind)
    if not band:
        return ""
    why = uncovered(plan, topology.device.name if topology is not None else None).get(kind)
    if why:
        return f"no measured band ({why} not measured by {band['source']})"
    text = (f"expected error {band['low'] * 100:+.0f}% to {band['high'] * 100:+.0f}% "
            f"(predicted vs measured over {band['rows']} {band['covers']}, {band['source']})")
    return text + (f"; not covered: {band['not_covered']}" if band.get("not_covered") else "")


def searched_split(plan: Plan) -> str:
    """"; stages of 1/2x30/1 blocks (split evenly: +1.2 s per step)" for a stage split the
    search chose over the even one ([Note: uneven stages] in solver/configurations.py), from
    the even split's runner-up; "" for an even or pinned split."""
    counts = [s.num_layers for s in plan.stages]
    if plan.pinned_stages or counts == [s.num_layers for s in stages_of(sum(counts),
                                                                        len(counts))]:
        return ""
    runner = next((a for a in plan.alternatives if a.reason.startswith("stages split evenly")),
                  None)
    if runner is None:
        gain = ""
    elif runner.reason.split("): ", 1)[-1].startswith("memory"):
        gain = " (split evenly: over the memory budget)"
    else:
        delta = runner.step_time_s - plan.prediction.step_time_s
        gain = f" (split evenly: {'+' if delta >= 0 else '-'}{fmt_time(abs(delta))} per step)"
    return f"; stages of {blocks_text(counts)} blocks{gain}"
