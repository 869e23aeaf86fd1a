"""The data of the placement ILP (ilp.py): what a solve is given besides the problem and its
costs -- the memory of each pipeline rank (`RankMemory`) and the step time to minimise
(`StepForm`, [Note: step form] in ilp.py) -- and what it returns (`Solution`).

Also the constants both the model (ilp_model.py) and the solve (ilp.py) use: the units inside
the model (ns for time) and the parts a model is split into, and the error a solve raises when
its limit comes before any placement (`SolverLimitReached`, [Note: deterministic limits]).

[Note: deterministic limits] Every solve is bounded in deterministic units, never by the wall
clock, so that the same inputs give the same plan on any machine at any load (every rank that
plans for itself agrees): CP-SAT runs one worker with a fixed seed under
`max_deterministic_time`, GLOP under its own `max_deterministic_time`. Both count work (CP-SAT:
propagations, clause visits, LP pivots, each weighted) in "deterministic seconds", calibrated to
be roughly a second of one core of a reference machine; on the shared 2-core development
machine one deterministic second took 2-6 s of wall time at load 2 (CP-SAT on llama-tiny's
memory-constrained ILPs). The planner's `time_limit_s` is this limit per solve. A solve that reaches it keeps its
best placement (`Solution.optimal` False); with none found it falls back to its feasible start
(the LP rounding, the time-optimal placement or the all-replicated one) and, with no start that
satisfies the model either, raises `SolverLimitReached`, which the planner turns into a skipped
configuration (planner.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RankMemory", "StepForm", "TIME_FORM", "Solution", "SolverLimitReached"]

_NS = 1e9
_TIE_BREAK = 1.0  # ns
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
        boundary_coef: residual streams between blocks the rank holds (pipeline stage
            outputs kept for the backward, receive buffers), each at its size on a tp rank
            for the placement of the block-output node (Costs.boundary_bytes).
        frozen_coef: part -> bytes per element of a frozen parameter (Problem.frozen: no
            gradient, no optimizer state, [Note: frozen pricing] in cost_model/memory.py);
            None: priced as `param_coef`.
        loss_coef: how many token-loss working sets the rank holds at the placement of the
            logits' producer (Costs.loss_rows: 1 at moment A of the last rank without
            pipelining, else 0; [Note: loss working set] in cost_model/memory.py).
    """

    param_coef: dict[str, float]
    act_coef: dict[str, float]
    const_bytes: float = 0.0
    boundary_coef: float = 0.0
    frozen_coef: dict[str, float] | None = None
    loss_coef: float = 0.0


@dataclass(frozen=True)
class StepForm:
    """The step time of one configuration as a function of the placement ([Note: step form]).

    Attributes:
        compute_factor, comm_factor: a_c, a_m, seconds of step per second of the busiest
            rank's compute (communication) per microbatch.
        shares: per pipeline rank (those no other rank dominates), ((part, share), ...).
        sync_s_per_elem: B, data-parallel sync and optimizer seconds per trainable parameter
            element.
        const_s: K, seconds (constant in the placement; not in the ILP objective).
        sync_s_per_frozen_elem: B_f, the same per frozen parameter element (its ZeRO
            gathers only: no gradient reduction, no optimizer step; [Note: frozen pricing] in
            cost_model/memory.py); B_f <= B.
    """

    compute_factor: float
    comm_factor: float
    shares: tuple[tuple[tuple[str, float], ...], ...]
    sync_s_per_elem: float = 0.0
    const_s: float = 0.0
    sync_s_per_frozen_elem: float = 0.0

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
        return (self.compute_factor * on(busiest, sol.compute_s)
                + self.comm_factor * on(busiest, sol.comm_s)
                + self.sync_s(sol) + self.const_s)

    def sync_s(self, sol: "Solution") -> float:
        """The sync term of the rank whose parameters cost the most, seconds: max over ranks
        of B x trainable + B_f x frozen elements."""
        def cost(rank) -> float:
            share = dict(rank)
            total, frozen = sol.param_elems_on(share), sol.frozen_elems_on(share)
            return (self.sync_s_per_elem * (total - frozen)
                    + self.sync_s_per_frozen_elem * frozen)
        return max(cost(rank) for rank in self.shares)


TIME_FORM = StepForm(1.0, 1.0, (tuple((p, 1.0) for p in _PARTS),))
"""One microbatch through the whole model (the time-optimal placement of a (tp, b, policy))."""


