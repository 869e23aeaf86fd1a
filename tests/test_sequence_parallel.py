"""Sequence parallelism ([Note: sequence parallelism] in autoplan/solver/sequence.py): the norm,
dropout and residual-add regions split on the sequence dim across the tp group, with
reduce-scatter / all-gather where plain tensor parallelism all-reduces.

Unit tests on captured tiny graphs (no process group); the equivalence tests train on 4 gloo
ranks (dp2 x tp2) and match one process step by step (fp32, rtol 1e-5), like
tests/test_training.py.
"""

from __future__ import annotations

import json

import pytest
import torch

import _jobs

from autoplan.capture import capture_preset
from autoplan.cost_model.comm import collective_time_s, redistribute_time_s
from autoplan.solver import checkpointing as ckpt
from autoplan.solver import sequence
from autoplan.solver.costs import build_costs
from autoplan.solver.problem import build_problem
from autoplan.spec import TrainingSpec
from autoplan.topology import preset

STEPS = 3
BATCH = 4


@pytest.fixture(scope="module")
def graphs():
    return {name: capture_preset(name, batch=BATCH, seq_len=_jobs.SEQ, num_layers=2)
            for name in ("gpt2-tiny", "llama-tiny")}


def _gpt2_with_dropout():
    """gpt2-tiny with dropout 0.1 (the preset's p = 0 dropouts are not captured)."""
    from autoplan.capture import capture
    from autoplan.models import build_model, example_inputs

    model = build_model("gpt2-tiny", num_layers=2, resid_pdrop=0.1, embd_pdrop=0.1,
                        attn_pdrop=0.1)
    return capture(model, example_inputs("gpt2-tiny", batch=BATCH, seq_len=_jobs.SEQ),
                   model_name="gpt2-tiny")


@pytest.mark.parametrize("name", ["gpt2-tiny", "gpt2-dropout", "llama-tiny"])
def test_region_is_norms_dropout_and_adds(graphs, name):
    """The region holds the norms (RMSNorm: its pow, mul, casts), the residual adds (and
    GPT-2's dropouts, where p > 0) of the block, never a matmul, and each of its nodes offers
    S(seq) on the tp axis."""
    if name == "gpt2-dropout":
        graphs = {name: _gpt2_with_dropout()}
    prob = build_problem(graphs[name], 2, 4)
    assert sequence.seq_dim(prob.graph) == 1
    region = sequence.sequence_parallel_region(prob)
    nodes = {n.name: n for n in graphs[name].gm.graph.nodes}
    kinds = {str(nodes[n].target).split(".")[1] for n in region}
    assert "add" in kinds and kinds <= {"add", "layer_norm", "dropout", "mul", "pow", "to"}, kinds
    if name.startswith("gpt2"):
        assert "layer_norm" in kinds and ("dropout" in kinds) == (name == "gpt2-dropout"), kinds
    for n in region:
        assert any(c.outputs[0] == "S(1)" for c in prob.cands[n]), n


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_activation_memory_divided_by_tp_in_the_region(graphs, name):
    """A saved tensor of the region is tp times smaller under S(seq) than under R, and under
    "selective" checkpointing the block input each block keeps is too (priced at the block
    output's placement)."""
    tp = 2
    spec = TrainingSpec(global_batch=BATCH, seq_len=_jobs.SEQ, dtype="float32")
    topo = preset("dgx-h100")
    prob = build_problem(graphs[name], tp, 4)
    costs = build_costs(prob, BATCH, spec, topo)
    region = sequence.sequence_parallel_region(prob)
    checked = 0
    for n in region:
        row = costs.act_bytes.get(n)
        if not row or not row[0]:
            continue  # saves nothing (an add)
        by_out = {c.outputs[0]: b for c, b in zip(prob.cands[n], row)}
        assert by_out["S(1)"] * tp == pytest.approx(by_out["R"]), n
        checked += 1
    assert checked >= 2
    sel = ckpt.checkpointed_costs(prob, costs, "selective", spec, topo)
    out = ckpt.boundary_node(prob)
    assert out in region
    by_out = {c.outputs[0]: b for c, b in zip(prob.cands[out], sel.act_bytes[out])}
    boundary = prob.graph.total_layers * ckpt.boundary_bytes(prob) * sel.scale
    assert by_out["R"] - by_out["S(1)"] == pytest.approx(boundary * (1 - 1 / tp))


