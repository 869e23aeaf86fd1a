"""Every use of torch's private APIs, in one place.

autoplan asks DTensor's own sharding rules which placements an op accepts and what it produces
(docs/design.md, "Placements"). Those rules live behind private names
(`torch.distributed.tensor._op_schema`, `_dtensor_spec`, `DTensor._op_dispatcher`) that change
between torch releases; this module is the only one that touches them, so a torch upgrade is
fixed here. Written against torch 2.13.

The runtime and the export pass need a few more private names, also kept here (at the end of
the module): FSDP2-based replication (`replicate_module`), a re-entrant implicit replication
switch (`implicit_replication`) and the reset of DTensor's plan caches
(`clear_dtensor_caches`).

No process group is needed: the mesh is built with `_init_backend=False`, which is enough for
sharding propagation (it reads the mesh shape, never communicates).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, RuntimeSchemaInfo
from torch.distributed.tensor.placement_types import Placement

__all__ = ["TensorArg", "Propagation", "Trace", "tp_mesh", "propagate", "has_sharding_rule",
           "is_aten_op", "has_direct_rule", "is_composite", "decompose", "propagate_trace",
           "strict_redistribution", "replicate_module", "implicit_replication",
           "clear_dtensor_caches", "forget_process_groups", "checkpoint_extents", "checkpoint_keys",
           "quiet_understood_warnings", "default_store", "chunk_spec", "pipeline_eval",
           "cpu_claiming_fakes", "outside_fake_mode", "fake_tensor_mode", "is_fake",
           "active_fake_mode", "in_backward", "in_recomputation", "fake_store", "group_ranks",
           "concrete_value", "vote_pipeline_mode_locally", "pipeline_stages", "view_base",
           "Placement", "Partial", "Replicate", "Shard"]


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument of an op, described by its global shape, dtype and placement."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    placement: Placement


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

@dataclass(frozen=True)
class Trace:
    """The aten calls a composite op makes, with tensors as references.

    Attributes:
        steps: (op, args, kwargs, output refs); tensor arguments are ("in", i) for the i-th
            flattened input, ("t", k, j) for output j of step k, or a TensorArg (Replicate) for
            a tensor created inside the decomposition.
        metas: shape/dtype of every reference.
        outputs: references of the op's outputs (an input reference for a pure alias).
    """

    steps: tuple
    metas: dict
    outputs: tuple


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
            inputs.append(torch.empty(a.shape, dtype=a.dtype, device="meta"))
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
    return Trace(tuple(steps), metas, tuple(to_ref(t) for t in outs))


def propagate_trace(trace: Trace, placements: list, mesh: DeviceMesh) -> Propagation:
    """`propagate` for a composite op: chain DTensor's rules through `trace` with the i-th
    input at `placements[i]`. `moves_inputs` is True when any piece would redistribute (the
    suggestion of a piece is not a suggestion for the composite, so `inputs` stay as given).

    Raises:
        Exception: whatever DTensor raises for a piece.
    """
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


# --- runtime and export helpers ---------------------------------------------------------------

def replicate_module(module: torch.nn.Module, dp_mesh, mp_policy=None,
                     ignored_params=None) -> torch.nn.Module:
    """DDP on FSDP2's machinery (`torch.distributed._composable.replicate_with_fsdp`), which
    composes with DTensor tensor parallelism and torch.distributed.pipelining; `mp_policy` is
    FSDP2's MixedPrecisionPolicy (None: fp32); `ignored_params`: parameters it leaves alone."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    if ignored_params:
        kwargs["ignored_params"] = set(ignored_params)
    return replicate(module, mesh=dp_mesh, **kwargs)


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor `t` is an autograd view of (`Tensor._base`), None when it is not a view.
    DTensor views made by aten view ops (linear's flatten of its input) keep it too."""
    return t._base


@contextlib.contextmanager
def implicit_replication():
    """Like torch.distributed.tensor.experimental.implicit_replication, but re-entrant: it
    restores the previous setting on exit instead of switching it off, so a stage forward
    nested inside a step's forward+backward does not end the step's replication early."""
    dispatcher = DTensor._op_dispatcher
    before = dispatcher._allow_implicit_replication
    dispatcher._allow_implicit_replication = True
    try:
        yield
    finally:
        dispatcher._allow_implicit_replication = before


def clear_dtensor_caches() -> None:
    """DTensor caches sharding and redistribution plans by mesh *shape*; the cached ones name
    the process groups of the rank traced last, which are gone once it is destroyed."""
    from torch.distributed.tensor import _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's own cache
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()


def local_shard_offset(global_shape, mesh: DeviceMesh,
                       placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's shard of a DTensor of `global_shape` at
    `placements` on `mesh` (a rank of the mesh): the shard is
    `global[offset[d] : offset[d] + local_shape[d]]` along every tensor dim d; see
    `local_shard_slices` (defined below) for what it accepts."""
    slices = local_shard_slices(global_shape, mesh, placements)
    return tuple(s.stop - s.start for s in slices), tuple(s.start for s in slices)


__all__ += ["local_shard_offset"]


def local_shard_slices(global_shape, mesh: DeviceMesh, placements) -> tuple[slice, ...] | None:
    """The block of a tensor of `global_shape` that this rank holds as a DTensor with
    `placements` on `mesh`: one slice per tensor dim; None when this rank is not in `mesh`.

    torch's `compute_local_shape_and_global_offset` (what DCP uses) gives the local shape and the
    *first* global index along each dim, which describes the shard only when it is one
    contiguous block. That holds for `Shard` and `Replicate`, and for FSDP2 over tp:
    `_StridedShard(d, split_factor=k)` followed by `Shard(d)` on later mesh axes of total size k
    (the dp shard of the tp shard; tests/test_hf_checkpoint.py checks it against
    `full_tensor()`, uneven sizes included).

    Raises:
        ValueError: a `Partial` placement, or a `_StridedShard` whose split factor is not the
            size of the later mesh axes sharding the same dim (a non-contiguous shard).
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(f"placements {tuple(placements)}: a Partial placement on mesh "
                             f"axis {axis} has no slice of the full tensor")
        if isinstance(p, _StridedShard):
            later = 1
            for j in range(axis + 1, len(placements)):
                q = placements[j]
                if isinstance(q, Shard) and not isinstance(q, _StridedShard) and q.dim == p.dim:
                    later *= mesh.size(j)
            if later != p.split_factor:
                raise ValueError(
                    f"placements {tuple(placements)} on mesh {tuple(mesh.shape)}: "
                    f"{p} on mesh axis {axis} is not FSDP-over-tp nesting (later Shard({p.dim}) "
                    f"axes have size {later}, split factor {p.split_factor}): not a contiguous "
                    f"block")
    if mesh.get_coordinate() is None:
        return None
    shape, offset = compute_local_shape_and_global_offset(tuple(global_shape), mesh, placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


__all__ += ["local_shard_slices"]


def forget_process_groups() -> None:
    """Drop every process group this process knows, without talking to its peers (no
    shutdown, no barrier): for a forked child that must set up its own (fake) group while
    the parent keeps training on the real one. Mirrors what torch 2.13's
    `destroy_process_group()` clears (c10d's registries, partly module globals behind
    `_World`, and the C++ group-name registry), minus the backends' shutdown."""
    import torch.distributed.distributed_c10d as c10d

    world = c10d._world
    c10d._update_default_pg(None)
    for registry in (world.pg_map, world.pg_names, world.pg_group_ranks,
                     world.pg_backend_config, world.pg_to_tag, world.tags_to_pg,
                     world.pg_coalesce_state, world.comms):
        registry.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0


def checkpoint_keys(path) -> set[str]:
    """The (flattened) keys a DCP checkpoint holds, from its metadata (torch 2.13)."""
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def checkpoint_extents(path) -> dict[str, int]:
    """{file relative to `path`: bytes the DCP checkpoint's metadata says it holds at least}
    (the furthest offset + length of its records); torch 2.13's FileSystemReader storage
    records. Raises what `read_metadata` raises for a missing or unreadable `.metadata`."""
    from torch.distributed.checkpoint import FileSystemReader

    extents: dict[str, int] = {}
    for info in FileSystemReader(str(path)).read_metadata().storage_data.values():
        end = int(info.offset) + int(info.length)
        extents[info.relative_path] = max(extents.get(info.relative_path, 0), end)
    return extents


_QUIETED = []


def quiet_understood_warnings() -> None:
    """Silence two torch 2.13 messages that say nothing to an autoplan user, once per process
    (the runtime and the export pass call this; nothing else is filtered):

    - "DTensor random operators may not have complete support on cpu device mesh": DTensor's
      own RNG is never relied on -- random ops are rewritten to be layout-invariant
      ([Note: RNG contract] in autoplan/passes/rng.py), under which CPU meshes are exact.
    - "CPU process group does not support alltoall yet, falling back with allgather + chunk!"
      (a log record): gloo has no all_to_all; the fallback is what the cost model prices for
      a CPU mesh, and the result is the same.
    """
    if _QUIETED:
        return
    import logging
    import warnings

    warnings.filterwarnings(
        "ignore", message="DTensor random operators may not have complete support on cpu")

    class _NoAlltoallFallbackNotice(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "does not support alltoall yet" not in record.getMessage()

    logging.getLogger("torch.distributed.tensor._collective_utils").addFilter(
        _NoAlltoallFallbackNotice())
    _QUIETED.append(True)


def default_store():
    """The key-value store of the default process group (torchrun's TCPStore, or the one
    `init_process_group` was given); torch 2.13's `_get_default_store`."""
    import torch.distributed.distributed_c10d as c10d

    return c10d._get_default_store()


def chunk_spec(batch_dim: int | None):
    """How torch.distributed.pipelining splits a first-stage input into microbatches: along
    `batch_dim` (TensorChunkSpec), or whole to every microbatch (None; pipelining's private
    `_Replicate`)."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    return _Replicate() if batch_dim is None else TensorChunkSpec(batch_dim)


def pipeline_eval(schedule, args: tuple, target, losses: list) -> list | None:
    """A forward-only run of a torch.distributed.pipelining schedule (its `eval`), returning
    the last stage's output of each microbatch as a list, unmerged (merging concatenates on
    dim 0, which a scalar output such as a loss does not have); None on ranks without the last
    stage. Overrides the schedule's private `_merge_outputs` for the call."""
    schedule._merge_outputs = list
    try:
        return schedule.eval(*args, target=target, losses=losses)
    finally:
        del schedule._merge_outputs


def cpu_claiming_fakes():
    """A function turning a meta tensor into a fake tensor (torch's private
    `torch._subclasses.FakeTensor`) that claims the CPU device and stores nothing, all of one
    FakeTensorMode, which torch.export then traces in ([Note: lifted constants on meta] in
    autoplan/capture/constants.py)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode, cpu = FakeTensorMode(), torch.device("cpu")
    return lambda meta: FakeTensor(mode, meta, cpu)


# --- pipeline stages that hold receive buffers only for microbatches in flight -----------------
# [Note: in-flight receive buffers] torch.distributed.pipelining 2.13's PipelineStage allocates,
# when a schedule first runs, one activation receive buffer per microbatch
# (`_setup_forward_recv_info`) and one gradient receive buffer per microbatch
# (`_setup_backward_recv_info` -> `_create_grad_recv_info`), and keeps all of them for the whole
# step and between steps: 2 m boundary activations on a middle rank, whatever the schedule.
# Megatron-LM (megatron/core/pipeline_parallel/p2p_communication.py) allocates a receive
# tensor when it posts the receive. `InFlightPipelineStage` does the same inside torch's
# schedules, which reach the buffers only through `get_fwd_recv_ops` / `get_bwd_recv_ops` (the
# receive is posted), `forward_one_chunk` / `backward_one_chunk` (it is consumed) and
# `clear_runtime_states`:
# - an activation buffer is allocated when its receive is posted and dropped by the stage after
#   the forward of its microbatch; autograd keeps it (the stage input saved for backward, in
#   `fwd_cache`) until that microbatch's backward, so it lives exactly while its microbatch is
#   in flight;
# - a gradient buffer is allocated when its receive is posted and dropped after the backward
#   that consumed it;
# - the last stage's loss of a microbatch, which the schedule keeps to the end of the step, is
#   detached after its backward (as torch already detaches that stage's outputs): its spent
#   graph would otherwise keep the microbatch's stage input alive, m of them by the end;
# - forward-only runs (`eval`) also drop the forward cache of a microbatch once its output is
#   handed to the send, which the training backward would have popped (the last stage's stays:
#   it is the schedule's output, kept for the caller anyway).
# - torch's interleaved runtime kept the work of every send, and so the tensor sent, to the end
#   of the step: `in_flight_interleaved_schedule_class` waits for each once it is matched.
# So a rank holds the buffers of the microbatches its schedule has in flight: min(m, pp - r) for
# 1F1B, all m under GPipe (every forward before any backward), Megatron-LM's warm-up count for
# interleaved 1F1B. Beyond its activations it still keeps each in-flight microbatch's stage
# output (torch's `fwd_cache`, for the backward), which solver/pipeline.py prices ([Note: memory
# per rank]); tests/test_pipeline_memory.py measures that nothing grows with m.

@functools.cache
def in_flight_pipeline_stage_class():
    """`InFlightPipelineStage`: torch's PipelineStage whose receive buffers live only while
    their microbatch is in flight ([Note: in-flight receive buffers]). Defined on first use
    (then cached), so that the compiler, which imports this module, does not pay the 0.7 s
    import of torch.distributed.pipelining."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import (PipeliningMetadataError, _DTensorMeta,
                                                     _make_tensor_from_meta)
    from torch.distributed.pipelining.stage import _RecvInfo

    class InFlightPipelineStage(PipelineStage):
        """A PipelineStage (same arguments) whose activation and gradient receive buffers
        exist only from the posted receive until their microbatch is done ([Note: in-flight
        receive buffers]); everything else is torch 2.13's. Plain-tensor boundaries only (the
        runtime's stages take and give local tensors); a DTensor boundary raises
        PipeliningMetadataError when its buffer would be allocated."""

        def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
            if self.is_first:  # root arguments: no buffers
                super()._setup_forward_recv_info(num_microbatches, has_backward)
                return
            if self._stage_meta.inputs is None:
                raise PipeliningMetadataError(
                    f"Stage {self.stage_index}: inputs metadata required for recv info.")
            name = f"recv_for_{self.stage_index}_from_{self.stage_index - 1}"
            for chunk in range(num_microbatches):
                self.args_recv_info[chunk] = tuple(
                    _RecvInfo(name, self.stage_index - 1, None, meta)
                    for meta in self._stage_meta.inputs)

        def _create_grad_recv_info(self, act_send_info: dict) -> tuple:
            if self.is_last:
                return ()
            grads = self._stage_meta.output_grads
            if grads is None:
                raise PipeliningMetadataError(
                    f"Stage {self.stage_index}: output_grads metadata is required for creating "
                    "grad recv info.")
            out = []
            for idx, dst_list in act_send_info.items():
                if not dst_list:
                    raise PipeliningMetadataError(
                        f"Stage {self.stage_index}: output {idx} is not sent to any stage.")
                src = dst_list[0]
                out.append(_RecvInfo(f"recv_grad_for_{self.stage_index}_from_{src}", src, None,
                                     grads[idx]))
            return tuple(out)

        def _allocate(self, infos) -> None:
            for info in infos:
                if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
                    if isinstance(info.tensor_meta, _DTensorMeta):
                        raise PipeliningMetadataError(
                            f"Stage {self.stage_index}: {info.input_name} is a "
                            f"{type(info.tensor_meta).__name__}; in-flight receive buffers "
                            "take plain tensors only")
                    info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)

        @staticmethod
        def _release(infos) -> None:
            for info in infos:
                if not info.is_root_arg:
                    info.buffer = None

        def get_fwd_recv_ops(self, fwd_chunk_id: int):
            self._allocate(self.args_recv_info[fwd_chunk_id])
            return super().get_fwd_recv_ops(fwd_chunk_id)

        def get_bwd_recv_ops(self, bwd_chunk_id: int):
            if self.has_backward and not self.is_last:
                self._allocate(self.grad_recv_info[bwd_chunk_id])
            return super().get_bwd_recv_ops(bwd_chunk_id)

        def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None,
                              save_forward_output: bool = True):
            out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
            self._release(self.args_recv_info[fwd_chunk_id])
            return out

        def get_fwd_send_ops(self, fwd_chunk_id: int):
            ops = super().get_fwd_send_ops(fwd_chunk_id)
            if not self.has_backward:  # the send ops hold the outputs now
                self.fwd_cache.pop(fwd_chunk_id, None)
            return ops

        def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                               last_backward=False):
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                       last_backward=last_backward)
            if not self.has_backward:  # forward-only: torch's schedules call it all the same
                return
            if not self.is_last:
                self._release(self.grad_recv_info[bwd_chunk_id])
            elif isinstance(loss, torch.Tensor) and not loss._is_view():
                # the schedule keeps every microbatch's loss to the end of the step; its spent
                # graph would keep this microbatch's stage input (received buffer) alive
                loss.detach_()

    return InFlightPipelineStage


