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
[Note: model building] is in `_Model`.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

from ortools.linear_solver import pywraplp

from autoplan.solver.costs import Costs, split_of
from autoplan.solver.problem import OUTPUT, Problem

__all__ = ["RankMemory", "StepForm", "TIME_FORM", "Solution", "solve", "relax", "evaluate",
           "model_proto"]

_NS = 1e9
_KB = 1e3
_TIE_BREAK = 1.0  # ns
_INTEGRAL = 1e-6
_GAP = 1e-7  # relative optimality gap accepted from CP-SAT and from a rounded LP optimum
_PARTS = ("pre", "layer", "post")


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


@dataclass(frozen=True)
class StepForm:
    """The step time of one configuration as a function of the placement ([Note: step form]).

    Attributes:
        compute_factor, comm_factor: a_c, a_m, seconds of step per second of the busiest
            rank's compute (communication) per microbatch.
        shares: per pipeline rank (those no other rank dominates), ((part, share), ...).
        sync_s_per_elem: B, data-parallel sync and optimizer seconds per parameter element.
        const_s: K, seconds (constant in the placement; not in the ILP objective).
    """

    compute_factor: float
    comm_factor: float
    shares: tuple[tuple[tuple[str, float], ...], ...]
    sync_s_per_elem: float = 0.0
    const_s: float = 0.0

    @property
    def one_factor(self) -> bool:
        """a_c = a_m: the busiest rank is the one of the largest weighted time."""
        return abs(self.compute_factor - self.comm_factor) <= 1e-12 * max(
            abs(self.compute_factor), abs(self.comm_factor), 1e-300)

    def value(self, sol: "Solution") -> float:
        """The step time this form gives `sol`, seconds."""
        def on(rank, per_part: dict) -> float:
            return sum(s * per_part.get(p, 0.0) for p, s in rank)
        busiest = max(self.shares, key=lambda rank: (
            on(rank, sol.compute_s) + on(rank, sol.comm_s), on(rank, sol.compute_s)))
        elems = max(on(rank, sol.param_elems) for rank in self.shares)
        return (self.compute_factor * on(busiest, sol.compute_s)
                + self.comm_factor * on(busiest, sol.comm_s)
                + self.sync_s_per_elem * elems + self.const_s)


