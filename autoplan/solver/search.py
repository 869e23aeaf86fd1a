"""The outer search: mesh shape (pp, dp, tp), ZeRO stage, microbatches and schedule.

[Note: decomposition] The placement ILP (ilp.py) depends on the configuration only through tp
and the microbatch size b (its costs) and, when memory binds, through the memory coefficients.
So: (1) enumerate every valid configuration; (2) bound each one from below without an ILP
(every node at its cheapest candidate, no tp communication, parameters and activations at their
smallest split) -- `_lower_bound`; (3) visit configurations by increasing bound, solving the
time-optimal ILP once per (tp, b) (cached) and assessing the configuration analytically
(pipeline.py); a configuration whose time-optimal placement does not fit in memory gets the ILP
again with its per-rank memory constraints; (4) stop when the next bound is no better than the
(top_k + 1)-th best step time found. The result is the optimum of the cost model over all
configurations (up to CP-SAT's time limit, reported by Solution.optimal), the same answer as
exhaustive search with far fewer ILP solves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autoplan.cost_model.comm import group_layout
from autoplan.graph import CapturedGraph
from autoplan.plan import SCHEDULES
from autoplan.solver.costs import Costs, build_costs
from autoplan.solver.ilp import Solution, solve
from autoplan.solver.pipeline import Assessment, Config, assess, rank_memories
from autoplan.solver.problem import OUTPUT, Problem, build_problem
from autoplan.spec import TrainingSpec
from autoplan.strategies import StrategyCache
from autoplan.topology import Topology

__all__ = ["NoFeasiblePlan", "InvalidConfig", "Overrides", "Search", "enumerate_configs",
           "validate"]


class NoFeasiblePlan(ValueError):
    """No configuration fits in device memory; the message gives the smallest per-device memory
    any plan needs, the configuration that needs it and what the device has."""


class InvalidConfig(ValueError):
    """A user override that cannot work (numbers that do not divide, too many stages, ...)."""


@dataclass(frozen=True)
class Overrides:
    """User-fixed choices of `plan()` (None: searched)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    zero_stage: int | None = None
    num_microbatches: int | None = None
    schedule: str | None = None
    num_virtual_stages: int | None = None
    allow_tp_across_nodes: bool = False


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(graph: CapturedGraph, topology: Topology, spec: TrainingSpec, o: Overrides) -> None:
    """Reject overrides that cannot work, naming the numbers (InvalidConfig)."""
    world, layers = topology.world_size, graph.total_layers if graph.num_layers else 0
    for name in ("tp", "pp", "dp"):
        value = getattr(o, name)
        if value is not None and (value < 1 or world % value):
            raise InvalidConfig(f"{name} {value} does not divide the world size {world}")
    fixed = [v for v in (o.tp, o.pp, o.dp) if v is not None]
    prod = 1
    for v in fixed:
        prod *= v
    if world % prod or (len(fixed) == 3 and prod != world):
        raise InvalidConfig(f"tp {o.tp} x pp {o.pp} x dp {o.dp} does not fit world size {world}")
    if o.pp is not None and o.pp > max(layers, 1):
        raise InvalidConfig(f"pp {o.pp} is more than the model's {layers} layers")
    if o.tp is not None and o.tp > topology.devices_per_node and not o.allow_tp_across_nodes:
        raise InvalidConfig(f"tp {o.tp} spans nodes of {topology.devices_per_node} devices; "
                            "pass allow_tp_across_nodes=True to allow it")
    if o.zero_stage is not None and o.zero_stage not in (0, 1, 2, 3):
        raise InvalidConfig(f"zero_stage {o.zero_stage} is not one of 0, 1, 2, 3")
    if o.schedule is not None and o.schedule not in SCHEDULES:
        raise InvalidConfig(f"schedule {o.schedule!r} is not one of {SCHEDULES}")
    v = o.num_virtual_stages or 1
    if v > 1 and o.schedule not in (None, "interleaved-1f1b"):
        raise InvalidConfig(f"num_virtual_stages {v} needs schedule 'interleaved-1f1b'")
    if o.pp is not None and o.pp * v > max(layers, 1):
        raise InvalidConfig(f"pp {o.pp} x num_virtual_stages {v} = {o.pp * v} stages is more "
                            f"than the model's {layers} layers")
    if o.num_microbatches is not None:
        _check_microbatches(spec, o, world)


