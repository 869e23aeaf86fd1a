"""Apply a plan's tensor-parallel placements to a (stage) graph.

The rewritten graph is meant to be *interpreted under DTensor* on the tp sub-mesh
(docs/design.md, "Passes"): parameters are DTensors with the plan's placements, and
before every op whose input placement differs from what its producer yields, the pass inserts an
explicit `redistribute(x, "<dst>")` node -- one per costed `Redistribution` in the plan, no more
and no fewer (`check_redistributions` verifies this). A value that several consumers need in one
placement is redistributed once ([Note: one redistribution per value] in solver/problem.py): the
plan records it for the first of them, and the later ones, which the plan lists no record for,
read that node's result. DTensor then runs each op on local shards with no implicit
communication, because the solver's candidates come from DTensor's own rules.

`aten.scaled_dot_product_attention` has no DTensor rule; it is replaced by `sdpa_local`, which
runs the fused kernel on the local shards (batch- or head-sharded, as the plan says).
`aten.view` / `aten.reshape` become `reshape` ([Note: view under DTensor]).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx
import torch.utils._pytree
from torch.distributed.tensor import DTensor, Replicate

from autoplan._torch_compat import has_direct_rule, is_aten_op, is_composite
from autoplan.experts import EXPERTS_OP
from autoplan.passes.experts_local import experts_local
from autoplan.passes.regather import tag_gathered
from autoplan.plan import Plan, Redistribution, parse_placement

__all__ = ["apply_placements", "redistribute", "reshape", "run_replicated", "sdpa_local",
           "swap_dtensor_op", "tensor_args",
           "check_redistributions"]

aten = torch.ops.aten


def redistribute(x, placement: str):
    """Move DTensor `x` to `placement` on its (1-D) mesh; plain tensors pass through.

    Collective by (src -> dst): S->R all-gather, P->R all-reduce, P->S reduce-scatter,
    S(i)->S(j) all-to-all, R->S local slice (DTensor's redistribute semantics). An
    all-gathered activation is tagged so that autograd keeps its shard for the backward and
    gathers it again there ([Note: gathered inputs saved sharded] in passes/regather.py).
    """
    if not isinstance(x, DTensor):
        return x
    p = parse_placement(placement)
    if tuple(x.placements) == (p,):
        return x

    out = x.redistribute(x.device_mesh, (p,))
    tag_gathered(x, out)
    return out


def _contiguous_local(t):
    if isinstance(t, DTensor) and not t._local_tensor.is_contiguous():
        return DTensor.from_local(
            t.to_local().contiguous(), t.device_mesh, t.placements, run_check=False,
            shape=t.shape, stride=torch._prims_common.make_contiguous_strides_for(t.shape))
    return t


def _replicated_only(node: torch.fx.Node, strategy) -> bool:
    """An aten op planned all-R that DTensor cannot run: one without a direct rule that is
    not composite, or a composite one (the dispatcher decomposes it before DTensor sees it)
    with a piece that has no rule even on Replicate inputs (aten.adaptive_avg_pool1d of a
    transposed input: its decomposition's `as_strided_`)."""
    op = node.target
    if not is_aten_op(op):
        return False
    if strategy is not None and not set(strategy.inputs) | set(strategy.outputs) <= {"R"}:
        return False
    if is_composite(op):  # decomposed before DTensor sees it, whatever rule it registers
        return _composite_without_rule(node)
    return not has_direct_rule(op)


def _writes_buffer(node: torch.fx.Node, strategy, buffers: set[str]) -> bool:
    """An in-place op planned all-R whose first argument is a buffer: a get_attr of one, or
    what an in-place op on one returned."""
    if strategy is None or not set(strategy.inputs) | set(strategy.outputs) <= {"R"}:
        return False
    value = node
    while value.op == "call_function":
        op, args = value.target, value.args
        if op is run_replicated:  # rewritten already: an earlier in-place op on the buffer
            op, args = args[0], args[1:]
        if not is_aten_op(op) or not args or not isinstance(args[0], torch.fx.Node):
            return False
        first = op._schema.arguments[0]
        if first.alias_info is None or not first.alias_info.is_write:
            return False
        value = args[0]
    return value is not node and value.op == "get_attr" and str(value.target) in buffers


_NO_RULE: dict[tuple, bool] = {}  # (op, argument shapes and dtypes, static args) -> answer


def _composite_without_rule(node: torch.fx.Node) -> bool:
    """Whether DTensor's rules cannot carry composite `node` through its decomposition with
    every tensor argument Replicate (the planner then offered it all-R only, strategies/
    probe.py); False when an argument's shape is not known."""
    from autoplan._torch_compat import TensorArg, decompose, propagate_trace, tp_mesh

    vals = [a.meta.get("val") for a in tensor_args(node)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    strides = [None if v.is_contiguous() else tuple(v.stride()) for v in vals]
    key = (str(node.target), tuple((tuple(v.shape), v.dtype) for v in vals), tuple(strides),
           repr(torch.fx.node.map_arg((node.args, node.kwargs), lambda _n: "<T>")))
    if key not in _NO_RULE:
        it = iter(zip(vals, strides))
        args, kwargs = torch.fx.node.map_arg(
            (node.args, node.kwargs),
            lambda _n: (lambda v, st: TensorArg(tuple(v.shape), v.dtype, Replicate(), st))(
                *next(it)))
        try:
            propagate_trace(decompose(node.target, tuple(args), dict(kwargs)),
                            [Replicate()] * len(vals), tp_mesh(2))
            _NO_RULE[key] = False
        except Exception:  # a piece without a rule (or DTensor refuses it)
            _NO_RULE[key] = True
    return _NO_RULE[key]


def run_replicated(op, *args, **kwargs):
    """`op` (an aten op DTensor has no rule for, planned all-Replicate) on the local values of
    its DTensor arguments, which are whole (Replicate); tensor outputs become Replicate
    DTensors on the arguments' mesh again. Raises ValueError for an argument that is not
    Replicate (the plan gives such ops R inputs only)."""
    mesh = None

    def local(a):
        nonlocal mesh
        if isinstance(a, DTensor):
            if any(not p.is_replicate() for p in a.placements):
                raise ValueError(f"{op}: argument at {a.placements}; an op without a DTensor "
                                 "rule runs on Replicate arguments only")
            mesh = a.device_mesh
            return a.to_local()
        return a

    out = op(*torch.utils._pytree.tree_map(local, args),
             **torch.utils._pytree.tree_map(local, kwargs))
    if mesh is None:
        return out
    return torch.utils._pytree.tree_map(
        lambda t: DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
        if isinstance(t, torch.Tensor) else t, out)


def reshape(x, shape):
    """`aten.view` / `aten.reshape` that works on strided local shards.

    [Note: view under DTensor] A DTensor's strides are global: after a transpose of a sharded
    tensor, DTensor can take the global layout for viewable while the local shard is strided,
    and run `view` on it, which fails -- in forward, and in backward when the incoming gradient
    is strided. The local shard (and, through a hook, the gradient) is made contiguous first (a
    copy only when it is strided, as `reshape` would make); the sharding rule is DTensor's.
    Under torch.compile no hook ([Note: compiled stages] in autoplan/runtime/compiled.py): a
    hook on an intermediate breaks the graph, and the lone reshape frame then fails in
    AOTAutograd's replay of an aliased DTensor output (as_strided). Nor DTensor's reshape: its
    backward is a `view` of the incoming gradient chosen by the gradient's *global* strides,
    and when the local gradient is strided (the transpose after a head split, dp2 x tp2)
    AOTAutograd's trace fails ("Cannot view a tensor ... with strides"). Traced, the reshape
    runs on the local shard between `to_local` and `from_local`, with the output placements
    and local shape DTensor's rule gives: a plain reshape, whose backward copies a strided
    gradient. (A custom autograd identity making the DTensor gradient contiguous through
    to_local / from_local compiled but gave wrong gradients, 3e-4 loss error at step 2.) Known
    limit: where DTensor's rule gathers the input first (a sharded dim merged behind another)
    the traced reshape is DTensor's, with the failure above when its gradient is strided.
    Eagerly the DTensor reshape is kept: the regather hooks ([Note: gathered inputs saved
    sharded] in passes/regather.py) find a gathered value through its view chain.
    """
    out = aten.reshape.default(_contiguous_local(x), shape)
    if not isinstance(out, DTensor) or not out.requires_grad:
        return out
    if not torch.compiler.is_compiling():
        out.register_hook(_contiguous_local)
        return out
    local = x.to_local()
    if local.numel() != out._local_tensor.numel():  # DTensor's rule gathered x first
        return out
    # traced: the DTensor reshape above only gave the placements and is dead code
    return DTensor.from_local(local.reshape(out._local_tensor.shape), out.device_mesh,
                              out.placements, run_check=False, shape=out.shape,
                              stride=out.stride())


def sdpa_local(q, k, v, attn_mask=None, *args, **kwargs):
    """scaled_dot_product_attention on local shards.

    q, k, v: (B, H, T, D) DTensors with one common placement, S(0) (batch), S(1) (heads) or R.
    attn_mask: broadcastable (B|1, 1|H, T, T); a plain tensor is sliced like q along a batch
    shard when its batch dim is not 1. Returns a (B, H, T, Dv) DTensor with q's placement.
    """
    if not isinstance(q, DTensor):
        return aten.scaled_dot_product_attention.default(q, k, v, attn_mask, *args, **kwargs)
    placements = q.placements
    if k.placements != placements or v.placements != placements:
        raise ValueError(
            f"sdpa_local: q, k, v placements differ ({q.placements}, {k.placements}, "
            f"{v.placements}); the plan must redistribute them to one placement")
    mesh = q.device_mesh
    if isinstance(attn_mask, DTensor):
        attn_mask = attn_mask.to_local()
    elif attn_mask is not None and placements[0].is_shard():
        dim = placements[0].dim
        if attn_mask.shape[dim] != 1:
            attn_mask = attn_mask.chunk(mesh.size(), dim=dim)[mesh.get_local_rank()]
    out = aten.scaled_dot_product_attention.default(
        q.to_local(), k.to_local(), v.to_local(), attn_mask, *args, **kwargs)
    # (B, H, T, Dv): v's head dim, which need not be q's (multi-head latent attention: qk
    # 192, v 128 in DeepSeek-V3); a contiguous output's global strides are its shape's
    shape = torch.Size((*q.shape[:-1], v.shape[-1]))
    if not out.is_contiguous():
        return DTensor.from_local(out, mesh, placements, run_check=False)
    return DTensor.from_local(out, mesh, placements, run_check=False, shape=shape,
                              stride=_contiguous_strides(shape))


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensor arguments of `node` in flattened (args, then kwargs) order -- the order in
    which `NodeStrategy.inputs` lists placements. Repeated uses count once each."""
    out: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda a: out.append(a))
    return out


def _output_placement(node: torch.fx.Node, plan: Plan, placements_of_value: dict) -> str:
    return placements_of_value.get(node.meta.get("orig_name", node.name), "R")


def value_placements(plan: Plan) -> dict[str, str]:
    """Placement of every value (node output) the plan knows, by original node name."""
    out: dict[str, str] = {}
    for s in plan.strategies:
        out[s.node] = s.outputs[0] if len(s.outputs) == 1 else ",".join(s.outputs)
    return out


def swap_dtensor_op(node: torch.fx.Node) -> None:
    """Point a call of an op that DTensor cannot run as captured at our version of it, in place:
    scaled_dot_product_attention -> `sdpa_local`, autoplan.experts -> `experts_local`
    (passes/experts_local.py), view / reshape -> `reshape`."""
    if node.target is aten.scaled_dot_product_attention.default:
        node.target = sdpa_local
    elif node.target is EXPERTS_OP:
        node.target = experts_local
    elif node.target in (aten.view.default, aten.reshape.default):
        node.target = reshape


def apply_placements(gm: torch.fx.GraphModule, plan: Plan,
                     param_names: dict[str, str] | None = None) -> list[Redistribution]:
    """Insert the plan's redistributions into `gm` (in place) and swap sdpa for `sdpa_local`.

    `param_names` maps get_attr targets to canonical FQNs (default: identity). Returns the
    redistributions inserted, as (producer, consumer, arg_index, src, dst) records, so callers
    can check them against `plan.redistributions`.
    """
    strategies = {s.node: s for s in plan.strategies}
    buffers = {fqn for fqn, _ in gm.named_buffers()}
    produced = value_placements(plan)
    planned = {(r.producer, r.consumer, r.arg_index) for r in plan.redistributions}
    moved_to: dict[tuple[torch.fx.Node, str], torch.fx.Node] = {}  # (value, dst) -> its node
    inserted: list[Redistribution] = []
    for node in list(gm.graph.nodes):
        if node.op == "output":
            inserted += _redistribute_outputs(gm, node, plan, produced, param_names)
            continue
        if node.op != "call_function":
            continue
        name = node.meta.get("orig_name", node.name)
        swap_dtensor_op(node)
        strategy = strategies.get(name)
        if _replicated_only(node, strategy) or _writes_buffer(node, strategy, buffers):
            # an op DTensor has no rule of its own for (e.g. the fill_.Tensor of T5's decoder
            # input shift; a decomposition does not run in place), planned all-R; or one
            # that writes a buffer, a plain tensor on every rank, which DTensor cannot write
            # a DTensor into (`buf.mul_(m).add_(x.mean(0))`)
            node.args = (node.target,) + tuple(node.args)
            node.target = run_replicated
        # getitem reads one element of a multi-output op: it has no tensor of its own to move.
        if strategy is None or node.target is operator.getitem:
            continue
        args = tensor_args(node)
        if len(args) != len(strategy.inputs):
            raise ValueError(
                f"plan strategy for {name} ({node.target}) lists {len(strategy.inputs)} input "
                f"placements but the node has {len(args)} tensor arguments")
        for i, (arg, dst) in enumerate(zip(args, strategy.inputs)):
            src = _src_placement(arg, plan, produced, param_names)
            if src == dst:
                continue
            producer = arg.meta.get("orig_name", arg.name)
            record = Redistribution(
                producer=producer, consumer=name, arg_index=i,
                src=src, dst=dst, collective="", bytes=0, time_s=0.0)
            if src == "R" and dst == "P":
                # R -> P moves no data (DTensor keeps the value on one rank's share); DTensor
                # forbids it as a user redistribution, and performs it itself inside the op
                # whose rule asks for a Partial input (e.g. the bias of a row-parallel addmm).
                inserted.append(record)
                continue
            shared = moved_to.get((arg, dst))
            if shared is not None and (producer, name, i) not in planned:
                _replace_ith_use(node, i, arg, shared)  # the plan shares the earlier one
                continue
            with gm.graph.inserting_before(node):
                moved = gm.graph.call_function(redistribute, (arg, dst))
            moved.meta["orig_name"] = f"redistribute_{arg.name}_{name}"
            moved.meta["redistribute_for"] = name
            _replace_ith_use(node, i, arg, moved)
            moved_to[(arg, dst)] = moved
            inserted.append(record)
    gm.graph.lint()
    gm.recompile()
    return inserted


def _redistribute_outputs(gm, node, plan, produced, param_names) -> list[Redistribution]:
    """The graph output must leave in the placements the plan gives it (Replicate for the
    model's final output): insert the plan's redistributions whose consumer is "output"."""
    wanted = {(r.producer, r.arg_index): r for r in plan.redistributions
              if r.consumer == "output"}
    inserted = []
    for i, arg in enumerate(tensor_args(node)):
        r = wanted.get((arg.meta.get("orig_name", arg.name), i))
        if r is None:
            continue
        with gm.graph.inserting_before(node):
            moved = gm.graph.call_function(redistribute, (arg, r.dst))
        _replace_ith_use(node, i, arg, moved)
        inserted.append(dataclasses.replace(r, collective="", bytes=0, time_s=0.0))
    return inserted


def _src_placement(arg: torch.fx.Node, plan: Plan, produced: dict[str, str],
                   param_names: dict[str, str] | None) -> str:
    if arg.op == "get_attr":
        fqn = (param_names or {}).get(arg.target, arg.target)
        return plan.placement_of(fqn)
    if arg.op == "call_function" and arg.target.__name__ == "getitem":
        parent, idx = arg.args
        multi = produced.get(parent.meta.get("orig_name", parent.name), "R").split(",")
        return multi[idx] if idx < len(multi) else multi[0]
    return produced.get(arg.meta.get("orig_name", arg.name), "R")


def _replace_ith_use(node: torch.fx.Node, index: int, old: torch.fx.Node,
                     new: torch.fx.Node) -> None:
    counter = [0]

    def swap(a: torch.fx.Node):
        i = counter[0]
        counter[0] += 1
        return new if (i == index and a is old) else a

    node.args = torch.fx.node.map_arg(node.args, swap)
    node.kwargs = torch.fx.node.map_arg(node.kwargs, swap)


def check_redistributions(planned: list[Redistribution], inserted: list[Redistribution]) -> None:
    """Lint: the inserted redistributions are exactly the planned ones (every costed one
    inserted, none uncosted). Raises ValueError listing the differences."""
    key = lambda r: (r.producer, r.consumer, r.arg_index, r.src, r.dst)  # noqa: E731
    want = {key(r) for r in planned}
    got = {key(r) for r in inserted}
    if want != got:
        raise ValueError(
            f"redistributions differ from the plan: missing {sorted(want - got)[:5]}, "
            f"uncosted {sorted(got - want)[:5]}")
