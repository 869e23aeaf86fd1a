"""Context parallelism in a stage graph: the runtime's half of [Note: context parallelism]
(autoplan/solver/context.py).

The stage graph is captured at the cp rank's own tokens, b x s / cp (the same model, the
same node names, every view shape already local), and this pass rewrites what the local
capture gets wrong:

1. every fused attention (`aten.scaled_dot_product_attention`) becomes
   `context_parallel_attention`: K and V all-gathered along the sequence dim over the cp group
   (an autograd-aware functional collective: its backward reduce-scatters dK and dV), the
   rank's queries against all keys under the causal mask of *global* positions
   (q_pos >= k_pos). The gathered keys stay in group-rank order (rank r's two chunks, then
   rank r + 1's); the mask is built from their positions, so no reordering is needed. Where
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

from autoplan._torch_compat import all_gather_autograd
from autoplan.cost_model.compute import ATTENTION_OPS, op_name
from autoplan.passes.sharding import run_replicated, sdpa_local

__all__ = ["chunk_positions", "attention_at_positions", "context_parallel_attention",
           "apply_context_parallel"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_FUSED = (_SDPA, sdpa_local)  # apply_placements swaps the aten op for sdpa_local
_ARANGES = (torch.ops.aten.arange.default, torch.ops.aten.arange.start,
            torch.ops.aten.arange.start_step)
_RESHAPES = (torch.ops.aten.reshape.default, torch.ops.aten.view.default,
             torch.ops.aten._unsafe_view.default)


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


def attention_at_positions(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           q_positions: torch.Tensor, kv_positions: torch.Tensor, *,
                           causal: bool, scale: float | None = None,
                           enable_gqa: bool = False) -> torch.Tensor:
    """Attention of queries q (B, H, Sq, D) against keys k and values v (B, H_kv, Sk, D) held
    in any order: query j sits at sequence position q_positions[j] (Sq,), key i at
    kv_positions[i] (Sk,); causal: query j sees key i iff q_positions[j] >= kv_positions[i]
    (Vaswani et al. 2017's causal mask, written on positions). Returns (B, H, Sq, D): equal to
    causal attention over the whole sequence, restricted to the query rows."""
    mask = q_positions[:, None] >= kv_positions[None, :] if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=enable_gqa)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               q_positions: torch.Tensor, kv_positions: torch.Tensor,
                               group_name: str, causal: bool, scale: float | None,
                               enable_gqa: bool) -> torch.Tensor:
    """One cp rank's attention: its queries q (B, H, s / cp, D) against K and V all-gathered
    along the sequence dim (2) over the cp group `group_name` (k, v: (B, H_kv, s / cp, D),
    gathered to (B, H_kv, s, D) in group-rank order; kv_positions (s,) says where each sits).
    The gathers' backward reduce-scatters dK and dV. Returns (B, H, s / cp, D)."""
    k = all_gather_autograd(k, 2, group_name)
    v = all_gather_autograd(v, 2, group_name)
    return attention_at_positions(q, k, v, q_positions, kv_positions, causal=causal,
                                  scale=scale, enable_gqa=enable_gqa)


def _ancestors(node: torch.fx.Node) -> list[torch.fx.Node]:
    """`node` and every node it depends on, in graph order."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return [n for n in node.graph.nodes if n in seen]


def _mask_kind(node: torch.fx.Node, mask: torch.fx.Node, s_local: int) -> bool:
    """Whether the mask `mask` of attention `node` is causal (True) or all True (False),
    evaluated on the host from its constants (B x s_local^2 booleans at most: 64 MB a sample
    at 8K local tokens); raises ValueError for a mask that reads a graph input or
    is neither."""
    nodes = _ancestors(mask)
    inputs = [n.name for n in nodes if n.op == "placeholder"]
    if inputs:
        raise ValueError(
            f"context parallelism: attention {node.name} takes a mask computed from the "
            f"batch ({inputs}: padding, documents or a user's mask), which cp does not "
            "split; train without it or with cp=1")
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
    (B, H_kv, n, S, D)), (B, H_kv n, S, D)) gives (x, n); anything else (t, 1)."""
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


def _replace_attention(gm: torch.fx.GraphModule, node: torch.fx.Node, q_pos, kv_pos,
                       group_name: str, s_local: int) -> list[torch.fx.Node]:
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
        causal = _mask_kind(node, mask, s_local)
    k, v, gqa = given["key"], given["value"], bool(given.get("enable_gqa", False))
    k0, nk = _before_repeat_kv(k)
    v0, nv = _before_repeat_kv(v)
    if nk > 1 and nk == nv and not gqa:  # gather the h_kv heads, expand inside attention
        k, v, gqa = k0, v0, True
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(
            context_parallel_attention,
            (given["query"], k, v, q_pos, kv_pos, group_name, causal, given.get("scale"), gqa))
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


def apply_context_parallel(gm: torch.fx.GraphModule, *, seq_len: int, cp: int, rank: int,
                           group_name: str) -> dict[str, int]:
    """Rewrite a stage graph captured at seq_len / cp tokens per sample for cp rank `rank`
    of the cp group named `group_name` (in place; see the module docstring). The rank's
    positions (seq_len / cp,) and every rank's, in group-rank order (seq_len,), become
    non-persistent buffers `_cp_positions` / `_cp_kv_positions` on the device of the graph's
    other constants. Returns {"attention": replaced, "positions": arange nodes replaced,
    "erased": dead nodes removed}.

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
    if not attention:
        raise ValueError("context parallelism: the graph has no aten."
                         "scaled_dot_product_attention: attention spelled out in matmuls "
                         "and softmax cannot gather K and V (use attn_implementation='sdpa')")
    device = _graph_device(gm)
    gm.register_buffer("_cp_positions", chunk_positions(seq_len, cp, rank).to(device),
                       persistent=False)
    gm.register_buffer("_cp_kv_positions", torch.cat(
        [chunk_positions(seq_len, cp, r) for r in range(cp)]).to(device), persistent=False)
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        q_pos = gm.graph.get_attr("_cp_positions")
        kv_pos = gm.graph.get_attr("_cp_kv_positions")
    dead = []
    for node in attention:
        dead += _replace_attention(gm, node, q_pos, kv_pos, group_name, s_local)
    erased = _erase_dead(gm, dead)
    aranges = [n for n in gm.graph.nodes if _is_position_arange(n, s_local)]
    if not aranges:
        seen = [f"{n.name} {n.args} {n.kwargs} {n.meta.get('val')}" for n in gm.graph.nodes
                if _arange(n) is not None]
        raise ValueError(
            f"context parallelism: no position source in the graph (an integer aten.arange "
            f"of the local {s_local} tokens; aranges: {seen or 'none'}): where the model's "
            "positions come from cannot be given the rank's global positions; train with "
            "cp=1")
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


def _graph_device(gm: torch.fx.GraphModule) -> torch.device:
    """The device the graph's factory ops create on (passes.device.retarget_device's)."""
    for n in gm.graph.nodes:
        d = n.kwargs.get("device") if n.op == "call_function" else None
        if isinstance(d, torch.device):
            return d
    return torch.device("cpu")
