"""compile=True ([Note: compiled stages] in autoplan/runtime/compiled.py, [Note: compiled
execution] in autoplan/cost_model/compute.py): the compiled runtime matches one process, and the
plan says it assumed compiled execution and is priced for it.

The multi-rank tests share one inductor cache directory (TORCHINDUCTOR_CACHE_DIR) for the
session: a graph compiled by one rank or test is read by the next instead of built again (C++
compilation is the cost of these tests on 2 cores).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import _compile_jobs
import _jobs
from autoplan import autoparallel
from autoplan._torch_compat import compile_counters
from autoplan.cost_model.compute import compiled_device
from autoplan.plan import Plan
from autoplan.solver import plan as solve
from autoplan.solver.planner import reprice
from autoplan.spec import TrainingSpec
from autoplan.topology import preset
from autoplan.testing import assert_params_close

STEPS = 3
BATCH = 4


@pytest.fixture(scope="session")
def inductor_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("inductor"))


def _model(**overrides):
    return _jobs.preset("gpt2-tiny", **overrides)()


# -- the plan ----------------------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("no_private_group")  # one-process builds

def test_plan_says_it_assumed_compiled_execution():
    compiled = autoparallel(_model(), global_batch=BATCH, seq_len=_jobs.SEQ, world_size=4,
                            dp=2, tp=2, compile=True).plan
    eager = autoparallel(_model(), global_batch=BATCH, seq_len=_jobs.SEQ, world_size=4,
                         dp=2, tp=2).plan
    assert compiled.compiled and not eager.compiled
    assert Plan.from_json(compiled.to_json()) == compiled
    assert json.loads(compiled.to_json())["compiled"] is True
    # an eager plan is written as before the field existed: older plans read the same
    assert "compiled" not in json.loads(eager.to_json())
    assert Plan.from_json(eager.to_json()) == eager
    assert "compiled" in str(compiled) and "compiled" not in str(eager)


def test_compiled_device_drops_dtensor_host_time_and_fuses():
    device = dataclasses.replace(preset("local-cpu").device, dtensor_op_overhead_s=30e-6,
                                 dtensor_redistribute_s=100e-6, optimizer_op_s=5e-6)
    c = compiled_device(device)
    assert (c.dtensor_op_overhead_s, c.dtensor_redistribute_s, c.fuses_pointwise) == \
        (0.0, 0.0, True)
    # what compile does not change stays as measured
    assert (c.launch_latency_s, c.optimizer_op_s, c.peak_flops_per_s) == \
        (device.launch_latency_s, device.optimizer_op_s, device.peak_flops_per_s)


def test_compiled_plan_is_priced_without_dispatch_overhead():
    """On a device with DTensor host time per op (CPU ranks, as `autoplan calibrate` fits
    them), the same dp2 x tp2 configuration is predicted faster compiled; repricing a
    compiled plan prices it compiled again."""
    topo = preset("local-cpu", devices_per_node=4)
    device = dataclasses.replace(topo.device, dtensor_op_overhead_s=30e-6,
                                 dtensor_redistribute_s=100e-6)
    topo = dataclasses.replace(topo, device=device)
    graph = autoparallel(_model(), global_batch=BATCH, seq_len=_jobs.SEQ, world_size=4).graph
    spec = TrainingSpec(global_batch=BATCH, seq_len=_jobs.SEQ)
    fixed = dict(dp=2, tp=2, zero_stage=0, num_microbatches=1)
    eager = solve(graph, topo, spec, **fixed)
    compiled = solve(graph, topo, spec, compiled=True, **fixed)
    assert compiled.compiled and not eager.compiled
    assert compiled.prediction.step_time_s < eager.prediction.step_time_s
    again = reprice(graph, compiled, topo, spec)
    assert again.compiled
    assert again.prediction.step_time_s == pytest.approx(compiled.prediction.step_time_s,
                                                         rel=1e-9)
    with pytest.raises(ValueError, match="compiled="):
        solve(graph, topo, spec, compiled="yes", **fixed)


def test_compile_option_is_checked():
    with pytest.raises(ValueError, match="compile='yes'"):
        autoparallel(_model(), global_batch=BATCH, seq_len=_jobs.SEQ, compile="yes")


def test_selective_checkpointing_of_random_ops_is_refused():
    """A selectively checkpointed block is compiled whole; dropout runs eagerly, which a
    checkpointed region cannot do: refused at build, naming the way out."""
    model = autoparallel(_model(resid_pdrop=0.1), global_batch=BATCH, seq_len=_jobs.SEQ,
                         checkpointing="selective", compile=True)
    with pytest.raises(ValueError, match="checkpointing='full' or 'none', or compile=False"):
        model.build()


# -- the runtime -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("policy, dropout", [("full", 0.1), ("selective", 0.0)])
def test_compiled_equals_eager_with_checkpointing(inductor_dir, policy, dropout):
    """One process, compile=True against compile=False under activation checkpointing (full:
    with dropout, whose draws run eagerly, one graph break each; selective: compiled whole).

    Tolerance: losses rtol 1e-5; parameters rtol 1e-5, atol 1e-5. Inductor's fused kernels
    sum in another order and vectorise transcendentals, so activations and gradients differ
    from eager in the last bits (~1 ulp); AdamW turns a near-zero gradient's rounding noise dg
    into a step of up to lr * |dg| / eps (autoplan.testing.adamw): measured up to 2.4e-6 after
    2 steps, 1% of one step's lr = 1e-3 is the bound allowed."""
    # one block: a second, alike, compiles the same graphs again and checks nothing more
    factory = _jobs.preset("gpt2-tiny", n_layer=1, resid_pdrop=dropout, embd_pdrop=dropout,
                           attn_pdrop=dropout)
    overrides = dict(checkpointing=policy)
    eager = _compile_jobs.train_compiled(factory, 2, BATCH, overrides, inductor_dir)
    compiled = _compile_jobs.train_compiled(factory, 2, BATCH, dict(overrides, compile=True),
                                            inductor_dir)
    torch.testing.assert_close(torch.tensor(compiled[0]), torch.tensor(eager[0]),
                               rtol=1e-5, atol=1e-6)
    for fqn, value in eager[1].items():
        torch.testing.assert_close(compiled[1][fqn], value, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{fqn}: {m}")
    counters = compiled[4]
    # the block compiled, a graph more for each break, no guard failed on the second step
    assert counters["graphs"] >= 1 + counters["graph_breaks"], counters
    assert counters["recompiles"] == 0, counters
    # dropout breaks the graph once per random op (3 per GPT-2 block), nothing else does
    assert counters["graph_breaks"] == (3 if dropout else 0), counters
    assert eager[4] == {"graphs": 0, "graph_breaks": 0, "recompiles": 0, "cache_hits": 0}


MESHES = {"dp2xtp2": dict(dp=2, tp=2, zero_stage=3),
          "pp2xdp2": dict(pp=2, dp=2, zero_stage=0, num_microbatches=2)}


def _compiled_run(mesh: str, run) -> list:
    """Train gpt2-tiny under MESHES[mesh] compiled on 4 ranks (`run(overrides, budget)` ->
    the ranks' `train_compiled` results, returned) and check the correctness contract: losses
    and parameters after 3 AdamW steps equal one (eager) process, fp32 rtol 1e-5 / atol
    1e-6."""
    overrides = dict(MESHES[mesh], compile=True)
    fraction = 0.9 if "tp" in overrides else None  # split weights on the tp axis
    budget = _jobs.memory_budget(_jobs.preset("gpt2-tiny"), BATCH,
                                 {k: v for k, v in overrides.items() if k != "compile"},
                                 fraction, 4)
    results = run(overrides, budget)
    ref = _jobs.reference(_jobs.preset("gpt2-tiny"), STEPS, BATCH)
    held = set()
    for losses, params, plan_json, _norms, counters in results:
        plan = json.loads(plan_json)
        assert plan["compiled"] is True
        if fraction is not None:
            assert any(p != "R" for _, p in plan["param_placements"])
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]),
                                   rtol=1e-5, atol=1e-6)
        assert_params_close(params, ref[1], ref[3])  # [Note: AdamW rounding allowance]
        held |= set(params)
        # every rank compiled its blocks, no guard failed step after step
        assert counters["graphs"] >= 1 and counters["recompiles"] == 0, counters
    assert held == set(ref[1])
    return results


