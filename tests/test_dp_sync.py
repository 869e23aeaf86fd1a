"""The data-parallel sync as the runtime issues it: one collective per FSDP2 unit, and the
stragglers' drift on ranks that share cores (cost_model/step_time.py [Note: step time])."""

from __future__ import annotations

import dataclasses

import pytest

from autoplan.capture import capture_preset
from autoplan.cost_model.comm import collective_time_s
from autoplan.cost_model.config import Config
from autoplan.cost_model.dp_sync import dp_sync_s, num_dp_units
from autoplan.solver.search import Search
from autoplan.solver.configurations import PlanConfig
from autoplan.spec import TrainingSpec
from autoplan.topology import preset


def _local4(**device):
    topo = preset("local-cpu", devices_per_node=4)
    return dataclasses.replace(topo, device=dataclasses.replace(topo.device, **device))


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_each_unit_pays_its_own_latency_and_straggler_wait(zero_stage):
    """FSDP2 reduces (and gathers) per unit: the same bytes in `units` collectives cost the
    bandwidth term once and the latency + skew of a collective once per unit; ZeRO-1's
    all-gathers of the updated parameters are one per parameter tensor, whatever the units."""
    topo = _local4(sync_skew_s={4: 2e-3})
    cfg = Config(pp=1, dp=4, tp=1, zero_stage=zero_stage, num_microbatches=2,
                 microbatch_size=1, schedule="1f1b", num_virtual_stages=1)
    spec = TrainingSpec(global_batch=8, seq_len=16)
    elems = 3.0e6
    one, five = (dp_sync_s(cfg, spec, topo, elems, units) for units in (1, 5))
    per_unit = {0: ["all_reduce"], 1: ["all_reduce"],
                2: ["reduce_scatter"] * 2 + ["all_gather"] * 2,  # both per microbatch
                3: ["reduce_scatter"] * 2 + ["all_gather"] * 4}[zero_stage]
    fixed = sum(collective_time_s(kind, 0.0, 4, topo) for kind in per_unit)
    assert fixed > 2e-3 * len(per_unit)  # latency steps and the skew
    assert five - one == pytest.approx(4 * fixed, rel=1e-9)


def test_units_are_the_blocks_and_the_roots_holding_parameters():
    """rank_stages.py `apply_data_parallel`: a unit per block, one per stage root; only the first
    and last pipeline ranks' roots hold parameters (embeddings, head)."""
    def cfg(pp):
        return Config(pp=pp, dp=2, tp=1, zero_stage=0, num_microbatches=4,
                      microbatch_size=1, schedule="1f1b", num_virtual_stages=1)
    assert num_dp_units(cfg(1), [12]) == 13
    assert num_dp_units(cfg(4), [3, 3, 3, 3]) == 4
    assert num_dp_units(cfg(4), [2, 4, 4, 2]) == 4
    assert num_dp_units(cfg(4), [4, 3, 3, 2]) == 5
    assert num_dp_units(cfg(2), [0, 0]) == 1


@pytest.fixture(scope="module")
def graph():
    return capture_preset("gpt2-tiny", batch=1, seq_len=16)


@pytest.mark.parametrize("mesh, drifts", [((1, 4, 1), True), ((1, 2, 2), True),
                                          ((1, 1, 4), True), ((4, 1, 1), False)])
def test_ranks_that_meet_at_collectives_wait_for_drift_in_proportion_to_compute(
        graph, mesh, drifts):
    """[Note: step time], drift: with sync_skew_slope s, a plan whose ranks meet at
    collectives (dp, tp) takes s x its compute longer; a pipeline-only plan (send/recv between
    stages) does not."""
    pp, dp, tp = mesh
    spec = TrainingSpec(global_batch=8, seq_len=16)
    cfg = PlanConfig(pp, dp, tp, 0, 2 * pp, 8 // (2 * pp) // dp, "1f1b", 1)
    runs = []
    for slope in ({}, {4: 0.1}):
        search = Search(graph, _local4(sync_skew_slope=slope), spec, 1.0)
        runs.append(search.assess(cfg, search.solution(cfg)))
    plain, drifted = runs
    want = 0.1 * plain.compute_s if drifts else 0.0
    assert drifted.step_time_s - plain.step_time_s == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert drifted.comm_s - plain.comm_s == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_zero1_gathers_each_tensors_fp32_master_once():
    """ZeRO-1 (runtime/zero1.py, [Note: ZeRO-1 partition]): after the all-reduce of the
    gradients, one all-gather per parameter tensor of its fp32 master under mixed precision."""
    topo = _local4(sync_skew_s={4: 2e-3})
    cfg = Config(pp=1, dp=4, tp=1, zero_stage=1, num_microbatches=2,
                 microbatch_size=1, schedule="1f1b", num_virtual_stages=1)
    spec = TrainingSpec(global_batch=8, seq_len=16, dtype="bfloat16")
    elems = 3.0e6
    grads = collective_time_s("all_reduce", elems * 2, 4, topo)  # priced at ZeRO's 2 B
    for tensors in (1, 7):
        gathers = tensors * collective_time_s("all_gather", elems * 4 / tensors, 4, topo)
        assert dp_sync_s(cfg, spec, topo, elems, tensors=tensors) == pytest.approx(
            grads + gathers, rel=1e-12)
