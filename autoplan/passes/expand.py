"""A plan restated for another capture of the same model (another depth or batch).

[Note: plan retargeting]
A plan names graph nodes (`Plan.strategies`, `Plan.redistributions`) of the graph it was
planned on. Planning captures a few identical blocks ([Note: shallow planning capture] in
autoplan/capture/planning.py), the runtime captures every block at the microbatch size, and
fx names the nodes of the two graphs differently (the final norm's `to_10` after two blocks is
`to_130` after thirty-two, and a node of block 5 has no counterpart name at all). Before the
passes apply a plan to a graph it was not made on, `plan_for_graph` restates it there, by
structure rather than by name:

1. each graph is cut into segments: the call_function nodes before the first block ("pre"),
   each block k (`CapturedGraph.layer_nodes[k]`), the nodes between blocks, the nodes after the
   last block ("post");
2. block k of the target graph takes the choices of the planned graph's block
   min(k, N - 1) (N blocks planned): the representative blocks share their choices
   ([Note: layer sharing] in autoplan/solver/problem.py), and block 0 may differ from the
   others only at its input; the other segments pair with their planned counterparts;
3. within a pair of segments, nodes are matched in order by their op (difflib's longest
   matching runs, so that an op one capture has and the other lacks -- HF's batch-size-1
   mask path has one `expand` fewer -- leaves the rest matched); a matched node takes the
   planned node's strategy, an unmatched one has none (the passes leave it as captured);
4. the redistributions of a matched consumer are the planned consumer's, its producer named
   from the target graph's own argument at that index.

Parameters keep their placements by FQN (`Plan.param_placements` lists every layer's already).
"""

from __future__ import annotations

import dataclasses
import difflib

import torch.fx

from autoplan.graph import CapturedGraph
from autoplan.plan import NodeStrategy, Plan, Redistribution
from autoplan.passes.sharding import tensor_args

__all__ = ["plan_for_graph", "counterparts"]


def plan_for_graph(plan: Plan, planned: CapturedGraph, graph: CapturedGraph) -> Plan:
    """`plan`, made on `planned`, with its strategies and redistributions named after the
    nodes of `graph` ([Note: plan retargeting]); `plan` itself when `graph` is `planned`.

    Raises:
        ValueError: the graphs are not of one model (their real depths differ, or a parameter
            of `graph` has no placement in the plan), or `plan` names nodes `planned` does
            not have (a plan retargeted already).
    """
    if graph is planned:
        return plan
    if graph.total_layers != planned.total_layers:
        raise ValueError(
            f"plan for {planned.model_name!r} ({planned.total_layers} layers) cannot be applied "
            f"to {graph.model_name!r} ({graph.total_layers} layers): not the same model")
    placed = dict(plan.param_placements)
    missing = sorted(fqn for fqn in graph.params if fqn not in placed)
    if missing:
        raise ValueError(f"plan for {planned.model_name!r} has no placement for parameters of "
                         f"{graph.model_name!r}: {missing[:3]}")
    names = {n.name for n in planned.gm.graph.nodes}
    foreign = [s.node for s in plan.strategies if s.node not in names]
    if foreign:  # a plan retargeted already: its names would be mapped onto other nodes
        raise ValueError(
            f"plan has strategies for nodes {planned.model_name!r}'s planning graph does not "
            f"have ({foreign[:3]}): it is not the plan made on that graph (retargeted "
            "already?); retarget the plan as made on it")
    match = _match(planned, graph)
    strategies = {s.node: s for s in plan.strategies}
    by_consumer: dict[str, list[Redistribution]] = {}
    for r in plan.redistributions:
        by_consumer.setdefault(r.consumer, []).append(r)
    new_strategies, new_redistributions = [], []
    for node in graph.gm.graph.nodes:
        source = match.get(node.name)
        if source is None:
            continue
        if source.name in strategies:
            s = strategies[source.name]
            new_strategies.append(NodeStrategy(node.name, s.inputs, s.outputs))
        consumer = "output" if node.op == "output" else node.name
        args = tensor_args(node)
        for r in by_consumer.get("output" if source.op == "output" else source.name, ()):
            new_redistributions.append(dataclasses.replace(
                r, producer=args[r.arg_index].name, consumer=consumer))
    return dataclasses.replace(plan, strategies=tuple(new_strategies),
                               redistributions=tuple(new_redistributions))


def counterparts(planned: CapturedGraph, graph: CapturedGraph) -> dict[str, torch.fx.Node]:
    """Node name of `graph` -> the node of `planned` it corresponds to (call_function and
    output nodes; [Note: plan retargeting]): the same model captured at another batch or
    sequence length, or with another number of blocks."""
    return _match(planned, graph)


def _match(planned: CapturedGraph, graph: CapturedGraph) -> dict[str, torch.fx.Node]:
    """Node name of `graph` -> its counterpart in `planned` (call_function and output nodes
    only; nodes without one are absent)."""
    mine, theirs = _segments(graph), _segments(planned)
    n_planned = max(planned.num_layers, 1)
    out: dict[str, torch.fx.Node] = {}
    for key, nodes in mine.items():
        kind, k = key
        if kind == "block":
            other = theirs.get(("block", min(k, n_planned - 1)), [])
        elif kind == "between":
            other = theirs.get(("between", min(k, n_planned - 2)), []) if n_planned > 1 else []
        else:
            other = theirs.get(key, [])
        out.update(_align(other, nodes))
    return out


def _segments(graph: CapturedGraph) -> dict[tuple[str, int], list[torch.fx.Node]]:
    """("pre", 0), ("block", k), ("between", k) (after block k), ("post", 0) -> nodes in graph
    order; the output node ends "post"."""
    layer_of = {name: k for k, names in graph.layer_nodes.items() for name in names}
    last = max(graph.layer_nodes) if graph.layer_nodes else None
    segments: dict[tuple[str, int], list[torch.fx.Node]] = {}
    seen: int | None = None
    for node in graph.gm.graph.nodes:
        if node.op not in ("call_function", "output"):
            continue
        if node.name in layer_of:
            seen = layer_of[node.name]
            key = ("block", seen)
        elif seen is None:
            key = ("pre", 0)
        elif seen == last or node.op == "output":
            key = ("post", 0)
        else:
            key = ("between", seen)
        segments.setdefault(key, []).append(node)
    return segments


def _align(planned: list[torch.fx.Node], nodes: list[torch.fx.Node]
           ) -> dict[str, torch.fx.Node]:
    """Match two node sequences by op, in order (difflib's matching runs); a pair whose
    tensor arguments differ in number is no match."""
    ops = [str(n.target) for n in planned], [str(n.target) for n in nodes]
    matcher = difflib.SequenceMatcher(None, ops[0], ops[1], autojunk=False)
    out = {}
    for a, b, size in matcher.get_matching_blocks():
        for i in range(size):
            p, n = planned[a + i], nodes[b + i]
            if len(tensor_args(p)) == len(tensor_args(n)):
                out[n.name] = p
    return out