__all__ += ["in_flight_pipeline_stage_class"]


@functools.cache
def in_flight_interleaved_schedule_class():
    """`InFlightInterleaved1F1B`: torch's ScheduleInterleaved1F1B (same arguments) that waits
    for each send as soon as it is sure to be matched, instead of at the end of the step.

    torch 2.13's action runtime (`_PipelineScheduleRuntime._step_microbatches`) keeps the work
    of every SEND_F and SEND_B of the step in a list it waits on at the end, and a send's work
    holds the tensor sent: 2 v - 1 boundaries per microbatch on every rank, growing with m
    ([Note: in-flight receive buffers]). This one posts the sends itself, with a SEND_F /
    SEND_B handler in the runtime's private action-to-function map (which its dispatch loop
    consults before its own handling), and waits for a send once the peer has surely posted the
    matching receive, so that the wait cannot block: once this rank has waited for a receive
    of something the peer sent after posting it. The action IR, every rank's, says when that
    is (`_matched_at`). Gloo's works report no completion before `wait`, so polling them
    (`is_completed`) would keep them all."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import _batch_p2p, _ComputationType

    kind = _ComputationType
    sends, recvs = (kind.SEND_F, kind.SEND_B), (kind.RECV_F, kind.RECV_B)

    class InFlightInterleaved1F1B(ScheduleInterleaved1F1B):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._pending: list[tuple[int, list]] = []  # (matched at action index, works)
            self._matched = _matched_at(self.pipeline_order_with_comms, self.rank,
                                        self.stage_index_to_group_rank)
            self._comp_type_to_function_map[kind.SEND_F] = self._send
            self._comp_type_to_function_map[kind.SEND_B] = self._send

        def _send(self, action, _ctx) -> None:
            now = self._matched["index"][action]
            self._wait(lambda matched: matched <= now)
            stage = next(s for s in self._stages if s.stage_index == action.stage_index)
            mb = action.microbatch_index
            ops = stage.get_fwd_send_ops(mb) if action.computation_type == kind.SEND_F \
                else stage.get_bwd_send_ops(mb)
            self._pending.append((self._matched["send"][action], _batch_p2p(ops)))

        def _wait(self, due) -> None:
            keep = []
            for matched, works in self._pending:
                if due(matched):
                    for work in works:
                        work.wait()
                else:
                    keep.append((matched, works))
            self._pending = keep

        def _step_microbatches(self, *args, **kwargs):
            try:
                return super()._step_microbatches(*args, **kwargs)
            finally:
                self._wait(lambda matched: True)

    def _matched_at(order: dict, rank: int, stage_rank: dict) -> dict:
        """{"index": this rank's action -> its index, "send": this rank's send action -> the
        index of its first action after which the send's receive is surely posted (past the
        end: never before the step ends)}. A send to peer P is matched by P's receive r; the
        first send u that P posts after r reaches this rank as a receive this rank waits for
        in the compute that consumes it (torch's runtime waits for a receive right before
        that compute); after that compute, r was posted."""
        mine = order[rank]
        index = {a: i for i, a in enumerate(mine)}
        consumer = {}  # (stage, receive kind, microbatch) -> index of the compute waiting on it
        for i, a in enumerate(mine):
            if a.computation_type == kind.FORWARD:
                consumer.setdefault((a.stage_index, kind.RECV_F, a.microbatch_index), i)
            elif a.computation_type in (kind.FULL_BACKWARD, kind.BACKWARD_INPUT):
                consumer.setdefault((a.stage_index, kind.RECV_B, a.microbatch_index), i)
        matched = {}
        for a in mine:
            if a.computation_type not in sends:
                continue
            forward = a.computation_type == kind.SEND_F
            to = a.stage_index + (1 if forward else -1)
            peer = order[stage_rank[to]]
            recv = next(i for i, b in enumerate(peer)
                        if b.computation_type == (kind.RECV_F if forward else kind.RECV_B)
                        and b.stage_index == to and b.microbatch_index == a.microbatch_index)
            matched[a] = len(mine)
            for b in peer[recv + 1:]:
                if b.computation_type in sends:
                    back = b.stage_index + (1 if b.computation_type == kind.SEND_F else -1)
                    if stage_rank[back] == rank:
                        got = recvs[0] if b.computation_type == kind.SEND_F else recvs[1]
                        at = consumer.get((back, got, b.microbatch_index))
                        if at is not None:
                            matched[a] = at + 1
                            break
        return {"index": index, "send": matched}

    return InFlightInterleaved1F1B


__all__ += ["in_flight_interleaved_schedule_class"]


def compile_counters() -> dict[str, int]:
    """What torch.compile did in this process so far (torch._dynamo's counters): `graphs`
    (FX graphs handed to the backend, one per compiled region; a graph break makes two),
    `graph_breaks` (places a region was cut; the cut ops ran eagerly) and `recompiles`
    (guards that failed and compiled a frame again). For the tests and benchmarks of
    [Note: compiled stages] (autoplan/runtime/compiled.py)."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompiles": int(sum(counters["recompiles"].values()))}


