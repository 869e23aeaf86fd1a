"""Context parallelism in a stage graph: the runtime's half of [Note: context parallelism]
(autoplan/solver/context.py).

The stage graph is captured at the cp rank's own tokens, b x s / cp (the same model, the
same node names, every view shape already local), and this pass rewrites what the local
capture gets wrong:

1. every fused attention (`aten.scaled_dot_product_attention`) becomes
   `context_parallel_attention`: K and V all-gathered along the sequence dim over the cp group
   (an autograd-aware functional collective: its backward reduce-scatters dK and dV), and
   the rank's two query chunks against the keys up to their own, causal on *global*
   positions (`load_balanced_attention`: no s / cp x s mask is built). Where
   K and V reach attention through GQA's `repeat_kv` (unsqueeze -> expand -> reshape, Hugging
   Face's spelling) the gather takes the tensor before the expansion (h_kv heads, as the cost
   model prices it) and attention runs with `enable_gqa`;
2. the mask the model built for its (local) attention is dropped with the ops only it used:
   it is accepted only when it is the causal mask (or all True: non-causal) computed from
   constants (a mask that reads a graph input -- padding, documents, a user's mask -- is
   refused, and so is any other pattern, e.g. a sliding window);
3. every position source -- an integer `aten.arange(0, s / cp)` still in the graph once the
   mask is gone: Hugging Face's `cache_position` / `position_ids`, GPT-2's position-embedding
   index -- is replaced by the rank's global positions (chunks i and 2 cp - 1 - i). A graph
   with none is refused (its positions come from somewhere this pass cannot see).

Pure graph rewriting (in place); the process group is named by its group name, so the graph
module's code stays plain Python.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from autoplan._torch_compat import all_gather_autograd, causal_lower_right_bias
from autoplan.op_classes import ATTENTION_OPS, op_name
from autoplan.passes.sharding import reshape as placed_reshape, run_replicated, sdpa_local

__all__ = ["check_whole_graph", "position_sources", "chunk_positions",
           "load_balanced_attention", "context_parallel_attention", "apply_context_parallel"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_FUSED = (_SDPA, sdpa_local)  # apply_placements swaps the aten op for sdpa_local
_ARANGES = (torch.ops.aten.arange.default, torch.ops.aten.arange.start,
            torch.ops.aten.arange.start_step)
_RESHAPES = (torch.ops.aten.reshape.default, torch.ops.aten.view.default,
             torch.ops.aten._unsafe_view.default, placed_reshape)  # the last: apply_placements'



def chunk_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of cp rank `rank`'s tokens: the sequence cut into 2 cp chunks of
    seq_len / (2 cp), chunks `rank` and 2 cp - 1 - `rank`, in that order. (seq_len / cp,)
    int64. Raises ValueError when seq_len is not divisible by 2 cp."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism: seq_len {seq_len} is not divisible by "
                         f"2 x cp = {2 * cp} (the load-balanced chunks)")
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def load_balanced_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int,
                            rank: int, *, causal: bool, scale: float | None = None,
                            enable_gqa: bool = False) -> torch.Tensor:
    """Attention of cp rank `rank`'s queries q (B, H, s / cp, D) -- sequence chunks `rank` and
    2 cp - 1 - `rank` of c = s / (2 cp) tokens each -- against the whole sequence's keys k and
    values v (B, H_kv, s, D) as the cp group's all-gather leaves them: group-rank order, rank
    r's two chunks after rank r - 1's. Returns (B, H, s / cp, D), causal attention over the
    whole sequence (Vaswani et al. 2017) restricted to the rank's query rows.

    The keys are put back in sequence order, and query chunk j attends to key chunks 0..j
    under the causal mask aligned at the bottom right (torch's `causal_lower_right`: a query
    at row t of its chunk sees keys up to j c + t), so no s / cp x s mask is built and the
    fused kernels still apply; the two calls cover (rank + 1) + (2 cp - rank) chunk pairs,
    2 cp + 1 on every rank (the load balancing of [Note: context parallelism]).
    `causal=False`: every key, in any order."""
    if not causal:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa)
    c = q.shape[2] // 2
    # sequence chunk j sits at slot 2 j (j < cp: rank j's first) or 2 (2 cp - 1 - j) + 1
    slots = [2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)]
    k = torch.cat([k.narrow(2, slot * c, c) for slot in slots], dim=2)
    v = torch.cat([v.narrow(2, slot * c, c) for slot in slots], dim=2)
    out = []
    for half, j in enumerate((rank, 2 * cp - 1 - rank)):
        keys = (j + 1) * c
        out.append(F.scaled_dot_product_attention(
            q.narrow(2, half * c, c), k.narrow(2, 0, keys), v.narrow(2, 0, keys),
            attn_mask=causal_lower_right_bias(c, keys), scale=scale, enable_gqa=enable_gqa))
    return torch.cat(out, dim=2)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               group_name: str, cp: int, rank: int, causal: bool,
                               scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """One cp rank's attention: its queries q (B, H, s / cp, D) against K and V all-gathered
    along the sequence dim (2) over the cp group `group_name` (k, v: (B, H_kv, s / cp, D),
    gathered to (B, H_kv, s, D) in group-rank order), `load_balanced_attention`. The gathers'
    backward reduce-scatters dK and dV. Returns (B, H, s / cp, D).

    Under tensor parallelism q, k, v are DTensors on the tp mesh with one placement (heads
    Shard(1), batch Shard(0) or Replicate, as sharding.sdpa_local takes them): attention runs
    on the local shards and returns a DTensor with q's placement. Raises ValueError when their
    placements differ after K and V were moved to q's (h_kv heads taken before GQA's
    expansion may be planned at another placement than the expanded ones)."""
    if isinstance(q, DTensor):
        if not any(p.is_partial() for p in (*k.placements, *v.placements)):
            k = k.redistribute(k.device_mesh, q.placements)  # no-op where they agree
            v = v.redistribute(v.device_mesh, q.placements)
        local_q, local_k = q.to_local().shape[1], k.to_local().shape[1]
        if k.placements != q.placements or v.placements != q.placements or \
                any(p.is_partial() for p in q.placements) or \
                local_k == 0 or local_q * k.shape[1] != local_k * q.shape[1]:
            raise ValueError(
                f"context parallelism: q, k, v reach attention at {q.placements}, "
                f"{k.placements}, {v.placements} ({local_q} query and {local_k} key heads "
                f"here of {q.shape[1]} and {k.shape[1]}); cp attention runs on one common "
                "Shard or Replicate placement that keeps whole GQA groups on every rank")
        out = context_parallel_attention(q.to_local(), k.to_local(), v.to_local(), group_name,
                                         cp, rank, causal, scale, enable_gqa)
        return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False,
                                  shape=q.shape, stride=q.stride())
    k = all_gather_autograd(k, 2, group_name)
    v = all_gather_autograd(v, 2, group_name)
    return load_balanced_attention(q, k, v, cp, rank, causal=causal, scale=scale,
                                   enable_gqa=enable_gqa)


def _ancestors(node: torch.fx.Node) -> list[torch.fx.Node]:
    """`node` and every node it depends on, in graph order."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _mask_kind(node: torch.fx.Node, mask: torch.fx.Node, s_local: int,
               evaluate_up_to: int | None = None) -> bool:
    """Whether the mask `mask` of attention `node` is causal (True) or all True (False),
    evaluated on the host from its constants (B x s_local^2 booleans at most: 64 MB a sample
    at 8K local tokens); raises ValueError for a mask that reads a graph input or
    is neither. A mask of more than `evaluate_up_to` elements (None: no limit) is not
    evaluated and taken as causal (`apply_context_parallel`'s `check_masks_up_to`)."""
    nodes = _ancestors(mask)
    inputs = [n.name for n in nodes if n.op == "placeholder"]
    if inputs:
        raise ValueError(
            f"context parallelism: attention {node.name} takes a mask computed from the "
            f"batch ({inputs}: padding, documents or a user's mask), which cp does not "
            "split; train without it or with cp=1")
    val = mask.meta.get("val")
    if evaluate_up_to is not None and (val is None or val.numel() > evaluate_up_to):
        return True
    env: dict[torch.fx.Node, object] = {}
    for n in nodes:
        if n.op != "call_function":
            raise ValueError(f"context parallelism: the mask of attention {node.name} reads "
                             f"{n.op} {n.target}; only a mask computed from positions is "
                             "understood")
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
        # on the host, whatever device the graph was captured or retargeted to
        args, kwargs = torch.fx.node.map_aggregate((args, kwargs), _on_cpu)
        env[n] = n.target(*args, **kwargs)
    value = env[mask].to(torch.bool)
    causal = torch.ones(s_local, s_local, dtype=torch.bool).tril()
    if bool(value.eq(causal).all()):
        return True
    if bool(value.all()):
        return False
    raise ValueError(f"context parallelism: the mask of attention {node.name} is neither "
                     f"causal nor all True at {s_local} tokens (a sliding window?); cp runs "
                     "causal or unmasked attention only")


