"""What the whole-step model (step_time.py, rank_memory.py) reads of a placement and what the
placement ILP (solver/ilp.py) is given and returns in its terms: a rank's memory as a linear
function of the placement (`RankMemory`, per moment of [Note: peak moments] in memory.py) and a
solved placement with its totals per part (`Solution`: compute, communication, parameters,
activations of "pre", "layer", "post").
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RankMemory", "Solution"]


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
        at_loss: the last rank's moment A at its loss ([Note: peak moments] in
            cost_model/memory.py): before any block's backward, so without the
            checkpointing policy's transient (solver/checkpointing.py checkpointed_ranks).
        expert_coef, expert_frozen_coef: under expert parallelism (ep > 1), part -> bytes
            per element of a routed expert weight (Problem.experts; trainable, frozen) at
            this moment: its slice's states, held outside FSDP2 (rank_memory.ExpertSlices,
            [Note: expert slices in the forms] in cost_model/rank_memory.py); None: priced
            as `param_coef` (`frozen_coef`).
    """

    param_coef: dict[str, float]
    act_coef: dict[str, float]
    const_bytes: float = 0.0
    boundary_coef: float = 0.0
    frozen_coef: dict[str, float] | None = None
    loss_coef: float = 0.0
    at_loss: bool = False
    expert_coef: dict[str, float] | None = None
    expert_frozen_coef: dict[str, float] | None = None


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
            cost_model/context_parallel.py).
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
