"""Mixture-of-experts: the `autoplan.experts` op, its capture from HF models, planning and
training under tp and ep against one process."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import _jobs
import _moe
from autoplan.capture import CaptureError, capture, materialize
from autoplan.experts import EXPERTS_OP, experts, experts_reference
from autoplan.plan import Plan
from autoplan.report.facts import experts_text


def _op_inputs(num_tokens=6, hidden=4, inter=3, num_experts=4, top_k=2, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=g, dtype=dtype)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:top_k]
                       for _ in range(num_tokens)])
    w = torch.rand(num_tokens, top_k, generator=g, dtype=dtype)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g, dtype=dtype)
    down = torch.randn(num_experts, hidden, inter, generator=g, dtype=dtype)
    return x, idx, w, gate_up, down


def test_experts_op_gradients_are_exact():
    """The op's autograd formula (a backward op that recomputes the forward) against finite
    differences, for hidden, routing weights and both expert weights."""
    x, idx, w, gate_up, down = _op_inputs()
    args = [t.requires_grad_(True) for t in (x, w, gate_up, down)]
    torch.autograd.gradcheck(lambda a, b, c, d: experts(a, idx, b, c, d, "silu", 0), args)


def test_experts_op_computes_in_the_hidden_dtype_with_fp32_weights():
    """A 16-bit expert-parallel plan hands the op bf16 hidden states and its fp32 expert
    slices (runtime/expert_parallel.py: FSDP2 does not cast them), with the router's fp32
    weights: output and gradients are those autograd gives the op's math on the same
    operands (experts_reference: the weights cast to bf16 per expert), each gradient in its
    operand's dtype."""
    x, idx, w, gate_up, down = _op_inputs(num_tokens=16, hidden=8, inter=6,
                                          dtype=torch.float32)
    x = x.to(torch.bfloat16)
    got_args = [t.clone().requires_grad_(True) for t in (x, w, gate_up, down)]
    ref_args = [t.clone().requires_grad_(True) for t in (x, w, gate_up, down)]
    got = experts(got_args[0], idx, got_args[1], got_args[2], got_args[3], "silu", 0)
    ref = experts_reference(ref_args[0], idx, ref_args[1], ref_args[2], ref_args[3], "silu", 0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)).to(got.dtype)
    got.backward(grad)
    ref.backward(grad)
    for a, b in zip(got_args, ref_args):
        assert a.grad.dtype == a.dtype
        # bf16 roundings in another order (the op sums gate and up's input gradients as two
        # matmuls, autograd as one): normwise within about 2 bf16 epsilons (2^-8 each); the others exact
        diff = (a.grad.double() - b.grad.double()).norm() / b.grad.double().norm()
        assert diff < 1e-2, diff


@pytest.mark.slow
def test_a_bf16_expert_parallel_plan_trains_the_16_bit_recipe(clusters):
    """bf16, dp4 x ep2: the expert slices stay fp32 masters outside FSDP2 and the op computes
    in bf16 (it failed on a dtype mismatch at the first step before). Against one process of
    the same recipe (_jobs.reference_mixed), test_train_as_planned's bf16 tolerances: losses
    atol 1e-3 (near 4.2), parameters atol 1e-2 (a few bf16 roundings of updates)."""
    factory = _moe.factory("mixtral")
    ref = _jobs.reference_mixed(factory, 2, 4, "bfloat16")
    results = clusters.get(4).run(_jobs.train_mixed, factory, 2, 4,
                                  dict(dp=4, ep=2, zero_stage=0), "bfloat16", timeout_s=600)
    for r in results:
        torch.testing.assert_close(torch.tensor(r[0]), torch.tensor(ref[0]), rtol=0,
                                   atol=1e-3)
    for fqn, value in results[0][1].items():
        torch.testing.assert_close(value.float(), ref[1][fqn].float(), rtol=0, atol=1e-2)


