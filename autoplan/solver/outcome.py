"""What the planner says of its result (planner.py): the runners-up and why each loses, the
warnings (weights a fixed tp leaves whole, configurations skipped at the solver's limit) and
the errors where no plan is left (overrides that admit no configuration, no plan that fits in
memory, every configuration cut at the limit), each naming the numbers at fault."""

from __future__ import annotations

import warnings
from dataclasses import replace

from autoplan.cost_model.config import blocks_text, config_stages
from autoplan.cost_model.expert_parallel import EXPERTS_REASON
from autoplan.cost_model.step_time import Assessment
from autoplan.graph import CapturedGraph
from autoplan.plan import Plan
from autoplan.solver.branch_bound import POLICY_ORDER, rank_key, runner_up_group
from autoplan.solver.configurations import (InvalidConfig, Overrides, PlanConfig,
                                            ReplicatedWeightsWarning, SolverLimitWarning)
from autoplan.solver.expert_degree import ep_degrees
from autoplan.solver.ilp import evaluate
from autoplan.solver.ilp_types import SolverLimitReached
from autoplan.solver.problem import Problem
from autoplan.solver.search import Search
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology
from autoplan.units import fmt_bytes

__all__ = ["no_configuration", "warn_unsplit", "given_overrides", "alternatives",
           "even_split", "float8_off", "explain_memory", "limit_error", "warn_skipped"]


def no_configuration(graph: CapturedGraph, topology: Topology, spec: TrainingSpec,
                      overrides: Overrides, unplaced: list[tuple[str, str]]) -> InvalidConfig:
    """The error of overrides that admit no configuration, naming the meshes that were
    skipped because their groups cannot sit on the nodes ((mesh, why) of
    configurations.enumerate_configs), the meshes of one reason together."""
    text = (f"no configuration of {topology.world_size} devices satisfies the overrides "
            f"{given_overrides(overrides)} with global_batch {spec.global_batch} and "
            f"{graph.total_layers} layers")
    o = overrides
    if o.pp and o.pp > 1 and o.num_microbatches and o.num_microbatches < o.pp and \
            o.schedule in (None, "1f1b", "interleaved-1f1b", "interleaved-zb"):
        text += (f"; {o.num_microbatches} microbatches are fewer than pp {o.pp} stages, which "
                 "torch's 1F1B and interleaved schedules refuse: give num_microbatches >= "
                 f"{o.pp} or schedule gpipe")
    if unplaced:
        meshes: dict[str, list[str]] = {}
        for mesh, why in unplaced:
            meshes.setdefault(why, []).append(mesh)
        reasons = "; ".join(f"{', '.join(m)}: {why}" for why, m in meshes.items())
        text += (f"; the meshes they allow cannot be placed: {reasons} (use degrees that "
                 f"divide devices_per_node={topology.devices_per_node} or are multiples of it)")
    return InvalidConfig(text)


def warn_unsplit(search: Search, result: Plan) -> None:
    """ReplicatedWeightsWarning when the plan's (user-fixed) tp > 1 leaves weight matrices
    (>= 2 dims) of the repeated block (of the model, without blocks) replicated on the tp axis
    and the graph says why: a weight none of whose dims tp divides, or an op of the block that
    no placement splits over tp ranks (fused attention with 12 heads on tp 8). A replication
    the cost model merely preferred (communication dearer than what sharding saves) is a
    choice, not warned about."""
    tp, graph = result.mesh.tp, search.graph
    if tp == 1:
        return
    in_block = (lambda layer_id: layer_id == 0) if graph.num_layers else (lambda _: True)
    head = f"{graph.block_path(0)}." if graph.num_layers else ""
    weights = [p for p in graph.params.values()
               if not p.is_buffer and len(p.shape) >= 2 and in_block(p.layer_id)]
    replicated = [p for p in weights if result.placement_of(p.fqn) == "R"]
    if not replicated:
        return

    def named(params) -> str:
        return ", ".join(f"{p.fqn.removeprefix(head)} {tuple(p.shape)}" for p in params)

    odd = [p for p in replicated if all(d % tp for d in p.shape)]
    # the weights' own dims explain it; else the ops of the block that nothing splits
    causes = ([f"tp {tp} divides none of the dims of {named(odd)}"] if odd else
              _unsplit_ops(graph, search.problem(tp),
                           graph.layer_nodes.get(0, ()) if graph.num_layers else graph.nodes))
    if not causes:
        return
    where = f"every block of {graph.layer_prefix}" if graph.num_layers else graph.model_name
    names = named(replicated)
    warnings.warn(
        f"tp {tp} leaves {len(replicated)} of the {len(weights)} weight matrices of {where} "
        f"replicated on the tp axis (each of the {tp} tp ranks holds them whole): {names}. "
        f"Cause: {'; '.join(causes)}. Choose a tp that divides these dims, or leave tp to the "
        f"planner.", ReplicatedWeightsWarning, stacklevel=4)


