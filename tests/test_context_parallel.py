"""Context parallelism in the planner ([Note: context parallelism] in autoplan/solver/context.py):
the cp mesh axis and its JSON, the costs per cp rank and the K/V collectives against the
alpha-beta formula by hand, the search over cp, the report, and the runtime's refusal to build
a cp plan it does not run yet."""

from __future__ import annotations

import dataclasses

import pytest

from autoplan.capture import capture
from autoplan.cost_model.context import kv_bytes
from autoplan.models import build_model, example_inputs, model_config
from autoplan.plan import MeshShape, Plan
from autoplan.report import render_markdown
from autoplan.runtime.checks import check_context_parallel
from autoplan.solver import InvalidConfig, plan
from autoplan.solver import pipeline
from autoplan.solver.context import attention_nodes, cp_degrees
from autoplan.solver.search import Overrides, PlanConfig, Search, enumerate_configs
from autoplan.spec import TrainingSpec
from autoplan.topology import preset

SEQ = 2048


@pytest.fixture(scope="module")
def long_llama():
    """llama-tiny (8 query / 2 kv heads of 4, 2 layers) at 2048 tokens."""
    model = build_model("llama-tiny", max_position_embeddings=SEQ)
    return capture(model, example_inputs("llama-tiny", batch=1, seq_len=SEQ),
                   model_name="llama-tiny", total_layers=2)


@pytest.fixture(scope="module")
def h100():
    return preset("dgx-h100")


SPEC = TrainingSpec(global_batch=2, seq_len=SEQ, dtype="bfloat16")


def test_mesh_cp_axis_world_size_and_json():
    mesh = MeshShape(pp=2, dp=2, tp=2, cp=4)
    assert mesh.world_size == 32 and mesh.dp_shard == 8
    assert mesh.axis_names == ("pp", "dp", "cp", "tp") and mesh.shape == (2, 2, 4, 2)
    assert str(mesh) == "pp2xdp2xcp4xtp2"
    assert MeshShape(2, 2, 2).axis_names == ("pp", "dp", "tp")
    with pytest.raises(ValueError, match="cp 0"):
        MeshShape(cp=0)
    with pytest.raises(ValueError, match="cp 2 with ep 2"):
        MeshShape(dp=2, ep=2, cp=2)


def test_plan_json_round_trip_with_cp_and_without(long_llama, h100):
    p = plan(long_llama, h100, SPEC, cp=2, tp=4)
    assert p.mesh.cp == 2 and p.mesh.world_size == 8
    assert Plan.from_json(p.to_json()) == p
    d = p.to_dict()
    assert d["mesh"]["cp"] == 2 and d["prediction"]["cp_comm_s"] > 0
    q = plan(long_llama, h100, SPEC, cp=1, tp=4)
    assert "cp" not in q.to_dict()["mesh"] and "cp_comm_s" not in q.to_dict()["prediction"]
    assert Plan.from_json(q.to_json()) == q


def test_cp_degrees(long_llama):
    # powers of two dividing the devices, seq % 2 cp == 0, chunks of >= 128 tokens
    assert cp_degrees(long_llama, SEQ, 64) == [1, 2, 4, 8]
    assert cp_degrees(long_llama, 3000, 64) == [1, 2, 4]  # 3000 % 16 != 0
    assert cp_degrees(long_llama, 1024, 64) == [1, 2, 4]  # chunks of 1024 / 16 < 128
    assert cp_degrees(long_llama, SEQ, 6) == [1, 2]
    eager = build_model("llama-tiny", attn_implementation="eager")
    g = capture(eager, example_inputs("llama-tiny", batch=1, seq_len=16),
                model_name="llama-tiny", total_layers=2)
    assert attention_nodes(g) == [] and cp_degrees(g, 4096, 8) == [1]
    with pytest.raises(InvalidConfig, match="no fused attention"):
        plan(g, preset("dgx-h100"), TrainingSpec(2, 16), cp=2)


def test_invalid_cp_names_the_numbers(long_llama, h100):
    with pytest.raises(InvalidConfig, match="seq_len 1000 is not divisible by 2 x cp = 16"):
        plan(long_llama, h100, TrainingSpec(2, 1000), cp=8)
    with pytest.raises(InvalidConfig, match="cp 3 does not divide the world size 8"):
        plan(long_llama, h100, SPEC, cp=3)


