"""Candidate placements of the routed-experts op ([Note: experts op] in autoplan/experts.py) on
the tp mesh axis. DTensor has no rule for it; these are explicit, as for fused attention.

Tensor arguments, [Note: argument order]: hidden (T, H), top_k_index (T, k), top_k_weights
(T, k), gate_up_proj (E, 2I, H), down_proj (E, H, I). Candidates:

- all R -> R: every tp rank computes every expert for every token (shard_factor 1).
- experts split, (R, R, R, S(0), S(0)) -> P: each tp rank holds E / tp whole experts and
  computes, for all tokens, the choices that fall on them; the output is a partial sum over the
  tp ranks (a token's k choices spread over ranks). Offered when E divides by tp and E >= tp.
  Work per rank is 1/tp of the op's on average (shard_factor tp), the busiest rank's
  `TrainingSpec.routing_skew` times that, which the cost model prices ([Note: expert
  parallelism] in cost_model/expert_parallel.py). This is expert parallelism over ranks that
  hold the same tokens: no all-to-all, one all-reduce (or reduce-scatter) of the output.

The FFN-dim split of each expert (gate_up_proj S(1), down_proj S(2)) is not offered: HF stores
gate and up concatenated in one (E, 2I, H) tensor, so an even split of dim 1 gives one rank all
the gate rows and the other all the up rows; a layout-aware split would need a placement the
plan cannot spell (a strided shard). Tokens (dim 0 of hidden) are the batch: data parallelism,
never the tp axis.
"""

from __future__ import annotations

import torch.fx

from autoplan.strategies.candidate import Candidate

__all__ = ["experts_candidates"]


def experts_candidates(node: torch.fx.Node, arg_shapes: list[tuple], tp: int) -> list[Candidate]:
    """The candidates of an `autoplan.experts` node at tp (see the module docstring).

    Args:
        node: the op's fx node (for error messages).
        arg_shapes: shapes of its five tensor arguments, in order.
        tp: size of the tp axis (> 1).

    Raises:
        ValueError: the node does not have the op's five tensor arguments.
    """
    if len(arg_shapes) != 5:
        raise ValueError(f"node {node.name!r} ({node.target}) has {len(arg_shapes)} tensor "
                         "arguments; the experts op takes 5")
    cands = [Candidate(("R",) * 5, ("R",), 1.0)]
    num_experts = arg_shapes[3][0]
    if num_experts >= tp and num_experts % tp == 0:
        cands.append(Candidate(("R", "R", "R", "S(0)", "S(0)"), ("P",), float(tp)))
    return cands
