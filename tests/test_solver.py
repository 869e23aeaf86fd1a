"""The solver: golden plans, errors, the Plan contract, optimality against exhaustive search."""

from __future__ import annotations

import dataclasses
import itertools
import operator
import re

import pytest
import torch

from _helpers import check_candidate
from autoplan import _torch_compat as tc
from autoplan.capture import capture, capture_preset
from autoplan.models.mlp import MLP, WideMLP
from autoplan.plan import Plan, format_placement, parse_placement
from autoplan.solver import (InvalidConfig, NoFeasiblePlan, SolverLimitReached,
                             SolverLimitWarning, plan)
from autoplan.solver.costs import build_costs
from autoplan.solver.ilp import evaluate, solve
from autoplan.solver.problem import build_problem
from autoplan.solver.search import Search
from autoplan.solver.configurations import PlanConfig
from autoplan.spec import TrainingSpec
from autoplan.strategies import constant_like_nodes, tensor_args
from autoplan.topology import preset

aten = torch.ops.aten


@pytest.fixture(scope="module")
def llama():
    return capture_preset("llama-tiny", batch=1, seq_len=16)


@pytest.fixture(scope="module")
def gpt2():
    return capture_preset("gpt2-tiny", batch=1, seq_len=16)


@pytest.fixture(scope="module")
def local4():
    return preset("local-cpu", devices_per_node=4)


def _small_device(topo, mem_bytes):
    return dataclasses.replace(topo, device=dataclasses.replace(topo.device, mem_bytes=mem_bytes))


@pytest.fixture(scope="module")
def tp_plan(llama, gpt2, local4):
    """plan(graph, local4, global batch 8 x seq 16, tp=tp) for graph "llama" or "gpt2", each
    solved once for the tests that read it (a Plan is frozen; the solver is deterministic)."""
    graphs, plans = {"llama": llama, "gpt2": gpt2}, {}

    def get(name: str, tp: int) -> Plan:
        if (name, tp) not in plans:
            plans[name, tp] = plan(graphs[name], local4, TrainingSpec(global_batch=8,
                                                                      seq_len=16), tp=tp)
        return plans[name, tp]
    return get


@pytest.fixture(scope="module")
def memory_bound(llama, local4):
    """(topology, spec, plan) for llama-tiny on 4 ranks of 300 kB, where memory binds the
    placements (CP-SAT solves): the plan solved once for the tests that compare with it."""
    topo = _small_device(local4, 3e5)
    spec = TrainingSpec(global_batch=8, seq_len=16)
    return topo, spec, plan(llama, topo, spec)


def _wide_mlp(h=1024):
    with torch.device("meta"):
        model = WideMLP(h, 4 * h)
    return capture(model, (torch.zeros(1, 64, h),), model_name="wide-mlp")


# --- golden plans -------------------------------------------------------------------------------

def test_ample_memory_gives_pure_data_parallel(gpt2, local4):
    p = plan(gpt2, local4, TrainingSpec(global_batch=8, seq_len=16))
    assert (p.mesh.pp, p.mesh.dp, p.mesh.tp) == (1, 4, 1)
    assert all(pl == "R" for _, pl in p.param_placements)
    assert p.redistributions == ()
    assert p.alternatives and all(a.reason for a in p.alternatives)


@pytest.mark.parametrize("pp", [1, 2])
def test_a_tied_embedding_is_one_tensor_per_rank_that_holds_it(gpt2, pp):
    """GPT-2's wte is also its head: one tensor on a rank running both (pp 1), one on each of
    the first and the last stage's rank (pp 2) -- priced so, not once per use."""
    topo = preset("local-cpu", devices_per_node=pp)
    p = plan(gpt2, topo, TrainingSpec(global_batch=8, seq_len=16, dtype="float32"),
             pp=pp, tp=1, dp=1, zero_stage=0)
    assert gpt2.params["transformer.wte.weight"].aliases == ("lm_head.weight",)

    def numel(prefixes):
        return sum(i.numel for f, i in gpt2.params.items() if f.startswith(prefixes))

    blocks = {s.index: tuple(f"transformer.h.{i}." for i in range(s.layer_start, s.layer_end))
              for s in p.stages}
    held = {0: numel(("transformer.wte.", "transformer.wpe.") + blocks[0])}
    held[pp - 1] = held.get(pp - 1, 0) + numel(blocks[pp - 1] if pp > 1 else ()) + numel(
        ("transformer.ln_f.",) + (("transformer.wte.",) if pp > 1 else ()))
    assert (held[0] if pp == 1 else None) in (gpt2.num_params, None)
    params_bytes = p.prediction.memory_breakdown["params"]  # fp32, the worst rank
    assert params_bytes == pytest.approx(4 * max(held.values()))


