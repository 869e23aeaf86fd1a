"""The audit of ops whose numbers depend on how the batch is cut ([Note: batch coupling] in
autoplan/batch_coupling.py): each kind either trains on gloo ranks as one process (fp32, rtol
1e-5) or is refused when the plan is made, before any rank starts, naming the op, its module
and source line and what to do. Models: tests/_coupling_jobs.py."""

from __future__ import annotations

import json

import pytest
import torch

import _coupling_jobs as jobs
from autoplan import testing
from autoplan.batch_coupling import batch_couplings
from autoplan.capture import capture
from autoplan.strategies.samples import sample_facts


def _planned(name: str, **overrides):
    from autoplan.api import autoparallel

    return autoparallel(jobs.MODELS[name](), global_batch=4, example_batch=jobs.batch(0),
                        loss_fn=lambda out, batch: out, **{"world_size": 2, **overrides})


def _couplings(model: torch.nn.Module, batch: dict) -> list:
    graph = capture(model, (), example_kwargs=batch)
    buffers = {fqn for fqn, p in graph.params.items() if p.is_buffer}
    return batch_couplings(graph.gm, buffers, sample_facts(graph.gm, graph.batch_size),
                           batch_size=graph.batch_size)


def test_the_audit_finds_each_kind():
    """Per kind, what the plan must keep: batch statistics and a buffer updated from the batch
    the whole batch and one forward, a counter one forward (and pp 1, as forward reads it), a
    draw broadcast over the samples microbatches of 2 or more; eval-mode BatchNorm, keyed
    draws and the loss's mean over the samples nothing."""
    found = {name: [(c.node, c.keeps) for c in _couplings(jobs.MODELS[name](), jobs.batch(0))]
             for name in jobs.MODELS}
    whole, once = ("dp", "num_microbatches", "cp"), ("num_microbatches", "checkpointing")
    assert found == {
        "DropPath": [], "Noise": [], "EvalBatchNorm": [],
        "BatchNorm": [("add_", once), ("batch_norm", whole + ("checkpointing",))],
        "Ema": [("mul_", once), ("mean", whole), ("add_", whole + ("checkpointing",))],
        "Counter": [("add_", once + ("pp",))],
        "Centered": [("mean", whole)],
        "BroadcastNoise": [("randn", ("microbatch_size",))]}


def test_layer_norm_models_have_no_coupling():
    """ViT and BERT (LayerNorm, dropout, their loss a mean over the samples) in training
    mode: nothing to hold, so their plans are searched as before."""
    from autoplan.models.architectures import build_architecture, example_batch

    for name in ("vit", "bert"):
        model = build_architecture(name, device="meta").train()
        assert _couplings(model, example_batch(name, batch=4, seq_len=16, device="meta")) == []


def test_a_batch_statistic_is_planned_with_the_batch_whole():
    """BatchNorm in training mode on 2 devices: the search keeps the batch whole (dp 1, one
    microbatch, no checkpointing: the running statistics update once per step); where that
    leaves no plan (tp and pp fixed to 1: only dp 2 fills the devices) the error says which
    op held it. On one device the plan is as before; eval-mode BatchNorm is held to nothing
    (dp 2 plans)."""
    from autoplan.solver import InvalidConfig

    plan = _planned("BatchNorm").plan
    assert (plan.mesh.dp, plan.num_microbatches, plan.checkpointing) == (1, 1, "none")
    assert plan.mesh.tp * plan.mesh.pp == 2
    with pytest.raises(InvalidConfig, match=r"does not fit world size 2 \(the search was held "
                                            r"to checkpointing='none', cp=1, dp=1, "
                                            r"num_microbatches=1 by node batch_norm .*in module bn at "
                                            r"_coupling_jobs.py:\d+ .*batch statistics"):
        _ = _planned("BatchNorm", tp=1, pp=1).plan
    assert _planned("BatchNorm", world_size=1).plan.mesh.dp == 1
    assert _planned("EvalBatchNorm", dp=2).plan.mesh.dp == 2


