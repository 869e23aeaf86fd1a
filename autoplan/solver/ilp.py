r"""The placement ILP (OR-Tools CP-SAT) for one (tp, microbatch size) pair.

Notation: V the ILP nodes (problem.nodes: nodes outside the repeated blocks plus one
representative block), C_n the candidates of node n (strategies.node_strategies), E the weighted
edges (problem.edges), w_n, w_e their weights ([Note: layer sharing] in problem.py).

Variables
    x[n, c] in {0, 1}           node n runs candidate c
    y[e, (p, q, s)] in {0, 1}   edge e carries producer placement p into consumer placement q,
                                the consumer's candidate splitting its work (s) or not
    z[k] in {0, 1}              shared redistribution k is done: a (p, q) forward or (p, q, s)
                                backward of a value several edges read ([Note: one
                                redistribution per value] in problem.py)

Constraints
    (one_hot)     sum_c x[n, c] = 1                                   for n in V
                  -- implemented in add_node_constraint()
    (edge_src)    sum_{(q,s)} y[e, (p, q, s)] = sum_{c: out_k(c) = p} x[u, c]
    (edge_dst)    sum_p y[e, (p, q, s)] = sum_{c: in_j(c) = q, split(c) = s} x[v, c]
                  for e = (u, k) -> (v, j) and every p, (q, s); for the graph output,
                  q = R only: the output is replicated
                  -- implemented in add_edge_constraint(); pairs DTensor cannot redistribute
                  (S -> P), pairs that would gather a split parameter (costs.py) and, for
                  getitem edges, pairs with p != q have no variable, which forbids them
    (shared)      z[k] >= sum_{s} y[e, (p, q, s)] for every edge e of k's group
                  -- implemented in _add_redistribution_costs(); an edge with a fixed end has
                  the other end's x in place of y
    (tied)        a parameter read by several get_attr nodes takes one placement
                  -- implemented in add_tied_constraint()
    (memory_r)    sum_g a_r(g) elems(g, c) x[g, c] + sum_n b_r(n) act(n, c) x[n, c] + K_r <= M
                  for every pipeline rank r, when memory limits are given: a_r is the bytes per
                  parameter element of rank r (model states under the ZeRO stage and dp, plus
                  ZeRO transients; for a frozen g, Problem.frozen, those without gradient and
                  optimizer state: RankMemory.frozen_coef), b_r the microbatches in flight
                  times the share of the node's part on the rank, M = max_memory_fraction *
                  device memory
                  -- implemented in add_memory_constraint()

Objective ([Note: step form]): the step time of one configuration (pipeline.py), which is
affine in the placement's per-part compute, communication and parameter totals
    C_p = sum_{n in p} w_n sum_c t_compute(n, c) x[n, c]                 (seconds per microbatch)
    M_p = sum_{e in p} w_e sum_k (t_fwd(e, k) + t_bwd(e, k)) y[e, k]     (seconds per microbatch)
          + sum_{k shared, in p} c_k z[k]     (edges in a shared group: their terms are the z's,
                                               c_k the largest w_e t of the group; costs.py)
    P_p = sum_{g: p in parts(g), g trainable} sum_c elems(g, c) x[g, c]  (parameter elements)
    F_p = the same over the frozen g (Problem.frozen)
for the parts p in {pre, layer, post}, through the busiest pipeline rank r* (the largest
sum_p s[r, p] (C_p + M_p), s[r, p] the share of part p on rank r) and the rank with the most
parameters:
    step = a_c sum_p s[r*, p] C_p + a_m sum_p s[r*, p] M_p
           + max_r sum_p s[r, p] (B P_p + B_f F_p) + K
with a_c, a_m the stage factors (microbatches plus the bubble; they differ only where compute
slows down with the number of busy ranks), B the data-parallel sync and optimizer seconds per
trainable parameter element, B_f <= B that of a frozen one (its ZeRO gathers only), K constant
(`StepForm`). So
    min  a_c sum_p s[rho, p] C_p + a_m sum_p s[rho, p] M_p + B E + eps * (nodes not all-R)
    (busiest_r)  sum_p s[rho, p] (C_p + M_p) >= sum_p s[r, p] (C_p + M_p)   for r != rho
    (sync_r)     E >= sum_p s[r, p] (P_p + (B_f / B) F_p)
    -- implemented in add_objective(), once per candidate busiest rank rho (the ranks no other
    rank dominates part by part; the best of the solves is kept). With a_c = a_m (dedicated
    devices) one solve does: min a_m T + B E, (stage_r) T >= sum_p s[r, p] (C_p + M_p); with
    one rank (pp = 1) T and E are substituted (no constraints). `TIME_FORM` (one rank, every
    share 1, a_c = a_m = 1, B = 0) is the time of one microbatch through the whole model: the
    placement every configuration of a (tp, b, policy) starts from. eps (1 ns) only breaks ties
    towards replication: the ILP optimum is the step-time optimum up to 1 ns per ILP node.
    With objective="memory" the objective is instead min z, (memory_max_r) z >= memory_r for
    all r (the smallest memory a plan of this configuration needs; explains infeasibility)
    -- implemented in add_memory_objective().

Solving ([Note: LP first]): the LP relaxation (x, y in [0, 1]) is solved with GLOP first. The
edge constraints make it tight -- on every llama/gpt2 layer we measured its optimum is integral
-- and an integral LP optimum is an optimum of the ILP (the LP bound is met by an integral
point), found in ~30 ms instead of ~250 ms. A fractional LP optimum (ties; the max of a
pipeline's stage form) is rounded to each node's largest x, which is kept when it meets the LP
bound within the relative gap 1e-7. Under memory constraints (knapsack-like) the LP is
solved too: infeasible, so is the ILP; integral, it is the ILP's optimum; else its rounding,
when it satisfies the memory rows, is CP-SAT's start. Otherwise the model is solved as an ILP
by CP-SAT
(linearization_level 2, one worker with a fixed seed, relative gap 1e-7, variable bounds up to
1e14: its default 1e7 would truncate T, E and z), from a feasible start when one is known (the
LP rounding, else the caller's `start`, else every node replicated: `_starts`). Every solve is
limited in deterministic time, never wall-clock ([Note: deterministic limits] in ilp_types.py);
one that reaches its limit keeps its best placement, else its start when the start satisfies
the model (both with `Solution.optimal` False), else raises SolverLimitReached.
Units inside the model: ns for time, kB (1e3 B) for memory, elements for parameters.

[Note: LP reuse] The LPs of one (tp, b, policy, cp) -- a search solves one per step form,
dozens -- differ in their objective alone where their forms share `_Model.objective_rows_key`
(the ranks' shares, the busiest rank assumed, whether there is a sync term and its frozen
weight): the rows of T, E and the busiest split depend on nothing else. So the last
`_LP_MODELS` LPs of a problem are kept, and the next one of the same costs and rows gets its
objective set anew (`_Model.set_objective`); GLOP then starts from its previous basis, still
primal feasible as only the objective changed. DeepSeek-V3 on 256 dgx-h100 nodes: 58 LPs, 38
built instead of 58, building 4.5 -> 2.9 s and solving 5.4 -> 3.3 s. The bound is the LP
optimum either way; where optimal vertices tie, the rounding may differ from a cold start's,
and it is kept only when it meets the bound ([Note: LP first]): optimal either way.

[Note: LP re-costing] A one-rank form (TIME_FORM, the time-optimal placement of each (tp, b,
policy, cp), and every form without pipelining) adds no row: its T and E are substituted into
the objective. So the LP of another Costs of the same problem differs from a kept one only in
its cost terms where the two share `structure_signature` (the pairs each edge offers, which
redistributions cost anything): the kept model gets the new costs (`_Model.recost`: the
template's communication terms and add_placement_costs again) and its objective, GLOP starts
from its last basis, and nothing is built. llama3-405b on 2,048 dgx-h100 nodes solves 40 such
LPs, one per (tp, b, policy, cp). As in [Note: LP reuse], the bound is the LP optimum either
way and a tie between optimal vertices may round differently, kept only when it meets it.

Compute, communication and transition (edge) costs stay separate in `Solution`.

Files: ilp_types.py (StepForm, SolverLimitReached; RankMemory and Solution are
cost_model/placement_totals.py's), ilp_model.py (the
model: `_Model`, whose add_* methods are named above, and [Note: model building]); this module
solves the model and evaluates placements (`solve`, `relax`, `evaluate`, `model_proto`).
"""

