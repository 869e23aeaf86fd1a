"""The tensor-parallel axis's traffic of one pipeline rank ([Note: traffic per axis] in
traffic.py): the planned redistributions forward and backward, the partial gradients DTensor
all-reduces, the re-gathered saved inputs, the vocab-parallel loss's collectives.
"""

from __future__ import annotations

import torch

from autoplan.cost_model.comm import backward_redistribution
from autoplan.cost_model.traffic_context import RankTraffic, TrafficContext, gradient_carriers

__all__ = ["tensor_parallel"]

# collective name (Redistribution.collective / redistribute_time_s) -> the functional op
# DTensor dispatches, as the recorder names it (S(i) -> S(j): `all_to_all_single` of the local
# tensor where the ranks have all-to-all, DeviceSpec.all_to_all; on CPU ranks DTensor of torch
# 2.13 all-gathers the whole tensor and keeps its chunk, `_collective`)
_FUNCTIONAL = {"all_gather": "all_gather_into_tensor", "all_reduce": "all_reduce",
               "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single"}
# aten base names (op_classes.op_name) of ops whose backward DTensor runs on a Partial gradient
# and replicated operands, keeping it Partial: linear in the gradient, spelled in views,
# expansions and products (derivatives.yaml: pow's and rsqrt's are products with the saved
# value, mean's an expansion): an unfused norm's ops
_PARTIAL_THROUGH = frozenset({
    "view", "_unsafe_view", "reshape", "alias", "t", "transpose", "permute", "expand",
    "unsqueeze", "squeeze", "clone", "contiguous", "slice", "select", "add", "sub", "neg",
    "mul", "div", "mean", "sum", "to", "_to_copy", "type_as", "pow", "rsqrt"})
# views that keep a tensor whole and contiguous: a saved one is re-gathered
# (passes/regather.py `_tag_of`)
_WHOLE_VIEWS = ("view", "_unsafe_view", "reshape", "alias", "unsqueeze", "squeeze")


def tensor_parallel(ctx: TrafficContext, t: RankTraffic, stages: set[int]) -> None:
    """tp's traffic where the consumers run on `stages` ([Note: traffic per axis]), each op
    counted where it runs in the model of L blocks."""
    plan, tp = ctx.plan, ctx.plan.mesh.tp
    if tp == 1:
        return
    forward, backward, params = _redistributions(ctx, stages)
    for kind, nbytes, times, again in forward.values():
        t.add(_FUNCTIONAL[kind], "tp", _buffer(kind, nbytes, tp), (times + again) * ctx.m)
    for p, q, nbytes, partial in backward.values():
        kind = _collective(*backward_redistribution(p, q, grad_placement="P" if partial
                                                    else None), tp, ctx.all_to_all)
        if kind in _FUNCTIONAL:
            t.add(_FUNCTIONAL[kind], "tp", _buffer(kind, nbytes, tp), ctx.m)
    for name in ctx.once(_partial_gradients)[1]:  # all-reduced where the gradient is
        t.add("all_reduce", "tp", ctx.value_bytes(ctx.nodes[name]),
              ctx.m * len(ctx.instances(name, stages)))
    reductions, width = _param_reductions(ctx)
    for numel in params.values():
        t.add("all_reduce", "tp", numel * width, reductions)
    if ctx.once(_vocab_parallel_logits) is not None:
        # (N,) row maxima, then (2, N) sums, fp32 (fp64 for fp64 logits)
        rows = plan.microbatch_size * plan.seq_len / plan.mesh.cp
        stat = 8 if ctx.e == 8 else 4
        t.add("allreduce_", "tp", rows * stat, ctx.m)
        t.add("allreduce_", "tp", 2 * rows * stat, ctx.m)


