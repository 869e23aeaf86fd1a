"""Cost model: compute (roofline per aten op), communication (alpha-beta per collective and
topology level), memory (model states by ZeRO stage, activations by checkpointing policy and
pipeline schedule, peak per rank) and the same formulas symbolically for reports and tests.

Hardware is always an argument (a `Topology` or `DeviceSpec`); nothing here reads the machine.
"""

from autoplan.cost_model.comm import (
    COLLECTIVES, backward_redistribution, collective_time_s, group_layout, hop_crosses_nodes,
    p2p_time_s, pipeline_hop_time_s, redistribute_time_s,
)
from autoplan.cost_model.compute import (
    backward_time_s, graph_backward_time_s, graph_forward_time_s, matmul_efficiency, op_name,
    op_time_s,
)
from autoplan.cost_model.memory import (
    SavedTensor, activation_bytes_from_graph, activation_bytes_per_layer_closed_form,
    model_state_bytes, node_producers, peak_memory_bytes, pipeline_in_flight_microbatches,
    saved_tensors,
)
from autoplan.cost_model.symbolic import FORMULAS, evaluate, latex

__all__ = [
    "COLLECTIVES", "collective_time_s", "group_layout", "hop_crosses_nodes", "p2p_time_s",
    "pipeline_hop_time_s", "redistribute_time_s", "backward_redistribution",
    "op_name", "matmul_efficiency", "op_time_s", "backward_time_s", "graph_forward_time_s",
    "graph_backward_time_s",
    "model_state_bytes", "activation_bytes_per_layer_closed_form", "activation_bytes_from_graph",
    "saved_tensors", "node_producers", "SavedTensor", "pipeline_in_flight_microbatches",
    "peak_memory_bytes",
    "FORMULAS", "evaluate", "latex",
]
