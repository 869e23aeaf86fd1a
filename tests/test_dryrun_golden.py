"""A fast dry run of a golden plan in CI (issue 26): one rank of llama3-8b on one dgx-h100
node (tests/golden/llama3-8b_dgx-h100-1.plan.json: pp2 x dp2 x tp2, ZeRO-1, interleaved
1F1B with 2 virtual stages), the whole 32-layer model at 8,192 tokens in bf16, on fake
tensors ([Note: dry run] in autoplan/runtime/dryrun.py).

Fast because of the microbatches: the golden plan's 32 become 2 (one per pipeline stage, the
fewest interleaved 1F1B takes), its global batch 64 -> 4 to match (microbatch 1 x dp 2 x 2),
and the plan is repriced at that (solver/planner.py `reprice`: the same placements and
configuration, the prediction for 2 microbatches). A dry-run step costs a Python dispatch per
aten op, so it grows with microbatches x layers, not with the tensors' sizes: about 4 s per
step here against 66 s at 32 microbatches (bench/results/dryrun.json). The model keeps its 32
layers: the plan's stages are 8-layer chunks, and the prediction is for them.

The plan is made as `autoplan dryrun` makes it (cli.plan_for_dry_run: planned on two bf16
blocks, the runtime graph captured whole at the microbatch); the test checks that it is the
golden plan's configuration and placements.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from autoplan import cli
from autoplan.runtime.dryrun import dry_run
from autoplan.solver.planner import reprice
from autoplan.spec import TrainingSpec

GOLDEN = Path(__file__).resolve().parent / "golden" / "llama3-8b_dgx-h100-1.plan.json"
ARGV = ["dryrun", "-q", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
        "--global-batch", "64", "--seq", "8192"]
NUM_MICROBATCHES = 2
RANK = 4  # the first rank of the last pipeline stage: the most loaded at 2 microbatches
# measured / predicted peak: the cost model predicts 13% above this rank's measured peak
# (58.4 GB measured, 67.7 GB predicted, 2026-12-05), as bench/dryrun.py measures for the
# same plan at 32 microbatches (12-15%); issue 26's bar is +-5%, not met yet. The band
# holds the test to that state and fails on a step away from it.
BAND = (0.8, 1.2)


def test_one_rank_of_the_golden_llama3_8b_plan_at_two_microbatches():
    planned, graph = cli.plan_for_dry_run(cli.build_parser().parse_args(ARGV))
    plan, golden = planned.plan, json.loads(GOLDEN.read_text())
    for key in ("mesh", "zero_stage", "schedule", "num_virtual_stages", "checkpointing",
                "microbatch_size", "num_microbatches", "global_batch"):
        assert json.loads(plan.to_json())[key] == golden[key], key
    assert [list(p) for p in plan.param_placements] == golden["param_placements"]

    batch = plan.microbatch_size * plan.mesh.dp * NUM_MICROBATCHES
    small = reprice(planned.graph, dataclasses.replace(
        plan, num_microbatches=NUM_MICROBATCHES, global_batch=batch), planned.topology,
        TrainingSpec(batch, plan.seq_len, dtype=plan.dtype))
    (rank,) = dry_run(graph, small, [RANK], planned_graph=planned.graph, steps=2,
                      device_mem_bytes=planned.topology.device.mem_bytes)
    assert rank.coordinates == {"pp": 1, "dp": 0, "cp": 0, "tp": 0}
    assert rank.predicted_peak_bytes == small.prediction.memory_by_pp_rank[1]["peak"]
    assert BAND[0] <= rank.peak_bytes / rank.predicted_peak_bytes <= BAND[1], \
        (rank.peak_bytes, rank.predicted_peak_bytes, rank.peak_by_category)
    assert rank.peak_moment.endswith(f" of {NUM_MICROBATCHES}")
    # every axis of the plan carries traffic: tp's collectives, the stage boundary on pp,
    # ZeRO-1's gradient reduction and parameter gathers on dp
    axes = {name for name, size in zip(plan.mesh.axis_names, plan.mesh.shape) if size > 1}
    assert axes == {"pp", "dp", "tp"}
    assert all(rank.bytes_by_axis.get(axis, 0) > 0 for axis in axes), rank.bytes_by_axis
    assert rank.flops > 0
