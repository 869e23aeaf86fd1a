"""`plan()`: the search of search.py driven to a `Plan` (branch and bound over configurations)."""

from __future__ import annotations

import heapq
import logging
import time

from autoplan.graph import CapturedGraph
from autoplan.plan import Plan
from autoplan.solver.assemble import build_plan
from autoplan.solver.pipeline import Assessment, Config
from autoplan.solver.search import (
    InvalidConfig, NoFeasiblePlan, Overrides, Search, enumerate_configs, validate,
)
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology

__all__ = ["plan"]

log = logging.getLogger(__name__)


def plan(graph: CapturedGraph, topology: Topology, spec: TrainingSpec, *,
         tp: int | None = None, pp: int | None = None, dp: int | None = None,
         zero_stage: int | None = None, num_microbatches: int | None = None,
         schedule: str | None = None, num_virtual_stages: int | None = None,
         allow_tp_across_nodes: bool = False, time_limit_s: float = 10.0,
         top_k: int = 5) -> Plan:
    """The fastest configuration and placement that fits, as a `Plan`.

    Args:
        graph: captured model (global shapes). Placements are checked against the captured
            shapes; batch dims are never split on the tp axis, so any microbatch size is valid.
            Costs scale linearly with tokens from the captured batch x sequence length (capture
            at the planned seq_len for exact attention costs).
        topology: the cluster; spec: the training step.
        tp, pp, dp, zero_stage, num_microbatches, schedule, num_virtual_stages: fix a choice
            (None: searched).
        allow_tp_across_nodes: let tp groups span nodes (off: tp <= devices_per_node).
        time_limit_s: CP-SAT limit per ILP solve, seconds.
        top_k: runners-up kept in `Plan.alternatives`.

    Returns:
        A Plan with every field filled (see autoplan.plan.Plan).

    Raises:
        InvalidConfig: overrides that cannot work (the message names the numbers).
        NoFeasiblePlan: nothing fits in memory (the message gives the smallest per-device memory
            any plan needs, with its configuration, and the device's memory).
    """
    start = time.perf_counter()
    overrides = Overrides(tp, pp, dp, zero_stage, num_microbatches, schedule, num_virtual_stages,
                          allow_tp_across_nodes)
    validate(graph, topology, spec, overrides)
    configs = enumerate_configs(graph, topology, spec, overrides)
    if not configs:
        raise InvalidConfig(
            f"no configuration of {topology.world_size} devices satisfies the overrides "
            f"{_given(overrides)} with global_batch {spec.global_batch} and "
            f"{graph.total_layers} layers")
    search = Search(graph, topology, spec, time_limit_s)
    evaluated = _branch_and_bound(search, configs, top_k)
    feasible = sorted((a for a in evaluated if a.fits), key=_rank)
    if not feasible:
        raise NoFeasiblePlan(_explain_memory(search, configs))
    best = feasible[0]
    result = build_plan(search, best, _alternatives(best, evaluated, top_k))
    log.info("plan: %s in %.2f s (%d configurations, %d ILP solves)", best.config,
             time.perf_counter() - start, len(configs), len(search.solutions))
    return result


def _given(o: Overrides) -> dict:
    return {k: v for k, v in vars(o).items() if v is not None and k != "allow_tp_across_nodes"}


def _rank(a: Assessment) -> tuple:
    c = a.config
    # ties: less memory, then the simpler mesh (less tp, then less pp)
    return (round(a.step_time_s, 12), round(a.memory_bytes), c.tp, c.pp, c.zero_stage,
            c.num_microbatches, c.schedule)


