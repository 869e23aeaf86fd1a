"""Process launching: a local cluster of N CPU ranks (gloo), and `torchrun` environments.

`LocalCluster(world_size)` starts N worker processes once (forked from a server that has
imported torch: [Note: ranks fork from a preloaded server]) and keeps their gloo process group
alive, so many jobs (tests, benchmarks) share one set of processes instead of paying process and
import start-up each time. `LocalCluster.run(fn, *args, timeout_s=...)` runs `fn(*args)` on every
rank and returns the per-rank results in rank order. A failed job raises `RankError` naming the
rank that caused it ([Note: naming the failed rank] in rank_faults.py) and closes the cluster; a
job that does not finish within `timeout_s` raises TimeoutError (no hangs: every multi-rank path
has a timeout).

Collective timeout: a rank waits at most `pg_timeout_s` in one collective for its peers, then
raises. `LocalCluster` defaults to LOCAL_COLLECTIVE_TIMEOUT_S (300 s): a dead peer is found by
the liveness watch within a second, so this timeout only bounds a hang, which is then named
within 300 s + FAULT_GRACE_S. It must stay far above a healthy wait: ranks capture and plan
on their own before the plan's broadcast, and on a loaded machine one rank can be a minute
behind another (45 s failed the test suite's 2-rank jobs on a 2-core machine under load).
`init_from_env` defaults to TORCHRUN_COLLECTIVE_TIMEOUT_S (600 s): across machines the first
NCCL contact and checkpoint loads take minutes, and torchrun's agent tears the job down when a
worker dies. The environment variable AUTOPLAN_COLLECTIVE_TIMEOUT_S (seconds) overrides both
defaults; an explicit argument overrides it.

Under `torchrun` (RANK/WORLD_SIZE/MASTER_ADDR in the environment) `init_from_env()` joins the
job's process group instead; multi-node launching is torchrun's job. A group it creates is
drained and destroyed at exit ([Note: orderly exit] in shutdown.py); one that exists already
is left to whoever created it.

Ranks die with the parent that started them, even one killed by SIGKILL; SIGTERM of the parent
first closes its clusters ([Note: ranks die with their parent], parent_death.py).
"""

from __future__ import annotations

import faulthandler
import gc
import math
import multiprocessing as mp
import os
import pickle
import queue
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import weakref
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from autoplan._torch_compat import (clear_dtensor_caches, destroy_groups, live_groups,
                                   shared_mesh_groups)
from autoplan.runtime.parent_death import close_on_sigterm, die_with_parent
from autoplan.runtime.rank_faults import (Outcome, RankError, death_stack, dump_stacks, exit_text,
                                          fold, frame_text, main_stack, rank_error)
from autoplan.runtime.shutdown import init_default_group

__all__ = ["COLLECTIVE_TIMEOUT_ENV", "FAULT_GRACE_S", "LOCAL_COLLECTIVE_TIMEOUT_S",
           "LocalCluster", "RankError", "TORCHRUN_COLLECTIVE_TIMEOUT_S", "init_from_env",
           "launch"]

COLLECTIVE_TIMEOUT_ENV = "AUTOPLAN_COLLECTIVE_TIMEOUT_S"
LOCAL_COLLECTIVE_TIMEOUT_S = 300.0
TORCHRUN_COLLECTIVE_TIMEOUT_S = 600.0
FAULT_GRACE_S = 5.0
"""Seconds the other ranks get to report after the first fault of a job: a peer of a dead rank
fails at once (its socket closes); one stuck waiting for a rank that raised would wait for the
whole collective timeout, so its stack is taken instead."""

_POLL_S = 0.5  # how often `run` checks that every rank's process is alive
_START_TIMEOUT_S = 300.0  # the ranks' rendezvous: torch imports on a loaded machine are slow
_STARTUP_JOB = -1  # job id of a rank's report that it failed to start


def _collective_timeout_s(timeout_s: float | None, default_s: float) -> float:
    """`timeout_s`, else $AUTOPLAN_COLLECTIVE_TIMEOUT_S, else `default_s`; seconds. Raises
    ValueError for a value that is not a positive number, naming where it came from."""
    source = "timeout"
    if timeout_s is None:
        text = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
        if text is None:
            return default_s
        source = f"${COLLECTIVE_TIMEOUT_ENV}"
        try:
            timeout_s = float(text)
        except ValueError:
            raise ValueError(f"{source}={text!r} is not a number of seconds") from None
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"collective {source}={timeout_s!r} s must be a positive number")
    return float(timeout_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summary(exc: BaseException) -> str:
    """One line for an exception: its type and the first line of its message, without the C++
    source location gloo prefixes and cut at a sentence end past 160 characters."""
    try:
        text = str(exc).strip()
    except Exception:  # noqa: BLE001 - a broken __str__ must not take the worker down
        text = "<str() failed>"
    text = text.splitlines()[0] if text else ""
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\] ", "", text)
    if len(text) > 160:
        end = text.find(". ", 0, 160)
        text = text[:end + 1] if end > 0 else text[:160] + " ..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# [Note: ranks fork from a preloaded server]
