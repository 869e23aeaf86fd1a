"""Sequence parallelism (Megatron-LM, Korthikanti et al. 2022, section 4.2.2) as placements.

[Note: sequence parallelism] In the tp group, the regions of a block outside its tensor-
parallel matmuls -- layer norm / RMSNorm, dropout, the residual adds -- hold their activations
split on the sequence dim, `Shard(s)`; the all-reduce of a row-parallel matmul's partial output
becomes a reduce-scatter onto that dim (P -> S(s)) and the input of a column-parallel matmul an
all-gather from it (S(s) -> R). The placement ILP expresses this without a new construct:

- candidates: every elementwise op, norm and add of the block offers S(s) on the tp axis
  (DTensor's own rules; strategies/), and a flattening view before a matmul no longer prunes it
  (strategies/prune.py, rule 1);
- communication: P -> S(s) is priced as a reduce-scatter and S(s) -> R as an all-gather, each
  with the bytes of the full tensor (cost_model.comm.redistribute_time_s): together the
  all-reduce's volume, forward and backward (the backward of each is the other);
- memory: a saved tensor is divided by tp when its owner's output is S(s) (solver/costs.py), and
  under "selective" checkpointing the block input each block keeps is priced at the placement
  of the block's output (solver/checkpointing.py), so an S(s) residual stream holds 1/tp.

So free planning picks sequence parallelism wherever it is cheapest. `restrict` fixes it either
way for the *sequence-parallel region*: the block's nodes that are neither views nor matmuls
(nor casts or tuple elements of a matmul's output) and whose one output has the residual stream's
shape (B, S, H) -- norms, dropout, residual adds. `True` keeps only their S(s) candidates
(where they have one), `False` drops those.
"""

from __future__ import annotations

import operator

import torch.fx

from autoplan.cost_model.compute import MATMUL_OPS, VIEW_OPS, op_name
from autoplan.solver.problem import Problem
from autoplan.strategies import node_tensor_meta, tensor_args

__all__ = ["seq_dim", "sequence_parallel_region", "restrict"]


def residual_shape(problem: Problem) -> tuple[int, ...]:
    """The shape of the residual stream: the output of block 0 that a later block or the part
    after the blocks reads (global shape at the captured batch).

    Raises ValueError when the graph has no repeated block or no such output."""
    graph = problem.graph
    if not graph.layer_nodes:
        raise ValueError("sequence parallelism needs repeated blocks; this graph has none")
    first = set(graph.layer_nodes[min(graph.layer_nodes)])
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    for name in reversed(graph.layer_nodes[min(graph.layer_nodes)]):
        if any(u.name not in first for u in nodes[name].users):
            meta = node_tensor_meta(graph, nodes[name])[0]
            if meta is not None:
                return tuple(meta[0])
    raise ValueError("sequence parallelism: no output of the first block is read after it")


def seq_dim(problem: Problem) -> int:
    """The sequence dim of the residual stream: its first dim after the batch dim (0) whose
    size is the captured sequence length.

    Raises ValueError when the graph has no sequence length or no such dim."""
    shape, seq = residual_shape(problem), problem.graph.seq_len
    dims = [d for d in range(1, len(shape)) if shape[d] == seq]
    if not seq or not dims:
        raise ValueError(f"sequence parallelism: no dim of the residual stream {shape} has the "
                         f"sequence length {seq}")
    return dims[0]


def _matmul_derived(graph) -> set[str]:
    """Nodes that are a matmul's output, or a view, cast or tuple element of one."""
    out: set[str] = set()
    for node in graph.gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(str(node.target))
        passes = node.target is operator.getitem or name in VIEW_OPS or name in ("to",
                                                                                 "_to_copy")
        if name in MATMUL_OPS or (passes and any(a.name in out for a in tensor_args(node))):
            out.add(node.name)
    return out


def sequence_parallel_region(problem: Problem) -> set[str]:
    """ILP nodes of the sequence-parallel region (module docstring)."""
    graph, shape = problem.graph, residual_shape(problem)
    derived = _matmul_derived(graph)
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    region = set()
    for n in problem.nodes:
        node: torch.fx.Node = nodes[n]
        if (problem.part[n] != "layer" or node.op != "call_function" or n in derived
                or n in problem.constants or op_name(str(node.target)) in VIEW_OPS):
            continue
        metas = node_tensor_meta(graph, node)
        if len(metas) == 1 and metas[0] is not None and tuple(metas[0][0]) == shape:
            region.add(n)
    return region


def restrict(problem: Problem, on: bool) -> Problem:
    """`problem` with sequence parallelism fixed on (`on`) or off for its region, in place
    (new candidate lists; the strategy cache's are shared). Nodes of the region without an
    S(s) candidate keep theirs when `on`. A no-op at tp 1.

    Raises ValueError as `seq_dim` does."""
    if problem.tp == 1:
        return problem
    placement = f"S({seq_dim(problem)})"
    region = sequence_parallel_region(problem)
    for name in list(problem.cands):
        if problem.rep.get(name) not in region:
            continue
        cands = problem.cands[name]
        split = [c for c in cands if c.outputs[0] == placement]
        keep = split if on else [c for c in cands if c.outputs[0] != placement]
        if keep:
            problem.cands[name] = keep
    return problem
