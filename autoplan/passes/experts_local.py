"""The routed-experts op under DTensor on the tp axis ([Note: experts op] in autoplan/experts.py).

DTensor has no rule for `autoplan.experts`; `apply_placements` points its nodes at
`experts_local` (as it does fused attention at `sdpa_local`), which runs the op on the local
shards in the placements the plan chose (strategies/experts_candidates.py):

- all Replicate: every rank runs the whole op; the output is Replicate.
- experts Shard(0): rank r holds the experts [r E/tp, (r+1) E/tp) and runs the op with that
  `expert_offset` on the replicated tokens; the output is Partial (each rank's sum over the
  choices it holds). The gradients of the replicated hidden and routing weights are partial too
  (a rank differentiates through its own experts only): `to_local(grad_placements=Partial)`
  says so, and DTensor all-reduces them where the replicated producer needs them whole.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autoplan.experts import EXPERTS_OP

__all__ = ["experts_local", "route_experts"]


def experts_local(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act: str,
                  expert_offset: int):
    """`autoplan.experts` on DTensors of one 1-D mesh (plain tensors: the op itself).

    hidden (T, H), top_k_index and top_k_weights (T, k): Replicate. gate_up_proj (E, 2I, H) and
    down_proj (E, H, I): both Replicate or both Shard(0). Returns (T, H): Replicate, or Partial
    when the experts are split.

    Raises:
        ValueError: other placements (the plan must redistribute to these first).
    """
    if not isinstance(gate_up_proj, DTensor):
        return EXPERTS_OP(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act,
                          expert_offset)
    mesh = gate_up_proj.device_mesh
    tokens = (hidden, top_k_index, top_k_weights)
    if any(isinstance(t, DTensor) and t.placements != (Replicate(),) for t in tokens) or \
            gate_up_proj.placements != down_proj.placements or \
            gate_up_proj.placements not in ((Replicate(),), (Shard(0),)):
        raise ValueError(
            "experts_local: expected hidden, top_k_index, top_k_weights Replicate and the two "
            "expert weights both Replicate or both Shard(0); got "
            f"{[getattr(t, 'placements', 'plain') for t in tokens]}, "
            f"{gate_up_proj.placements}, {down_proj.placements}")
    split = gate_up_proj.placements == (Shard(0),)
    grad = (Partial(),) if split else None
    x, w = (t.to_local(grad_placements=grad) if isinstance(t, DTensor) else t
            for t in (hidden, top_k_weights))
    idx = top_k_index.to_local() if isinstance(top_k_index, DTensor) else top_k_index
    local_gate_up, local_down = gate_up_proj.to_local(), down_proj.to_local()
    if split:
        # Shard(0) of E divisible by the mesh size (strategies/experts_candidates.py): equal
        # contiguous chunks
        expert_offset += mesh.get_local_rank() * local_gate_up.shape[0]
    out = EXPERTS_OP(x, idx, w, local_gate_up, local_down, act, expert_offset)
    placement = (Partial(),) if split else (Replicate(),)
    return DTensor.from_local(out, mesh, placement, run_check=False,
                              shape=torch.Size(hidden.shape), stride=out.stride())


def route_experts(gm: torch.fx.GraphModule, target) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """Point every experts node of `gm` (after `apply_placements`: `experts_local` or the op
    itself) at `target`, the op run over an ep group (runtime/expert_parallel.py
    `experts_all_to_all`; in place, recompiles). Returns (experts node, weight node) of each
    node's gate_up_proj and down_proj arguments, in graph order: the weights the runtime shards
    over ep.

    Raises ValueError when an experts node's weights are not parameters read directly."""
    routed = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (experts_local, EXPERTS_OP):
            continue
        node.target = target
        for arg in node.args[3:5]:
            if not isinstance(arg, torch.fx.Node) or arg.op != "get_attr":
                raise ValueError(f"experts node {node.name}: expert weights must be parameters "
                                 f"read directly (get_attr), got {arg}")
            routed.append((node, arg))
    gm.recompile()
    return routed
