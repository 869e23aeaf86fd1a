"""Tensor memory by category (autoplan/runtime/mem_categories.py StepMemory, torch's
MemTracker) and the loss's working set it measured ([Note: loss working set] in
autoplan/cost_model/memory.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.cost_model.memory import loss_working_bytes
from autoplan.runtime.mem_categories import CATEGORIES, StepMemory

VOCAB, TOKENS, WIDTH = 512, 64, 32


def _lm():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB, bias=False))


def _step(model, opt, ids, *, drop_logits: bool):
    logits = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), ids.reshape(-1))
    if drop_logits:
        del logits  # as the runtime does before the backward
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_categories_of_a_step_are_the_model_states_and_the_loss_working_set():
    """Steps after the first under one tracker (a root module called again is tracked
    afresh, not refused as MemTracker does): the peak's parameters and optimizer states
    are the model's exact bytes, and the peak is at least the loss's working set on top of
    them; fake tensors (capture) are not counted."""
    model = _lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ids = torch.randint(0, VOCAB, (1, TOKENS))
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    tracker = StepMemory()
    with tracker:
        for i in range(3):
            if i == 2:
                tracker.reset_peak()
            _step(model, opt, ids, drop_logits=True)
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode():
            nn.Linear(4096, 4096)(torch.randn(8, 4096))  # 64 MB were it real
    cats = tracker.peak_by_category()
    assert set(cats) == set(CATEGORIES)
    assert cats["params"] == param_bytes
    # AdamW: exp_avg and exp_avg_sq (fp32) and a 4-byte step per parameter tensor
    assert cats["optimizer"] >= 2 * param_bytes
    assert sum(cats.values()) == tracker.peak_bytes()
    logits_bytes = TOKENS * VOCAB * 4
    assert tracker.peak_bytes() >= 3 * param_bytes + loss_working_bytes(logits_bytes, 4)
    assert tracker.peak_bytes() < 64e6
    assert tracker.peak_phase in ("forward", "backward", "optimizer")


def test_the_loss_working_set_is_three_fp32_logits_and_dropping_the_logits_frees_one():
    """Measured on the loss alone: with the logits dropped before the backward, the peak
    above what the step starts with is the log-probabilities, their gradient and the logits'
    gradient, each fp32 (loss_working_bytes); holding the logits adds them."""
    logits_bytes = TOKENS * VOCAB * 4
    peaks = {}
    for drop in (True, False):
        model = _lm()
        for p in model.parameters():
            p.requires_grad_(False)
        hidden = torch.randn(1, TOKENS, WIDTH)
        head = nn.Linear(WIDTH, VOCAB, bias=False)
        head.weight.requires_grad_(False)
        x = hidden.requires_grad_(True)
        tracker = StepMemory()
        with tracker:
            tracker.reset_peak()
            logits = head(x)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(),
                                   torch.randint(0, VOCAB, (TOKENS,)))
            if drop:
                del logits
            loss.backward()
        # less the head's weight, tracked as a parameter from its module's first call
        peaks[drop] = tracker.peak_bytes() - tracker.peak_by_category()["params"]
    # + x and its gradient (TOKENS x WIDTH fp32 each) and a few scalars: 4%
    assert peaks[True] == pytest.approx(loss_working_bytes(logits_bytes, 4), rel=0.05)
    assert peaks[False] == pytest.approx(peaks[True] + logits_bytes, rel=0.05)
    assert loss_working_bytes(logits_bytes / 2, 2) == loss_working_bytes(logits_bytes, 4)
    with pytest.raises(ValueError, match="dtype_bytes=0"):
        loss_working_bytes(1.0, 0)


def test_a_model_returning_its_loss_has_no_runtime_loss_working_set():
    """build_costs prices the runtime's token loss only when the graph has no `loss`
    output: gpt2-tiny (logits) gets 3 fp32 copies of its logits; the same graph told it
    returns a loss gets none."""
    import dataclasses

    from autoplan.capture import capture_preset
    from autoplan.solver.costs import build_costs
    from autoplan.solver.problem import build_problem
    from autoplan.spec import TrainingSpec
    from autoplan.topology import preset

    graph = capture_preset("gpt2-tiny", batch=1, seq_len=16)
    spec = TrainingSpec(global_batch=4, seq_len=16)
    topo = preset("local-cpu", devices_per_node=4)
    costs = build_costs(build_problem(graph, 1, spec.dtype_bytes), 1, spec, topo)
    assert costs.output_bytes > 0
    assert costs.loss_bytes == pytest.approx(
        loss_working_bytes(costs.output_bytes, spec.dtype_bytes))
    with_loss = dataclasses.replace(graph, output_names=("loss",))
    costs = build_costs(build_problem(with_loss, 1, spec.dtype_bytes), 1, spec, topo)
    assert costs.loss_bytes == 0.0
