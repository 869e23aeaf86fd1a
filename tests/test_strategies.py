"""Candidate placements (autoplan.strategies) against DTensor's own rules.

The runtime contract: a node run under DTensor with its i-th tensor argument at
`Candidate.inputs[i]` needs no implicit redistribution and produces `Candidate.outputs`.
"""

from __future__ import annotations

import operator
import time

import pytest
import torch

from _helpers import check_candidate
from autoplan import _torch_compat as tc
from autoplan.capture import capture, capture_preset
from autoplan.plan import parse_placement
from autoplan.strategies import (
    StrategyCache, batch_dims, constant_like_nodes, ignored_nodes, node_strategies,
    node_tensor_meta, tensor_args,
)

aten = torch.ops.aten


@pytest.fixture(scope="module")
def llama():
    # 8 query heads, 2 KV heads of width 4 (case C3), 2 identical layers
    return capture_preset("llama-tiny", batch=2, seq_len=16)


@pytest.fixture(scope="module")
def gpt2():
    return capture_preset("gpt2-tiny", batch=2, seq_len=16)


def _nodes(graph):
    return {n.name: n for n in graph.gm.graph.nodes}


def _node_of(graph, target):
    return next(n for n in graph.gm.graph.nodes if n.target is target)


# --- structure -------------------------------------------------------------------------------

def test_tensor_args_order_is_fx_flatten_order(llama):
    cat = next(n for n in llama.gm.graph.nodes
               if n.target is aten.cat.default and isinstance(n.args[0][0], torch.fx.Node)
               and n.args[0][0].target is aten.neg.default)
    assert [a.name for a in tensor_args(cat)] == [a.name for a in cat.args[0]]
    index = _node_of(llama, aten.index.Tensor)
    flat = [index.args[0]] + [a for a in index.args[1] if a is not None]
    assert tensor_args(index) == flat


def test_every_node_kind_has_candidates_all_r_first(llama):
    cands = node_strategies(llama, 2)
    consts = constant_like_nodes(llama)
    for node in llama.gm.graph.nodes:
        if node.op == "output":
            continue
        assert node.name in cands, node.name
        first = cands[node.name][0]
        assert all(p == "R" for p in first.inputs + first.outputs)
        assert len(first.inputs) == len(tensor_args(node))
        if node.op == "placeholder" or node.name in consts:
            assert cands[node.name] == [first]
        if node.op == "get_attr":
            assert all(c.outputs[0] != "P" for c in cands[node.name])


def test_constant_like_nodes_are_position_and_mask_only(llama):
    consts = constant_like_nodes(llama)
    nodes = _nodes(llama)
    assert "model_rotary_emb_inv_freq" in consts  # a buffer
    assert any(nodes[n].target is aten.arange.default for n in consts)
    assert "embedding" not in consts and "input_ids" not in consts
    assert not any(nodes[n].op == "get_attr" and "proj" in str(nodes[n].target) for n in consts)


def test_tp1_is_all_replicated(gpt2):
    for cands in node_strategies(gpt2, 1).values():
        assert len(cands) == 1 and cands[0].shard_factor == 1.0


def test_shard_factor_and_dims_that_divide(llama):
    """C10: never shard a dim smaller than the mesh axis or one it does not divide; never
    the batch dim (the dp axis's job)."""
    bdims = batch_dims(llama)
    for tp in (2, 4):
        cands = node_strategies(llama, tp)
        nodes = _nodes(llama)
        for name, lst in cands.items():
            metas = node_tensor_meta(llama, nodes[name])
            for c in lst:
                split = any(p.startswith("S(") for p in c.inputs + c.outputs)
                assert c.shard_factor == (tp if split else 1)
                for i, p in enumerate(c.outputs):
                    if p.startswith("S("):
                        d = parse_placement(p).dim
                        size = metas[i][0][d]
                        assert size >= tp and size % tp == 0, (name, c)
                        assert d != bdims[name][i], (name, c)


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_the_batch_dim_is_found_through_attention_to_the_logits(name):
    """Every value computed from the token ids with the batch (6 samples) as its leading dim
    carries the batch there, past each attention (whose causal mask is Replicate: DTensor
    slices it, which keeps the batch split) and residual add, to the logits; and no tp
    candidate ever splits it. Before, the batch was lost at the first attention and the tp
    axis was offered Shard(0) on the rest of the model: at microbatch 1, one rank held the
    whole tensor, priced as a tp-th (GPT 1T's dry run: activations 4.5x the plan)."""
    graph = capture_preset(name, batch=6, seq_len=16)
    bdims, nodes = batch_dims(graph), list(graph.gm.graph.nodes)
    ids = next(n for n in nodes if n.op == "placeholder")
    fed = {ids.name}
    for n in nodes:
        if n.op == "call_function" and any(a.name in fed for a in tensor_args(n)):
            fed.add(n.name)
    batched = [n for n in nodes if n.name in fed and n.name != ids.name
               and isinstance(n.meta.get("val"), torch.Tensor)
               and n.meta["val"].dim() >= 2 and n.meta["val"].shape[0] == 6]
    assert len(batched) > 40
    assert any(n.target is aten.scaled_dot_product_attention.default for n in batched)
    lost = [n.name for n in batched if bdims[n.name][0] != 0]
    assert not lost, lost
    for lst_name, lst in node_strategies(graph, 2).items():
        if lst_name in {n.name for n in batched}:
            assert all(c.outputs[0] != "S(0)" for c in lst), (lst_name, lst)


