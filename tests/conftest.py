"""Shared fixtures: gloo clusters are started once per session and reused by every test
(process start-up and imports dominate a tiny job), and each job has a timeout."""

from __future__ import annotations

import pytest

from autoplan.runtime.launcher import LocalCluster


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


@pytest.fixture(scope="session")
def clusters():
    c = _Clusters()
    yield c
    c.close()
