"""Bytes per mesh axis the plan prices ([Note: traffic per axis] in
autoplan/cost_model/traffic.py) against what a dry run of the rank records ([Note: dry run]
in autoplan/runtime/dryrun.py), bf16 plans of 4 to 16 ranks on tiny models, planned on whole
captures and on shallow ones ([Note: shallow planning capture]: one or two blocks standing for
four).

Tolerance: exact, byte for byte and op for op. The price counts the same ops on the same
local shapes as the runtime issues them (FSDP2's padded units, the pipeline boundary,
DTensor's redistributions and the Partial gradients it carries, checkpointing's
recomputation, cp's K/V gathers), so nothing may differ.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from autoplan.capture import capture, capture_preset
from autoplan.capture.planning import capture_for_planning
from autoplan.cost_model.traffic import rank_traffic
from autoplan.models import build_model, example_inputs
from autoplan.passes.expand import plan_for_graph
from autoplan.plan import Plan
from autoplan.runtime.dryrun import dry_run
from autoplan.solver import plan as solve
from autoplan.spec import TrainingSpec
from autoplan.topology import preset

BATCH, SEQ = 8, 16


def _dry(name: str, ranks, fraction: float | None = None, **fixed):
    """(the plan, the dry runs of `ranks`) of a bf16 plan of `name` on 4 local-cpu ranks;
    `fraction`: planned again with the device's memory lowered to that fraction of the
    first plan's peak (so that tp shards the blocks or checkpointing is chosen)."""
    planned = capture_preset(name, batch=BATCH, seq_len=SEQ, dtype=torch.bfloat16)
    topology = preset("local-cpu", devices_per_node=4)
    spec = TrainingSpec(BATCH, SEQ, dtype="bfloat16")
    plan = solve(planned, topology, spec, **fixed)
    if fraction is not None:
        device = dataclasses.replace(topology.device,
                                     mem_bytes=plan.prediction.memory_bytes * fraction)
        plan = solve(planned, dataclasses.replace(topology, device=device), spec, **fixed)
    graph = capture_preset(name, batch=plan.microbatch_size, seq_len=SEQ,
                           dtype=torch.bfloat16)
    return plan, dry_run(graph, plan, ranks, planned_graph=planned, steps=1)


def _exact(plan, runs, axes=None):
    for r in runs:
        priced = plan.prediction.bytes_by_axis_by_pp_rank[r.coordinates["pp"]]
        assert r.priced_bytes_by_axis == priced
        measured = {a: b for a, b in r.bytes_by_axis.items() if axes is None or a in axes}
        want = {a: b for a, b in priced.items() if axes is None or a in axes}
        assert measured == pytest.approx(want, rel=0, abs=0), (r.rank, r.counts)


@pytest.mark.parametrize("zero_stage", [1, 3])
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_pp2_dp2_priced_exactly(name, zero_stage):
    """pp2 x dp2: FSDP2's units (ZeRO-3: gathers by the schedule's order, one deferred
    reduce-scatter per unit) or replicate's all-reduces and ZeRO-1's packed gather, the
    boundary's sends and receives, the tied embedding's gradient sum (gpt2) and the scalars;
    both pipeline ranks, byte for byte."""
    plan, runs = _dry(name, [0, 2], pp=2, dp=2, tp=1, zero_stage=zero_stage,
                      num_microbatches=2)
    assert [r.coordinates["pp"] for r in runs] == [0, 1]
    _exact(plan, runs)


def test_gpt2_dp2_tp2_zero3_priced_exactly():
    """dp2 x tp2 ZeRO-3 with tp sharding the blocks and full checkpointing: the
    redistributions forward, in recomputation and backward (Megatron's f all-reduces), the
    FSDP2 units on the tp shards, the clipping's scalars on both axes; the token ids
    gathered for the embedding are held whole (no gradient: not re-gathered in the backward)."""
    plan, runs = _dry("gpt2-tiny", [0], fraction=0.95, dp=2, tp=2, pp=1, zero_stage=3,
                      num_microbatches=2, checkpointing="full")
    assert plan.checkpointing == "full"
    _exact(plan, runs)


def test_llama_dp2_tp2_zero3_sequence_parallel_priced_exactly():
    """llama-tiny dp2 x tp2 ZeRO-3, the blocks sequence-parallel and fully checkpointed: the
    gathers and reduce-scatters of the blocks (again in recomputation up to the block's last
    saving op, not the reduce-scatter after it), the norm weights' Partial gradients reduced
    once per FSDP2 reduction, the fused vocab-parallel loss's two all-reduces per
    microbatch in place of the logits' all-gather. The plan is fixed so (sequence
    parallelism, full checkpointing, the head split by vocabulary), not forced by a lowered
    device memory, whose outcome moves with the memory model."""
    plan, runs = _dry("llama-tiny", [0], dp=2, tp=2, pp=1, zero_stage=3, num_microbatches=2,
                      checkpointing="full", sequence_parallel=True,
                      placements={"lm_head.weight": "S(0)"})
    assert plan.checkpointing == "full"
    _exact(plan, runs)
    (r,) = runs
    assert r.counts["allreduce_@tp"] == 2 * plan.num_microbatches  # the loss's statistics


