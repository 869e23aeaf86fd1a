"""Shared fixtures: gloo clusters are started once per session and reused by every test
(process start-up and imports dominate a tiny job), and each job has a timeout; a fake process
group per test module (`fake_world`)."""

from __future__ import annotations

import os

# Triton reads TRITON_INTERPRET when it is first imported (torch.export imports it), so the
# kernels' interpreter tests need it set before any test module loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

from autoplan.runtime.launcher import LocalCluster  # noqa: E402


class _Clusters:
    def __init__(self):
        self._live: dict[int, LocalCluster] = {}

    def get(self, world_size: int) -> LocalCluster:
        cluster = self._live.get(world_size)
        if cluster is None or cluster._closed:  # a failed job kills its cluster; start anew
            cluster = self._live[world_size] = LocalCluster(world_size)
        return cluster

    def close(self):
        for c in self._live.values():
            c.close()


@pytest.fixture(scope="session", autouse=True)
def _session_plan_cache(tmp_path_factory):
    """The plan cache (autoplan/cache.py) of module and session fixtures: one of this session,
    never the user's ~/.cache/autoplan. The capture cache ([Note: capture cache] in
    autoplan/capture/cache.py) is one for the whole run, shared by the xdist workers: a
    capture is a function of its key alone, so a test reads what an earlier one captured (the
    tests of the cache's own behaviour use `own_capture_cache`)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path_factory.mktemp("plan-cache-session")))
        mp.setenv("AUTOPLAN_CAPTURE_CACHE_DIR", str(shared / "capture-cache"))
        yield


@pytest.fixture
def own_capture_cache(tmp_path, monkeypatch):
    """An empty capture cache of this test's own, for tests that count its hits and misses."""
    monkeypatch.setenv("AUTOPLAN_CAPTURE_CACHE_DIR", str(tmp_path / "captures"))


@pytest.fixture(autouse=True)
def _empty_plan_cache(_session_plan_cache, tmp_path_factory, monkeypatch):
    """Every test plans with an empty plan cache of its own, in this process and the CLI
    processes it starts: a test that runs `autoplan plan` twice sees its own second run served
    from the cache, never another test's plan (nor the user's)."""
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path_factory.mktemp("plan-cache")))


@pytest.fixture(scope="session")
def clusters():
    c = _Clusters()
    yield c
    c.close()


@pytest.fixture(scope="module")
def fake_world():
    """A fake process group of 4 ranks (no communication): lets DTensor really dispatch ops on
    meta tensors so that implicit redistributions can be caught."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    if owned:
        dist.destroy_process_group()


@pytest.fixture
def no_private_group():
    """A one-process build keeps the one-rank group it made (session._PRIVATE_GROUP) for the
    process's life; a test module that builds one in the test process takes it down after each
    test (`pytestmark = pytest.mark.usefixtures("no_private_group")`), so that later test files
    (the fake 4-rank worlds of export, strategies and solver tests) start without a process
    group."""
    yield
    from autoplan import session

    if session._PRIVATE_GROUP and dist.is_initialized() and \
            dist.group.WORLD is session._private_group():
        dist.destroy_process_group()
        session._PRIVATE_GROUP.pop()