def _redistributions(ctx: TrafficContext, stages: set[int]) -> tuple[dict, dict, dict]:
    """The redistributions whose consumers run on `stages`: (forward: per (value, dst,
    where) [kind, bytes, runs per microbatch (again in recomputation), re-gathered in the
    backward], backward: per redistribution [src, dst, bytes, its gradient Partial],
    parameters whose Partial gradient FSDP2 reduces: (parameter, instance) -> local
    elements)."""
    from autoplan.passes.sharding import tensor_args

    tp = ctx.plan.mesh.tp
    logits = ctx.once(_vocab_parallel_logits)
    regathered, no_grad = ctx.once(_regathered), ctx.once(_no_gradient)
    gives, _, partial_params = ctx.once(_partial_gradients)
    forward: dict[tuple, list] = {}  # per (value, dst, where): [kind, bytes, times, again]
    backward: dict[tuple, list] = {}  # a redistribution's: [src, dst, bytes, Partial grad]
    params: dict[tuple, int] = {}  # a parameter's Partial gradient, reduced by FSDP2
    for v in ctx.graph.gm.graph.nodes:
        s = ctx.strategies.get(v.name)
        if v.op == "output":
            wanted = ["R"] * len(tensor_args(v))
        elif s is not None:
            wanted = list(s.inputs)
        else:
            continue
        for u, q in zip(tensor_args(v), wanted):
            if v.op == "output" and u.name == logits:
                continue  # the vocab-parallel loss reads the logits' shards
            for where in ctx.instances(v.name, stages):
                found = ctx.source(u, v.name, where)
                if found is None:
                    continue
                name, inst = found
                p = ctx.placement(name)
                if p is None or "," in p:  # a multi-output node: its getitems carry the values
                    continue
                nbytes = ctx.value_bytes(ctx.nodes[name])
                kind = _collective(p, q, tp, ctx.all_to_all)
                if kind in _FUNCTIONAL:
                    # consumers of one gathered value share it: issued before the first,
                    # re-gathered in the backward when one holds it (not checkpointed)
                    entry = forward.setdefault((name, inst, q, where), [
                        kind, nbytes, 1 + ctx.recomputed(v.name, where), False])
                    entry[3] |= kind == "all_gather" and (u.name, v.name) in regathered and \
                        not ctx.checkpointed(where) and not ctx.fused(v.name, where)
                if q == "P" or u.name in no_grad or name in no_grad:
                    continue
                if p != q:
                    entry = backward.setdefault((name, inst, q, where), [p, q, nbytes, False])
                    entry[3] |= (u.name, v.name) in gives
                elif u.name in partial_params:
                    params[(name, inst)] = ctx.numel(ctx.params[str(u.target)], False)
    return forward, backward, params


def _partial_gradients(ctx: TrafficContext) -> tuple[set, set, set]:
    """Where the tp gradients that arrive Partial are reduced, as DTensor runs the backward
    ([Note: traffic per axis]): a split consumer hands a value it reads replicated a Partial
    gradient (Megatron's f); so does an op DTensor runs backward on a Partial gradient and
    replicated operands (`_PARTIAL_THROUGH`, all-R, not fused into a kernel) whose own
    gradient is Partial. Where every gradient a value gets is Partial they add up Partial,
    and the value's is Partial: a parameter's is reduced by FSDP2, an op of
    `_PARTIAL_THROUGH` hands it on, any other op's value is all-reduced; where Partial and
    other gradients meet, the value's is all-reduced. A Partial gradient reaching a
    redistribution takes its backward (S -> R's becomes a reduce-scatter). Returns
    ({(value, consumer) handing it a Partial gradient}, {values all-reduced}, {parameters
    with a Partial gradient}), by the graph's node names."""
    from autoplan.op_classes import op_name
    from autoplan.passes.sharding import tensor_args

    no_grad = ctx.once(_no_gradient)
    logits = ctx.once(_vocab_parallel_logits)
    partial: set[str] = set()  # values whose gradient is Partial, handed on to their inputs
    gives: set[tuple[str, str]] = set()
    reduced: set[str] = set()
    params: set[str] = set()

    def through(w) -> bool:
        s = ctx.strategies.get(w.name)
        return (w.op == "call_function" and s is not None and
                op_name(str(w.target)) in _PARTIAL_THROUGH and
                all(x == "R" for x in (*s.inputs, *s.outputs)) and
                not ctx.fused(w.name, ctx.instances(w.name)[-1]))  # as the deepest block

    for x in reversed(ctx.graph.gm.graph.nodes):
        p = ctx.placement(x.name) if x.op in ("get_attr", "call_function") else None
        if p is None or "," in p or x.name in no_grad:
            continue
        handed = []
        for w in x.users:
            s = ctx.strategies.get(w.name)
            if w.op == "output":
                if x.name == logits:
                    continue
                wanted, split = ["R"] * len(tensor_args(w)), False
            elif s is None or w.name in no_grad:
                handed.append(False)
                continue
            else:
                wanted, split = list(s.inputs), any(o != "R" for o in s.outputs)
            for a, q in zip(tensor_args(w), wanted):
                if a is not x:
                    continue
                hands = q == "R" and (split or (w.name in partial and through(w)))
                if hands:
                    gives.add((x.name, w.name))
                handed.append(hands and p == q)  # else a redistribution's backward took it
        if not any(handed):
            continue
        if not all(handed):  # Partial meets other gradients
            reduced.add(x.name)
        elif x.op == "get_attr":
            params.add(x.name)
        elif through(x):
            partial.add(x.name)
        else:
            reduced.add(x.name)
    return gives, reduced, params


