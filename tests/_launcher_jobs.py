"""Jobs for test_launcher.py: a rank that faults (dies, raises, hangs) on purpose at step 2,
while its peers train or wait in a collective. Module-level: the ranks import them by name."""

from __future__ import annotations

import ctypes
import os
import signal
import time

import torch
import torch.distributed as dist

FAULT_STEP = 2


def fault(kind: str, stamp_path: str) -> None:
    """Fault this rank the way `kind` says; first write the time of the fault (time.time(),
    seconds) to `stamp_path`, so that the test can time how long the job took to fail."""
    with open(stamp_path, "w") as f:
        f.write(repr(time.time()))
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "exit":
        os._exit(3)
    elif kind == "segv":
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    elif kind == "raise":
        raise ValueError("bad batch on purpose")
    elif kind == "hang":
        while True:
            time.sleep(3600)
    raise AssertionError(f"unknown fault {kind!r}")


def train_then_fault(kind: str, fault_rank: int, steps: int, stamp_path: str) -> list[float]:
    """gpt2-tiny planned by autoparallel over the ranks (dp, ZeRO-3) trains `steps` steps;
    rank `fault_rank` faults (`fault`) at the start of step FAULT_STEP. The losses."""
    import _jobs
    from autoplan.api import autoparallel

    model = _jobs.preset("gpt2-tiny")()
    ap = autoparallel(model, global_batch=4, seq_len=_jobs.SEQ, optimizer=_jobs.adamw,
                      dp=dist.get_world_size(), zero_stage=3)
    x, y = _jobs.batches(_jobs.vocab_of(model), steps, 4)
    losses = []
    for i in range(steps):
        if i == FAULT_STEP and dist.get_rank() == fault_rank:
            fault(kind, stamp_path)
        losses.append(ap.step(x[i], y[i]))
    return losses


def all_reduce_then_fault(kind: str, fault_rank: int, steps: int, stamp_path: str) -> float:
    """`steps` all_reduces of a (4,) tensor; rank `fault_rank` faults at step FAULT_STEP, the
    others then wait for it in the next all_reduce. The sum."""
    t = torch.ones(4)
    for i in range(steps):
        if i == FAULT_STEP and dist.get_rank() == fault_rank:
            fault(kind, stamp_path)
        dist.all_reduce(t)
    return float(t.sum())


def sleep_s(seconds: float) -> int:
    """Sleep, no collective; this rank's number."""
    time.sleep(seconds)
    return dist.get_rank()


def rank_of() -> int:
    return dist.get_rank()


def parent_of_sleeping_ranks(pids_path: str, stack_dir_path: str) -> None:
    """Be the parent of a LocalCluster(2) whose ranks sleep in a job for 120 s: once they are
    up, write their pids to `pids_path` and the cluster's stack folder to `stack_dir_path`
    (one line each) so that a test can kill this process and look for what it left behind."""
    from autoplan.runtime.launcher import LocalCluster

    with LocalCluster(2) as cluster:
        cluster.run(rank_of, timeout_s=120)
        with open(stack_dir_path + ".tmp", "w") as f:
            f.write(cluster._stack_dir)
        with open(pids_path + ".tmp", "w") as f:
            f.write(" ".join(str(p.pid) for p in cluster._procs))
        os.replace(stack_dir_path + ".tmp", stack_dir_path)
        os.replace(pids_path + ".tmp", pids_path)
        cluster.run(sleep_s, 120, timeout_s=180)


def mesh_job() -> None:
    """A dp2 x tp2 DeviceMesh and a DTensor all-gather on each of its axes: the subgroups and
    DTensor plans a job leaves in a rank of the pool."""
    from torch.distributed.device_mesh import init_device_mesh

    _gather_on_each_axis(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))


def held() -> tuple[int, int, int]:
    """(process groups, open file descriptors, threads) of this rank now."""
    from autoplan._torch_compat import live_groups

    return (len(live_groups()), len(os.listdir("/proc/self/fd")),
            len(os.listdir("/proc/self/task")))


def shared_mesh_job() -> int:
    """An all-gather on each axis of the dp2 x tp2 mesh an engine would take
    (`shared_mesh`); the mesh's id, the same job after job."""
    from autoplan._torch_compat import shared_mesh

    mesh = shared_mesh("cpu", (2, 2), ("dp", "tp"))
    _gather_on_each_axis(mesh)
    return id(mesh)


def _gather_on_each_axis(mesh) -> None:
    """A Shard(0) DTensor all-gathered on each axis of the dp x tp `mesh`."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for axis in ("dp", "tp"):
        distribute_tensor(torch.ones(4, 4), mesh[axis], [Shard(0)]).full_tensor()


def max_autotune_as_imported() -> bool:
    """torch._inductor.config.max_autotune in this rank: read from TORCHINDUCTOR_MAX_AUTOTUNE
    when the config module is first imported."""
    import torch._inductor.config as config

    return config.max_autotune
