r"""The placement ILP (OR-Tools CP-SAT) for one (tp, microbatch size) pair.

Notation: V the ILP nodes (problem.nodes: nodes outside the repeated blocks plus one
representative block), C_n the candidates of node n (strategies.node_strategies), E the weighted
edges (problem.edges), w_n, w_e their weights ([Note: layer sharing] in problem.py).

Variables
    x[n, c] in {0, 1}           node n runs candidate c
    y[e, (p, q, s)] in {0, 1}   edge e carries producer placement p into consumer placement q,
                                the consumer's candidate splitting its work (s) or not

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
    (tied)        a parameter read by several get_attr nodes takes one placement
                  -- implemented in add_tied_constraint()
    (memory_r)    sum_g a_r(g) elems(g, c) x[g, c] + sum_n b_r(n) act(n, c) x[n, c] + K_r <= M
                  for every pipeline rank r, when memory limits are given: a_r is the bytes per
                  parameter element of rank r (model states under the ZeRO stage and dp, plus
                  ZeRO transients), b_r the microbatches in flight times the share of the node's
                  part on the rank, M = max_memory_fraction * device memory
                  -- implemented in add_memory_constraint()

Objective ([Note: step form]): the step time of one configuration (pipeline.py), which is
affine in the placement's per-part compute, communication and parameter totals
    C_p = sum_{n in p} w_n sum_c t_compute(n, c) x[n, c]                 (seconds per microbatch)
    M_p = sum_{e in p} w_e sum_k (t_fwd(e, k) + t_bwd(e, k)) y[e, k]     (seconds per microbatch)
    P_p = sum_{g: p in parts(g)} sum_c elems(g, c) x[g, c]               (parameter elements)
for the parts p in {pre, layer, post}, through the busiest pipeline rank r* (the largest
sum_p s[r, p] (C_p + M_p), s[r, p] the share of part p on rank r) and the rank with the most
parameters:
    step = a_c sum_p s[r*, p] C_p + a_m sum_p s[r*, p] M_p + B max_r sum_p s[r, p] P_p + K
with a_c, a_m the stage factors (microbatches plus the bubble; they differ only where compute
slows down with the number of busy ranks), B the data-parallel sync and optimizer seconds per
parameter element, K constant (`StepForm`). So
    min  a_c sum_p s[rho, p] C_p + a_m sum_p s[rho, p] M_p + B E + eps * (nodes not all-R)
    (busiest_r)  sum_p s[rho, p] (C_p + M_p) >= sum_p s[r, p] (C_p + M_p)   for r != rho
    (sync_r)     E >= sum_p s[r, p] P_p
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
bound within the relative gap 1e-7. Otherwise, and always under memory constraints
(knapsack-like, the LP is fractional), the model is solved as an ILP by CP-SAT
(linearization_level 2, one deterministic worker, relative gap 1e-7, variable bounds up to
1e14: its default 1e7 would truncate T, E and z).
Units inside the model: ns for time, kB (1e3 B) for memory, elements for parameters.
Compute, communication and transition (edge) costs stay separate in `Solution`.

Files: ilp_types.py (RankMemory, StepForm, Solution), ilp_model.py (the model: `_Model`, whose
add_* methods are named above, and [Note: model building]); this module solves the model and
evaluates placements (`solve`, `relax`, `evaluate`, `model_proto`).
"""

from __future__ import annotations

import time

from ortools.linear_solver import pywraplp

from autoplan.solver.costs import Costs, split_of
from autoplan.solver.ilp_model import _build, _Model
from autoplan.solver.ilp_types import (_GAP, _NS, _TIE_BREAK, TIME_FORM, RankMemory, Solution,
                                       StepForm)
from autoplan.solver.problem import OUTPUT, Problem

__all__ = ["RankMemory", "StepForm", "TIME_FORM", "Solution", "solve", "relax", "evaluate",
           "model_proto"]

_INTEGRAL = 1e-6


def solve(problem: Problem, costs: Costs, *, form: StepForm = TIME_FORM,
          ranks: list[RankMemory] | None = None, budget_bytes: float | None = None,
          objective: str = "time", time_limit_s: float = 10.0) -> Solution | None:
    """Solve the ILP of the module docstring ([Note: LP first]); None when infeasible.

    Args:
        problem, costs: from problem.build_problem and costs.build_costs.
        form: the step time to minimise ([Note: step form]); default: one microbatch.
        ranks, budget_bytes: per-rank memory (RankMemory) and the limit; no memory constraint
            when `ranks` is None.
        objective: "time" (default) or "memory" (min of the largest rank's memory).
        time_limit_s: time limit per solver call, seconds.
    """
    start = time.perf_counter()
    several = objective != "memory" and len(form.shares) > 1 and not form.one_factor
    best = None
    for busiest in (range(len(form.shares)) if several else (None,)):
        sol = _solve_once(problem, costs, form, busiest, ranks, budget_bytes, objective,
                          time_limit_s)
        if sol is not None and (best is None or form.value(sol) < form.value(best)):
            best = sol
    if best is not None:
        best.solve_s = time.perf_counter() - start
    return best


