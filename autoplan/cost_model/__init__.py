"""Cost model: every price of a plan, from one op to the whole step. Compute (roofline per aten
op), communication (alpha-beta per collective and topology level), memory (model states by
ZeRO stage, activations by checkpointing policy and pipeline schedule, peak per rank), the step
time and memory of a whole configuration, and the same formulas symbolically for reports and
tests. The solver (autoplan/solver/) searches over what this package prices.

Hardware is always an argument (a `Topology` or `DeviceSpec`); nothing here reads the machine.

The files, from op to step:
    compute.py           compute time per aten op (roofline, matmul efficiency curve)
    comm.py              collective and pipeline-hop times (alpha-beta per link level)
    memory.py            model states by ZeRO stage, activations in closed form, the peak
                         moments, the loss's working set
    activations.py       activations from a captured graph: what autograd saves, op by op
    context_parallel.py  context parallelism priced: attention nodes, K/V bytes, K/V time
    offload.py           CPU offload priced: host memory, transfers, the host step
    expert_parallel.py   expert parallelism priced: MoE layers, all-to-alls, 1 / ep states
    float8.py            the FP8 linears priced, and which a float8 plan runs ([Note: float8
                         pricing])
    placement_totals.py  what the whole-step model reads of a placement: `Solution` (per-part
                         totals) and `RankMemory` (a rank's memory, linear in the placement)
    config.py            `Config` (one point of the search) and its stages on pipeline ranks
    dp_sync.py           the data-parallel collectives and local passes of a step
    rank_memory.py       memory per pipeline rank: peaks, and the ILP's linear forms
    schedule_moments.py  the moments of an interleaved rank, walked from torch's actions
    schedule_time.py     torch's pipeline orders run in unit time (the zero-bubble step)
    step_time.py         the step time of a configuration (`assess`: bubble, dp sync, optimizer)
    part_costs.py        compute and communication per part of the model (the report's table)
    traffic.py           bytes each rank moves per mesh axis in a step, as the dry run counts
    traffic_tp.py        the same on the tp axis (redistributions, partial gradients)
    traffic_context.py   what those rules share: RankTraffic, what they read of plan and graph
    fidelity.py          the error bands a plan states
    symbolic.py          the formulas as sympy expressions (reports print, tests check them)
"""

from autoplan.cost_model.activations import (
    SavedTensor, activation_bytes_from_graph, node_producers, saved_tensors
)
from autoplan.cost_model.comm import (
    COLLECTIVES, backward_redistribution, collective_time_s, group_layout, hop_crosses_nodes,
    p2p_time_s, pipeline_hop_time_s, redistribute_time_s,
)
from autoplan.cost_model.compute import (
    backward_time_s, graph_backward_time_s, graph_forward_time_s, matmul_efficiency, op_time_s
)
from autoplan.cost_model.memory import (
    activation_bytes_per_layer_closed_form, model_state_bytes, peak_memory_bytes,
    pipeline_in_flight_microbatches
)
from autoplan.cost_model.symbolic import FORMULAS, evaluate, latex

__all__ = [
    "COLLECTIVES", "collective_time_s", "group_layout", "hop_crosses_nodes", "p2p_time_s",
    "pipeline_hop_time_s", "redistribute_time_s", "backward_redistribution",
    "matmul_efficiency", "op_time_s", "backward_time_s", "graph_forward_time_s",
    "graph_backward_time_s",
    "model_state_bytes", "activation_bytes_per_layer_closed_form", "activation_bytes_from_graph",
    "saved_tensors", "node_producers", "SavedTensor", "pipeline_in_flight_microbatches",
    "peak_memory_bytes",
    "FORMULAS", "evaluate", "latex",
]