def test_wide_mlp_that_does_not_fit_one_device_is_megatron_split():
    """Global batch 1 (dp cannot help), 2 devices, weights too big for one: tp=2 with the
    first Linear split by columns (weight S(0)), the second by rows (weight S(1)), and one
    all-reduce in the forward (Shoeybi et al. 2019, section 3)."""
    graph = _wide_mlp()
    topo = _small_device(preset("local-cpu", devices_per_node=2), 120e6)
    p = plan(graph, topo, TrainingSpec(global_batch=1, seq_len=64))
    assert (p.mesh.pp, p.mesh.dp, p.mesh.tp) == (1, 1, 2)
    placements = dict(p.param_placements)
    assert placements["fc1.weight"] == "S(0)" and placements["fc2.weight"] == "S(1)"
    assert [r.collective for r in p.redistributions].count("all_reduce") == 1
    moving = [r for r in p.redistributions if r.collective not in ("none", "slice")]
    assert len(moving) == 1 and moving[0].src == "P" and moving[0].dst == "R"
    assert p.prediction.memory_bytes <= 0.9 * 120e6


def test_memory_binds_the_placement_even_when_replication_is_faster():
    """With a very slow interconnect the time-optimal tp=2 placement replicates the weights;
    it does not fit, so the memory-constrained ILP splits them."""
    graph = _wide_mlp()
    topo = _small_device(preset("local-cpu", devices_per_node=2), 120e6)
    slow = dataclasses.replace(topo.intra_node, bw_bytes_per_s=1e3)
    topo = dataclasses.replace(topo, intra_node=slow)
    p = plan(graph, topo, TrainingSpec(global_batch=1, seq_len=64), tp=2)
    assert p.prediction.memory_bytes <= 0.9 * 120e6
    assert sum(pl != "R" for _, pl in p.param_placements) >= 2


def test_plan_json_round_trip(tp_plan):
    p = tp_plan("llama", 2)
    assert Plan.from_json(p.to_json()) == p
    assert p.strategies and p.param_placements and p.alternatives


# --- the Plan is complete and consistent ----------------------------------------------------------

def _check_plan_consistent(graph, p: Plan):
    """Every call_function node has a strategy; every parameter a placement; every edge whose
    placements differ is a listed redistribution; the output is replicated."""
    strat = {s.node: s for s in p.strategies}
    consts = constant_like_nodes(graph)
    listed = {(r.producer, r.consumer, r.arg_index): r for r in p.redistributions}
    placements = dict(p.param_placements)
    for fqn, info in graph.params.items():
        assert fqn in placements and all(a in placements for a in info.aliases)
    out_of = {}
    for node in graph.gm.graph.nodes:
        if node.op == "get_attr":
            out_of[node.name] = (placements.get(str(node.target), "R"),)
        elif node.op == "placeholder":
            out_of[node.name] = ("R",)
        elif node.op == "call_function":
            assert node.name in strat, node.name
            out_of[node.name] = strat[node.name].outputs
    for node in graph.gm.graph.nodes:
        if node.op == "output":
            wanted, consumer = ["R"] * len(tensor_args(node)), "output"
        elif node.op == "call_function":
            wanted, consumer = strat[node.name].inputs, node.name
            if node.name in consts:
                assert all(x == "R" for x in wanted + strat[node.name].outputs)
        else:
            continue
        for j, (u, dst) in enumerate(zip(tensor_args(node), wanted)):
            k = node.args[1] if node.target is operator.getitem else 0
            src = out_of[u.name][k]
            if src != dst:
                r = listed[(u.name, consumer, j)]
                assert (r.src, r.dst) == (src, dst)
            else:
                assert (u.name, consumer, j) not in listed


@pytest.mark.parametrize("tp", [2, 4])
def test_plan_is_consistent(llama, gpt2, tp_plan, tp):
    for name, graph in (("llama", llama), ("gpt2", gpt2)):
        _check_plan_consistent(graph, tp_plan(name, tp))


# --- the runtime contract: DTensor runs every chosen strategy as planned --------------------------