def test_costs_per_cp_rank_are_half_the_tokens(long_llama, h100):
    """cp 2 with a microbatch of 2 samples computes and holds what cp 1 does with 1 sample
    (b s / cp tokens per rank), plus the K/V collectives and the gathered K/V."""
    search = Search(long_llama, h100, SPEC, 10.0)
    half, whole = search.cost(2, 2, "none", 2), search.cost(2, 1, "none", 1)
    assert half.scale == pytest.approx(whole.scale)
    assert half.compute_s == whole.compute_s
    attn = [n for n in attention_nodes(long_llama) if n in search.problem(2).weight]
    assert len(attn) == 1 and set(half.node_comm_s) == set(attn) and not whole.node_comm_s
    for n, row in whole.act_bytes.items():
        if n not in attn:
            assert half.act_bytes[n] == row
    assert all(h > w for h, w in zip(half.act_bytes[attn[0]], whole.act_bytes[attn[0]]))


def test_kv_collectives_by_hand(long_llama, h100):
    """t_cp = 2 [all_gather(n/2) + reduce_scatter(n/2)] over cp ranks on NVLink, n the K and V
    bytes of the whole sequence before GQA's expansion, for the rank's heads."""
    search = Search(long_llama, h100, SPEC, 10.0)
    cp, tp, b = 2, 2, 1
    costs = search.cost(tp, b, "none", cp)
    prob = search.problem(tp)
    (node,) = [n for n in costs.node_comm_s]
    kv, heads = kv_bytes(long_llama, node)
    config = model_config("llama-tiny")
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert heads == config["num_key_value_heads"] == 2
    assert kv == 2 * 1 * SEQ * heads * head_dim * 4  # captured in fp32: batch 1, K and V
    n_whole = kv * b / long_llama.batch_size
    link = h100.intra_node
    for cand, (fwd, bwd) in zip(prob.cands[node], costs.node_comm_s[node]):
        split = cand.shard_factor > 1 and any(p.startswith("S(") for p in cand.inputs[1:3])
        n = n_whole / min(tp, heads) if split else n_whole
        one = 2 * ((n / 2) * (cp - 1) / cp / link.bw_bytes_per_s + (cp - 1) * link.latency_s)
        assert fwd == pytest.approx(one, rel=1e-9) and bwd == pytest.approx(one, rel=1e-9)
    assert any(c.shard_factor > 1 for c in prob.cands[node])


def test_gradient_sync_and_zero_over_dp_times_cp(h100):
    """dp 2 x cp 2 shards ZeRO states over 4 ranks and reduces over a group of 4."""
    spec = SPEC
    sol = pipeline.Solution({}, param_elems={"layer": 1e9})
    four = pipeline.assess(pipeline.Config(1, 4, 2, 3, 1, 1, "1f1b"), sol, spec, h100,
                           total_layers=2, output_bytes=0.0, boundary_bytes=0.0)
    mixed = pipeline.assess(pipeline.Config(1, 2, 2, 3, 1, 1, "1f1b", cp=2), sol, spec, h100,
                            total_layers=2, output_bytes=0.0, boundary_bytes=0.0)
    assert mixed.memory_breakdown == four.memory_breakdown
    assert mixed.dp_sync_s == pytest.approx(four.dp_sync_s)


def test_search_covers_cp_and_bounds_hold(long_llama, h100):
    search = Search(long_llama, h100, SPEC, 10.0)
    configs = enumerate_configs(long_llama, h100, SPEC, Overrides(), search.policies())
    assert {c.cp for c in configs} == {1, 2, 4, 8}
    assert all(c.world_size == 8 and SPEC.global_batch % c.dp == 0 for c in configs)
    for cfg in [c for c in configs if c.cp > 1][::37]:
        sol = search.solution(cfg)
        assessed = search.assess(cfg, sol)
        assert search.lower_bound(cfg).step_time_s <= assessed.step_time_s * (1 + 1e-9)
        assert assessed.cp_comm_s > 0 and sum(sol.cp_comm_s.values()) > 0


def test_candidate_ranks_give_the_peak_of_every_rank(long_llama, h100, monkeypatch):
    """assess over the ranks `_candidate_ranks` keeps equals assess over all ranks."""
    search = Search(long_llama, h100, SPEC, 10.0)
    sol = search.solution(PlanConfig(1, 1, 1, 0, 1, 1, "1f1b"))
    sol = dataclasses.replace(sol, act_bytes={"pre": 3e8, "layer": 7e9, "post": 5e8},
                              param_elems={"pre": 1e8, "layer": 9e9, "post": 2e8})
    cases = [(pp, m, sched, v, zero) for pp in (2, 3, 5, 8) for m in (1, 2, 4, 7, 16)
             for sched, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))
             for zero in (0, 3) if sched != "interleaved-1f1b" or m % pp == 0]
    for pp, m, sched, v, zero in cases:
        cfg = pipeline.Config(pp, 2, 1, zero, m, 1, sched, v)
        kw = dict(total_layers=37, output_bytes=4e8, boundary_bytes=2e8)
        few = pipeline.assess(cfg, sol, SPEC, h100, **kw)
        with monkeypatch.context() as mp:
            mp.setattr(pipeline, "_candidate_ranks", lambda c, layers: list(range(c.pp)))
            every = pipeline.assess(cfg, sol, SPEC, h100, **kw)
        assert (few.step_time_s, few.memory_bytes, few.memory_breakdown) == \
            (every.step_time_s, every.memory_bytes, every.memory_breakdown), cfg


