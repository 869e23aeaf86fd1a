"""`plan()`: the search of search.py driven to a `Plan` (its branch and bound over
configurations: solver/branch_bound.py)."""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time
import warnings

from autoplan.collector import collector_paused
from autoplan.cost_model.compute import compiled_device
from autoplan.cost_model.fidelity import error_bands
from autoplan.cost_model.step_time import Assessment
from autoplan.graph import CapturedGraph
from autoplan.options import OptionError, SearchOptions
from autoplan.plan import Plan
from autoplan.solver.assemble import build_plan
from autoplan.solver.branch_bound import (
    POLICY_ORDER, branch_and_bound, offload_candidates, offloaded, rank_key,
    runner_up_group,
)
from autoplan.solver.context import cp_degrees
from autoplan.units import fmt_bytes
from autoplan.solver.expert_degree import expert_parallel
from autoplan.solver.frozen import plan_frozen_dtype
from autoplan.solver.ilp import evaluate
from autoplan.solver.pins import pinned_params
from autoplan.solver.problem import Problem
from autoplan.solver.search import (
    InvalidConfig, NoFeasiblePlan, Overrides, PlanConfig, ReplicatedWeightsWarning, Search,
    SolverLimitReached, SolverLimitWarning, enumerate_configs, validate,
)
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology

__all__ = ["plan", "reprice", "compiled_topology"]

log = logging.getLogger(__name__)


