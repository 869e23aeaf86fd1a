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

Objective (seconds per microbatch through the whole model, fwd + bwd)
    min  sum_n w_n sum_c t_compute(n, c) x[n, c]
       + sum_e w_e sum_k (t_fwd(e, k) + t_bwd(e, k)) y[e, k]
       + eps * (number of nodes not all-R)
    -- implemented in add_objective(); eps (1 ns) only breaks ties towards replication.
    With objective="memory" the objective is instead min z, (memory_max_r) z >= memory_r for
    all r (the smallest memory a plan of this configuration needs; explains infeasibility)
    -- implemented in add_memory_objective().

Solving ([Note: LP first]): the LP relaxation (x, y in [0, 1]) is solved with GLOP first. The
edge constraints make it tight -- on every llama/gpt2 layer we measured its optimum is integral
-- and an integral LP optimum is an optimum of the ILP (the LP bound is met by an integral
point), found in ~30 ms instead of ~250 ms. When the LP optimum is fractional (ties), and
always under memory constraints (knapsack-like, the LP is fractional), the model is solved as an
ILP by CP-SAT (linearization_level 2, one deterministic worker, relative gap 1e-4).
Units inside the model: ns for time, kB (1e3 B) for memory.
Compute, communication and transition (edge) costs stay separate in `Solution`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from ortools.linear_solver import pywraplp

from autoplan.solver.costs import Costs, split_of
from autoplan.solver.problem import OUTPUT, Problem

__all__ = ["RankMemory", "Solution", "solve", "evaluate"]

_NS = 1e9
_KB = 1e3
_TIE_BREAK = 1.0  # ns
_INTEGRAL = 1e-6


@dataclass(frozen=True)
class RankMemory:
    """Memory of one pipeline rank as a linear function of the placements, bytes.

    Attributes:
        param_coef: part -> bytes per parameter element (elements as costs.param_elems count
            them, multiplicity included). A parameter in several parts takes the largest.
        act_coef: part -> factor on activation bytes (in flight x share of the part on the rank).
        const_bytes: placement-independent bytes (logits working set, ...).
    """

    param_coef: dict[str, float]
    act_coef: dict[str, float]
    const_bytes: float = 0.0


@dataclass
class Solution:
    """A solved placement and its cost breakdown (weighted totals over the whole model).

    Attributes:
        choice: ILP node -> index of its chosen candidate.
        compute_s, comm_s: part -> seconds per microbatch (fwd + bwd).
        param_elems, act_bytes: part -> parameter elements per device, activation bytes per
            microbatch per device.
        objective_s: compute + comm, seconds per microbatch.
        optimal: CP-SAT proved optimality (False: best found within the time limit).
        num_vars, num_constraints, solve_s: model size and wall time.
        integer_solver: True when the LP was fractional and CP-SAT solved the ILP.
    """

    choice: dict[str, int]
    compute_s: dict[str, float] = field(default_factory=dict)
    comm_s: dict[str, float] = field(default_factory=dict)
    param_elems: dict[str, float] = field(default_factory=dict)
    act_bytes: dict[str, float] = field(default_factory=dict)
    objective_s: float = 0.0
    optimal: bool = True
    num_vars: int = 0
    num_constraints: int = 0
    solve_s: float = 0.0
    integer_solver: bool = False