def _on_cpu(x: object) -> object:
    return torch.device("cpu") if isinstance(x, torch.device) else x


def _before_repeat_kv(t: torch.fx.Node) -> tuple[torch.fx.Node, int]:
    """(the tensor before GQA's head expansion, repeats): reshape(expand(unsqueeze(x, 2),
    (B, H_kv, n, S, D)), (B, H_kv n, S, D)) gives (x, n) -- aten's reshape as captured or
    apply_placements' `sharding.reshape` in its place; anything else (t, 1)."""
    if t.target in _RESHAPES and isinstance(t.args[0], torch.fx.Node):
        e = t.args[0]
        if e.target is torch.ops.aten.expand.default and isinstance(e.args[0], torch.fx.Node):
            u = e.args[0]
            if u.target is torch.ops.aten.unsqueeze.default and u.args[1] == 2:
                x = u.args[0]
                xs, es = x.meta["val"].shape, e.meta["val"].shape
                if len(xs) == 4 and len(es) == 5 and es[1] == xs[1] and es[3:] == xs[2:]:
                    return x, int(es[2])
    return t, 1


def gathered_kv(key: torch.fx.Node, value: torch.fx.Node, enable_gqa: bool, tp: int
                ) -> tuple[torch.fx.Node, torch.fx.Node, bool]:
    """(K, V, enable_gqa) as cp attention gathers them for an attention reading `key` and
    `value`: the h_kv heads from before GQA's expansion (`_before_repeat_kv`), expanded inside
    the attention, where the tp degree `tp` divides them (each tp rank then holds whole
    groups); else `key` and `value` themselves (correct, h / h_kv times the bytes). The
    rewrite and the traffic model (cost_model/traffic.py) both take this."""
    k0, nk = _before_repeat_kv(key)
    v0, nv = _before_repeat_kv(value)
    if nk > 1 and nk == nv and not enable_gqa and k0.meta["val"].shape[1] % tp == 0:
        return k0, v0, True
    return key, value, enable_gqa