# A rank is a fresh process: spawned, it imports torch, torch.distributed, DTensor and (for a
# Hugging Face model) transformers before its first job, ~3 s of CPU each on this machine, paid
# by every rank of every cluster -- 40% of the CPU of a 4-rank compiled job that starts two
# clusters (tests/test_compile.py, py-spy). So ranks start from multiprocessing's fork server
# (`_rank_context`), a clean process started once per parent that imports this module (torch,
# torch.distributed, autoplan's DTensor layer) and transformers when the parent has imported
# it, then forks each rank: the imports are paid once per parent, not once per rank (4 ranks
# that import torch and transformers: 11.6 s of CPU spawned, 0 in the ranks forked, 2.9 s in
# the server). The server also imports what every job's first step imports (`_PRELOAD`: the
# solver, the engine) and the Hugging Face model modules the parent has imported (the models
# its jobs build): a fresh rank's CPU to the end of its first gpt2-tiny dp2 job, 3.7 and 3.3 s
# before, 1.0 and 0.7 s after (2 ranks, getrusage; 2026-12-08). The server is single-threaded and
# has run no op (no OpenMP pool, no CUDA context), so forking it is safe, and it is not the
# parent: the parent's other threads and state stay out. What a fork server does not pass on,
# the rank takes itself: the parent's environment as it is at the cluster's start (`env`; the
# server's is the one it started with -- the test suite sets a plan cache directory per test),
# and the death of the process that started it ([Note: ranks die with their parent]; the server
# is the rank's parent). Some of what the server imports reads the environment once, at import
# (torch._inductor's config, triton's TRITON_INTERPRET): a cluster started when the parent's
# TORCH*/PYTORCH*/TRITON* variables differ from those the server started with spawns its ranks
# instead, which import under the cluster's own environment.

# Modules the first step of every job imports (the planner, the engine): preloaded.
_PRELOAD = ("autoplan.solver", "autoplan.runtime.engine")
_MODEL_MODULE = re.compile(r"transformers\.models\.\w+\.modeling_\w+")
_ENV_READ_AT_IMPORT = ("TORCH", "PYTORCH", "TRITON")
_server_env: dict[str, str] | None = None  # those variables as the fork server started


def _rank_context():
    """The multiprocessing context ranks start from ([Note: ranks fork from a preloaded
    server]): "forkserver" with this module, `_PRELOAD` and, when the parent has imported
    them, transformers and its model modules preloaded (the list takes effect when the server
    starts: at the first cluster of a process); "spawn" where the parent's environment has
    changed since then in a variable torch, triton or inductor read at import."""
    global _server_env
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_READ_AT_IMPORT)}
    if _server_env is None:
        _server_env = env
    elif env != _server_env:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    models = sorted(m for m in sys.modules if _MODEL_MODULE.fullmatch(m))
    preload = [__name__, *_PRELOAD] + [m for m in ("transformers",) if m in sys.modules]
    ctx.set_forkserver_preload(preload + models)
    return ctx


