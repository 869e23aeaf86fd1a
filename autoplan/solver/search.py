"""The outer search over the configurations of configurations.py (mesh shape (pp, dp, cp,
tp), ZeRO stage, microbatches, schedule, activation checkpointing, offload): their costs,
bounds, step forms and placement ILPs, shared where they agree (cp: [Note: context
parallelism] in cost_model/context_parallel.py; the placement ILP
depends on it through its costs, so (tp, b, policy) below is (tp, b, policy, cp) where cp > 1).

[Note: decomposition] The placement ILP (ilp.py) of a configuration depends on it through tp,
the microbatch size b and the checkpointing policy (its costs, [Note: checkpointing] in
checkpointing.py), through its step form (how cost_model/step_time.py turns per-part totals
into a step time: microbatches and bubble, the pipeline ranks' shares, the data-parallel sync and optimizer
per parameter, [Note: step form] in ilp.py) and, when memory binds, through its memory forms.
So: (1) enumerate every valid configuration; (2) bound each one from below without an ILP
(every node at its cheapest candidate, no tp communication, parameters and activations at their
smallest split) -- `_lower_bound`; (3) visit configurations by increasing bound (planner.py):
the time-optimal placement of one microbatch, solved once per (tp, b, policy) and shared, is
the optimum of every configuration whose step form orders placements alike (pp = 1, nothing
per parameter: `same_argmin`), and otherwise a feasible plan and a tighter bound
(`Search.refined_bound`); then the LP relaxation of the configuration's own step-time ILP
certifies an optimum or tightens the bound again; then CP-SAT solves that ILP; a configuration
whose optimum does not fit in memory gets its ILP again with its per-rank memory constraints;
(4) stop when the next bound is no better than the best step time found. The result is the
optimum of the cost model over all configurations and placements, up to the ILP's tie-breaks
(1 ns per ILP node) and the relative gap 1e-7 (and CP-SAT's deterministic limit, reported by
Solution.optimal; a configuration whose ILP found no placement within it is skipped with a
`SolverLimitWarning`, [Note: deterministic limits] in ilp_types.py): the same answer as
exhaustive search (tests/test_planner_scale.py checks it on random problems), with far fewer ILP
solves.

An ep > 1 configuration (expert parallelism, [Note: expert parallelism] in
cost_model/expert_parallel.py) is a configuration like the others, searched jointly: ep
changes no placement, and what it adds to the step time (the all-to-alls, the experts' dp
sync and compute) does not depend on the placement, so its ILPs are those of its ep = 1
configuration (the step form's constant differs, not its argmin) and its bounds that one's
plus ep's terms; its memory is priced with the expert slices held whole (`assess`). At tp > 1
the runtime runs ep only with the experts split on tp (Shard(0)): a placement that does not
split them is no placement of the ep configuration (`solution`). Not joint: the memory forms
of its memory-constrained ILP are the ep = 1 configuration's (the placement then found is
assessed with ep, as every one is).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autoplan.cost_model.config import Config, config_stages
from autoplan.cost_model.expert_parallel import with_expert_parallel
from autoplan.cost_model.placement_totals import RankMemory, Solution
from autoplan.cost_model.rank_memory import (ExpertSlices, memory_floor_bytes, rank_memories,
                                             rank_peaks)
from autoplan.cost_model.step_time import Assessment, assess, pipeline_time_s
from autoplan.graph import CapturedGraph
from autoplan.solver import checkpointing as ckpt
from autoplan.solver import float8, pins, sequence
from autoplan.solver.configurations import PlanConfig
from autoplan.solver.context import with_context_parallel
from autoplan.solver.expert_degree import ExpertSearch
from autoplan.solver.costs import Costs, build_costs, token_scale
from autoplan.solver.ilp import TIME_FORM, SolverLimitReached, StepForm, relax, solve
from autoplan.solver.ilp_types import form_signature, memory_signature, same_argmin
from autoplan.solver.problem import OUTPUT, Problem, build_problem
from autoplan.spec import TrainingSpec
from autoplan.strategies import StrategyCache
from autoplan.topology import Topology

__all__ = ["Search", "output_bytes"]


@dataclass
class Search(ExpertSearch):
    """State of one planning run: problems per tp, costs and solutions per (tp, b, policy,
    cp) (PlanConfig.costs_key; cp is left out of the text below where it is 1).

    Attributes:
        time_limit_s: the limit of every GLOP and CP-SAT call, deterministic seconds, never
            wall-clock ([Note: deterministic limits] in ilp_types.py).
        solutions: ILP cache key -> placement, None when no placement satisfies that ILP.
        stopped: ILP cache key -> the SolverLimitReached of an ILP that found no placement
            within the limit (raised again, naming the configuration, on every request).
        skipped: configuration -> the SolverLimitReached for which the planner skipped it.
        scaled: (tp, token scale) -> build_costs at that scale ([Note: costs per token
            scale]).
    """

    graph: CapturedGraph
    topology: Topology
    spec: TrainingSpec
    time_limit_s: float
    sequence_parallel: bool | None = None
    cache: StrategyCache = field(default_factory=StrategyCache)
    # canonical FQN -> (placement, pattern) of the pinned parameters (solver/pins.py)
    pinned: dict = field(default_factory=dict)
    problems: dict[int, Problem] = field(default_factory=dict)
    costs: dict[tuple, Costs] = field(default_factory=dict)
    scaled: dict[tuple, Costs] = field(default_factory=dict)
    solutions: dict[tuple, Solution | None] = field(default_factory=dict)
    bounds: dict[tuple, Solution] = field(default_factory=dict)
    stopped: dict[tuple, SolverLimitReached] = field(default_factory=dict)
    skipped: dict[PlanConfig, SolverLimitReached] = field(default_factory=dict)

    @property
    def total_layers(self) -> int:
        return self.graph.total_layers if self.graph.num_layers else 0

    @property
    def budget_bytes(self) -> float:
        return self.spec.max_memory_fraction * self.topology.device.mem_bytes

    def policies(self) -> tuple[str, ...]:
        """Checkpointing policies worth searching for this graph (checkpointing.policies)."""
        return ckpt.policies(self.problem(1))

    def problem(self, tp: int) -> Problem:
        if tp not in self.problems:
            prob = build_problem(self.graph, tp, self.spec.dtype_bytes, cache=self.cache)
            if self.sequence_parallel is not None:
                sequence.restrict(prob, self.sequence_parallel)
            pins.restrict(prob, self.pinned)
            if self.spec.float8 == "on" and not self.spec.float8_only:  # FP8 placements
                float8.restrict(prob)
            self.problems[tp] = prob
        return self.problems[tp]

    def cost(self, tp: int, b: int, policy: str = "none", cp: int = 1,
             stride: int | None = None) -> Costs:
        """The ILP coefficients of (tp, b, policy, cp): build_costs at the token scale of one
        cp rank, the cp collectives ([Note: context parallelism] in cost_model/context_parallel.py),
        then the recomputation of the policy. `stride`: the cp group's in the mesh, tp unless given
        (a bound's tp = 1 problem stands for a configuration of tp = stride)."""
        stride = tp if stride is None or cp == 1 else stride
        key = (tp, b, policy, cp) + ((stride,) if stride != tp else ())
        if key not in self.costs:
            if policy == "none":
                prob = self.problem(tp)
                # [Note: costs per token scale] build_costs depends on (b, cp) only through
                # the tokens one cp rank holds, b seq_len / cp (costs.token_scale): (b, cp)
                # = (1, 8), (2, 16) and (4, 32) share one build (a quarter of a cp > 1
                # search's cost tables at 8K tokens); the cp collectives differ, and are
                # added to a copy (with_context_parallel replaces the rows it changes).
                scale = (tp, token_scale(prob, b, self.spec.seq_len, cp))
                if scale not in self.scaled:
                    self.scaled[scale] = build_costs(prob, b, self.spec, self.topology, cp)
                self.costs[key] = with_context_parallel(prob, self.scaled[scale], cp,
                                                        self.topology, stride)
            else:
                self.costs[key] = ckpt.checkpointed_costs(
                    self.problem(tp), self.cost(tp, b, "none", cp, stride), policy, self.spec,
                    self.topology)
        return self.costs[key]

    def ranks(self, cfg: PlanConfig, tp: int | None = None) -> list[RankMemory]:
        """Per-rank memory forms of `cfg` for the ILP (tp: of another problem, for bounds)."""
        tp = cfg.tp if tp is None else tp
        costs = self.cost(tp, cfg.microbatch_size, cfg.checkpointing, cfg.cp)
        boundary = self.boundary_bytes(tp, cfg.microbatch_size, cfg.cp)
        ranks = rank_memories(cfg, self.spec, self.total_layers, output_bytes(cfg, costs),
                              offload=cfg.offload, frozen=bool(self.problem(tp).frozen),
                              experts=self.expert_slices(cfg))
        return ckpt.checkpointed_ranks(ranks, cfg.checkpointing, self.total_layers, boundary,
                                       ckpt.block_bytes(self.problem(tp), costs,
                                                        cfg.checkpointing))

    def solution(self, cfg: PlanConfig, *, exact: bool = False,
                 constrained: bool = False) -> Solution | None:
        """A placement for cfg: by default the time-optimal one of its (tp, b, policy),
        shared by every configuration of those; `exact`: the one minimising cfg's own step
        time ([Note: step form]); `constrained`: that under cfg's per-rank memory constraints
        (None when nothing fits). Each ILP after the first of a (tp, b, policy) starts from
        that one's placement.

        Raises SolverLimitReached (naming cfg) when the ILP found no placement within the
        limit."""
        key, form, ranks = self._key(cfg, exact, constrained)
        if key not in self.solutions and key not in self.stopped:
            tp = cfg.tp
            self._solve(key, lambda: solve(
                self.problem(tp), self.cost(*cfg.costs_key), form=form, ranks=ranks,
                budget_bytes=self.budget_bytes, start=self._start(cfg),
                time_limit_s=self.time_limit_s), self.solutions)
        return self.for_ep(cfg, self._cached(key, cfg, self.solutions))

    @property
    def num_solves(self) -> int:
        """ILPs solved so far (those stopped at their limit included)."""
        return len(self.solutions) + len(self.stopped)

    def _start(self, cfg: PlanConfig) -> dict[str, int] | None:
        """The time-optimal placement of cfg's (tp, b, policy), when solved: a start for its
        other ILPs (ilp.solve's `start`)."""
        sol = self.solutions.get(cfg.costs_key)
        return None if sol is None else sol.choice

    def _solve(self, key: tuple, run, into: dict) -> None:
        try:
            into[key] = run()
        except SolverLimitReached as e:
            self.stopped[key] = e

    def _cached(self, key: tuple, cfg: PlanConfig, table: dict):
        if key in self.stopped:
            e = self.stopped[key]
            raise SolverLimitReached(e.ilp, e.limit_s, str(cfg))
        return table[key]

    def relaxation(self, cfg: PlanConfig) -> tuple[float, Solution | None]:
        """ilp.relax of cfg's own step-time ILP: (its LP bound, a certified optimum or None);
        a certified optimum is also recorded as cfg's exact solution."""
        key, form, _ranks = self._key(cfg, True, False)
        relax_key = ("relax",) + key
        if relax_key not in self.bounds:
            self.bounds[relax_key] = relax(self.problem(cfg.tp), self.cost(*cfg.costs_key),
                                           form=form, time_limit_s=self.time_limit_s)
            certified = self.bounds[relax_key][1]
            if certified is not None:
                self.solutions.setdefault(key, certified)
        return self.bounds[relax_key]

    def solved(self, cfg: PlanConfig, *, exact: bool = False) -> bool:
        """True when `solution(cfg, exact=exact)` needs no new ILP."""
        return self._key(cfg, exact, False)[0] in self.solutions

    def _key(self, cfg: PlanConfig, exact: bool, constrained: bool) -> tuple:
        """(cache key, form, ranks) of a `solution` call."""
        form = self.step_form(cfg) if exact or constrained else TIME_FORM
        if not constrained and same_argmin(form):
            form = TIME_FORM
        ranks = self.ranks(cfg) if constrained else None
        # configurations with the same form (and memory coefficients) share the ILP
        key = cfg.costs_key if form is TIME_FORM and ranks is None else (
            cfg.costs_key + (form_signature(form), ranks and memory_signature(ranks)))
        return key, form, ranks

    def smallest(self, cfg: PlanConfig) -> Solution | None:
        """The placement of least peak memory for cfg (the ILP's memory objective), None when
        no placement exists. Raises SolverLimitReached like `solution`."""
        key = ("smallest", cfg)
        if key not in self.bounds and key not in self.stopped:
            self._solve(key, lambda: solve(
                self.problem(cfg.tp), self.cost(*cfg.costs_key),
                ranks=self.ranks(cfg), objective="memory", start=self._start(cfg),
                time_limit_s=self.time_limit_s), self.bounds)
        return self.for_ep(cfg, self._cached(key, cfg, self.bounds))

    def step_form(self, cfg: PlanConfig) -> StepForm:
        """[Note: step form] of cfg (ilp.py): step_time.assess as an affine function of the
        per-part totals. The shares follow config.py's stages (`config_stages`, stage i on rank
        i % pp); the factors and the constant are read off step_time.assess itself, from a zero
        placement and unit totals on the first rank, so they follow its formulas
        (tests/test_planner_scale.py checks the form against assess on random placements)."""
        key = ("form", cfg)
        if key not in self.bounds:
            # the pipeline transfers at the smallest boundary a placement can send (a tp-th
            # under sequence parallelism): the constant stays a lower bound; the ILP does not
            # see the transfers' difference between placements (priced by assess)
            rows = self.cost(*cfg.costs_key).boundary_bytes.values()
            least = min((min(row) for row in rows), default=None)

            def probe(**totals) -> float:
                return self.assess(cfg, Solution({}, boundary_bytes=least,
                                                 **totals)).step_time_s
            zero, elems = probe(), 1e9
            # a frozen element: no gradient, no optimizer state ([Note: frozen pricing])
            frozen = (probe(param_elems={"pre": elems}, frozen_elems={"pre": elems}) - zero
                      ) / elems if self.problem(cfg.tp).frozen else 0.0
            self.bounds[key] = StepForm(
                probe(compute_s={"pre": 1.0}) - zero, probe(comm_s={"pre": 1.0}) - zero,
                _rank_shares(cfg, self.total_layers),
                (probe(param_elems={"pre": elems}) - zero) / elems, zero, frozen)
        return self.bounds[key]

    def refined_bound(self, cfg: PlanConfig, sol: Solution) -> float:
        """A step time no placement of cfg beats, given the time-optimal placement `sol` of
        its (tp, b, policy) (total time X* per microbatch). The busiest rank carries at least
        the average, X* / pp (every part's shares sum to 1 over the ranks), and at least its
        own parts' cheapest compute; the sync at least the smallest parameter split."""
        form = self.step_form(cfg)
        mins = self._cheapest(cfg)
        slack = len(self.problem(cfg.tp).nodes) * 1e-9  # the ILP's tie-breaks ([Note: step form])
        average = (sol.objective_s - slack) / cfg.pp if sol.optimal else 0.0
        own = max(sum(s * mins.compute_s.get(p, 0.0) for p, s in rank) for rank in form.shares)
        factor = min(form.compute_factor, form.comm_factor)
        return factor * max(average, own) + form.sync_s(mins) + form.const_s

    def _cheapest(self, cfg: PlanConfig) -> Solution:
        key = ("memory",) + cfg.costs_key
        if key not in self.bounds:
            self.bounds[key] = _lower_bound(self.problem(cfg.tp), self.cost(*cfg.costs_key), 1)
        return self.bounds[key]

    def boundary_bytes(self, tp: int, b: int, cp: int = 1, stride: int | None = None) -> float:
        """Bytes of the residual stream between blocks, one microbatch (global; on one cp
        rank: seq_len / cp tokens). `stride`: as `cost`'s."""
        costs = self.cost(tp, b, "none", cp, stride)
        key = ("boundary", tp)
        if key not in self.bounds:  # the largest block-output edge of the tp problem
            prob = self.problem(tp)
            self.bounds[key] = max((e.nbytes for e in prob.edges
                                    if prob.part.get(e.src) == "layer" and (
                                        e.dst == OUTPUT or prob.part.get(e.dst) != "layer")),
                                   default=None)
        size = self.bounds[key]
        return (costs.output_bytes if size is None else size) * costs.scale

    def assess(self, cfg: PlanConfig, sol: Solution, *, tp: int | None = None,
               divide: int = 1, memory: bool = True) -> Assessment:
        """step_time.assess of `cfg` with placement `sol` under cfg's checkpointing policy.
        (tp, divide): for bounds, quantities of the tp problem with the boundary divided;
        `memory` False: the step time alone (step_time.assess')."""
        tp = cfg.tp if tp is None else tp
        costs, boundary, seen, transient = self._seen(cfg, sol, tp, divide)
        slices = self.expert_slices(cfg)
        a = assess(cfg, seen, self.spec, self.topology, total_layers=self.total_layers,
                   output_bytes=output_bytes(cfg, costs), boundary_bytes=boundary / divide,
                   param_tensors=self.problem(tp).param_tensors, offload=cfg.offload,
                   transient_bytes=transient, experts=slices, memory=memory)
        return a if slices is None else with_expert_parallel(a, self.ep_delta(cfg))

    def rank_peaks(self, a: Assessment,
                   experts: ExpertSlices | None = None) -> list[dict[str, float]]:
        """rank_memory.rank_peaks of the assessed configuration `a` (from `assess`: its
        Solution as the checkpointing policy leaves it, and the policy's transient, as
        `assess` prices them): per pp rank, bytes by category and "peak".
        `experts`: the expert slices of an ep > 1 plan (rank_memory.ExpertSlices), by default
        as its configuration holds them (`expert_slices`)."""
        cfg = a.config
        experts = self.expert_slices(cfg) if experts is None else experts
        costs = self.cost(cfg.tp, cfg.microbatch_size, cfg.checkpointing, cfg.cp, cfg.tp)
        boundary = self.boundary_bytes(cfg.tp, cfg.microbatch_size, cfg.cp, cfg.tp)
        return rank_peaks(cfg, a.solution, self.spec, total_layers=self.total_layers,
                          output_bytes=output_bytes(cfg, costs), boundary_bytes=boundary,
                          offload=cfg.offload, experts=experts,
                          transient_bytes=a.transient_bytes)

    def _seen(self, cfg: PlanConfig, sol: Solution, tp: int, divide: int) -> tuple:
        """(costs, boundary bytes, the Solution step_time.assess sees, transient bytes) of
        `assess`."""
        b, policy = cfg.microbatch_size, cfg.checkpointing
        costs = self.cost(tp, b, policy, cfg.cp, cfg.tp)  # cfg's cp group: at stride cfg.tp
        boundary = self.boundary_bytes(tp, b, cfg.cp, cfg.tp)
        # core-attention at a bound (tp = 1 problem, no choice): the cores split tp ways
        one_block = ckpt.block_bytes(self.problem(tp), costs, policy, sol.choice or None) / (
            divide if policy == "core-attention" else 1)
        seen, transient = ckpt.checkpointed_solution(
            sol, policy, self.total_layers, boundary, one_block)
        return costs, boundary, seen, transient

    def pipeline_bound(self, cfg: PlanConfig) -> float:
        """A step time `lower_bound(cfg)` never goes below, at a fraction of its cost: the
        pipeline term alone (step_time.pipeline_time_s) of the bound's placement. It is the
        same for every ZeRO stage and offload of cfg's mesh, (b, policy), microbatches and
        schedule, so it is computed once for them (branch_bound.py: [Note: lazy bounds]).
        Under ep > 1, plus what ep adds to the pipeline term, the all-to-alls and the experts'
        compute (`ep_delta`), for every ZeRO stage alike. Not the dp sync's change, although it
        may be negative: it never takes more than the exposed dp sync of the ep = 1
        configuration, which a lower bound adds to the pipeline term (that sync is priced on
        the busiest pipeline rank's elements, at least the mean ep_step_delta_s' `before` is
        priced on, and dp_sync_s grows with the elements), so the bound stays below
        `lower_bound`."""
        if cfg.ep > 1 and self.moe is not None:
            key = ("pipeline-ep", cfg.ep, cfg.costs_key, cfg.pp, cfg.dp,
                   cfg.num_microbatches, cfg.schedule, cfg.num_virtual_stages)
            if key not in self.bounds:
                a2a_s, _sync_s, compute_s = self.ep_delta(replace(cfg, zero_stage=0))
                self.bounds[key] = self.pipeline_bound(replace(cfg, ep=1)) + a2a_s + compute_s
            return self.bounds[key]
        key = ("pipeline", cfg.costs_key, cfg.pp, cfg.dp, cfg.num_microbatches, cfg.schedule,
               cfg.num_virtual_stages)
        if key not in self.bounds:
            _costs, boundary, seen, _transient = self._seen(cfg, self._lower_solution(cfg), 1,
                                                            cfg.tp)
            self.bounds[key] = pipeline_time_s(cfg, seen, self.topology,
                                               total_layers=self.total_layers,
                                               boundary_bytes=boundary / cfg.tp)
        return self.bounds[key]

    def memory_bound(self, cfg: PlanConfig) -> Assessment:
        """An Assessment whose memory no placement at this (tp, b, policy) can beat: every
        node and parameter at its smallest candidate (exact costs of this tp, not divided)."""
        return self.assess(cfg, self._cheapest(cfg))

    def lower_bound(self, cfg: PlanConfig) -> Assessment:
        """[Note: decomposition] step 2: an Assessment no exact one can beat, from the tp = 1
        problem (no strategies needed) with compute, parameters and activations divided by tp:
        a split op takes at least 1/tp of the replicated time (the roofline's efficiency only
        drops on smaller shapes), a split tensor holds exactly 1/tp. Under "full" checkpointing
        a block's saved input is priced replicated at every tp, so it is not divided."""
        # kept per configuration: the planner asks again for the offload variants' sake
        if ("lower", cfg) not in self.bounds:
            self.bounds[("lower", cfg)] = self.assess(cfg, self._lower_solution(cfg), tp=1,
                                                      divide=cfg.tp)
        return self.bounds[("lower", cfg)]

    def time_bound(self, cfg: PlanConfig) -> float:
        """`lower_bound(cfg).step_time_s`, the same float, without pricing memory ([Note: time
        first] in branch_bound.py), seconds."""
        if ("lower", cfg) in self.bounds:
            return self.bounds[("lower", cfg)].step_time_s
        key = ("time", cfg)
        if key not in self.bounds:
            self.bounds[key] = self.assess(cfg, self._lower_solution(cfg), tp=1,
                                           divide=cfg.tp, memory=False).step_time_s
        return self.bounds[key]

    def over_budget(self, cfg: PlanConfig) -> bool:
        """Whether `lower_bound(cfg)` is shown not to fit by its memory floor (`floor_bytes`)
        over the budget, beyond a relative 1e-9 for the sums' order: True only where
        lower_bound's `fits` is False, at a fraction of its price ([Note: time first] in
        branch_bound.py)."""
        return ("lower", cfg) not in self.bounds and \
            self.floor_bytes(cfg) > self.budget_bytes * (1 + 1e-9)

    def floor_bytes(self, cfg: PlanConfig) -> float:
        """rank_memory.memory_floor_bytes at `lower_bound(cfg)`'s placement, bytes: no more
        than its memory."""
        key = ("floor", cfg)
        if key not in self.bounds:
            _costs, _boundary, seen, _transient = self._seen(cfg, self._lower_solution(cfg), 1,
                                                             cfg.tp)
            self.bounds[key] = memory_floor_bytes(
                cfg, seen, self.spec, total_layers=self.total_layers, offload=cfg.offload,
                experts=self.expert_slices(cfg))
        return self.bounds[key]

    def _lower_solution(self, cfg: PlanConfig) -> Solution:
        """`lower_bound`'s placement totals: of the tp = 1 problem, divided by cfg.tp."""
        key = cfg.costs_key
        if key not in self.bounds:
            self.bounds[key] = _lower_bound(
                self.problem(1), self.cost(1, cfg.microbatch_size, cfg.checkpointing, cfg.cp,
                                           cfg.tp),
                cfg.tp)
        return self.bounds[key]


def output_bytes(cfg: Config, costs) -> float:
    """What the last pipeline rank holds after its forward for the loss, one microbatch,
    bytes: the loss's working set ([Note: loss working set] in cost_model/memory.py) and the
    logits themselves while the runtime holds them -- a pipeline stage keeps its output until
    the microbatch's backward (GPipe's last stage all m microbatches'); without pipelining the runtime drops them before the backward
    unless the model computed its own loss (then `costs.loss_bytes` is 0 and the logits are
    counted as before). Without pipelining a loss priced per candidate (`costs.loss_rows`:
    the vocab-parallel cross-entropy) is the placement's, not this constant: RankMemory.
    loss_coef and Solution.loss_bytes carry it."""
    held = costs.output_bytes if cfg.pp > 1 or not costs.loss_bytes else 0.0
    if cfg.pp > 1 and cfg.schedule == "gpipe":
        # every microbatch's logits at once: GPipe's last stage runs all m forwards before
        # the first backward (the 1F1B schedules, interleaved too, hold one at their peak)
        held *= cfg.num_microbatches
    per_candidate = cfg.pp == 1 and costs.loss_rows
    return held + (0.0 if per_candidate else costs.loss_bytes)


def _rank_shares(cfg: Config, total_layers: int) -> tuple:
    """Each pipeline rank's share of the parts (config.py's stages), ranks that another
    rank bounds part by part left out: ((part, share), ...) per rank."""
    layers = [0] * cfg.pp
    for st in config_stages(cfg, total_layers):
        layers[st.index % cfg.pp] += st.num_layers
    ranks = [{"pre": float(r == 0), "layer": layers[r] / total_layers if total_layers else 1.0,
              "post": float(r == cfg.pp - 1)} for r in range(cfg.pp)]
    kept: list[dict] = []
    for r in ranks:
        if r in kept or any(all(r[p] <= o[p] for p in r) for o in ranks if o != r):
            continue
        kept.append(r)
    return tuple(tuple((p, v) for p, v in r.items() if v) for r in kept)


def _lower_bound(prob: Problem, costs: Costs, tp: int) -> Solution:
    sol = Solution({}, optimal=False)
    add = lambda d, k, v: d.__setitem__(k, d.get(k, 0.0) + v)  # noqa: E731
    for n, row in costs.compute_s.items():
        add(sol.compute_s, prob.part[n], prob.weight[n] * min(row) / tp)
    for n, row in costs.node_comm_s.items():  # the K/V gathers of cp: at most tp-way split
        add(sol.comm_s, prob.part[n], prob.weight[n] * min(f + b for f, b in row) / tp)
        add(sol.cp_comm_s, prob.part[n], prob.weight[n] * min(f + b for f, b in row) / tp)
    for g, elems in costs.param_elems.items():
        sol.add_param_elems(prob.params[g][2], min(elems) / tp, frozen=g in prob.frozen)
    for n, row in costs.act_bytes.items():
        add(sol.act_bytes, prob.part.get(n, "pre") if n is not None else "pre", min(row) / tp)
    for row in costs.boundary_bytes.values():
        sol.boundary_bytes = min(row) / tp
    for row in costs.loss_rows.values():
        sol.loss_bytes = min(row) / tp
    return sol