from __future__ import annotations

import time
from collections import OrderedDict

from ortools.linear_solver import pywraplp

from autoplan.cost_model.placement_totals import RankMemory, Solution
from autoplan.solver.costs import Costs, redistribution_units
from autoplan.solver.ilp_model import _build, _Model, edge_key, structure_signature
from autoplan.solver.ilp_types import (_GAP, _NS, _TIE_BREAK, TIME_FORM, SolverLimitReached,
                                       StepForm)
from autoplan.solver.problem import Problem

__all__ = ["StepForm", "TIME_FORM", "SolverLimitReached", "solve",
           "relax", "evaluate", "model_proto"]

_INTEGRAL = 1e-6
_SOLVED = (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE)


def solve(problem: Problem, costs: Costs, *, form: StepForm = TIME_FORM,
          ranks: list[RankMemory] | None = None, budget_bytes: float | None = None,
          objective: str = "time", start: dict[str, int] | None = None,
          time_limit_s: float = 10.0) -> Solution | None:
    """Solve the ILP of the module docstring ([Note: LP first]).

    Args:
        problem, costs: from problem.build_problem and costs.build_costs.
        form: the step time to minimise ([Note: step form]); default: one microbatch.
        ranks, budget_bytes: per-rank memory (RankMemory) and the limit; no memory constraint
            when `ranks` is None.
        objective: "time" (default) or "memory" (min of the largest rank's memory).
        start: a placement (node -> candidate index) to start CP-SAT from when the LP's
            rounding is none; e.g. the time-optimal placement of the same (tp, b, policy).
        time_limit_s: the limit of each GLOP and CP-SAT call in deterministic seconds, not
            wall-clock ([Note: deterministic limits] in ilp_types.py).

    Returns:
        The best placement, `optimal` False when a limit cut a solve short; None only when no
        placement satisfies the constraints (proved infeasible, or a node left without a
        candidate while building).

    Raises:
        SolverLimitReached: a limit came before any placement and no start satisfies the model.
    """
    began = time.perf_counter()
    several = objective != "memory" and len(form.shares) > 1 and not form.one_factor
    best, optimal, stopped = None, True, None
    for busiest in (range(len(form.shares)) if several else (None,)):
        try:
            sol = _solve_once(problem, costs, form, busiest, ranks, budget_bytes, objective,
                              start, time_limit_s)
        except SolverLimitReached as e:  # this rank's split unsolved: the others may do
            stopped, optimal = e, False
            continue
        if sol is not None:
            optimal = optimal and sol.optimal
            if best is None or form.value(sol) < form.value(best):
                best = sol
    if best is None and stopped is not None:
        raise stopped
    if best is not None:
        best.optimal = optimal
        best.solve_s = time.perf_counter() - began
    return best


