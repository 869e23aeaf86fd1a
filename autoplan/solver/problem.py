"""The placement problem for one tp degree: ILP nodes, their candidates, weighted edges.

Identical blocks share variables ([Note: layer sharing]): the ILP sees the nodes outside the
repeated blocks plus ONE representative block (`graph.layer_nodes[0]`); node k of every other
captured block maps onto node k of the representative. Weights turn the captured graph
(`num_layers` blocks) into the real model (`total_layers` blocks):

| edge or node                                   | weight per captured item                |
|------------------------------------------------|-----------------------------------------|
| node or edge inside a block                    | T / N                                   |
| block k -> block k' > k (the residual stream)  | (T - 1) / (N - 1)                        |
| outside -> block, feeding every captured block | T / N (rotary tables, masks)            |
| outside -> block, feeding some blocks only     | 1 (the embedding feeds the first block) |
| anything else                                  | 1                                       |

with T = total_layers and N = num_layers. With N = 1 the block-to-block edge is not in the
captured graph; it is priced by a synthetic edge from the block's output to the block's input
(weight T - 1), see `_transition_edges`.

[Note: one redistribution per value] A value that several consumers need in one placement is
redistributed once and the result shared (the rewrite inserts one collective,
passes/sharding.py; the plan records it once, for the first consumer in graph order,
solver/assemble.py). Consumers share when they read the same producer output and sit in the
same place: the same block (a block's own value, or a value from the block before, or one from
outside the blocks), or outside the blocks in the same part ("pre" / "post"). `Edge.share`
names that group -- (producer, output index, "same" | "next" | "in" | "pre" | "post"), None
for the graph output and tuple elements -- and `share_key` is its counterpart on the captured
graph, by which assemble and the rewrite group real consumers. The ILP prices a group's
redistribution p -> q once (costs.redistribution_units).
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict
from dataclasses import dataclass, field

import torch.fx

from autoplan.cost_model.activations import core_attention_regions
from autoplan.cost_model.expert_parallel import expert_weights
from autoplan.graph import CapturedGraph
from autoplan.op_classes import op_name
from autoplan.solver.problem_saved import kept_selective, saved_entries, tensor_bytes
from autoplan.strategies import (
    Candidate, StrategyCache, constant_like_nodes, node_strategies, node_tensor_meta, tensor_args,
)

__all__ = ["OUTPUT", "Edge", "Problem", "build_problem", "share_key", "boundary_node",
           "boundary_bytes"]

OUTPUT = "__output__"
"""Pseudo-consumer of the graph output: it takes "R" (the graph output must be replicated)."""


@dataclass(frozen=True)
class Edge:
    """A weighted producer -> consumer edge between ILP nodes.

    Attributes:
        src, out_index: producer and which of its outputs.
        dst, arg_index: consumer (or OUTPUT) and which of its tensor arguments.
        weight: how many real edges it stands for ([Note: layer sharing]).
        nbytes: global bytes at the captured shapes and the compute dtype.
        scales: True when the tensor grows with the microbatch (an activation, not a param).
        grad: True when a gradient flows back along it.
        getitem: True for a tuple element: placements must be equal, nothing moves.
        part: "pre" | "layer" | "post": where its cost is paid (the consumer's part).
        share: edges with one `share` (not None) carry one redistribution per (producer
            placement, consumer placement) ([Note: one redistribution per value]).
    """

    src: str
    out_index: int
    dst: str
    arg_index: int
    weight: float
    nbytes: float
    scales: bool
    grad: bool
    getitem: bool
    part: str
    share: tuple | None = None


@dataclass
class Problem:
    """Everything about the placement ILP that does not depend on the microbatch size.

    Attributes:
        graph, tp: the captured graph and the tp degree.
        cands: candidates of every node of the full graph (strategies.node_strategies).
        rep: node name -> its ILP node (itself outside the blocks).
        nodes: ILP nodes in graph order.
        part: ILP node -> "pre" | "layer" | "post".
        weight: ILP node -> multiplicity (T for block nodes when blocks are shared).
        edges: weighted ILP edges.
        saved: (owner ILP node or None, global bytes at b = captured batch, multiplicity, part)
            for every tensor autograd saves (cost_model.activations.saved_tensors).
        core_saved: the entries of `saved` that "core-attention" checkpointing drops: tensors
            an attention core (cost_model.activations.core_attention_regions) makes and only its
            own ops save ([Note: core attention] in solver/checkpointing.py); empty for fused
            attention.
        core_nodes: the names of the nodes of every attention core (recomputed under
            "core-attention").
        core_inputs: Problem.saved-style entries for what the cores read and no op saves
            (e.g. an additive attention mask): "core-attention"'s checkpoints hold them.
        kept_selective: (ILP node, bytes of all its outputs at b = captured batch,
            multiplicity, part) for every block op whose outputs "selective" checkpointing
            keeps (autoplan.op_classes.SELECTIVE_SAVED_OPS: matmuls of every spelling, fused
            attention; [Note: selective saved set]).
        regathered: node -> the op whose backward reads the node's input (the node itself,
            or the op that saves it through flattening views): an all-gather on an edge into
            the node is held as its shard and all-gathered again in that op's backward
            ([Note: gathered inputs saved sharded] in autoplan/passes/regather.py).
        params: ILP get_attr node -> (canonical FQN, numel, parts it belongs to, multiplicity).
        frozen: the get_attr nodes of `params` whose parameter the optimizer does not step
            (`ParamInfo.trainable` False; [Note: frozen pricing] in cost_model/memory.py).
        experts: the get_attr nodes of `params` of routed expert weights (those an experts
            op reads: cost_model/expert_parallel.py `expert_weights`), held as slices under
            expert parallelism ([Note: expert slices in the forms] in
            cost_model/rank_memory.py).
        constants: constant-like nodes (no cost).
        shared: True when blocks share variables.
    """

    graph: CapturedGraph
    tp: int
    cands: dict[str, list[Candidate]]
    rep: dict[str, str]
    nodes: list[str]
    part: dict[str, str]
    weight: dict[str, float]
    edges: list[Edge] = field(default_factory=list)
    saved: list[tuple] = field(default_factory=list)
    core_saved: list[tuple] = field(default_factory=list)
    core_nodes: frozenset = frozenset()
    core_inputs: list[tuple] = field(default_factory=list)
    kept_selective: list[tuple] = field(default_factory=list)
    regathered: dict[str, str] = field(default_factory=dict)
    params: dict[str, tuple[str, int, frozenset, float]] = field(default_factory=dict)
    frozen: frozenset = frozenset()
    experts: frozenset = frozenset()
    constants: set[str] = field(default_factory=set)
    shared: bool = True

    @property
    def num_layers(self) -> int:
        return self.graph.total_layers if self.graph.num_layers else 0

    @functools.cached_property
    def layer_of(self) -> dict[str, int]:
        """Node name -> index of the captured block it belongs to (block nodes only)."""
        return _layer_of(self.graph)

    @functools.cached_property
    def param_tensors(self) -> dict[str, float]:
        """Trainable parameter tensors per part (a tied weight in every part that uses it,
        block ones times their multiplicity), for the optimizer's per-tensor ops."""
        out: dict[str, float] = {}
        for g, (_fqn, _numel, parts, mult) in self.params.items():
            if g in self.frozen:
                continue
            for part in parts:
                out[part] = out.get(part, 0.0) + mult
        return out


