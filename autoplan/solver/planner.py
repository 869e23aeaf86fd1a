"""`plan()`: the search of search.py driven to a `Plan` (its branch and bound over
configurations: solver/branch_bound.py; what it says of the result, its warnings and errors:
outcome.py)."""

from __future__ import annotations

import dataclasses
import fnmatch
import heapq
import logging
import time
import warnings

from autoplan.collector import collector_paused
from autoplan.cost_model.compute import compiled_device
from autoplan.cost_model.config import stages_of
from autoplan.cost_model.expert_parallel import expert_weights
from autoplan.cost_model.fidelity import error_bands
from autoplan.graph import CapturedGraph
from autoplan.options import OptionError, SearchOptions
from autoplan.plan import Plan
from autoplan.solver.assemble import as_alternatives, build_plan
from autoplan.solver.branch_bound import (branch_and_bound, offload_candidates, offloaded,
                                          rank_key, variants)
from autoplan.solver.configurations import (Float8Warning, InvalidConfig, NoFeasiblePlan,
                                            Overrides, PlanConfig, enumerate_configs,
                                            validate)
from autoplan.solver.context import cp_degrees
from autoplan.solver.expert_degree import ep_refusal
from autoplan.solver.frozen import plan_frozen_dtype
from autoplan.solver.ilp import evaluate
from autoplan.solver.outcome import (alternatives, even_split, expert_layout, explain_memory,
                                     float8_off, given_overrides, limit_error, no_configuration,
                                     warn_skipped, warn_unsplit)
from autoplan.solver.pins import pinned_params
from autoplan.solver.search import Search
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology

__all__ = ["plan", "reprice", "compiled_topology", "experts_split"]

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
        InvalidConfig also for float8 "on" / "auto" under another dtype than bfloat16, on a
            device without an FP8 peak, or with `compiled`.
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
        Float8Warning: float8 "on" or "auto" asked for, and the plan runs no linear in FP8
            (the message says why).
        SolverLimitWarning: a plan was found, but configurations were skipped because their
            ILP found no placement within `time_limit_s` (the message names them).
    """
    try:
        o = Overrides(**{**vars(options or SearchOptions()), **choices},
                      elementwise_optimizer=elementwise_optimizer)
    except OptionError as e:
        raise InvalidConfig(str(e)) from None
    if o.routing_skew is not None:  # an option of the training step: the spec holds it
        spec = dataclasses.replace(spec, routing_skew=o.routing_skew)
    if o.float8 != "off":  # so is the float8 recipe
        spec = _float8_spec(spec, o.float8, topology, compiled)
    ep, user_pins = o.ep, o.placements
    given_ep = ep is not None and ep > 1
    if given_ep:
        if o.cp not in (None, 1):
            raise InvalidConfig(f"ep {ep} with cp {o.cp}: expert and context parallelism are "
                                "not planned together")
        # tp 1 unless given; a given tp > 1 splits the experts on tp (Shard(0)), the
        # runtime's ep x tp layout ([Note: experts over ep and tp] in runtime/expert_parallel.py)
        o = dataclasses.replace(o, cp=1, tp=1 if o.tp is None else o.tp)
        if o.tp > 1:
            o = dataclasses.replace(o, placements=experts_split(graph, o.placements, ep, o.tp))
    if not isinstance(compiled, bool):
        raise ValueError(f"compiled={compiled!r}; expected True or False")
    if compiled:
        topology = compiled_topology(topology)
        o = dataclasses.replace(o, split_backward=False)
    if o.stages is not None:
        v = o.num_virtual_stages or 1
        pp = len(o.stages) // v if o.pp is None and len(o.stages) % v == 0 else o.pp
        o = dataclasses.replace(o, num_virtual_stages=v, pp=pp)
    how = (f" With ep {ep} given the expert slices are held whole outside ZeRO, and tp is 1 "
           f"unless given: give a tp that splits the experts, pp to spread the layers, or a "
           f"larger ep." if given_ep else "")
    try:
        result = _planned(graph, topology, spec, o, frozen_weights_dtype)
    except NoFeasiblePlan as e:
        raise NoFeasiblePlan(f"{e}{how}") from None
    if spec.float8 != "off" and not result.float8_linears:
        _warn_no_float8(graph, topology, spec.float8)
    if user_pins:
        result = dataclasses.replace(result, pinned=user_pins)
    if o.stages is not None:
        result = dataclasses.replace(result, pinned_stages=True)
    return dataclasses.replace(result, compiled=True) if compiled else result


def _float8_spec(spec: TrainingSpec, mode: str, topology: Topology, compiled) -> TrainingSpec:
    """`spec` with float8 `mode` ([Note: float8 pricing] in cost_model/float8.py); raises
    InvalidConfig where the recipe cannot run: another dtype than bfloat16, a device without
    an FP8 peak, compiled stages."""
    if spec.dtype != "bfloat16":
        raise InvalidConfig(f"float8={mode!r} under dtype {spec.dtype!r}: the float8 recipe "
                            "runs its other ops in bfloat16; give dtype='bfloat16'")
    if "float8" not in topology.device.peak_flops_per_s:
        raise InvalidConfig(f"float8={mode!r} on {topology.name}: its device "
                            f"{topology.device.name} lists no FP8 peak (peak_flops_per_s "
                            f"has {sorted(topology.device.peak_flops_per_s)}); FP8 matmuls "
                            "need Hopper or newer (H100, H200), or a topology file that "
                            "gives the device's 'float8' FLOP/s")
    if compiled:
        raise InvalidConfig(f"float8={mode!r} with compile=True: the FP8 linear is not run "
                            "compiled yet (its amax all-reduces are eager collectives); plan "
                            "it eagerly")
    return dataclasses.replace(spec, float8=mode)


def _warn_no_float8(graph: CapturedGraph, topology: Topology, mode: str) -> None:
    """Float8Warning: float8 `mode` was asked for and the plan runs no linear in FP8."""
    from autoplan.cost_model.float8 import eligible

    why = ("no linear of the repeated blocks has a parameter weight with both dims multiples "
           "of 16 (routers and the LM head stay in bf16)" if not eligible(graph) else
           f"FP8 is not faster for any of them on {topology.device.name} (float8='on' runs "
           "them regardless)" if mode == "auto" else
           "no placement the planner chose runs the FP8 linear on local shards")
    warnings.warn(f"float8={mode!r}: {graph.model_name} runs no linear in FP8: {why}",
                  Float8Warning, stacklevel=3)


def experts_split(graph: CapturedGraph, placements: tuple, ep: int, tp: int) -> tuple:
    """`placements` (parsed pins) with every expert weight pinned Shard(0), the split a given
    ep at tp > 1 runs with ([Note: experts over ep and tp] in runtime/expert_parallel.py).
    Raises InvalidConfig when the user pinned one otherwise."""
    prefix = f"{graph.layer_prefix}." if graph.layer_prefix else ""
    pins = dict(placements)
    for fqn in expert_weights(graph):
        info = graph.params[fqn]
        own = f"{graph.block_path(info.layer_id)}." if info.layer_id is not None and prefix \
            else None
        pattern = f"{prefix}*.{fqn.removeprefix(own)}" if own and fqn.startswith(own) else fqn
        for given, placement in placements:
            if fnmatch.fnmatchcase(fqn, given) and placement != "S(0)":
                raise InvalidConfig(
                    f"ep {ep} at tp {tp} needs the experts split on tp (Shard(0)); "
                    f"placements pin {fqn} to {placement} by {given} (pin it S(0) or fix "
                    f"tp=1)")
        pins.setdefault(pattern, "S(0)")
    return tuple(sorted(pins.items()))


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
    if plan.routing_skew != 1.0:  # and at the routing skew it was priced at
        spec = dataclasses.replace(spec, routing_skew=plan.routing_skew)
    if plan.float8_linears:  # its own FP8 linears, and only those
        spec = dataclasses.replace(spec, float8="on", float8_only=plan.float8_linears)
    search, assessed = _assessed(graph, plan, topology, spec)
    with collector_paused():
        return dataclasses.replace(build_plan(search, assessed, []), compiled=plan.compiled)


def _stage_layers(plan: Plan, total_layers: int) -> tuple[int, ...]:
    """The plan's blocks per stage as a configuration holds them: () for the even split
    (cost_model.config.stages_of), else the counts (pinned, or searched: [Note: uneven
    stages] in solver/configurations.py)."""
    counts = tuple(st.num_layers for st in plan.stages)
    even = tuple(st.num_layers for st in stages_of(total_layers, len(plan.stages)))
    return () if counts == even and not plan.pinned_stages else counts


def _assessed(graph: CapturedGraph, plan: Plan, topology: Topology, spec: TrainingSpec):
    """(Search, Assessment) of `plan`'s configuration and placements on `graph`, priced on
    `topology` and `spec` (no search). Raises InvalidConfig when a node's placements are not
    among its candidates on this graph."""
    with collector_paused():
        search = Search(graph, topology, spec, time_limit_s=10.0)
        cfg = PlanConfig(plan.mesh.pp, plan.mesh.dp, plan.mesh.tp, plan.zero_stage,
                         plan.num_microbatches, plan.microbatch_size, plan.schedule,
                         plan.num_virtual_stages, cp=plan.mesh.cp,
                         stage_layers=_stage_layers(plan, graph.total_layers),
                         checkpointing=plan.checkpointing, offload=plan.offload,
                         ep=plan.mesh.ep)
        why = ep_refusal(search.moe, cfg.dp, cfg.tp, cfg.cp, cfg.ep, topology) \
            if cfg.ep > 1 else ""
        if why:
            raise InvalidConfig(f"plan ep {cfg.ep}: {why}")
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
        return search, search.assess(cfg, evaluate(problem, costs, choice))


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
            raise NoFeasiblePlan(min(explain_memory(*u) for u in unfit)[1]) from None
        raise
    if first is None or second.prediction.step_time_s < first.prediction.step_time_s:
        return second
    return first


def _planned(graph: CapturedGraph, topology: Topology, spec: TrainingSpec, o: Overrides,
             frozen_weights_dtype: str | None) -> Plan:
    """The best plan under `o`, the frozen weights' dtype searched (solver/frozen.py)."""
    with collector_paused():
        def run(chosen: TrainingSpec, search_offload: bool) -> Plan:
            fixed = o if search_offload or o.offload is not None else \
                dataclasses.replace(o, offload="none")
            return _plan(graph, topology, chosen, fixed, o.time_limit_s, o.top_k)

        return plan_frozen_dtype(graph, spec, run, weights_dtype=frozen_weights_dtype,
                                 offload_searched=o.offload is None)


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
        for c in [cfg] + variants(search, cfg, overrides):
            # memory priced only where the step time would lower `least` ([Note: time first])
            if search.time_bound(c) < least and not search.over_budget(c) and (
                    c is cfg or c in offload_candidates(search, cfg, overrides)) and \
                    search.lower_bound(c).fits:
                least = search.time_bound(c)
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
        raise no_configuration(graph, topology, spec, overrides, unplaced)
    if context_parallel_only:
        configs = [c for c in configs if c.cp > 1]
        if not configs:
            raise InvalidConfig(f"no configuration with cp > 1 of {topology.world_size} "
                                f"devices satisfies the overrides {given_overrides(overrides)}")
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
        raise limit_error(search)
    if not feasible:  # what does not fit is explained with the offload variants too
        configs += offloaded(search, configs, overrides)
    if not feasible and unfit is not None:
        unfit.append((search, configs))
        raise NoFeasiblePlan("no configuration fits in memory")
    if not feasible:
        raise NoFeasiblePlan(explain_memory(search, configs)[1])
    if search.skipped:
        warn_skipped(search)
    best = feasible[0]
    runners_up = alternatives(best, evaluated, top_k)
    if top_k > 0 and overrides.stages is None:  # what a searched stage split won
        split = even_split(search, best, evaluated)
        runners_up = split + runners_up[:top_k - len(split)]
    if top_k > 0:  # why the experts lie as they do
        experts = expert_layout(search, best, evaluated, given_ep=overrides.ep is not None)
        runners_up = experts + [r for r in runners_up
                                if not experts or r[0].config != experts[0][0].config
                                ][:top_k - len(experts)]
    result = build_plan(search, best, runners_up)
    if top_k > 0:  # what the float8 recipe buys
        fp8 = float8_off(search, best, len(result.float8_linears))
        if fp8:
            result = dataclasses.replace(result, alternatives=as_alternatives(
                fp8) + result.alternatives[:top_k - 1])
    if overrides.tp is not None:  # a tp the planner chose is the cost model's optimum
        warn_unsplit(search, result)
    log.info("plan: %s in %.2f s (%d configurations, %d ILP solves)", best.config,
             time.perf_counter() - start, len(configs), search.num_solves - solved)
    return result


def _cp_may_help(graph: CapturedGraph, topology: Topology, spec: TrainingSpec) -> bool:
    """True when a search with cp free has configurations a cp = 1 one has not: cp > 1
    degrees exist for this sequence and devices (context.cp_degrees)."""
    return any(cp > 1 for cp in cp_degrees(graph, spec.seq_len, topology.world_size))