def plan(graph: CapturedGraph, topology: Topology, spec: TrainingSpec,
         options: SearchOptions | None = None, *, compiled: bool = False,
         frozen_weights_dtype: str | None = None, elementwise_optimizer: bool = True,
         **choices) -> Plan:
    """The fastest configuration and placement that fits, as a `Plan`.

    Args:
        graph: captured model (global shapes). Placements are checked against the captured
            shapes; batch dims are never split on the tp axis, so any microbatch size is valid.
            Costs scale linearly with tokens from the captured batch x sequence length (capture
            at the planned seq_len for exact attention costs).
        topology: the cluster; spec: the training step.
        options: what the search fixes and how hard it works (autoplan/options.py
            `SearchOptions`, the one place each option is written; docs/reference.md lists
            them); default: everything searched. `choices`: its fields as keywords
            (`plan(graph, topology, spec, tp=2)`), applied over `options`.
        compiled: price the stages as run through torch.compile (no DTensor host time,
            pointwise chains fused: cost_model.compute.compiled_device, [Note: compiled
            execution]); the plan says so (`Plan.compiled`) and the runtime compiles them.
        frozen_weights_dtype: the dtype the model's frozen parameters (`requires_grad=False`)
            start in, e.g. "bfloat16" for a LoRA base read from a bf16 checkpoint; None: not
            known. With frozen parameters under a 16-bit dtype, the plan holds them in the
            compute dtype (`Plan.frozen_dtype`) when these are in it already or when fp32
            masters of them fit nowhere on the devices; `spec.frozen_dtype` set fixes it
            ([Note: frozen dtype] in solver/frozen.py). A model without frozen parameters
            is planned as it is.
        elementwise_optimizer: False when the optimizer reads whole tensors (a per-tensor
            norm: LAMB, LARS; Adafactor; Muon; runtime/optim.py whole_tensor_reason): ZeRO-1
            with dp x cp > 1 and the host offload of the optimizer at tp > 1, which hand it
            pieces of each tensor ([Note: elementwise optimizer]), are not searched, and a
            fixed zero_stage that needs them raises InvalidConfig.

    Returns:
        A Plan with every field filled (see autoplan.plan.Plan); pins recorded in
        `Plan.pinned`, given stages as `Plan.pinned_stages`.

    Raises:
        TypeError: a keyword that is not a field of `SearchOptions`.
        InvalidConfig: overrides that cannot work (the message names the numbers), a value
            outside its field's choices (an `OptionError` of SearchOptions, as InvalidConfig).
        ValueError: a pin that cannot hold (solver/pins.py, naming it).
        NoFeasiblePlan: nothing fits in memory (the message gives the smallest per-device memory
            any plan needs, with its configuration, and the device's memory).
        SolverLimitReached: no configuration is left with a placement that fits, and some were
            skipped because their ILP found no placement within `time_limit_s` (the message
            names the first and the limit).

    Warns:
        ReplicatedWeightsWarning: a fixed `tp` > 1 leaves weight matrices of the repeated
            block replicated on the tp axis because the model's shapes do not split by tp
            (e.g. 12 attention heads on tp 8); the message names the weights, their shapes and
            the dims tp does not divide.
        SolverLimitWarning: a plan was found, but configurations were skipped because their
            ILP found no placement within `time_limit_s` (the message names them).
    """
    try:
        o = Overrides(**{**vars(options or SearchOptions()), **choices},
                      elementwise_optimizer=elementwise_optimizer)
    except OptionError as e:
        raise InvalidConfig(str(e)) from None
    ep = o.ep
    if ep is not None and ep > 1:
        if o.cp not in (None, 1):
            raise InvalidConfig(f"ep {ep} with cp {o.cp}: expert and context parallelism are "
                                "not planned together")
        if o.tp not in (None, 1) or o.zero_stage == 1:
            raise InvalidConfig(f"ep {ep} runs with tp 1 and ZeRO 0, 2 or 3; got tp {o.tp}, "
                                f"zero_stage {o.zero_stage}")
        o = dataclasses.replace(o, cp=1, tp=1)
    if not isinstance(compiled, bool):
        raise ValueError(f"compiled={compiled!r}; expected True or False")
    if compiled:
        topology = compiled_topology(topology)
    if o.stages is not None:
        v = o.num_virtual_stages or 1
        pp = len(o.stages) // v if o.pp is None and len(o.stages) % v == 0 else o.pp
        o = dataclasses.replace(o, num_virtual_stages=v, pp=pp)
    with collector_paused():
        def run(chosen: TrainingSpec, search_offload: bool) -> Plan:
            fixed = o if search_offload or o.offload is not None else \
                dataclasses.replace(o, offload="none")
            return _plan(graph, topology, chosen, fixed, o.time_limit_s, o.top_k)

        result = plan_frozen_dtype(graph, spec, run, weights_dtype=frozen_weights_dtype,
                                   offload_searched=o.offload is None)
        spec = dataclasses.replace(spec, frozen_dtype=result.frozen_dtype or spec.frozen_dtype)
        if ep is not None and ep > 1 and result.zero_stage == 1:
            # ep does not run with ZeRO-1: the best plan at the other stages
            others = []
            for z in (0, 2, 3):
                try:
                    others.append(_plan(graph, topology, spec,
                                        dataclasses.replace(o, zero_stage=z), o.time_limit_s,
                                        o.top_k))
                except (InvalidConfig, NoFeasiblePlan):
                    continue
            if not others:
                raise InvalidConfig(f"ep {ep}: no plan fits at ZeRO 0, 2 or 3 (ep does not run "
                                    "with ZeRO-1)")
            result = min(others, key=lambda p: p.prediction.step_time_s)
    result = expert_parallel(graph, result, spec, topology, ep)
    if o.placements:
        result = dataclasses.replace(result, pinned=o.placements)
    if o.stages is not None:
        result = dataclasses.replace(result, pinned_stages=True)
    return dataclasses.replace(result, compiled=True) if compiled else result


def compiled_topology(topology: Topology) -> Topology:
    """`topology` with its device as it runs compiled stages
    (cost_model.compute.compiled_device, [Note: compiled execution])."""
    return dataclasses.replace(topology, device=compiled_device(topology.device))


