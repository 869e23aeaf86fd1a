"""Batches of any form on gloo ranks, each matching one process (fp32, rtol 1e-5): a dict
with an attention mask and labels whose model returns its own `.loss`, a user's
`loss_fn(output, batch)`, an image model, a seq2seq model; `eval_step`; and the batch checks.
"""

from __future__ import annotations

import pytest
import torch

from autoplan.testing import assert_params_close

TP = dict(dp=2, tp=2, pp=1, num_microbatches=1)
PP = dict(dp=2, tp=1, pp=2, num_microbatches=2)


def _check(results, ref_losses, ref_params, allowance):
    for losses, params in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert_params_close(params, ref_params, allowance)  # [Note: AdamW rounding allowance]


@pytest.mark.slow
@pytest.mark.parametrize("kind, overrides, user_loss, declared", [
    ("llama", TP, False, False),
    ("llama", PP, False, True),
    ("llama", TP, True, False),
    ("vit", TP, False, False),
    ("t5", TP, False, False),
], ids=["dict-mask-own-loss-dp2xtp2", "dict-own-loss-pp2xdp2-declared",
        "user-loss_fn-dp2xtp2", "vit-pixel_values-dp2xtp2", "t5-seq2seq-dp2xtp2"])
def test_a_batch_of_any_form_trains_as_on_one_process(clusters, kind, overrides, user_loss,
                                                      declared):
    import _batch_jobs

    steps = 3
    parts = overrides["dp"] * overrides["num_microbatches"]
    ref_losses, ref_params, allowance = _batch_jobs.reference(kind, steps, parts, user_loss)
    results = clusters.get(4).run(_batch_jobs.train, kind, steps, overrides, user_loss,
                                  declared, timeout_s=600)
    _check(results, ref_losses, ref_params, allowance)


@pytest.mark.slow
def test_eval_step_gives_one_process_loss_and_outputs(clusters):
    """eval_step on pp2 x dp2 (2 microbatches): the loss and the whole batch's logits on every
    rank, dropout off, nothing trained."""
    import _batch_jobs

    ref_loss, ref_logits = _batch_jobs.reference_eval("llama", 4)
    for loss, logits in clusters.get(4).run(_batch_jobs.evaluate, "llama", PP, timeout_s=600):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


# -- the batch's checks, in one process (planning only, no training) --------------------------
@pytest.fixture(scope="module")
def planned():
    """One plan shared by the checks below: checking a batch reads the plan, changes nothing."""
    import _batch_jobs

    from autoplan import autoparallel

    batch = _batch_jobs.batches("llama", 1)[0]
    ap = autoparallel(_batch_jobs._model("llama"), global_batch=4,
                      example_batch={k: v.to("meta") for k, v in batch.items()})
    return ap, batch


def test_the_first_batch_declares_the_inputs_and_the_spec_names_them(planned):
    ap, batch = planned
    spec = ap.inputs
    assert [(leaf.name, leaf.batch_dim, leaf.to_model) for leaf in spec.leaves] == [
        ("input_ids", 0, True), ("attention_mask", 0, True), ("labels", 0, True)]
    assert ap.spec.seq_len == 16
    assert ap.graph.output_names == ("loss", "logits")


@pytest.mark.parametrize("change, message", [
    (lambda b: {k: v for k, v in b.items() if k != "attention_mask"}, "structure"),
    (lambda b: {**b, "attention_mask": b["attention_mask"][:, :8]},
     r"attention_mask has shape \(4, 8\).*dim 1: 8 where the plan has 16"),
    (lambda b: {**b, "input_ids": b["input_ids"].float()}, "input_ids has dtype torch.float32"),
    (lambda b: {**b, "input_ids": b["input_ids"] + 64}, "input_ids holds token id"),
    (lambda b: {**b, "input_ids": b["input_ids"][:2]}, "dim 0: 2 where the plan has 4"),
], ids=["missing-key", "shape", "dtype", "vocabulary", "samples"])
def test_a_batch_unlike_the_plans_is_refused_naming_the_value(planned, change, message):
    ap, batch = planned
    with pytest.raises(ValueError, match=message):
        ap._checked((change(batch),))


def test_narrower_integers_are_taken_and_an_ambiguous_batch_dim_asks_for_a_name(planned):
    from autoplan.inputs import InputSpec

    ap, batch = planned
    leaves = ap._checked(({k: v.int() for k, v in batch.items()},))
    assert all(t.dtype == torch.long for t in leaves)
    net = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"batch_dims=\{'input': <dim>\}"):
        InputSpec.of(torch.zeros(3, 4, 4), net, global_batch=4)
    spec = InputSpec.of(torch.zeros(3, 4, 4), net, global_batch=4, batch_dims={"input": 2})
    assert spec.leaves[0].batch_dim == 2
    assert InputSpec.of(torch.zeros(1, 8), net, global_batch=4).leaves[0].batch_dim is None


def test_a_model_without_a_loss_needs_loss_fn_or_labels():
    from autoplan import autoparallel

    net = torch.nn.Sequential(torch.nn.Linear(8, 8))
    import torch.distributed as dist

    ap = autoparallel(net, global_batch=4, world_size=1)
    with pytest.raises(ValueError, match="no loss to train on"):
        ap.step(torch.randn(4, 8))
    assert not dist.is_initialized()  # said before a process group was set up
