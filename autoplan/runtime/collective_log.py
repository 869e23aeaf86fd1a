"""The collectives a rank issues, by mesh axis, dtype and bytes: one recording and one labelling
for the dry run (dryrun_recorder.py, on fake tensors) and for a real rank (`CollectiveLog`, on
gloo or NCCL), so that the two are compared op for op (tests/test_dryrun_vs_real.py).

A collective is seen where it is dispatched: torch's c10d ops (`torch.ops.c10d.*`, which the
`dist.*` calls of FSDP2 and the pipeline schedules dispatch) and functional collectives
(`_c10d_functional`, DTensor's redistributions), each with the process group it runs on: a
c10d op's ProcessGroup argument, a functional one's group name (`_torch_compat.group_ranks`).
`label_collectives` then names each group by the mesh axis of the rank's engine.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autoplan import _torch_compat as tc

__all__ = ["COLLECTIVE_NAMESPACES", "Collective", "CollectiveLog", "bytes_by_axis",
           "collective_call", "label_collectives"]

# The namespaces of the c10d and functional collectives a rank issues, named by op packet
# (wait_tensor and the coalescing bookkeeping move nothing).
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
# _wrap_tensor_autograd: the autograd wrapper of a functional collective's result (a real
# rank's; none on fake tensors)
_NOT_COLLECTIVES = {"wait_tensor", "barrier", "monitored_barrier_", "_wrap_tensor_autograd"}

# (op name, global ranks of its group, dtype name, bytes): a collective as recorded, before
# its group is named by mesh axis
Call = tuple[str, tuple[int, ...], str, int]


@dataclass(frozen=True)
class Collective:
    """One collective or point-to-point op a rank issued.

    Attributes:
        op: the op's name (`all_gather_into_tensor`, `_reduce_scatter_base_`, `send`, ...).
        axis: the mesh axis of its process group (`tp`, `dp`, `pp`, `cp`, `dp_cp`; `world` for
            all ranks when no one axis spans them;
            `pp[2]`: 2 ranks of a pp line, as the tied-weight groups are; `ranks[k]`: a group
            of k ranks on no axis).
        group_size: ranks in the group.
        dtype: dtype of the data moved (`bfloat16`).
        bytes: the op's largest buffer: the gathered output of an all-gather, the input of a
            reduce-scatter, the tensor of an all-reduce, send, recv or broadcast (nccl-tests'
            "size").
    """

    op: str
    axis: str
    group_size: int
    dtype: str
    bytes: int


def collective_call(func, args, kwargs, out) -> Call | None:
    """The collective that the dispatch of `func(*args, **kwargs) -> out` is, as a `Call`
    (op name, global ranks of its group, dtype, bytes: the largest of its inputs and its
    output, each summed over its tensors), or None for any other op (and for wait_tensor,
    barriers). Works on real and fake tensors alike."""
    namespace = getattr(func, "namespace", "")
    name = func.overloadpacket.__name__ if namespace else ""
    if namespace == "_dtensor" and name == "shard_dim_alltoall":
        # DTensor's Shard(i) -> Shard(j) on a GPU mesh: one all-to-all of the local tensor
        # (its C++ kernel calls the process group directly), named as the dry run's
        # (_torch_compat.shard_dim_all_to_all) and the cost model's
        name = "all_to_all_single"
    elif namespace not in COLLECTIVE_NAMESPACES:
        return None
    if name in _NOT_COLLECTIVES:
        return None
    # a c10d op takes its ProcessGroup, a functional one its group's name
    ranks = next((r for a in tree_leaves((args, kwargs))
                  if (r := tc.group_ranks(a)) is not None), ())
    sizes, dtype = [], ""
    for value in list(args) + list(kwargs.values()) + [out]:
        tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
        if tensors:
            sizes.append(sum(t.numel() * t.element_size() for t in tensors))
            dtype = dtype or str(tensors[0].dtype).removeprefix("torch.")
    return name, tuple(ranks), dtype, max(sizes, default=0)


def label_collectives(calls: list[Call], engine) -> list[Collective]:
    """`calls` of a rank with their groups named by the mesh axes of `engine` (the rank's
    DistributedModel): a group that is an axis's is that axis ("dp_cp" the flattened dp x cp
    group, "world" every rank); a group inside one axis's group is `axis[k]` (k ranks: tied
    weights' 2 ranks of a pp line); any other `ranks[k]`."""
    axes: dict[tuple[int, ...], str] = {}
    with tc.outside_fake_mode():
        for name in engine.mesh.mesh_dim_names:
            axes[tuple(sorted(engine.mesh[name].mesh.flatten().tolist()))] = name
        if engine.plan.mesh.cp > 1:
            axes[tuple(sorted(engine.dp_mesh.mesh.flatten().tolist()))] = "dp_cp"
    # all ranks: named by the axis that spans them when one does (pp2 x dp1 x tp1's pp)
    axes.setdefault(tuple(range(engine.plan.mesh.world_size)), "world")
    out = []
    for op, ranks, dtype, nbytes in calls:
        key = tuple(sorted(ranks))
        axis = axes.get(key)
        if axis is None:  # a subset of an axis's group (tied weights: 2 ranks of a pp line)
            axis = next((f"{name}[{len(key)}]" for members, name in axes.items()
                         if set(key) <= set(members)), f"ranks[{len(key)}]")
        out.append(Collective(op, axis, len(key), dtype, nbytes))
    return out


def bytes_by_axis(collectives) -> tuple[dict[str, int], dict[str, int]]:
    """(the sum of `Collective.bytes` by axis, the number of collectives by "op@axis"). A
    collective over a group of one rank crosses no link and is left out (FSDP2's `replicate`
    at dp 1, which a 16-bit plan keeps for its mixed-precision casts, all-reduces each unit's
    gradients over the rank alone)."""
    by_axis: dict[str, int] = defaultdict(int)
    counts: dict[str, int] = defaultdict(int)
    for c in collectives:
        if c.group_size == 1:
            continue
        by_axis[c.axis] += c.bytes
        counts[f"{c.op}@{c.axis}"] += 1
    return dict(by_axis), dict(counts)


class CollectiveLog(TorchDispatchMode):
    """Records every collective this rank dispatches under it (`collective_call`), in issue
    order, in `calls`; `collectives(engine)` names their groups by mesh axis. Use as a context
    manager around a real rank's steps (`calls.clear()` before the one to measure); on a
    CPU rank it costs a Python call per aten op."""

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor lowers to local ops, which come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        call = collective_call(func, args, kwargs, out)
        if call is not None:
            self.calls.append(call)
        return out

    def collectives(self, engine) -> list[Collective]:
        """The recorded calls with their groups named by `engine`'s mesh axes
        (`label_collectives`)."""
        return label_collectives(self.calls, engine)