@pytest.mark.slow
def test_compiled_matches_single_process(clusters, inductor_dir):
    """The correctness contract under compile=True (`_compiled_run`), pp2 x dp2: compiled
    blocks inside pipeline stages (1F1B, 2 microbatches). dp2 x tp2 is the next test's."""
    _compiled_run("pp2xdp2", lambda overrides, budget: clusters.get(4).run(
        _compile_jobs.train_compiled, _jobs.preset("gpt2-tiny"), STEPS, BATCH, overrides,
        inductor_dir, timeout_s=900, device_memory_bytes=budget))


@pytest.mark.slow
def test_compile_cache_is_keyed_by_what_group_names_mean(clusters, tmp_path):
    """dp2 x tp2 at ZeRO-3 (compiled blocks on DTensors inside FSDP2 units), run twice sharing
    one inductor cache: by the session's ranks, which compile and store, then by fresh
    processes, which read what they stored, as ranks on one machine and a restarted job do;
    each run meets the correctness contract (`_compiled_run`). c10d names a group by a
    counter that differs between ranks that are not its members, so the two tp groups carry
    different names on ranks {0, 1} and {2, 3}, and torch's caches do not key on what a name
    means ([Note: compile cache and process groups]): the second run must not load a kernel
    naming another rank's group. Failed before the cache key carried the groups' meaning
    (rank 3: "Could not resolve the process group registered under the name 7", ranks 0 and 1
    waiting in an all-gather)."""
    from autoplan.runtime.launcher import LocalCluster

    cache = str(tmp_path / "inductor")

    def stored(overrides, budget):
        return clusters.get(4).run(_compile_jobs.train_compiled, _jobs.preset("gpt2-tiny"),
                                   STEPS, BATCH, overrides, cache, timeout_s=600,
                                   device_memory_bytes=budget)

    def read(overrides, budget):  # fresh processes: they read what the first run stored
        with LocalCluster(4, pg_timeout_s=120) as cluster:
            return cluster.run(_compile_jobs.train_compiled, _jobs.preset("gpt2-tiny"),
                               STEPS, BATCH, overrides, cache, timeout_s=600,
                               device_memory_bytes=budget)

    _compiled_run("dp2xtp2", stored)
    counters = [r[4] for r in _compiled_run("dp2xtp2", read)]
    assert all(c["cache_hits"] > 0 for c in counters), counters  # the cache was read


def test_compile_counters_count_graphs_and_breaks():
    before = compile_counters()

    eager = torch.compiler.disable(torch.neg)

    def f(x):
        y = x * 2
        y = eager(y)  # runs eagerly: the graph is cut there
        return y + 1

    out = torch.compile(f, backend="eager")(torch.ones(3))
    after = compile_counters()
    assert torch.equal(out, torch.full((3,), -1.0))  # -(1 * 2) + 1
    assert after["graphs"] - before["graphs"] == 2
    assert after["graph_breaks"] - before["graph_breaks"] == 1
