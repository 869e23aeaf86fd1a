"""ep searched jointly with the rest of the plan ([Note: expert parallelism] in
cost_model/expert_parallel.py): never slower than repricing the best ep = 1 plan at each ep
(what the planner did before), faster where only a configuration the ep = 1 search did not
choose fits or pays with ep, and the report says how the experts lie and why."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import _jobs
import _moe
from autoplan.capture import capture
from autoplan.cost_model.expert_parallel import expert_layers, expert_weights
from autoplan.plan import Plan
from autoplan.report.facts import experts_text
from autoplan.solver import plan, reprice
from autoplan.solver.expert_degree import ep_degrees
from autoplan.spec import TrainingSpec
from autoplan.topology import preset


def _model(family: str, **overrides):
    """A 7B-class (deepseek_v3: 2B-class) mixture-of-experts model on meta."""
    import transformers

    if family == "deepseek_v3":
        cfg = _moe.config(family, hidden_size=2048, num_attention_heads=16,
                          num_key_value_heads=16, vocab_size=32000,
                          max_position_embeddings=4096, intermediate_size=11008,
                          moe_intermediate_size=1408, n_routed_experts=16, n_group=4,
                          topk_group=2, num_experts_per_tok=4, q_lora_rank=512,
                          kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64,
                          v_head_dim=64)
    else:
        cfg = _moe.config(family, hidden_size=4096, num_attention_heads=32, head_dim=128,
                          num_key_value_heads=8, vocab_size=32000,
                          max_position_embeddings=4096, num_local_experts=8, **overrides)
    cls = {"mixtral": transformers.MixtralForCausalLM,
           "deepseek_v3": transformers.DeepseekV3ForCausalLM}[family]
    with torch.device("meta"):
        return cls(cfg)


def _repriced(graph, topology, spec, **choices):
    """The planner before the joint search: the best ep = 1 plan, repriced at every ep that
    applies to its mesh (at tp > 1 where it splits the experts on tp), the fastest that fits."""
    base = plan(graph, topology, spec, ep=1, **choices)
    budget = spec.max_memory_fraction * topology.device.mem_bytes
    m, best = base.mesh, base
    split = all(base.placement_of(f) == "S(0)" for f in expert_weights(graph))
    for ep in ep_degrees(expert_layers(graph), m.dp, m.tp, m.cp, topology, None):
        if ep == 1 or (m.tp > 1 and not split):
            continue
        cand = reprice(graph, dataclasses.replace(base, mesh=dataclasses.replace(m, ep=ep)),
                       topology, spec)
        if cand.prediction.memory_bytes <= budget and \
                cand.prediction.step_time_s < best.prediction.step_time_s:
            best = cand
    return best


# (family, model overrides, nodes, global batch, routing skew, choices, joint strictly faster)
CASES = {
    # Mixtral-8x7B-class (47B): ep = 1 plans fit only over pp 8 x tp 2; with ep 8 a pp 2 plan
    # fits (its configuration at ep 1 needs 270 GB), 6% faster
    "mixtral-47b-2-nodes": ("mixtral", dict(intermediate_size=14336), 2, 256, 1.0, {}, True),
    # tp 2 given: the folded plan (experts over ep 2 x tp 2) at pp 4, 3% faster than the
    # repricing of the ep = 1 search's pp 8
    "mixtral-47b-tp2-folded": ("mixtral", dict(intermediate_size=14336), 4, 256, 1.0,
                               {"tp": 2}, True),
    # the default skew: ep's busiest rank computes 1.52x the mean, no ep pays; equal
    "deepseek-2b-2-nodes": ("deepseek_v3", {}, 2, 256, None, {}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_joint_search_never_slower_than_repricing(case):
    """The joint search's plan is no slower than the repricing's on every case, strictly
    faster where the case says so; the report's experts line gives the expert mesh next to
    the dense one and why (the chosen configuration at the other layout)."""
    family, overrides, nodes, batch, skew, choices, faster = CASES[case]
    graph = capture(_model(family, **overrides),
                    (torch.zeros(1, 4096, dtype=torch.long, device="meta"),),
                    model_name=case, total_layers=32)
    topology = preset("dgx-h100", nodes)
    spec = TrainingSpec(global_batch=batch, seq_len=4096, dtype="bfloat16",
                        **({} if skew is None else {"routing_skew": skew}))
    joint = plan(graph, topology, spec, **choices)
    old = _repriced(graph, topology, spec, **choices)
    budget = spec.max_memory_fraction * topology.device.mem_bytes
    assert joint.prediction.memory_bytes <= budget
    assert joint.prediction.step_time_s <= old.prediction.step_time_s * (1 + 1e-9)
    if faster:
        assert joint.prediction.step_time_s < 0.99 * old.prediction.step_time_s
        assert joint.mesh.ep > 1 and joint.mesh.pp < old.mesh.pp
    line = experts_text(joint, graph)
    assert ". Why: experts " in line
    if joint.mesh.ep > 1:
        assert "Why: experts with the dense layers (ep 1) on this configuration: " in line
        assert f"ep {joint.mesh.ep}'s all-to-alls" in line
    if choices.get("tp") == 2:  # the experts over ep x tp: a mesh of their own
        ep = 2 * joint.mesh.ep
        assert line.startswith(f"expert mesh ep {ep} x edp {joint.mesh.dp // joint.mesh.ep} "
                               f"x etp 1 (ep folds tp 2 with {joint.mesh.ep} of the dp ranks)")


def test_a_given_ep_says_what_another_would_do():
    """With ep given the experts line says so, and where another ep would be faster on the
    chosen configuration it says by how much (a fresh-eyes finding: it read "tie" for a plan
    42% faster); the runners-up show their ep."""
    from autoplan.report.facts import mesh_text

    graph = capture(_moe.factory("mixtral", intermediate_size=512, num_local_experts=8)().to(
        "meta"), (torch.zeros(1, 16, dtype=torch.long, device="meta"),))
    topology, spec = preset("local-cpu", devices_per_node=4), TrainingSpec(8, 16)
    fixed = plan(graph, topology, spec, dp=4, ep=1, zero_stage=0)
    (alt,) = [a for a in fixed.alternatives if a.reason.startswith("experts ")]
    assert alt.mesh.ep > 1 and f"(ep {alt.mesh.ep})" in mesh_text(alt.mesh)
    faster = fixed.prediction.step_time_s - alt.step_time_s
    assert faster > 0
    assert (f"on this configuration (ep 1 given: configurations at other ep not searched): "
            f"{faster * 1e3:.3g} ms per step faster") in alt.reason
    free = plan(graph, topology, spec, dp=4, zero_stage=0)
    assert free.prediction.step_time_s <= alt.step_time_s * (1 + 1e-9)


def test_ep_at_tp_needs_the_experts_split_on_tp():
    """A given ep at tp > 1 splits the experts on tp (the runtime's ep x tp layout); a pin
    that keeps them whole is refused, naming the weight and the pin."""
    from autoplan.api import autoparallel
    from autoplan.solver.configurations import InvalidConfig

    with pytest.raises(InvalidConfig, match=r"ep 2 at tp 2 needs the experts split on tp "
                                            r"\(Shard\(0\)\); placements pin "
                                            r"model\.layers\.0\.mlp\.experts\.\w+ to R"):
        autoparallel(_moe.factory("mixtral")(), global_batch=4, seq_len=16, world_size=4,
                     dp=2, tp=2, ep=2, placements={"*.mlp.experts.*": "R"}).plan


def test_no_plan_with_a_given_ep_names_what_ep_holds():
    """A given ep whose plans do not fit is refused with what ep changes and what to try (the
    expert slices whole outside ZeRO, tp 1 unless given), not only the smallest plan's
    memory (which hid the ep that caused it)."""
    from autoplan.api import autoparallel
    from autoplan.solver.configurations import NoFeasiblePlan

    with pytest.raises(NoFeasiblePlan, match=r"With ep 2 given the expert slices are held "
                                             r"whole outside ZeRO, and tp is 1 unless given"):
        autoparallel(_moe.factory("mixtral")(), global_batch=4, seq_len=16, world_size=4,
                     dp=4, ep=2, device_memory_bytes=1e5).plan


@pytest.mark.slow
def test_ep_with_pp_matches_single_process(clusters):
    """ep inside the dp of a pipelined plan (pp 2 x dp 2 with ep 2, ZeRO-3, 2 microbatches): a
    stage's MoE layers exchange tokens within its ep group while the stages pass microbatches,
    as the joint search chooses for DeepSeek-V3 at scale (pp 4 x dp 64 with ep 8); with
    clipping, losses, norms and every parameter after 3 AdamW steps equal one process."""
    factory = _moe.factory("deepseek_v3")
    ref = _jobs.reference(factory, 3, 4, max_grad_norm=0.5)
    results = clusters.get(4).run(
        _jobs.train, factory, 3, 4, dict(pp=2, dp=2, ep=2, zero_stage=3, num_microbatches=2),
        max_grad_norm=0.5, timeout_s=600)
    plan = Plan.from_json(results[0][2])
    assert (str(plan.mesh), plan.zero_stage) == ("pp2xdp2(ep2)xtp1", 3)
    for r in results:
        torch.testing.assert_close(torch.tensor(r[3]), torch.tensor(ref[2]), rtol=1e-5, atol=0)
    _moe.assert_matches(results, ref)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_memory_forms_hold_the_expert_slices(family):
    """Under ep > 1 the memory-constrained ILP prices the expert weights as the slices a rank
    holds beside FSDP2 ([Note: expert slices in the forms] in cost_model/rank_memory.py): its
    memory rows, at a placement, give the peak pipeline.assess gives -- random ep > 1
    configurations (pp, interleaving, ZeRO stages, checkpointing, offload), fp32 and bf16,
    frozen experts too -- and, at tp > 1, admit only placements splitting the experts on tp
    (what the runtime runs). Before, the rows held them as FSDP2 holds a dense weight: a
    DeepSeek-V3 placement at 70.9 GB was 467 GB in the ILP, and no ep plan was constrained."""
    import random

    from autoplan.solver import ilp, ilp_model
    from autoplan.solver.configurations import Overrides, enumerate_configs, offload_variants
    from autoplan.solver.search import Search

    rng = random.Random(0)
    model = _moe.factory(family, num_local_experts=8, n_routed_experts=8, num_experts=8,
                         num_hidden_layers=4 if family == "mixtral" else 2)()
    if family == "deepseek_v3":  # frozen experts: no gradient, no optimizer state
        for name, p in model.named_parameters():
            if ".experts." in name and rng.random() < 0.5:
                p.requires_grad_(False)
    graph = capture(model.to("meta"), (torch.zeros(1, 16, dtype=torch.long, device="meta"),),
                    model_name=f"tiny-{family}")
    topology = dataclasses.replace(preset("dgx-h100"), devices_per_node=8, num_nodes=2)
    checked = {"split": 0, "refused": 0, "offload": 0}
    for dtype in ("float32", "bfloat16"):
        spec = TrainingSpec(global_batch=32, seq_len=16, dtype=dtype)
        search = Search(graph, topology, spec, 1.0)
        configs = [c for c in enumerate_configs(graph, topology, spec, Overrides(),
                                                search.policies()) if c.ep > 1]
        assert configs
        picked = rng.sample(configs, min(25, len(configs)))
        for cfg in picked + [v for c in picked for v in offload_variants(c, Overrides())][:12]:
            prob, costs = search.problem(cfg.tp), search.cost(*cfg.costs_key)
            assert prob.experts
            model_ = ilp._build(prob, costs, True, search.ranks(cfg), 1e15, "time",
                                ilp.TIME_FORM, None, 10.0)
            if cfg.tp > 1:  # at tp > 1 an expert weight is split on tp (Shard(0)) or refused
                for g in prob.experts:
                    for v, c in zip(model_.x[g], prob.cands[g]):
                        assert (v.ub() == 1.0) == (c.outputs[:1] == ("S(0)",)), (cfg, g)
                        checked["refused"] += c.outputs[:1] != ("S(0)",)
            for _ in range(3):
                choice = {n: rng.randrange(len(prob.cands[n])) for n in prob.nodes}
                if cfg.tp > 1:  # the experts split on tp, as the runtime runs ep at tp > 1
                    choice.update({g: [c.outputs[:1] for c in prob.cands[g]].index(("S(0)",))
                                   for g in prob.experts})
                values = model_.assignment(choice)
                try:
                    sol = ilp.evaluate(prob, costs, choice)
                except KeyError:  # a pair that is not offered
                    continue
                assert search.for_ep(cfg, sol) is not None and not model_.violated(values)
                form_bytes = max(
                    (const + sum(c * values[v] for v, c in terms.items())) * ilp_model._KB
                    for terms, const in map(model_.memory_expr, search.ranks(cfg)))
                want = search.assess(cfg, sol).memory_bytes
                assert form_bytes == pytest.approx(want, rel=1e-9), (dtype, cfg)
                checked["split"] += 1
                checked["offload"] += cfg.offload != "none"
    assert checked["split"] >= 30 and checked["refused"] >= 3 and checked["offload"] >= 5, checked
