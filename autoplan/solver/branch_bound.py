"""The branch and bound over configurations that `planner.plan` drives ([Note: decomposition]
steps 2-4 in search.py): a heap of configurations by lower bound, each tightened in turn --
lazily at its pipeline term, bounded, its (tp, b, policy)'s placement, its LP relaxation, its
step-time ILP -- until the best plan is proven, then runners-up for the report. Also the order
plans are ranked in (`rank_key`) and the offload variants searched where nothing fits.
"""

from __future__ import annotations

import heapq

from autoplan.cost_model.offload import OFFLOADS
from autoplan.cost_model.offload import available as offload_available
from autoplan.cost_model.step_time import Assessment
from autoplan.solver.configurations import Overrides, PlanConfig, offload_variants
from autoplan.solver.ilp_types import SolverLimitReached, same_argmin
from autoplan.solver.search import Search

__all__ = ["branch_and_bound", "offloaded", "offload_candidates", "rank_key",
           "runner_up_group", "POLICY_ORDER"]


def offloaded(search: Search, configs: list[PlanConfig],
              overrides: Overrides) -> list[PlanConfig]:
    """Offload variants of the configurations no placement of which fits in device memory
    ([Note: offload] in cost_model/offload.py, "Search"); none without the topology's host
    figures, or where the host is the devices' own memory (Topology.host_is_device_memory:
    offloading there frees nothing)."""
    return [v for cfg in configs for v in offload_candidates(search, cfg, overrides)]


def offload_candidates(search: Search, cfg: PlanConfig, overrides: Overrides) -> list[PlanConfig]:
    """`offloaded` of one configuration: its variants worth bounding (of `variants`)."""
    offloads = variants(search, cfg, overrides)
    if not offloads:
        return []
    budget, out = search.budget_bytes, []
    lb = search.lower_bound(cfg)
    if lb.memory_bytes <= budget:
        return []
    for variant in offloads:
        # the variant's peak on lb's rank is lb's less what it offloads (at most these
        # kinds: the unsharded gradients of "grads" stay): a variant over the budget even
        # so needs no bound of its own
        kinds = ("optimizer",) if variant.offload == "optimizer" else (
            "optimizer", "params", "grads")
        moved = sum(lb.memory_breakdown.get(k, 0.0) for k in kinds)
        if lb.memory_bytes - moved <= budget:
            out.append(variant)
    return out


def variants(search: Search, cfg: PlanConfig, overrides: Overrides) -> list[PlanConfig]:
    """cfg's offload variants (configurations.offload_variants) where the topology can offload
    at all, whether or not cfg fits (`offload_candidates` says which are worth bounding)."""
    if not offload_available(search.topology) or search.topology.host_is_device_memory:
        return []
    return offload_variants(cfg, overrides)


POLICY_ORDER = {"none": 0, "core-attention": 1, "selective": 2, "full": 3}


def rank_key(a: Assessment) -> tuple:
    c = a.config
    # ties: less memory, then the simpler mesh (less tp, then less pp), then less recompute
    return (round(a.step_time_s, 12), round(a.memory_bytes), c.tp, c.cp, c.pp, c.ep, c.zero_stage,
            c.num_microbatches, c.schedule, c.num_virtual_stages,
            POLICY_ORDER[c.checkpointing], c.offload != "none")