class _Model:
    """The model under construction (pywraplp: GLOP for the LP, CP-SAT for the ILP); each
    add_* builds one block of the docstring."""

    def __init__(self, problem: Problem, costs: Costs, integer: bool) -> None:
        self.p, self.c, self.integer = problem, costs, integer
        self.s = pywraplp.Solver.CreateSolver("CP_SAT" if integer else "GLOP")
        if integer:
            # Full LP relaxation inside CP-SAT: a llama-tiny layer solves in 0.15 s instead
            # of 12 s with the default level; one worker keeps the answer deterministic.
            self.s.SetSolverSpecificParametersAsString(
                "linearization_level:2 num_workers:1 random_seed:0 relative_gap_limit:1e-4")
        self.x: dict[str, list] = {}
        self.y: list[dict] = []

    def var(self, name: str):
        return self.s.BoolVar(name) if self.integer else self.s.NumVar(0.0, 1.0, name)

    def add_node_constraint(self) -> None:
        for n in self.p.nodes:
            k = len(self.p.cands[n])
            if k == 1:
                self.x[n] = [1]
                continue
            self.x[n] = [self.var(f"x[{n},{i}]") for i in range(k)]
            self.s.Add(sum(self.x[n]) == 1, f"one_hot[{n}]")

    def _sum_x(self, n: str, pred):
        return sum(v for v, c in zip(self.x[n], self.p.cands[n]) if pred(c))

    def add_edge_constraint(self) -> None:
        for i, (edge, pairs) in enumerate(zip(self.p.edges, self.c.pairs)):
            y = {key: self.var(f"y[{i},{key}]") for key in pairs}
            self.y.append(y)
            by_src, by_dst = defaultdict(list), defaultdict(list)
            for (p, q, s), var in y.items():
                by_src[p].append(var)
                by_dst[(q, s)].append(var)
            k = edge.out_index
            for p in {c.outputs[k] for c in self.p.cands[edge.src]}:
                self.s.Add(sum(by_src.get(p, [])) == self._sum_x(
                    edge.src, lambda c, p=p: c.outputs[k] == p), f"edge_src[{i},{p}]")
            if edge.dst == OUTPUT:
                self.s.Add(sum(y.values()) == 1, f"edge_dst[{i},output R]")
                continue
            j = edge.arg_index
            for q, s in {(c.inputs[j], split_of(c)) for c in self.p.cands[edge.dst]}:
                self.s.Add(sum(by_dst.get((q, s), [])) == self._sum_x(
                    edge.dst, lambda c, q=q, s=s: (c.inputs[j], split_of(c)) == (q, s)),
                    f"edge_dst[{i},{q},{s}]")

    def add_tied_constraint(self) -> None:
        by_fqn = defaultdict(list)
        for g, (fqn, *_rest) in self.p.params.items():
            by_fqn[fqn].append(g)
        for fqn, nodes in by_fqn.items():
            for other in nodes[1:]:
                for place in {c.outputs[0] for c in self.p.cands[nodes[0]]}:
                    same = lambda c, pl=place: c.outputs[0] == pl  # noqa: E731
                    self.s.Add(self._sum_x(nodes[0], same) == self._sum_x(other, same),
                               f"tied[{fqn},{place}]")

    def memory_expr(self, rank: RankMemory):
        """(linear expression in kB, constant kB) of one rank's memory."""
        expr, const = 0, rank.const_bytes / _KB
        for g, elems in self.c.param_elems.items():
            coef = max((rank.param_coef.get(part, 0.0) for part in self.p.params[g][2]),
                       default=0.0)
            expr += sum(v * (coef * e / _KB) for v, e in zip(self.x[g], elems))
        for n, row in self.c.act_bytes.items():
            coef = rank.act_coef.get(self.p.part.get(n, "pre") if n is not None else "pre", 0.0)
            if n is None or n not in self.x:
                const += coef * row[0] / _KB
            else:
                expr += sum(v * (coef * b / _KB) for v, b in zip(self.x[n], row))
        return expr, const

    def add_memory_constraint(self, ranks: list[RankMemory], budget_bytes: float) -> None:
        for r, rank in enumerate(ranks):
            expr, const = self.memory_expr(rank)
            self.s.Add(expr <= budget_bytes / _KB - const, f"memory[rank {r}]")

    def add_objective(self) -> None:
        obj = 0
        for n in self.p.nodes:
            w = self.p.weight[n]
            for v, t, c in zip(self.x[n], self.c.compute_s.get(n, []), self.p.cands[n]):
                tie = _TIE_BREAK if any(pl != "R" for pl in c.inputs + c.outputs) else 0
                obj += v * (w * t * _NS + tie)
        for edge, y, pairs in zip(self.p.edges, self.y, self.c.pairs):
            for key, var in y.items():
                fwd, bwd, _ = pairs[key]
                obj += var * (edge.weight * (fwd + bwd) * _NS)
        self.s.Minimize(obj)

    def add_memory_objective(self, ranks: list[RankMemory]) -> None:
        z = self.s.NumVar(0.0, self.s.infinity(), "z")
        for r, rank in enumerate(ranks):
            expr, const = self.memory_expr(rank)
            self.s.Add(z >= expr + const, f"memory_max[rank {r}]")
        self.s.Minimize(z)

    def values(self) -> dict[str, list[float]]:
        return {n: [v if isinstance(v, int) else v.solution_value() for v in xs]
                for n, xs in self.x.items()}


def _build(problem, costs, integer, ranks, budget_bytes, objective) -> _Model:
    model = _Model(problem, costs, integer)
    model.add_node_constraint()
    model.add_edge_constraint()
    model.add_tied_constraint()
    if objective == "memory":
        model.add_memory_objective(ranks or [])
    else:
        if ranks is not None:
            model.add_memory_constraint(ranks, budget_bytes)
        model.add_objective()
    return model


def solve(problem: Problem, costs: Costs, *, ranks: list[RankMemory] | None = None,
          budget_bytes: float | None = None, objective: str = "time",
          time_limit_s: float = 10.0) -> Solution | None:
    """Solve the ILP of the module docstring ([Note: LP first]); None when infeasible.

    Args:
        problem, costs: from problem.build_problem and costs.build_costs.
        ranks, budget_bytes: per-rank memory (RankMemory) and the limit; no memory constraint
            when `ranks` is None.
        objective: "time" (default) or "memory" (min of the largest rank's memory).
        time_limit_s: time limit per solver call, seconds.
    """
    start = time.perf_counter()
    optimal = True
    # Memory constraints (knapsack-like) make the LP fractional: go to CP-SAT directly.
    for integer in ((True,) if ranks is not None or objective == "memory" else (False, True)):
        model = _build(problem, costs, integer, ranks, budget_bytes, objective)
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
    choice = {n: max(range(len(xs)), key=lambda i, xs=xs: xs[i]) for n, xs in values.items()}
    sol = evaluate(problem, costs, choice)
    sol.optimal = optimal
    sol.num_vars, sol.num_constraints = model.s.NumVariables(), model.s.NumConstraints()
    sol.solve_s = time.perf_counter() - start
    sol.integer_solver = model.integer
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
        for part in problem.params[g][2]:
            add(sol.param_elems, part, elems[choice[g]])
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