def test_c10_batch_of_two_on_a_four_way_axis_is_never_split():
    """Activations (2, 6, 32) on a 4-way axis: the batch dim (2) and the rows (6) are never
    split; only dims of at least 4 that 4 divides are."""
    with torch.device("meta"):
        mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
                                  torch.nn.Linear(32, 8))
    graph = capture(mlp, (torch.zeros(2, 6, 8),), layer_prefix="")
    nodes = _nodes(graph)
    for name, lst in node_strategies(graph, 4).items():
        metas = node_tensor_meta(graph, nodes[name])
        for c in lst:
            for i, p in enumerate(c.outputs):
                if p.startswith("S("):
                    d = parse_placement(p).dim
                    size = metas[i][0][d]
                    assert size >= 4 and size % 4 == 0, (name, c)
                    if nodes[name].op != "get_attr":
                        assert d == len(metas[i][0]) - 1, (name, c)  # never batch or rows


def test_getitem_passes_the_element_placement_through():
    ln = torch.nn.LayerNorm(16)
    with torch.device("meta"):
        ln = ln.to("meta")
    graph = capture(torch.nn.Sequential(ln), (torch.zeros(2, 8, 16),), layer_prefix="")
    cands = node_strategies(graph, 2)
    for node in graph.gm.graph.nodes:
        if node.target is operator.getitem:
            producer = cands[node.args[0].name]
            seen = {c.outputs[node.args[1]] for c in producer}
            assert {c.outputs[0] for c in cands[node.name]} == seen
            assert all(c.inputs == c.outputs for c in cands[node.name])


def test_ignored_nodes_have_no_candidates(llama):
    assert not ignored_nodes(llama) & set(node_strategies(llama, 2))


# --- C3: GQA --------------------------------------------------------------------------------

def _kv_nodes(graph):
    return [n for n, info in graph.nodes.items()
            if info.module_path.endswith(("k_proj", "v_proj"))]


def test_c3_kv_heads_never_split_below_one_head_per_rank(llama):
    """2 KV heads of width 4 (k_proj out dim 8): at tp=4 a split of that dim would leave half a
    head per rank; the planner offers no such split (the view into heads refuses it)."""
    cands4 = node_strategies(llama, 4)
    nodes = _nodes(llama)
    for name in _kv_nodes(llama):
        assert all(c.outputs[0] != "S(2)" for c in cands4[name]), cands4[name]
        weight = tensor_args(nodes[name])[1]
        assert all(c.outputs[0] != "S(0)" for c in cands4[weight.name]), weight.name
    # at tp=2 each rank gets exactly one KV head: allowed
    cands2 = node_strategies(llama, 2)
    assert any(c.outputs[0] == "S(2)" for c in cands2[_kv_nodes(llama)[0]])


def test_sdpa_rule_splits_heads_only_when_both_head_counts_divide(llama):
    sdpa = _node_of(llama, aten.scaled_dot_product_attention.default)
    for tp, heads in ((2, True), (4, True), (8, True), (16, False)):
        cands = node_strategies(llama, tp)[sdpa.name] if tp <= 8 else None
        if cands is None:
            continue
        assert any(c.outputs == ("S(1)",) for c in cands) == heads
        for c in cands:
            assert c.inputs[:3] == (c.outputs[0],) * 3
            assert c.inputs[3] == "R"  # the (B, 1, S, S) mask broadcasts over heads


# --- DTensor is the judge ----------------------------------------------------------------------

