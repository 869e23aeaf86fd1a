"""The plan's FP8 linears, in a rewritten stage graph ([Note: float8 recipe] in autoplan/float8.py).

After `apply_placements` (the graph is interpreted under DTensor), each `aten.linear` node (and
each Conv1D `aten.addmm`) whose weight is one of the plan's `float8_linears` (weight FQNs)
becomes a call of `autoplan.float8.float8_linear` (`float8_addmm`) with the same arguments,
which runs the linear in FP8 on the local shards of its DTensors. Nothing else changes: the
redistributions the plan inserted around the linear stay where they are, and the linear's own
placements are ones the planner checked the FP8 linear runs (`autoplan.float8.supported`). An
export traces through the call: each rank's graph code shows the FP8 linear's ops (its casts
and `aten._scaled_mm`) under the linear's module comment.
"""

from __future__ import annotations

import torch.fx

from autoplan.float8 import ADDMM_TARGET, LINEAR_TARGET, float8_addmm, float8_linear

__all__ = ["linear_weight", "use_float8"]


_FP8 = {LINEAR_TARGET: (1, float8_linear), ADDMM_TARGET: (2, float8_addmm)}
"""A linear-like op -> (the index of its weight argument, its FP8 call)."""


def linear_weight(node: torch.fx.Node) -> str | None:
    """The FQN of the parameter an `aten.linear` (or Conv1D's `aten.addmm`) node multiplies by
    (a get_attr of the graph), or None for another node or a weight computed in the graph."""
    if node.op != "call_function" or node.target not in _FP8:
        return None
    index = _FP8[node.target][0]
    w = node.args[index] if len(node.args) > index else None
    return w.target if isinstance(w, torch.fx.Node) and w.op == "get_attr" else None


def use_float8(gm: torch.fx.GraphModule, weights: frozenset[str] | set[str]) -> set[str]:
    """Make the linears of `gm` whose weight FQN is in `weights` FP8 linears (in place).
    Returns the weight FQNs rewritten (those of `weights` this graph holds)."""
    done = set()
    for node in gm.graph.nodes:
        fqn = linear_weight(node)
        if fqn is not None and fqn in weights:
            node.target = _FP8[node.target][1]
            done.add(fqn)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
