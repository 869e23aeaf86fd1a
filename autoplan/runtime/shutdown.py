"""The process group autoplan creates, and its orderly end ([Note: orderly exit]).

    init_default_group("gloo", timeout=...)  # init_process_group, then destroyed at exit
    forget_at_exit(mesh)                     # a DeviceMesh built on it: its groups go too
    release_at_exit(model._release_runtime)  # a model whose runtime was built in it

[Note: orderly exit]
A job whose training succeeded exits 0 on every rank: the default process group autoplan
created -- torchrun's (launcher.init_from_env) or the world of one a lone process trains in
(AutoParallel) -- is drained and destroyed, in order, before the interpreter finalizes.

Why: a ProcessGroupGloo worker thread (`pt_gloo_runloop`) completes a Work's future first and
drops the Work after, so the main thread may be past `wait()` and on its way out when the
Work's tensors hand their Python objects back, under the GIL. Once Py_FinalizeEx has begun,
taking the GIL ends the thread (pthread_exit), whose unwinding meets a noexcept frame:
std::terminate ("terminate called without an active exception"), SIGABRT, and torchrun reports
the job failed after every rank printed its last line. A core of a plain gloo loop (no
autoplan) shows it: runLoop -> ~AsyncAllreduceWork -> TensorImpl::decref_pyobject ->
gil_scoped_acquire -> take_gil -> PyThread_exit_thread, the main thread in Py_FinalizeEx's
collection. `destroy_process_group()` alone does not help -- torch's DDP on gloo still aborted
in 3 of 10 runs with it (issue 29) -- as it only unregisters the groups: the worker threads
stop when a group's last reference goes (~ProcessGroupGloo joins them), and a DeviceMesh keeps
its groups (DTensor's sharding cache keeps the meshes for the life of the process, after the
model that built them is gone), FSDP2's state keeps its own (held by the modules, in
reference cycles).

So `GroupExit.close` runs at exit (atexit: the interpreter still whole), in this order:
1. the ranks meet in the job's store, at most EXIT_BARRIER_TIMEOUT_S, so that none closes its
   connections while a peer is still in its last collective. Not with a collective: one that a
   peer never joins would stay queued, and step 4 waits for queued work. A peer busy past the
   timeout (rank 0 writing a report) is past its last collective and is not waited for;
2. `destroy_process_group()`, when the default group is still the one autoplan created (torch
   shuts its groups down in its order, sub-groups first);
3. the meshes built on it forget their groups (`forget_at_exit`: the engine's, alive or not),
   and every model that trained in it and is still alive drops its runtime (the engine, with
   FSDP2's state, the pipeline stages, the tied-weight groups);
4. one full collection: the cycles go, the last reference of each group with them, and each
   ~ProcessGroupGloo joins its worker threads on this thread -- torch destroys a group without
   holding the GIL, so a worker still dropping a Work takes it and finishes.
One holder is avoided rather than dropped: torch.distributed.nn.functional gives its functions
`group=group.WORLD` as a default argument, evaluated when it is first imported (with FSDP2,
pipelining or DCP, or by DTensor's first `distribute_tensor`), so `init_default_group` imports
it before it creates the group, while that default is still None.
Checked: no `pt_gloo_runloop` thread is left on either rank of the README's torchrun script
when the interpreter finalizes (tests/test_shutdown.py). Measured by turns on the 2-core
machine (bench/torchrun_exit.py, docs/benchmarks.md): the README's script exits 0 in 20 of 20
runs, twice (the commit before: 19 of 20 and 20 of 20, a rank SIGABRTed in the failed run); a
plain gloo all_reduce loop, which provokes the abort far more often, exits 0 in 9 and 7 of 20
runs in a group of its own, in 20 of 20 in the group autoplan creates.

A rank that exits on an uncaught exception does none of this: a peer may still wait for it in
a collective, and destroying a group with queued work waits for that work. Its gloo worker
threads are then alive when the interpreter finalizes, and the abort above can take the rank
(tests/test_shutdown.py's raising rank exited -6 instead of 1 in one CI run of 2026-12-06). So
on that path `close` flushes stdout and stderr (the traceback is printed by then) and ends the
process at once with the exit status 1 an uncaught exception gives (`os._exit`): the
interpreter never finalizes, and atexit handlers registered before the group was created do
not run (every one registered after it has run). Two errors are left to the interpreter: a
KeyboardInterrupt, which it reports as SIGINT, and a collective's failure
(`job.is_collective_failure`: autoplan's PeerError, gloo's lost peer), the error of a rank
that failed because another did. That rank must end after the one whose own error ended the
job: torchrun names the rank that failed first as the job's root cause, and two ranks that end
in the same second of its monitor tie to the lower rank (tried: with every error ending at
once, the README script's raising rank 1 lost the root cause to rank 0's PeerError). A group
the user created stays the user's: nothing here runs for it. On a clean exit an atexit handler
registered before the group was created runs after this one, when the model's runtime is gone.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import weakref
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

__all__ = ["EXIT_BARRIER_TIMEOUT_S", "GroupExit", "init_default_group", "forget_at_exit",
           "release_at_exit"]

EXIT_BARRIER_TIMEOUT_S = 60.0
"""Seconds a rank waits at exit for the others to reach theirs ([Note: orderly exit], step 1):
ranks that finished the same last step arrive within seconds of each other (in the README's
torchrun script rank 1 waits there for rank 0's report and export); a rank that leaves with
sys.exit(1) after an error it caught is held no longer by peers that wait for it in a
collective."""

_KEY = "autoplan/exit"

# The default groups this process created through autoplan, newest last (a process that
# destroys its group and creates another has two, the first with its group gone): process-wide,
# as torch.distributed's own registry of groups is.
_OWNED: list["GroupExit"] = []


class GroupExit:
    """The default process group autoplan created, closed in order at exit ([Note: orderly
    exit]): `close()` is registered with atexit; idempotent.

    Args:
        group: the default ProcessGroup (held by a weak reference).
        store: its key-value store (the job's), where the ranks meet at exit.
        barrier_timeout_s: how long a rank waits there for the others, seconds.
    """

    def __init__(self, group, store, barrier_timeout_s: float = EXIT_BARRIER_TIMEOUT_S):
        self._group = weakref.ref(group)
        self._store = store
        self.rank, self.world_size = group.rank(), group.size()
        self.barrier_timeout_s = barrier_timeout_s
        self._releases: list[weakref.WeakMethod] = []
        self._meshes: list[weakref.ref] = []  # by identity: equal meshes may hold other groups
        self.closed = False

    @property
    def group(self):
        """The group, or None once it is gone."""
        return self._group()

    def release_at_exit(self, release: Callable[[], None]) -> None:
        """Call `release` (a bound method, held weakly) at close, after the group's
        destruction: it drops what holds the group (see the Note, step 3)."""
        ref = weakref.WeakMethod(release)
        if ref not in self._releases:
            self._releases.append(ref)

    def forget_at_exit(self, mesh) -> None:
        """Drop the groups `mesh` (held weakly) holds at close, after the group's destruction
        (see the Note, step 3)."""
        if all(ref() is not mesh for ref in self._meshes):
            self._meshes.append(weakref.ref(mesh))

    def close(self) -> None:
        """Meet the other ranks, destroy the group, release the models, collect (the Note's
        steps 1-4); nothing when the interpreter exits on an uncaught exception."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if self in _OWNED:
            _OWNED.remove(self)
        if _exiting_on_error():
            _end_without_finalizing()
            return
        from autoplan._torch_compat import forget_mesh_groups

        meshes = [m for ref in self._meshes if (m := ref()) is not None]
        releases = [r for ref in self._releases if (r := ref()) is not None]
        self._meshes.clear()
        self._releases.clear()
        if self.group is None and not meshes and not releases:
            return  # destroyed and gone already, nothing built on it
        if self.world_size > 1:
            self.meet()
        if dist.is_initialized() and dist.group.WORLD is self.group:
            dist.destroy_process_group()
        for mesh in meshes:
            forget_mesh_groups(mesh)
        for release in releases:
            release()
        gc.collect()

    def meet(self) -> list[int]:
        """Wait in the store until every rank has come, at most `barrier_timeout_s`; the ranks
        that did not come (empty: all came, or the store is gone -- its host left first)."""
        store = self._store
        try:
            store.set(f"{_KEY}/{self.rank}", "")
            if store.add(f"{_KEY}/count", 1) == self.world_size:
                store.set(f"{_KEY}/all", "")
            store.wait([f"{_KEY}/all"], timedelta(seconds=self.barrier_timeout_s))
            return []
        except Exception:  # noqa: BLE001 - a timeout, or a store that is gone: leave anyway
            try:
                return [r for r in range(self.world_size)
                        if not store.check([f"{_KEY}/{r}"])]
            except Exception:  # noqa: BLE001 - the store is gone
                return []


def _end_without_finalizing() -> None:
    """End a process exiting on an uncaught exception with its status 1, without finalizing
    the interpreter ([Note: orderly exit]); returns for a KeyboardInterrupt and for a
    collective's failure."""
    from autoplan.runtime.job import is_collective_failure

    error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if isinstance(error, KeyboardInterrupt) or is_collective_failure(error):
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream: nothing more to say
            pass
    os._exit(1)


def _exiting_on_error() -> bool:
    """Whether the interpreter exits on an uncaught exception: it printed one (Python 3.12's
    sys.last_exc, 3.11's sys.last_value)."""
    return getattr(sys, "last_exc", None) is not None or \
        getattr(sys, "last_value", None) is not None


def init_default_group(backend: str, **kwargs) -> GroupExit:
    """`dist.init_process_group(backend, **kwargs)`, the group then drained and destroyed at
    exit ([Note: orderly exit]); torch.distributed.nn.functional is imported first, so that its
    functions' default group (taken when it is imported) is not this one. Returns the group's
    GroupExit. Raises as init_process_group does."""
    import torch.distributed.nn.functional  # noqa: F401 - see above

    from autoplan._torch_compat import default_store, drop_stale_meshes

    drop_stale_meshes()  # an earlier default group's meshes hold it no longer
    dist.init_process_group(backend, **kwargs)
    _OWNED[:] = [e for e in _OWNED if e.group is not None]
    owner = GroupExit(dist.group.WORLD, default_store())
    _OWNED.append(owner)
    atexit.register(owner.close)
    return owner


def _owner() -> GroupExit | None:
    """The GroupExit of the default group when autoplan created it, else None."""
    world = dist.group.WORLD if dist.is_initialized() else None
    return next((o for o in _OWNED if world is not None and o.group is world), None)


def release_at_exit(release: Callable[[], None]) -> None:
    """Have `release` (a bound method, held weakly) drop what holds the default group at exit,
    when autoplan created the group ([Note: orderly exit], step 3); nothing for a user's
    group."""
    if (owner := _owner()) is not None:
        owner.release_at_exit(release)


def forget_at_exit(mesh) -> None:
    """Have `mesh` (a DeviceMesh, held weakly) and the meshes sliced from it drop their groups
    at exit, when autoplan created the default group ([Note: orderly exit], step 3); nothing
    for a user's group."""
    if (owner := _owner()) is not None:
        owner.forget_at_exit(mesh)
