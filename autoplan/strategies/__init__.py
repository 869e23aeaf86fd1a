"""Candidate placements per graph node on the tensor-parallel (tp) mesh axis.

The candidates come from DTensor's own sharding rules (docs/design.md, "Placements"): for
each node we offer DTensor input placements and keep those it runs *without any implicit
redistribution*, with the output placement DTensor itself produces. The runtime then
redistributes a node's i-th tensor argument to `Candidate.inputs[i]` whenever the producer's
output placement differs, and DTensor runs the op exactly as planned (the solver's costs are
the collectives the runtime inserts, no more, no fewer).

[Note: argument order] `Candidate.inputs[i]` is the placement of the i-th fx Node found by
`tensor_args(node)`: positional args then kwargs, each walked depth-first the way
`torch.fx.node.map_arg` walks them (lists/tuples in order, `None` skipped). For
`aten.cat([a, b], d)` that is (a, b); for `aten.index.Tensor(x, [None, i])` it is (x, i).

[Note: node kinds] Nodes fall into kinds, each with its own candidate rule:
- placeholder (graph input, token ids): only R.
- parameter (get_attr of a parameter): R, or S(d) for each dim d it can be split on; never P.
- constant-like (depends on no parameter and no graph input: position ids, causal masks,
  rotary tables, buffers): the single candidate R, shard_factor 1; they run as plain tensors.
- getitem of a multi-output op: passes the chosen element's placement through.
- aten op with a DTensor rule: every verified (inputs -> outputs) combination, see below.
- aten.scaled_dot_product_attention: explicit rule (DTensor has none for it): q, k, v all R,
  all S(0) (batch) or all S(1) (heads, only when both the query and the key/value head counts
  divide by tp, so no rank ever holds less than one KV head -- case C3); the mask follows.
- `autoplan.experts` (mixture-of-experts, [Note: experts op]): explicit rule, all R or the
  experts split S(0) with a partial output (strategies/experts_candidates.py).
- any other op (no DTensor rule): only all-R, with a logged note naming the op.
- no tensor output (`aten._assert_tensor_metadata`): "ignored" -- no candidates, the runtime
  runs it on whatever it gets (see `ignored_nodes`).

A dim is split only when its size divides by tp and is at least tp (case C10: never shard a
dim smaller than the mesh axis), and never on a batch-carrying dim: batch splitting is data
parallelism, which the dp mesh axis does; keeping it off the tp axis also keeps every candidate
valid for any microbatch size (batch dims are found by propagating Shard(0) from the inputs
through DTensor's rules, `batch_dims`).

Enumeration: an op with a direct DTensor rule is probed with the all-R combination, every
single-argument change from it and the "all arguments alike" combinations; whenever DTensor
would redistribute, its suggestion (a valid combination) is probed too. A composite op
(aten.linear, [Note: composite ops] in _torch_compat/sharding_rules.py) gives no suggestion, so it
is probed with every combination up to 64 (else every one- and two-argument change). At most two
Partial inputs. A split that a view refuses, or a parameter split no consumer computes with, is then
pruned (`_prune`). For a tp with a divisor already planned, the divisor's candidates are
re-checked by size instead ([Note: divisor tp]). Results are cached by (op, argument
shapes/dtypes/allowed placements, static arguments, tp), so identical layers cost one layer.
Measured: a 2-layer llama3-8b graph for tp 2, 4, 8 in ~1 s cold, ~0.3 s with DTensor warm.

Files: this package's __init__ (`node_strategies`), candidate.py (`Candidate`, `StrategyCache`:
the types every file shares), nodes.py (the
graph helpers: tensor arguments, shapes, constant-like and ignored nodes, batch dims, DTensor
propagation of one node), probe.py (the candidates of one node: [Note: node kinds],
Enumeration, [Note: divisor tp]), prune.py (`_prune`), experts_candidates.py (the experts op's
rule), samples.py (`sample_facts`: where the samples are and which ops read across them,
[Note: sample dims]; read by the keying of random ops and by autoplan/batch_coupling.py).
"""

from __future__ import annotations

from autoplan.graph import CapturedGraph
from autoplan.strategies.candidate import Candidate, StrategyCache
from autoplan.strategies.nodes import (
    batch_dims, constant_like_nodes, ignored_nodes, node_tensor_meta, tensor_args,
)
# _propagate_node: re-exported, the tests import it from here.
from autoplan.strategies.nodes import _propagate_node  # noqa: F401
from autoplan.strategies.probe import _Context
from autoplan.strategies.prune import _prune

__all__ = ["Candidate", "node_strategies", "tensor_args", "constant_like_nodes",
           "ignored_nodes", "batch_dims", "node_tensor_meta", "StrategyCache"]


# --- candidates ------------------------------------------------------------------------------

def node_strategies(graph: CapturedGraph, tp: int, *, cache: StrategyCache | None = None,
                    base_tp: int | None = None) -> dict[str, list[Candidate]]:
    """Candidate placements on a tp-way mesh axis for every node of `graph`.

    Args:
        graph: the captured graph (global shapes).
        tp: size of the tensor-parallel mesh axis (1 gives every node its all-R candidate).
        cache: optional `StrategyCache` shared between calls.
        base_tp: a divisor of tp (> 1) whose candidates are computed first (or taken from
            `cache`); the tp candidates are then only those of base_tp that DTensor still
            accepts at tp. Exact, because a split valid on tp ranks is valid on any divisor
            of tp (every size check is a divisibility check) -- and much cheaper than probing.

    Returns:
        node name -> candidates, for placeholders, get_attr and call_function nodes in graph
        order (`ignored_nodes` are left out). See [Note: node kinds]; the all-R candidate is
        always present, first.

    Raises:
        ValueError: tp < 1, or a call_module / call_method node with users (capture should
            have inlined it; the message names the node).
    """
    if tp < 1:
        raise ValueError(f"node_strategies: tp={tp} must be >= 1")
    cache = cache if cache is not None else StrategyCache()
    if base_tp is not None and not (1 < base_tp < tp and tp % base_tp == 0):
        raise ValueError(f"node_strategies: base_tp={base_tp} must be a divisor of tp={tp} "
                         "between 1 and tp")
    if base_tp is not None:
        node_strategies(graph, base_tp, cache=cache)
    ctx = _Context(graph, tp, cache, base_tp)
    out: dict[str, list[Candidate]] = {}
    for node in graph.gm.graph.nodes:
        if node.op == "output" or node.name in ctx.ignored:
            continue
        if node.op in ("call_module", "call_method"):
            if node.users:
                raise ValueError(f"node {node.name!r} is a {node.op} ({node.target}); the planner "
                                 "needs an aten graph (capture inlines modules)")
            continue
        out[node.name] = ctx.candidates(node, out)
    if tp > 1:
        _prune(graph, out)
    return out
