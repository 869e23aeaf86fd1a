"""CPU offload ([Note: offload] in autoplan/cost_model/offload.py): topology fields, the plan
field, the cost model's accounting, and training on 4 gloo ranks with offloaded optimizer
states at ZeRO-1 and ZeRO-3 matching one process (fp32, rtol 1e-5)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import _jobs
from _offload_jobs import train_offloaded
from test_training import BATCH, STEPS, assert_matches

from autoplan.plan import Plan
from autoplan.topology import load_topology, preset, save_topology

@pytest.mark.parametrize("name", ["dgx-a100", "dgx-h100", "h200-node", "local-cpu"])
def test_presets_have_host_figures_and_round_trip(tmp_path, name):
    topo = preset(name)
    assert topo.host_mem_bytes > 0 and topo.host_optimizer_bw_bytes_per_s > 0
    assert topo.device.host_bw_bytes_per_s > 0
    save_topology(topo, tmp_path / "t.yaml")
    assert load_topology(tmp_path / "t.yaml") == topo


def test_gpu_host_figures_follow_the_datasheets():
    h100, a100 = preset("dgx-h100"), preset("dgx-a100")
    # PCIe Gen5 / Gen4 x16: 64 / 32 GB/s per direction, at PCIE_EFFICIENCY 0.8
    assert h100.device.host_bw_bytes_per_s == pytest.approx(51.2e9)
    assert a100.device.host_bw_bytes_per_s == pytest.approx(25.6e9)
    assert h100.host_mem_bytes == 2e12 and a100.host_mem_bytes == 2e12


def test_local_cpu_host_is_its_own_memory():
    topo = preset("local-cpu", devices_per_node=4)
    d = topo.device
    assert d.host_bw_bytes_per_s == pytest.approx(d.mem_bw_bytes_per_s / 2)  # memcpy
    assert topo.host_mem_bytes == pytest.approx(d.mem_bytes * 4)
    # offloading within one RAM frees nothing: the planner never picks it there
    assert topo.host_is_device_memory and not preset("dgx-h100").host_is_device_memory


def test_host_fields_absent_or_zero_mean_not_given():
    from autoplan.topology import Topology

    data = preset("dgx-h100").to_dict()
    del data["host_mem_bytes"], data["device"]["host_bw_bytes_per_s"]
    topo = Topology.from_dict(data)
    assert topo.host_mem_bytes == 0 and topo.device.host_bw_bytes_per_s == 0
    with pytest.raises(ValueError, match="host_mem_bytes: expected a number >= 0"):
        Topology.from_dict({**data, "host_mem_bytes": -1})


def test_plan_offload_round_trips_and_is_checked():
    plan = _plan("none", 1)
    d = plan.to_dict()  # plans without offload are written as before it existed
    assert "offload" not in d and "host_memory_bytes" not in d["prediction"]
    assert Plan.from_json(plan.to_json()) == plan
    off = _plan("optimizer", 1)
    again = Plan.from_json(off.to_json())
    assert again == off and again.offload == "optimizer"
    assert json.loads(off.to_json())["prediction"]["host_memory_bytes"] > 0
    with pytest.raises(ValueError, match="offload 'optimizer\\+params' does not run at ZeRO-1"):
        dataclasses.replace(off, offload="optimizer+params")
    with pytest.raises(ValueError, match="offload 'disk'"):
        dataclasses.replace(plan, offload="disk")


def _plan(offload, zero, dp=4, **kw):
    from autoplan.api import autoparallel

    return autoparallel(_jobs.preset("gpt2-tiny")(), global_batch=BATCH, seq_len=_jobs.SEQ,
                        world_size=4, dp=dp, tp=4 // dp, pp=1, zero_stage=zero,
                        num_microbatches=1, offload=offload, **kw).plan


@pytest.mark.parametrize("zero,offload", [(1, "optimizer"), (0, "optimizer"),
                                          (3, "optimizer+params")])
def test_offload_moves_states_to_the_host_and_adds_their_time(zero, offload):
    """Same configuration with and without offload: the device loses exactly the offloaded
    states, the host holds them (with the stepped parameters' copies and gradients), and the
    step time grows by the transfers and the host step in place of the device step."""
    base, off = _plan("none", zero), _plan(offload, zero)
    assert off.offload == offload and base.offload == "none"
    b, o = base.prediction, off.prediction
    assert o.host_memory_bytes > 0 and b.host_memory_bytes == 0
    assert o.memory_breakdown["optimizer"] == 0
    if offload == "optimizer":
        # host: fp32 copy + gradient + AdamW's two moments of each stepped parameter = 2x the
        # device's optimizer states (8 bytes each)
        assert o.host_memory_bytes == pytest.approx(2 * b.memory_breakdown["optimizer"])
        assert o.memory_breakdown["params"] == b.memory_breakdown["params"]
    else:
        # the parameter shards leave the device too; the host holds the shard's fp32
        # parameters, gradients and moments: 4 x the device's sharded parameters (4 bytes)
        assert o.memory_breakdown["params"] == 0 < b.memory_breakdown["params"]
        assert o.host_memory_bytes == pytest.approx(4 * b.memory_breakdown["params"])
    assert o.memory_bytes < b.memory_bytes
    assert o.offload_s > 0 and o.comm_s == pytest.approx(b.comm_s + o.offload_s)


def test_offload_needs_host_figures_and_a_stage_that_runs_it():
    from autoplan.solver.configurations import InvalidConfig

    with pytest.raises(InvalidConfig, match="does not run at ZeRO-2"):
        _plan("optimizer", 2)
    with pytest.raises(InvalidConfig, match="does not run at ZeRO-1"):
        _plan("optimizer+params", 1)


@pytest.mark.slow
def test_llama3_8b_on_one_h200_plans_with_offloaded_states():
    """Issue 13's case: 16 bytes per parameter of Llama-3-8B do not fit one H200 (the smallest
    plan needed 131.7 GB); with the optimizer states on the host a plan fits, and says how
    much host memory it uses."""
    import torch

    from autoplan.capture import capture_preset
    from autoplan.report import render_markdown
    from autoplan.solver import plan as solve
    from autoplan.spec import TrainingSpec

    topo = preset("h200-node", 1)
    topo = dataclasses.replace(topo, devices_per_node=1)
    graph = capture_preset("llama3-8b", batch=8, seq_len=4096, dtype=torch.bfloat16)
    spec = TrainingSpec(global_batch=8, seq_len=4096, dtype="bfloat16")
    result = solve(graph, topo, spec)
    assert result.offload == "optimizer"
    assert result.prediction.memory_bytes <= spec.max_memory_fraction * 141e9
    assert 90e9 < result.prediction.host_memory_bytes < 2e12
    assert "Host memory (offloaded optimizer)" in render_markdown(result, graph=graph,
                                                                   topology=topo)
    with pytest.raises(Exception, match="no plan fits in memory"):
        solve(graph, topo, spec, offload="none")


# --- 4 gloo ranks against one process ---------------------------------------------------------

@pytest.fixture(scope="module")
def references():
    return lambda name: _jobs.preset_reference(name, STEPS, BATCH)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_zero1_offloaded_optimizer_matches_single_process(clusters, references, name):
    """ZeRO-1 at dp2 x tp2 with the optimizer on the host: each dp rank steps the (tp-local)
    parameters it owns on host copies, copies them up, then the all-gather; every rank
    matches one process, and the bytes moved and held are exactly the stepped parameters'."""
    overrides = dict(dp=2, tp=2, pp=1, zero_stage=1, offload="optimizer")
    results = clusters.get(4).run(train_offloaded, _jobs.preset(name), STEPS, BATCH,
                                  overrides, timeout_s=600)
    for result in results:
        assert_matches(name, result, references(name))
    plans = [Plan.from_json(r[2]) for r in results]
    assert all(p.offload == "optimizer" and p.zero_stage == 1 for p in plans)
    for _, _, _, facts in results:
        n = facts["stepped_elems"]
        assert n > 0
        # fp32: 4 bytes down (gradient) and 4 up (parameter) per stepped element and step
        assert facts["bytes_to_host"] == facts["bytes_to_device"] == 4 * n * STEPS
        # host copy + gradient + two AdamW moments, 4 bytes each
        assert facts["host_bytes"] == 16 * n
    # the ranks of a tp coordinate own disjoint parameters that cover all of its shard: the
    # plan's host figure is the average of the two, by its dp-th of the rank's elements
    per_tp = [results[0][3]["stepped_elems"] + results[1][3]["stepped_elems"],
              results[2][3]["stepped_elems"] + results[3][3]["stepped_elems"]]
    predicted = plans[0].prediction.host_memory_bytes
    measured = max(16 * e / 2 for e in per_tp)
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_zero3_offloaded_params_match_single_process(clusters, references, name):
    """ZeRO-3 at dp4 with FSDP2's CPUOffloadPolicy: every FSDP2 parameter's shard is kept on
    the host, and every rank matches one process."""
    overrides = dict(dp=4, tp=1, pp=1, zero_stage=3, offload="optimizer+params")
    results = clusters.get(4).run(train_offloaded, _jobs.preset(name), STEPS, BATCH,
                                  overrides, timeout_s=600)
    for result in results:
        assert_matches(name, result, references(name))
        facts = result[3]
        assert facts["fsdp_offloaded"] and all(facts["fsdp_offloaded"])
        # checkpoints of offloaded states are refused by name, before any file is written
        save, load = facts["checkpoint_refusals"]
        assert save.startswith("checkpoint of a plan with offload 'optimizer+params'"), save
        assert load.startswith("load of a plan with offload 'optimizer+params'"), load
    assert all(Plan.from_json(r[2]).offload == "optimizer+params" for r in results)
