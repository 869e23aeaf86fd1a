"""The group autoplan created ends before the interpreter does ([Note: orderly exit] in
autoplan/runtime/shutdown.py): its worker threads are joined at exit, a rank that raised still
exits non-zero, a user's group is left alone. The README's torchrun script 20 times in a row:
bench/torchrun_exit.py."""

from __future__ import annotations

import os
import re
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from autoplan.runtime import shutdown

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"),
                                reason="threads are read from /proc/self/task (Linux)")

# the name ProcessGroupGloo gives its worker threads (torch 2.13)
GLOO_WORKER = "pt_gloo_runloop"


def gloo_workers() -> set[int]:
    """Thread ids of this process's ProcessGroupGloo worker threads."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == GLOO_WORKER:
                    found.add(int(tid))
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return found


class Runtime:
    """Holds process groups the way an engine's FSDP2 state does, until released."""

    def __init__(self, group):
        self.group = group

    def release(self) -> None:
        self.group = None


@pytest.fixture
def gloo_world_of_one(monkeypatch):
    """A gloo default group of one rank created as autoplan creates its own (its GroupExit),
    the threads that ran before it; whatever a test leaves is destroyed after it. A test that
    failed earlier in this process set sys.last_value (pytest does): not an exit on an error."""
    assert not dist.is_initialized()
    monkeypatch.delattr("sys.last_value", raising=False)
    monkeypatch.delattr("sys.last_exc", raising=False)
    before = gloo_workers() if os.path.isdir("/proc/self/task") else set()
    owner = shutdown.init_default_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield owner, before
    owner.close()
    if dist.is_initialized():
        dist.destroy_process_group()


@needs_proc
def test_close_ends_the_groups_worker_threads(gloo_world_of_one):
    """A runtime that holds the group, a mesh that DTensor's sharding cache keeps after its
    user is gone, an async all_reduce: `close` destroys the group, drops both holders, and the
    group's worker threads are joined before it returns -- as at exit, before the interpreter
    finalizes."""
    owner, before = gloo_world_of_one
    runtime = Runtime(dist.group.WORLD)
    shutdown.release_at_exit(runtime.release)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    shutdown.forget_at_exit(mesh)
    x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    assert (x @ x).full_tensor().sum() == 64
    dist.all_reduce(torch.ones(3), async_op=True).wait()
    del mesh, x
    assert gloo_workers() - before, "the group runs worker threads"
    owner.close()
    assert not dist.is_initialized() and owner.closed and runtime.group is None
    assert gloo_workers() - before == set()


@pytest.mark.parametrize("error, status", [
    (ValueError("a step failed"), 1), (KeyboardInterrupt(), None),
    (RuntimeError("rank 0, step 2: a collective failed (Connection reset by peer)"), None)],
    ids=["own-error", "interrupt", "peer-failed"])
def test_an_exit_on_an_uncaught_exception_leaves_the_group(gloo_world_of_one, monkeypatch,
                                                            error, status):
    """The interpreter exits on an error (sys.last_value set as it prints the traceback):
    nothing is waited for or destroyed, and the process ends with the exception's exit status
    (1) without finalizing, its output flushed; a KeyboardInterrupt, and a collective's failure
    (a rank that failed because a peer did), are the interpreter's."""
    owner, _ = gloo_world_of_one
    runtime = Runtime(dist.group.WORLD)
    shutdown.release_at_exit(runtime.release)
    monkeypatch.setattr("sys.last_value", error, raising=False)
    exits, flushed = [], []
    monkeypatch.setattr(shutdown.os, "_exit", exits.append)
    monkeypatch.setattr(sys, "stdout", type("Out", (), {"flush": lambda self: flushed.append(
        "stdout")})())
    owner.close()
    assert owner.closed and dist.is_initialized() and runtime.group is not None
    assert exits == ([] if status is None else [status])
    assert flushed == ([] if status is None else ["stdout"])


def test_a_users_group_is_left_alone():
    """A group the user created: no model is released for it, nothing is destroyed."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runtime = Runtime(dist.group.WORLD)
        shutdown.release_at_exit(runtime.release)
        shutdown.forget_at_exit(init_device_mesh("cpu", (1,)))
        assert all(o.group is not dist.group.WORLD for o in shutdown._OWNED)
        assert not any(o._releases or o._meshes for o in shutdown._OWNED)
    finally:
        dist.destroy_process_group()


class _Rank:
    """What GroupExit reads of a group: its rank and size."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_ranks_meet_in_the_store_and_one_that_does_not_come_is_named():
    """Two ranks meet (neither waits out the timeout); a rank alone leaves after the timeout
    naming the rank that did not come."""
    store = dist.HashStore()
    ranks = [_Rank(0, 2), _Rank(1, 2)]
    exits = [shutdown.GroupExit(r, store, barrier_timeout_s=30) for r in ranks]
    missing = {}
    threads = [threading.Thread(target=lambda e=e: missing.update({e.rank: e.meet()}))
               for e in exits]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert missing == {0: [], 1: []}
    alone = shutdown.GroupExit(_Rank(0, 2), dist.HashStore(), barrier_timeout_s=0.2)
    assert alone.meet() == [1]


# -- the README's torchrun script, two ranks -----------------------------------------------
# Prepended to the README's script by test_first_contact's torchrun test (one torchrun run of
# it checks both what it trains and how its ranks end).
THREADS_AT_EXIT = '''import atexit as _atexit, os as _os


def _gloo_workers_at_exit():  # registered first, so it runs after autoplan's exit handler
    names = [open(f"/proc/self/task/{t}/comm").read().strip()
             for t in _os.listdir("/proc/self/task")]
    print(f"rank {_os.environ['RANK']}: {names.count('pt_gloo_runloop')} gloo worker "
          "threads at exit", flush=True)


_atexit.register(_gloo_workers_at_exit)
'''


@pytest.mark.slow
def test_a_rank_that_raises_still_fails_the_job(tmp_path):
    """Rank 1 raises after its first step while rank 0 goes on to the next: rank 1 exits 1
    (its exit handler waits for nobody), torchrun reports the job failed with rank 1 as the
    root cause."""
    from test_first_contact import _torchrun, readme_script

    source = readme_script("train.py")
    step = "    loss = model.step(tokens[:, :-1], tokens[:, 1:])"
    assert step in source
    source = source.replace(step, step + "\n    if dist.get_rank() == 1:\n"
                            "        raise ValueError('rank 1 fails on purpose')")
    script = tmp_path / "train.py"
    script.write_text(source)
    run = _torchrun(script, 2, timeout_s=400)
    assert run.returncode != 0
    assert "ValueError: rank 1 fails on purpose" in run.stderr
    root = run.stderr.split("Root Cause", 1)[-1]
    assert re.search(r"rank\s+: 1 .*\n\s+exitcode\s+: 1 ", root), run.stderr[-3000:]