def test_old_plan_json_loads_and_round_trips():
    """A plan.json written before the field loads with it empty; a plan with it round-trips."""
    planned = capture_preset("gpt2-tiny", batch=BATCH, seq_len=SEQ)
    plan = solve(planned, preset("local-cpu", devices_per_node=2), TrainingSpec(BATCH, SEQ),
                 pp=2, dp=1, tp=1, num_microbatches=2)
    assert len(plan.prediction.bytes_by_axis_by_pp_rank) == 2
    assert Plan.from_json(plan.to_json()) == plan
    data = plan.to_dict()
    del data["prediction"]["bytes_by_axis_by_pp_rank"]
    assert Plan.from_dict(data).prediction.bytes_by_axis_by_pp_rank == ()


# -- a shallow capture priced as the runtime's graph ----------------------------------------------
LAYERS = 4  # blocks of the model; planned on 1 or 2 of them
# mesh, and the fraction of the first plan's peak the device keeps (None: as planned): as
# planned tp splits the MLPs; at 0.7 the attention heads too (cp gathers a tp-th of K and V,
# the heads' output is gathered before o_proj) and the LM head (its logits all-reduced)
MESHES = {
    "pp2 x cp2 x tp2": (dict(pp=2, dp=1, cp=2, tp=2), None),
    "pp2 x dp2 x cp2 x tp2, heads split": (dict(pp=2, dp=2, cp=2, tp=2), 0.7),
}


def _shallow(mesh: str, num_blocks: int):
    """(planning graph of `num_blocks` of llama-tiny's 4 blocks at the global batch, the
    runtime's graph of all 4 at the microbatch and seq_len / cp tokens, the plan) for a bf16
    plan of `mesh` (MESHES), ZeRO-1, selective checkpointing, 2 microbatches."""
    fixed, fraction = MESHES[mesh]
    model = build_model("llama-tiny", device="meta", dtype=torch.bfloat16,
                        num_hidden_layers=LAYERS)
    planned = capture_for_planning(
        model, example_inputs("llama-tiny", batch=BATCH, seq_len=SEQ), model_name="llama-tiny",
        num_blocks=num_blocks)
    assert (planned.num_layers, planned.total_layers) == (num_blocks, LAYERS)
    topology = preset("local-cpu", devices_per_node=math.prod(fixed.values()))
    spec = TrainingSpec(BATCH, SEQ, dtype="bfloat16")
    fixed = dict(fixed, zero_stage=1, num_microbatches=2, checkpointing="selective")
    plan = solve(planned, topology, spec, **fixed)
    if fraction is not None:
        device = dataclasses.replace(topology.device,
                                     mem_bytes=plan.prediction.memory_bytes * fraction)
        plan = solve(planned, dataclasses.replace(topology, device=device), spec, **fixed)
    graph = capture(model, example_inputs("llama-tiny", batch=plan.microbatch_size,
                                          seq_len=SEQ // plan.mesh.cp), model_name="llama-tiny")
    return planned, graph, plan


@pytest.mark.parametrize("num_blocks", [1, 2])
@pytest.mark.parametrize("mesh", list(MESHES))
def test_a_shallow_graph_is_priced_as_the_runtime_graph(mesh, num_blocks):
    """The plan priced on its planning graph (1 or 2 of 4 blocks, the global batch, the whole
    sequence) is the plan retargeted to the runtime's graph (4 blocks, the microbatch, a cp
    rank's tokens) priced there: per pipeline rank, bytes by axis and ops by "op@axis" --
    the stage boundaries' sends and receives, cp's gathers of the whole sequence, tp's
    redistributions where they run and how often."""
    planned, graph, plan = _shallow(mesh, num_blocks)
    shallow = rank_traffic(plan, planned)
    full = rank_traffic(plan_for_graph(plan, planned, graph), graph)
    assert [t.bytes_by_axis for t in shallow] == [t.bytes_by_axis for t in full]
    assert [t.counts for t in shallow] == [t.counts for t in full]
    cp = "cp" if plan.mesh.dp > 1 else "dp_cp"  # the recorder's name of the cp group at dp 1
    for t in shallow:
        assert t.bytes_by_axis["pp"] > 4 + 8 and t.counts["send@pp"] > 0  # not the scalars only
        assert t.counts[f"all_gather_into_tensor@{cp}"] > 0 and t.bytes_by_axis["tp"] > 0


@pytest.mark.parametrize("mesh, num_blocks", [("pp2 x cp2 x tp2", 2),
                                              ("pp2 x dp2 x cp2 x tp2, heads split", 1)])
def test_the_dry_run_measures_what_a_shallow_plan_prices(mesh, num_blocks):
    """The first and the last pipeline rank of a plan made on a shallow capture, dry-run on
    the runtime's graph: every axis -- tp, cp (the dp x cp group's at dp 1), pp, dp --
    measures what `Prediction.bytes_by_axis_by_pp_rank` prices, byte for byte, and op for op
    what rank_traffic counts."""
    planned, graph, plan = _shallow(mesh, num_blocks)
    world, pp = plan.mesh.world_size, plan.mesh.pp
    runs = dry_run(graph, plan, [0, world - world // pp], planned_graph=planned, steps=1)
    assert [r.coordinates["pp"] for r in runs] == [0, pp - 1]
    counts = rank_traffic(plan, planned)
    for r in runs:
        priced = plan.prediction.bytes_by_axis_by_pp_rank[r.coordinates["pp"]]
        assert r.bytes_by_axis == pytest.approx(priced, rel=0, abs=0), (r.rank, r.counts)
        assert r.counts == counts[r.coordinates["pp"]].counts
        assert {"tp", "pp"} <= set(priced) and r.counts.get("all_gather_into_tensor@cp", 0) + \
            r.counts.get("all_gather_into_tensor@dp_cp", 0) > 0