def build_problem(graph: CapturedGraph, tp: int, dtype_bytes: int, *,
                  cache: StrategyCache | None = None) -> Problem:
    """Candidates, representatives, weighted edges and saved tensors for a tp degree.

    Args:
        graph: captured graph.
        tp: tensor-parallel degree.
        dtype_bytes: compute dtype width; floating tensors are priced at it.
        cache: shared StrategyCache.
    """
    base = next((d for d in range(2, tp) if tp % d == 0), None)  # smallest prime factor
    cands = node_strategies(graph, tp, cache=cache, base_tp=base)
    rep, shared = _representatives(graph, cands)
    nodes = [n for n in cands if rep[n] == n]
    layer_of = _layer_of(graph)
    part = _parts(graph, cands, layer_of)
    prob = Problem(graph, tp, cands, rep, nodes, {n: part[n] for n in nodes}, {},
                   constants=constant_like_nodes(graph), shared=shared)
    n_cap, total = max(graph.num_layers, 1), graph.total_layers
    for n in nodes:
        in_block = layer_of.get(n) is not None or part[n] == "layer"
        prob.weight[n] = (total if shared else total / n_cap) if in_block else 1.0
    prob.edges = _edges(graph, prob, layer_of, dtype_bytes)
    prob.core_nodes = frozenset(n for region in core_attention_regions(graph) for n in region)
    prob.saved, prob.core_saved, prob.core_inputs = saved_entries(graph, prob, layer_of,
                                                                  dtype_bytes)
    prob.kept_selective = kept_selective(graph, prob, layer_of, dtype_bytes)
    prob.params = _params(graph, prob)
    prob.frozen = frozenset(g for g, (fqn, *_rest) in prob.params.items()
                            if not graph.params[fqn].trainable)
    routed = set(expert_weights(graph))
    prob.experts = frozenset(g for g, (fqn, *_rest) in prob.params.items() if fqn in routed)
    return prob