def _unsplit_ops(graph: CapturedGraph, problem: Problem, names) -> list[str]:
    """The ops among `names` (tensor outputs of >= 2 dims, not constants) that no candidate
    places with a Shard on the tp axis, each with its output shape and the dims tp does not
    divide; those that compute (FLOPs > 0: matmuls, attention) when there are any, since the
    elementwise ops around them follow their placement."""
    tp, out, computing = problem.tp, [], []
    for name in names:
        info, cands = graph.nodes.get(name), problem.cands.get(name)
        if (info is None or not cands or name in problem.constants or not info.shapes
                or len(info.shapes[0]) < 2
                or any(pl.startswith("S") for c in cands for pl in c.inputs + c.outputs)):
            continue
        op = info.target.split(".")[1] if info.target.startswith("aten.") else info.target
        shape = tuple(info.shapes[0])
        odd = ", ".join(f"{size} (dim {d})" for d, size in enumerate(shape)
                        if size > 1 and size % tp)
        text = (f"{op} in {info.module_path or 'the model'} (output {shape}): no placement "
                f"splits it over {tp} ranks" + (f"; tp {tp} does not divide {odd}" if odd else ""))
        out.append(text)
        if info.flops > 0:
            computing.append(text)
    return computing or out


def given_overrides(o: Overrides) -> dict:
    """The overrides the user gave: fields set and not at their default (the switches
    `allow_tp_across_nodes`, `uneven_stages`, `elementwise_optimizer` and `split_backward`
    are not choices fixed)."""
    defaults = Overrides()
    return {k: v for k, v in vars(o).items()
            if v is not None and v != getattr(defaults, k)
            and k not in ("allow_tp_across_nodes", "uneven_stages", "elementwise_optimizer",
                          "split_backward", "ep", "time_limit_s", "top_k")}


def alternatives(best: Assessment, evaluated: list[Assessment], top_k: int) -> list[tuple]:
    """Runners-up with the reason each loses: up to two faster ones that do not fit
    ("memory"), then the fastest that fit; one per (mesh, microbatches, schedule), so that
    the list shows different plans rather than ZeRO stages of one."""
    group = runner_up_group
    seen = {group(best)}
    faster_oom, fits = [], []
    for a in sorted(evaluated, key=rank_key):
        if group(a) in seen:
            continue
        if a.fits:
            seen.add(group(a))
            fits.append(a)
        elif a.step_time_s < best.step_time_s and len(faster_oom) < min(2, top_k):
            seen.add(group(a))
            faster_oom.append(a)
    chosen = (faster_oom + fits)[:top_k]
    return [(a, _reason(a, best)) for a in sorted(chosen, key=rank_key)]


def even_split(search: Search, best: Assessment, evaluated: list[Assessment]) -> list[tuple]:
    """The runner-up that says what a searched uneven stage split wins ([Note: uneven stages]
    in configurations.py): `best`'s configuration with its blocks split evenly -- as the
    search priced it, else priced with `best`'s placements -- and why it loses; [] when
    `best`'s split is the even one."""
    if not best.config.stage_layers:
        return []
    cfg = replace(best.config, stage_layers=())
    even = next((a for a in evaluated if a.config == cfg), None)
    if even is None:
        even = search.assess(cfg, best.solution)
    blocks = blocks_text(st.num_layers for st in config_stages(cfg, search.total_layers))
    return [(even, f"stages split evenly ({blocks} blocks): {_reason(even, best)}")]


