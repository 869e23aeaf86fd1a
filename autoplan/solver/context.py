"""Context parallelism in the search: the cp degrees it tries and the K/V collectives a
degree adds to a configuration's ILP coefficients (`with_context_parallel`).

How the search uses it: [Note: context parallelism] in cost_model/context_parallel.py.

Which cp the search tries then (`cp_degrees`): 1, and the powers of two with cp dividing the devices
left after tp, s divisible by 2 cp (the load-balanced chunks), chunks of at least
MIN_CHUNK_TOKENS tokens, and a fused attention op in every block (an attention spelled out in
matmuls and softmax has no K/V gather to price).
"""

from __future__ import annotations

import dataclasses

from autoplan.cost_model.context_parallel import attention_nodes, kv_bytes, kv_comm_s
from autoplan.graph import CapturedGraph
from autoplan.solver.costs import Costs
from autoplan.solver.problem import Problem
from autoplan.topology import Topology

__all__ = ["MIN_CHUNK_TOKENS", "cp_degrees", "attention_nodes", "with_context_parallel"]

MIN_CHUNK_TOKENS = 128
"""The shortest sequence chunk (s / (2 cp) tokens) the search gives a cp rank: one query tile
of fused attention (FlashAttention-2 processes queries in blocks of 128 rows, Dao 2023,
section 3.1 and its released kernels' kBlockM = 128). A search-space choice, not a cost: a
shorter chunk leaves the attention kernel's tiles partly empty, which the roofline does not
see, so such plans would be priced too well; it also keeps the search to the cp degrees that
long-context runs use (Llama 3: cp 16 at 128K tokens, chunks of 4096)."""


def cp_degrees(graph: CapturedGraph, seq_len: int, devices: int) -> list[int]:
    """The cp degrees to search ([Note: context parallelism]): 1, and powers of two
    dividing `devices` (the devices left after tp) with `seq_len` % (2 cp) == 0 and
    seq_len / (2 cp) >= MIN_CHUNK_TOKENS, when every captured block has a fused attention
    op."""
    out = [1]
    names = attention_nodes(graph)
    blocks = graph.num_layers or 0
    if not names or (blocks and len(names) < blocks):
        return out
    cp = 2
    while cp <= devices and seq_len // (2 * cp) >= MIN_CHUNK_TOKENS:
        if devices % cp == 0 and seq_len % (2 * cp) == 0:
            out.append(cp)
        cp *= 2
    return out


def with_context_parallel(problem: Problem, costs: Costs, cp: int, topology: Topology,
                          stride: int | None = None) -> Costs:
    """`costs` (built at the token scale divided by cp: costs.build_costs) with the K/V
    collectives of every attention node per candidate (`Costs.node_comm_s`, seconds per
    occurrence: the ILP multiplies by the node's weight) and the gathered
    K/V saved for backward added to its activations ([Note: context parallelism]).
    `stride`: the cp group's rank stride in the mesh, the problem's tp unless given (the
    search's bounds price the tp = 1 problem for a configuration of tp > 1, whose cp group
    sits at stride tp). Raises ValueError when the cp group cannot sit on the nodes."""
    if cp == 1:
        return costs
    tp = problem.tp
    stride = tp if stride is None else stride
    comm = dict(costs.node_comm_s)
    acts = dict(costs.act_bytes)
    for n in attention_nodes(problem.graph):
        if n not in problem.weight:  # another block's: its ILP node stands for it
            continue
        whole, heads = kv_bytes(problem.graph, n)
        whole *= costs.scale * cp  # the microbatch's whole sequence
        row, extra = [], list(acts.get(n, [0.0] * len(problem.cands[n])))
        for i, c in enumerate(problem.cands[n]):
            split = c.shard_factor > 1 and any(p.startswith("S(") for p in c.inputs[1:3])
            per_rank = whole / min(tp, heads) if split else whole
            row.append(kv_comm_s(per_rank, cp, stride, topology))
            # activation rows hold every block's tensors (the weight), as build_costs does
            extra[i] += per_rank * (cp - 1) / cp * problem.weight[n]
        comm[n] = row
        acts[n] = extra
    return dataclasses.replace(costs, node_comm_s=comm, act_bytes=acts)