TIME_FORM = StepForm(1.0, 1.0, (tuple((p, 1.0) for p in _PARTS),))
"""One microbatch through the whole model (the time-optimal placement of a (tp, b, policy))."""


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
    add_* builds one block of the docstring. [Note: model building]: coefficients are set on
    pywraplp's constraint objects directly (its operator API costs ~10 us per term, which was
    most of a solve); a node with one candidate is the constant 1, and an edge with one end
    fixed needs no y variables (its pair costs become the other end's x coefficients and an
    unavailable pair forbids that candidate); identical constraints are added once."""

    def __init__(self, problem: Problem, costs: Costs, integer: bool) -> None:
        self.p, self.c, self.integer = problem, costs, integer
        self.s = pywraplp.Solver.CreateSolver("CP_SAT" if integer else "GLOP")
        if integer:
            # Full LP relaxation inside CP-SAT: a llama-tiny layer solves in 0.15 s instead
            # of 12 s with the default level; one worker keeps the answer deterministic.
            self.s.SetSolverSpecificParametersAsString(
                "linearization_level:2 num_workers:1 random_seed:0 "
                f"relative_gap_limit:{_GAP} mip_max_bound:1e14")
        else:
            # A step-time objective reaches 1e10-1e11 ns; GLOP then finds the optimum but
            # calls it IMPRECISE (a dual residual of ~1e-7 against its absolute tolerance)
            # and pywraplp drops the solution. The primal side is exact (residuals ~1e-15),
            # and the placement is re-evaluated (and, when fractional, solved by CP-SAT).
            self.s.SetSolverSpecificParametersAsString("change_status_to_imprecise: false")
        self.x: dict[str, list] = {}  # a variable per candidate, or [None]: fixed to its one
        self.y: list[dict] = []
        # per part: variable -> ns (time) and variable -> elements; the constants of fixed
        # nodes separately (they matter in the stage/sync constraints of pp > 1)
        self.comp = {p: defaultdict(float) for p in _PARTS}
        self.comm = {p: defaultdict(float) for p in _PARTS}
        self.elems = {p: defaultdict(float) for p in _PARTS}
        self.comp_const = dict.fromkeys(_PARTS, 0.0)
        self.comm_const = dict.fromkeys(_PARTS, 0.0)
        self.elems_const = dict.fromkeys(_PARTS, 0.0)
        self.ties: dict = defaultdict(float)
        self.infeasible = ""  # the constraint that cannot hold, when found while building
        self._seen: set[tuple] = set()

    def var(self, name: str):
        return self.s.BoolVar(name) if self.integer else self.s.NumVar(0.0, 1.0, name)

    def bound_var(self, ceiling: float, name: str):
        """A variable >= 0 that bounds a max (T, E, z): for CP-SAT integral (ns, elements, kB;
        rounding up costs at most one unit) and at most `ceiling` (it needs finite domains);
        continuous and unbounded above for the LP."""
        top = math.ceil(ceiling) + 1.0
        if self.integer:
            return self.s.IntVar(0.0, top, name)
        return self.s.NumVar(0.0, self.s.infinity(), name)

    def constraint(self, terms: dict, lb: float, ub: float, name: str) -> None:
        """lb <= sum(coef * var) <= ub, skipping zero terms and exact duplicates."""
        terms = {v: c for v, c in terms.items() if c}
        if not terms:
            if lb > 1e-9 or ub < -1e-9:
                self.infeasible = self.infeasible or name
            return
        key = (tuple(sorted((v.index(), c) for v, c in terms.items())), lb, ub)
        if key in self._seen:
            return
        self._seen.add(key)
        ct = self.s.Constraint(lb, ub, name)
        for v, c in terms.items():
            ct.SetCoefficient(v, c)

    def forbid(self, n: str, i: int, why: str) -> None:
        v = self.x[n][i]
        if v is None:
            self.infeasible = self.infeasible or why
        else:
            v.SetUb(0.0)

    def add_node_constraint(self) -> None:
        for n in self.p.nodes:
            k = len(self.p.cands[n])
            if k == 1:
                self.x[n] = [None]
                continue
            self.x[n] = [self.var(f"x[{n},{i}]") for i in range(k)]
            self.constraint({v: 1.0 for v in self.x[n]}, 1.0, 1.0, f"one_hot[{n}]")

    def _sum_x(self, n: str, pred) -> tuple[dict, float]:
        """(terms, constant) of the sum of x[n, c] over candidates c with pred(c)."""
        terms, const = {}, 0.0
        for v, c in zip(self.x[n], self.p.cands[n]):
            if pred(c):
                if v is None:
                    const += 1.0
                else:
                    terms[v] = terms.get(v, 0.0) + 1.0
        return terms, const

    def add_edge_constraint(self) -> None:
        for i, (edge, pairs) in enumerate(zip(self.p.edges, self.c.pairs)):
            k = edge.out_index
            src_fixed = self.x[edge.src] == [None]
            dst_fixed = edge.dst == OUTPUT or self.x[edge.dst] == [None]
            if src_fixed or dst_fixed:
                self.y.append({})
                self._fold_edge(i, edge, pairs)
                continue
            # sorted: the pairs come from sets (costs.py), whose order changes between
            # processes (string hashing); the model, and so its tie-breaks, must not
            y = {key: self.var(f"y[{i},{key}]") for key in sorted(pairs)}
            self.y.append(y)
            by_src, by_dst = defaultdict(dict), defaultdict(dict)
            for (p, q, s), var in y.items():
                by_src[p][var] = 1.0
                by_dst[(q, s)][var] = 1.0
            for p in dict.fromkeys(c.outputs[k] for c in self.p.cands[edge.src]):
                terms, _ = self._sum_x(edge.src, lambda c, p=p: c.outputs[k] == p)
                self.constraint({**by_src.get(p, {}), **{v: -c for v, c in terms.items()}},
                                0.0, 0.0, f"edge_src[{i},{p}]")
            j = edge.arg_index
            dsts = dict.fromkeys((c.inputs[j], split_of(c)) for c in self.p.cands[edge.dst])
            for q, s in dsts:
                terms, _ = self._sum_x(
                    edge.dst, lambda c, q=q, s=s: (c.inputs[j], split_of(c)) == (q, s))
                self.constraint({**by_dst.get((q, s), {}), **{v: -c for v, c in terms.items()}},
                                0.0, 0.0, f"edge_dst[{i},{q},{s}]")
            for key, var in y.items():
                fwd, bwd, _ = pairs[key]
                self.comm[edge.part][var] += edge.weight * (fwd + bwd) * _NS

    def _fold_edge(self, i: int, edge, pairs) -> None:
        """An edge with a fixed end: its cost and availability land on the other end's x."""
        k = edge.out_index
        src_cands = self.p.cands[edge.src]
        if edge.dst == OUTPUT:
            dst_keys = [("R", False)]
        else:
            dst_keys = [(c.inputs[edge.arg_index], split_of(c)) for c in self.p.cands[edge.dst]]
        free_src = self.x[edge.src] != [None]
        if not free_src and (edge.dst == OUTPUT or self.x[edge.dst] == [None]):
            key = (src_cands[0].outputs[k], *dst_keys[0])
            if key not in pairs:
                self.infeasible = self.infeasible or f"edge[{i},{key}] (no redistribution)"
            else:
                self.comm_const[edge.part] += edge.weight * sum(pairs[key][:2]) * _NS
            return
        side = edge.src if free_src else edge.dst
        for ci, cand in enumerate(self.p.cands[side]):
            key = (cand.outputs[k], *dst_keys[0]) if free_src else \
                (src_cands[0].outputs[k], *dst_keys[ci])
            if key not in pairs:
                self.forbid(side, ci, f"edge[{i},{key}] (no redistribution)")
                continue
            fwd, bwd, _ = pairs[key]
            self.comm[edge.part][self.x[side][ci]] += edge.weight * (fwd + bwd) * _NS

    def add_tied_constraint(self) -> None:
        by_fqn = defaultdict(list)
        for g, (fqn, *_rest) in self.p.params.items():
            by_fqn[fqn].append(g)
        for fqn, nodes in by_fqn.items():
            for other in nodes[1:]:
                for place in dict.fromkeys(c.outputs[0] for c in self.p.cands[nodes[0]]):
                    same = lambda c, pl=place: c.outputs[0] == pl  # noqa: E731
                    (a, ca), (b, cb) = self._sum_x(nodes[0], same), self._sum_x(other, same)
                    self.constraint({**a, **{v: -c for v, c in b.items()}}, cb - ca, cb - ca,
                                    f"tied[{fqn},{place}]")

    def memory_expr(self, rank: RankMemory) -> tuple[dict, float]:
        """(terms in kB, constant kB) of one rank's memory."""
        terms: dict = defaultdict(float)
        const = rank.const_bytes / _KB
        for g, elems in self.c.param_elems.items():
            coef = max((rank.param_coef.get(part, 0.0) for part in self.p.params[g][2]),
                       default=0.0)
            for v, e in zip(self.x[g], elems):
                if v is None:
                    const += coef * e / _KB
                else:
                    terms[v] += coef * e / _KB
        for n, row in self.c.act_bytes.items():
            coef = rank.act_coef.get(self.p.part.get(n, "pre") if n is not None else "pre", 0.0)
            if n is None or n not in self.x:
                const += coef * row[0] / _KB
                continue
            for v, b in zip(self.x[n], row):
                if v is None:
                    const += coef * b / _KB
                else:
                    terms[v] += coef * b / _KB
        return terms, const

    def add_memory_constraint(self, ranks: list[RankMemory], budget_bytes: float) -> None:
        for r, rank in _undominated(ranks):
            terms, const = self.memory_expr(rank)
            self.constraint(terms, -self.s.infinity(), budget_bytes / _KB - const,
                            f"memory[rank {r}]")

    def add_placement_costs(self) -> None:
        """Per-part compute and parameter-element terms of every node (the pairs' terms come
        from add_edge_constraint)."""
        for n in self.p.nodes:
            w, part = self.p.weight[n], self.p.part[n]
            for v, t, c in zip(self.x[n], self.c.compute_s.get(n, []), self.p.cands[n]):
                if v is None:
                    self.comp_const[part] += w * t * _NS
                    continue
                self.comp[part][v] += w * t * _NS
                if any(pl != "R" for pl in c.inputs + c.outputs):
                    self.ties[v] += _TIE_BREAK
        for g, elems in self.c.param_elems.items():
            for part in self.p.params[g][2]:
                for v, e in zip(self.x[g], elems):
                    if v is None:
                        self.elems_const[part] += e
                    else:
                        self.elems[part][v] += e

    def add_objective(self, form: StepForm, busiest: int | None = None) -> None:
        """[Note: step form]; `busiest`: the rank rho assumed busiest (a_c != a_m)."""
        obj: dict = defaultdict(float, self.ties)
        a_c, a_m, b = form.compute_factor, form.comm_factor, form.sync_s_per_elem * _NS
        if len(form.shares) == 1 or busiest is not None:
            rank = form.shares[0 if busiest is None else busiest]
            self._add_terms(obj, rank, self.comp, a_c)
            self._add_terms(obj, rank, self.comm, a_m)
            if busiest is not None:
                for r, other in enumerate(form.shares):
                    if r != busiest:
                        self._at_least(rank, other, f"busiest[rank {busiest} >= {r}]")
        else:
            big_t = self.bound_var(self._ceiling(form, elems=False), "T")
            obj[big_t] += a_m
            for r, rank in enumerate(form.shares):
                self._at_least(big_t, rank, f"stage[rank {r}]")
        if len(form.shares) == 1:
            self._add_terms(obj, form.shares[0], self.elems, b)
        elif b:
            big_e = self.bound_var(self._ceiling(form, elems=True), "E")
            obj[big_e] += b
            for r, rank in enumerate(form.shares):
                self._at_least(big_e, rank, f"sync[rank {r}]", elems=True)
        objective = self.s.Objective()
        for v, c in obj.items():
            objective.SetCoefficient(v, c)
        objective.SetMinimization()

    @staticmethod
    def _add_terms(obj: dict, rank, terms: dict, factor: float) -> None:
        for part, share in rank:
            for v, c in terms[part].items():
                obj[v] += factor * share * c

    def _ceiling(self, form: StepForm, *, elems: bool) -> float:
        """An upper bound of every rank's row: CP-SAT needs finite domains."""
        most = 0.0
        for rank in form.shares:
            row, const = self._row(rank, elems)
            most = max(most, const + sum(c for c in row.values() if c > 0))
        return most * (1 + 1e-9)

    def _row(self, rank, elems: bool) -> tuple[dict, float]:
        """(terms, constant) of sum_p s[r, p] (C_p + M_p), or of sum_p s[r, p] P_p."""
        row: dict = defaultdict(float)
        const = 0.0
        kinds = ((self.elems, self.elems_const),) if elems else (
            (self.comp, self.comp_const), (self.comm, self.comm_const))
        for part, share in rank:
            for terms, consts in kinds:
                const += share * consts[part]
                for v, c in terms[part].items():
                    row[v] += share * c
        return row, const

    def _at_least(self, bound, rank, name: str, *, elems: bool = False) -> None:
        """bound >= the rank's row; `bound` a variable or another rank's row."""
        row, const = self._row(rank, elems)
        if isinstance(bound, tuple):  # a rank: its row - this row >= 0
            lhs, lconst = self._row(bound, elems)
        else:
            lhs, lconst = {bound: 1.0}, 0.0
        terms = defaultdict(float, lhs)
        for v, c in row.items():
            terms[v] -= c
        if self.integer:
            # CP-SAT scales a constraint to integer coefficients and gives up (reports it
            # infeasible) when they span 1e0..1e10 with fractions: round to whole ns
            # (elements), at most half a unit per term.
            terms = {v: float(round(c)) for v, c in terms.items()}
        self.constraint(terms, const - lconst, self.s.infinity(), name)

    def add_memory_objective(self, ranks: list[RankMemory]) -> None:
        exprs = [(r, *self.memory_expr(rank)) for r, rank in _undominated(ranks)]
        ceiling = max((c + sum(v for v in t.values() if v > 0) for _r, t, c in exprs),
                      default=0.0)
        z = self.bound_var(ceiling, "z")
        for r, terms, const in exprs:
            self.constraint({**{v: -c for v, c in terms.items()}, z: 1.0}, const,
                            self.s.infinity(), f"memory_max[rank {r}]")
        objective = self.s.Objective()
        objective.SetCoefficient(z, 1.0)
        objective.SetMinimization()

    def values(self) -> dict[str, list[float]]:
        return {n: [1.0 if v is None else v.solution_value() for v in xs]
                for n, xs in self.x.items()}


