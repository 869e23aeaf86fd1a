"""Field cases C1, C2, C3, C4 and C8 of ../shared/cases/CASES.md, on gloo ranks against one
process (same seeds, same data, fp32, rtol 1e-5 / atol 1e-6)."""

from __future__ import annotations

import json

import pytest
import torch

import _jobs
import _models
from test_training import assert_matches


def _run(clusters, world, factory, steps, batch, overrides, **kw):
    results = clusters.get(world).run(_jobs.train, factory, steps, batch, overrides,
                                      timeout_s=180, **kw)
    ref = _jobs.reference(factory, steps, batch, max_grad_norm=kw.get("max_grad_norm"))
    held = set()
    for r in results:
        assert_matches("custom", r, ref, steps=steps)
        held |= set(r[1])
    assert held == set(ref[1])
    return results, ref


@pytest.mark.slow
def test_c1_tied_embedding_zero3(clusters):
    """C1: tied input embedding / LM head, vocab 7, hidden 8, world 2, ZeRO-3, one AdamW step:
    every row of the tied weight changes and equals the single-process update."""
    factory = _models.nanogpt(vocab_size=7, n_embd=8, n_head=2, n_layer=2, block_size=16)
    before = factory().transformer.wte.weight.detach().clone()
    results, ref = _run(clusters, 2, factory, 1, 4, dict(dp=2, zero_stage=3))
    for losses, params, plan_json in results:
        wte = params["transformer.wte.weight"]
        assert (wte - before).abs().amax(dim=1).gt(0).all(), "a row of the tied weight froze"
        assert "lm_head.weight" not in params  # one tensor, one shard group
        assert json.loads(plan_json)["zero_stage"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [dict(tp=2, dp=1), dict(dp=2, zero_stage=2)],
                         ids=["tp2", "zero2"])
def test_c2_weight_and_submodule_used_twice(clusters, overrides):
    """C2: `x @ w @ w` and a submodule called twice, at tp=2 and under ZeRO-2."""
    _run(clusters, 2, _models.shared_use(), 3, 4, overrides)


@pytest.mark.slow
def test_c3_gqa_tp4(clusters):
    """C3: GQA with 8 query heads and 2 KV heads (head_dim 4) planned for tp=4: no split leaves
    less than one KV head per rank, and the plan's run matches one process."""
    factory = _jobs.preset("llama-tiny")
    results, _ = _run(clusters, 4, factory, 3, 4, dict(tp=4))
    plan = json.loads(results[0][2])
    for fqn, placement in plan["param_placements"]:
        if fqn.endswith(("k_proj.weight", "v_proj.weight")):
            # 2 KV heads x head_dim 4 = 8 rows: S(0) over 4 ranks would give half a head each
            assert placement == "R", (fqn, placement)


@pytest.mark.slow
def test_c4_seven_layers_pp2(clusters):
    """C4: 7 identical layers, pp=2: stage layer counts sum to 7, every layer once."""
    factory = _models.nanogpt(vocab_size=16, n_embd=8, n_head=2, n_layer=7, block_size=16)
    results, _ = _run(clusters, 2, factory, 2, 4, dict(pp=2, num_microbatches=2))
    stages = json.loads(results[0][2])["stages"]
    layers = [k for s in stages for k in range(s["layer_start"], s["layer_end"])]
    assert sorted(layers) == list(range(7))


@pytest.mark.slow
def test_c4_seven_layers_pp3_interleaved(clusters):
    """C4: 7 layers, pp=3 interleaved with 2 virtual stages per rank (6 stages)."""
    factory = _models.nanogpt(vocab_size=16, n_embd=8, n_head=2, n_layer=7, block_size=16)
    results, _ = _run(clusters, 3, factory, 2, 6,
                      dict(pp=3, num_microbatches=3, schedule="interleaved-1f1b",
                           num_virtual_stages=2))
    stages = json.loads(results[0][2])["stages"]
    assert len(stages) == 6
    layers = [k for s in stages for k in range(s["layer_start"], s["layer_end"])]
    assert sorted(layers) == list(range(7))


def test_c8_microbatches_do_not_divide():
    """C8: pp=3, batch 8, 3 microbatches requested -> rejected at plan time, numbers named."""
    from autoplan.api import autoparallel

    model = _models.nanogpt(vocab_size=16, n_embd=8, n_head=2, n_layer=3, block_size=16)()
    ap = autoparallel(model, global_batch=8, seq_len=16, world_size=3, pp=3,
                      num_microbatches=3)
    with pytest.raises(ValueError, match=r"8.*3|3.*8") as err:
        ap.plan
    assert "not divisible" in str(err.value)
