"""[Note: forward prefetch] in autoplan/runtime/parallel.py: under ZeRO 2/3 each FSDP2 block
unit issues the next block's all-gather in its own pre-forward, and that changes when the
parameters are gathered, never what is computed. What it buys on gloo: bench/overlap.py."""

from __future__ import annotations

import pytest

import _prefetch_jobs

STEPS, BATCH = 2, 8


@pytest.mark.slow
@pytest.mark.parametrize("zero", [3, 2])
def test_each_block_prefetches_the_next_and_losses_are_unchanged(clusters, zero):
    results = clusters.get(4).run(_prefetch_jobs.prefetch_and_losses, "llama-tiny", STEPS,
                                  BATCH, dict(pp=1, dp=4, tp=1, zero_stage=zero), timeout_s=300)
    for prefetched, with_prefetch, without in results:
        n = len(prefetched)
        assert n >= 2, prefetched  # llama-tiny's blocks, one unit each
        assert prefetched == [[i + 1] for i in range(n - 1)] + [[]]
        assert with_prefetch == without  # bit for bit: the same all-gathers, issued earlier
