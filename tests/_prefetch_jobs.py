"""Rank jobs of tests/test_prefetch.py."""

from __future__ import annotations

import _jobs


def prefetch_and_losses(name: str, steps: int, batch: int, overrides: dict):
    """On every rank: train `name` under `overrides` twice, with the runtime's forward
    prefetch and without; return (for each FSDP2 block unit of the prefetching model, in the
    order they run, the FQN-free indices of the units it prefetches), and both runs' losses."""
    from autoplan._torch_compat.dtensor import forward_prefetched
    from autoplan.api import autoparallel
    from autoplan.runtime.rank_stages import RankStages

    losses, prefetched = {}, None
    for prefetch in (True, False):
        RankStages.forward_prefetch = prefetch
        try:
            model = _jobs.preset(name)()
            ap = autoparallel(model, global_batch=batch, seq_len=_jobs.SEQ, **overrides)
            x, y = _jobs.batches(_jobs.vocab_of(model), steps, batch)
            losses[prefetch] = [ap.step(x[i], y[i]) for i in range(steps)]
        finally:
            RankStages.forward_prefetch = True
        if prefetch:
            (_, stage), = ap._engine.stages
            units = [m for m in stage.modules() if hasattr(m, "_get_fsdp_state")
                     and m is not stage]
            prefetched = [[units.index(t) for t in forward_prefetched(u)] for u in units]
    return prefetched, losses[True], losses[False]