def float8_off(search: Search, best: Assessment, num_linears: int) -> list[tuple]:
    """The runner-up that says what the float8 recipe buys ([Note: float8 pricing] in
    cost_model/float8.py): `best`'s configuration and placements with every linear in the
    compute dtype, priced now, and what it loses (or, under float8="on", wins) by; [] when the
    search priced no FP8 linear (`num_linears` 0, or float8 "off")."""
    if search.spec.float8 == "off" or not num_linears:
        return []
    # the same candidate lists (a float8="on" search cut them: solver/float8.py), other costs
    off = replace(search, spec=replace(search.spec, float8="off"), costs={}, scaled={},
                  solutions={}, bounds={}, stopped={}, skipped={})
    cfg = best.config
    costs = off.cost(*cfg.costs_key)
    alt = off.assess(cfg, evaluate(off.problem(cfg.tp), costs, best.solution.choice))
    what = (f"every linear in {search.spec.dtype} (float8 {search.spec.float8!r} runs "
            f"{num_linears} in FP8)")
    d = alt.step_time_s - best.step_time_s
    if d < 0:  # float8="on" given where FP8 does not pay
        return [(alt, f"{what}: {_seconds(-d)} per step faster ({d / best.step_time_s:+.1%}), "
                      "not taken (float8 given)")]
    return [(alt, f"{what}: {_reason(alt, best)} ({d / best.step_time_s:+.1%})")]


def expert_layout(search: Search, best: Assessment, evaluated: list[Assessment],
                  given_ep: bool = False) -> list[tuple]:
    """The runner-up that says why the experts of a mixture-of-experts plan lie as they do
    ([Note: expert parallelism] in cost_model/expert_parallel.py): `best`'s configuration and
    placements with the other layout -- at ep 1 (the experts held as the dense weights) when
    `best` has ep > 1, else at the ep > 1 that does best there (fitting first) -- as the search
    priced it, else priced now; and what it loses by, with ep's own terms (all-to-alls, the
    experts' dp sync and compute). No plan of either layout beats `best`: the search is joint
    ([Note: expert parallelism]); this says what ep does to the chosen configuration. With ep
    given (`given_ep`) the other layout may be faster: said so, the net difference first. []
    for a dense model, or where no ep > 1 applies to it."""
    if search.moe is None:
        return []
    cfg, sol = best.config, best.solution
    if cfg.ep > 1:
        others = [replace(cfg, ep=1)]
    else:
        others = [replace(cfg, ep=e) for e in ep_degrees(search.moe, cfg.dp, cfg.tp, cfg.cp,
                                                         search.topology, None) if e > 1]
        others = [c for c in others if search.for_ep(c, sol) is not None]
    priced = {a.config: a for a in evaluated}
    alt = min((priced.get(c) or search.assess(c, sol) for c in others), default=None,
              key=lambda a: (not a.fits, a.step_time_s))
    if alt is None:
        return []
    with_ep = alt if alt.config.ep > 1 else best
    a2a_s, sync_s, compute_s = search.ep_delta(with_ep.config)
    terms = (f"ep {with_ep.config.ep}'s all-to-alls {_seconds(a2a_s)}, the experts' dp sync "
             f"{_signed(sync_s)} and compute {_signed(compute_s)} against ep 1")
    where = (f"{EXPERTS_REASON}with the dense layers (ep 1)" if alt.config.ep == 1 else
             f"{EXPERTS_REASON}over ep {alt.config.ep}") + " on this configuration"
    d = alt.step_time_s - best.step_time_s
    if not alt.fits:
        net = _reason(alt, best)
    elif d < 0:  # only where the user fixed ep: the search would have taken it
        net = f"{_seconds(-d)} per step faster ({d / best.step_time_s:+.1%}), not taken"
    elif d > 0:  # the net difference, then the part that moves most
        deltas = _deltas(alt, best)
        net = (f"+{_seconds(d)} per step vs the chosen plan, most in "
               f"{max(deltas, key=deltas.get)}")
    else:
        net = _reason(alt, best)
    given = (f" (ep {cfg.ep} given: configurations at other ep not searched)"
             if given_ep else "")
    return [(alt, f"{where}{given}: {net}; {terms}")]


def _signed(d: float) -> str:
    return ("+" if d >= 0 else "-") + _seconds(abs(d))


