"""The job a model trains in: torchrun's process group, nodes and device, read from the
environment so that a launch cannot silently go wrong.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in
every process it starts. Under it, `join()` initialises the default process group (NCCL when
CUDA is available, gloo otherwise; launcher.init_from_env), `num_nodes` is WORLD_SIZE /
LOCAL_WORLD_SIZE and the device is `cuda:LOCAL_RANK` (the NCCL backend) or the CPU. Without
these variables and without a process group, the process plans alone (world size 1 or the
`world_size=` it was given) -- it never trains one model per process without saying so.

`run_isolated(fn, ...)` runs a function in a forked child that drops the parent's process
groups: `export` sets up a fake group of the plan's size to trace every rank's graph, which
cannot coexist with a training process's real default group.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["TORCHRUN_VARS", "under_torchrun", "join", "num_nodes", "device", "comm_device",
           "is_collective_failure",
           "Progress", "PeerError", "run_isolated"]

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or a launcher that sets its variables)."""
    return all(k in os.environ for k in TORCHRUN_VARS)


def join() -> None:
    """Join torchrun's process group when this process is part of a torchrun job and has no
    group yet (the collective timeout: launcher.init_from_env). A no-op otherwise."""
    if dist.is_initialized() or not under_torchrun():
        return
    from autoplan.runtime.launcher import init_from_env

    init_from_env()


def num_nodes(given: int | None, world_size: int) -> int | None:
    """The job's node count: `given` (the user's `num_nodes=`) checked against torchrun's
    WORLD_SIZE / LOCAL_WORLD_SIZE when both are known; None when neither says.

    Raises ValueError when they disagree or WORLD_SIZE is not a multiple of LOCAL_WORLD_SIZE.
    """
    local = os.environ.get("LOCAL_WORLD_SIZE") if dist.is_initialized() else None
    if local is None:
        return given
    per_node = int(local)
    if per_node < 1 or world_size % per_node:
        raise ValueError(f"torchrun: WORLD_SIZE={world_size} is not a multiple of "
                         f"LOCAL_WORLD_SIZE={per_node}")
    from autoplan.units import plural

    from_env = world_size // per_node
    if given is not None and given != from_env:
        raise ValueError(
            f"num_nodes={given}, but torchrun started {plural(from_env, 'node')} of {per_node} "
            f"ranks "
            f"(WORLD_SIZE={world_size}, LOCAL_WORLD_SIZE={per_node}); drop num_nodes= to use "
            "the job's")
    return from_env


def device() -> str:
    """Where this rank computes: its CUDA device under the NCCL backend (set from LOCAL_RANK
    by `join`), else "cpu"."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def comm_device() -> torch.device:
    """Where a tensor must be for the default group's collectives: this rank's CUDA device
    under NCCL, else the CPU (gloo)."""
    return torch.device(device())


class PeerError(RuntimeError):
    """A collective failed on this rank while other ranks were elsewhere: the message names
    them and where they were last (see Progress); the collective's own error is chained."""


_PEER_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
               "peer", "gloo", "nccl", "socket")


def is_collective_failure(error: BaseException) -> bool:
    """Whether `error` is a collective's failure -- torch.distributed's own error types, or
    the words gloo and NCCL use for a lost or late peer -- rather than an error of the step's
    own computation (which is re-raised as it is, not blamed on a peer)."""
    if isinstance(error, (dist.DistError, TimeoutError)):
        return True
    text = str(error).lower()
    return any(word in text for word in _PEER_WORDS)


class Progress:
    """Where every rank of the job is, kept in the job's store, so that a rank whose collective
    fails can name the peer it waited for.

    Each rank writes one key, `autoplan/progress/<rank>` = "<unix time> <what>", at the start
    and the end of every step (two small store writes per step). When a collective times out
    or loses its peer, gloo says only "Timed out waiting ..." or "Connection reset by peer";
    `others(current)` reads the peers' keys and names those not at `current` -- a rank that
    hangs between steps, or died, has an older mark. A job of one rank keeps nothing.
    """

    PREFIX = "autoplan/progress/"

    def __init__(self):
        from autoplan._torch_compat import default_store

        self.store = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.store = default_store()
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def mark(self, what: str) -> None:
        if self.store is not None:
            self.store.set(f"{self.PREFIX}{self.rank}", f"{time.time():.3f} {what}")

    def others(self, current: str) -> str:
        """A line per other rank not at `current`: its last mark and how long ago ("" when
        every rank is there, or nothing can be read)."""
        if self.store is None:
            return ""
        lines, now = [], time.time()
        for r in range(self.world_size):
            key = f"{self.PREFIX}{r}"
            if r == self.rank:
                continue
            try:
                if not self.store.check([key]):
                    lines.append(f"rank {r}: no step started yet")
                    continue
                stamp, _, what = self.store.get(key).decode().partition(" ")
            except Exception:  # noqa: BLE001 - the store is gone too: nothing to add
                return ""
            if what != current:
                lines.append(f"rank {r}: last at '{what}', {now - float(stamp):.0f} s ago")
        return "\n".join(lines)


def _child(fn: Callable, args: tuple, conn) -> None:
    from autoplan._torch_compat import forget_process_groups

    try:
        forget_process_groups()
        conn.send((True, fn(*args)))
    except BaseException:  # noqa: BLE001 - sent to the parent with its traceback
        conn.send((False, traceback.format_exc()))
    finally:
        conn.close()


def run_isolated(fn: Callable, *args: Any, timeout_s: float = 600.0) -> Any:
    """`fn(*args)` in a forked child without this process's process groups; returns its
    (picklable) result. Nothing is pickled on the way in, so `fn` and `args` may be anything
    in memory (a captured graph, a closure).

    Raises RuntimeError with the child's traceback when it fails, TimeoutError (the child
    killed) past `timeout_s` seconds.
    """
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(fn, args, send), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish within "
                               f"{timeout_s:.0f} s in its forked child")
        ok, value = receive.recv()
    except EOFError:
        child.join(timeout=5)
        raise RuntimeError(f"{getattr(fn, '__name__', fn)}: its forked child exited with "
                           f"code {child.exitcode} without a result") from None
    finally:
        if child.is_alive():
            child.join(timeout=5)
        if child.is_alive():
            child.kill()
            child.join()
        receive.close()
    if not ok:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed in its forked child:\n{value}")
    return value