def _replace_attention(gm: torch.fx.GraphModule, node: torch.fx.Node, group_name: str,
                       cp: int, rank: int, s_local: int, tp: int,
                       evaluate_up_to: int | None = None) -> list[torch.fx.Node]:
    """Replace one fused attention; returns the nodes it read that may now be dead."""
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
             "enable_gqa"]
    given = dict(zip(names, node.args)) | dict(node.kwargs)
    if given.get("dropout_p", 0.0):
        raise ValueError(f"context parallelism: attention {node.name} has dropout_p "
                         f"{given['dropout_p']}; cp runs attention without dropout")
    mask = given.get("attn_mask")
    causal = bool(given.get("is_causal", False))
    if mask is not None:
        if causal:
            raise ValueError(f"context parallelism: attention {node.name} has both a mask and "
                             "is_causal")
        causal = _mask_kind(node, mask, s_local, evaluate_up_to)
    k, v, gqa = gathered_kv(given["key"], given["value"], bool(given.get("enable_gqa", False)),
                            tp)
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(
            context_parallel_attention,
            (given["query"], k, v, group_name, cp, rank, causal, given.get("scale"), gqa))
    new.meta = dict(node.meta)
    new.meta["orig_name"] = node.meta.get("orig_name", node.name)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return [a for a in (mask, given["key"], given["value"]) if isinstance(a, torch.fx.Node)]


