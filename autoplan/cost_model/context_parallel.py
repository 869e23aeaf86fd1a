"""Context parallelism priced: the fused attention ops of a graph, the bytes of their keys and
values, and the time of the cp group's K/V collectives (the search adds them to a
configuration's ILP coefficients: solver/context.py `with_context_parallel`).

[Note: context parallelism] With context parallelism of degree cp (torchtitan's `cp` mesh
axis, torch.distributed.tensor.experimental.context_parallel; Llama 3 405B trained its
128K-token phase with cp 16, Dubey et al. 2024, section 3.3.2), every sample's sequence is cut
into 2 cp chunks and cp rank i holds chunks i and 2 cp - 1 - i (causal load balancing: under a
causal mask chunk j attends to j + 1 chunks, so each rank does (i + 1) + (2 cp - i) = 2 cp + 1
chunk-pairs of attention, the same on every rank). Every op but attention works on the rank's
own tokens; attention needs the keys and values of the whole sequence. What this changes in
the cost model, per microbatch of b samples of s tokens:

- compute and activations: each rank holds b s / cp tokens, so every op's FLOPs, bytes and
  saved tensors are those of b s / cp tokens (solver/costs.py build_costs at the token scale divided
  by cp). Attention, quadratic in s, also takes 1/cp of the whole sequence's work per rank: its
  queries are s / cp rows against all s keys, and the causal balancing above makes the
  masked-out half the same on every rank (the graph's attention FLOPs, whatever they count for
  the mask, divide by cp exactly when the graph is captured at the planned s);
- communication (solver/context.py `with_context_parallel`): the runtime all-gathers K and V over
  the cp group before each attention (forward) and reduce-scatters their gradients dK, dV after it
  (backward): per attention op and microbatch

      t_cp = 2 [all_gather(n_kv, cp) + reduce_scatter(n_kv, cp)],   n_kv = b s h_kv d e / t'

  with h_kv the key/value heads before GQA's expansion (the gather happens before
  `repeat_kv`), d the head dim, e the bytes per element and t' = min(tp, h_kv) when the
  attention candidate splits heads on the tp axis (1 otherwise): every tp rank needs at least
  one key/value head. Collective times are `comm.collective_time_s` (`kv_comm_s`) over the cp group,
  which has stride tp on the (pp, dp, cp, tp) mesh: NVLink while cp x tp fits in a node, the
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
  is dp x cp (config.Config.dp_shard; torchtitan's dp_shard x cp FSDP mesh).

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

What the runtime runs (autoplan/passes/context_parallel.py, runtime/step_inputs.py; a given cp with
dp, tp, pp and ZeRO, eager -- runtime/checks.py refuses the rest by name) against what is
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
"""

from __future__ import annotations

import torch
import torch.fx

from autoplan.cost_model.comm import collective_time_s
from autoplan.graph import CapturedGraph
from autoplan.op_classes import ATTENTION_OPS, VIEW_OPS, op_name
from autoplan.topology import Topology

__all__ = ["attention_nodes", "kv_bytes", "kv_comm_s"]


def attention_nodes(graph: CapturedGraph) -> list[str]:
    """Names of the fused attention nodes of the captured graph (ATTENTION_OPS)."""
    return [name for name, info in graph.nodes.items()
            if op_name(info.target) in ATTENTION_OPS]


def _fx(graph: CapturedGraph, name: str) -> torch.fx.Node:
    for node in graph.gm.graph.nodes:
        if node.name == name:
            return node
    raise KeyError(name)


def _numel(node) -> int:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.numel() if isinstance(val, torch.Tensor) else 0


def kv_bytes(graph: CapturedGraph, name: str) -> tuple[float, int]:
    """(bytes of K plus V before GQA's expansion, at the captured batch and sequence;
    key/value heads) of attention node `name`: each of its args 1 and 2 (B, H, S, D) traced
    back through view-like ops (HF's repeat_kv: expand + reshape) to its smallest form."""
    node = _fx(graph, name)
    total, heads = 0.0, 0
    for arg in node.args[1:3]:
        val = arg.meta["val"]
        smallest, cur = val.numel(), arg
        while isinstance(cur, torch.fx.Node) and op_name(str(cur.target)) in VIEW_OPS and \
                cur.args and isinstance(cur.args[0], torch.fx.Node):
            cur = cur.args[0]
            if _numel(cur):
                smallest = min(smallest, _numel(cur))
        total += smallest * val.element_size()
        heads = max(1, round(val.shape[1] * smallest / val.numel()))
    return total, heads


def kv_comm_s(kv_nbytes: float, cp: int, tp: int, topology: Topology) -> tuple[float, float]:
    """(forward, backward) seconds of the cp group's K/V collectives for `kv_nbytes` (K and V
    together, the whole sequence, per rank): an all-gather of each forward, a reduce-scatter
    of each gradient backward ([Note: context parallelism])."""
    if cp == 1 or kv_nbytes <= 0:
        return 0.0, 0.0
    one = kv_nbytes / 2
    fwd = 2 * collective_time_s("all_gather", one, cp, topology, stride=tp)
    bwd = 2 * collective_time_s("reduce_scatter", one, cp, topology, stride=tp)
    return fwd, bwd
