"""Context parallelism in the cost model: the sequence split across the cp axis.

[Note: context parallelism] With context parallelism of degree cp (torchtitan's `cp` mesh
axis, torch.distributed.tensor.experimental.context_parallel; Llama 3 405B trained its
128K-token phase with cp 16, Dubey et al. 2024, section 3.3.2), every sample's sequence is cut
into 2 cp chunks and cp rank i holds chunks i and 2 cp - 1 - i (causal load balancing: under a
causal mask chunk j attends to j + 1 chunks, so each rank does (i + 1) + (2 cp - i) = 2 cp + 1
chunk-pairs of attention, the same on every rank). Every op but attention works on the rank's
own tokens; attention needs the keys and values of the whole sequence. What this changes in
the cost model, per microbatch of b samples of s tokens:

- compute and activations: each rank holds b s / cp tokens, so every op's FLOPs, bytes and
  saved tensors are those of b s / cp tokens (costs.build_costs at the token scale divided by
  cp). Attention, quadratic in s, also takes 1/cp of the whole sequence's work per rank: its
  queries are s / cp rows against all s keys, and the causal balancing above makes the
  masked-out half the same on every rank (the graph's attention FLOPs, whatever they count for
  the mask, divide by cp exactly when the graph is captured at the planned s);
- communication (`with_context_parallel`): the runtime all-gathers K and V over the cp group
  before each attention (forward) and reduce-scatters their gradients dK, dV after it
  (backward): per attention op and microbatch

      t_cp = 2 [all_gather(n_kv, cp) + reduce_scatter(n_kv, cp)],   n_kv = b s h_kv d e / t'

  with h_kv the key/value heads before GQA's expansion (the gather happens before
  `repeat_kv`), d the head dim, e the bytes per element and t' = min(tp, h_kv) when the
  attention candidate splits heads on the tp axis (1 otherwise): every tp rank needs at least
  one key/value head. Collective times are `comm.collective_time_s` over the cp group, which
  has stride tp on the (pp, dp, cp, tp) mesh: NVLink while cp x tp fits in a node, the
  hierarchical inter-node algorithm beyond ([Note: group layout] in cost_model/comm.py). The
  collectives are not overlapped with compute (the runtime issues them in line, like the
  tp redistributions), so they are exposed;
- memory: the gathered K and V (n_kv each, (cp - 1) / cp of them beyond the rank's own chunks)
  are saved by attention for its backward; added to the attention node's activations without
  checkpointing. Under selective or full checkpointing attention's inputs are recomputed, so
  the all-gather runs again in the backward (its forward time added to the backward, like
  every recomputed forward: solver/checkpointing.py);
- gradient reduction and ZeRO: the cp ranks hold the same parameters and their gradients are
  partial sums over their tokens, so they reduce and shard like data-parallel ranks: the group
  is dp x cp (pipeline.Config.dp_shard; torchtitan's dp_shard x cp FSDP mesh).

Ring attention (p2p of K/V chunks overlapped with the attention of the previous chunk) would
hide most of t_cp; it is not what the runtime does, so it is not what is priced.

When the search takes cp > 1 (unless the user fixes cp; `planner._plan` plans with cp = 1
first, then searches cp > 1): where no configuration with cp = 1 fits in memory, where the
cp = 1 plan needs CPU offload, and otherwise only for a plan faster than the cp = 1 one even
at the worst of the step-time error band (`planner._cp_ceiling_s`: predicted x (1 + high) below
the cp = 1 plan's x (1 + low); the search runs under that ceiling, so a configuration bounded
above it costs no ILP). What the price above leaves out -- attention and matmul kernels on
s / cp-token chunks run below the efficiency of whole sequences, the K/V collectives of every
layer compete with the tp ones -- would otherwise decide cp on the strength of a few percent
the model cannot vouch for. Context parallelism is a memory lever for long sequences (Llama 3
used it in its 128K phase), and it also takes devices off dp x pp: where the global batch is
small for the devices (128 sequences of 128K tokens on 16,384 GPUs) a cp = 1 plan that fits
has a few microbatches for a deep pipeline and is mostly bubble, and cp restores the
microbatches (Dubey et al. 2024, section 3.3.2, name the same batch constraint).
`@autoparallel` searches cp the same way where the runtime can run it for the model, batch and
loss (runtime/checks.py context_parallel_refusal), and plans cp 1 otherwise unless given cp.

What the runtime runs (autoplan/passes/context.py, runtime/step_inputs.py; a given cp with dp,
tp, pp and ZeRO, eager -- runtime/checks.py refuses the rest by name) against what is
priced above:

- the runtime graph is captured at s / cp tokens per sample, so every op but attention runs
  on the rank's b s / cp tokens, as priced; the position index (an integer arange of the
  local length: HF's cache_position / position_ids, GPT-2's position-embedding index) is
  replaced by the rank's global positions, and the model's own causal mask is dropped;
- each fused attention all-gathers K and V over the cp group (all_gather_single_autograd,
  whose backward reduce-scatters dK and dV: the priced pair) before GQA's expansion where the
  graph spells it as HF's repeat_kv (unsqueeze -> expand -> reshape; attention then runs with
  enable_gqa) or the attention op has enable_gqa itself: h_kv heads, as priced. Another
  spelling of the expansion is gathered after it, h / h_kv times the priced bytes: a
  cost-model mismatch, not a numerical one;
- attention puts the gathered keys back in sequence order (one copy of the gathered K and V,
  transient, not priced) and runs each query chunk j against key chunks 0..j under a
  bottom-right-aligned causal mask: (i + 1) + (2 cp - i) chunk pairs on rank i, the balanced
  work priced above, with no s / cp x s mask materialised;
- under checkpointing the block's forward is recomputed with its gathers, as priced;
- under pp every stage is rewritten on its own; the positions-derived values a later stage
  takes (rotary cos/sin, GPT-2's position embeddings) cross the stage boundary already at the
  rank's global positions, and the boundary activations are the rank's b s / cp tokens, as
  priced;
- the token loss is summed per rank over the global batch's trained tokens and the step's
  loss all-reduced over dp x cp (a scalar, not priced); gradients reduce and shard over the
  flattened dp x cp mesh (FSDP2 / replicate, or ZeRO-1's sharded optimizer over it).

- under tp, attention runs on the rank's heads (q, k, v one placement, as sharding.sdpa_local):
  the gather moves the rank's h_kv / t' heads, as priced, K and V taken before repeat_kv
  and moved to the query's placement inside the cp attention (passes/context_parallel.py
  `gathered_kv`). Where tp does not divide h_kv, the gather takes the expanded K and V
  (h / h_kv times the priced bytes; the traffic model prices what moves).

So the planner can produce cp plans the runtime does not run yet: a model with dropout, a
batch other than (input_ids, labels), compile=True.

Which cp the search tries then (`cp_degrees`): 1, and the powers of two with cp dividing the devices
left after tp, s divisible by 2 cp (the load-balanced chunks), chunks of at least
MIN_CHUNK_TOKENS tokens, and a fused attention op in every block (an attention spelled out in
matmuls and softmax has no K/V gather to price).
"""

from __future__ import annotations

import dataclasses

from autoplan.cost_model.context import attention_nodes, kv_bytes, kv_comm_s
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