def test_report_names_cp(long_llama, h100):
    p = plan(long_llama, h100, SPEC, cp=2, tp=4, top_k=3)
    md = render_markdown(p, graph=long_llama, topology=h100)
    assert "pp 1 x dp 1 x cp 2 x tp 4" in md
    assert "| context parallelism | cp 2: every sample's 2048 tokens in 4 chunks of 512" in md
    assert "of which cp K/V all-gather + reduce-scatter" in md
    assert "| `cp` | 2 | 4 | intra-node |" in md
    assert "Check: they differ" not in md


def test_cp_only_where_nothing_fits_without(long_llama, h100):
    """[Note: context parallelism]: with memory for a cp = 1 plan, free planning keeps cp 1
    (no cp anywhere, alternatives included); with 1.26 MB usable per device, where the
    smallest cp = 1 plan needs 1.32 MB, it plans cp > 1."""
    p = plan(long_llama, h100, SPEC, top_k=5)
    assert p.mesh.cp == 1 and all(a.mesh.cp == 1 for a in p.alternatives)
    tight = dataclasses.replace(h100, device=dataclasses.replace(h100.device, mem_bytes=1.4e6))
    assert plan(long_llama, tight, SPEC).mesh.cp > 1


def test_free_plan_explains_a_losing_cp(long_llama, h100):
    """Where cp is searched (1.26 MB usable: cp 4 x tp 2 chosen), a runner-up with more cp
    that loses on communication names its exposed K/V all-gather; one with less cp (cp 2 x
    tp 4) loses on tp communication and does not blame K/V."""
    tight = dataclasses.replace(h100, device=dataclasses.replace(h100.device, mem_bytes=1.4e6))
    p = plan(long_llama, tight, SPEC, top_k=5)
    losing = [a for a in p.alternatives if a.reason.startswith("communication")]
    more = [a for a in losing if a.mesh.cp > p.mesh.cp]
    less = [a for a in losing if a.mesh.cp < p.mesh.cp]
    assert more and all(f"(cp{a.mesh.cp}: K/V all-gather exposed " in a.reason for a in more)
    assert all("K/V" not in a.reason for a in less)


def test_runtime_refuses_a_cp_plan(long_llama, h100):
    p = plan(long_llama, h100, SPEC, cp=2, tp=4)
    with pytest.raises(NotImplementedError, match=r"context parallelism \(cp 2 in "
                                                  r"pp1xdp1xcp2xtp4\).*all-gather of K and V"):
        check_context_parallel(p)
    check_context_parallel(plan(long_llama, h100, SPEC, cp=1, tp=4))  # no error


def test_autoparallel_plans_cp_1_and_refuses_a_given_cp_at_build():
    """@autoparallel plans with cp 1 (the runtime does not run cp > 1) where plan() would
    take cp 4; cp=4 given plans it, and the build says what is missing, before anything is
    set up."""
    from autoplan import autoparallel

    def make():
        return build_model("llama-tiny", max_position_embeddings=1024, device="cpu")

    fixed = dict(global_batch=4, seq_len=1024, cluster="dgx-h100", tp=2, pp=1, dp=1)
    graph = capture(build_model("llama-tiny", max_position_embeddings=1024),
                    example_inputs("llama-tiny", batch=1, seq_len=1024), model_name="x",
                    total_layers=2)
    assert plan(graph, preset("dgx-h100"), TrainingSpec(4, 1024), tp=2, pp=1,
                dp=1).mesh.cp == 4
    with pytest.raises(InvalidConfig, match=r"x cp 1 does not fit world size 8 \(cp is 1 "
                                            "here: the runtime does not run context"):
        autoparallel(make, **fixed)().plan
    given = autoparallel(make, **fixed, cp=4)()
    assert given.plan.mesh.cp == 4
    with pytest.raises(NotImplementedError, match="cp 4"):
        given.build()