def model_proto(problem: Problem, costs: Costs, *, form: StepForm = TIME_FORM,
                ranks: list[RankMemory] | None = None, budget_bytes: float | None = None,
                integer: bool = True):
    """The ILP as OR-Tools' MPModelProto (ortools.linear_solver.linear_solver_pb2): to read,
    export (`ExportModelAsLpFormat`) or check, e.g. for duplicate constraints."""
    from ortools.linear_solver import linear_solver_pb2

    model = _build(problem, costs, integer, ranks, budget_bytes, "time", form, None)
    proto = linear_solver_pb2.MPModelProto()
    model.s.ExportModelToProto(proto)
    return proto


def relax(problem: Problem, costs: Costs, *, form: StepForm,
          time_limit_s: float = 10.0) -> tuple[float, Solution | None]:
    """(a step time no placement beats, a placement certified optimal or None) from the LP
    relaxation of the unconstrained ILP ([Note: LP first]): the bound is the LP optimum less
    the tie-breaks; the placement is the LP's (integral or rounded) when it meets the bound
    within the relative gap. Cheap (GLOP only); `solve` does the rest."""
    several = len(form.shares) > 1 and not form.one_factor
    bound, best = float("inf"), None
    for busiest in (range(len(form.shares)) if several else (None,)):
        model = _build(problem, costs, False, None, None, "time", form, busiest)
        if model.infeasible:
            continue
        model.s.SetTimeLimit(int(time_limit_s * 1000))
        status = model.s.Solve()
        if status == pywraplp.Solver.INFEASIBLE:
            continue
        if status != pywraplp.Solver.OPTIMAL:
            return form.const_s, None  # no bound known beyond the constant
        lp = model.s.Objective().Value() - _TIE_BREAK * len(model.ties)
        bound = min(bound, lp / _NS + form.const_s)
        values = model.values()
        sol = _rounded(problem, costs, form, model, values)
        if sol is not None and (best is None or form.value(sol) < form.value(best)):
            best = sol
    if best is not None:
        slack = _GAP * abs(bound) + _TIE_BREAK * len(problem.nodes) / _NS
        best = best if form.value(best) <= bound + slack else None
    return bound, best


def _solve_once(problem, costs, form, busiest, ranks, budget_bytes, objective,
                time_limit_s) -> Solution | None:
    optimal = True
    # Memory constraints (knapsack-like) make the LP fractional: go to CP-SAT directly.
    for integer in ((True,) if ranks is not None or objective == "memory" else (False, True)):
        model = _build(problem, costs, integer, ranks, budget_bytes, objective, form, busiest)
        if model.infeasible:
            return None  # a constraint without variables fails (e.g. a fixed pair not offered)
        model.s.SetTimeLimit(int(time_limit_s * 1000))
        status = model.s.Solve()
        if status == pywraplp.Solver.INFEASIBLE:
            return None  # the LP is infeasible only when the ILP is
        if not integer and status != pywraplp.Solver.OPTIMAL:
            continue  # GLOP gave up (numerics, time): CP-SAT decides
        if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
            return None
        values = model.values()
        if all(min(abs(v), abs(1 - v)) < _INTEGRAL for xs in values.values() for v in xs):
            optimal = status == pywraplp.Solver.OPTIMAL
            break
        rounded = None if integer else _rounded(problem, costs, form, model, values)
        if rounded is not None:
            return rounded
    choice = {n: max(range(len(xs)), key=lambda i, xs=xs: xs[i]) for n, xs in values.items()}
    sol = evaluate(problem, costs, choice)
    sol.optimal = optimal
    sol.num_vars, sol.num_constraints = model.s.NumVariables(), model.s.NumConstraints()
    sol.integer_solver = model.integer
    return sol


def _rounded(problem, costs, form: StepForm, model: _Model, values) -> Solution | None:
    """A fractional LP optimum (ties, or the max of a stage form) rounded to each node's
    largest x: when that placement meets the LP bound (within the gap _GAP, the one CP-SAT
    stops at) it is an ILP optimum and CP-SAT is not needed ([Note: LP first]). None otherwise
    (or when the rounding is not a valid placement)."""
    choice = {n: max(range(len(xs)), key=lambda i, xs=xs: xs[i]) for n, xs in values.items()}
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
    for edge, pairs in zip(problem.edges, costs.pairs):
        key = edge_key(problem, edge, choice)
        fwd, bwd, _ = pairs[key]
        add(sol.comm_s, edge.part, edge.weight * (fwd + bwd))
    for g, elems in costs.param_elems.items():
        sol.add_param_elems(problem.params[g][2], elems[choice[g]])
    for n, row in costs.act_bytes.items():
        part = problem.part.get(n, "pre") if n is not None else "pre"
        add(sol.act_bytes, part, row[choice[n]] if n is not None and n in choice else row[0])
    sol.objective_s = sum(sol.compute_s.values()) + sum(sol.comm_s.values())
    return sol


def edge_key(problem: Problem, edge, choice: dict[str, int]) -> tuple:
    """(p, q, split) that the choice puts on `edge`."""
    p = problem.cands[edge.src][choice[edge.src]].outputs[edge.out_index]
    if edge.dst == OUTPUT:
        return (p, "R", False)
    c = problem.cands[edge.dst][choice[edge.dst]]
    return (p, c.inputs[edge.arg_index], split_of(c))
