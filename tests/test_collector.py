"""The cyclic garbage collector paused while planning ([Note: collector paused] in
autoplan/collector.py): what the pause restores, where what it allocated ends up, and that
`autoplan plan` and `plan()` run no collection (a removed pause fails here, not only in
bench/plan_speed.py's timings)."""

from __future__ import annotations

import gc

import pytest

from autoplan.cli import main
from autoplan.collector import collector_paused


class _Node:  # a gc-tracked object that refers to another: a cycle when two refer to each other
    def __init__(self):
        self.other = None


@pytest.fixture
def collections():
    """Collections run while the test runs: (generation, objects collected) per collection."""
    seen: list[tuple[int, int]] = []

    def callback(phase, info):
        if phase == "stop":
            seen.append((info["generation"], info["collected"]))

    gc.collect()  # nothing pending from earlier tests
    gc.callbacks.append(callback)
    try:
        yield seen
    finally:
        gc.callbacks.remove(callback)


def test_the_pause_restores_the_collector_state():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # nested: the inner one leaves it paused
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("restored on error too")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled(), "a collector disabled before stays disabled"
    finally:
        gc.enable()


def test_what_the_pause_allocated_is_old_and_cycles_are_still_freed(collections):
    """Objects allocated while paused land in the oldest generation (no young collection
    scanning them all when the collector comes back); garbage cycles among them are freed by
    the next full collection; objects someone froze before stay frozen."""
    with collector_paused():
        kept = [_Node() for _ in range(20_000)]  # many times the young generation's threshold
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a cycle that becomes garbage
        del a, b
    assert gc.get_count()[0] < gc.get_threshold()[0], gc.get_count()
    assert not collections, collections
    assert gc.get_freeze_count() == 0
    assert gc.collect() >= 2
    del kept

    gc.freeze()  # as a process does before it forks
    try:
        frozen = gc.get_freeze_count()
        with collector_paused():
            _Node()
        # not unfrozen (that would empty the permanent generation); a frozen object whose last
        # reference goes meanwhile (a finalizer of an earlier test's objects) leaves it by itself
        assert frozen - 100 <= gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_cli_plan_runs_no_collection(capsys, tmp_path, collections):
    """`autoplan plan` (capture, solve, report, writing the files, the cache) runs without a
    collection, and leaves the collector enabled."""
    code = main(["plan", "--model", "llama-tiny", "--cluster", "local-cpu",
                 "--devices-per-node", "4", "--global-batch", "8", "--seq", "16", "--no-cache",
                 "-o", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    assert not collections, f"{len(collections)} collections while planning: {collections[:5]}"
    assert gc.isenabled()