def reprice(graph: CapturedGraph, plan: Plan, topology: Topology, spec: TrainingSpec) -> Plan:
    """`plan` -- its configuration and placements, unchanged -- priced on `topology`: the same
    Plan with the prediction the cost model makes there (no search; alternatives dropped).
    For comparing a plan that ran with what the model says under other figures (bench/
    fidelity.py prices the plan it ran at the machine speed measured during the run), or a plan
    made for one cluster on another of the same size.

    An ep plan keeps its ep, repriced too ([Note: expert parallelism] in
    cost_model/expert_parallel.py);
    a compiled plan is priced compiled ([Note: compiled execution]).

    Raises InvalidConfig when the plan does not belong to this graph and world size (a node
    without the plan's placements among its candidates, another device count).
    """
    if plan.mesh.world_size != topology.world_size:
        raise InvalidConfig(f"plan {plan.mesh} needs {plan.mesh.world_size} devices; topology "
                            f"{topology.name} has {topology.world_size}")
    if plan.compiled:
        topology = compiled_topology(topology)
    if plan.frozen_dtype:  # priced as it holds its frozen parameters
        spec = dataclasses.replace(spec, frozen_dtype=plan.frozen_dtype)
    with collector_paused():
        search = Search(graph, topology, spec, time_limit_s=10.0)
        cfg = PlanConfig(plan.mesh.pp, plan.mesh.dp, plan.mesh.tp, plan.zero_stage,
                         plan.num_microbatches, plan.microbatch_size, plan.schedule,
                         plan.num_virtual_stages, cp=plan.mesh.cp,
                         stage_layers=tuple(st.num_layers for st in plan.stages)
                         if plan.pinned_stages else (),
                         checkpointing=plan.checkpointing, offload=plan.offload)
        problem = search.problem(cfg.tp)
        wanted = {st.node: (st.inputs, st.outputs) for st in plan.strategies}
        fqn_of = {g: fqn for g, (fqn, *_x) in problem.params.items()}
        choice = {}
        for n in problem.nodes:
            cands = problem.cands[n]
            if n in wanted:
                match = [i for i, c in enumerate(cands) if (c.inputs, c.outputs) == wanted[n]]
            elif n in fqn_of:
                place = plan.placement_of(fqn_of[n])
                match = [i for i, c in enumerate(cands) if c.outputs[:1] == (place,)]
            else:  # graph inputs, constants: not part of a plan, replicated
                match = [i for i, c in enumerate(cands) if all(o == "R" for o in c.outputs)]
                match = match or [0]
            if not match:
                raise InvalidConfig(f"plan node {n}: placements {wanted.get(n)} are not among "
                                    f"its {len(cands)} candidates on this graph")
            choice[n] = match[0]
        costs = search.cost(*cfg.costs_key)
        assessed = search.assess(cfg, evaluate(problem, costs, choice))
        priced = expert_parallel(graph, build_plan(search, assessed, []), spec, topology,
                                 plan.mesh.ep)
        return dataclasses.replace(priced, compiled=plan.compiled)


def _plan(graph: CapturedGraph, topology: Topology, spec: TrainingSpec, overrides: Overrides,
          time_limit_s: float, top_k: int) -> Plan:
    """The best plan; cp > 1 is searched after cp = 1 ([Note: context parallelism] in
    cost_model/context_parallel.py): where no cp = 1 plan fits, where the cp = 1 plan needs CPU
    offload, and otherwise for a plan faster than the cp = 1 one beyond the step-time error band
    (`_cp_ceiling_s`: branch and bound under that ceiling, so configurations bounded above it
    cost no ILP). The faster of the two is taken."""
    if overrides.cp is not None or not _cp_may_help(graph, topology, spec):
        return _search(graph, topology, spec, overrides, time_limit_s, top_k)
    first, unfit, shared = None, [], {}
    least = _least_bound_s(graph, topology, spec, dataclasses.replace(overrides, cp=1),
                           time_limit_s, shared)
    if least < float("inf"):  # [Note: cp first under a bound]
        try:
            return _search(graph, topology, spec, overrides, time_limit_s, top_k,
                           context_parallel_only=True, shared=shared,
                           ceiling_s=_cp_ceiling_s(least, topology))
        except (InvalidConfig, _NoneFaster):
            pass
    try:  # what does not fit is explained once both searches have failed
        first = _search(graph, topology, spec, dataclasses.replace(overrides, cp=1),
                        time_limit_s, top_k, unfit=unfit, shared=shared)
    except (NoFeasiblePlan, InvalidConfig):
        pass
    ceiling = float("inf")
    if first is not None and first.offload == "none":
        ceiling = _cp_ceiling_s(first.prediction.step_time_s, topology)
    try:  # the cp = 1 configurations have had their search: the second one is over cp > 1
        second = _search(graph, topology, spec, overrides, time_limit_s, top_k,
                         context_parallel_only=True, unfit=unfit, shared=shared,
                         ceiling_s=ceiling)
    except (NoFeasiblePlan, InvalidConfig, _NoneFaster):
        if first is not None:
            return first
        if unfit:  # neither search has a plan that fits
            raise NoFeasiblePlan(min(_explain_memory(*u) for u in unfit)[1]) from None
        raise
    if first is None or second.prediction.step_time_s < first.prediction.step_time_s:
        return second
    return first


