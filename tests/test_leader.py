"""Rank 0 captures and solves for every rank of a job ([Note: leader rank] in
autoplan/runtime/leader.py): one solve per job, the others read rank 0's capture from the
capture cache, and every rank ends with rank 0's plan, its warnings or its error."""

from __future__ import annotations

import _leader_jobs


def test_rank_0_solves_and_every_rank_takes_its_plan(clusters):
    rows = clusters.get(4).run(_leader_jobs.plan_on_every_rank, "llama-tiny", 4,
                               {"dp": 2, "tp": 2}, timeout_s=600)
    by_rank = {r["rank"]: r for r in rows}
    assert [by_rank[r]["solves"] for r in range(4)] == [1, 0, 0, 0]
    assert len({r["plan"] for r in rows}) == 1
    # the others read the graph rank 0 captured (a cache hit), whatever rank 0 found
    assert all(by_rank[r]["capture_cached"] for r in (1, 2, 3))


def test_rank_0_s_warnings_are_said_on_every_rank(clusters):
    """tp 3 replicates every weight of the tiny Llama's blocks: the solver's
    ReplicatedWeightsWarning, said by rank 0 as it solves, is said on the other ranks too."""
    rows = clusters.get(3).run(_leader_jobs.plan_on_every_rank, "llama-tiny", 3, {"tp": 3},
                               timeout_s=600)
    said = [r["warnings"] for r in sorted(rows, key=lambda r: r["rank"])]
    assert any(category == "ReplicatedWeightsWarning" for category, _ in said[0])
    assert said[1] == said[2] == said[0]


def test_rank_0_s_planning_error_is_raised_on_every_rank(clusters):
    rows = clusters.get(4).run(_leader_jobs.plan_on_every_rank, "llama-tiny", 4, {"tp": 3},
                               timeout_s=600)
    raised = {r["raised"] for r in rows}
    assert len(raised) == 1, raised
    (kind, message), = raised
    assert kind == "InvalidConfig" and "tp" in message
    assert sorted(r["solves"] for r in rows) == [0, 0, 0, 1]


def test_a_rank_that_waits_too_long_for_rank_0_names_it_and_the_work(clusters):
    rows = dict(clusters.get(4).run(_leader_jobs.slow_leader, 2.0, 0.2, timeout_s=120))
    assert rows[0] == "rank 0's result"
    for rank in (1, 2, 3):
        assert rows[rank].startswith(f"LeaderTimeout: rank {rank} waited 0.2 s for rank 0 "
                                     "sleeping"), rows[rank]