def test_redistributions_are_reduce_scatter_and_all_gather_with_all_reduce_bytes():
    """P -> S(seq) is a reduce-scatter and S(seq) -> R an all-gather of the full tensor's bytes;
    the two take the time of the all-reduce P -> R they replace (same ring volume, Korthikanti
    et al. 2022 section 4.2.2)."""
    topo = preset("dgx-h100")
    nbytes, tp = 64e6, 8
    rs_name, rs_s = redistribute_time_s("P", "S(1)", nbytes, tp, topo)
    ag_name, ag_s = redistribute_time_s("S(1)", "R", nbytes, tp, topo)
    ar_name, ar_s = redistribute_time_s("P", "R", nbytes, tp, topo)
    assert (rs_name, ag_name, ar_name) == ("reduce_scatter", "all_gather", "all_reduce")
    assert rs_s == pytest.approx(ag_s)
    assert rs_s + ag_s == pytest.approx(ar_s + topo.device.dtensor_redistribute_s, rel=1e-6)
    assert rs_s - topo.device.dtensor_redistribute_s == pytest.approx(
        collective_time_s("reduce_scatter", nbytes, tp, topo))


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_forcing_on_and_off(graphs, name):
    """sequence_parallel=True leaves only S(seq) candidates in the region, False only unsplit
    ones (R, P: plain tensor parallelism, not a hidden-dim split either)."""
    on = sequence.restrict(build_problem(graphs[name], 2, 4), True)
    off = sequence.restrict(build_problem(graphs[name], 2, 4), False)
    region = sequence.sequence_parallel_region(on)
    for n in region:
        assert {c.outputs[0] for c in on.cands[n]} == {"S(1)"}, n
        assert {c.outputs[0] for c in off.cands[n]} <= {"R", "P"}, n


def _sp_placements(plan: dict) -> dict[str, str]:
    return {s["node"]: s["outputs"][0] for s in plan["strategies"]
            if s["node"].startswith(("layer_norm", "dropout", "add"))}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_tp2_sequence_parallel_matches_single_process(clusters, name):
    """dp2 x tp2 with sequence parallelism forced: 4 gloo ranks match one process."""
    from test_training import assert_matches

    overrides = dict(dp=2, tp=2, zero_stage=0, sequence_parallel=True)
    # under 0.9 of the ample plan's memory the planner splits weights on the tp axis
    budget = _jobs.memory_budget(_jobs.preset(name), BATCH, overrides, 0.9, 4)
    results = clusters.get(4).run(_jobs.train, _jobs.preset(name), STEPS, BATCH, overrides,
                                  timeout_s=240, device_memory_bytes=budget)
    plan = json.loads(results[0][2])
    kinds = {r["collective"] for r in plan["redistributions"]}
    assert {"reduce_scatter", "all_gather"} <= kinds, kinds
    assert any(p != "R" for _, p in plan["param_placements"]), "no weight split on tp"
    assert "S(1)" in set(_sp_placements(plan).values())
    ref = _jobs.reference(_jobs.preset(name), STEPS, BATCH)
    for result in results:
        assert_matches(name, result, ref)


@pytest.mark.slow
@pytest.mark.parametrize("name,policy", [("gpt2-tiny", "core-attention"),
                                         ("gpt2-tiny", "selective"),
                                         ("llama-tiny", "selective")])
def test_tp2_sequence_parallel_with_checkpointing_matches_single_process(clusters, name, policy):
    """dp2 x tp2, sequence parallelism forced, under Megatron-LM's selective recompute
    ("core-attention", GPT-2's unfused attention) and op-level "selective": the held shards of
    the gathered inputs ([Note: gathered inputs saved sharded]) meet torch checkpoint's own
    saved-tensor hooks and the recomputed gathers; 4 gloo ranks match one process."""
    from test_training import assert_matches

    factory = _jobs.preset(name, **({"attn_implementation": "eager"}
                                    if policy == "core-attention" else {}))
    overrides = dict(dp=2, tp=2, zero_stage=0, sequence_parallel=True, checkpointing=policy)
    budget = _jobs.memory_budget(factory, BATCH, overrides, 0.9, 4)
    results = clusters.get(4).run(_jobs.train, factory, STEPS, BATCH, overrides,
                                  timeout_s=240, device_memory_bytes=budget)
    plan = json.loads(results[0][2])
    assert plan["checkpointing"] == policy
    assert "all_gather" in {r["collective"] for r in plan["redistributions"]}
    assert "S(1)" in set(_sp_placements(plan).values())
    ref = _jobs.reference(factory, STEPS, BATCH)
    for result in results:
        assert_matches(name, result, ref)