__all__ += ["compile_counters"]


def all_gather_autograd(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """`t` all-gathered along tensor dim `dim` over `group` (a ProcessGroup or its name), in
    group-rank order, differentiable: its backward reduce-scatters (sums) the gradient along
    `dim` (torch.distributed._functional_collectives.all_gather_single_autograd, private in
    torch 2.13, which replaced all_gather_tensor_autograd: it gathers on dim 0 and cuts and
    concatenates for another dim). What context parallelism gathers K and V with ([Note:
    context parallelism] in autoplan/solver/context.py)."""
    from torch.distributed._functional_collectives import all_gather_single_autograd

    return all_gather_single_autograd(t.contiguous(), dim, group)


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The 1-D mesh of all ranks of `mesh` (a sub-mesh of several axes, e.g. ("dp", "cp")),
    row-major, named `name`: torchtitan's `mesh["dp_shard", "cp"]._flatten("dp_shard_cp")`
    (DeviceMesh._flatten, private in torch 2.13)."""
    return mesh._flatten(name)


def causal_lower_right_bias(q_len: int, kv_len: int):
    """torch.nn.attention.bias.causal_lower_right(q_len, kv_len): the causal mask of q_len
    queries that are the last of kv_len positions, as an attention bias the fused kernels
    take without a materialised mask. Created outside any active TorchDispatchMode
    (`_disable_current_modes`, private in torch 2.13): it is a Tensor subclass over an empty
    tensor, which selective activation checkpointing's mode would otherwise record and then
    refuse to rewrap ("the raw Tensor object is already associated to a python object")."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return causal_lower_right(q_len, kv_len)


__all__ += ["all_gather_autograd", "flatten_mesh", "causal_lower_right_bias"]


# --- dry run: the runtime on fake tensors (autoplan/runtime/dryrun.py) -------------------------
def outside_fake_mode():
    """A context in which no FakeTensorMode is active (torch's private `unset_fake_temporarily`;
    a no-op where none is): for tensors that are the runtime's own bookkeeping, read back as
    Python values (a DeviceMesh's rank table), never memory of a training step. Outside a dry run
    no fake mode is active and this changes nothing."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def fake_tensor_mode():
    """A FakeTensorMode (torch's private `torch._subclasses.FakeTensorMode`) for a dry run:
    real tensors met inside (lifted constants, the pipeline's bookkeeping) become fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(t) -> bool:
    """Whether `t` is a fake tensor (torch's private `is_fake`; a DTensor of fake shards is)."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return _is_fake(t)


def active_fake_mode():
    """The FakeTensorMode active now, or None (torch's private `_guards.active_fake_mode`)."""
    from torch._guards import active_fake_mode as _active

    return _active()


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread now (torch's private
    `_current_graph_task_id`)."""
    return torch._C._current_graph_task_id() != -1


def in_recomputation() -> bool:
    """Whether torch.utils.checkpoint is recomputing a checkpointed region on this thread now:
    its private `_recomputation_hook` is the innermost saved-tensors hook (torch 2.13's
    `_top_saved_tensors_default_hooks`)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return hooks is not None and \
        getattr(hooks[1], "__qualname__", "").startswith("_recomputation_hook.")


def fake_store():
    """The store of torch's `fake` process-group backend (torch.testing's FakeStore)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def group_ranks(group) -> list[int] | None:
    """Global ranks of the process group an op argument names, or None when it names none: a
    c10d op's ProcessGroup (boxed as a torch.ScriptObject), a functional collective's group
    name (torch's private `_resolve_process_group`)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if isinstance(group, torch.ScriptObject):
        if not group._type().qualified_name().endswith(".ProcessGroup"):
            return None
        group = dist.ProcessGroup.unbox(group)
    elif isinstance(group, str):
        try:
            group = _resolve_process_group(group)
        except (RuntimeError, ValueError):
            return None  # a reduce op's name ("sum")
    elif not isinstance(group, dist.ProcessGroup):
        return None
    return dist.get_process_group_ranks(group)


def concrete_value(t: torch.Tensor, if_fake: float) -> float:
    """`t.item()` as a float; `if_fake` for a fake tensor, which has no value (a dry run,
    autoplan/runtime/dryrun.py: the caller states what stands in, NaN where nothing can)."""
    if is_fake(t):
        return if_fake
    return t.item()


def pipeline_stages(schedule) -> list:
    """The pipeline stages (torch.distributed.pipelining's `PipelineStage`) of this rank in
    `schedule` (torch 2.13's private `_stages` of a multi-stage schedule, `_stage` of a
    single-stage one); [] for None (no pp)."""
    if schedule is None:
        return []
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def vote_pipeline_mode_locally(schedule) -> None:
    """Make `schedule`'s warm-up decide its stages' inference mode from this rank's own votes,
    without the vote's point-to-point round (torch 2.13's private `_warmup_p2p` and
    `InferenceMode`): for a dry run (autoplan/runtime/dryrun.py), whose fake process group
    delivers no values. Each rank votes STATIC when its stages were given their shapes, and
    every rank of an autoplan schedule builds its stages with static example shapes
    (runtime/parallel.py build_schedule), so the vote's product is this rank's own."""
    from torch.distributed.pipelining._utils import InferenceMode

    def warmup(stages, has_backward, p2p_done):
        dynamic = any(InferenceMode.needs_dynamic(s._user_meta, has_backward) for s in stages)
        for stage in stages:
            stage._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    schedule._warmup_p2p = warmup