@dataclass
class Solution:
    """A solved placement and its cost breakdown (weighted totals over the whole model).

    Attributes:
        choice: ILP node -> index of its chosen candidate.
        compute_s, comm_s: part -> seconds per microbatch (fwd + bwd).
        param_elems, act_bytes: part -> parameter elements per device, activation bytes per
            microbatch per device; param_elems holds the parameters of one part only.
        shared_param_elems: ((parts, elements per device), ...) of the parameters several
            parts use (a tied embedding and head): held once by a rank that runs any of those
            parts (`param_elems_on`).
        frozen_elems, shared_frozen_elems: the same of the frozen parameters only (included in
            param_elems and shared_param_elems; `frozen_elems_on`); empty when all train.
        objective_s: compute + comm, seconds per microbatch.
        optimal: proved optimal (False: the best placement found within the deterministic
            limit, or the solve's feasible start; [Note: deterministic limits]).
        num_vars, num_constraints: model size.
        solve_s: wall time of the solve, seconds; for reports only, no decision reads it.
        integer_solver: True when the LP was fractional and CP-SAT solved the ILP.
        cp_comm_s: part -> seconds per microbatch of context parallelism's K/V collectives,
            included in comm_s (Costs.node_comm_s; [Note: context parallelism] in
            solver/context.py).
        boundary_bytes: the residual stream between blocks, one microbatch, on a tp rank at
            the chosen placement (Costs.boundary_bytes); None: not known (its global size is
            assumed).
        loss_bytes: the token loss's working set without pipelining at the chosen placement
            of the logits' producer (Costs.loss_rows); None: none priced per candidate
            (Costs.loss_bytes holds).
    """

    choice: dict[str, int]
    compute_s: dict[str, float] = field(default_factory=dict)
    comm_s: dict[str, float] = field(default_factory=dict)
    param_elems: dict[str, float] = field(default_factory=dict)
    shared_param_elems: list[tuple[tuple[str, ...], float]] = field(default_factory=list)
    act_bytes: dict[str, float] = field(default_factory=dict)
    objective_s: float = 0.0
    optimal: bool = True
    num_vars: int = 0
    num_constraints: int = 0
    solve_s: float = 0.0
    integer_solver: bool = False
    cp_comm_s: dict[str, float] = field(default_factory=dict)
    boundary_bytes: float | None = None
    loss_bytes: float | None = None
    frozen_elems: dict[str, float] = field(default_factory=dict)
    shared_frozen_elems: list[tuple[tuple[str, ...], float]] = field(default_factory=list)

    def add_param_elems(self, parts, elems: float, *, frozen: bool = False) -> None:
        """Count a parameter of `elems` elements per device used by `parts` (`frozen`: one
        the optimizer does not step, counted in the frozen totals too)."""
        parts = tuple(parts)
        for per_part, shared in ((self.param_elems, self.shared_param_elems),) + (
                ((self.frozen_elems, self.shared_frozen_elems),) if frozen else ()):
            if len(parts) == 1:
                per_part[parts[0]] = per_part.get(parts[0], 0.0) + elems
            else:
                shared.append((parts, elems))

    def param_elems_on(self, share: dict[str, float]) -> float:
        """Parameter elements per device of a rank holding `share[part]` of each part; a
        parameter several parts use counts once, at its largest share there (a tied embedding
        and head on one pipeline rank is one tensor; on two, one on each)."""
        own = sum(s * self.param_elems.get(p, 0.0) for p, s in share.items())
        return own + sum(e * max(share.get(p, 0.0) for p in parts)
                         for parts, e in self.shared_param_elems)

    def frozen_elems_on(self, share: dict[str, float]) -> float:
        """`param_elems_on` of the frozen parameters (0.0 when all train)."""
        if not self.frozen_elems and not self.shared_frozen_elems:
            return 0.0
        own = sum(s * self.frozen_elems.get(p, 0.0) for p, s in share.items())
        return own + sum(e * max(share.get(p, 0.0) for p in parts)
                         for parts, e in self.shared_frozen_elems)


class SolverLimitReached(ValueError):
    """A placement ILP reached its deterministic limit ([Note: deterministic limits]) before any
    placement, with no feasible start to fall back on.

    Attributes:
        ilp: which ILP (objective, tp, size), e.g. "the time ILP of tp 8 (1583 variables)".
        limit_s: the limit, deterministic seconds (the planner's `time_limit_s`).
        config: the configuration it was solved for ("" when not known).
    """

    def __init__(self, ilp: str, limit_s: float, config: str = "") -> None:
        self.ilp, self.limit_s, self.config = ilp, limit_s, config
        where = f" for {config}" if config else ""
        super().__init__(f"{ilp}{where} found no placement within time_limit_s={limit_s:g} "
                         f"(deterministic seconds of CP-SAT); pass a larger time_limit_s")