@pytest.mark.filterwarnings("ignore::autoplan.solver.configurations.ReplicatedWeightsWarning")
def test_plan_and_report_show_the_region(graphs):
    """solver.plan(sequence_parallel=...) fixes the region's placements, and the report's
    summary and placement section say so."""
    from autoplan.report.markdown import render_markdown
    from autoplan.solver import plan

    graph = graphs["gpt2-tiny"]
    topo = preset("local-cpu", num_nodes=1)
    spec = TrainingSpec(global_batch=BATCH, seq_len=_jobs.SEQ, dtype="float32")
    fixed = dict(tp=2, dp=topo.world_size // 2, zero_stage=0, top_k=0)
    on = plan(graph, topo, spec, sequence_parallel=True, **fixed)
    off = plan(graph, topo, spec, sequence_parallel=False, **fixed)
    n = len(sequence.region_nodes(graph))
    assert sequence.placed(graph, on) == (n, n) and sequence.placed(graph, off) == (0, n)
    assert "reduce_scatter" in {r.collective for r in on.redistributions}
    text = render_markdown(on, graph=graph, topology=topo)
    assert f"| sequence parallelism | on: all {n} norm, dropout and residual-add" in text
    assert "`ln_1` (layer_norm) `S(1)`" in text  # module roles, not aten node names
    assert "| sequence parallelism | off" in render_markdown(off, graph=graph, topology=topo)


@pytest.mark.slow
def test_sequence_parallel_dropout_matches_single_process(clusters):
    """GPT-2 with dropout 0.5 everywhere, the residual dropouts split on the sequence dim: the
    masks are those of one process ([Note: RNG contract]: a rank keeps its slice of each
    row's draws), so 4 gloo ranks (dp2 x tp2) match one process under the keyed random ops."""
    from test_training import assert_matches

    from autoplan.api import autoparallel

    dropout = dict(resid_pdrop=0.5, attn_pdrop=0.5, embd_pdrop=0.5)
    factory = _jobs.preset("gpt2-tiny", **dropout)
    overrides = dict(dp=2, tp=2, zero_stage=0, sequence_parallel=True)
    budget = _jobs.memory_budget(factory, BATCH, overrides, 0.9, 4)
    ap = autoparallel(factory(), global_batch=BATCH, seq_len=_jobs.SEQ, world_size=4,
                      device_memory_bytes=budget, **overrides)  # the plan each rank makes
    dropouts = [s.outputs[0] for s in ap.plan.strategies if s.node.startswith("dropout_")]
    assert dropouts and set(dropouts) == {"S(1)"}, dropouts
    results = clusters.get(4).run(_jobs.train_seeded, factory, STEPS, BATCH, overrides, 123,
                                  device_memory_bytes=budget, timeout_s=300)
    ref = _jobs.reference_keyed(factory, STEPS, BATCH, seed=123)
    for result in results:
        assert_matches("gpt2-tiny", result, ref)


def test_free_planning_picks_sequence_parallelism_where_memory_is_tight():
    """llama3-70b, 8 dgx-h100 nodes, seq 8192, tp8 x pp4 x dp2, selective checkpointing, ZeRO
    0: the ILP puts the whole region at S(1) by itself (measured: 75.6 s, 70.8 GB), and at
    ZeRO 1 plain tensor parallelism is slower (79.1 vs 74.5 s) and holds more activations than
    ZeRO 0's sequence parallelism (35.8 vs 25.9 GB): the block inputs and the kept stage
    outputs it no longer splits, (f_r L_r + f_r) x I x (1 - 1/8), with f_r L_r = 4 in flight x
    20 blocks on the first pp rank, f_r = 4 stage outputs ([Note: memory per rank]) and
    I = s h bytes (bf16)."""
    from autoplan.solver import plan

    graph = capture_preset("llama3-70b", batch=1, seq_len=8192, num_layers=1,
                           dtype=torch.bfloat16)
    topo = preset("dgx-h100", num_nodes=8)
    spec = TrainingSpec(global_batch=512, seq_len=8192, dtype="bfloat16")
    fixed = dict(tp=8, pp=4, dp=2, num_microbatches=256, schedule="1f1b",
                 checkpointing="selective", top_k=0)
    free = plan(graph, topo, spec, zero_stage=0, **fixed)
    n = len(sequence.region_nodes(graph))
    assert n and sequence.placed(graph, free) == (n, n)
    off = plan(graph, topo, spec, zero_stage=1, sequence_parallel=False, **fixed)
    on = plan(graph, topo, spec, zero_stage=1, **fixed)
    acts = [p.prediction.memory_breakdown["activations"] for p in (on, off, free)]
    block_inputs = (4 * 20 + 4) * 8192 * 8192 * 2 * (1 - 1 / 8)
    # selective recomputes the region's own ops: at ZeRO 0 the block inputs and stage outputs
    # are the whole difference; at ZeRO 1 (memory to spare) the ILP also keeps o_proj's output whole
    # (row-parallel, P) rather than gathering its input again in the recomputation
    # ([Note: regather priced] in solver/costs.py), which costs as much as it saves
    assert acts[1] - acts[2] == pytest.approx(block_inputs, rel=1e-3)
    assert acts[0] <= acts[1]
    assert on.prediction.step_time_s < off.prediction.step_time_s


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_gathered_inputs_are_held_as_shards_as_priced(clusters, name):
    """tp2 with sequence parallelism, no checkpointing, one microbatch: the live bytes a
    forward leaves for the backward drop by (1 - 1/tp) of every gathered matmul input when
    autograd holds the shard ([Note: gathered inputs saved sharded] in passes/regather.py)
    -- the amount the cost model prices -- and then equal the plan's predicted activations.
    Fails on a runtime that keeps the gathered value (held_off == held_on)."""
    overrides = dict(dp=1, tp=2, zero_stage=0, sequence_parallel=True,
                     checkpointing="none", num_microbatches=1)
    cluster = clusters.get(2)
    on = cluster.run(_jobs.held_after_forward, name, BATCH, overrides, True, timeout_s=240)
    off = cluster.run(_jobs.held_after_forward, name, BATCH, overrides, False, timeout_s=240)
    for (held_on, predicted, shards_save), (held_off, _p, _s) in zip(on, off):
        assert shards_save > 0
        assert held_off - held_on == pytest.approx(shards_save, rel=0.02), (held_off, held_on)
        if name == "gpt2-tiny":  # llama-tiny: the plan's activations exceed what is held
            # by 30% (154 vs 223 kB, measured) apart from the gathers: not this test's subject
            assert held_on == pytest.approx(predicted, rel=0.05), (held_on, predicted)


def test_gpt_block_holds_korthikanti_table_2_with_core_attention(tmp_path):
    """A GPT block (Megatron-LM's: 4h GeLU MLP as one op, dropout 0.1, unfused attention) under
    "core-attention" checkpointing with sequence parallelism holds 34 s b h / t bytes in bf16,
    Korthikanti et al. 2022 Table 2's "selective + sequence parallelism" row -- plus the layer
    norms' fp32 mean and rstd per token (2 norms x 8 bytes x s b / t), which the table leaves
    out: every saved tensor of the block split tp ways, the gathered matmul inputs held as
    their shards ([Note: gathered inputs saved sharded])."""
    from autoplan.solver import plan

    h, heads, seq, b, tp = 2048, 16, 1024, 1, 4
    path = tmp_path / "gpt.json"
    path.write_text(json.dumps({
        "model_type": "gpt2", "n_embd": h, "n_layer": 4, "n_head": heads, "vocab_size": 128,
        "n_positions": seq, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
        "activation_function": "gelu_pytorch_tanh", "attn_implementation": "eager"}))
    graph = capture_preset(str(path), batch=2 * b, seq_len=seq, num_layers=2,
                           dtype=torch.bfloat16)
    topo = preset("dgx-a100", num_nodes=1)
    spec = TrainingSpec(global_batch=2 * b, seq_len=seq, dtype="bfloat16")
    made = plan(graph, topo, spec, tp=tp, pp=1, dp=2, zero_stage=0, num_microbatches=1,
                checkpointing="core-attention", sequence_parallel=True, top_k=0)
    prob = sequence.restrict(build_problem(graph, tp, 2), True)
    costs = ckpt.checkpointed_costs(prob, build_costs(prob, b, spec, topo), "core-attention",
                                    spec, topo)
    chosen = {s.node: (s.inputs, s.outputs) for s in made.strategies}
    held = 0.0
    for n, row in costs.act_bytes.items():
        if n is None or prob.part.get(n) != "layer":
            continue
        index = next(i for i, c in enumerate(prob.cands[n])
                     if (tuple(c.inputs), tuple(c.outputs)) == chosen[n])
        held += row[index]
    per_block = held / graph.total_layers
    assert per_block == pytest.approx((34 * seq * b * h + 2 * 8 * seq * b) / tp, rel=1e-9)
