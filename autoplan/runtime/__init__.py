"""The bundled runtime: `DistributedModel` (autoplan/runtime/engine.py) trains one rank's share
of a planned model; `LocalCluster` (launcher.py) runs functions on N local gloo ranks."""

from autoplan.runtime.launcher import LocalCluster, RankError

__all__ = ["LocalCluster", "RankError"]