# --- representatives --------------------------------------------------------------------------

def _layer_of(graph: CapturedGraph) -> dict[str, int]:
    return {name: k for k, names in graph.layer_nodes.items() for name in names}


def _representatives(graph: CapturedGraph, cands) -> tuple[dict[str, str], bool]:
    """[Note: layer sharing]; falls back to no sharing when the blocks do not align (same ops
    with the same shapes, position by position).

    Node k of every block gets the candidates common to node k of all blocks (in place, in
    `cands`): the first block may differ from the others only because its input comes from
    outside (a graph input is never Partial), and a shared choice must be valid in every block.
    """
    rep = {n: n for n in cands}
    blocks = [graph.layer_nodes[k] for k in sorted(graph.layer_nodes)]
    if len(blocks) < 2:
        return rep, True
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    first = blocks[0]
    aligned = all(len(b) == len(first) and all(
        nodes[a].target == nodes[c].target and graph.nodes[a].shapes == graph.nodes[c].shapes
        for a, c in zip(b, first)) for b in blocks[1:])
    if not aligned:
        return rep, False
    for i, name0 in enumerate(first):
        common = [c for c in cands[name0] if all(c in cands[b[i]] for b in blocks[1:])]
        for b in blocks:
            cands[b[i]] = common
    proposals: dict[str, set] = defaultdict(set)
    for block in blocks:
        for name, name0 in zip(block, first):
            rep[name] = name0
            for a, a0 in zip(tensor_args(nodes[name]), tensor_args(nodes[name0])):
                if a.op == "get_attr":
                    proposals[a.name].add(a0.name)
    block_nodes = {n for b in blocks for n in b}
    for g, targets in proposals.items():
        users_in_blocks = all(u.name in block_nodes for u in nodes[g].users)
        if len(targets) == 1 and users_in_blocks:
            rep[g] = next(iter(targets))
    return rep, True


def _parts(graph: CapturedGraph, cands, layer_of) -> dict[str, str]:
    """"layer" for block nodes; "post" for nodes downstream of a block; else "pre".
    A parameter takes the part of its consumers ("layer" wins, then "pre")."""
    part: dict[str, str] = {}
    for node in graph.gm.graph.nodes:
        if node.name not in cands:
            continue
        if node.name in layer_of:
            part[node.name] = "layer"
        elif node.op == "call_function" and any(part.get(a.name) in ("layer", "post")
                                                 for a in tensor_args(node)):
            part[node.name] = "post"
        else:
            part[node.name] = "pre"
    for node in graph.gm.graph.nodes:
        if node.op == "get_attr" and node.name in cands:
            kinds = {part.get(u.name, "pre") for u in node.users}
            part[node.name] = "layer" if "layer" in kinds else ("post" if kinds == {"post"}
                                                                 else "pre")
    return part


