"""DTensor's sharding rules, asked by the compiler: which placements an op accepts and what it
produces (docs/design.md, "Placements"; torch's private `torch.distributed.tensor._op_schema`,
`_dtensor_spec`, `DTensor._op_dispatcher`).

No process group is needed: the mesh is built with `_init_backend=False`, which is enough for
sharding propagation (it reads the mesh shape, never communicates).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, RuntimeSchemaInfo
from torch.distributed.tensor.placement_types import Placement

__all__ = ["TensorArg", "Propagation", "Trace", "tp_mesh", "propagate", "has_sharding_rule",
           "is_aten_op", "has_direct_rule", "is_composite", "decompose", "propagate_trace",
           "strict_redistribution", "strided_shard_size_and_offset"]


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument of an op, described by its global shape, dtype and placement;
    `stride`: its strides where they matter (a composite op decomposes differently for a
    strided input: aten.adaptive_avg_pool1d of a transposed tensor calls `as_strided_`),
    None: contiguous."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    placement: Placement
    stride: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Propagation:
    """What DTensor does with an op given input placements (one mesh axis).

    Attributes:
        inputs: the placement DTensor runs each tensor argument with (flattened-argument order,
            positional args then kwargs); equal to the given ones when nothing moves.
        outputs: placement of each output (a 1-tuple for single-tensor ops; None for an output
            that is not a tensor).
        moves_inputs: True when DTensor would redistribute at least one input first.
    """

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement | None, ...]
    moves_inputs: bool


def tp_mesh(tp: int) -> DeviceMesh:
    """A 1-D CPU DeviceMesh of `tp` ranks seen from rank 0, with no process group behind it."""
    return DeviceMesh("cpu", torch.arange(tp), _init_backend=False, _rank=0)


def _propagator():
    return DTensor._op_dispatcher.sharding_propagator


def is_aten_op(target: Any) -> bool:
    """True for an aten OpOverload (what DTensor's rules are keyed by)."""
    return isinstance(target, torch._ops.OpOverload)


def has_direct_rule(op: Any) -> bool:
    """True when DTensor registers a sharding strategy for aten overload `op` itself."""
    prop = _propagator()
    return op in prop.op_strategy_funcs or op in prop.op_single_dim_strategy_funcs


def is_composite(op: Any) -> bool:
    """True for CompositeImplicitAutograd ops (aten.linear, aten.reshape, aten.to, ...): under
    DTensor they never reach a sharding rule themselves, their decomposition does."""
    return isinstance(op, torch._ops.OpOverload) and op._can_decompose()


def has_sharding_rule(op: Any) -> bool:
    """True when DTensor can propagate sharding for aten overload `op` (a registered strategy,
    a single-dim strategy, or a decomposition DTensor traces through)."""
    if not isinstance(op, torch._ops.OpOverload):
        return False
    prop = _propagator()
    if op in prop.op_strategy_funcs or op in prop.op_single_dim_strategy_funcs:
        return True
    from torch.distributed.tensor._decompositions import DecompShardingStrategy
    return DecompShardingStrategy.has_decomp(op)


def _spec(mesh: DeviceMesh, arg: TensorArg) -> DTensorSpec:
    stride = torch._prims_common.make_contiguous_strides_for(arg.shape) if arg.shape else ()
    meta = TensorMeta(torch.Size(arg.shape), tuple(stride), arg.dtype)
    return DTensorSpec(mesh, (arg.placement,), tensor_meta=meta)


def _schema_info(op, args) -> RuntimeSchemaInfo | None:
    prop = _propagator()
    info = prop.op_to_schema_info.get(op) or \
        prop.op_to_schema_info_for_single_dim_strategy.get(op)
    nested = any(isinstance(a, (list, tuple)) and any(isinstance(x, DTensorSpec) for x in a)
                 for a in args)
    if nested and (info is None or not info.needs_pytree):
        # Mirror DTensor's dispatcher, which flattens list-of-tensor arguments on its own.
        info = dataclasses.replace(info, needs_pytree=True) if info is not None \
            else RuntimeSchemaInfo(needs_pytree=True)
    return info


def strided_shard_size_and_offset(size: int, split_factor: int, num_chunks: int,
                                  rank: int) -> tuple[int, int]:
    """(local size, first global index or -1 when empty) of `rank`'s shard of a dim of `size`
    under `_StridedShard(split_factor)` over `num_chunks` ranks: the dim cut into
    `split_factor` torch.chunk pieces, each cut into `num_chunks` torch.chunk pieces, the rank
    holding its piece of each. The closed form DTensor itself uses for unbacked sizes
    (`_StridedShard.local_shard_size_and_offset`), where for ints it builds `arange(size)` and
    splits it: a second and more per call at the 16.7M-token dims of a 128K-context plan."""
    first_size = -(-size // split_factor)
    local, offset = 0, -1
    for j in range(split_factor):
        start = min(first_size * j, size)
        length = max(0, min(first_size * (j + 1), size) - start)
        second_size = -(-length // num_chunks)
        lo, hi = min(second_size * rank, length), min(second_size * (rank + 1), length)
        if hi > lo and offset < 0:
            offset = start + lo
        local += max(0, hi - lo)
    return local, offset


@contextlib.contextmanager
def _strided_shard_sizes_by_formula():
    """DTensor's `_StridedShard.local_shard_size_and_offset` answered by
    `strided_shard_size_and_offset` for int sizes and ranks (offset mode FIRST or NONE), the
    original otherwise; restored on exit. Sharding propagation calls it to adjust the shape
    arguments of views (`_adjust_shape_and_stride_args`); tests/test_strategies.py checks the
    formula against the original."""
    from torch.distributed.tensor.placement_types import (_StridedShard,
                                                          _StridedShardOffsetMode)

    original = _StridedShard.__dict__["local_shard_size_and_offset"]

    def by_formula(self, curr_local_size, num_chunks, rank,
                   offset_mode=_StridedShardOffsetMode.FIRST):
        mode = _StridedShardOffsetMode(offset_mode)
        if (type(curr_local_size) is int and type(rank) is int and type(num_chunks) is int
                and mode is not _StridedShardOffsetMode.ALL):
            size, first = strided_shard_size_and_offset(
                curr_local_size, self._split_factor_int(), num_chunks, rank)
            return size, (None if mode is _StridedShardOffsetMode.NONE else first)
        return original(self, curr_local_size, num_chunks, rank, offset_mode)

    _StridedShard.local_shard_size_and_offset = by_formula
    try:
        yield
    finally:
        _StridedShard.local_shard_size_and_offset = original


def propagate(op: Any, args: tuple, kwargs: dict, mesh: DeviceMesh) -> Propagation:
    """Run DTensor's sharding propagation for `op(*args, **kwargs)` on `mesh`.

    `args`/`kwargs` hold `TensorArg` where the op gets a tensor; everything else is passed as is.
    Uses DTensor's cached propagation, so repeated identical queries cost a hash lookup.

    Raises:
        Exception: whatever DTensor raises when it has no rule or refuses the placements
            (callers treat any exception as "not a candidate").
    """
    to_spec: Callable[[Any], Any] = lambda a: _spec(mesh, a) if isinstance(a, TensorArg) else a
    args_s = pytree.tree_map(to_spec, args, is_leaf=lambda a: isinstance(a, TensorArg))
    kwargs_s = pytree.tree_map(to_spec, kwargs, is_leaf=lambda a: isinstance(a, TensorArg))
    schema = OpSchema(op, tuple(args_s), dict(kwargs_s), schema_info=_schema_info(op, args_s))
    with _strided_shard_sizes_by_formula():
        out = _propagator().propagate_op_sharding(schema)
    given = [s for s in pytree.tree_leaves((args_s, kwargs_s)) if isinstance(s, DTensorSpec)]
    wanted = list(given)
    if out.redistribute_schema is not None:
        # For view-like ops the schema is also set when only shape args were rewritten
        # global -> local: compare placements, never trust `is None` alone.
        suggested = out.redistribute_schema.args_spec
        wanted[:len(suggested)] = list(suggested)
    inputs = tuple(s.placements[0] for s in wanted)
    moves = any(g.placements != w.placements for g, w in zip(given, wanted))
    spec = out.output_spec
    if isinstance(spec, DTensorSpec):
        outputs: tuple = (spec.placements[0],)
    elif isinstance(spec, (tuple, list)):
        outputs = tuple(s.placements[0] if isinstance(s, DTensorSpec) else None for s in spec)
    else:
        outputs = (None,)
    return Propagation(inputs, outputs, moves)


# --- composite ops: propagate through the decomposition DTensor actually runs ----------------
# [Note: composite ops] A CompositeImplicitAutograd op (aten.linear) is decomposed by the
# dispatcher *before* DTensor's __torch_dispatch__ sees it, so at run time DTensor applies the
# rules of the pieces (t, view, mm, _unsafe_view). DTensor's own decomposition-based strategy
# (DecompShardingStrategy) is not what runs and, in torch 2.13, fails on negative dims
# (aten.t -> Shard(-1)). We therefore record the pieces once on meta tensors with a dispatch
# mode (which sits where DTensor sits) and chain `propagate` through them.
# A piece that DTensor runs by that decomposition strategy alone (no rule of its own) is run
# forward only: autograd records the piece itself and calls its derivative, which DTensor may
# have no rule for (aten._weight_norm -> aten._weight_norm_interface, whose backward
# aten._weight_norm_interface_backward has none). `decompose` records such a piece's backward
# too, and `propagate_trace` refuses a trace whose backward DTensor cannot run: the planner
# then offers the op all-R and the sharding pass runs it on local values (`run_replicated`).


@dataclass(frozen=True)
class Trace:
    """The aten calls a composite op makes, with tensors as references.

    Attributes:
        steps: (op, args, kwargs, output refs); tensor arguments are ("in", i) for the i-th
            flattened input, ("t", k, j) for output j of step k, or a TensorArg (Replicate) for
            a tensor created inside the decomposition.
        metas: shape/dtype of every reference.
        outputs: references of the op's outputs (an input reference for a pure alias).
        backward_without_rule: the aten ops of the pieces' backward that DTensor has no rule
            for (recorded for the pieces it has no rule of their own for, [Note: composite
            ops]); () when it can run the backward.
    """

    steps: tuple
    metas: dict
    outputs: tuple
    backward_without_rule: tuple[str, ...] = ()


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, kwargs or {}, out))
        return out


def decompose(op: Any, args: tuple, kwargs: dict) -> Trace:
    """Record the aten calls `op` makes on meta tensors shaped like the `TensorArg`s given."""
    inputs: list[torch.Tensor] = []

    def to_meta(a):
        if isinstance(a, TensorArg):
            inputs.append(torch.empty(a.shape, dtype=a.dtype, device="meta") if a.stride is None
                          else torch.empty_strided(a.shape, a.stride, dtype=a.dtype,
                                                   device="meta"))
            return inputs[-1]
        return a

    is_arg = lambda a: isinstance(a, TensorArg)  # noqa: E731
    margs = pytree.tree_map(to_meta, args, is_leaf=is_arg)
    mkwargs = pytree.tree_map(to_meta, kwargs, is_leaf=is_arg)
    recorder = _Recorder()
    with recorder:
        out = op(*margs, **mkwargs)
    refs = {id(t): ("in", i) for i, t in enumerate(inputs)}
    metas = {("in", i): (tuple(t.shape), t.dtype) for i, t in enumerate(inputs)}

    def to_ref(a):
        if isinstance(a, torch.Tensor):
            return refs.get(id(a)) or TensorArg(tuple(a.shape), a.dtype, Replicate())
        return a

    steps = []
    for k, (func, a, kw, o) in enumerate(recorder.calls):
        a_ref, kw_ref = pytree.tree_map(to_ref, a), pytree.tree_map(to_ref, kw)
        outs = o if isinstance(o, (tuple, list)) else (o,)
        out_refs = []
        for j, t in enumerate(outs):
            ref = ("t", k, j)
            if isinstance(t, torch.Tensor):
                refs[id(t)] = ref
                metas[ref] = (tuple(t.shape), t.dtype)
            out_refs.append(ref)
        steps.append((func, a_ref, kw_ref, tuple(out_refs)))
    outs = out if isinstance(out, (tuple, list)) else (out,)
    missing = {str(f) for func, a, kw, _ in recorder.calls
               if has_sharding_rule(func) and not has_direct_rule(func)
               for f in _backward_ops(func, a, kw) if not has_sharding_rule(f)}
    return Trace(tuple(steps), metas, tuple(to_ref(t) for t in outs), tuple(sorted(missing)))


def _backward_ops(func: Any, args: tuple, kwargs: dict) -> list:
    """The aten ops autograd runs for the backward of `func(*args, **kwargs)`, on fresh meta
    leaves shaped like its floating tensor arguments (requiring a gradient), every
    differentiable output's gradient given."""
    def leaf(a):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype,
                                       device="meta").requires_grad_()
        return a

    args, kwargs = pytree.tree_map(leaf, (args, kwargs))
    leaves = [t for t in pytree.tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor) and t.requires_grad]
    with torch.enable_grad():
        out = func(*args, **kwargs)
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs or not leaves:
        return []
    grads = [torch.ones_like(t) for t in outs]
    recorder = _Recorder()
    with recorder:
        torch.autograd.grad(outs, leaves, grads, allow_unused=True)
    return [f for f, *_ in recorder.calls]


