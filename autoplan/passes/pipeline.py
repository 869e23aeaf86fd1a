"""The old name of autoplan/passes/stages.py (the split into pipeline stages), kept while
cost_model/traffic.py imports `constant_like_nodes` from here: the cost-model work of issue 25
moves that import, and then this module goes (tests/test_house.py, PENDING_NAMES)."""

from __future__ import annotations

from autoplan.passes.stages import StageGraph, assign_stages, constant_like_nodes, split_stages

__all__ = ["assign_stages", "constant_like_nodes", "split_stages", "StageGraph"]