@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_chosen_strategies_run_under_dtensor(name, tp, request, tp_plan, fake_world):
    """Propagation (no process group) keeps every chosen strategy's inputs and gives its
    outputs; and a real DTensor dispatch (fake process group, strict: no implicit
    redistribution allowed) produces the planned outputs."""
    from torch.distributed.tensor import DeviceMesh
    from autoplan.strategies import Candidate, _propagate_node
    graph = request.getfixturevalue(name)
    p = tp_plan(name, tp)
    mesh, pmesh = DeviceMesh("cpu", torch.arange(tp)), tc.tp_mesh(tp)
    consts = constant_like_nodes(graph)
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    for s in p.strategies:
        node = nodes[s.node]
        if node.name in consts or node.target is operator.getitem:
            continue
        if node.target is not aten.scaled_dot_product_attention.default:  # explicit rule
            prop = _propagate_node(graph, node, [parse_placement(x) for x in s.inputs], pmesh)
            assert not prop.moves_inputs, s
            assert tuple(format_placement(x) if x is not None else "R"
                         for x in prop.outputs) == s.outputs, s
        check_candidate(graph, node, Candidate(s.inputs, s.outputs, 1.0), tp, mesh)


# --- C3 -----------------------------------------------------------------------------------------

def test_c3_gqa_at_tp4_replicates_kv_heads(llama, tp_plan):
    """8 query heads, 2 KV heads: tp=4 is accepted; no strategy splits the KV projection's
    output (2 heads x 4) or its weight rows below one head per rank; the plan is valid."""
    p = tp_plan("llama", 4)
    assert p.mesh.tp == 4
    strat = {s.node: s for s in p.strategies}
    kv = [n for n, info in llama.nodes.items() if info.module_path.endswith(("k_proj", "v_proj"))]
    assert kv
    for name in kv:
        assert strat[name].outputs[0] != "S(2)"
    placements = dict(p.param_placements)
    for fqn, pl in placements.items():
        if fqn.endswith(("k_proj.weight", "v_proj.weight")):
            assert pl != "S(0)", fqn
    _check_plan_consistent(llama, p)


# --- errors -------------------------------------------------------------------------------------

def test_no_plan_fits_names_the_smallest_memory_and_the_device(llama, local4):
    tiny = _small_device(local4, 2e4)
    with pytest.raises(NoFeasiblePlan) as err:
        plan(llama, tiny, TrainingSpec(global_batch=8, seq_len=16))
    text = str(err.value)
    needed = re.search(r"smallest per-device memory any plan needs is ([0-9.]+) (k|M|G)B \(pp",
                       text)
    assert needed, text
    assert float(needed.group(1)) * {"k": 1e3, "M": 1e6, "G": 1e9}[needed.group(2)] > 0.9 * 2e4
    assert "cpu-rank has 20 kB" in text
    assert isinstance(err.value, ValueError)


def test_c10_a_plan_just_over_budget_is_rejected(llama, local4):
    """Everything fixed (no placement freedom at tp=1): the predicted peak -- parameters,
    gradients, optimizer states, activations x in-flight microbatches, temporaries -- decides."""
    fixed = dict(tp=1, pp=2, dp=2, zero_stage=1, num_microbatches=2, schedule="gpipe",
                 checkpointing="none")
    spec = TrainingSpec(global_batch=8, seq_len=16)
    peak = plan(llama, local4, spec, **fixed).prediction
    assert {"params", "grads", "optimizer", "activations", "temporaries"} <= set(
        peak.memory_breakdown)
    fits = _small_device(local4, peak.memory_bytes / 0.9 * 1.001)
    assert plan(llama, fits, spec, **fixed).prediction.memory_bytes == peak.memory_bytes
    with pytest.raises(NoFeasiblePlan):
        plan(llama, _small_device(local4, peak.memory_bytes / 0.9 * 0.999), spec, **fixed)


def test_batch_not_divisible_names_the_numbers(llama, local4):
    with pytest.raises(InvalidConfig, match="global_batch 8 is not divisible by dp 4 x "
                                            "num_microbatches 3"):
        plan(llama, local4, TrainingSpec(global_batch=8, seq_len=16), dp=4, num_microbatches=3)


