"""The plan's FP8 linears, in a rewritten stage graph ([Note: float8 recipe] in autoplan/float8.py).

After `apply_placements` (the graph is interpreted under DTensor), each `aten.linear` node whose
weight is one of the plan's `float8_linears` (weight FQNs) becomes a call of
`autoplan.float8.float8_linear` with the same arguments, which runs the linear in FP8 on the
local shards of its DTensors. Nothing else changes: the redistributions the plan inserted around
the linear stay where they are, and the linear's own placements are ones the planner checked
the FP8 linear runs (`autoplan.float8.supported`). An export traces through the call: each
rank's graph code shows the FP8 linear's ops (its casts and `aten._scaled_mm`) under the
linear's module comment.
"""

from __future__ import annotations

import torch.fx

from autoplan.float8 import LINEAR_TARGET, float8_linear

__all__ = ["linear_weight", "use_float8"]


def linear_weight(node: torch.fx.Node) -> str | None:
    """The FQN of the parameter an `aten.linear` node multiplies by (a get_attr of the graph),
    or None for another node or a weight computed in the graph."""
    if node.op != "call_function" or node.target is not LINEAR_TARGET or len(node.args) < 2:
        return None
    w = node.args[1]
    return w.target if isinstance(w, torch.fx.Node) and w.op == "get_attr" else None


def use_float8(gm: torch.fx.GraphModule, weights: frozenset[str] | set[str]) -> set[str]:
    """Make the linears of `gm` whose weight FQN is in `weights` FP8 linears (in place).
    Returns the weight FQNs rewritten (those of `weights` this graph holds)."""
    done = set()
    for node in gm.graph.nodes:
        fqn = linear_weight(node)
        if fqn is not None and fqn in weights:
            node.target = float8_linear
            done.add(fqn)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
