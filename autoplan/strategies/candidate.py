"""The types every file of `autoplan.strategies` shares: `Candidate` (one way to run a node on
the tp axis) and `StrategyCache`. A leaf module, so that the package's modules form a DAG
(docs/design.md, house rule 12): probe.py, prune.py and experts_candidates.py import it, and the
package's `__init__` re-exports it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Candidate", "StrategyCache"]


@dataclass(frozen=True)
class Candidate:
    """One way to run a node on the tp axis.

    Attributes:
        inputs: placement ("R", "P", "S(d)") of each tensor argument, [Note: argument order].
        outputs: placement of each tensor output (one entry for single-output ops).
        shard_factor: tp when the op's work is split across the tp ranks (an input or an
            output is sharded), else 1. Partial-only candidates do full-size work per rank.
    """

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    shard_factor: float


class StrategyCache(dict):
    """Cache of candidate lists keyed by node signature; pass one to `node_strategies` to
    share work between calls (e.g. several tp degrees of one planning run)."""