def test_c8_pp3_batch8_three_microbatches_is_rejected_at_plan_time():
    with torch.device("meta"):
        model = MLP(16, 32, num_blocks=3)
    graph = capture(model, (torch.zeros(1, 4, 16),), model_name="mlp3")
    topo = preset("local-cpu", devices_per_node=3)
    with pytest.raises(InvalidConfig, match="global_batch 8 is not divisible by dp 1 x "
                                            "num_microbatches 3"):
        plan(graph, topo, TrainingSpec(global_batch=8, seq_len=4), pp=3, num_microbatches=3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tp=3), "tp 3 does not divide the world size 4"),
    (dict(pp=4), "pp 4 is more than the model's 2 layers"),
    (dict(zero_stage=5), "zero_stage 5"),
    (dict(schedule="zigzag"), "schedule 'zigzag'"),
])
def test_invalid_overrides(llama, local4, kwargs, match):
    with pytest.raises(InvalidConfig, match=match):
        plan(llama, local4, TrainingSpec(global_batch=8, seq_len=16), **kwargs)


# --- pipeline stages (C4), shared blocks (C11) -------------------------------------------------

def _mlp(num_blocks):
    with torch.device("meta"):
        model = MLP(16, 64, num_blocks=num_blocks)
    return capture(model, (torch.zeros(1, 8, 16),), model_name=f"mlp{num_blocks}")


@pytest.mark.parametrize("pp, v, schedule", [(2, 1, "1f1b"), (3, 2, "interleaved-1f1b")])
def test_c4_stages_cover_every_layer_once(pp, v, schedule):
    graph = _mlp(7)
    topo = preset("local-cpu", devices_per_node=pp)
    p = plan(graph, topo, TrainingSpec(global_batch=6, seq_len=8), pp=pp, schedule=schedule,
             num_virtual_stages=v, num_microbatches=3)
    assert len(p.stages) == pp * v
    layers = [k for s in p.stages for k in range(s.layer_start, s.layer_end)]
    assert layers == list(range(7))
    assert max(s.num_layers for s in p.stages) - min(s.num_layers for s in p.stages) <= 1


def test_c11_ilp_size_does_not_grow_with_depth():
    sizes = []
    for n in (2, 8, 32):
        graph = _mlp(n)
        prob = build_problem(graph, 2, 4)
        costs = build_costs(prob, 1, TrainingSpec(global_batch=1, seq_len=8),
                            preset("local-cpu", devices_per_node=2))
        sol = solve(prob, costs)
        sizes.append((len(prob.nodes), len(prob.edges), sol.num_vars, sol.num_constraints))
    assert sizes[0] == sizes[1] == sizes[2], sizes


def test_the_answer_does_not_depend_on_how_many_blocks_were_captured(local4):
    """1, 2 or 4 captured blocks of an 8-layer model: the same ILP, the same costs."""
    spec = TrainingSpec(global_batch=8, seq_len=16)
    results = []
    for n in (1, 2, 4):
        graph = capture_preset("llama-tiny", batch=1, seq_len=16, num_layers=n)
        graph.total_layers = 8
        prob = build_problem(graph, 2, spec.dtype_bytes)
        sol = solve(prob, build_costs(prob, 2, spec, local4))
        results.append((sol.num_vars, sol.compute_s, sol.comm_s, sol.param_elems, sol.act_bytes))
    assert results[0] == results[1] == results[2]


def test_shallow_capture_lists_every_layer_parameter(local4):
    graph = capture_preset("llama-tiny", batch=1, seq_len=16, num_layers=1)
    graph.total_layers = 4
    p = plan(graph, local4, TrainingSpec(global_batch=8, seq_len=16), tp=2)
    fqns = dict(p.param_placements)
    for k in range(4):
        assert f"model.layers.{k}.self_attn.q_proj.weight" in fqns
    assert fqns["model.layers.3.mlp.down_proj.weight"] == fqns["model.layers.0.mlp.down_proj.weight"]


# --- optimality ---------------------------------------------------------------------------------

