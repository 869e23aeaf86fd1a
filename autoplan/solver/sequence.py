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
- memory: a saved tensor is divided by tp when its owner's output is S(s) (solver/costs.py);
  a gathered input (S(s) -> R into a matmul, through flattening views) is saved as its shard
  and all-gathered again in the backward, as Megatron-LM's sequence-parallel linear does
  (Korthikanti et al. 2022, sec. 4.2.2; runtime: [Note: gathered inputs saved sharded] in
  passes/regather.py; cost: its view chain's root owns it, Problem.regathered, and the gather
  again is [Note: regather priced] in solver/costs.py); under "selective" checkpointing the
  block input each block keeps is priced at the placement of the block's output
  (solver/checkpointing.py), so an S(s) residual stream holds 1/tp; a pipeline stage's output
  kept for its backward and its receive buffers are the block output's local tensor, 1/tp of
  it when S(s) (Costs.boundary_bytes, [Note: memory per rank] in cost_model/rank_memory.py).
  With "core-attention" checkpointing a block of a GPT then holds 34 s b h / t bytes, Table 2's
  "selective + sequence parallelism" row (tests/test_sequence_parallel.py).

So free planning picks sequence parallelism wherever it is cheapest.

Known limit: where a flatten view sits between the norm and a column-parallel matmul (GPT-2's
Conv1D: view (B, S, H) -> (B S, H), then addmm), the backward of the all-gather S(s) -> R on
the edge into the view is priced as a slice and Megatron's f all-reduce is charged on the
view -> addmm edge, while DTensor reduce-scatters the partial gradient (P -> S(s)) in the
all-gather's backward: sequence parallelism there is over-priced by an all-reduce minus a
reduce-scatter per column-parallel input, and the ILP sometimes routes S(s) -> S(h) by an
all-to-all before the view instead. A linear on (B, S, H) (Llama) has no view: its gather's
backward is priced as the reduce-scatter it is (costs.py, g = "P" for a split consumer). `restrict` fixes it either
way for the *sequence-parallel region*: the block's nodes that are neither views nor matmuls
(nor casts or tuple elements of a matmul's output) and whose one output has the residual stream's
shape (B, S, H) -- norms, dropout, residual adds. `True` keeps only their S(s) candidates
(where they have one); `False` keeps only their unsplit candidates (R, P): plain Megatron
tensor parallelism, whose norm regions are replicated -- not merely "no S(s)", since a residual
stream split on the hidden dim, S(h), would hold 1/tp too. `placed` says how much of a plan's
region is S(s) (the report's and bench/published.py's "sequence parallelism" line).
"""

from __future__ import annotations

import operator

from autoplan.graph import CapturedGraph
from autoplan.op_classes import MATMUL_OPS, VIEW_OPS, op_name
from autoplan.plan import Plan
from autoplan.solver.problem import Problem
from autoplan.strategies import constant_like_nodes, node_tensor_meta, tensor_args

__all__ = ["residual_shape", "seq_dim", "region_nodes", "sequence_parallel_region", "placed",
           "restrict"]


def residual_shape(graph: CapturedGraph) -> tuple[int, ...]:
    """The shape of the residual stream: the output of block 0 that a later block or the part
    after the blocks reads (global shape at the captured batch).

    Raises ValueError when the graph has no repeated block or no such output."""
    if not graph.layer_nodes:
        raise ValueError("sequence parallelism needs repeated blocks; this graph has none")
    block = graph.layer_nodes[min(graph.layer_nodes)]
    first = set(block)
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    for name in reversed(block):
        if any(u.name not in first for u in nodes[name].users):
            meta = node_tensor_meta(graph, nodes[name])[0]
            if meta is not None:
                return tuple(meta[0])
    raise ValueError("sequence parallelism: no output of the first block is read after it")


def seq_dim(graph: CapturedGraph) -> int:
    """The sequence dim of the residual stream: its first dim after the batch dim (0) whose
    size is the captured sequence length.

    Raises ValueError when the graph has no sequence length or no such dim."""
    shape, seq = residual_shape(graph), graph.seq_len
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


def region_nodes(graph: CapturedGraph) -> list[str]:
    """Nodes of every captured block in the sequence-parallel region (module docstring), in
    graph order."""
    shape = residual_shape(graph)
    derived = _matmul_derived(graph)
    consts = constant_like_nodes(graph)
    block = {n for names in graph.layer_nodes.values() for n in names}
    out = []
    for node in graph.gm.graph.nodes:
        if (node.name not in block or node.op != "call_function" or node.name in derived
                or node.name in consts or op_name(str(node.target)) in VIEW_OPS):
            continue
        metas = node_tensor_meta(graph, node)
        if len(metas) == 1 and metas[0] is not None and tuple(metas[0][0]) == shape:
            out.append(node.name)
    return out


def sequence_parallel_region(problem: Problem) -> set[str]:
    """ILP nodes of the sequence-parallel region (module docstring)."""
    return {problem.rep[n] for n in region_nodes(problem.graph)
            if problem.rep.get(n) in problem.part}


def placed(graph: CapturedGraph, plan: Plan) -> tuple[int, int]:
    """(nodes of the region placed S(seq) on the tp axis, nodes of the region) in `plan`'s
    strategies: (n, n) is Megatron-LM's sequence parallelism, (0, n) plain tensor parallelism;
    (0, 0) at tp 1 or without repeated blocks."""
    if plan.mesh.tp == 1 or not graph.layer_nodes:
        return 0, 0
    placement = f"S({seq_dim(graph)})"
    outs = {st.node: st.outputs[0] for st in plan.strategies if st.outputs}
    region = [n for n in region_nodes(graph) if n in outs]
    return sum(outs[n] == placement for n in region), len(region)


def restrict(problem: Problem, on: bool) -> Problem:
    """`problem` with sequence parallelism fixed on (`on`: S(s) outputs only) or off (R or P
    outputs only) for its region, in place (new candidate lists; the strategy cache's are
    shared). A node left without candidates keeps its own. A no-op at tp 1.

    Raises ValueError as `seq_dim` does."""
    if problem.tp == 1:
        return problem
    placement = f"S({seq_dim(problem.graph)})"
    region = sequence_parallel_region(problem)
    for name in list(problem.cands):
        if problem.rep.get(name) not in region:
            continue
        cands = problem.cands[name]
        keep = ([c for c in cands if c.outputs[0] == placement] if on else
                [c for c in cands if not c.outputs[0].startswith("S(")])
        if keep:
            problem.cands[name] = keep
    return problem
