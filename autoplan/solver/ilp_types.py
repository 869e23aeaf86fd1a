"""The data of the placement ILP (ilp.py): what a solve is given besides the problem and its
costs -- the memory of each pipeline rank (`RankMemory`) and the step time to minimise
(`StepForm`, [Note: step form] in ilp.py) -- and what it returns (`Solution`); `RankMemory` and
`Solution` are the cost model's (cost_model/placement_totals.py), which prices them.

Also the constants both the model (ilp_model.py) and the solve (ilp.py) use: the units inside
the model (ns for time) and the parts a model is split into, and the error a solve raises when
its limit comes before any placement (`SolverLimitReached`, [Note: deterministic limits]);
whether two forms order placements alike (`same_argmin`) and the keys the search caches
solutions under (`form_signature`, `memory_signature`).

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

from dataclasses import dataclass

from autoplan.cost_model.placement_totals import Solution

__all__ = ["StepForm", "TIME_FORM", "SolverLimitReached", "same_argmin", "form_signature",
           "memory_signature"]

_NS = 1e9
_TIE_BREAK = 1.0  # ns
_GAP = 1e-7  # relative optimality gap accepted from CP-SAT and from a rounded LP optimum
_PARTS = ("pre", "layer", "post")


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

    def value(self, sol: Solution) -> float:
        """The step time this form gives `sol`, seconds."""
        def on(rank, per_part: dict) -> float:
            return sum(s * per_part.get(p, 0.0) for p, s in rank)
        busiest = max(self.shares, key=lambda rank: (
            on(rank, sol.compute_s) + on(rank, sol.comm_s), on(rank, sol.compute_s)))
        return (self.compute_factor * on(busiest, sol.compute_s)
                + self.comm_factor * on(busiest, sol.comm_s)
                + self.sync_s(sol) + self.const_s)

    def sync_s(self, sol: Solution) -> float:
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


def form_signature(form: StepForm) -> tuple:
    """The form's factors and shares rounded to 9 significant digits (a cache key)."""
    r9 = lambda v: float(f"{v:.9g}")  # noqa: E731
    return (r9(form.compute_factor), r9(form.comm_factor),
            tuple(tuple((p, r9(v)) for p, v in r) for r in form.shares), r9(form.sync_s_per_elem),
            r9(form.sync_s_per_frozen_elem))


def memory_signature(ranks) -> tuple:
    """Per-rank memory coefficients rounded to 6 significant digits (a cache key)."""
    r6 = lambda v: float(f"{v:.6g}")  # noqa: E731
    return tuple((tuple(sorted((k, r6(v)) for k, v in r.param_coef.items())),
                  tuple(sorted((k, r6(v)) for k, v in r.act_coef.items())), r6(r.const_bytes),
                  r6(r.boundary_coef), r6(r.loss_coef),
                  r.frozen_coef and tuple(sorted((k, r6(v)) for k, v in r.frozen_coef.items())),
                  r.expert_coef and tuple(sorted((k, r6(v)) for k, v in r.expert_coef.items())),
                  r.expert_frozen_coef and tuple(sorted(
                      (k, r6(v)) for k, v in r.expert_frozen_coef.items())))
                 for r in ranks)