class _NoneFaster(Exception):
    """No configuration of a search beats its ceiling (`_search`'s `ceiling_s`)."""


def _cp_ceiling_s(first_s: float, topology: Topology) -> float:
    """The step time a cp > 1 plan must beat to be taken over a cp = 1 plan of step time
    `first_s` that fits without offload, seconds: faster even at the worst of the step-time
    error band (cost_model/fidelity.py: predicted (1 + high) below the cp = 1 plan's
    (1 + low)), the margin by which the cost model can vouch for it ([Note: context
    parallelism]). Increasing in `first_s`."""
    band = error_bands(topology.device.name)[0]
    return first_s * (1.0 + band.low) / (1.0 + band.high)


# [Note: cp first under a bound] The cp = 1 search's best plan matters to a cp > 1 one only
# through its ceiling (_cp_ceiling_s), and every cp = 1 plan is at least the least lower bound
# of the cp = 1 configurations (`_least_bound_s`, no ILP: bounds only). So the cp > 1 search
# runs first under the ceiling of that bound: a plan under it is under the ceiling of the
# cp = 1 best as well (the ceiling increases with the step time), so it is taken and the
# cp = 1 search is never run (llama3.1-405b at 128K tokens: its nine ILPs, ~4 s, are spared).
# The plan is the same as the search under the cp = 1 best's ceiling finds, runners-up
# included: a ceiling only sets the best step time before one is found, and every
# configuration bounded below the plan found is popped, and solved, under either. Otherwise
# the searches run as before, cp = 1 then cp > 1 under its best's ceiling; the second cp > 1
# search resumes the first where it stopped ([Note: resumed search] in branch_bound.py: every
# entry the first popped was under the lower ceiling, so the second would pop it too, before
# any runner-up is filled in: the runners-up's ILP budget is unchanged).


def _least_bound_s(graph: CapturedGraph, topology: Topology, spec: TrainingSpec,
                   overrides: Overrides, time_limit_s: float, shared: dict) -> float:
    """A step time no plan the overrides admit beats, seconds ([Note: cp first under a
    bound]): the least search.lower_bound that fits over the configurations and their offload
    variants (`offload_candidates`), inf when none (or the overrides admit none). Lazily, as
    `branch_and_bound` ([Note: lazy bounds] in branch_bound.py): a configuration's pipeline
    term is no more than its and its variants' bounds, so those from the least pipeline term
    on are skipped."""
    try:
        validate(graph, topology, spec, overrides)
    except InvalidConfig:
        return float("inf")
    search = _new_search(graph, topology, spec, overrides, time_limit_s, shared)
    configs = enumerate_configs(graph, topology, spec, overrides, search.policies())
    heap = [(search.pipeline_bound(cfg), i, cfg) for i, cfg in enumerate(configs)]
    heapq.heapify(heap)
    least = float("inf")
    while heap and heap[0][0] < least:
        _bound, _i, cfg = heapq.heappop(heap)
        for c in [cfg] + offload_candidates(search, cfg, overrides):
            lb = search.lower_bound(c)
            if lb.fits:
                least = min(least, lb.step_time_s)
    return least


