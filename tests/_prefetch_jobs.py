"""Rank jobs of tests/test_prefetch.py."""

from __future__ import annotations

import _jobs


def prefetch_and_losses(name: str, config: dict, steps: int, batch: int, overrides: dict):
    """On every rank: train `name` (its config changed by `config`) under `overrides` twice,
    with the runtime's forward prefetch and without. Returns, for the prefetching model's FSDP2 block units: the order
    their forwards ran in during its first step, the units each prefetches (unit i = the
    i-th to run), whether each issues its all-gathers without waiting; and both runs' losses."""
    from autoplan._torch_compat.dtensor import forward_prefetched, unshard_async_enabled
    from autoplan.api import autoparallel
    from autoplan.runtime.rank_stages import RankStages

    losses, seen = {}, {}
    for prefetch in (True, False):
        RankStages.forward_prefetch = prefetch
        try:
            model = _jobs.preset(name, **config)()
            ap = autoparallel(model, global_batch=batch, seq_len=_jobs.SEQ, **overrides)
            ap.build()
            ran, hooks = [], []
            if prefetch:
                units = [m for _, stage in ap._engine.stages for m in stage.modules()
                         if hasattr(m, "_get_fsdp_state") and m is not stage]
                hooks = [u.register_forward_pre_hook(lambda m, _a, i=i: ran.append(i))
                         for i, u in enumerate(units)]
            x, y = _jobs.batches(_jobs.vocab_of(model), steps, batch)
            losses[prefetch] = []
            for i in range(steps):
                losses[prefetch].append(ap.step(x[i], y[i]))
                for h in hooks:
                    h.remove()
                hooks = []
        finally:
            RankStages.forward_prefetch = True
        if prefetch:
            order = list(dict.fromkeys(ran))  # first run of each unit (recompute runs again)
            seen = {"order": order,
                    "prefetched": [[order.index(units.index(t)) for t in forward_prefetched(
                        units[u])] for u in order],
                    "async": [unshard_async_enabled(units[u]) for u in order]}
    return seen, losses[True], losses[False]
