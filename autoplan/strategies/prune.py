"""Pruning of the candidates of a whole graph (`_prune`): splits a view refuses, and parameter
splits no consumer computes with.
"""

from __future__ import annotations

import math

import torch

from autoplan.graph import CapturedGraph
from autoplan.strategies.candidate import Candidate
from autoplan.strategies.nodes import tensor_args

aten = torch.ops.aten
_VIEW_LIKE = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                        aten.unflatten.int})


def _prune(graph: CapturedGraph, cands: dict[str, list[Candidate]]) -> None:
    """Drop splits that cut through a logical unit, to a fixpoint, in place.

    1. An output S(d) that a view/reshape consumer refuses (DTensor cannot split that dim evenly
       into the view's dims: the split would cut through a unit such as an attention head, e.g.
       2 KV heads of width 4 as a dim of 8 split 4 ways -- case C3) is not offered.
       A view that merges dim d into the dims before it (the flatten of (B, S, H) into
       (B S, H) before a matmul) refuses S(d) without cutting a unit: DTensor cannot express
       the merged split (it would be strided), but gathering S(d) -> R before the view is a
       valid plan -- the all-gather in front of a column-parallel matmul under Megatron's
       sequence parallelism (Korthikanti et al. 2022, section 4.2.2) -- so such a refusal
       does not prune.
    2. A parameter is split on the tp axis only in a way some consumer computes with directly
       (storage-only sharding of parameters is ZeRO's business on the dp axis).
    The all-R candidate is never dropped.
    """
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    users = {name: [(u, i) for u in nodes[name].users if u.name in cands
                    for i, a in enumerate(tensor_args(u)) if a is nodes[name]]
             for name in cands}
    # A worklist: a node is checked again only when a consumer lost candidates (its producers
    # are what that can affect). Removal is monotone, so the fixpoint is the same as
    # re-checking every node until nothing changes; consumers first, so one pass mostly does.
    pending, queued = list(cands), set(cands)
    while pending:
        name = pending.pop()
        queued.discard(name)
        lst = cands[name]
        keep = [c for c in lst if _usable(nodes[name], c, users[name], cands)]
        if len(keep) < len(lst):
            cands[name] = keep
            for a in tensor_args(nodes[name]):
                if a.name in cands and a.name not in queued:
                    pending.append(a.name)
                    queued.add(a.name)


def _usable(node, cand: Candidate, users, cands) -> bool:
    if all(p == "R" for p in cand.outputs) or len(cand.outputs) != 1:
        return True
    out = cand.outputs[0]
    accepted = [any(c.inputs[i] == out for c in cands[u.name]) for u, i in users]
    if node.op == "get_attr":
        return any(accepted)
    if not out.startswith("S("):
        return True
    dim = int(out[2:-1])
    return all(ok or _merges_left(node, u, dim)
               for (u, _), ok in zip(users, accepted) if u.target in _VIEW_LIKE)


def _merges_left(node, view, dim: int) -> bool:
    """True when `view` merges `node`'s dim `dim` with at least one dim before it into one
    output dim (a flatten), so that its split cuts no unit (rule 1 of `_prune`)."""
    src, dst = node.meta.get("val"), view.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor) or dim == 0:
        return False
    ins, outs = [int(s) for s in src.shape], [int(s) for s in dst.shape]
    if dim >= len(ins):
        return False
    lead = math.prod(ins[:dim])  # elements before dim: a flatten ends a group at dim
    upto = math.prod(ins[:dim + 1])
    prefix = 1
    for size in outs:
        start, prefix = prefix, prefix * size
        if prefix == upto:
            return start < lead  # one output dim spans dims before dim and dim itself
        if prefix > upto:
            return False
    return False