def _check_microbatches(spec: TrainingSpec, o: Overrides, world: int) -> None:
    m, b = o.num_microbatches, spec.global_batch
    if m < 1:
        raise InvalidConfig(f"num_microbatches {m} must be >= 1")
    if o.dp is not None:
        dps = [o.dp]
    else:
        rest = world // ((o.tp or 1) * (o.pp or 1))
        dps = [d for d in _divisors(rest)
               if (o.tp is None or o.pp is None or d == rest)] or [rest]
    if not any(b % (d * m) == 0 for d in dps):
        d = dps[0] if len(dps) == 1 else min(dps)
        raise InvalidConfig(f"global_batch {b} is not divisible by dp {d} x num_microbatches {m}"
                            + ("" if len(dps) == 1 else f" (nor by any dp in {dps} x {m})"))


def enumerate_configs(graph: CapturedGraph, topology: Topology, spec: TrainingSpec,
                      o: Overrides) -> list[Config]:
    """Every configuration the overrides allow ([Note: decomposition], step 1)."""
    world, layers = topology.world_size, graph.total_layers if graph.num_layers else 0
    out = []
    for tp in _divisors(world):
        if (o.tp is not None and tp != o.tp) or (
                tp > topology.devices_per_node and not o.allow_tp_across_nodes):
            continue
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            if (o.pp is not None and pp != o.pp) or (o.dp is not None and dp != o.dp):
                continue
            if pp > max(layers, 1) or not _layout_ok(tp, dp, pp, topology):
                continue
            out += _configs_for_mesh(pp, dp, tp, layers, spec, o)
    return out


def _layout_ok(tp: int, dp: int, pp: int, topology: Topology) -> bool:
    try:
        group_layout(tp, 1, topology)
        group_layout(dp, tp, topology)
        group_layout(pp, tp * dp, topology)
    except ValueError:
        return False
    return True