# [Note: lazy bounds] Bounding every configuration up front (search.lower_bound: a whole
# pipeline.assess each) was most of a large search -- 13,640 configurations for a 128K-token
# llama3.1-405b on 2,048 nodes, of which some 80 are ever popped. So a configuration enters
# the heap lazily, at its pipeline term (search.pipeline_bound: the pipeline term of its lower
# bound's placement, which its lower bound adds exposed communication and the optimizer to, so
# never more; shared by its ZeRO stages and offloads), and is bounded -- and, where its bound
# does not fit, its offload variants made and bounded -- when popped. The pops of bounded
# configurations are then exactly those of bounding all up front, in the same order: a lazy
# entry sorts before what it becomes (a bound no smaller, the same tp, pp and index, state
# _LAZY first), so it is expanded before anything that would follow it; an offload variant
# keeps its place in `configs + offloaded(configs)` (index n + i k + j). A lazy entry popped
# when the runners-up are complete ends the search as a bounded one would: every entry left
# is no better. Configurations never popped are never bounded.
#
# [Note: time first] Memory is most of a lower bound's price (rank_memory.rank_peak per
# candidate rank; the step time is a few sums), and most bounded configurations are never
# popped again. So a popped lazy entry pushes its configuration and each of its offload
# variants at its bound's step time alone (search.time_bound: the same float as
# lower_bound's), state _TIMED; the memory is priced when that entry is popped: a
# configuration that does not fit, or a variant that is not among its configuration's
# `offload_candidates`, is dropped there, and the rest go on as bounded entries at once. The
# pops are those of pricing both when the lazy entry is popped, in the same order, with the
# dropped entries in between: an entry's key (step time, tp, pp, index) is the one it had
# (a variant's index n + i k + j counts j over all of cfg's variants rather than its
# candidates: the same order), and a dropped entry neither changes the state nor ends the
# search where the next entry would not (every stop tests the bound and the runners-up
# found, and the next entry's bound is no smaller). An entry whose memory floor exceeds the
# budget (search.over_budget: its states and moment A's activations, rank_memory.
# memory_floor_bytes) is dropped before its step time is priced. Most configurations popped
# are those whose placements do not fit: qwen3-235b-a22b on 32 dgx-h100 nodes priced memory
# 29,128 times before, 6,536 after (and the step time alone 12,890 times); its whole
# `autoplan plan` 20.1 -> 17.6 s, the same plan.
#
# [Note: resumed search] A search under a ceiling that finds nothing below it (the first cp > 1
# search of [Note: cp first under a bound]) has popped exactly the entries of bound below the
# ceiling, every one while proving, and the assessments those made are at or above it. The
# same search under a higher ceiling pops those same entries first, also all while proving
# (its best plan is never below the lower ceiling), with the same transitions -- none depends
# on the best plan but whether a pop proves. So it resumes the paused one: the heap as left
# (the entry that stopped it pushed back), its assessments, its best among them, its skipped
# configurations; it continues as a fresh search would from there (llama3-405b at 8K tokens
# on 2,048 nodes: the second cp > 1 search no longer pops its ~6,000 bounded entries again).
# states of a configuration in the branch and bound
_LAZY, _TIMED, _BOUNDED, _REFINED, _RELAXED, _UNFIT = -2, -1, 0, 1, 2, 3