def _branch_and_bound(search: Search, configs: list[Config], top_k: int) -> list[Assessment]:
    """[Note: decomposition] steps 2-4 in search.py; returns every assessment made.

    A heap of configurations by lower bound. A configuration is first bounded without an ILP;
    when popped, its time-optimal placement is assessed; if that does not fit, it goes back
    with the unconstrained step time as its (tighter) bound, and only if it is popped again
    before the best plan is proven is the memory-constrained ILP solved. Once the next bound
    is no better than the best plan, runners-up are filled in for the report with at most
    `top_k` more ILP solves (no constrained ones: those stay "memory" alternatives).
    """
    heap: list[tuple] = []
    for i, cfg in enumerate(configs):
        lb = search.lower_bound(cfg)
        if lb.fits:
            heapq.heappush(heap, (lb.step_time_s, cfg.tp, cfg.pp, i, cfg, None))
    done: list[Assessment] = []
    best = float("inf")
    fill_solves = fill_fits = 0
    while heap:
        bound, _tp, _pp, i, cfg, unfit = heapq.heappop(heap)
        proving = bound < best
        if not proving and (fill_fits >= top_k or fill_solves >= top_k):
            break
        if unfit is None:
            known = (cfg.tp, cfg.microbatch_size) in search.solutions
            fill_solves += 0 if (proving or known) else 1
            result = search.assess(cfg, search.solution(cfg.tp, cfg.microbatch_size))
            if not result.fits and search.memory_bound(cfg).fits:
                heapq.heappush(heap, (result.step_time_s, cfg.tp, cfg.pp, i, cfg, result))
                continue
        elif proving:
            constrained = search.solution(cfg.tp, cfg.microbatch_size, cfg)
            again = search.assess(cfg, constrained) if constrained is not None else None
            result = again if again is not None and again.fits else unfit
        else:
            result = unfit  # a runner-up that needs more memory than its fastest placement
        done.append(result)
        if result.fits:
            best = min(best, result.step_time_s)
            fill_fits += 0 if proving else 1
    return done


def _alternatives(best: Assessment, evaluated: list[Assessment], top_k: int) -> list[tuple]:
    """Runners-up with the reason each loses: up to two faster ones that do not fit
    ("memory"), then the fastest that fit; one per (mesh, microbatches, schedule), so that
    the list shows different plans rather than ZeRO stages of one."""
    def group(a: Assessment) -> tuple:
        c = a.config
        return (c.pp, c.dp, c.tp, c.num_microbatches, c.schedule, c.num_virtual_stages)

    seen = {group(best)}
    faster_oom, fits = [], []
    for a in sorted(evaluated, key=_rank):
        if group(a) in seen:
            continue
        if a.fits:
            seen.add(group(a))
            fits.append(a)
        elif a.step_time_s < best.step_time_s and len(faster_oom) < min(2, top_k):
            seen.add(group(a))
            faster_oom.append(a)
    chosen = (faster_oom + fits)[:top_k]
    return [(a, _reason(a, best)) for a in sorted(chosen, key=_rank)]


def _reason(a: Assessment, best: Assessment) -> str:
    if not a.fits:
        return (f"memory: needs {a.memory_bytes / 1e9:.3g} GB per device, over the budget")
    deltas = {"bubble": a.bubble_s - best.bubble_s, "communication": a.comm_s - best.comm_s,
              "compute": a.compute_s - best.compute_s}
    kind = max(deltas, key=deltas.get)
    if deltas[kind] <= 0:
        return "tie: same predicted step time; ranked by memory and simplicity"
    return f"{kind}: +{deltas[kind] * 1e3:.3g} ms per step vs the chosen plan"


def _explain_memory(search: Search, configs: list[Config]) -> str:
    """NoFeasiblePlan message: the smallest per-device memory any plan needs."""
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
    return (f"no plan fits in memory: the smallest per-device memory any plan needs is "
            f"{best_bytes / 1e9:.4g} GB ({best_cfg}), but {device.name} has "
            f"{device.mem_bytes / 1e9:.4g} GB ({budget / 1e9:.4g} GB usable at "
            f"max_memory_fraction {search.spec.max_memory_fraction})")


def _min_memory(search: Search, cfg: Config) -> float | None:
    from autoplan.solver.ilp import solve
    from autoplan.solver.pipeline import rank_memories
    prob, costs = search.problem(cfg.tp), search.cost(cfg.tp, cfg.microbatch_size)
    ranks = rank_memories(cfg, search.spec, search.total_layers, costs.output_bytes)
    sol = solve(prob, costs, ranks=ranks, objective="memory", time_limit_s=search.time_limit_s)
    return None if sol is None else search.assess(cfg, sol).memory_bytes