@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_every_candidate_runs_under_dtensor_as_planned(name, tp, request, fake_world):
    graph = request.getfixturevalue(name)
    from torch.distributed.tensor import DeviceMesh
    mesh = DeviceMesh("cpu", torch.arange(tp))
    consts = constant_like_nodes(graph)
    cands = node_strategies(graph, tp)
    checked = set()
    for node in graph.gm.graph.nodes:
        if node.op != "call_function" or node.name in consts or node.target is operator.getitem:
            continue
        for cand in cands[node.name]:
            key = (str(node.target), repr(node.args), cand)
            if key not in checked:
                checked.add(key)
                check_candidate(graph, node, cand, tp, mesh)


def test_propagate_agrees_for_direct_rule_ops(llama):
    """The brief's form of the contract: DTensor's propagator (no process group) keeps every
    candidate's inputs and gives its outputs."""
    from autoplan.strategies import _propagate_node
    mesh = tc.tp_mesh(4)
    consts = constant_like_nodes(llama)
    cands = node_strategies(llama, 4)
    for node in llama.gm.graph.nodes:
        if (node.op != "call_function" or node.name in consts or node.target is operator.getitem
                or not tc.has_direct_rule(node.target)):
            continue
        for cand in cands[node.name]:
            prop = _propagate_node(llama, node, [parse_placement(p) for p in cand.inputs], mesh)
            assert not prop.moves_inputs, (node.name, cand)
            assert tuple(tc_format_p(p) for p in prop.outputs) == cand.outputs


def tc_format_p(p) -> str:
    from autoplan.plan import format_placement
    return format_placement(p) if p is not None else "R"


# --- speed and the divisor shortcut --------------------------------------------------------------

def test_divisor_tp_gives_the_same_candidates_as_probing(llama, gpt2):
    for graph in (llama, gpt2):
        direct = node_strategies(graph, 4, cache=StrategyCache())
        derived = node_strategies(graph, 4, cache=StrategyCache(), base_tp=2)
        assert {k: set(v) for k, v in direct.items()} == {k: set(v) for k, v in derived.items()}


def test_a_divisor_tp_probes_nothing_its_base_tp_probed(llama, monkeypatch):
    """With the base tp's candidates in the cache, a multiple of it verifies them instead of
    probing DTensor again: no op probed at tp 2 is probed at tp 4 (a key whose tp was not
    last once made every tp > 2 probe anew, 3x the work of planning llama3-405b)."""
    from autoplan.strategies import probe

    cache = StrategyCache()
    node_strategies(llama, 2, cache=cache)
    probed = []
    real = probe._Context._probe
    monkeypatch.setattr(probe._Context, "_probe",
                        lambda self, node: probed.append(node.name) or real(self, node))
    node_strategies(llama, 4, cache=cache, base_tp=2)
    assert probed == []


def test_identical_layers_cost_nothing_and_warm_planning_is_fast():
    graph = capture_preset("llama3-8b", batch=1, seq_len=128, num_layers=2)
    cache = StrategyCache()
    node_strategies(graph, 2, cache=cache)  # warm-up (first DTensor use, fake tensors)
    t0 = time.perf_counter()
    results = {tp: node_strategies(graph, tp, cache=cache, base_tp=2 if tp > 2 else None)
               for tp in (1, 2, 4, 8)}
    # a regression guard, not the bar (bench/ measures that): ~0.3 s on an idle 2-core CPU
    assert time.perf_counter() - t0 < 6.0
    for tp in (2, 4, 8):
        layer0, layer1 = graph.layer_nodes[0], graph.layer_nodes[1]
        assert all(results[tp][a] == results[tp][b] for a, b in zip(layer0, layer1))


def test_strided_shard_sizes_by_formula_equal_dtensors():
    """The closed form the planner's sharding propagation uses for `_StridedShard` local sizes
    and first offsets (autoplan/_torch_compat/sharding_rules.py) equals what DTensor computes
    by splitting an arange, on even and uneven sizes, including empty shards."""
    from torch.distributed.tensor.placement_types import _StridedShard

    from autoplan import _torch_compat as compat

    original = _StridedShard.__dict__["local_shard_size_and_offset"]
    for size in (1, 3, 7, 8, 12, 30, 64, 97):
        for split_factor in (1, 2, 3, 4):
            placement = _StridedShard(0, split_factor=split_factor)
            for num_chunks in (1, 2, 3, 4, 8):
                for rank in range(num_chunks):
                    want = original(placement, size, num_chunks, rank)
                    got = compat.strided_shard_size_and_offset(size, split_factor, num_chunks,
                                                               rank)
                    assert got == tuple(want), (size, split_factor, num_chunks, rank)
                    with compat._strided_shard_sizes_by_formula():
                        assert placement.local_shard_size_and_offset(
                            size, num_chunks, rank) == tuple(want)
    assert _StridedShard.__dict__["local_shard_size_and_offset"] is original  # restored