def branch_and_bound(search: Search, configs: list[PlanConfig], top_k: int,
                      overrides: Overrides = Overrides(),
                      ceiling_s: float = float("inf"),
                      paused: dict | None = None) -> list[Assessment]:
    """[Note: decomposition] steps 2-4 in search.py; returns every assessment made.
    `ceiling_s`: the best step time is taken to start there (a plan elsewhere is that fast);
    when nothing beats it the search ends at the first bound no better, with no runners-up.
    `paused`: where such a search leaves its heap and assessments, and from where a search of
    the same configurations under a higher ceiling resumes them ([Note: resumed search]).

    A heap of configurations by lower bound; each moves through up to four states, with a
    tighter bound at each:
    0. lazy, at its pipeline term (search.pipeline_bound, [Note: lazy bounds]); popped: it
       and its offload variants go back at their lower bound's step time ([Note: time
       first]), and popped again their memory is priced: a configuration that does not fit
       is dropped, as is a variant where its configuration fits (`offload_candidates`);
    1. bounded without an ILP (search.lower_bound);
    2. popped: the time-optimal placement of its (tp, b, policy) -- one ILP shared by all the
       configurations of those -- is assessed. When the configuration's step time orders
       placements like one microbatch's time (pp = 1 and dp = 1: `same_argmin`), that is its
       optimum; otherwise the bound is refined (search.refined_bound) and it goes back;
    3. popped again: the LP relaxation of its own step-time ILP ([Note: step form]) either
       certifies an optimum or gives a bound, with which it goes back;
    4. popped again: its step-time ILP (CP-SAT) gives its optimum.
    A configuration no placement of which fits (search.memory_bound) is settled at state 2,
    unfit, with its (tp, b, policy)'s placement: no ILP of its own. An optimum that does not
    fit goes back with its step time as its bound and, popped again before the best plan is
    proven, the memory-constrained ILP decides. A configuration whose
    ILP found no placement within the limit (SolverLimitReached) is skipped and recorded in
    `search.skipped`; one without any placement (no ILP solution at all) is dropped.
    Once the next bound is no better than the best plan, runners-up are filled in for the
    report with at most `top_k` more ILP solves (2 `top_k` while none is found), of
    time-optimal placements only: a runner-up
    whose own ILP was not solved while proving is assessed at its (tp, b, policy)'s placement
    (a plan it can run, so its step time is no better than its optimum), and constrained ones
    stay "memory" alternatives.
    """
    # [Note: lazy bounds] configuration i's offload variants j are numbered n + i k + j: in the
    # order of `configs + offloaded(configs)`, which breaks ties between equal bounds
    n, k = len(configs), len(OFFLOADS)
    if paused and paused["ceiling_s"] <= ceiling_s:  # [Note: resumed search]
        heap, done = paused["heap"], paused["done"]
        search.skipped.update(paused["skipped"])
        paused.clear()  # taken: a later search under a higher ceiling does not resume it again
    else:
        heap = [(search.pipeline_bound(cfg), cfg.tp, cfg.pp, i, _LAZY, cfg, None)
                for i, cfg in enumerate(configs)]
        heapq.heapify(heap)
        done = []
    best, best_group = ceiling_s, None
    for a in done:  # a resumed search's plans, all at or above the ceiling they were made under
        if a.fits and a.step_time_s < best:
            best, best_group = a.step_time_s, runner_up_group(a)
    fill_solves, fill_groups = 0, set()

    def settle(i: int, cfg: PlanConfig, result: Assessment) -> Assessment | None:
        """`result` is cfg's unconstrained optimum: final, or back on the heap to be solved
        under its memory constraints."""
        if not result.fits and search.memory_bound(cfg).fits:
            heapq.heappush(heap, (result.step_time_s, cfg.tp, cfg.pp, i, _UNFIT, cfg, result))
            return None
        return result

    while heap:
        bound, _tp, _pp, i, state, cfg, payload = heapq.heappop(heap)
        proving = bound < best
        if not proving and best_group is None and best == ceiling_s < float("inf"):
            heapq.heappush(heap, (bound, _tp, _pp, i, state, cfg, payload))  # for `paused`
            break  # nothing under the ceiling: the plan that set it is taken
        # runners-up: at most top_k more ILP solves, 2 top_k while none has been found
        if not proving and (len(fill_groups) >= top_k or fill_solves >= 2 * top_k
                            or (fill_solves >= top_k and fill_groups)):
            break
        if state == _LAZY:  # [Note: time first]
            timed = [(i, cfg, None)] + [(n + i * k + j, v, cfg) for j, v in enumerate(
                variants(search, cfg, overrides))]
            for index, c, parent in timed:
                if not search.over_budget(c):  # else dropped when popped: never pushed
                    heapq.heappush(heap, (search.time_bound(c), c.tp, c.pp, index, _TIMED, c,
                                          parent))
            continue
        if state == _TIMED:  # payload: the configuration of an offload variant
            if payload is not None and cfg not in offload_candidates(search, payload, overrides):
                continue
            if not search.lower_bound(cfg).fits:
                continue
            state, payload = _BOUNDED, None
        solved = search.num_solves
        result = None
        try:
            if state == _BOUNDED:
                sol = search.solution(cfg)  # None: no placement of its (tp, b, policy) at all
                quick = None if sol is None else search.assess(cfg, sol)
                if quick is not None and not quick.fits and not search.memory_bound(cfg).fits:
                    result = quick  # no placement fits: its own optimum would not either
                elif quick is not None and same_argmin(search.step_form(cfg)):
                    result = settle(i, cfg, quick)
                elif quick is not None:
                    refined = max(bound, search.refined_bound(cfg, sol))
                    heapq.heappush(heap, (refined, cfg.tp, cfg.pp, i, _REFINED, cfg, quick))
            elif state == _REFINED and proving and not search.solved(cfg, exact=True):
                lp_bound, _certified = search.relaxation(cfg)
                if not search.solved(cfg, exact=True):  # not certified by the LP: CP-SAT later
                    heapq.heappush(heap, (max(bound, lp_bound), cfg.tp, cfg.pp, i, _RELAXED,
                                          cfg, payload))
                    continue
                result = settle(i, cfg, _exact(search, cfg, payload))
            elif state in (_REFINED, _RELAXED) and (proving or search.solved(cfg, exact=True)):
                result = settle(i, cfg, _exact(search, cfg, payload))
            elif state in (_REFINED, _RELAXED):
                result = payload  # a runner-up: assessed at its (tp, b, policy) placement
            elif proving:
                result = _constrained(search, cfg, payload)
            else:
                result = payload  # a runner-up that needs more memory than its fastest placement
        except SolverLimitReached as e:  # [Note: deterministic limits]: skipped, on record
            search.skipped[cfg] = e
        fill_solves += 0 if proving else search.num_solves - solved
        if result is None:
            continue
        done.append(result)
        if result.fits:
            if result.step_time_s < best:
                best, best_group = result.step_time_s, runner_up_group(result)
            if not proving and runner_up_group(result) != best_group:
                # another ZeRO stage of the best is no runner-up
                fill_groups.add(runner_up_group(result))
    if paused is not None and best_group is None and ceiling_s < float("inf"):
        paused.update(ceiling_s=ceiling_s, heap=heap, done=done, skipped=dict(search.skipped))
    return done