def _erase_dead(gm: torch.fx.GraphModule, roots: list[torch.fx.Node]) -> int:
    """Erase the call_function nodes among `roots` and their ancestors that nothing reads any
    more (the dropped masks and K/V expansions); returns how many."""
    candidates = set()
    for r in roots:
        candidates.update(_ancestors(r))
    erased = 0
    for n in reversed(list(gm.graph.nodes)):
        if n in candidates and n.op == "call_function" and not n.users:
            gm.graph.erase_node(n)
            erased += 1
    return erased


def _arange(n: torch.fx.Node) -> tuple[object, tuple] | None:
    """(the aten.arange overload, its args) of an arange node -- as captured, or wrapped by
    apply_placements in `run_replicated(op, *args)` (DTensor has no rule for factories) --
    else None."""
    if n.op != "call_function":
        return None
    if n.target in _ARANGES:
        return n.target, tuple(n.args)
    if n.target is run_replicated and n.args and n.args[0] in _ARANGES:
        return n.args[0], tuple(n.args[1:])
    return None


def _is_position_arange(n: torch.fx.Node, s_local: int) -> bool:
    """An integer aten.arange of 0, 1, ..., s_local - 1."""
    found = _arange(n)
    val = n.meta.get("val")
    if found is None or val is None or val.dtype.is_floating_point or \
            tuple(val.shape) != (s_local,):
        return False
    op, args = found
    start = args[0] if op is not torch.ops.aten.arange.default and len(args) > 1 else 0
    step = args[2] if op is torch.ops.aten.arange.start_step else 1
    return start == 0 and step == 1