def _undominated(ranks: list[RankMemory]) -> list[tuple[int, RankMemory]]:
    """Ranks whose memory no other rank bounds from above coefficient by coefficient (all
    coefficients and element counts are >= 0, so a dominated rank's constraint is implied)."""
    def vec(r: RankMemory) -> tuple:
        parts = sorted(set(r.param_coef) | set(r.act_coef))
        return tuple((r.param_coef.get(p, 0.0), r.act_coef.get(p, 0.0)) for p in parts)

    def leq(a: RankMemory, b: RankMemory) -> bool:
        parts = set(a.param_coef) | set(a.act_coef) | set(b.param_coef) | set(b.act_coef)
        return a.const_bytes <= b.const_bytes and all(
            a.param_coef.get(p, 0.0) <= b.param_coef.get(p, 0.0)
            and a.act_coef.get(p, 0.0) <= b.act_coef.get(p, 0.0) for p in parts)

    out: list[tuple[int, RankMemory]] = []
    seen = set()
    for r, rank in enumerate(ranks):
        key = (vec(rank), rank.const_bytes)
        if key in seen:
            continue
        seen.add(key)
        if any(leq(rank, other) and not leq(other, rank) for other in ranks):
            continue
        out.append((r, rank))
    return out


def _build(problem, costs, integer, ranks, budget_bytes, objective, form, busiest) -> _Model:
    model = _Model(problem, costs, integer)
    model.add_node_constraint()
    model.add_edge_constraint()
    model.add_tied_constraint()
    if objective == "memory":
        model.add_memory_objective(ranks or [])
    else:
        if ranks is not None:
            model.add_memory_constraint(ranks, budget_bytes)
        model.add_placement_costs()
        model.add_objective(form, busiest)
    return model


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
