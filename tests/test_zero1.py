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


@pytest.mark.parametrize("make, elementwise", [
    (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), True),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), True),
    (lambda p: torch.optim.Adagrad(p), True),
    (lambda p: torch.optim.RMSprop(p, centered=True), True),
    (lambda p: __import__("autoplan.runtime.optim").runtime.optim.FusedAdamW(p), True),
    (lambda p: torch.optim.Adafactor(p), False),
    (lambda p: _jobs.Lamb(p), False),
    (lambda p: torch.optim.LBFGS([q for _, q in p]), False),
], ids=["adamw", "sgd", "adagrad", "rmsprop", "fused-adamw", "adafactor", "lamb", "lbfgs"])
def test_the_probe_tells_elementwise_optimizers_from_whole_tensor_ones(make, elementwise):
    """[Note: elementwise optimizer]: the user's factory stepped on probes of the model's
    parameters, whole and as two halves of their rows."""
    from autoplan.runtime.optim import whole_tensor_reason

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    model[1].bias.requires_grad_(False)
    reason = whole_tensor_reason(make, model.named_parameters())
    assert (reason is None) == elementwise, reason
    if not elementwise and "LBFGS" not in repr(make):
        assert "'0.weight'" in reason or "could not be probed" in reason


def test_the_planner_hands_a_whole_tensor_optimizer_no_pieces():
    """elementwise_optimizer=False: no ZeRO-1 over dp x cp > 1 and no offloaded optimizer at
    tp > 1 among the configurations (both are among them otherwise), and a fixed zero_stage 1
    is refused by name."""
    import dataclasses

    from autoplan.capture import capture_preset
    from autoplan.solver import InvalidConfig, plan
    from autoplan.solver.configurations import Overrides, enumerate_configs, offload_variants
    from autoplan.spec import TrainingSpec
    from autoplan.topology import preset

    graph = capture_preset("gpt2-tiny", batch=1, seq_len=16)
    topo = preset("local-cpu", devices_per_node=4)
    spec = TrainingSpec(global_batch=8, seq_len=16)

    def pieces(o):
        configs = enumerate_configs(graph, topo, spec, o)
        configs += [v for c in configs for v in offload_variants(c, o)]
        return ([c for c in configs if c.zero_stage == 1 and c.dp * c.cp > 1],
                [c for c in configs if c.offload == "optimizer" and c.tp > 1])

    zero1, offloaded = pieces(Overrides())
    assert zero1 and offloaded
    assert pieces(Overrides(elementwise_optimizer=False)) == ([], [])
    assert pieces(dataclasses.replace(Overrides(elementwise_optimizer=False), tp=2))[1] == []
    with pytest.raises(InvalidConfig, match="ZeRO-1 over dp x cp = 4 ranks.*reads whole"):
        plan(graph, topo, spec, dp=4, zero_stage=1, elementwise_optimizer=False)


@pytest.mark.slow
def test_a_whole_tensor_optimizer_trains_as_on_one_process(clusters):
    """LAMB on dp2 under @autoparallel: planned without ZeRO-1, trained as one process;
    a plan fixed at ZeRO-1 is refused before any step, naming the optimizer."""
    import _jobs

    from autoplan.testing import assert_params_close

    steps, batch = 2, 4
    ref_losses, ref_params, allowance = _jobs.reference_variant(
        "whole_tensor", _jobs.preset("gpt2-tiny"), steps, batch)
    results = clusters.get(2).run(_jobs.train_variant, "whole_tensor", _jobs.preset("gpt2-tiny"),
                                  steps, batch, dict(dp=2, tp=1, pp=1), timeout_s=300)
    for losses, params, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for k, v in params.items():
            assert_params_close({k: v}, ref_params, allowance)
    with pytest.raises(Exception, match="Lamb's update of .* differs"):
        clusters.get(2).run(_jobs.train_variant, "whole_tensor", _jobs.preset("gpt2-tiny"),
                            steps, batch, dict(dp=2, tp=1, pp=1, zero_stage=1), timeout_s=300)


def test_the_engine_refuses_a_plan_that_hands_a_whole_tensor_optimizer_rows():
    """A ZeRO-1 plan made without the optimizer (by hand, or read from a file) and built with
    LAMB: the engine refuses it at build ([Note: elementwise optimizer]); AdamW builds."""
    import _jobs

    from autoplan.capture import capture_preset
    from autoplan.runtime.dryrun import dry_run
    from autoplan.solver import plan as solve
    from autoplan.spec import TrainingSpec
    from autoplan.topology import preset

    planned = capture_preset("gpt2-tiny", batch=4, seq_len=16)
    graph = capture_preset("gpt2-tiny", batch=2, seq_len=16)
    plan = solve(planned, preset("local-cpu", devices_per_node=2), TrainingSpec(4, 16),
                 tp=1, pp=1, dp=2, zero_stage=1)
    with pytest.raises(ValueError, match="ZeRO-1 over dp x cp = 2 ranks.*Lamb's update"):
        dry_run(graph, plan, [1], planned_graph=planned, optimizer=_jobs.Lamb)
    (ok,) = dry_run(graph, plan, [1], planned_graph=planned,
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    assert ok.peak_bytes > 0
