"""Rank functions of tests/test_leader.py (importable by the rank processes)."""

from __future__ import annotations

import time
import warnings

import torch.distributed as dist

import _jobs


def plan_on_every_rank(name: str, batch: int, overrides: dict) -> dict:
    """Plan `name` on this rank as `@autoparallel` does, with the plan cache off (an earlier
    job's plan would spare the solve), counting the solves this rank runs; the plan, the
    warnings said here and whether the planning capture was read from the capture cache. An
    exception of the planning is returned as its type and message."""
    import os

    from autoplan import session
    from autoplan.api import autoparallel

    solves = []
    solve = session.solve
    cache = os.environ.get("AUTOPLAN_PLAN_CACHE")
    os.environ["AUTOPLAN_PLAN_CACHE"] = "0"

    def counted(*args, **kwargs):
        solves.append(1)
        return solve(*args, **kwargs)

    session.solve = counted
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            ap = autoparallel(_jobs.preset(name)(), global_batch=batch, seq_len=_jobs.SEQ,
                              **overrides)
            try:
                plan = ap.plan.to_json()
            except Exception as e:  # noqa: BLE001 - the test compares it across ranks
                return {"rank": dist.get_rank(), "solves": len(solves),
                        "raised": (type(e).__name__, str(e))}
    finally:
        session.solve = solve
        if cache is None:
            del os.environ["AUTOPLAN_PLAN_CACHE"]
        else:
            os.environ["AUTOPLAN_PLAN_CACHE"] = cache
    return {"rank": dist.get_rank(), "solves": len(solves), "plan": plan,
            "capture_cached": ap.build_stats().get("capture_for_planning_cached"),
            "warnings": sorted({(w.category.__name__, str(w.message)) for w in said
                                if w.category.__module__.startswith("autoplan")})}


def slow_leader(sleep_s: float, timeout_s: float) -> tuple[int, str]:
    """Rank 0 works `sleep_s` seconds under `from_leader`; the others wait `timeout_s`.
    Returns (rank, the outcome: rank 0's result or the exception's type and message)."""
    from autoplan.runtime.leader import from_leader

    def work():
        time.sleep(sleep_s)
        return "rank 0's result"

    try:
        return dist.get_rank(), from_leader(work, what="sleeping", timeout_s=timeout_s)
    except Exception as e:  # noqa: BLE001 - returned for the test to read
        return dist.get_rank(), f"{type(e).__name__}: {e}"