# --- edges ------------------------------------------------------------------------------------


def _grad_nodes(graph: CapturedGraph, params: set[str]) -> set[str]:
    """Nodes whose (floating) output depends on a parameter: a gradient flows into them."""
    out: set[str] = set()
    for node in graph.gm.graph.nodes:
        if node.op == "get_attr" and node.name in params:
            out.add(node.name)
        elif node.op == "call_function" and any(a.name in out for a in tensor_args(node)):
            meta = node_tensor_meta(graph, node)
            if any(m is not None and m[1].is_floating_point for m in meta):
                out.add(node.name)
    return out


def _edges(graph: CapturedGraph, prob: Problem, layer_of, dtype_bytes) -> list[Edge]:
    from autoplan.op_classes import NO_GRAD_OPS
    params = {nd.name for nd in graph.gm.graph.nodes
              if nd.op == "get_attr" and nd.name in prob.cands and nd.name not in prob.constants}
    grads = _grad_nodes(graph, params)
    raw: list[tuple] = []  # (u, k, v, j, kind)
    for v in graph.gm.graph.nodes:
        if v.op == "output":
            for u in tensor_args(v):
                raw.append((u, 0, None, 0))
            continue
        if v.name not in prob.cands or v.op != "call_function":
            continue
        for j, u in enumerate(tensor_args(v)):
            if u.name not in prob.cands:
                continue
            k = v.args[1] if v.target is operator.getitem else 0
            raw.append((u, k, v, j))
    n_cap, total = max(graph.num_layers, 1), graph.total_layers
    fanout: dict[tuple, int] = defaultdict(int)
    for u, k, v, j in raw:
        if v is not None and u.name not in layer_of and v.name in layer_of:
            fanout[(u.name, prob.rep[v.name], j)] += 1
    if n_cap == 1:  # one captured block: the residual stream enters the first block only
        stream = {node_tensor_meta(graph, u)[k] for u, k, v, j in raw
                  if u.name in layer_of and (v is None or v.name not in layer_of)}
        for key in fanout:
            u = next(n for n, *_ in raw if n.name == key[0])
            if node_tensor_meta(graph, u)[0] in stream:
                fanout[key] = 0
    merged: dict[tuple, Edge] = {}
    for u, k, v, j in raw:
        if u.name in prob.constants:
            continue  # constants run as plain tensors: slicing them is free, no gradient
        lu, lv = layer_of.get(u.name), (layer_of.get(v.name) if v is not None else None)
        if lu is None and u.op == "get_attr" and prob.part.get(prob.rep[u.name]) == "layer":
            lu = lv  # a block's own parameter: counted like the block's nodes
        if lu is not None and lv is not None:
            w = total / n_cap if lu == lv else (total - 1) / max(n_cap - 1, 1)
        elif lv is not None:
            w = total / n_cap if fanout[(u.name, prob.rep[v.name], j)] == n_cap else 1.0
        else:
            w = 1.0
        if not prob.shared and lu is not None and lv is not None and lu == lv:
            w = total / n_cap
        dst = OUTPUT if v is None else prob.rep[v.name]
        no_grad = v is not None and op_name(str(v.target)) in NO_GRAD_OPS
        where = _share_class(v, lu, lv, prob)
        edge = Edge(prob.rep[u.name], k, dst, j, w, tensor_bytes(graph, u, k, dtype_bytes),
                    u.name not in params, u.name in grads and not no_grad,
                    v is not None and v.target is operator.getitem,
                    "post" if v is None else prob.part[dst],
                    None if where is None else (prob.rep[u.name], k, where))
        key = (edge.src, k, dst, j)
        if key in merged:
            old = merged[key]
            share = old.share if old.share == edge.share else None
            edge = Edge(**{**old.__dict__, "weight": old.weight + w, "share": share})
        merged[key] = edge
    edges = list(merged.values())
    if graph.num_layers == 1 and total > 1:
        edges += _transition_edges(graph, prob, layer_of, edges)
    return edges


