"""[Note: forward prefetch] in autoplan/runtime/parallel.py: under ZeRO 2/3 each FSDP2 block
unit issues the next block's all-gather in its own pre-forward, without waiting for it, and
that changes when the parameters are gathered, never what is computed. What it buys on gloo:
bench/overlap.py."""

from __future__ import annotations

import pytest

import _prefetch_jobs

STEPS, BATCH = 2, 8


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    dict(pp=1, dp=4, tp=1, zero_stage=3),
    dict(pp=1, dp=4, tp=1, zero_stage=2),
    dict(pp=2, dp=2, tp=1, zero_stage=3, num_microbatches=2, schedule="1f1b",
         checkpointing="full"),
], ids=["dp4-zero3", "dp4-zero2", "pp2xdp2-zero3-full"])
def test_each_block_prefetches_the_one_that_runs_next(clusters, overrides):
    """The prefetched unit is the next to run in the forward (recorded by hooks), the last
    prefetches none, every block unit's all-gathers are issued without waiting; the losses
    equal those without prefetch bit for bit (the same all-gathers, issued earlier)."""
    results = clusters.get(4).run(_prefetch_jobs.prefetch_and_losses, "llama-tiny",
                                  dict(num_hidden_layers=4), STEPS, BATCH, overrides,
                                  timeout_s=300)
    for seen, with_prefetch, without in results:
        n = len(seen["order"])
        assert n == 4 // overrides["pp"], seen  # the stage's blocks, one unit each
        assert seen["prefetched"] == [[i + 1] for i in range(n - 1)] + [[]], seen
        assert all(seen["async"]), seen
        assert with_prefetch == without
