"""A fast dry run of a golden plan in CI (issue 26): one rank of llama3-8b on one dgx-h100
node (tests/golden/llama3-8b_dgx-h100-1.plan.json, whatever configuration the planner
chooses there: pp1 x dp4 x tp2, ZeRO-1, 16 microbatches on 2026-12-05), the whole 32-layer
model at 8,192 tokens in bf16, on fake tensors ([Note: dry run] in
autoplan/runtime/dryrun.py).

Fast because of the microbatches: the golden plan's become 2 (at least one per pipeline stage,
as torch's 1F1B schedules need), its global batch to match (microbatch x dp x 2), and the plan
is repriced at that (solver/planner.py `reprice`: the same placements and configuration, the
prediction for 2 microbatches). A dry-run step costs a Python dispatch per aten op, so it
grows with microbatches x layers, not with the tensors' sizes. The model keeps its 32 layers,
which the prediction is for.

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
# measured / predicted peak of the last pipeline stage's first rank: issue 26's bar is
# +-5%; the band holds the test near it and fails on a step away from it.
BAND = (0.8, 1.2)


def test_one_rank_of_the_golden_llama3_8b_plan_at_two_microbatches():
    planned, graph = cli.plan_for_dry_run(cli.build_parser().parse_args(ARGV))
    plan, golden = planned.plan, json.loads(GOLDEN.read_text())
    for key in ("mesh", "zero_stage", "schedule", "num_virtual_stages", "checkpointing",
                "microbatch_size", "num_microbatches", "global_batch"):
        assert json.loads(plan.to_json())[key] == golden[key], key
    assert [list(p) for p in plan.param_placements] == golden["param_placements"]

    m = max(NUM_MICROBATCHES, plan.mesh.pp)
    batch = plan.microbatch_size * plan.mesh.dp * m
    small = reprice(planned.graph, dataclasses.replace(
        plan, num_microbatches=m, global_batch=batch), planned.topology,
        TrainingSpec(batch, plan.seq_len, dtype=plan.dtype))
    last = plan.mesh.pp - 1
    first_of_last = last * plan.mesh.world_size // plan.mesh.pp  # pp is the outermost axis
    device = planned.topology.device  # H100s: NCCL's all-to-all, as the plan prices them
    (rank,) = dry_run(graph, small, [first_of_last], planned_graph=planned.graph,
                      device_mem_bytes=device.mem_bytes, device_all_to_all=device.all_to_all)
    assert rank.coordinates == {"pp": last, "dp": 0, "cp": 0, "tp": 0}
    assert rank.predicted_peak_bytes == small.prediction.memory_by_pp_rank[last]["peak"]
    assert BAND[0] <= rank.peak_bytes / rank.predicted_peak_bytes <= BAND[1], \
        (rank.peak_bytes, rank.predicted_peak_bytes, rank.peak_by_category)
    assert rank.peak_moment.endswith(f" of {m}")
    # every axis of the plan carries traffic: tp's collectives, a stage boundary on pp,
    # ZeRO-1's gradient reduction and parameter gathers on dp
    axes = {name for name, size in zip(plan.mesh.axis_names, plan.mesh.shape) if size > 1}
    assert axes >= {"dp", "tp"}
    assert all(rank.bytes_by_axis.get(axis, 0) > 0 for axis in axes), rank.bytes_by_axis
    # and as much as the plan prices, byte for byte ([Note: traffic per axis]), though it was
    # planned on two blocks at the global batch: tp's sequence-parallel gathers and
    # reduce-scatters, the vocab-parallel loss's all-reduces, ZeRO-1's on dp
    assert {a: float(b) for a, b in rank.bytes_by_axis.items()} == \
        small.prediction.bytes_by_axis_by_pp_rank[last], (rank.bytes_by_axis, rank.counts)
    assert rank.flops > 0