def _share_class(v: torch.fx.Node | None, lu: int | None, lv: int | None,
                 prob: Problem) -> str | None:
    """Where consumer `v` of a value from block `lu` sits ([Note: one redistribution per
    value]): "same" / "next" block, "in" (a value from outside the blocks), or its part outside
    the blocks; None for the graph output and a tuple element (nothing to share)."""
    if v is None or v.target is operator.getitem:
        return None
    if lv is not None:
        return "in" if lu is None else ("same" if lu == lv else "next")
    return prob.part.get(prob.rep[v.name], "pre")


def share_key(problem: Problem, producer: str, out_index: int, consumer: str) -> tuple | None:
    """The group of consumers of the captured graph that share one redistribution of
    `producer`'s output `out_index` ([Note: one redistribution per value]): (producer,
    out_index, the consumer's block index, or its part outside the blocks); None for the graph
    output ("output") and for consumers not in `problem`."""
    if consumer not in problem.rep:
        return None
    layer = problem.layer_of.get(consumer)
    if layer is not None:
        return (producer, out_index, "block", layer)
    return (producer, out_index, problem.part.get(problem.rep[consumer], "pre"))


def _transition_edges(graph, prob: Problem, layer_of, edges: list[Edge]) -> list[Edge]:
    """N = 1: price block k -> block k+1 by an edge from the block's output (the block node
    read by "post" nodes, with the input's shape) into the block's first-block-only inputs."""
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    outs = [e for e in edges if e.src in layer_of and prob.part.get(e.dst, "post") == "post"]
    extra = []
    for e in edges:
        if e.src in layer_of or e.dst not in layer_of or not e.scales or e.weight != 1.0:
            continue
        shape_in = node_tensor_meta(graph, nodes[e.src])[e.out_index]
        for o in outs:
            if node_tensor_meta(graph, nodes[o.src])[o.out_index] == shape_in:
                extra.append(Edge(o.src, o.out_index, e.dst, e.arg_index,
                                  graph.total_layers - 1, e.nbytes, True, e.grad, False, "layer",
                                  (o.src, o.out_index, "next")))
                break
    return extra


def _boundary_edge(problem: Problem) -> Edge | None:
    edges = [e for e in problem.edges if problem.part.get(e.src) == "layer"
             and (e.dst == OUTPUT or problem.part.get(e.dst) != "layer")]
    return max(edges, key=lambda e: e.nbytes, default=None)


def boundary_node(problem: Problem) -> str | None:
    """The ILP node whose output is the residual stream a block hands to the next one (the
    block's output read after the blocks), None without blocks."""
    edge = _boundary_edge(problem) if problem.num_layers else None
    return edge.src if edge is not None and edge.src in problem.cands else None


def boundary_bytes(problem: Problem) -> float:
    """I: global bytes of one block's input (the residual stream) at the captured batch, in
    the compute dtype (0.0 without blocks)."""
    edge = _boundary_edge(problem) if problem.num_layers else None
    return edge.nbytes if edge is not None else 0.0


def _params(graph: CapturedGraph, prob: Problem) -> dict[str, tuple]:
    fqns = {}
    for fqn, info in graph.params.items():
        for name in (fqn, *info.aliases):
            fqns[name] = fqn
    out = {}
    for node in graph.gm.graph.nodes:
        if node.op != "get_attr" or prob.rep.get(node.name) != node.name:
            continue
        fqn = fqns.get(str(node.target))
        if fqn is None or graph.params[fqn].is_buffer:
            continue
        parts = frozenset(prob.part.get(prob.rep.get(u.name, u.name), "pre")
                          for u in node.users if u.name in prob.rep) or frozenset({"pre"})
        mult = prob.weight.get(node.name, 1.0) if "layer" in parts else 1.0
        out[node.name] = (fqn, graph.params[fqn].numel, parts, mult)
    return out
