"""Building the placement ILP of ilp.py as an OR-Tools model ([Note: model building]).

`_Model` holds the model under construction; each of its add_* methods builds one block of the
math in ilp.py's docstring (the names there say which). `_build` assembles a whole model for
one objective; ilp.py solves it. Units inside the model: ns for time, kB (1e3 B) for memory,
elements for parameters.

Long because: it is the ILP written as code, one class (`_Model`) whose add_* methods follow
the blocks of ilp.py's math in order (structure, node, edge, tied, memory, placement costs,
objective); cut into files, a block would no longer read beside the variables and helpers the
others share.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from ortools.linear_solver import pywraplp

from autoplan.cost_model.placement_totals import RankMemory
from autoplan.solver.costs import Costs, redistribution_units, split_of
from autoplan.solver.ilp_types import _GAP, _NS, _PARTS, _TIE_BREAK, StepForm
from autoplan.solver.problem import OUTPUT, Problem

__all__ = ["edge_key", "structure_signature"]

_KB = 1e3


class _Model:
    """The model under construction (pywraplp: GLOP for the LP, CP-SAT for the ILP); each
    add_* builds one block of ilp.py's docstring. [Note: model building]: coefficients are set on
    pywraplp's constraint objects directly (its operator API costs ~10 us per term, which was
    most of a solve); a node with one candidate is the constant 1, and an edge with one end
    fixed needs no y variables (its pair costs become the other end's x coefficients and an
    unavailable pair forbids that candidate); identical constraints are added once.

    [Note: model templates] The variables and rows of add_node_constraint,
    add_edge_constraint and add_tied_constraint depend on the problem, the pairs each edge
    offers and which redistributions cost anything -- not on what they cost. A search solves
    dozens of ILPs of one problem (one per (b, policy, cp) and step form), so the first model
    of each such structure records what it did (`_Template`, kept on the Problem) and the later
    ones replay it: the same variables, rows, bounds and communication terms in the same order
    (the costs of this model's units), at about half the Python work."""

    def __init__(self, problem: Problem, costs: Costs, integer: bool, limit_s: float) -> None:
        self.p, self.c, self.integer = problem, costs, integer
        self.s = pywraplp.Solver.CreateSolver("CP_SAT" if integer else "GLOP")
        # limit_s: deterministic seconds, never wall-clock ([Note: deterministic limits])
        if integer:
            # Full LP relaxation inside CP-SAT: a llama-tiny layer solves in 0.15 s instead
            # of 12 s with the default level; one worker with a fixed seed keeps the answer
            # independent of the core count and of thread interleaving.
            self.s.SetSolverSpecificParametersAsString(
                "linearization_level:2 num_workers:1 random_seed:0 "
                f"relative_gap_limit:{_GAP} mip_max_bound:1e14 max_deterministic_time:{limit_s:g}")
        else:
            # A step-time objective reaches 1e10-1e11 ns; GLOP then finds the optimum but
            # calls it IMPRECISE (a dual residual of ~1e-7 against its absolute tolerance)
            # and pywraplp drops the solution. The primal side is exact (residuals ~1e-15),
            # and the placement is re-evaluated (and, when fractional, solved by CP-SAT).
            self.s.SetSolverSpecificParametersAsString(
                f"change_status_to_imprecise:false max_deterministic_time:{limit_s:g}")
        self.x: dict[str, list] = {}  # a variable per candidate, or [None]: fixed to its one
        self.y: list[dict] = []
        # shared redistributions: (z, [(terms, constant) of each edge that carries it])
        self.shared: list[tuple] = []
        # per part: variable -> ns (time) and variable -> elements; the constants of fixed
        # nodes separately (they matter in the stage/sync constraints of pp > 1)
        self.comp = {p: defaultdict(float) for p in _PARTS}
        self.comm = {p: defaultdict(float) for p in _PARTS}
        self.elems = {p: defaultdict(float) for p in _PARTS}  # trainable parameters
        self.frozen = {p: defaultdict(float) for p in _PARTS}  # frozen ones (Problem.frozen)
        self.comp_const = dict.fromkeys(_PARTS, 0.0)
        self.comm_const = dict.fromkeys(_PARTS, 0.0)
        self.elems_const = dict.fromkeys(_PARTS, 0.0)
        self.frozen_const = dict.fromkeys(_PARTS, 0.0)
        self.frozen_weight = 0.0  # B_f / B of the objective's step form (add_objective)
        self._objective_vars: dict = {}  # T and E, where the objective's rows made them
        self.ties: dict = defaultdict(float)
        self.infeasible = ""  # the constraint that cannot hold, when found while building
        self._seen: set[tuple] = set()
        # for `assignment` and `violated`: every constraint as (terms, lb, ub, name, binding)
        # -- binding False for the busiest-rank rows, which split the search rather than
        # constrain a placement -- and the bound variables (T, E, z)
        self.rows: list[tuple[dict, float, float, str, bool]] = []
        self.bounds: list = []
        self._index: dict = {}  # variable -> its solver index, for the duplicate check
        self._log: list | None = None  # [Note: model templates]: what add_structure did

    def add_structure(self) -> None:
        """add_node_constraint, add_edge_constraint and add_tied_constraint, replayed from a
        template of the problem when an earlier model had the same structure ([Note: model
        templates])."""
        units = redistribution_units(self.p, self.c)
        self.signature = signature = structure_signature(self.p, self.c)
        templates = self.p.__dict__.setdefault("_ilp_templates", {})
        if signature in templates:
            self._replay(templates[signature], units)
            return
        self._log = []
        self.add_node_constraint()
        self.add_edge_constraint()
        self.add_tied_constraint()
        templates[signature] = _Template(
            tuple(self._log), frozenset(self._seen), self.infeasible,
            {n: None if xs == [None] else [self._index[v] for v in xs]
             for n, xs in self.x.items()},
            [{key: self._index[v] for key, v in y.items()} for y in self.y])
        self._log = None

    def recost(self, costs: Costs) -> None:
        """[Note: LP re-costing] in ilp.py: this model (its variables, rows and bounds) with
        the cost terms of `costs`, a Costs of the same problem and `structure_signature`: the
        communication terms of the structure's template and add_placement_costs again. The
        objective is left to `set_objective`."""
        units = redistribution_units(self.p, costs)
        assert structure_signature(self.p, costs) == self.signature
        self.c = costs
        for terms in (self.comp, self.comm, self.elems, self.frozen):
            for part in _PARTS:
                terms[part] = defaultdict(float)
        for consts in (self.comp_const, self.comm_const, self.elems_const, self.frozen_const):
            consts.update(dict.fromkeys(_PARTS, 0.0))
        self.ties = defaultdict(float)
        # the structure's variables, by solver index (the template's numbering); the model's
        # own objects: pywraplp's variables() makes new ones, which hash apart
        made = {i: v for v, i in self._index.items()}
        for op in self.p.__dict__["_ilp_templates"][self.signature].ops:
            if op[0] == "comm":
                _kind, part, n, o, coef = op
                cost = units[n].cost_s * _NS
                self.comm[part][made[o]] += cost if coef is None else cost * coef
            elif op[0] == "const":
                self.comm_const[op[1]] += units[op[2]].cost_s * _NS
        self.add_placement_costs()

    def _replay(self, template: "_Template", units: list) -> None:
        """The model add_structure builds, from `template` (the same variables, rows, bounds
        and communication terms in the same order; the costs from `units`)."""
        made: list = []
        for op in template.ops:
            kind = op[0]
            if kind == "var":
                made.append(self.var(op[1]))
            elif kind == "row":
                _kind, terms, lb, ub, name, binding = op
                terms = {made[o]: c for o, c in terms}
                self.rows.append((terms, lb, ub, name, binding))
                ct = self.s.Constraint(lb, ub, name)
                for v, c in terms.items():
                    ct.SetCoefficient(v, c)
            elif kind == "ub0":
                made[op[1]].SetUb(0.0)
            elif kind == "comm":  # as _add_redistribution_costs: cost, then cost * coef
                _kind, part, n, o, coef = op
                cost = units[n].cost_s * _NS
                self.comm[part][made[o]] += cost if coef is None else cost * coef
            elif kind == "const":
                self.comm_const[op[1]] += units[op[2]].cost_s * _NS
            else:  # "shared"
                self.shared.append((made[op[1]], [({made[o]: c for o, c in terms}, const)
                                                  for terms, const in op[2]]))
        self._seen = set(template.seen)
        self.infeasible = template.infeasible
        self.x = {n: [None] if xs is None else [made[o] for o in xs]
                  for n, xs in template.x.items()}
        self.y = [{key: made[o] for key, o in y.items()} for y in template.y]

    def var(self, name: str):
        v = self.s.BoolVar(name) if self.integer else self.s.NumVar(0.0, 1.0, name)
        self._index[v] = v.index()  # asked once: the duplicate check needs it per term
        if self._log is not None:
            self._log.append(("var", name))
        return v

    def bound_var(self, ceiling: float, name: str):
        """A variable >= 0 that bounds a max (T, E, z): for CP-SAT integral (ns, elements, kB;
        rounding up costs at most one unit) and at most `ceiling` (it needs finite domains);
        continuous and unbounded above for the LP."""
        top = math.ceil(ceiling) + 1.0
        var = (self.s.IntVar(0.0, top, name) if self.integer
               else self.s.NumVar(0.0, self.s.infinity(), name))
        self.bounds.append(var)
        return var

    def constraint(self, terms: dict, lb: float, ub: float, name: str, *,
                   binding: bool = True) -> None:
        """lb <= sum(coef * var) <= ub, skipping zero terms and exact duplicates; `binding`
        False: a row of the busiest-rank split (add_objective), not of the placement."""
        terms = {v: c for v, c in terms.items() if c}
        if not terms:
            if lb > 1e-9 or ub < -1e-9:
                self.infeasible = self.infeasible or name
            return
        index = self._index
        key = (tuple(sorted((index[v] if v in index else v.index(), c)
                            for v, c in terms.items())), lb, ub)
        if key in self._seen:
            return
        self._seen.add(key)
        self.rows.append((terms, lb, ub, name, binding))
        if self._log is not None:
            self._log.append(("row", tuple((index[v], c) for v, c in terms.items()), lb, ub,
                              name, binding))
        ct = self.s.Constraint(lb, ub, name)
        for v, c in terms.items():
            ct.SetCoefficient(v, c)

    def forbid(self, n: str, i: int, why: str) -> None:
        v = self.x[n][i]
        if v is None:
            self.infeasible = self.infeasible or why
        else:
            v.SetUb(0.0)
            if self._log is not None:
                self._log.append(("ub0", self._index[v]))

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
        # per edge: pair key -> (terms, constant) of the 0/1 expression "the edge carries it"
        carries: list[dict[tuple, tuple[dict, float]]] = []
        for i, (edge, pairs) in enumerate(zip(self.p.edges, self.c.pairs)):
            k = edge.out_index
            src_fixed = self.x[edge.src] == [None]
            dst_fixed = edge.dst == OUTPUT or self.x[edge.dst] == [None]
            if src_fixed or dst_fixed:
                self.y.append({})
                carries.append(self._fold_edge(i, edge, pairs))
                continue
            # sorted: the pairs come from sets (costs.py), whose order changes between
            # processes (string hashing); the model, and so its tie-breaks, must not
            y = {key: self.var(f"y[{i},{key}]") for key in sorted(pairs)}
            self.y.append(y)
            carries.append({key: ({var: 1.0}, 0.0) for key, var in y.items()})
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
        self._add_redistribution_costs(carries)

    def _fold_edge(self, i: int, edge, pairs) -> dict[tuple, tuple[dict, float]]:
        """An edge with a fixed end: which pair it carries is the other end's x (a constant
        when both ends are fixed); an unavailable pair forbids that candidate."""
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
                return {}
            return {key: ({}, 1.0)}
        side = edge.src if free_src else edge.dst
        out: dict[tuple, tuple[dict, float]] = {}
        for ci, cand in enumerate(self.p.cands[side]):
            key = (cand.outputs[k], *dst_keys[0]) if free_src else \
                (src_cands[0].outputs[k], *dst_keys[ci])
            if key not in pairs:
                self.forbid(side, ci, f"edge[{i},{key}] (no redistribution)")
                continue
            out.setdefault(key, ({}, 0.0))[0][self.x[side][ci]] = 1.0
        return out

    def _add_redistribution_costs(self, carries: list[dict]) -> None:
        """The communication terms (costs.redistribution_units): a unit of one (edge, pair)
        is priced on the expression that says the edge carries the pair; a shared one
        ([Note: one redistribution per value] in problem.py) on a variable z >= each of its
        edges' expressions (z = 1 when any edge carries it, minimisation keeps it 0 else)."""
        for n, unit in enumerate(redistribution_units(self.p, self.c)):
            if not unit.cost_s:
                continue
            cost = unit.cost_s * _NS
            exprs = []
            for i, keys in unit.uses:
                terms: dict = defaultdict(float)
                const = 0.0
                for key in keys:
                    t, c = carries[i].get(key, ({}, 0.0))
                    const += c
                    for v, coef in t.items():
                        terms[v] += coef
                if terms or const:
                    exprs.append((dict(terms), const))
            if not exprs:
                continue
            log = self._log if self._log is not None else []
            if any(const >= 1.0 for _t, const in exprs):
                self.comm_const[unit.part] += cost
                log.append(("const", unit.part, n))
                continue
            if len(exprs) == 1:
                for v, coef in exprs[0][0].items():
                    self.comm[unit.part][v] += cost * coef
                    log.append(("comm", unit.part, n, self._index[v], coef))
                continue
            z = self.var(f"z[{n}]")
            self.shared.append((z, exprs))
            log.append(("shared", self._index[z], [
                (tuple((self._index[v], c) for v, c in terms.items()), const)
                for terms, const in exprs]))
            for m, (terms, const) in enumerate(exprs):
                self.constraint({z: 1.0, **{v: -c for v, c in terms.items()}}, const,
                                self.s.infinity(), f"shared[{n},{m}]")
            self.comm[unit.part][z] += cost
            log.append(("comm", unit.part, n, self._index[z], None))

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
            if rank.expert_coef is not None and g in self.p.experts:  # held as ep slices
                per_part = rank.expert_frozen_coef if g in self.p.frozen else rank.expert_coef
            elif rank.frozen_coef is None or g not in self.p.frozen:
                per_part = rank.param_coef
            else:
                per_part = rank.frozen_coef
            coef = max((per_part.get(part, 0.0) for part in self.p.params[g][2]), default=0.0)
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
        for n, row in self.c.loss_rows.items() if rank.loss_coef else ():
            if n not in self.x:
                const += rank.loss_coef * row[0] / _KB
                continue
            for v, b in zip(self.x[n], row):
                if v is None:
                    const += rank.loss_coef * b / _KB
                else:
                    terms[v] += rank.loss_coef * b / _KB
        for n, row in self.c.boundary_bytes.items() if rank.boundary_coef else ():
            coef = rank.boundary_coef
            if n not in self.x:
                const += coef * row[0] / _KB
                continue
            for v, b in zip(self.x[n], row):
                if v is None:
                    const += coef * b / _KB
                else:
                    terms[v] += coef * b / _KB
        return terms, const

    def add_memory_constraint(self, ranks: list[RankMemory], budget_bytes: float) -> None:
        """(memory_r) of every rank no other dominates. Forms with expert slices (ep > 1)
        admit, at tp > 1, only the expert-weight placements the runtime runs with ep: split
        on tp by whole experts, Shard(0) (search.for_ep; [Note: experts over ep and tp] in
        runtime/expert_parallel.py)."""
        if self.p.tp > 1 and any(r.expert_coef is not None for r in ranks):
            for g in self.p.experts:
                for i, c in enumerate(self.p.cands[g]):
                    if c.outputs[:1] != ("S(0)",):
                        self.forbid(g, i, f"expert weight {g} split otherwise than Shard(0)")
        for r, rank in _undominated(ranks):
            terms, const = self.memory_expr(rank)
            self.constraint(terms, -self.s.infinity(), budget_bytes / _KB - const,
                            f"memory[rank {r}]")

    def add_placement_costs(self) -> None:
        """Per-part compute, node communication (Costs.node_comm_s) and parameter-element
        terms of every node (the pairs' terms come from add_edge_constraint)."""
        for n in self.p.nodes:
            w, part = self.p.weight[n], self.p.part[n]
            for v, t, c in zip(self.x[n], self.c.compute_s.get(n, []), self.p.cands[n]):
                if v is None:
                    self.comp_const[part] += w * t * _NS
                    continue
                self.comp[part][v] += w * t * _NS
                if any(pl != "R" for pl in c.inputs + c.outputs):
                    self.ties[v] += _TIE_BREAK
            # collectives of the node itself (context parallelism's K/V gather), comm terms
            for v, (fwd, bwd) in zip(self.x[n], self.c.node_comm_s.get(n, [])):
                if v is None:
                    self.comm_const[part] += w * (fwd + bwd) * _NS
                else:
                    self.comm[part][v] += w * (fwd + bwd) * _NS
        for g, elems in self.c.param_elems.items():
            terms, consts = (self.frozen, self.frozen_const) if g in self.p.frozen else (
                self.elems, self.elems_const)
            for part in self.p.params[g][2]:
                for v, e in zip(self.x[g], elems):
                    if v is None:
                        consts[part] += e
                    else:
                        terms[part][v] += e

    def add_objective(self, form: StepForm, busiest: int | None = None) -> None:
        """[Note: step form]; `busiest`: the rank rho assumed busiest (a_c != a_m). The rows
        (`_add_objective_rows`, which depend on `objective_rows_key` only), then the
        coefficients (`set_objective`)."""
        self._add_objective_rows(form, busiest)
        self.set_objective(form, busiest)

    @staticmethod
    def objective_rows_key(form: StepForm, busiest: int | None) -> tuple:
        """What the rows add_objective adds depend on ([Note: LP reuse] in ilp.py): two forms
        of one key differ in the objective's coefficients only."""
        several = len(form.shares) > 1
        frozen = form.sync_s_per_frozen_elem / form.sync_s_per_elem \
            if form.sync_s_per_elem else 0.0
        return (form.shares if several else len(form.shares), busiest,
                several and bool(form.sync_s_per_elem), frozen if several else None)

    def _add_objective_rows(self, form: StepForm, busiest: int | None) -> None:
        """The busiest-rank split's rows, or T and the stage rows, and E and the sync rows."""
        b = form.sync_s_per_elem * _NS
        # E counts trainable elements, a frozen one at B_f / B of one ([Note: step form])
        self.frozen_weight = form.sync_s_per_frozen_elem * _NS / b if b else 0.0
        if len(form.shares) == 1:
            return
        if busiest is not None:
            rank = form.shares[busiest]
            for r, other in enumerate(form.shares):
                if r != busiest:
                    self._at_least(rank, other, f"busiest[rank {busiest} >= {r}]",
                                   binding=False)
        else:
            big_t = self.bound_var(self._ceiling(form, elems=False), "T")
            self._objective_vars["T"] = big_t
            for r, rank in enumerate(form.shares):
                self._at_least(big_t, rank, f"stage[rank {r}]")
        if b:
            big_e = self.bound_var(self._ceiling(form, elems=True), "E")
            self._objective_vars["E"] = big_e
            for r, rank in enumerate(form.shares):
                self._at_least(big_e, rank, f"sync[rank {r}]", elems=True)

    def set_objective(self, form: StepForm, busiest: int | None = None) -> None:
        """The objective of `form` on the rows `_add_objective_rows` added for a form of the
        same `objective_rows_key` (the previous coefficients cleared)."""
        obj: dict = defaultdict(float, self.ties)
        a_c, a_m, b = form.compute_factor, form.comm_factor, form.sync_s_per_elem * _NS
        if len(form.shares) == 1 or busiest is not None:
            rank = form.shares[0 if busiest is None else busiest]
            self._add_terms(obj, rank, self.comp, a_c)
            self._add_terms(obj, rank, self.comm, a_m)
        else:
            obj[self._objective_vars["T"]] += a_m
        if len(form.shares) == 1:
            frozen = form.sync_s_per_frozen_elem * _NS / b if b else 0.0
            self._add_terms(obj, form.shares[0], self.elems, b)
            self._add_terms(obj, form.shares[0], self.frozen, b * frozen)
        elif b:
            obj[self._objective_vars["E"]] += b
        objective = self.s.Objective()
        objective.Clear()
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
        """(terms, constant) of sum_p s[r, p] (C_p + M_p), or of sum_p s[r, p] (P_p + w F_p),
        w = B_f / B (`frozen_weight`)."""
        row: dict = defaultdict(float)
        const = 0.0
        kinds = ((self.elems, self.elems_const, 1.0),) if elems else (
            (self.comp, self.comp_const, 1.0), (self.comm, self.comm_const, 1.0))
        if elems and self.frozen_weight:
            kinds += ((self.frozen, self.frozen_const, self.frozen_weight),)
        for part, share in rank:
            for terms, consts, weight in kinds:
                const += share * weight * consts[part]
                for v, c in terms[part].items():
                    row[v] += share * weight * c
        return row, const

    def _at_least(self, bound, rank, name: str, *, elems: bool = False,
                  binding: bool = True) -> None:
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
        self.constraint(terms, const - lconst, self.s.infinity(), name, binding=binding)

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

    def assignment(self, choice: dict[str, int]) -> dict | None:
        """Every variable's value for a placement (node -> candidate index, as
        Solution.choice): x and y from the choice, each bound variable (T, E, z) at the least
        value its rows allow. None when the choice is no placement of this model: a node
        without a valid index, an edge whose pair has no variable (not offered, or a getitem
        edge that changes placement)."""
        values: dict = {}
        for n, xs in self.x.items():
            i = choice.get(n)
            if i is None or not 0 <= i < len(xs):
                return None
            values.update((v, float(j == i)) for j, v in enumerate(xs) if v is not None)
        for edge, y in zip(self.p.edges, self.y):
            if y:
                key = edge_key(self.p, edge, choice)
                if key not in y:
                    return None
                values.update((v, float(k == key)) for k, v in y.items())
        for z, exprs in self.shared:
            values[z] = max(min(1.0, const + sum(c * values[v] for v, c in terms.items()))
                            for terms, const in exprs)
        least = dict.fromkeys(self.bounds, 0.0)
        for terms, lb, _ub, _name, _binding in self.rows:
            for b in self.bounds:
                if b in terms:  # b - row >= lb (the stage, sync and memory_max rows)
                    rest = sum(c * values[v] for v, c in terms.items() if v is not b)
                    least[b] = max(least[b], (lb - rest) / terms[b])
        values.update((b, float(math.ceil(v)) if self.integer else v) for b, v in least.items())
        return values

    def violated(self, values: dict) -> str:
        """The name of a binding constraint or variable bound that `values` (`assignment`)
        breaks, beyond a relative 1e-9; "" when it satisfies the model."""
        for v, value in values.items():
            if not v.lb() - 1e-9 <= value <= v.ub() + 1e-9:
                return f"{v.name()} = {value:g} outside [{v.lb():g}, {v.ub():g}]"
        for terms, lb, ub, name, binding in self.rows:
            if not binding:
                continue
            activity = sum(c * values[v] for v, c in terms.items())
            slack = 1e-9 * max(1.0, *(abs(b) for b in (lb, ub) if abs(b) < 1e300))
            if not lb - slack <= activity <= ub + slack:
                return f"{name}: {activity:g} outside [{lb:g}, {ub:g}]"
        return ""

    def hint(self, values: dict) -> None:
        """Give CP-SAT `values` (`assignment`) as its starting point."""
        self.s.SetHint(list(values), list(values.values()))


def structure_signature(problem: Problem, costs: Costs) -> tuple:
    """What a model's variables and rows depend on besides the problem ([Note: model
    templates]): the pairs each edge offers and which redistributions cost anything. Kept on
    `costs`, as its redistribution units are (a Costs is not changed after it is built)."""
    cached = costs.__dict__.get("_signature")
    if cached is not None and cached[0] is problem:
        return cached[1]
    signature = (tuple(frozenset(pairs) for pairs in costs.pairs),
                 tuple(bool(u.cost_s) for u in redistribution_units(problem, costs)))
    costs.__dict__["_signature"] = (problem, signature)
    return signature


@dataclass(frozen=True)
class _Template:
    """[Note: model templates] What add_structure did, by variable number (creation order):
    `ops` in order -- ("var", name), ("row", ((var, coef), ...), lb, ub, name, binding),
    ("ub0", var), ("comm", part, unit, var, coef or None for the unit's z), ("const", part,
    unit), ("shared", z, [(((var, coef), ...), const), ...]) -- then the duplicate check's
    keys, the infeasible constraint, and x and y by variable number."""

    ops: tuple
    seen: frozenset
    infeasible: str
    x: dict
    y: list


def _undominated(ranks: list[RankMemory]) -> list[tuple[int, RankMemory]]:
    """Ranks whose memory no other rank bounds from above coefficient by coefficient (all
    coefficients and element counts are >= 0, so a dominated rank's constraint is implied)."""
    def frozen(r: RankMemory) -> dict:
        return r.param_coef if r.frozen_coef is None else r.frozen_coef

    def vec(r: RankMemory) -> tuple:
        parts = sorted(set(r.param_coef) | set(r.act_coef))
        return tuple((r.param_coef.get(p, 0.0), r.act_coef.get(p, 0.0), frozen(r).get(p, 0.0))
                     for p in parts) + (r.boundary_coef, r.loss_coef)

    def leq(a: RankMemory, b: RankMemory) -> bool:
        parts = set(a.param_coef) | set(a.act_coef) | set(b.param_coef) | set(b.act_coef)
        return a.const_bytes <= b.const_bytes and a.boundary_coef <= b.boundary_coef and \
            a.loss_coef <= b.loss_coef and all(
            a.param_coef.get(p, 0.0) <= b.param_coef.get(p, 0.0)
            and frozen(a).get(p, 0.0) <= frozen(b).get(p, 0.0)
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


def edge_key(problem: Problem, edge, choice: dict[str, int]) -> tuple:
    """(p, q, split) that the choice puts on `edge`."""
    p = problem.cands[edge.src][choice[edge.src]].outputs[edge.out_index]
    if edge.dst == OUTPUT:
        return (p, "R", False)
    c = problem.cands[edge.dst][choice[edge.dst]]
    return (p, c.inputs[edge.arg_index], split_of(c))


def _build(problem, costs, integer, ranks, budget_bytes, objective, form, busiest,
           limit_s) -> _Model:
    model = _Model(problem, costs, integer, limit_s)
    model.add_structure()
    if objective == "memory":
        model.add_memory_objective(ranks or [])
    else:
        if ranks is not None:
            model.add_memory_constraint(ranks, budget_bytes)
        model.add_placement_costs()
        model.add_objective(form, busiest)
    return model
