"""The expert-parallel degree ep of a plan: a given one checked, or the degree of least step
time among those that apply and fit, each priced by cost_model/expert_parallel.py ([Note:
expert parallelism] there: a decomposition over the plan chosen at ep = 1).
"""

from __future__ import annotations

from collections.abc import Callable

from autoplan.cost_model.comm import group_layout
from autoplan.cost_model.expert_parallel import (
    ExpertLayers, expert_layers, expert_slices, expert_weights, with_expert_parallel,
)
from autoplan.cost_model.rank_memory import ExpertSlices
from autoplan.graph import CapturedGraph
from autoplan.plan import Plan
from autoplan.solver.configurations import InvalidConfig
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology

__all__ = ["expert_parallel"]


def expert_parallel(graph: CapturedGraph, plan: Plan, spec: TrainingSpec, topology: Topology,
                    ep: int | None,
                    rank_peaks: Callable[[ExpertSlices], list[dict[str, float]]]) -> Plan:
    """`plan` with its expert-parallel degree: `ep` when given (1: none), else the degree of
    least step time among those that apply and fit ([Note: expert parallelism]).
    `rank_peaks(slices)`: the memory of each pipeline rank of `plan`'s configuration and
    placement with the expert weights held as `slices` (solver/search.py Search.rank_peaks).

    Raises:
        InvalidConfig: a given ep > 1 that does not apply: the graph has no MoE layer, ep does
            not divide dp or ep x tp some layer's experts, the plan has tp > 1 and does not
            split the experts on tp (the runtime's support), or its groups straddle
            node boundaries unevenly (cost_model/comm.py [Note: group layout]).
    """
    layers = expert_layers(graph)
    if ep is not None and ep < 1:
        raise InvalidConfig(f"ep {ep} must be >= 1")
    if ep == 1 or (layers is None and ep is None) or plan.mesh.cp > 1:  # cp: no ep (plan())
        return plan
    tokens = plan.microbatch_size * spec.seq_len  # a rank's microbatch (cp 1 here)
    slices = lambda e: expert_slices(  # noqa: E731
        layers, e, tokens, spec.dtype_bytes, spec.routing_skew, plan.mesh.tp)
    if ep is not None:
        reason = _not_applicable(layers, plan, ep, topology, graph)
        if reason:
            raise InvalidConfig(f"ep {ep}: {reason}")
        return with_expert_parallel(layers, plan, spec, topology, ep, rank_peaks(slices(ep)))
    budget = spec.max_memory_fraction * topology.device.mem_bytes
    best = plan
    for e in range(2, plan.mesh.dp + 1):
        if _not_applicable(layers, plan, e, topology, graph):
            continue
        cand = with_expert_parallel(layers, plan, spec, topology, e, rank_peaks(slices(e)))
        if cand.prediction.memory_bytes <= budget and \
                cand.prediction.step_time_s < best.prediction.step_time_s:
            best = cand
    return best


def _not_applicable(layers: ExpertLayers | None, plan: Plan, ep: int,
                    topology: Topology, graph: CapturedGraph) -> str:
    mesh = plan.mesh
    if layers is None:
        return "the model has no mixture-of-experts layer"
    if mesh.dp % ep:
        return f"does not divide dp {mesh.dp} (fix dp to a multiple of ep)"
    bad = sorted({e for e in layers.num_experts if e % (ep * mesh.tp)})
    if bad:
        return (f"x tp {mesh.tp} does not divide the experts of every layer ({bad})"
                if mesh.tp > 1 else f"does not divide the experts of every layer ({bad})")
    if mesh.tp > 1:  # tp's split of whole experts, split again over ep (runtime)
        placements = dict(plan.param_placements)
        unsplit = sorted(f for f in expert_weights(graph) if placements.get(f) != "S(0)")
        if unsplit:
            return (f"at tp {mesh.tp} needs the experts split on tp (Shard(0)); the plan "
                    f"places {unsplit[0]} {placements.get(unsplit[0], 'R')} (pin "
                    f"placements={{'*experts*': 'S(0)'}} or fix tp=1)")
    try:  # the ep groups and the groups across them must sit evenly on the nodes
        group_layout(ep, mesh.tp, topology)
        group_layout(mesh.dp // ep, mesh.tp * ep, topology)
    except ValueError as e:
        return str(e)
    return ""
