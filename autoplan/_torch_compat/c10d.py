"""Process groups and collectives (torch.distributed's private c10d names): dropping a process's
groups without a shutdown, the groups a DeviceMesh holds, one mesh per shape shared by a
process's engines and destroying the groups a job left, the default and the fake stores, the
ranks an op's group argument names, flattening a sub-mesh, a differentiable all-gather along
any dim.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DeviceMesh

__all__ = ["forget_process_groups", "forget_mesh_groups", "live_groups", "destroy_groups",
           "shared_mesh", "shared_mesh_groups", "drop_stale_meshes", "default_store",
           "fake_store", "group_ranks", "flatten_mesh", "all_gather_autograd"]


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


def forget_mesh_groups(mesh: DeviceMesh) -> None:
    """Drop the process groups `mesh` and every mesh sliced or flattened from it hold: torch
    2.13 keeps them in its root mesh's `_pg_registry` (name -> ProcessGroup). A mesh outlives
    its user in DTensor's sharding cache (an lru_cache over specs that name their mesh), and
    with it its groups and their threads, after `destroy_process_group()` ([Note: orderly
    exit] in autoplan/runtime/shutdown.py). The mesh can no longer give its groups."""
    mesh._get_root_mesh()._pg_registry.clear()


# (device, shape, names) -> (the default group then, held weakly: a destroyed default group
# must be free to go, its GroupExit with it, autoplan/runtime/shutdown.py; the mesh, whose
# groups the orderly exit drops, forget_mesh_groups, and drop_stale_meshes lets go)
_SHARED_MESHES: dict[tuple, tuple[weakref.ref, DeviceMesh]] = {}


def _alive(world: weakref.ref, mesh: DeviceMesh) -> DeviceMesh | None:
    """`mesh`, built under the default group `world` refers to, while it can still be used:
    that group is still the default and every group of the mesh is still registered with
    c10d; else None."""
    import torch.distributed.distributed_c10d as c10d

    if world() is None or c10d._world.default_pg is not world():
        return None
    try:
        alive = all(g in c10d._world.pg_map for g in mesh.get_all_groups())
    except (RuntimeError, ValueError, KeyError):  # a group name no longer resolves
        return None
    return mesh if alive else None


def shared_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """`init_device_mesh(device_type, shape, mesh_dim_names=names)`, built once per process
    and default group: a later call with the same arguments gets the same mesh, and so the
    same process groups, while they live (neither destroyed nor forgotten). torch 2.13 creates
    new groups -- sockets, threads, NCCL communicators -- at every `init_device_mesh`, and
    nothing frees them while DTensor's plan caches name the mesh; one engine per call
    would leak a set of groups per model built in a process (a notebook's re-run cell, the
    ranks of a pool running job after job; [Note: a job ends with its groups] in
    autoplan/runtime/launcher.py). Collective (new groups) when it builds."""
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    key = (device_type, tuple(shape), tuple(names))
    held = _SHARED_MESHES.get(key)
    if held is not None and (mesh := _alive(*held)) is not None:
        return mesh
    mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    _SHARED_MESHES[key] = (weakref.ref(c10d._world.default_pg), mesh)
    return mesh


def drop_stale_meshes() -> None:
    """Let go of the shared meshes that can no longer be used (their default group destroyed
    or replaced, a group of theirs gone): before a new default group is made."""
    for key in [k for k, held in _SHARED_MESHES.items() if _alive(*held) is None]:
        del _SHARED_MESHES[key]


def shared_mesh_groups() -> set:
    """The process groups of the live meshes `shared_mesh` holds, those of the meshes
    flattened from them included (their root's registry, torch 2.13's `_pg_registry`)."""
    return {g for held in _SHARED_MESHES.values() if (mesh := _alive(*held)) is not None
            for g in mesh._get_root_mesh()._pg_registry.values()}


def live_groups() -> set:
    """The process groups this process knows now (torch 2.13's `_world.pg_map`, which also
    holds the default group)."""
    import torch.distributed.distributed_c10d as c10d

    return set(c10d._world.pg_map)


def destroy_groups(keep: set) -> int:
    """Destroy (shut down and unregister) every process group this process knows but `keep`
    -- the subgroups of a finished job's DeviceMeshes -- and return how many. Local: no
    peer is contacted, so call it only once this rank's collectives on them are over. The
    default group is always kept."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    gone = [pg for pg in c10d._world.pg_map if pg not in keep and pg is not dist.group.WORLD]
    for pg in gone:
        dist.destroy_process_group(pg)
    return len(gone)


def default_store():
    """The key-value store of the default process group (torchrun's TCPStore, or the one
    `init_process_group` was given); torch 2.13's `_get_default_store`."""
    import torch.distributed.distributed_c10d as c10d

    return c10d._get_default_store()


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


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The 1-D mesh of all ranks of `mesh` (a sub-mesh of several axes, e.g. ("dp", "cp")),
    row-major, named `name`: torchtitan's `mesh["dp_shard", "cp"]._flatten("dp_shard_cp")`
    (DeviceMesh._flatten, private in torch 2.13)."""
    return mesh._flatten(name)


def all_gather_autograd(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """`t` all-gathered along tensor dim `dim` over `group` (a ProcessGroup or its name), in
    group-rank order, differentiable: its backward reduce-scatters (sums) the gradient along
    `dim` (torch.distributed._functional_collectives.all_gather_single_autograd, private in
    torch 2.13, which replaced all_gather_tensor_autograd: it gathers on dim 0 and cuts and
    concatenates for another dim). What context parallelism gathers K and V with ([Note:
    context parallelism] in autoplan/cost_model/context_parallel.py)."""
    from torch.distributed._functional_collectives import all_gather_single_autograd

    return all_gather_single_autograd(t.contiguous(), dim, group)