def propagate_trace(trace: Trace, placements: list, mesh: DeviceMesh) -> Propagation:
    """`propagate` for a composite op: chain DTensor's rules through `trace` with the i-th
    input at `placements[i]`. `moves_inputs` is True when any piece would redistribute (the
    suggestion of a piece is not a suggestion for the composite, so `inputs` stay as given).

    Raises:
        NotImplementedError: DTensor has no rule for an op of the backward
            (`Trace.backward_without_rule`), whatever the placements.
        Exception: whatever DTensor raises for a piece.
    """
    if trace.backward_without_rule:
        raise NotImplementedError(f"DTensor has no sharding rule for the backward op(s) "
                                  f"{', '.join(trace.backward_without_rule)}")
    env: dict = {("in", i): p for i, p in enumerate(placements)}
    is_ref = lambda a: isinstance(a, tuple) and len(a) in (2, 3) and a[0] in ("in", "t")  # noqa
    moved = False
    for func, a_ref, kw_ref, out_refs in trace.steps:
        def to_arg(a):
            if is_ref(a):
                shape, dtype = trace.metas[a]
                return TensorArg(shape, dtype, env[a])
            return a
        a = pytree.tree_map(to_arg, a_ref, is_leaf=is_ref)
        kw = pytree.tree_map(to_arg, kw_ref, is_leaf=is_ref)
        prop = propagate(func, a, kw, mesh)
        moved = moved or prop.moves_inputs
        for ref, p in zip(out_refs, prop.outputs):
            env[ref] = p
    outputs = tuple(env.get(r) if is_ref(r) else None for r in trace.outputs)
    return Propagation(tuple(placements), outputs, moved)


def strict_redistribution():
    """A context in which DTensor raises instead of redistributing implicitly (any placement
    change, communication or not): wrap the execution of a planned op in it to prove the plan
    left nothing implicit. torch's ExplicitRedistributionContext(strict=True)."""
    from torch.distributed.tensor._utils import ExplicitRedistributionContext
    return ExplicitRedistributionContext(strict=True)