def model_proto(problem: Problem, costs: Costs, *, form: StepForm = TIME_FORM,
                ranks: list[RankMemory] | None = None, budget_bytes: float | None = None,
                integer: bool = True):
    """The ILP as OR-Tools' MPModelProto (ortools.linear_solver.linear_solver_pb2): to read,
    export (`ExportModelAsLpFormat`) or check, e.g. for duplicate constraints."""
    from ortools.linear_solver import linear_solver_pb2

    model = _build(problem, costs, integer, ranks, budget_bytes, "time", form, None, 10.0)
    proto = linear_solver_pb2.MPModelProto()
    model.s.ExportModelToProto(proto)
    return proto


def relax(problem: Problem, costs: Costs, *, form: StepForm,
          time_limit_s: float = 10.0) -> tuple[float, Solution | None]:
    """(a step time no placement beats, a placement certified optimal or None) from the LP
    relaxation of the unconstrained ILP ([Note: LP first]): the bound is the LP optimum less
    the tie-breaks; the placement is the LP's (integral or rounded) when it meets the bound
    within the relative gap. Cheap (GLOP only, `time_limit_s` deterministic seconds per LP);
    `solve` does the rest. An LP that stops at its limit gives the bound `form.const_s`."""
    several = len(form.shares) > 1 and not form.one_factor
    bound, best = float("inf"), None
    for busiest in (range(len(form.shares)) if several else (None,)):
        model = _lp(problem, costs, form, busiest, time_limit_s)
        if model.infeasible:
            continue
        status = model.s.Solve()
        if status == pywraplp.Solver.INFEASIBLE:
            continue
        if status != pywraplp.Solver.OPTIMAL:
            return form.const_s, None  # no bound known beyond the constant
        lp = model.s.Objective().Value() - _TIE_BREAK * len(model.ties)
        bound = min(bound, lp / _NS + form.const_s)
        sol = _rounded(problem, costs, form, model, _largest(model.values()))
        if sol is not None and (best is None or form.value(sol) < form.value(best)):
            best = sol
    if best is not None:
        slack = _GAP * abs(bound) + _TIE_BREAK * len(problem.nodes) / _NS
        best = best if form.value(best) <= bound + slack else None
    return bound, best


