"""Stacks that open with a few blocks unlike the rest ([Note: leading blocks] in
autoplan/capture/stack.py): DeepSeek-V3's dense first blocks before its MoE ones. Their layout,
the plan from the planning capture against the plan from the full one, and a pipelined ZeRO-3
run against one process."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import _jobs
import _moe
from autoplan.capture import capture_preset
from autoplan.capture.stack import MAX_LEADING_BLOCKS, stack_layout
from autoplan.plan import Plan
from autoplan.solver import plan as solve
from autoplan.spec import TrainingSpec
from autoplan.testing import assert_params_close
from autoplan.topology import preset

pytest.importorskip("transformers")


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)


def _layout(widths) -> int:
    return stack_layout(nn.ModuleList(_Block(w) for w in widths))


@pytest.mark.parametrize("widths, first", [
    ([8] * 6, 0),                                  # uniform
    ([4, 4, 8, 8, 8, 8], 2),                       # DeepSeek-V3's layout
    ([4] * MAX_LEADING_BLOCKS + [8, 8], MAX_LEADING_BLOCKS),
    ([4] * (MAX_LEADING_BLOCKS + 1) + [8, 8], 0),  # too long a head: every block a block
    ([4, 8], 0),                                   # a tail of one: nothing to share
    ([8, 8, 8, 8, 4], 0),                          # the last block differs
    ([4, 8, 4, 8, 4, 8], 0),                       # alternating kinds
])
def test_stack_layout(widths, first):
    assert _layout(widths) == first


def _config_file(tmp_path, **overrides) -> str:
    path = tmp_path / "deepseek.json"
    path.write_text(json.dumps(_moe.config("deepseek_v3", **overrides).to_dict()))
    return str(path)


def test_planning_capture_plans_as_the_full_capture(tmp_path):
    """2 dense + 6 MoE blocks on 4 CPU ranks at pp 2: the planning capture (the dense blocks
    and 2 MoE blocks, scaled to 6) and the full capture make one plan, with one predicted
    step time and memory; the dense blocks run on the first stage, outside the blocks."""
    path = _config_file(tmp_path, num_hidden_layers=8, first_k_dense_replace=2)
    spec = TrainingSpec(global_batch=4, seq_len=16, dtype="float32")
    topology = preset("local-cpu", devices_per_node=4)
    planned = capture_preset(path, batch=4, seq_len=16, num_layers=2)
    full = capture_preset(path, batch=4, seq_len=16)
    assert (planned.num_layers, full.num_layers, planned.first_layer) == (2, 6, 2)
    a = solve(planned, topology, spec, pp=2, dp=2, tp=1, zero_stage=0, schedule="1f1b")
    b = solve(full, topology, spec, pp=2, dp=2, tp=1, zero_stage=0, schedule="1f1b")
    assert [s.num_layers for s in a.stages] == [s.num_layers for s in b.stages] == [3, 3]
    assert dict(a.param_placements) == dict(b.param_placements)
    for field in ("step_time_s", "memory_bytes", "compute_s", "comm_s"):
        assert getattr(a.prediction, field) == pytest.approx(getattr(b.prediction, field),
                                                             rel=1e-6), field
    # the first stage carries the dense blocks: it is the fuller one
    first, last = a.prediction.memory_by_pp_rank
    assert first["peak"] > last["peak"]


@pytest.mark.slow
def test_pipelined_zero3_with_leading_dense_blocks_matches_one_process(clusters):
    """2 dense + 4 MoE blocks at pp 2 x dp 2, ZeRO-3, full checkpointing: the dense blocks run
    on stage 0 outside the blocks (no unit, no recomputation of their own), the MoE blocks
    one FSDP2 unit each; losses of 3 AdamW steps and every parameter after them equal one
    process (fp32, rtol 1e-5)."""
    factory = _moe.factory("deepseek_v3", num_hidden_layers=6, first_k_dense_replace=2)
    ref = _jobs.reference(factory, 3, 4)
    results = clusters.get(4).run(_jobs.train, factory, 3, 4,
                                  dict(pp=2, dp=2, zero_stage=3, checkpointing="full",
                                       schedule="1f1b"),
                                  timeout_s=600)
    plan = Plan.from_json(results[0][2])
    assert [s.num_layers for s in plan.stages] == [2, 2]
    assert (plan.zero_stage, plan.checkpointing) == (3, "full")
    for losses, params, *_ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-5,
                                   atol=1e-6)
        assert_params_close(params, ref[1], ref[3])  # [Note: AdamW rounding allowance]
    held = set().union(*(r[1] for r in results))
    assert held == set(ref[1])
    assert any(k.startswith("model.layers.0.") for k in held)
