"""DTensor at run time (the runtime and the export pass): FSDP2-based replication
(`replicate_module`), a re-entrant implicit replication switch (`implicit_replication`), the
reset of DTensor's plan caches (`clear_dtensor_caches`), a rank's block of a sharded tensor
(`local_shard_slices`), the autograd base of a view, the two torch warnings autoplan
understands (`quiet_understood_warnings`), a CPU mesh's Shard(i) -> Shard(j) run as a GPU
mesh runs it (`shard_dim_all_to_all`, for the dry run), and whether an op runs for DTensor's
sharding propagation, not for the rank (`marking_sharding_propagation`); the units an FSDP2
unit prefetches in its forward (`forward_prefetched`) and its all-gathers issued without
waiting (`unshard_async`).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Shard

__all__ = ["replicate_module", "view_base", "implicit_replication", "clear_dtensor_caches",
           "local_shard_offset", "local_shard_slices", "quiet_understood_warnings",
           "shard_dim_all_to_all", "marking_sharding_propagation", "in_sharding_propagation",
           "forward_prefetched", "unshard_async", "unshard_async_enabled"]


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


def forward_prefetched(unit: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose all-gathers FSDP2 unit `unit` issues in its forward
    (`set_modules_to_forward_prefetch`; torch 2.13's private `_states_to_forward_prefetch`);
    [] when none was set."""
    states = unit._get_fsdp_state()._states_to_forward_prefetch
    return [module for state in states for module in state._modules]


def unshard_async(unit: torch.nn.Module) -> None:
    """FSDP2 unit `unit` (and the units under it) issues its pre-forward and pre-backward
    parameter all-gathers with `async_op=True` and waits for each where the unit runs, so an
    explicitly prefetched all-gather runs beside the compute in between on any backend, and
    its result is freed right after its copy-out (torch 2.13's private
    `FSDPModule._set_unshard_async_op`)."""
    unit._set_unshard_async_op(True)


def unshard_async_enabled(unit: torch.nn.Module) -> bool:
    """Whether every parameter group of FSDP2 unit `unit` issues its all-gathers with
    `async_op=True` (`unshard_async`; torch 2.13's private `unshard_async_op`)."""
    groups = unit._get_fsdp_state()._fsdp_param_groups
    return all(g.unshard_async_op for g in groups)


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


@contextlib.contextmanager
def shard_dim_all_to_all():
    """Within it, DTensor turns Shard(i) into Shard(j) on a CPU mesh as it does on a GPU mesh:
    one all-to-all of the rank's local tensor, not gloo's fallback (an all-gather of the whole
    tensor and a chunk of it, `shard_dim_alltoall` in torch/distributed/tensor/_collective_utils.py,
    which `Shard._to_new_shard_dim` calls by its name in placement_types). For the dry run of a
    plan for GPUs (`DeviceSpec.all_to_all`): the fake process group has all-to-all, and the
    ranks hold and move what NCCL's would.

    The exchange is the one torch's C++ `shard_dim_alltoall` makes
    (torch/csrc/distributed/c10d/Functional.cpp): the local tensor cut into group-size pieces
    along the new shard dim, each made contiguous, one all-to-all, the pieces received joined
    along the old one -- here as `all_to_all_single` on the pieces stacked on a new leading
    dim (its buffer: the local tensor's bytes). DTensor pads an uneven dim before the call.
    """
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import placement_types

    def all_to_all(local, gather_dim, shard_dim, mesh, mesh_dim):
        pieces = torch.stack(local.chunk(mesh.size(mesh_dim), dim=shard_dim))
        out = funcol.all_to_all_single(pieces, None, None, (mesh, mesh_dim))
        if isinstance(out, funcol.AsyncCollectiveTensor):
            out = out.wait()
        return torch.cat(out.unbind(0), dim=gather_dim)

    torch_own = placement_types.shard_dim_alltoall
    placement_types.shard_dim_alltoall = all_to_all
    try:
        yield
    finally:
        placement_types.shard_dim_alltoall = torch_own


_PROPAGATING = [0]  # depth of DTensor's output-metadata propagation now running


def in_sharding_propagation() -> bool:
    """Whether the op now dispatched runs inside DTensor's output-metadata propagation (under
    `marking_sharding_propagation`): on fake global-shape arguments, to learn the output's
    shape -- not an op of the rank."""
    return _PROPAGATING[0] > 0


@contextlib.contextmanager
def marking_sharding_propagation():
    """Within it, `in_sharding_propagation` tells DTensor's output-metadata propagation apart.
    On a cache miss DTensor runs the op on fake arguments of the global shape
    (`ShardingPropagator._propagate_tensor_meta_non_cached`, torch/distributed/tensor/
    _sharding_prop.py) in the fake mode it detects -- the rank's own in a dry run, whose
    recorder would count its FLOPs and storage as the rank's."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    torch_own = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):
        _PROPAGATING[0] += 1
        try:
            return torch_own(self, op_schema)
        finally:
            _PROPAGATING[0] -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = torch_own