def _solve_once(problem, costs, form, busiest, ranks, budget_bytes, objective, start,
                limit_s) -> Solution | None:
    """One solve of the ILP (of one busiest rank): the LP first when there are no memory
    constraints, then CP-SAT from a feasible start (`_starts`)."""
    rounding = None
    # Memory constraints (knapsack-like) make the LP fractional: its rounding is CP-SAT's
    # first start (when it satisfies the model; else the caller's start), an infeasible LP
    # an infeasible ILP ([Note: LP first]).
    if objective != "memory":
        model = _lp(problem, costs, form, busiest, limit_s) if ranks is None else _build(
            problem, costs, False, ranks, budget_bytes, objective, form, busiest, limit_s)
        if model.infeasible:
            return None  # a constraint without variables fails (e.g. a fixed pair not offered)
        status = model.s.Solve()
        if status == pywraplp.Solver.INFEASIBLE:
            return None  # the LP is infeasible only when the ILP is
        if status == pywraplp.Solver.OPTIMAL:  # else GLOP gave up (numerics, limit): CP-SAT
            values = model.values()
            rounding = _largest(values)
            if all(min(abs(v), abs(1 - v)) < _INTEGRAL for xs in values.values() for v in xs):
                return _placed(problem, costs, model, rounding, optimal=True)
            sol = _rounded(problem, costs, form, model, rounding) if ranks is None else None
            if sol is not None:
                return sol
    model = _build(problem, costs, True, ranks, budget_bytes, objective, form, busiest, limit_s)
    if model.infeasible:
        return None
    # CP-SAT's hint: the first start that satisfies the model, else the first that is a
    # placement of it (CP-SAT may repair it); `feasible` says which
    first, feasible = None, False
    for choice in _starts(problem, rounding, start):
        values = model.assignment(choice)
        if values is not None and not model.violated(values):
            first, feasible = (choice, values), True
            break
        if first is None and values is not None:
            first = (choice, values)
    if first is not None:
        model.hint(first[1])
    status = model.s.Solve()
    if status in _SOLVED:
        return _placed(problem, costs, model, _largest(model.values()),
                       optimal=status == pywraplp.Solver.OPTIMAL)
    if status == pywraplp.Solver.INFEASIBLE:
        return None
    what = (f"the {objective} ILP of tp {problem.tp} ({model.s.NumVariables()} variables, "
            f"{model.s.NumConstraints()} constraints)")
    if status != pywraplp.Solver.NOT_SOLVED:  # ABNORMAL, MODEL_INVALID: a bug, not a limit
        raise RuntimeError(f"CP-SAT failed on {what}: MPSolver status {status}")
    if feasible:  # the limit came first: the start is a placement that satisfies the model
        return _placed(problem, costs, model, first[0], optimal=False)
    raise SolverLimitReached(what, limit_s)


_LP_MODELS = 6
"""LPs kept per problem for reuse ([Note: LP reuse]): a tp 8 DeepSeek-V3 block's holds ~35 MB."""


def _lp(problem: Problem, costs: Costs, form: StepForm, busiest: int | None,
        limit_s: float) -> _Model:
    """The LP of the unconstrained time objective of `form` ([Note: LP reuse]): a kept one
    of the same costs and rows with its objective set anew, else a new one (kept, the least
    recently used dropped)."""
    models = problem.__dict__.setdefault("_lp_models", OrderedDict())
    key = (id(costs), _Model.objective_rows_key(form, busiest), limit_s)
    if key in models:
        models.move_to_end(key)
        model = models[key][1]
        model.set_objective(form, busiest)
        return model
    if len(form.shares) == 1:  # [Note: LP re-costing]: no row depends on the costs
        signature = structure_signature(problem, costs)
        for old in reversed(models):
            model = models[old][1]
            if old[1:] == key[1:] and model.signature == signature:
                del models[old]
                model.recost(costs)
                model.set_objective(form, busiest)
                models[key] = (costs, model)
                return model
    model = _build(problem, costs, False, None, None, "time", form, busiest, limit_s)
    models[key] = (costs, model)  # costs kept alive: its id stays its own
    if len(models) > _LP_MODELS:
        models.popitem(last=False)
    return model