def _param_reductions(ctx: TrafficContext) -> tuple[int, int]:
    """(how many times per step FSDP2 reduces a unit's gradients, the bytes of an element of
    the gradient it reads then): once per step under ZeRO 0/1 or pp, reading the gradient
    accumulated in f when microbatches were accumulated first; else per microbatch, in e."""
    plan = ctx.plan
    if plan.zero_stage <= 1 or plan.mesh.pp > 1:
        accumulated = plan.mesh.pp > 1 or ctx.m > 1
        return 1, (ctx.f if accumulated else ctx.e)
    return ctx.m, ctx.e


def _vocab_parallel_logits(ctx: TrafficContext) -> str | None:
    """The logits node the runtime's vocab-parallel loss reads as tp shards (passes/kernels.py
    `keep_logits_sharded`: the fused kernels, tp > 1, pp 1, the token loss of a model that
    returns no loss of its own, logits Shard of their last dim), or None."""
    from autoplan.passes.sharding import tensor_args

    plan, g = ctx.plan, ctx.graph
    if not ctx.kernels or plan.mesh.tp == 1 or plan.mesh.pp > 1 or "loss" in g.output_names:
        return None
    out = next(n for n in g.gm.graph.nodes if n.op == "output")
    args = tensor_args(out)
    if g.main_output_index >= len(args):
        return None
    logits = args[g.main_output_index]
    val = logits.meta.get("val")
    if not isinstance(val, torch.Tensor) or \
            ctx.placement(logits.name) not in (f"S({val.ndim - 1})", "S(-1)"):
        return None
    return logits.name


def _no_gradient(ctx: TrafficContext) -> set[str]:
    """Values autograd gives no gradient (activations.grad_carriers: none descends from a trainable
    parameter -- graph inputs, buffers, frozen weights, masks, rotary tables -- or they are
    not floating)."""
    from autoplan.cost_model.activations import PARAM_PREFIX

    carriers = ctx.once(gradient_carriers)
    out = set()
    for n in ctx.graph.gm.graph.nodes:
        val = n.meta.get("val")
        name = PARAM_PREFIX + str(n.target) if n.op == "get_attr" else n.name
        if name not in carriers or \
                (isinstance(val, torch.Tensor) and not val.dtype.is_floating_point):
            out.add(n.name)
    return out


def _collective(src: str, dst: str, tp: int, all_to_all: bool) -> str:
    """The collective DTensor runs to turn `src` into `dst` on the tp axis (comm.py
    `redistribute_time_s`'s table): "all_gather", "all_reduce", "reduce_scatter",
    "all_to_all" (where the ranks have it, `all_to_all`; else S(i) -> S(j) all-gathers), or
    "none" (nothing moves: the same placement, a slice, to Partial)."""
    if src == dst or tp == 1 or dst == "P" or src == "R":
        return "none"
    if src == "P":
        return "all_reduce" if dst == "R" else "reduce_scatter"
    return "all_gather" if dst == "R" or not all_to_all else "all_to_all"


def _buffer(kind: str, nbytes: float, tp: int) -> float:
    """The recorded bytes of `kind` on a value of `nbytes` (whole over tp): an all-to-all's
    buffer is the rank's local tensor, sent in tp pieces (nccl-tests' size); the others' as
    `RankTraffic` counts them."""
    return nbytes / tp if kind == "all_to_all" else nbytes


def _regathered(ctx: TrafficContext) -> set[tuple[str, str]]:
    """(value, consumer) pairs where the consumer holds the value's tp all-gather for its
    backward (activations.saved_tensors' rules; directly, or through views that keep it whole and
    contiguous, as linear's flatten): [Note: gathered inputs saved sharded] in
    passes/regather.py re-gathers it there. An op fused into a kernel saves local tensors,
    which are not re-gathered; nor is a value no gradient flows through (token ids gathered
    for an embedding): the runtime tags only gathers that require a gradient
    (passes/regather.py `tag_gathered`) and holds the others whole."""
    from autoplan.cost_model.activations import node_producers, saved_tensors

    g = ctx.graph
    infos = [g.nodes[n.name] for n in g.gm.graph.nodes if n.name in g.nodes]
    grads = ctx.once(gradient_carriers)
    saved = {(s.consumer, s.owner) for s in saved_tensors(
        infos, producers=node_producers(g.gm), grads=grads)}

    def holds(value, consumer) -> bool:
        if (consumer.name, value.name) in saved:
            return True
        name = str(consumer.target).split(".")[-2] if "." in str(consumer.target) else ""
        return name in _WHOLE_VIEWS and consumer.args and consumer.args[0] is value and \
            any(holds(consumer, w) for w in consumer.users)

    return {(u.name, v.name) for v in g.gm.graph.nodes for u in v.all_input_nodes
            if v.op == "call_function" and u.name in grads and holds(u, v)}
