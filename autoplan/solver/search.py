"""The outer search: mesh shape (pp, dp, cp, tp), ZeRO stage, microbatches, schedule and
activation checkpointing (cp: [Note: context parallelism] in context.py; the placement ILP
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
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autoplan.cost_model import offload
from autoplan.cost_model.comm import group_layout
from autoplan.cost_model.config import Config, config_stages
from autoplan.cost_model.placement_totals import RankMemory, Solution
from autoplan.cost_model.rank_memory import rank_memories, rank_peaks
from autoplan.cost_model.step_time import Assessment, assess, pipeline_time_s
from autoplan.graph import CapturedGraph
from autoplan.options import SearchOptions
from autoplan.plan import optimizer_pieces
from autoplan.solver import checkpointing as ckpt
from autoplan.solver import pins, sequence
from autoplan.solver.context import attention_nodes, cp_degrees, with_context_parallel
from autoplan.solver.costs import Costs, build_costs, token_scale
from autoplan.solver.ilp import TIME_FORM, SolverLimitReached, StepForm, relax, solve
from autoplan.solver.problem import OUTPUT, Problem, build_problem
from autoplan.spec import TrainingSpec
from autoplan.strategies import StrategyCache
from autoplan.topology import Topology

__all__ = ["NoFeasiblePlan", "InvalidConfig", "ReplicatedWeightsWarning", "SolverLimitReached",
           "SolverLimitWarning", "Overrides", "PlanConfig", "Search", "enumerate_configs",
           "same_argmin", "validate", "offload_variants"]


class NoFeasiblePlan(ValueError):
    """No configuration fits in device memory; the message gives the smallest per-device memory
    any plan needs, the configuration that needs it and what the device has."""


class InvalidConfig(ValueError):
    """A user override that cannot work (numbers that do not divide, too many stages, ...).

    Attributes:
        reason: what cannot work, naming the numbers.
        option: the boolean keyword argument of `plan()` that would allow it (e.g.
            "allow_tp_across_nodes"), or None. The message ends with "pass <option>=True to
            allow it"; a front end that spells its options otherwise (the command line's
            `--allow-tp-across-nodes`) builds its own message from `reason` and `option`.
    """

    def __init__(self, reason: str, *, option: str | None = None):
        self.reason, self.option = reason, option
        super().__init__(reason if option is None else f"{reason}; pass {option}=True to allow it")


class ReplicatedWeightsWarning(UserWarning):
    """A fixed tp > 1 leaves weight matrices of the repeated block replicated on the tp axis
    because the model's shapes do not split by tp (planner.py, `_warn_unsplit`): every tp rank
    holds them whole."""


class SolverLimitWarning(UserWarning):
    """Configurations were skipped because their ILP found no placement within the
    deterministic limit (`time_limit_s`, [Note: deterministic limits] in ilp_types.py): the
    plan is the best of the others. The message names them; a larger limit includes them."""


@dataclass(frozen=True)
class Overrides(SearchOptions):
    """The user's choices of `plan()` (`SearchOptions`: None searched), and what the optimizer
    allows."""

    # False: the optimizer reads whole tensors ([Note: elementwise optimizer] in
    # runtime/optim.py): what hands it pieces of a tensor is not searched
    # (plan.py optimizer_pieces)
    elementwise_optimizer: bool = True


@dataclass(frozen=True)
class PlanConfig(Config):
    """A point of the outer search: cost_model's Config plus the activation checkpointing policy
    ("none" | "core-attention" | "selective" | "full", [Note: checkpointing]) and the CPU
    offload ("none" | "optimizer" | "optimizer+params", [Note: offload] in cost_model/offload.py);
    cost_model/step_time.py prices them through the Solution and memory forms this module hands
    it. Its placement ILP depends on (tp, b, policy, cp): `costs_key`."""

    checkpointing: str = "none"
    offload: str = "none"

    def __str__(self) -> str:
        extra = "" if self.checkpointing == "none" else f", {self.checkpointing} checkpointing"
        extra += "" if self.offload == "none" else f", {self.offload} offloaded"
        return super().__str__() + extra

    @property
    def costs_key(self) -> tuple[int, int, str, int]:
        """(tp, b, policy, cp): what the placement ILP's coefficients depend on."""
        return (self.tp, self.microbatch_size, self.checkpointing, self.cp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(graph: CapturedGraph, topology: Topology, spec: TrainingSpec, o: Overrides) -> None:
    """Reject overrides that cannot work, naming the numbers (InvalidConfig)."""
    world, layers = topology.world_size, graph.total_layers if graph.num_layers else 0
    for name in ("tp", "pp", "dp", "cp"):
        value = getattr(o, name)
        if value is not None and (value < 1 or world % value):
            raise InvalidConfig(f"{name} {value} does not divide the world size {world}")
    fixed = [v for v in (o.tp, o.pp, o.dp, o.cp) if v is not None]
    prod = 1
    for v in fixed:
        prod *= v
    if world % prod or (len(fixed) == 4 and prod != world):
        raise InvalidConfig(f"tp {o.tp} x pp {o.pp} x dp {o.dp} x cp {o.cp} does not fit "
                            f"world size {world}")
    if o.cp is not None and o.cp > 1:
        _check_cp(graph, spec, o.cp)
    if o.pp is not None and o.pp > max(layers, 1):
        raise InvalidConfig(f"pp {o.pp} is more than the model's {layers} layers")
    if o.tp is not None and o.tp > topology.devices_per_node and not o.allow_tp_across_nodes:
        raise InvalidConfig(f"tp {o.tp} spans nodes of {topology.devices_per_node} devices",
                            option="allow_tp_across_nodes")
    v = o.num_virtual_stages or 1
    if v > 1 and o.schedule not in (None, "interleaved-1f1b"):
        raise InvalidConfig(f"num_virtual_stages {v} needs schedule 'interleaved-1f1b'")
    if o.pp is not None and o.pp * v > max(layers, 1):
        raise InvalidConfig(f"pp {o.pp} x num_virtual_stages {v} = {o.pp * v} stages is more "
                            f"than the model's {layers} layers")
    if o.stages is not None:
        _check_stages(o, layers)
    if o.checkpointing not in (None, "none") and not layers:
        raise InvalidConfig(f"checkpointing {o.checkpointing!r} needs repeated blocks; "
                            f"{graph.model_name} has none")
    if o.offload not in (None, "none") and not offload.available(topology):
        raise InvalidConfig(f"offload {o.offload!r}: topology {topology.name!r} gives no host "
                            f"figures (host_mem_bytes, device.host_bw_bytes_per_s, "
                            f"device.host_optimizer_bw_bytes_per_s)")
    if o.offload not in (None, "none") and o.zero_stage is not None:
        try:
            offload.check_offload(o.offload, o.zero_stage, o.dp or 2)
        except ValueError as e:
            raise InvalidConfig(str(e)) from None
    if not o.elementwise_optimizer and o.zero_stage is not None:
        why = optimizer_pieces(o.zero_stage, o.dp or 2, o.cp or 1, o.tp or 1,
                               o.offload or "none")
        if why is not None:
            raise InvalidConfig(
                f"zero_stage {o.zero_stage}: {why}, and the optimizer reads whole tensors "
                "([Note: elementwise optimizer] in runtime/optim.py): its update would not be "
                "the one on whole tensors; use zero_stage 0, 2 or 3 (FSDP2 hands it DTensors) "
                "or an elementwise optimizer (AdamW, Adam, SGD)")
    if o.num_microbatches is not None:
        _check_microbatches(spec, o, world)
    elif o.dp is not None and spec.global_batch % o.dp:
        raise InvalidConfig(f"global_batch {spec.global_batch} is not divisible by dp {o.dp}")


def _check_stages(o: Overrides, layers: int) -> None:
    """Pinned stages: pp x v of them, at least one block each, the model's blocks in all."""
    v = o.num_virtual_stages or 1
    if o.pp is not None and len(o.stages) != o.pp * v:
        raise InvalidConfig(f"stages {list(o.stages)}: {len(o.stages)} stages for pp {o.pp} x "
                            f"num_virtual_stages {v} = {o.pp * v}")
    if any(not isinstance(n, int) or n < 1 for n in o.stages):
        raise InvalidConfig(f"stages {list(o.stages)}: every stage needs at least one block "
                            "(a count of blocks per stage)")
    if sum(o.stages) != layers:
        raise InvalidConfig(f"stages {list(o.stages)} hold {sum(o.stages)} blocks; the model "
                            f"has {layers}")


def _check_cp(graph: CapturedGraph, spec: TrainingSpec, cp: int) -> None:
    """A fixed cp > 1 needs the sequence in 2 cp chunks and fused attention in every block
    ([Note: context parallelism] in cost_model/context_parallel.py)."""
    if spec.seq_len % (2 * cp):
        raise InvalidConfig(f"cp {cp}: seq_len {spec.seq_len} is not divisible by 2 x cp = "
                            f"{2 * cp} (the load-balanced sequence chunks)")
    if len(attention_nodes(graph)) < max(graph.num_layers or 0, 1):
        raise InvalidConfig(f"cp {cp}: {graph.model_name} has no fused attention op "
                            "(scaled_dot_product_attention) in every block to split the "
                            "sequence around")


def _check_microbatches(spec: TrainingSpec, o: Overrides, world: int) -> None:
    m, b = o.num_microbatches, spec.global_batch
    if m < 1:
        raise InvalidConfig(f"num_microbatches {m} must be >= 1")
    if o.dp is not None:
        dps = [o.dp]
    else:
        rest = world // ((o.tp or 1) * (o.pp or 1) * (o.cp or 1))
        dps = [d for d in _divisors(rest)
               if (o.tp is None or o.pp is None or o.cp is None or d == rest)] or [rest]
    if not any(b % (d * m) == 0 for d in dps):
        d = dps[0] if len(dps) == 1 else min(dps)
        raise InvalidConfig(f"global_batch {b} is not divisible by dp {d} x num_microbatches {m}"
                            + ("" if len(dps) == 1 else f" (nor by any dp in {dps} x {m})"))


def enumerate_configs(graph: CapturedGraph, topology: Topology, spec: TrainingSpec,
                      o: Overrides, policies: tuple[str, ...] = ("none",),
                      unplaced: list[tuple[str, str]] | None = None) -> list[PlanConfig]:
    """Every configuration the overrides allow ([Note: decomposition], step 1); `policies`:
    the checkpointing policies to search (checkpointing.policies), unless overridden. A mesh
    whose groups cannot sit on the nodes (`_unplaced`) is skipped; `unplaced`, when given,
    receives (mesh, why) per mesh: ("pp 1 x dp 3 x tp 2", "its tp group of 2 ranks ...")."""
    policies = (o.checkpointing,) if o.checkpointing is not None else policies
    world, layers = topology.world_size, graph.total_layers if graph.num_layers else 0
    out = []
    pinned = pins.pinned_params(graph, o.placements)
    for tp in _divisors(world):
        if (o.tp is not None and tp != o.tp) or (
                tp > topology.devices_per_node and not o.allow_tp_across_nodes):
            continue
        if tp == 1 and pins.needs_tp(o.placements):
            continue  # a split pinned: meshes with tp > 1 only
        why = pins.why_not(graph, pinned, tp)
        if why is not None:
            if o.tp is not None:
                raise InvalidConfig(why)
            if unplaced is not None:
                unplaced.append((f"tp {tp}", why))
            continue
        cps = [o.cp] if o.cp is not None else cp_degrees(graph, spec.seq_len, world // tp)
        for cp in cps:
            if world % (tp * cp):
                continue
            for pp in _divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if (o.pp is not None and pp != o.pp) or (o.dp is not None and dp != o.dp):
                    continue
                if pp > max(layers, 1):
                    continue
                why = _unplaced(tp, dp, pp, topology, cp)
                if why is None:
                    out += _configs_for_mesh(pp, dp, tp, layers, spec, o, policies, cp)
                elif unplaced is not None:
                    cp_text = f" x cp {cp}" if cp > 1 else ""
                    unplaced.append((f"pp {pp} x dp {dp}{cp_text} x tp {tp}", why))
    return out


def _unplaced(tp: int, dp: int, pp: int, topology: Topology, cp: int = 1) -> str | None:
    """Why a group of the (pp, dp, cp, tp) mesh -- or the dp x cp gradient group -- does not
    sit evenly on the nodes ([Note: group layout] in cost_model/comm.py), or None when every
    one does."""
    for axis, size, stride in (("tp", tp, 1), ("cp", cp, tp), ("dp", dp, tp * cp),
                               ("dp x cp", dp * cp, tp), ("pp", pp, tp * cp * dp)):
        try:
            group_layout(size, stride, topology)
        except ValueError:
            return (f"its {axis} group of {size} ranks at stride {stride} straddles the "
                    f"{topology.devices_per_node}-device nodes unevenly")
    return None


def _configs_for_mesh(pp, dp, tp, layers, spec, o: Overrides, policies,
                      cp: int = 1) -> list[PlanConfig]:
    if spec.global_batch % dp:
        return []
    zeros = [o.zero_stage] if o.zero_stage is not None else (
        [0, 1, 2, 3] if dp * cp > 1 else [0])
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
                if sched == "1f1b" and pp > 1 and m < pp:
                    continue  # torch's Schedule1F1B refuses fewer microbatches than stages
                b = spec.global_batch // (dp * m)
                out += [PlanConfig(pp, dp, tp, zero, m, b, sched, v, cp=cp,
                                   stage_layers=o.stages or (),
                                   checkpointing=policy, offload=o.offload or "none")
                        for policy in policies]
    if o.offload not in (None, "none"):  # a fixed offload: the stages that run it
        out = [c for c in out if o.offload in offload.offloads_for(c.zero_stage, c.dp)]
    if not o.elementwise_optimizer:
        out = [c for c in out
               if optimizer_pieces(c.zero_stage, c.dp, c.cp, c.tp, c.offload) is None]
    return out


def offload_variants(cfg: PlanConfig, o: Overrides) -> list[PlanConfig]:
    """The offloaded variants of `cfg` worth searching ([Note: offload] in cost_model/offload.py,
    "Search"): the caller asks for them when no placement of cfg fits on the device; none
    when the offload is fixed (enumerate_configs made those)."""
    if o.offload is not None or cfg.offload != "none":
        return []
    return [replace(cfg, offload=k) for k in offload.offloads_for(cfg.zero_stage, cfg.dp)
            if o.elementwise_optimizer
            or optimizer_pieces(cfg.zero_stage, cfg.dp, cfg.cp, cfg.tp, k) is None]


@dataclass
class Search:
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
                              offload=cfg.offload, frozen=bool(self.problem(tp).frozen))
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
        return self._cached(key, cfg, self.solutions)

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
            cfg.costs_key + (_form_signature(form), ranks and _signature(ranks)))
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
        return self._cached(key, cfg, self.bounds)

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
               divide: int = 1) -> Assessment:
        """step_time.assess of `cfg` with placement `sol` under cfg's checkpointing policy.
        (tp, divide): for bounds, quantities of the tp problem with the boundary divided."""
        tp = cfg.tp if tp is None else tp
        costs, boundary, seen, transient = self._seen(cfg, sol, tp, divide)
        result = assess(cfg, seen, self.spec, self.topology, total_layers=self.total_layers,
                        output_bytes=output_bytes(cfg, costs), boundary_bytes=boundary / divide,
                        param_tensors=self.problem(tp).param_tensors, offload=cfg.offload)
        return ckpt.with_transient(result, transient, self.budget_bytes)

    def rank_peaks(self, a: Assessment) -> list[dict[str, float]]:
        """rank_memory.rank_peaks of the assessed configuration `a` (from `assess`: its
        Solution as the checkpointing policy leaves it, and the policy's transient, added to
        every rank as `assess` adds it): per pp rank, bytes by category and "peak"."""
        cfg = a.config
        costs = self.cost(cfg.tp, cfg.microbatch_size, cfg.checkpointing, cfg.cp, cfg.tp)
        boundary = self.boundary_bytes(cfg.tp, cfg.microbatch_size, cfg.cp, cfg.tp)
        out = []
        for peak in rank_peaks(cfg, a.solution, self.spec, total_layers=self.total_layers,
                               output_bytes=output_bytes(cfg, costs), boundary_bytes=boundary,
                               offload=cfg.offload):
            peak["temporaries"] += a.transient_bytes
            peak["peak"] += a.transient_bytes
            out.append(peak)
        return out

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
        schedule, so it is computed once for them (branch_bound.py: [Note: lazy bounds])."""
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


def same_argmin(form: StepForm, other: StepForm = TIME_FORM) -> bool:
    """True when the two forms order placements alike: one rank each with proportional
    shares, proportional compute and communication factors, no sync term."""
    if len(form.shares) != 1 or len(other.shares) != 1 or form.sync_s_per_elem or \
            other.sync_s_per_elem or form.sync_s_per_frozen_elem or \
            other.sync_s_per_frozen_elem:
        return False
    a, b = dict(form.shares[0]), dict(other.shares[0])
    ratios = {round(a[p] * form.compute_factor / (b[p] * other.compute_factor), 12)
              for p in a} | {round(a[p] * form.comm_factor / (b[p] * other.comm_factor), 12)
                             for p in a}
    return a.keys() == b.keys() and len(ratios) <= 1


def _form_signature(form: StepForm) -> tuple:
    r9 = lambda v: float(f"{v:.9g}")  # noqa: E731
    return (r9(form.compute_factor), r9(form.comm_factor),
            tuple(tuple((p, r9(v)) for p, v in r) for r in form.shares), r9(form.sync_s_per_elem),
            r9(form.sync_s_per_frozen_elem))


def _signature(ranks) -> tuple:
    """Per-rank memory coefficients rounded to 6 significant digits (a cache key)."""
    r6 = lambda v: float(f"{v:.6g}")  # noqa: E731
    return tuple((tuple(sorted((k, r6(v)) for k, v in r.param_coef.items())),
                  tuple(sorted((k, r6(v)) for k, v in r.act_coef.items())), r6(r.const_bytes),
                  r6(r.boundary_coef), r6(r.loss_coef),
                  r.frozen_coef and tuple(sorted((k, r6(v)) for k, v in r.frozen_coef.items())))
                 for r in ranks)


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