def _configs_for_mesh(pp, dp, tp, layers, spec, o: Overrides) -> list[Config]:
    if spec.global_batch % dp:
        return []
    zeros = [o.zero_stage] if o.zero_stage is not None else ([0, 1, 2, 3] if dp > 1 else [0])
    ms = [m for m in _divisors(spec.global_batch // dp)
          if o.num_microbatches is None or m == o.num_microbatches]
    if pp > 1 and o.num_microbatches is None and any(m >= pp for m in ms):
        ms = [m for m in ms if m >= pp]  # fewer microbatches than stages: mostly bubble
    if pp == 1:
        schedules = [(o.schedule or "1f1b", 1)] if o.schedule != "interleaved-1f1b" else []
    else:
        schedules = [(s, 1) for s in ("gpipe", "1f1b") if o.schedule in (None, s)]
        vs = [o.num_virtual_stages] if o.num_virtual_stages else [2]
        if o.schedule in (None, "interleaved-1f1b"):
            schedules += [("interleaved-1f1b", v) for v in vs if v > 1 and pp * v <= layers]
    out = []
    for zero in zeros:
        for m in ms:
            for sched, v in schedules:
                if sched == "interleaved-1f1b" and m % pp:
                    continue  # the interleaved schedule runs microbatches in rounds of pp
                out.append(Config(pp, dp, tp, zero, m, spec.global_batch // (dp * m), sched, v))
    return out


@dataclass
class Search:
    """State of one planning run: problems per tp, costs and solutions per (tp, b)."""

    graph: CapturedGraph
    topology: Topology
    spec: TrainingSpec
    time_limit_s: float
    cache: StrategyCache = field(default_factory=StrategyCache)
    problems: dict[int, Problem] = field(default_factory=dict)
    costs: dict[tuple, Costs] = field(default_factory=dict)
    solutions: dict[tuple, Solution | None] = field(default_factory=dict)
    bounds: dict[tuple, Solution] = field(default_factory=dict)

    @property
    def total_layers(self) -> int:
        return self.graph.total_layers if self.graph.num_layers else 0

    def problem(self, tp: int) -> Problem:
        if tp not in self.problems:
            self.problems[tp] = build_problem(self.graph, tp, self.spec.dtype_bytes,
                                              cache=self.cache)
        return self.problems[tp]

    def cost(self, tp: int, b: int) -> Costs:
        if (tp, b) not in self.costs:
            self.costs[(tp, b)] = build_costs(self.problem(tp), b, self.spec, self.topology)
        return self.costs[(tp, b)]

    def solution(self, tp: int, b: int, cfg: Config | None = None) -> Solution | None:
        """Time-optimal placement; with `cfg`, under its per-rank memory constraints."""
        prob, costs = self.problem(tp), self.cost(tp, b)
        ranks = None if cfg is None else rank_memories(
            cfg, self.spec, self.total_layers, costs.output_bytes)
        # configurations with the same memory coefficients share the constrained ILP
        key = (tp, b) if cfg is None else (tp, b, _signature(ranks))
        if key not in self.solutions:
            budget = self.spec.max_memory_fraction * self.topology.device.mem_bytes
            self.solutions[key] = solve(prob, costs, ranks=ranks, budget_bytes=budget,
                                        time_limit_s=self.time_limit_s)
        return self.solutions[key]

    def boundary_bytes(self, tp: int, b: int) -> float:
        prob, costs = self.problem(tp), self.cost(tp, b)
        sizes = [e.nbytes for e in prob.edges
                 if prob.part.get(e.src) == "layer" and (e.dst == OUTPUT or
                                                         prob.part.get(e.dst) != "layer")]
        return max(sizes, default=costs.output_bytes) * costs.scale

    def assess(self, cfg: Config, sol: Solution) -> Assessment:
        costs = self.cost(cfg.tp, cfg.microbatch_size)
        return assess(cfg, sol, self.spec, self.topology, total_layers=self.total_layers,
                      output_bytes=costs.output_bytes,
                      boundary_bytes=self.boundary_bytes(cfg.tp, cfg.microbatch_size))

    def memory_bound(self, cfg: Config) -> Assessment:
        """An Assessment whose memory no placement at this (tp, b) can beat: every node and
        parameter at its smallest candidate (exact costs of this tp, not divided)."""
        key = ("memory", cfg.tp, cfg.microbatch_size)
        if key not in self.bounds:
            self.bounds[key] = _lower_bound(self.problem(cfg.tp),
                                            self.cost(cfg.tp, cfg.microbatch_size), 1)
        return self.assess(cfg, self.bounds[key])

    def lower_bound(self, cfg: Config) -> Assessment:
        """[Note: decomposition] step 2: an Assessment no exact one can beat, from the tp = 1
        problem (no strategies needed) with compute, parameters and activations divided by tp:
        a split op takes at least 1/tp of the replicated time (the roofline's efficiency only
        drops on smaller shapes), a split tensor holds exactly 1/tp."""
        key = (cfg.tp, cfg.microbatch_size)
        if key not in self.bounds:
            self.bounds[key] = _lower_bound(self.problem(1), self.cost(1, cfg.microbatch_size),
                                            cfg.tp)
        sol = self.bounds[key]
        return assess(cfg, sol, self.spec, self.topology, total_layers=self.total_layers,
                      output_bytes=self.cost(1, cfg.microbatch_size).output_bytes,
                      boundary_bytes=self.boundary_bytes(1, cfg.microbatch_size) / cfg.tp)


def _signature(ranks) -> tuple:
    """Per-rank memory coefficients rounded to 6 significant digits (a cache key)."""
    r6 = lambda v: float(f"{v:.6g}")  # noqa: E731
    return tuple((tuple(sorted((k, r6(v)) for k, v in r.param_coef.items())),
                  tuple(sorted((k, r6(v)) for k, v in r.act_coef.items())), r6(r.const_bytes))
                 for r in ranks)


def _lower_bound(prob: Problem, costs: Costs, tp: int) -> Solution:
    sol = Solution({}, optimal=False)
    add = lambda d, k, v: d.__setitem__(k, d.get(k, 0.0) + v)  # noqa: E731
    for n, row in costs.compute_s.items():
        add(sol.compute_s, prob.part[n], prob.weight[n] * min(row) / tp)
    for g, elems in costs.param_elems.items():
        for part in prob.params[g][2]:
            add(sol.param_elems, part, min(elems) / tp)
    for n, row in costs.act_bytes.items():
        add(sol.act_bytes, prob.part.get(n, "pre") if n is not None else "pre", min(row) / tp)
    return sol
