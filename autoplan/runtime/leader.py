"""Work one rank of a job does for all of them ([Note: leader rank]).

    graph = leader_first(lambda: cached_capture(...), what="capturing GPT")
    plan = from_leader(lambda: solve(...), what="planning GPT")

[Note: leader rank]
The capture and the solve are the same on every rank of a job: the same model, batch and
cluster give the same graph and the same plan. Done on every rank they cost N times the CPU
for one answer, and on a machine whose ranks share cores (4 gloo ranks on 2 cores; 8 GPU
ranks on a node's host CPUs) every rank waits for all of them: that was two thirds of a tiny
job's CPU from construction to its first loss. So rank 0, the leader, works alone:

  - `leader_first`: rank 0 runs the work first (a capture, which writes the capture cache,
    [Note: capture cache] in autoplan/capture/cache.py), then every other rank runs it: a
    cache hit where the ranks share a disk, else a capture of its own, the same graph. When
    rank 0's work raises, the others still run theirs, and raise as it did.
  - `from_leader`: rank 0 alone runs the work (the audit of the graph's random ops and batch
    couplings, and the solve); its result -- or the exception it raised -- reaches every rank
    through the job's store (`_torch_compat.default_store`), and each rank returns (or
    raises) the same.

The others wait in the store, not in a collective: a solve may take longer than a collective
may wait (LOCAL_COLLECTIVE_TIMEOUT_S), so they wait up to LEADER_TIMEOUT_S and then fail
naming rank 0 and the work they waited for. Each call takes the next key of a counter every
rank advances in the same order (the ranks run the same program), and names the work, so a
rank that waits for other work than rank 0 did times out naming it rather than reading another
result.

Only for a real job of more than one rank; alone (or on torch's fake process group, whose
store holds nothing) the work runs here.
"""

from __future__ import annotations

import itertools
import pickle
from datetime import timedelta
from typing import Callable, TypeVar

import torch.distributed as dist

__all__ = ["LEADER_TIMEOUT_S", "LeaderTimeout", "from_leader", "leader_first", "shared"]

T = TypeVar("T")

LEADER_TIMEOUT_S = 3600.0
"""Seconds a rank waits for rank 0's capture or solve: past the longest solve the planner is
given by default (the golden 16,384-GPU plans solve in under a minute here), well short of a
job's lifetime."""

_calls = itertools.count()  # each call's key; every rank advances it in the same order


class LeaderTimeout(RuntimeError):
    """Rank 0 did not finish the work the others waited for within LEADER_TIMEOUT_S."""


def shared() -> bool:
    """Whether this process is one rank of a job of several with a store to meet in (not
    torch's fake process group)."""
    return (dist.is_initialized() and dist.get_world_size() > 1
            and dist.get_backend() != "fake")


def leader_first(work: Callable[[], T], *, what: str,
                 timeout_s: float = LEADER_TIMEOUT_S) -> T:
    """`work()` on rank 0, then on every other rank (see the module doc). Returns this
    rank's result; raises what this rank's `work` raises, LeaderTimeout where rank 0 took
    longer than `timeout_s`. `what`: the work, for the timeout's message."""
    if not shared():
        return work()
    from autoplan._torch_compat import default_store

    store, key = default_store(), f"autoplan/leader/{next(_calls)}/{what}"
    if dist.get_rank() == 0:
        try:
            return work()
        finally:  # also when it raised: the others then run it and raise as rank 0 did
            store.set(key, b"done")
    _wait(store, key, what, timeout_s)
    _read(store, key)
    return work()


def from_leader(work: Callable[[], T], *, what: str,
                timeout_s: float = LEADER_TIMEOUT_S) -> T:
    """`work()` on rank 0 only; its result (picklable) on every rank, or on every rank the
    exception it raised (see the module doc). Raises LeaderTimeout where rank 0 took longer
    than `timeout_s`. `what`: the work, for the timeout's message."""
    if not shared():
        return work()
    from autoplan._torch_compat import default_store

    store, key = default_store(), f"autoplan/leader/{next(_calls)}/{what}"
    if dist.get_rank() == 0:
        try:
            result = work()
        except BaseException as e:
            store.set(key, _pickled(("raised", e)))
            raise
        store.set(key, pickle.dumps(("returned", result)))
        return result
    _wait(store, key, what, timeout_s)
    how, value = pickle.loads(_read(store, key))
    if how == "raised":
        raise value
    return value


def _pickled(outcome: tuple) -> bytes:
    """The outcome pickled; an exception that does not pickle goes as a RuntimeError with its
    type and message."""
    try:
        return pickle.dumps(outcome)
    except Exception:  # noqa: BLE001 - any exception type may fail to pickle
        e = outcome[1]
        return pickle.dumps((outcome[0], RuntimeError(f"on rank 0: {type(e).__name__}: {e}")))


def _wait(store, key: str, what: str, timeout_s: float) -> None:
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - torch raises DistStoreError or RuntimeError
        raise LeaderTimeout(
            f"rank {dist.get_rank()} waited {timeout_s:g} s for rank 0 {what} and it did not "
            f"finish ({type(e).__name__}: {e}); see rank 0's output for where it stopped") from None


def _read(store, key: str) -> bytes:
    """The value under `key`; the last of the other ranks to read it deletes it."""
    value = store.get(key)
    if store.add(f"{key}/read", 1) == dist.get_world_size() - 1:
        store.delete_key(key)
        store.delete_key(f"{key}/read")
    return value