def position_sources(gm: torch.fx.GraphModule, seq_len: int, cp: int) -> list[torch.fx.Node]:
    """The graph's position sources at seq_len / cp tokens per cp rank (rule 3 of the module
    docstring): integer aten.arange nodes of the local length, in graph order."""
    return [n for n in gm.graph.nodes if _is_position_arange(n, seq_len // cp)]


def check_whole_graph(gm: torch.fx.GraphModule, seq_len: int, cp: int) -> None:
    """Raise ValueError when the graph (all stages) has no aten.scaled_dot_product_attention
    or no position source at seq_len / cp tokens per cp rank: what `apply_context_parallel`
    checks of a whole graph, for a graph that is rewritten stage by stage."""
    if not any(n.op == "call_function" and n.target in _FUSED for n in gm.graph.nodes):
        raise ValueError(_NO_ATTENTION)
    if not position_sources(gm, seq_len, cp):
        raise ValueError(_no_positions(gm, seq_len // cp))


def apply_context_parallel(gm: torch.fx.GraphModule, *, seq_len: int, cp: int, rank: int,
                           group_name: str, tp: int = 1,
                           planned: dict[str, torch.fx.Node] | None = None,
                           whole: bool = True,
                           check_masks_up_to: int | None = None) -> dict[str, int]:
    """Rewrite a stage graph captured at seq_len / cp tokens per sample for cp rank `rank`
    of the cp group named `group_name` (in place; see the module docstring); `tp`: the tp
    degree the stage's heads are split by (K and V are gathered before GQA's expansion when
    tp divides their heads); `planned`: node name -> its counterpart in the graph captured at
    the whole seq_len (passes.expand.counterparts), whose aranges must have seq_len entries
    where this graph's have seq_len / cp -- an arange over something else that happens to be
    seq_len / cp long is then told apart from a position index (without it, the length alone
    decides). `whole`: False for one pipeline stage of the graph, which need not hold an
    attention or a position source of its own: its positions reach it from an earlier stage
    as boundary activations computed there at the rank's global positions (the runtime checks
    the whole graph has both before splitting it: `check_whole_graph`).
    `check_masks_up_to`: a mask of more elements is not evaluated and taken as causal -- for
    a trial of the rewrite on a graph captured at the whole sequence (`@autoparallel`
    deciding whether to search cp), whose masks the build checks at seq_len / cp tokens.
    The rank's positions (seq_len / cp,) become the non-persistent buffer
    `_cp_positions`, on the device of the graph's other constants. Returns {"attention":
    attentions replaced, "positions": arange nodes replaced, "erased": dead nodes removed}.

    Raises ValueError naming the node for an attention this cannot run under cp (another
    fused attention op, dropout in attention, a mask from the batch or not causal) and when
    the graph has no fused attention or no position source."""
    s_local = seq_len // cp
    other = [f"{n.name} ({n.target})" for n in gm.graph.nodes if n.op == "call_function"
             and n.target not in _FUSED and op_name(str(n.target)) in ATTENTION_OPS]
    if other:
        raise ValueError(f"context parallelism: fused attention {other[0]} is not "
                         "aten.scaled_dot_product_attention, the op cp replaces")
    attention = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _FUSED]
    if not attention and whole:
        raise ValueError(_NO_ATTENTION)
    dead = []
    for node in attention:
        dead += _replace_attention(gm, node, group_name, cp, rank, s_local, tp,
                                   check_masks_up_to)
    erased = _erase_dead(gm, dead)
    aranges = position_sources(gm, seq_len, cp)
    if not aranges and not whole:
        gm.graph.lint()
        gm.recompile()
        return {"attention": len(attention), "positions": 0, "erased": erased}
    if not aranges:
        raise ValueError(_no_positions(gm, s_local))
    _check_against_planned(aranges, planned, seq_len)
    gm.register_buffer("_cp_positions",
                       chunk_positions(seq_len, cp, rank).to(_graph_device(gm)),
                       persistent=False)
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        q_pos = gm.graph.get_attr("_cp_positions")
    for n in aranges:
        dtype = n.meta["val"].dtype
        src = q_pos
        if dtype != torch.int64:
            with gm.graph.inserting_before(n):
                src = gm.graph.call_function(torch.ops.aten._to_copy.default, (q_pos,),
                                             {"dtype": dtype})
        n.replace_all_uses_with(src)
        gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    return {"attention": len(attention), "positions": len(aranges), "erased": erased}


_NO_ATTENTION = ("context parallelism: the graph has no aten.scaled_dot_product_attention: "
                 "attention spelled out in matmuls and softmax cannot gather K and V (use "
                 "attn_implementation='sdpa')")


def _no_positions(gm: torch.fx.GraphModule, s_local: int) -> str:
    seen = [f"{n.name} {tuple(n.meta['val'].shape)}" for n in gm.graph.nodes
            if _arange(n) is not None and n.meta.get("val") is not None]
    return (f"context parallelism: no position source in the graph (an integer aten.arange "
            f"of the local {s_local} tokens; aranges: {seen or 'none'}): where the model's "
            "positions come from cannot be given the rank's global positions; train with "
            "cp=1")


def _check_against_planned(aranges: list[torch.fx.Node], planned, seq_len: int) -> None:
    """Raise ValueError for a would-be position index whose namesake in the graph captured at
    the whole sequence does not have seq_len entries (it indexes something else)."""
    if planned is None:
        return
    for n in aranges:
        name = n.meta.get("orig_name", n.name)
        other = planned.get(name)
        val = other.meta.get("val") if other is not None else None
        if val is not None and tuple(val.shape) != (seq_len,):
            raise ValueError(
                f"context parallelism: {name} is an aten.arange of {n.meta['val'].shape[0]} "
                f"entries, the local sequence length, but of {tuple(val.shape)[0]} at the "
                f"whole sequence ({seq_len} tokens): not a position index, and cp cannot tell "
                "the model's positions apart from it; train with cp=1")


def _graph_device(gm: torch.fx.GraphModule) -> torch.device:
    """The device the graph's factory ops create on (passes.device.retarget_device's)."""
    for n in gm.graph.nodes:
        d = n.kwargs.get("device") if n.op == "call_function" else None
        if isinstance(d, torch.device):
            return d
    return torch.device("cpu")