def _constrained(search: Search, cfg: PlanConfig, unfit: Assessment) -> Assessment:
    """cfg's optimum under its memory constraints, or `unfit` when nothing fits. Safeguard:
    the ILP's memory forms are pipeline.py's linear image of its peak; should they misjudge a
    placement (tests/test_planner_scale.py::test_memory_forms_equal_assess checks they do not),
    the placement of least memory is tried before the configuration is given up."""
    stopped = None
    for find in (lambda: search.solution(cfg, constrained=True), lambda: search.smallest(cfg)):
        try:
            sol = find()
        except SolverLimitReached as e:  # the least-memory placement may still fit
            stopped = stopped or e
            continue
        result = search.assess(cfg, sol) if sol is not None else None
        if result is not None and result.fits:
            return result
    if stopped is not None:
        raise stopped
    return unfit


def _exact(search: Search, cfg: PlanConfig, quick: Assessment) -> Assessment:
    """cfg's unconstrained optimum (its own step-time ILP); `quick`, the placement of its
    (tp, b, policy), when that is as good (equal up to the ILP's tie-breaks)."""
    sol = search.solution(cfg, exact=True)
    if sol is None:  # no placement (then none of its (tp, b, policy) either; kept for safety)
        return quick
    exact = search.assess(cfg, sol)
    return quick if quick.fits and quick.step_time_s < exact.step_time_s else exact


def runner_up_group(a: Assessment) -> tuple:
    """What makes a runner-up a different plan: all but the ZeRO stage."""
    c = a.config
    return (c.pp, c.dp, c.cp, c.tp, c.ep, c.num_microbatches, c.schedule, c.num_virtual_stages,
            c.checkpointing, c.offload)