def _worker(rank: int, world_size: int, port: int, tasks, results, pg_timeout_s: float,
            stack_path: str, parent_pid: int, use_prctl: bool, env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)  # the parent's, not the fork server's
    die_with_parent(parent_pid, use_prctl=use_prctl, poll_s=_POLL_S)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # A rank that crashes or hangs cannot report on the queue: faulthandler writes its stacks
    # to a file the parent reads, on a fatal signal and on SIGUSR1 ([Note: naming the failed
    # rank]). The file stays open for the life of the process.
    stacks = open(stack_path, "w")
    faulthandler.enable(file=stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # One intra-op thread per rank: N ranks share this machine's cores.
    torch.set_num_threads(1)
    try:
        # The rendezvous waits for slow imports; collectives wait at most pg_timeout_s.
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                              timeout=timedelta(seconds=max(pg_timeout_s, _START_TIMEOUT_S)))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then exit
        results.put((_STARTUP_JOB, rank, False, (f"failed to start: {_summary(e)}",
                                                 traceback.format_exc())))
        raise
    gc.freeze()  # [Note: a job ends with its groups]: what start-up made is never collected
    while True:
        item = tasks.get()
        if item is None:
            break
        job_id, payload = item
        before = live_groups()
        try:
            fn, args, kwargs = pickle.loads(payload)
            out = fn(*args, **kwargs)
            results.put((job_id, rank, True, pickle.dumps(out)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent with the traceback
            results.put((job_id, rank, False, (_summary(e), traceback.format_exc())))
        _end_job(before)
    dist.destroy_process_group()


def _end_job(before: set) -> None:
    """What a job leaves in a rank that outlives it ([Note: a job ends with its groups]).

    Note [a job ends with its groups]: torch 2.13 creates new process groups (gloo: sockets
    and threads) at every `init_device_mesh`, and nothing destroys them while DTensor's plan
    caches name their mesh: a dp2 x tp2 job left 14 descriptors and 9 threads in each rank,
    and after the test suite's hundreds of jobs one rank of the shared pool died of SIGSEGV in
    a gloo all-gather. Two things keep a rank as a fresh process would be. An engine takes
    its mesh from `shared_mesh` (autoplan/_torch_compat/c10d.py): one mesh, so one set of
    groups, per mesh shape in a process, reused by every later engine of that shape -- in a
    user's process too, where each model built used to add its own. And after each job a
    rank destroys the groups the job created that no shared mesh holds (a job's own
    `init_device_mesh` or `new_group`), then clears DTensor's caches when it destroyed any, so
    that no later job reuses a plan naming a destroyed group. A rank's job is over when it
    reports, so its collectives on them are done. A full collection traverses every object the
    collector tracks: a rank freezes what its start-up made (torch, transformers: about 260k
    objects, `gc.freeze`) out of it, so that this collection and the interpreter's own full
    ones walk only what jobs made (a dp2 x tp2 job's collection: 0.25 -> 0.1 s of CPU; the
    tests of tests/test_cases.py and test_dryrun_vs_real.py: 5% less CPU, 2026-12-07).
    """
    if destroy_groups(keep=before | shared_mesh_groups()):
        clear_dtensor_caches()
        gc.collect()


def _reported(ok: bool, data, seq: int, elapsed_s: float) -> Outcome:
    """The outcome a rank reported: its pickled result, or (summary, traceback)."""
    if not ok:
        summary, tb = data
        return Outcome("raised", seq, elapsed_s, summary=summary, detail=tb)
    try:
        return Outcome("ok", seq, elapsed_s, value=pickle.loads(data))
    except Exception as e:  # noqa: BLE001 - e.g. a class that only the ranks can import
        return Outcome("raised", seq, elapsed_s, summary=f"result not unpickled: {_summary(e)}",
                        detail=traceback.format_exc())


class LocalCluster:
    """N gloo ranks on this machine, reused across jobs.

    Args:
        world_size: number of ranks.
        pg_timeout_s: how long a rank waits in one collective for its peers before it raises,
            seconds; None: $AUTOPLAN_COLLECTIVE_TIMEOUT_S, else LOCAL_COLLECTIVE_TIMEOUT_S
            (300 s; see the module docstring for why).

    Raises ValueError for world_size < 1 or a timeout that is not a positive number. Use as a
    context manager or call `close()`; a failed job closes the cluster itself.
    """

    def __init__(self, world_size: int, *, pg_timeout_s: float | None = None):
        if world_size < 1:
            raise ValueError(f"LocalCluster: world_size={world_size} must be >= 1")
        self.world_size = world_size
        self.pg_timeout_s = _collective_timeout_s(pg_timeout_s, LOCAL_COLLECTIVE_TIMEOUT_S)
        ctx = _rank_context()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._stack_dir = tempfile.mkdtemp(prefix="autoplan-ranks-")
        self._stack_paths = [os.path.join(self._stack_dir, f"rank{r}.stacks")
                             for r in range(world_size)]
        port = _free_port()
        # PR_SET_PDEATHSIG fires when the thread that forked a rank ends: the fork server's
        # only thread, which lives until this process ends ([Note: ranks die with their
        # parent], [Note: ranks fork from a preloaded server]).
        env = dict(os.environ)
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, world_size, port, self._tasks[r], self._results,
                              self.pg_timeout_s, self._stack_paths[r], os.getpid(), True, env))
            for r in range(world_size)]
        for p in self._procs:
            p.start()
        self._next_job = 0
        self._closed = False
        ref = weakref.ref(self)  # the handler must not keep a dropped cluster alive

        def close_now() -> None:
            if (cluster := ref()) is not None:
                cluster.close(kill=True)
        self._uninstall_sigterm = close_on_sigterm(close_now)

    def run(self, fn: Callable, *args: Any, timeout_s: float = 300.0, **kwargs: Any) -> list:
        """Run `fn(*args, **kwargs)` on every rank; per-rank results in rank order.

        `fn` must be importable by the workers (a module-level function). Raises RankError
        naming the rank that caused a failure (a rank died, raised, or hung while the others
        failed; [Note: naming the failed rank]), within about FAULT_GRACE_S + 1 s of a death;
        TimeoutError when no rank failed but some gave no result within `timeout_s` seconds.
        Either way the cluster is closed (its processes killed and reaped).
        """
        if self._closed:
            raise RuntimeError("LocalCluster is closed (an earlier job failed or timed out)")
        job_id = self._next_job
        self._next_job += 1
        payload = pickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put((job_id, payload))
        outcomes = self._collect(job_id, timeout_s)
        if all(o.kind == "ok" for o in outcomes.values()):
            return [outcomes[r].value for r in range(self.world_size)]
        faults = {r: o for r, o in outcomes.items() if o.kind != "ok"}
        self.close(kill=True)
        job = getattr(fn, "__name__", repr(fn))
        if all(o.kind == "hung" for o in faults.values()):
            raise TimeoutError(self._timeout_message(job, timeout_s, faults))
        raise rank_error(faults, job)

    def _collect(self, job_id: int, timeout_s: float) -> dict[int, Outcome]:
        """Every rank's outcome: results as they come, deaths as `_POLL_S` polls see them; after
        the first fault the others get FAULT_GRACE_S. Ranks without one by then are hung."""
        start = time.monotonic()
        deadline = start + timeout_s
        outcomes: dict[int, Outcome] = {}
        while len(outcomes) < self.world_size and time.monotonic() < deadline:
            try:
                jid, rank, ok, data = self._results.get(
                    timeout=max(0.0, min(_POLL_S, deadline - time.monotonic())))
            except queue.Empty:
                pass
            else:
                if jid in (job_id, _STARTUP_JOB) and rank not in outcomes:
                    outcomes[rank] = _reported(ok, data, len(outcomes), time.monotonic() - start)
            for r, p in enumerate(self._procs):
                if r not in outcomes and p.exitcode is not None:
                    outcomes[r] = Outcome("died", len(outcomes), time.monotonic() - start,
                                           summary=exit_text(p.exitcode),
                                           detail=death_stack(self._stack_paths[r]))
            if any(o.kind != "ok" for o in outcomes.values()):
                deadline = min(deadline, time.monotonic() + FAULT_GRACE_S)
        return self._hung(outcomes, time.monotonic() - start)

    def _hung(self, outcomes: dict[int, Outcome], elapsed_s: float) -> dict[int, Outcome]:
        """`outcomes` with a "hung" outcome, stack included, for every rank that has none."""
        missing = [r for r in range(self.world_size) if r not in outcomes]
        dumps = dump_stacks({r: (self._procs[r].pid, self._stack_paths[r]) for r in missing})
        for r in missing:
            o = Outcome("hung", len(outcomes), elapsed_s, detail=dumps.get(r, ""))
            frames = main_stack(o.detail)
            where = f", waiting in {frame_text(frames[0])}" if frames else ""
            o.summary = f"no result after {elapsed_s:.0f} s" + where
            outcomes[r] = o
        return outcomes

    def _timeout_message(self, job: str, timeout_s: float, hung: dict[int, Outcome]) -> str:
        lines = [f"job {job} did not finish on ranks {sorted(hung)} of {self.world_size} "
                 f"within {timeout_s:g} s (no rank failed)"]
        for r, o in sorted(hung.items()):
            lines += [f"rank {r}: {o.summary}"] + fold(o)
        return "\n".join(lines)

    def close(self, kill: bool = False) -> None:
        """Stop the ranks: ask them to leave (then kill those still there after 10 s), or kill
        them at once when `kill`; every process is reaped. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._uninstall_sigterm()
        if not kill:
            for q in self._tasks:
                q.put(None)
            deadline = time.monotonic() + 10.0
            for p in self._procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        for q in [*self._tasks, self._results]:
            q.cancel_join_thread()  # a dead reader must not block this process's exit
            q.close()
        shutil.rmtree(self._stack_dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close(kill=exc[0] is not None)


def launch(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0, **kwargs):
    """Run `fn(*args, **kwargs)` once on `world_size` fresh gloo ranks; per-rank results.
    Raises as `LocalCluster.run` does."""
    with LocalCluster(world_size) as cluster:
        return cluster.run(fn, *args, timeout_s=timeout_s, **kwargs)


def init_from_env(*, timeout_s: float | None = None) -> tuple[int, int]:
    """Join the process group that `torchrun` describes in the environment.

    Uses NCCL when CUDA is available, else gloo; the group, when this call creates it, is
    destroyed in order at exit ([Note: orderly exit] in shutdown.py). `timeout_s`: how long a
    rank waits in one collective, seconds; None: $AUTOPLAN_COLLECTIVE_TIMEOUT_S, else
    TORCHRUN_COLLECTIVE_TIMEOUT_S (600 s). Returns (rank, world_size). Raises ValueError naming
    the missing variables when not started by torchrun, or for a timeout that is not a
    positive number.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise ValueError(f"not under torchrun: environment variables {missing} are not set")
    timeout_s = _collective_timeout_s(timeout_s, TORCHRUN_COLLECTIVE_TIMEOUT_S)
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        init_default_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
