"""Frozen parameters stay frozen ([Note: frozen parameters] in autoplan/runtime/engine.py):
training with parameters whose `requires_grad` is False equals one process (fp32: losses and
trained parameters to rtol 1e-5, as tests/test_training.py), the frozen ones bit-identical to
their start, with no gradient and no optimizer state on any rank, under tp, dp by every ZeRO
stage, pp (a frozen tied embedding and head across stages), clipping and checkpoint round
trips; a model whose frozen set changes after planning is refused."""

from __future__ import annotations

import json

import pytest
import torch

import _frozen_jobs
import _jobs
from autoplan.testing import assert_params_close

pytestmark = pytest.mark.usefixtures("no_private_group")

STEPS = 3
BATCH = 4
# GPT-2 tiny: a block that mixes frozen and trainable parameters (one FSDP2 unit), the
# position table; and the tied token embedding and head (held by the first and last stage).
MIXED = ("transformer.wpe.weight", "transformer.h.0.attn.c_attn.weight",
         "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias")
EMBEDDINGS = ("transformer.wte.weight", "transformer.wpe.weight")
# ... and the first block too: under pp2 the first stage has nothing to train
BOTTOM = EMBEDDINGS + tuple(f"transformer.h.0.{p}" for p in (
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
    "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
    "mlp.c_proj.weight", "mlp.c_proj.bias"))


def _assert_frozen_run(result, factory, *, steps=STEPS, max_grad_norm=None, batch=BATCH):
    """`result` of _frozen_jobs.train (rank 0's) equals one process; frozen parameters are
    their start values bit for bit and hold no gradient or optimizer state."""
    losses, params, _, norms, with_state, frozen_grads = result
    ref = _jobs.reference(factory, steps, batch, max_grad_norm=max_grad_norm)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-5, atol=1e-6)
    assert_params_close(params, ref[1], ref[3])
    if max_grad_norm is not None:
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref[2]), rtol=1e-5, atol=0)
    start = factory()
    frozen = {n for n, p in start.named_parameters() if not p.requires_grad}
    assert frozen
    for fqn in frozen & set(params):  # a pp rank holds its stages' parameters
        assert torch.equal(params[fqn], start.get_parameter(fqn).detach()), fqn
    assert not frozen & set(with_state), sorted(frozen & set(with_state))
    assert with_state or not set(params) - frozen, "trainable parameters without state"
    assert frozen_grads == []
    return frozen & set(params)


def test_frozen_positions_on_one_rank():
    """The issue's minimal case: a frozen position table moved by 3.07e-3 in 3 steps."""
    factory = _frozen_jobs.positions()
    result = _frozen_jobs.train(factory, STEPS, BATCH, {})
    _assert_frozen_run(result, factory)


def test_a_changed_frozen_set_is_refused():
    from autoplan import autoparallel
    from autoplan.runtime.checks import FrozenSetChangedError

    model = _frozen_jobs.positions()()
    ap = autoparallel(model, global_batch=BATCH, seq_len=_jobs.SEQ)
    x, y = _jobs.batches(_frozen_jobs.VOCAB, 2, BATCH)
    ap.step(x[0], y[0])
    model.pos.weight.requires_grad_(True)
    model.up.bias.requires_grad_(False)
    with pytest.raises(FrozenSetChangedError, match=r"1 frozen since: \['up.bias'\]; "
                                                    r"1 trainable since: \['pos.weight'\]"):
        ap.step(x[1], y[1])
    model.pos.weight.requires_grad_(False)
    model.up.bias.requires_grad_(True)
    ap.step(x[1], y[1])  # set back: trains on


def test_a_wholly_frozen_model_is_refused():
    from autoplan import autoparallel

    model = _frozen_jobs.positions()()
    model.requires_grad_(False)
    x, y = _jobs.batches(_frozen_jobs.VOCAB, 1, BATCH)
    with pytest.raises(ValueError, match="every parameter of the model is frozen"):
        autoparallel(model, global_batch=BATCH, seq_len=_jobs.SEQ).step(x[0], y[0])


CASES = {
    # the minimal case with its linears split on tp (a budget below replication's)
    "positions-dp2xtp2": (_frozen_jobs.positions(), dict(dp=2, tp=2), 0.9, None, 4),
    # a block mixing frozen and trainable parameters, ZeRO-1's partition, clipping
    "mixed-dp2xtp2-zero1": (_frozen_jobs.frozen_preset("gpt2-tiny", MIXED),
                            dict(dp=2, tp=2, zero_stage=1), 0.9, 0.05, 4),
    # frozen tied embedding and head across pipeline stages, FSDP2 units of frozen weights,
    # a first stage with nothing to train (its ranks' optimizers step nothing)
    "embeddings-pp2xdp2-zero3": (_frozen_jobs.frozen_preset("gpt2-tiny", BOTTOM),
                                 dict(pp=2, dp=2, zero_stage=3, num_microbatches=2), None, None,
                                 4),
    "mixed-dp4-zero2": (_frozen_jobs.frozen_preset("llama-tiny", (
        "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.up_proj.weight", "model.norm.weight")),
        dict(dp=4, zero_stage=2, num_microbatches=2), None, 0.05, 8),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_frozen_parameters_stay_frozen(clusters, case):
    factory, overrides, fraction, clip, batch = CASES[case]
    budget = _jobs.memory_budget(factory, batch, overrides, fraction, 4)
    results = clusters.get(4).run(_frozen_jobs.train, factory, STEPS, batch, overrides,
                                  max_grad_norm=clip, device_memory_bytes=budget,
                                  timeout_s=300)
    plan = json.loads(results[0][2])
    for axis in ("pp", "dp", "tp"):
        assert plan["mesh"][axis] == overrides.get(axis, 1)
    if fraction is not None:  # the budget made the planner split something on tp
        assert any(p != "R" for _, p in plan["param_placements"])
    held = set()
    for r in results:
        held |= _assert_frozen_run(r, factory, max_grad_norm=clip, batch=batch)
    assert held == {n for n, p in factory().named_parameters() if not p.requires_grad}


@pytest.mark.slow
def test_frozen_parameters_survive_a_checkpoint_round_trip(clusters, tmp_path):
    """Saved under dp2 x tp2 ZeRO-1, loaded under pp2 x dp2 ZeRO-3 over garbage weights:
    the frozen weights come back from the checkpoint, and the second step equals one process."""
    factory = _frozen_jobs.frozen_preset("gpt2-tiny", MIXED)
    results = clusters.get(4).run(
        _jobs.train_resume, factory, BATCH, dict(dp=2, tp=2, zero_stage=1),
        dict(pp=2, dp=2, zero_stage=3, num_microbatches=2), str(tmp_path / "ckpt"),
        timeout_s=300)
    ref = _jobs.reference(factory, 2, BATCH)
    start = factory()
    for losses, params, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-5,
                                   atol=1e-6)
        assert_params_close(params, ref[1], ref[3])
        for fqn in set(MIXED) & set(params):
            assert torch.equal(params[fqn], start.get_parameter(fqn).detach()), fqn
