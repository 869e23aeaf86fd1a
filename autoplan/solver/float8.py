"""The search under float8="on": the linears that can run in FP8 do ([Note: float8 pricing] in
autoplan/cost_model/float8.py).

"on" asks for every eligible linear in FP8, and the placement ILP would otherwise be free to
pick, for a linear, placements the FP8 linear does not run on local shards (a Partial weight,
say) where those are cheaper in the compute dtype. `restrict` cuts each eligible linear's
candidates to the ones `autoplan.float8.supported` runs, where it has any; a linear with none
at this tp stays as it is, in the compute dtype, and the plan's `float8_linears` leaves it out.
"""

from __future__ import annotations

from autoplan.cost_model.float8 import eligible, runs_in_float8
from autoplan.float8 import ADDMM_TARGET
from autoplan.solver.problem import Problem

__all__ = ["restrict"]


def restrict(problem: Problem) -> Problem:
    """`problem` with each eligible linear's candidates cut to those that run in FP8 (in place;
    new candidate lists, the strategy cache's are shared). Every node an ILP node stands for
    (the other blocks' copies) is cut alike: assembly reads a block's choice by its index."""
    fx_nodes = {n.name: n for n in problem.graph.gm.graph.nodes}
    linears = eligible(problem.graph)
    for name in list(problem.cands):
        rep = problem.rep.get(name, name)
        if rep not in linears:
            continue
        node = fx_nodes[rep]
        index = 2 if node.target is ADDMM_TARGET else 1
        weight = problem.cands.get(node.args[index].name, ())
        # a pinned weight (solver/pins.py, restricted before this) is read as it is stored:
        # only the candidates that read it so
        stored = {c.outputs[0] for c in weight} or None
        keep = [c for c in problem.cands[name]
                if runs_in_float8(node, c.inputs, problem.tp)
                and (stored is None or c.inputs[index] in stored)]
        if keep:
            problem.cands[name] = keep
    return problem