@pytest.mark.parametrize("name, overrides, choice, op, what", [
    ("BatchNorm", dict(dp=2), "dp=2", r"batch_norm \(aten.batch_norm.default\) in module bn",
     r"batch statistics.*It needs dp 1, one microbatch, cp 1.*GroupNorm.*eval mode"),
    ("Centered", dict(dp=2), "dp=2", r"mean \(aten.mean.dim\)", r"reads across samples"),
    ("Ema", dict(num_microbatches=2), "num_microbatches=2", r"mul_ \(aten.mul_.Tensor\)",
     r"updates buffer ema in place each time the forward runs"),
    ("Counter", dict(checkpointing="full"), "checkpointing='full'",
     r"add_ \(aten.add_.Tensor\)", r"updates buffer calls.*no activation checkpointing"),
    ("BroadcastNoise", dict(dp=2, num_microbatches=2), r"a microbatch of 1 sample",
     r"randn \(aten.randn.default\)",
     r"broadcast over the samples.*microbatches of 2 or more samples"),
], ids=["batch-norm-dp2", "batch-mean-dp2", "ema-m2", "counter-recompute", "noise-mb1"])
def test_a_plan_that_would_change_the_number_is_refused(name, overrides, choice, op, what):
    """Asked for a plan that cuts what the op needs whole, planning refuses the model before
    any rank starts: the plan's choice, the node, its module and source line, what to do."""
    model = _planned(name, **overrides)
    with pytest.raises(ValueError, match=rf"{name}: the plan's {choice}.* would change what "
                                         rf"node {op} at _coupling_jobs.py:\d+ `.*` computes "
                                         rf".*{what}"):
        _ = model.plan


def _budget(name: str, **overrides) -> float:
    """0.9 of the memory an ample tp2 plan needs: under it tp splits weights
    (autoplan.testing.split_weights_budget)."""
    return _planned(name, tp=2, **overrides).plan.prediction.memory_bytes * 0.9


def _assert_trains_as_one_process(clusters, name: str, overrides: dict) -> list[dict]:
    """Train `name` on 2 gloo ranks with `overrides` and on one process: losses, parameters
    (with autoplan.testing's AdamW allowance) and buffers equal at rtol 1e-5, atol 1e-6.
    Returns each rank's plan."""
    want_losses, want_params, want_buffers, _ = jobs.train(name, None)
    plans = []
    for losses, params, buffers, plan in clusters.get(2).run(jobs.train, name, overrides,
                                                             timeout_s=300):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses),
                                   rtol=1e-5, atol=1e-6)
        testing.assert_params_close(params, want_params)
        assert buffers.keys() == want_buffers.keys()
        for fqn, value in buffers.items():
            torch.testing.assert_close(value, want_buffers[fqn], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, fqn=fqn: f"{fqn}: {m}")
        plans.append(json.loads(plan))
    return plans


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [dict(dp=2, num_microbatches=2), dict(tp=2)],
                         ids=["dp2-m2", "tp2"])
def test_a_draw_over_a_tensor_without_samples_trains_as_one_process(clusters, overrides):
    """(16,) noise added to every sample and dropout of a weight (DropConnect) are keyed by
    their position alone ([Note: RNG contract]): every dp rank and microbatch draws what one
    process draws once, and a tp shard of the weight its part of it (they were refused)."""
    if "tp" in overrides:
        overrides = dict(overrides, device_memory_bytes=_budget("Noise"))
    plans = _assert_trains_as_one_process(clusters, "Noise", overrides)
    strategies = {s["node"]: s for s in plans[0]["strategies"]}
    if "tp" in overrides:  # the weight's dropout runs on its shard
        assert strategies["dropout"]["inputs"][0].startswith("S("), strategies["dropout"]


@pytest.mark.slow
def test_a_batch_statistic_and_buffers_updated_in_place_train_as_one_process(clusters):
    """BatchNorm in training mode (its running statistics and num_batches_tracked) and an EMA
    buffer of the activations on 2 ranks: held to a whole batch (tp splits the weights) they
    train as one process, buffers included (num_batches_tracked was never updated, the EMA's
    in-place add failed at tp 2); a step counter read by forward at dp 2 likewise."""
    for name in ("BatchNorm", "Ema"):
        plans = _assert_trains_as_one_process(
            clusters, name, dict(device_memory_bytes=_budget(name)))
        assert (plans[0]["mesh"]["dp"], plans[0]["num_microbatches"]) == (1, 1)
    _assert_trains_as_one_process(clusters, "Counter", dict(dp=2))
