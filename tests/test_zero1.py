"""ZeRO-1's optimizer states in equal parts ([Note: ZeRO-1 partition] in
autoplan/runtime/zero1.py): each dp rank steps its rows of every parameter, the update equals
one process's, a checkpoint round trip through the partition loses nothing, and a dry-run rank
holds a dp-th of the states with no gather buffer beyond one parameter."""

from __future__ import annotations

import pytest
import torch

import _jobs
from autoplan.runtime.zero1 import _split

BATCH, STEPS = 6, 3


def test_rows_split_as_evenly_as_they_go():
    assert _split(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert _split(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert _split(3, 3) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.slow
def test_uneven_rows_over_three_ranks_match_one_process(clusters):
    """dp3 ZeRO-1 on gpt2-tiny: every 32- and 64-row tensor splits 11/11/10 or 22/21/21, so
    the gather takes the padded path; 3 steps equal one process."""
    from test_training import assert_matches

    ref = _jobs.reference(_jobs.preset("gpt2-tiny"), STEPS, BATCH)
    results = clusters.get(3).run(_jobs.train, _jobs.preset("gpt2-tiny"), STEPS, BATCH,
                                  dict(dp=3, tp=1, pp=1, zero_stage=1), timeout_s=240)
    for result in results:
        assert_matches("gpt2-tiny", result, ref)


@pytest.mark.slow
def test_checkpoint_round_trip_through_the_partition(clusters, tmp_path):
    """One step at dp3 ZeRO-1, saved (each tensor's states gathered on one rank), loaded into
    a new dp3 ZeRO-1 model over garbage weights (the states scattered back into the rows),
    one more step: equal to two steps of one process."""
    factory = _jobs.preset("gpt2-tiny")
    ref = _jobs.reference(factory, 2, BATCH)
    plan = dict(dp=3, tp=1, pp=1, zero_stage=1)
    results = clusters.get(3).run(_jobs.train_resume, factory, BATCH, plan, plan,
                                  str(tmp_path / "ckpt"), timeout_s=240)
    from autoplan.testing import assert_params_close

    for losses, params, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-5,
                                   atol=1e-6)
        assert_params_close(params, ref[1], ref[3])