def test_ilp_equals_exhaustive_search_on_a_small_problem():
    """Solver optimality bar: the ILP optimum equals brute force over the same cost model."""
    graph = _wide_mlp(256)
    topo = preset("local-cpu", devices_per_node=2)
    spec = TrainingSpec(global_batch=1, seq_len=64)
    prob = build_problem(graph, 2, spec.dtype_bytes)
    costs = build_costs(prob, 1, spec, topo)
    sol = solve(prob, costs)
    choices = [range(len(prob.cands[n])) for n in prob.nodes]
    best = None
    for combo in itertools.product(*choices):
        try:
            value = evaluate(prob, costs, dict(zip(prob.nodes, combo))).objective_s
        except KeyError:  # a pair DTensor cannot redistribute (S -> P)
            continue
        best = value if best is None else min(best, value)
    assert sol.objective_s == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_branch_and_bound_equals_exhaustive_search_over_configurations(llama, memory_bound):
    """Solve every configuration exactly (memory-constrained where needed): the best step
    time equals the plan's. The device is small enough that memory binds."""
    from autoplan.solver.search import Search
    from autoplan.solver.configurations import Overrides, enumerate_configs
    topo, spec, best_plan = memory_bound
    best = best_plan.prediction.step_time_s
    search, times = Search(llama, topo, spec, 10.0), []
    for cfg in enumerate_configs(llama, topo, spec, Overrides(), search.policies()):
        result = search.assess(cfg, search.solution(cfg))
        if not result.fits:
            constrained = search.solution(cfg, constrained=True)
            result = search.assess(cfg, constrained) if constrained is not None else result
        if result.fits:
            times.append(result.step_time_s)
    assert best == pytest.approx(min(times), rel=1e-9)


# --- limits ([Note: deterministic limits] in solver/ilp_types.py) ------------------------------

def test_a_solve_cut_short_keeps_a_feasible_start_or_raises_a_named_error(llama, local4):
    """A CP-SAT solve stopped by a tiny deterministic limit before any placement returns its
    start (optimal False) when the start satisfies the model, and raises SolverLimitReached
    when no start does; with room the same ILP is solved to optimality."""
    search = Search(llama, local4, TrainingSpec(global_batch=8, seq_len=16), 10.0)
    cfg = PlanConfig(2, 1, 2, 0, 4, 2, "1f1b", 1, checkpointing="none")
    prob, costs = search.problem(2), search.cost(2, 2)
    ilp = dict(form=search.step_form(cfg), ranks=search.ranks(cfg))
    roomy, tight = 1e12, 3e5  # bytes: every placement fits / the all-replicated one does not
    cut = solve(prob, costs, **ilp, budget_bytes=roomy, time_limit_s=1e-6)
    assert not cut.optimal  # the all-replicated start
    assert all(all(pl == "R" for pl in prob.cands[n][i].inputs + prob.cands[n][i].outputs)
               for n, i in cut.choice.items())
    with pytest.raises(SolverLimitReached, match=r"time ILP of tp 2 .* time_limit_s=1e-06"):
        solve(prob, costs, **ilp, budget_bytes=tight, time_limit_s=1e-6)
    full = solve(prob, costs, **ilp, budget_bytes=tight, time_limit_s=10.0)
    assert full.optimal and full.integer_solver
    kept = solve(prob, costs, **ilp, budget_bytes=tight, start=full.choice, time_limit_s=1e-6)
    assert not kept.optimal and kept.choice == full.choice


def test_a_plan_cut_short_skips_configurations_by_name_or_raises_a_named_error(llama,
                                                                               memory_bound):
    """With memory binding (CP-SAT solves) and a limit of 0.001 deterministic seconds, the
    configuration whose constrained ILP finds nothing in time is skipped with a
    SolverLimitWarning naming it, and the plan is the best of the others, the same on every
    run, fits, and is never faster than the uncut plan (which searched them all); when that
    configuration is the only one allowed, SolverLimitReached names it."""
    topo, spec, uncut = memory_bound
    plans = []
    for _ in range(2):
        with pytest.warns(SolverLimitWarning, match=r"skipped, no placement found within "
                          r"time_limit_s=0.001 deterministic seconds \(pp\d x dp\d x tp\d, "
                          r"ZeRO-\d, \d+ microbatch"):
            plans.append(plan(llama, topo, spec, time_limit_s=1e-3).to_json())
    assert plans[0] == plans[1]
    cut = Plan.from_json(plans[0]).prediction
    assert cut.step_time_s >= uncut.prediction.step_time_s * (1 - 1e-9)
    assert cut.memory_bytes <= spec.max_memory_fraction * topo.device.mem_bytes
    with pytest.raises(SolverLimitReached, match=r"for pp1 x dp2 x tp2, .* and \d+ more config"
                                                 r"urations .* time_limit_s=0.001"):
        plan(llama, topo, spec, tp=2, pp=1, dp=2, time_limit_s=1e-3)
    with pytest.raises(ValueError, match="time_limit_s 0 must be a positive number"):
        plan(llama, topo, spec, time_limit_s=0)