def _new_search(graph: CapturedGraph, topology: Topology, spec: TrainingSpec,
                overrides: Overrides, time_limit_s: float, shared: dict | None) -> Search:
    """A Search with the caches in `shared` (filled with its own, when given)."""
    caches = {k: v for k, v in (shared or {}).items() if k != "paused"}
    search = Search(graph, topology, spec, time_limit_s, overrides.sequence_parallel,
                    pinned=pinned_params(graph, overrides.placements), **caches)
    if shared is not None:
        shared.update(cache=search.cache, problems=search.problems, costs=search.costs,
                      scaled=search.scaled, solutions=search.solutions,
                      bounds=search.bounds, stopped=search.stopped)
    return search


def _search(graph: CapturedGraph, topology: Topology, spec: TrainingSpec, overrides: Overrides,
            time_limit_s: float, top_k: int, context_parallel_only: bool = False,
            unfit: list | None = None, shared: dict | None = None,
            ceiling_s: float = float("inf")) -> Plan:
    """The best plan over the configurations the overrides admit (those with cp > 1 only,
    when `context_parallel_only`). Raises InvalidConfig when there are none, NoFeasiblePlan
    when none fits: its message says what the smallest plan needs, unless `unfit` is given,
    which then receives (search, configurations) for the caller to explain (a few ILPs).
    `ceiling_s`: only plans faster than that (seconds) are searched for; _NoneFaster when
    there is none.
    `shared`: the strategy cache, problems per tp, ILP coefficients, bounds and ILP solutions
    of an earlier search of the same graph, topology, spec and sequence-parallel choice (they
    depend on nothing else), filled with this one's."""
    start = time.perf_counter()
    validate(graph, topology, spec, overrides)
    search = _new_search(graph, topology, spec, overrides, time_limit_s, shared)
    solved = search.num_solves  # ILPs of earlier searches, in the caches `shared` holds
    unplaced: list[tuple[str, str]] = []
    configs = enumerate_configs(graph, topology, spec, overrides, search.policies(), unplaced)
    if not configs:  # cp > 1 or not: the overrides admit nothing, for the reasons found
        raise _no_configuration(graph, topology, spec, overrides, unplaced)
    if context_parallel_only:
        configs = [c for c in configs if c.cp > 1]
        if not configs:
            raise InvalidConfig(f"no configuration with cp > 1 of {topology.world_size} "
                                f"devices satisfies the overrides {_given(overrides)}")
    # a search of these configurations under a lower ceiling found nothing: resumed from
    # where it stopped ([Note: resumed search] in branch_bound.py)
    paused = None if shared is None else shared.setdefault(
        "paused", {}).setdefault((context_parallel_only, repr(overrides)), {})
    evaluated = branch_and_bound(search, configs, top_k, overrides, ceiling_s, paused)
    if ceiling_s < float("inf") and not any(a.fits and a.step_time_s < ceiling_s
                                            for a in evaluated):
        raise _NoneFaster(f"no plan under {ceiling_s:.3g} s")
    feasible = sorted((a for a in evaluated if a.fits), key=rank_key)
    if not feasible and search.skipped:
        raise _limit_error(search)
    if not feasible:  # what does not fit is explained with the offload variants too
        configs += offloaded(search, configs, overrides)
    if not feasible and unfit is not None:
        unfit.append((search, configs))
        raise NoFeasiblePlan("no configuration fits in memory")
    if not feasible:
        raise NoFeasiblePlan(_explain_memory(search, configs)[1])
    if search.skipped:
        _warn_skipped(search)
    best = feasible[0]
    result = build_plan(search, best, _alternatives(best, evaluated, top_k))
    if overrides.tp is not None:  # a tp the planner chose is the cost model's optimum
        _warn_unsplit(search, result)
    log.info("plan: %s in %.2f s (%d configurations, %d ILP solves)", best.config,
             time.perf_counter() - start, len(configs), search.num_solves - solved)
    return result


