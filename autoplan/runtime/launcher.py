"""Process launching: a local cluster of N CPU ranks (gloo), and `torchrun` environments.

`LocalCluster(world_size)` spawns N worker processes once and keeps their gloo process group
alive, so many jobs (tests, benchmarks) share one set of processes instead of paying process and
import start-up each time. `LocalCluster.run(fn, *args, timeout_s=...)` runs `fn(*args)` on every
rank and returns the per-rank results in rank order; an exception on any rank is re-raised here
with its rank and traceback, and a job that does not finish within `timeout_s` kills the whole
cluster (no hangs: every multi-rank path has a timeout).

Under `torchrun` (RANK/WORLD_SIZE/MASTER_ADDR in the environment) `init_from_env()` joins the
job's process group instead; multi-node launching is torchrun's job.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["LocalCluster", "RankError", "init_from_env", "launch"]


class RankError(RuntimeError):
    """A job failed on one rank; `rank` and the remote traceback are in the message."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed:\n{message}")
        self.rank = rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results, pg_timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # One intra-op thread per rank: N ranks share this machine's cores.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=pg_timeout_s))
    while True:
        item = tasks.get()
        if item is None:
            break
        job_id, payload = item
        try:
            fn, args, kwargs = pickle.loads(payload)
            out = fn(*args, **kwargs)
            results.put((job_id, rank, True, pickle.dumps(out)))
        except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
            results.put((job_id, rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class LocalCluster:
    """N gloo ranks on this machine, reused across jobs.

    Args:
        world_size: number of ranks.
        pg_timeout_s: timeout of every collective in the process group, seconds.

    Use as a context manager or call `close()`.
    """

    def __init__(self, world_size: int, *, pg_timeout_s: float = 120.0):
        if world_size < 1:
            raise ValueError(f"LocalCluster: world_size={world_size} must be >= 1")
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, world_size, port, self._tasks[r], self._results, pg_timeout_s))
            for r in range(world_size)]
        for p in self._procs:
            p.start()
        self._next_job = 0
        self._closed = False

    def run(self, fn: Callable, *args: Any, timeout_s: float = 300.0, **kwargs: Any) -> list:
        """Run `fn(*args, **kwargs)` on every rank; per-rank results in rank order.

        `fn` must be importable by the workers (a module-level function). Raises RankError for
        the lowest failing rank, TimeoutError (after killing the cluster) past `timeout_s`.
        """
        if self._closed:
            raise RuntimeError("LocalCluster is closed (an earlier job failed or timed out)")
        job_id = self._next_job
        self._next_job += 1
        payload = pickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put((job_id, payload))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(out) + len(errors) < self.world_size:
            try:
                jid, rank, ok, data = self._results.get(timeout=timeout_s)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                self.close(kill=True)
                if errors:  # the other ranks were left waiting in a collective
                    rank = min(errors)
                    raise RankError(rank, errors[rank]) from None
                raise TimeoutError(
                    f"job {fn.__name__} did not finish on all {self.world_size} ranks within "
                    f"{timeout_s:.0f} s (finished: {sorted(out)}, failed: {sorted(errors)}, "
                    f"dead processes: {dead})") from None
            if jid != job_id:
                continue
            if ok:
                out[rank] = pickle.loads(data)
            else:
                errors[rank] = data
                # The other ranks may now block in a collective; don't wait for them long.
                timeout_s = min(timeout_s, 30.0)
        if errors:
            self.close(kill=True)
            rank = min(errors)
            raise RankError(rank, errors[rank])
        return [out[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if not kill:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close(kill=exc[0] is not None)


def launch(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0, **kwargs):
    """Run `fn(*args, **kwargs)` once on `world_size` fresh gloo ranks; per-rank results."""
    with LocalCluster(world_size) as cluster:
        return cluster.run(fn, *args, timeout_s=timeout_s, **kwargs)


def init_from_env(*, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the process group that `torchrun` describes in the environment.

    Uses NCCL when CUDA is available, else gloo. Returns (rank, world_size). Raises ValueError
    naming the missing variables when not started by torchrun.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise ValueError(f"not under torchrun: environment variables {missing} are not set")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
