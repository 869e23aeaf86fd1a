"""The solver: per-op placements on the tp axis (an ILP), inside a search over the mesh shape
(pp, dp, tp), the ZeRO stage, microbatches, the pipeline schedule and activation checkpointing.
What it searches over is priced by autoplan/cost_model/ (the step time and memory of a
configuration: cost_model/step_time.py, cost_model/rank_memory.py).

The pipeline, in files:
    problem.py        candidates (strategies.py) -> ILP nodes, shared blocks, weighted edges
    problem_saved.py  what each ILP node saves for the backward (the ILP's activation memory)
    costs.py          cost model -> ILP coefficients for one (tp, microbatch size)
    checkpointing.py  what a checkpointing policy does to those coefficients and to memory
    context.py        the cp degrees searched; cp's K/V collectives in those coefficients
    sequence.py       sequence parallelism as placements of the norm/dropout/residual regions
    float8.py         float8="on": the FP8 placements of the linears that have them
    frozen.py         fine-tuning: the dtype frozen parameters are held in, a plan choice
    ilp.py            the ILP, written as math in its docstring, solved with OR-Tools (GLOP
                      first, CP-SAT when the LP is fractional)
    ilp_model.py      the ILP as an OR-Tools model (one add_* per block of that math)
    ilp_types.py      its step form and the error of a solve that found nothing
    configurations.py the configurations searched (options checked, meshes enumerated) and
                      the planner's errors and warnings
    search.py         their costs, bounds and step forms ([Note: decomposition])
    pins.py           pinned parameter placements: the user's hard constraints on the ILP
    branch_bound.py   the branch and bound over configurations (lazy, resumable bounds)
    planner.py        plan(): that search driven to the best plan and runners-up (cp first
                      under a bound, offload where nothing fits); reprice(): a fixed plan
                      priced on another topology
    outcome.py        what plan() says of its result: runners-up and why each loses,
                      warnings, the errors where no plan is left
    expert_degree.py  the expert-parallel degrees a mesh admits and what the search keeps of ep
    assemble.py       the Plan (placements per node and parameter, redistributions, predictions)

Public: `plan`, `reprice`, `NoFeasiblePlan`, `InvalidConfig`, `SolverLimitReached` (all
ValueError), `SolverLimitWarning`, `Float8Warning`, `DP_SYNC_OVERLAP`.
"""

from autoplan.cost_model.step_time import DP_SYNC_OVERLAP
from autoplan.solver.configurations import (Float8Warning, InvalidConfig, NoFeasiblePlan,
                                            SolverLimitWarning)
from autoplan.solver.ilp_types import SolverLimitReached
from autoplan.solver.planner import plan, reprice

__all__ = ["plan", "reprice", "NoFeasiblePlan", "InvalidConfig", "SolverLimitReached",
           "SolverLimitWarning", "Float8Warning", "DP_SYNC_OVERLAP"]