def _no_configuration(graph: CapturedGraph, topology: Topology, spec: TrainingSpec,
                      overrides: Overrides, unplaced: list[tuple[str, str]]) -> InvalidConfig:
    """The error of overrides that admit no configuration, naming the meshes that were
    skipped because their groups cannot sit on the nodes ((mesh, why) of
    search.enumerate_configs), the meshes of one reason together."""
    text = (f"no configuration of {topology.world_size} devices satisfies the overrides "
            f"{_given(overrides)} with global_batch {spec.global_batch} and "
            f"{graph.total_layers} layers")
    o = overrides
    if o.pp and o.pp > 1 and o.num_microbatches and o.num_microbatches < o.pp and \
            o.schedule in (None, "1f1b", "interleaved-1f1b"):
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


def _cp_may_help(graph: CapturedGraph, topology: Topology, spec: TrainingSpec) -> bool:
    """True when a search with cp free has configurations a cp = 1 one has not: cp > 1
    degrees exist for this sequence and devices (context.cp_degrees)."""
    return any(cp > 1 for cp in cp_degrees(graph, spec.seq_len, topology.world_size))


def _warn_unsplit(search: Search, result: Plan) -> None:
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
    head = f"{graph.layer_prefix}.0." if graph.num_layers else ""
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


def _given(o: Overrides) -> dict:
    """The overrides the user gave: fields set and not at their default (the switches
    `allow_tp_across_nodes` and `elementwise_optimizer` are not choices fixed)."""
    defaults = Overrides()
    return {k: v for k, v in vars(o).items()
            if v is not None and v != getattr(defaults, k)
            and k not in ("allow_tp_across_nodes", "elementwise_optimizer", "ep",
                          "time_limit_s", "top_k")}


def _alternatives(best: Assessment, evaluated: list[Assessment], top_k: int) -> list[tuple]:
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


def _reason(a: Assessment, best: Assessment) -> str:
    if not a.fits:
        return (f"memory: needs {fmt_bytes(a.memory_bytes)} per device, over the budget")
    deltas = {"bubble": a.bubble_s - best.bubble_s, "communication": a.comm_s - best.comm_s,
              "compute": a.compute_s - best.compute_s}
    if deltas["compute"] > 0 and POLICY_ORDER[a.config.checkpointing] > POLICY_ORDER[
            best.config.checkpointing]:
        deltas["recomputation"] = deltas.pop("compute")  # the extra compute is the recompute
    if a.config.offload != "none" and best.config.offload == "none":
        # [Note: offload]: its host step and transfers are what it adds
        deltas = {"offload": a.step_time_s - best.step_time_s}
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


def _explain_memory(search: Search, configs: list[PlanConfig]) -> tuple[float, str]:
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


def _limit_error(search: Search) -> SolverLimitReached:
    """The error when no plan is left and configurations were skipped at the limit."""
    first = next(iter(search.skipped.values()))
    more = len(search.skipped) - 1
    where = first.config + (f" and {more} more configuration{'s' * (more > 1)}" if more else "")
    return SolverLimitReached(first.ilp, first.limit_s, where)


def _warn_skipped(search: Search) -> None:
    """SolverLimitWarning naming the skipped configurations (at most 3) and the limit."""
    errors = list(search.skipped.values())
    names = "; ".join(e.config for e in errors[:3]) + ("; ..." if len(errors) > 3 else "")
    what = "1 configuration" if len(errors) == 1 else f"{len(errors)} configurations"
    warnings.warn(
        f"{what} skipped, no placement found within time_limit_s={errors[0].limit_s:g} "
        f"deterministic seconds ({names}); the plan is the best of the others, a larger "
        f"time_limit_s includes them", SolverLimitWarning, stacklevel=4)
