"""A plan made on a shallow capture, expanded to the graph the runtime runs.

Planning captures a few identical blocks of a deep model and scales them to its real depth
([Note: shallow planning capture] in autoplan/capture/planning.py); the runtime captures every
block. The plan's node strategies and redistributions name the shallow graph's nodes, so before
the runtime (or export) applies them they are carried over, node by node, to the full graph:

- a node of block k takes the strategy of the node at the same position in block
  min(k, captured - 1) -- blocks past the captured ones run as the last captured block, which
  the planner priced for all of them;
- a node outside the blocks (embedding, final norm, head, the loss) takes the strategy of the
  node at the same position among the shallow graph's nodes outside the blocks; graph inputs
  keep their names; a parameter node takes that of the same parameter in the mapped block;
- a redistribution is copied to every consumer mapped to its consumer, its producer renamed to
  what the consumer reads at that argument.
Parameter placements are already given for every FQN of the real depth (solver/assemble.py).
"""

from __future__ import annotations

import dataclasses

from autoplan.graph import CapturedGraph
from autoplan.passes.sharding import tensor_args
from autoplan.plan import NodeStrategy, Plan

__all__ = ["expand_plan"]


def _layer_param(graph: CapturedGraph, target: str) -> tuple[int, str] | None:
    """(block index, the FQN after it) of a parameter/buffer inside the blocks, or None."""
    head = graph.layer_prefix + "."
    if not graph.layer_prefix or not target.startswith(head):
        return None
    k, _, rest = target[len(head):].partition(".")
    return (int(k), rest) if k.isdigit() else None


def _positions(graph: CapturedGraph) -> tuple[dict, list[str]]:
    """({node name: (block, index in block)}, names of the call_function nodes outside the
    blocks, in graph order)."""
    in_block = {n: (k, i) for k, names in graph.layer_nodes.items()
                for i, n in enumerate(names)}
    outside = [n.name for n in graph.gm.graph.nodes
               if n.op == "call_function" and n.name not in in_block]
    return in_block, outside


def node_map(planned: CapturedGraph, runtime: CapturedGraph) -> dict[str, str]:
    """Runtime node name -> the planned node whose strategy it runs (see the module doc).

    Raises ValueError when the graphs do not line up: another count of nodes outside the
    blocks or in a block, or a parameter the shallow graph lacks."""
    p_block, p_out = _positions(planned)
    r_block, r_out = _positions(runtime)
    if len(p_out) != len(r_out):
        raise ValueError(f"plan for {planned.model_name}: {len(p_out)} ops outside the blocks "
                         f"in the planned graph, {len(r_out)} in the runtime graph")
    captured = planned.num_layers
    out = dict(zip(r_out, p_out))
    for name, (k, i) in r_block.items():
        block = planned.layer_nodes.get(min(k, captured - 1), ())
        if i >= len(block):
            raise ValueError(f"plan for {planned.model_name}: block {k} of the runtime graph "
                             f"has more ops than the planned block {min(k, captured - 1)}")
        out[name] = block[i]
    attrs = {n.target: n.name for n in planned.gm.graph.nodes if n.op == "get_attr"}
    for node in runtime.gm.graph.nodes:
        if node.op == "placeholder":
            out[node.name] = node.name
        elif node.op == "get_attr":
            target, where = node.target, _layer_param(runtime, node.target)
            if where is not None:
                k, rest = where
                target = f"{planned.layer_prefix}.{min(k, captured - 1)}.{rest}"
            if target not in attrs:
                raise ValueError(f"plan for {planned.model_name}: parameter {node.target} has "
                                 f"no counterpart {target} in the planned graph")
            out[node.name] = attrs[target]
    return out


def expand_plan(plan: Plan, planned: CapturedGraph, runtime: CapturedGraph) -> Plan:
    """`plan` (made on `planned`) with its strategies and redistributions named after the
    nodes of `runtime`, the same model captured at full depth; the plan itself when the two
    have the same blocks. Raises ValueError as `node_map`."""
    if planned.num_layers == runtime.num_layers:
        return plan
    mapping = node_map(planned, runtime)
    by_node = {s.node: s for s in plan.strategies}
    strategies = tuple(NodeStrategy(r, by_node[p].inputs, by_node[p].outputs)
                       for r, p in mapping.items() if p in by_node)
    wanted: dict[str, list] = {}
    for red in plan.redistributions:
        wanted.setdefault(red.consumer, []).append(red)
    reds = []
    for node in runtime.gm.graph.nodes:
        consumer = "output" if node.op == "output" else mapping.get(node.name)
        if consumer is None or consumer not in wanted:
            continue
        args = tensor_args(node)
        for red in wanted[consumer]:
            if red.arg_index < len(args):
                reds.append(dataclasses.replace(
                    red, producer=args[red.arg_index].name,
                    consumer="output" if node.op == "output" else node.name))
    return dataclasses.replace(plan, strategies=strategies, redistributions=tuple(reds))