def _deltas(a: Assessment, best: Assessment) -> dict[str, float]:
    """What `a` adds to `best`'s step time by part, seconds (recomputation and offload named
    where they are what it adds)."""
    deltas = {"bubble": a.bubble_s - best.bubble_s, "communication": a.comm_s - best.comm_s,
              "compute": a.compute_s - best.compute_s}
    if deltas["compute"] > 0 and POLICY_ORDER[a.config.checkpointing] > POLICY_ORDER[
            best.config.checkpointing]:
        deltas["recomputation"] = deltas.pop("compute")  # the extra compute is the recompute
    if a.config.offload != "none" and best.config.offload == "none":
        # [Note: offload]: its host step and transfers are what it adds
        deltas = {"offload": a.step_time_s - best.step_time_s}
    return deltas


def _reason(a: Assessment, best: Assessment) -> str:
    if not a.fits:
        return (f"memory: needs {fmt_bytes(a.memory_bytes)} per device, over the budget")
    deltas = _deltas(a, best)
    kind = max(deltas, key=deltas.get)
    if deltas[kind] <= 0:
        return "tie: same predicted step time; ranked by memory and simplicity"
    d = deltas[kind]
    text = f"{kind}: +{_seconds(d)} per step vs the chosen plan"
    if kind == "communication" and a.config.cp > 1 and a.cp_comm_s > best.cp_comm_s:
        # [Note: context parallelism]: the K/V collectives are not overlapped
        text += f" (cp{a.config.cp}: K/V all-gather exposed {_seconds(a.cp_comm_s)})"
    return text


def _seconds(d: float) -> str:
    return f"{d:.3g} s" if d >= 1 else f"{d * 1e3:.3g} ms"


def explain_memory(search: Search, configs: list[PlanConfig]) -> tuple[float, str]:
    """(bytes, NoFeasiblePlan message): the smallest per-device memory any plan needs."""
    device = search.topology.device
    budget = search.spec.max_memory_fraction * device.mem_bytes
    bounds = sorted(((search.lower_bound(c).memory_bytes, c) for c in configs),
                    key=lambda t: t[0])
    best: tuple | None = None
    for lb, cfg in bounds[:8]:  # exact minima of the most promising few
        if best is not None and lb >= best[0]:
            break
        exact = _min_memory(search, cfg)
        value = exact if exact is not None else lb
        if best is None or value < best[0]:
            best = (value, cfg)
    best_bytes, best_cfg = best
    return best_bytes, (
        f"no plan fits in memory: the smallest per-device memory any plan needs is "
        f"{fmt_bytes(best_bytes)} ({best_cfg}), but {device.name} has "
        f"{fmt_bytes(device.mem_bytes)} ({fmt_bytes(budget)} usable at "
        f"max_memory_fraction {search.spec.max_memory_fraction})")


def _min_memory(search: Search, cfg: PlanConfig) -> float | None:
    """The least memory a plan of cfg needs; None when no placement was found (none exists,
    or its ILP reached its limit: the caller uses the lower bound)."""
    try:
        sol = search.smallest(cfg)
    except SolverLimitReached:
        return None
    return None if sol is None else search.assess(cfg, sol).memory_bytes


def limit_error(search: Search) -> SolverLimitReached:
    """The error when no plan is left and configurations were skipped at the limit."""
    first = next(iter(search.skipped.values()))
    more = len(search.skipped) - 1
    where = first.config + (f" and {more} more configuration{'s' * (more > 1)}" if more else "")
    return SolverLimitReached(first.ilp, first.limit_s, where)


def warn_skipped(search: Search) -> None:
    """SolverLimitWarning naming the skipped configurations (at most 3) and the limit."""
    errors = list(search.skipped.values())
    names = "; ".join(e.config for e in errors[:3]) + ("; ..." if len(errors) > 3 else "")
    what = "1 configuration" if len(errors) == 1 else f"{len(errors)} configurations"
    warnings.warn(
        f"{what} skipped, no placement found within time_limit_s={errors[0].limit_s:g} "
        f"deterministic seconds ({names}); the plan is the best of the others, a larger "
        f"time_limit_s includes them", SolverLimitWarning, stacklevel=4)