def _starts(problem: Problem, rounding: dict | None, start: dict | None) -> list[dict]:
    """Candidate starts for CP-SAT, best first: the LP's rounding, the caller's start, every
    node at its first all-replicated candidate (when each node has one)."""
    replicated = {}
    for n in problem.nodes:
        i = next((i for i, c in enumerate(problem.cands[n])
                  if all(pl == "R" for pl in c.inputs + c.outputs)), None)
        if i is None:
            break
        replicated[n] = i
    else:
        return [c for c in (rounding, start, replicated) if c is not None]
    return [c for c in (rounding, start) if c is not None]


def _largest(values: dict[str, list[float]]) -> dict[str, int]:
    """Each node's candidate of the largest x (the first of equals)."""
    return {n: max(range(len(xs)), key=lambda i, xs=xs: xs[i]) for n, xs in values.items()}


def _placed(problem, costs, model: _Model, choice: dict[str, int], *,
            optimal: bool) -> Solution:
    sol = evaluate(problem, costs, choice)
    sol.optimal = optimal
    sol.num_vars, sol.num_constraints = model.s.NumVariables(), model.s.NumConstraints()
    sol.integer_solver = model.integer
    return sol


def _rounded(problem, costs, form: StepForm, model: _Model, choice) -> Solution | None:
    """A fractional LP optimum (ties, or the max of a stage form) rounded to each node's
    largest x (`choice`): when that placement meets the LP bound (within the gap _GAP, the
    one CP-SAT stops at) it is an ILP optimum and CP-SAT is not needed ([Note: LP first]).
    None otherwise (or when the rounding is not a valid placement)."""
    try:
        sol = evaluate(problem, costs, choice)
    except KeyError:  # an edge whose pair the rounding picked is not offered
        return None
    ties = sum(_TIE_BREAK for n, i in choice.items() if model.x[n][i] is not None
               and model.ties.get(model.x[n][i], 0.0))
    value = (form.value(sol) - form.const_s) * _NS + ties
    bound = model.s.Objective().Value()
    if value > bound + _GAP * abs(bound) + 1e-3:
        return None
    sol.num_vars, sol.num_constraints = model.s.NumVariables(), model.s.NumConstraints()
    return sol


def evaluate(problem: Problem, costs: Costs, choice: dict[str, int]) -> Solution:
    """The cost breakdown of a given choice (float arithmetic, no rounding)."""
    sol = Solution(dict(choice))
    add = lambda d, k, v: d.__setitem__(k, d.get(k, 0.0) + v)  # noqa: E731
    for n in problem.nodes:
        if n in costs.compute_s:
            add(sol.compute_s, problem.part[n], problem.weight[n] * costs.compute_s[n][choice[n]])
        if n in costs.node_comm_s:
            t = problem.weight[n] * sum(costs.node_comm_s[n][choice[n]])
            add(sol.comm_s, problem.part[n], t)
            add(sol.cp_comm_s, problem.part[n], t)
    keys = []
    for edge, pairs in zip(problem.edges, costs.pairs):
        key = edge_key(problem, edge, choice)
        pairs[key]  # noqa: B018 -- KeyError: a pair not offered, no placement of the ILP
        keys.append(key)
    for unit in redistribution_units(problem, costs):  # a shared one once
        if unit.cost_s and any(keys[i] in pair_keys for i, pair_keys in unit.uses):
            add(sol.comm_s, unit.part, unit.cost_s)
    for g, elems in costs.param_elems.items():
        sol.add_param_elems(problem.params[g][2], elems[choice[g]], frozen=g in problem.frozen)
    for n, row in costs.act_bytes.items():
        part = problem.part.get(n, "pre") if n is not None else "pre"
        add(sol.act_bytes, part, row[choice[n]] if n is not None and n in choice else row[0])
    for n, row in costs.boundary_bytes.items():
        sol.boundary_bytes = row[choice[n]] if n in choice else row[0]
    for n, row in costs.loss_rows.items():
        sol.loss_bytes = row[choice[n]] if n in choice else row[0]
    sol.objective_s = sum(sol.compute_s.values()) + sum(sol.comm_s.values())
    return sol