def test_experts_offset_slices_sum_to_the_whole():
    """Each rank holding 2 of 4 experts (expert_offset 0 and 2) computes a partial sum; the two
    add up to the op over all experts, and a token routed to no held expert gets zeros."""
    x, idx, w, gate_up, down = _op_inputs(dtype=torch.float32)
    full = experts(x, idx, w, gate_up, down, "silu", 0)
    parts = [experts(x, idx, w, gate_up[o:o + 2], down[o:o + 2], "silu", o) for o in (0, 2)]
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-6, atol=1e-6)
    none_held = (idx >= 2).all(dim=1)
    assert torch.equal(parts[0][none_held], torch.zeros_like(parts[0][none_held]))
    assert not torch.equal(parts[0], full)


@pytest.mark.parametrize("family", _moe.FAMILIES)
def test_capture_matches_hf_forward_and_gradients(family):
    """The captured graph, one experts op per MoE layer and no data-dependent op, gives the HF
    model's logits and every parameter's gradient (fp32)."""
    model = _moe.factory(family)()
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    graph = capture(model, (x,), model_name=family)
    targets = [n.target for n in graph.gm.graph.nodes if n.op == "call_function"]
    moe_layers = sum(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    assert targets.count(EXPERTS_OP) == moe_layers >= 1
    assert not {str(t) for t in targets} & {"aten.nonzero.default", "aten.where.default",
                                            "aten.index_add.default"}
    assert "forward" not in vars(model.model.layers[-1].mlp.experts)  # restored after capture
    materialize(graph.gm, model)
    out = graph.gm(x)
    out = out[graph.main_output_index] if isinstance(out, tuple) else out
    ref = model(x, use_cache=False).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    out.square().mean().backward()
    ref.square().mean().backward()
    got = dict(graph.gm.named_parameters())
    for fqn, p in model.named_parameters():
        torch.testing.assert_close(got[fqn].grad, p.grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{fqn}: {m}")


def test_unsupported_experts_layout_is_named():
    """An experts module with biases (a layout the op does not compute) fails at capture with
    its FQN, not later with a data-dependent shape."""
    model = _moe.factory("mixtral")()
    model.model.layers[1].mlp.experts.has_bias = True
    with pytest.raises(CaptureError, match=r"model\.layers\.1\.mlp\.experts.*has_bias"):
        capture(model, (torch.zeros(2, 8, dtype=torch.long),))


def test_reference_matches_hf_eager_experts():
    """The op's eager kernel is HF's own eager experts loop (Mixtral's, experts_implementation
    "eager") to rounding."""
    model = _moe.factory("mixtral")()
    experts_module = model.model.layers[0].mlp.experts
    model.config._experts_implementation = "eager"
    x, idx, w, _, _ = _op_inputs(num_tokens=5, hidden=32, num_experts=4, dtype=torch.float32)
    want = experts_module(x, idx, w)
    got = experts_reference(x, idx, w, experts_module.gate_up_proj, experts_module.down_proj,
                            "silu", 0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# --- planning ----------------------------------------------------------------------------------

def _experts_placements(plan) -> dict[str, str]:
    return {fqn: p for fqn, p in json.loads(plan.to_json())["param_placements"]
            if ".experts." in fqn}


@pytest.fixture(scope="module")
def ample_tp2_bytes():
    """family -> the memory per rank of its plan at tp2 on 2 local-cpu ranks (global batch 4,
    seq 16) with ample memory and the experts replicated (pinned R: with the experts priced
    as per-expert GEMMs the fastest plan may split them already), planned once for the tests
    that budget below it."""
    from autoplan.api import autoparallel

    planned = {}

    def get(family: str) -> float:
        if family not in planned:
            ample = autoparallel(_moe.factory(family)(), global_batch=4, seq_len=16,
                                 world_size=2, tp=2, placements={"*.mlp.experts.*": "R"}).plan
            planned[family] = ample.prediction.memory_bytes
        return planned[family]
    return get


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_tp2_on_local_cpu_splits_the_experts(family, ample_tp2_bytes):
    """At tp2 under a memory budget below replication, the plan splits the experts over the
    tp ranks (S(0), a partial output) and prices the op split (its time, launch latency
    aside, drops by more than 30 %)."""
    from autoplan.api import autoparallel
    from autoplan.cost_model.compute import op_time_s
    from autoplan.topology import preset

    ap = autoparallel(_moe.factory(family)(), global_batch=4, seq_len=16, world_size=2, tp=2,
                      device_memory_bytes=0.8 * ample_tp2_bytes(family))
    placements = _experts_placements(ap.plan)
    assert placements and set(placements.values()) == {"S(0)"}, placements
    nodes = [s for s in ap.plan.strategies if s.node.startswith("experts")]
    assert nodes and all(s.outputs == ("P",) for s in nodes)
    info = ap.graph.nodes[nodes[0].node]
    cfg = _moe.config(family)
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    assert info.flops == 2 * 4 * 16 * 2 * 3 * 32 * inter  # T k (2I H + H I), T = 64 tokens
    device = preset("local-cpu", 2).device
    whole, split = (op_time_s(info, device, "float32", shard_factor=f) - device.launch_latency_s
                    for f in (1.0, 2.0))
    assert split < 0.7 * whole  # the matmuls halve; efficiency drops a little on smaller ones


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_7b_class_moe_on_two_dgx_h100_nodes(family):
    """A 7B-class MoE (hidden 4096, 32 layers, 8 experts of FFN 1792, top-2: ~7e9 parameters;
    2 layers captured, costs scaled to 32) plans for 2 DGX-H100 nodes in bf16 and fits."""
    import transformers

    from autoplan.solver import plan
    from autoplan.spec import TrainingSpec
    from autoplan.topology import preset

    moe = (dict(intermediate_size=1792, num_local_experts=8) if family == "mixtral" else
           dict(intermediate_size=11008, moe_intermediate_size=1792, num_experts=8))
    cfg = _moe.config(family, hidden_size=4096, num_attention_heads=32, head_dim=128,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096,
                      **moe)
    cls = {"mixtral": transformers.MixtralForCausalLM,
           "qwen3_moe": transformers.Qwen3MoeForCausalLM}[family]
    with torch.device("meta"):
        model = cls(cfg)
    graph = capture(model, (torch.zeros(1, 4096, dtype=torch.long, device="meta"),),
                    model_name=f"{family}-7b-class", total_layers=32)
    topology = preset("dgx-h100", 2)
    result = plan(graph, topology, TrainingSpec(global_batch=256, seq_len=4096,
                                                dtype="bfloat16"))
    assert result.mesh.world_size == 16
    assert result.prediction.memory_bytes <= 0.9 * topology.device.mem_bytes
    experts = [n for n in graph.nodes.values() if n.target == "autoplan.experts.default"]
    assert len(experts) == 2 and all(n.flops > 0 for n in experts)
    total = sum(p.numel * (16 if p.layer_id is not None else 1)
                for p in graph.params.values() if not p.is_buffer)
    assert 6e9 < total < 8e9, total
    assert 0 < result.prediction.mfu < 1


# --- training against one process ---------------------------------------------------------------

@pytest.mark.slow
def test_mixtral_tp2_matches_single_process(clusters, ample_tp2_bytes):
    """Mixtral at tp2 with the experts split over the tp ranks: losses of 3 AdamW steps and
    every parameter after them equal one process (fp32, rtol 1e-5)."""
    factory = _moe.factory("mixtral")
    ref = _jobs.reference(factory, 3, 4)
    budget = 0.9 * ample_tp2_bytes("mixtral")  # _jobs.memory_budget's, already planned
    results = clusters.get(2).run(_jobs.train, factory, 3, 4, dict(tp=2), timeout_s=600,
                                  device_memory_bytes=budget)
    placements = _experts_placements(Plan.from_json(results[0][2]))
    assert set(placements.values()) == {"S(0)"}, placements
    _moe.assert_matches(results, ref)


@pytest.mark.slow
@pytest.mark.parametrize("family, zero, ep", [
    ("mixtral", 0, 2), ("qwen3_moe", 3, 2), ("deepseek_v3", 1, 2), ("mixtral", 1, 4),
    ("deepseek_v3", 3, 2)])
def test_dp4_ep_matches_single_process(clusters, family, zero, ep):
    """Expert parallelism: 4 ranks split the batch 4 ways; each group of ep ranks holds
    disjoint slices of the experts and exchanges tokens by all-to-all; the router stays
    replicated; the other weights are replicated (ZeRO-0), their optimizer states partitioned
    over the 4 (ZeRO-1: a slice's over the 4 / ep ranks that hold it, or its rank alone at ep
    4) or sharded (ZeRO-3). With gradient clipping that clips (the norm spans the expert
    slices): losses of 3 AdamW steps, the norms and every parameter after them equal one
    process."""
    factory = _moe.factory(family)
    ref = _jobs.reference(factory, 3, 4, max_grad_norm=0.5)
    assert all(n > 0.5 for n in ref[2]), "max_norm must be small enough to clip"
    results = clusters.get(4).run(_jobs.train, factory, 3, 4,
                                  dict(dp=4, ep=ep, zero_stage=zero),
                                  max_grad_norm=0.5, timeout_s=600)
    for r in results:
        torch.testing.assert_close(torch.tensor(r[3]), torch.tensor(ref[2]), rtol=1e-5, atol=0)
    plan = Plan.from_json(results[0][2])
    assert (plan.mesh.dp, plan.mesh.ep, str(plan.mesh)) == (4, ep, f"pp1xdp4(ep{ep})xtp1")
    assert plan.zero_stage == zero
    _moe.assert_matches(results, ref)


@pytest.mark.slow
@pytest.mark.parametrize("family, zero", [("mixtral", 0), ("qwen3_moe", 1), ("deepseek_v3", 3)])
def test_ep_with_tp_matches_single_process(clusters, family, zero):
    """ep 2 x tp 2 ([Note: experts over ep and tp] in runtime/expert_parallel.py), the folded
    plan (dense tp 2 x dp 2, experts ep 4: the report's expert mesh): dp 2 x tp 2
    on 4 ranks, tp splitting the experts (pinned Shard(0)) and ep splitting each tp share
    again, so a rank holds a quarter of the experts and exchanges its tp share of the
    choices within its ep group; with gradient clipping that clips: losses, norms and every
    parameter after 3 AdamW steps equal one process (fp32, rtol 1e-5)."""
    factory = _moe.factory(family)
    ref = _jobs.reference(factory, 3, 4, max_grad_norm=0.5)
    # DeepSeek-V3 unpinned: a given ep at tp 2 splits the experts on tp itself (and its
    # latent attention's v head dim, 8, is not q's, 16: sdpa_local's output shape)
    pins = {} if family == "deepseek_v3" else {"placements": {"*.mlp.experts.*": "S(0)"}}
    results = clusters.get(4).run(
        _jobs.train, factory, 3, 4, dict(dp=2, tp=2, ep=2, zero_stage=zero, **pins),
        max_grad_norm=0.5, timeout_s=600)
    plan = Plan.from_json(results[0][2])
    assert (str(plan.mesh), plan.zero_stage) == ("pp1xdp2(ep2)xtp2", zero)
    graph = capture(factory().to("meta"), (torch.zeros(1, 16, dtype=torch.long, device="meta"),))
    # the folded plan: the experts on a mesh of their own
    assert experts_text(plan, graph).startswith(
        "expert mesh ep 4 x edp 1 x etp 1 (ep folds tp 2 with 2 of the dp ranks): a rank holds "
        "1 of the 4 experts")
    for r in results:
        torch.testing.assert_close(torch.tensor(r[3]), torch.tensor(ref[2]), rtol=1e-5, atol=0)
    _moe.assert_matches(results, ref)


def config_of(p, ep: int):
    """The cost model's Config of plan `p` at expert-parallel degree `ep`."""
    from autoplan.cost_model.config import Config
    return Config(p.mesh.pp, p.mesh.dp, p.mesh.tp, p.zero_stage, p.num_microbatches,
                  p.microbatch_size, p.schedule, p.num_virtual_stages, ep=ep)


def test_ep_is_priced_per_topology_level():
    """ep 2 on a 2-node DGX-H100 plan (dp 16 x tp 1, ZeRO-0): the step pays the all-to-alls
    (inside a node: consecutive dp ranks) and the changed gradient all-reduce; the experts'
    weights and optimizer states per rank halve at ZeRO-0 and grow at ZeRO-3 (a whole slice
    instead of a 1/dp shard: rank_memory.ExpertSlices); an ep that does not divide the experts
    is a named error."""
    from autoplan.cost_model.expert_parallel import ep_step_delta_s, expert_layers
    from autoplan.solver.configurations import InvalidConfig
    from autoplan.solver.planner import reprice
    from autoplan.spec import TrainingSpec
    from autoplan.topology import preset

    graph = capture(_moe.factory("mixtral")().to("meta"),
                    (torch.zeros(1, 64, dtype=torch.long, device="meta"),), total_layers=32)
    from autoplan.solver import plan

    spec, topology = TrainingSpec(global_batch=64, seq_len=64), preset("dgx-h100", 2)

    def with_ep(p, ep):  # the same configuration and placement, at ep
        return reprice(graph, dataclasses.replace(p, mesh=dataclasses.replace(p.mesh, ep=ep)),
                       topology, spec)

    def states(p):
        (rank,) = p.prediction.memory_by_pp_rank
        return rank["params"], rank["optimizer"]

    base = plan(graph, topology, spec, dp=16, tp=1, zero_stage=0, ep=1)
    assert with_ep(base, 1).prediction.step_time_s == base.prediction.step_time_s
    layers = expert_layers(graph)
    assert layers.num_layers == 32 and layers.num_experts == (4, 4) and layers.top_k == 2
    two = with_ep(base, 2)
    assert two.mesh.ep == 2 and two.param_placements == base.param_placements
    a2a_s, sync_s, compute_s = ep_step_delta_s(layers, config_of(base, 2), spec, topology)
    # 32 layers x 4 all-to-alls of T k H x 4 bytes (T = 64 tokens of one sample) on NVLink
    assert 32 * 4 * (64 * 2 * 32 * 4) / 2 / topology.intra_node.bw_bytes_per_s < a2a_s
    assert two.prediction.step_time_s == pytest.approx(base.prediction.step_time_s + a2a_s
                                                       + sync_s + compute_s)
    # fp32 params, AdamW's two fp32 moments: half the experts' at ep 2
    saved = [b - t for b, t in zip(states(base), states(two))]
    assert saved == pytest.approx([layers.expert_elems * 4 / 2, layers.expert_elems * 8 / 2])
    assert two.prediction.memory_bytes < base.prediction.memory_bytes
    assert two.prediction.memory_bytes == max(r["peak"] for r in
                                              two.prediction.memory_by_pp_rank)
    with pytest.raises(InvalidConfig, match="does not divide the 4 experts of its MoE layers"):
        with_ep(base, 8)
    # ZeRO-3 shards the experts 16 ways without ep; ep keeps its slice whole: more memory
    zero3 = plan(graph, topology, spec, dp=16, tp=1, zero_stage=3, ep=1)
    two3 = with_ep(zero3, 2)
    grown = [t - b for b, t in zip(states(zero3), states(two3))]
    assert grown == pytest.approx([layers.expert_elems * 4 * (1 / 2 - 1 / 16),
                                   layers.expert_elems * 8 * (1 / 2 - 1 / 16)])


def test_routing_skew_priced():
    """The busiest rank's routing skew ([Note: expert parallelism]): under ep its all-to-alls
    move skew x the mean's bytes and its receive buffers hold skew x the pairs; at ep = 1 a
    rank computes its own tokens (no skew), while tp's split of whole experts runs at the
    busiest tp rank's pace; the option reaches the spec and the plan records it (no key at
    1); a dense plan's JSON carries no skew."""
    from autoplan.cost_model.compute import op_time_s
    from autoplan.cost_model.expert_parallel import (
        ep_step_delta_s, expert_layers, expert_slices, experts_time_s)
    from autoplan.plan import Plan
    from autoplan.solver import plan
    from autoplan.spec import ROUTING_SKEW, TrainingSpec
    from autoplan.topology import preset

    graph = capture(_moe.factory("mixtral")().to("meta"),
                    (torch.zeros(1, 64, dtype=torch.long, device="meta"),), total_layers=32)
    topology = preset("dgx-h100", 2)
    skewed, balanced = (TrainingSpec(global_batch=64, seq_len=64, routing_skew=s)
                        for s in (2.0, 1.0))
    assert TrainingSpec(global_batch=64, seq_len=64).routing_skew == ROUTING_SKEW > 1
    with pytest.raises(ValueError, match="routing_skew"):
        TrainingSpec(global_batch=64, seq_len=64, routing_skew=0.5)
    base = plan(graph, topology, balanced, dp=16, tp=1, zero_stage=0, ep=1, routing_skew=1.0)
    assert base.routing_skew == 1.0 and "routing_skew" not in base.to_dict()
    layers = expert_layers(graph)
    a2a_2, _, compute_2 = ep_step_delta_s(layers, config_of(base, 2), skewed, topology)
    a2a_1, _, compute_1 = ep_step_delta_s(layers, config_of(base, 2), balanced, topology)
    assert a2a_1 < a2a_2 < 2 * a2a_1  # the big exchanges' bytes double, not their latency
    assert compute_2 > compute_1
    device = topology.device
    assert experts_time_s(layers, 64, 1, skewed, device) == experts_time_s(
        layers, 64, 1, balanced, device)
    assert expert_slices(layers, 2, 64, 4, 2.0).act_bytes == pytest.approx(
        2 * expert_slices(layers, 2, 64, 4).act_bytes)
    node = next(n for n in graph.nodes.values() if n.experts is not None)
    assert node.experts == (4, 2, layers.intermediate)
    split = op_time_s(node, device, "float32", shard_factor=2, routing_skew=2.0)
    assert split > op_time_s(node, device, "float32", shard_factor=2)
    assert op_time_s(node, device, "float32", routing_skew=2.0) == op_time_s(
        node, device, "float32")
    at_two = plan(graph, topology, balanced, dp=16, tp=1, zero_stage=0, ep=1, routing_skew=2.0)
    assert at_two.routing_skew == 2.0
    assert Plan.from_json(at_two.to_json()).routing_skew == 2.0


def test_grouped_gemm_efficiency():
    """The routed experts are priced as per-expert GEMMs of m = T k / E rows ([Note: matmul
    efficiency curve]): DeepSeek-V3's shape (E 256, k 8, I 2048, H 7168) at 4096 tokens sits
    at m = 128, half the large-matmul efficiency of a GPU preset, where one (T, H) x (H, 3 k I)
    matmul would be near the top; ep gathers ep ranks' rows onto each expert."""
    from autoplan.cost_model.compute import _efficiency, expert_gemm_dims, matmul_efficiency
    from autoplan.graph import NodeInfo
    from autoplan.topology import preset

    device = preset("dgx-h100", 1).device
    tokens, hidden, (num_experts, k, inter) = 4096, 7168, (256, 8, 2048)
    node = NodeInfo("experts", "autoplan.experts.default", ((tokens, hidden),), ("bfloat16",),
                    tokens * hidden * 2, tokens * hidden * 2,
                    2 * tokens * k * 3 * inter * hidden, "mlp.experts", 3,
                    experts=(num_experts, k, inter))
    assert expert_gemm_dims(node) == (128, inter, hidden)
    assert expert_gemm_dims(node, group=8) == (1024, inter, hidden)
    assert _efficiency(node, device, 1.0) == pytest.approx(device.matmul_efficiency / 2)
    assert _efficiency(node, device, 4.0) == _efficiency(node, device, 1.0)  # whole experts
    assert matmul_efficiency(tokens, device) > 0.9 * device.matmul_efficiency


def test_ep_plan_round_trips_and_reports():
    """An ep plan keeps ep through JSON (a plan without ep writes no `ep` key, as before ep
    existed), prints it inside dp, and the report shows the ep groups' level."""
    from autoplan.report import render_markdown
    from autoplan.solver import plan
    from autoplan.spec import TrainingSpec
    from autoplan.topology import preset

    graph = capture(_moe.factory("mixtral")().to("meta"),
                    (torch.zeros(1, 16, dtype=torch.long, device="meta"),))
    topology, spec = preset("local-cpu"), TrainingSpec(global_batch=4, seq_len=16)
    with_ep = plan(graph, topology, spec, dp=4, ep=2)
    assert str(with_ep.mesh) == "pp1xdp4(ep2)xtp1"
    assert Plan.from_json(with_ep.to_json()) == with_ep
    without = plan(graph, topology, spec, dp=4, ep=1)
    assert "ep" not in json.loads(without.to_json())["mesh"]
    assert Plan.from_json(without.to_json()).mesh.ep == 1
    report = render_markdown(with_ep, graph=graph, topology=topology)
    assert "| `ep` (in dp) | 2 | 1 | intra-node |" in report
    # the experts' layout beside the dense layers' mesh
    assert ("| experts | expert mesh ep 2 x edp 2 x etp 1 (ep on 2 of the dp ranks): a rank "
            "holds 2 of the 4 experts of every MoE layer, that slice whole, outside ZeRO, on 2 "
            "dp ranks (dp 4 / ep 2); tokens exchanged by all-to-all within each ep group; the "
            "dense layers on dp 4 x tp 1. Why: experts with the dense layers (ep 1) on this "
            "configuration (ep 2 given: configurations at other ep not searched): ") in report
    assert "all 4 experts of every MoE layer on every rank, held as the dense weights are" \
        in render_markdown(without, graph=graph, topology=topology)


def test_reprice_keeps_ep():
    """`reprice` of an ep plan on its own topology gives the same plan, ep and prediction."""
    from autoplan.solver import plan, reprice
    from autoplan.spec import TrainingSpec
    from autoplan.topology import preset

    graph = capture(_moe.factory("qwen3_moe")().to("meta"),
                    (torch.zeros(1, 16, dtype=torch.long, device="meta"),))
    topology, spec = preset("local-cpu"), TrainingSpec(global_batch=4, seq_len=16)
    with_ep = plan(graph, topology, spec, dp=4, ep=2)
    again = reprice(graph, with_ep, topology, spec)
    assert again.mesh == with_ep.mesh
    assert again.prediction.step_time_s == pytest.approx(with_ep.prediction.step_time_s)
    assert again.prediction.memory_bytes == pytest.approx(with_ep.prediction.memory_bytes)


@pytest.mark.parametrize("overrides", [{}, {"pp": 2}, {"tp": 2, "dp": 2}],
                         ids=["searched", "pp2", "dp2xtp2"])
def test_deepseek_v3_plans_on_four_ranks(overrides):
    """DeepSeek-V3 (latent attention, a dense block 0 and an MoE block 1 with a shared expert
    and group-limited routing: blocks that differ) plans for 4 local-cpu ranks -- it once
    failed in the solver ('NoneType' object has no attribute 'compute_s')."""
    from autoplan.api import autoparallel

    ap = autoparallel(_moe.factory("deepseek_v3")(), global_batch=4, seq_len=16,
                      world_size=4, **overrides)
    assert ap.plan.mesh.world_size == 4
    assert all(getattr(ap.plan.mesh, k) == v for k, v in overrides.items())
    assert ap.plan.prediction.step_time_s > 0
