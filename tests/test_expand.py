"""A plan made on a shallow capture (a few blocks scaled to the real depth) carries over to the
full graph the runtime runs (autoplan/passes/expand.py)."""

from __future__ import annotations

import pytest

from autoplan.capture import capture
from autoplan.capture.planning import capture_for_planning
from autoplan.passes.expand import expand_plan, node_map
from autoplan.solver import plan as solve
from autoplan.spec import TrainingSpec
from autoplan.topology import preset


@pytest.fixture(scope="module")
def graphs():
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=6, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    inputs = (torch.zeros(4, 16, dtype=torch.long, device="meta"),)
    return capture_for_planning(model, inputs), capture(model, inputs)


def test_every_node_of_the_full_graph_gets_the_strategy_of_its_planned_counterpart(graphs):
    shallow, full = graphs
    assert shallow.num_layers < full.num_layers == shallow.total_layers == 6
    plan = solve(shallow, preset("local-cpu", num_nodes=1, devices_per_node=2),
                 TrainingSpec(4, 16), tp=2)
    wide = expand_plan(plan, shallow, full)
    planned = {s.node: s for s in plan.strategies}
    expanded = {s.node: s for s in wide.strategies}
    mapping = node_map(shallow, full)
    ops = [n.name for n in full.gm.graph.nodes if n.op == "call_function"]
    assert set(ops) <= set(expanded)
    for name in ops:
        want = planned[mapping[name]]
        assert (expanded[name].inputs, expanded[name].outputs) == (want.inputs, want.outputs)
    # the last block's ops run as the last captured block
    last = full.layer_nodes[5]
    assert [mapping[n] for n in last] == list(shallow.layer_nodes[shallow.num_layers - 1])
    # each planned redistribution inside a block reappears once per real block
    inside = {n for names in shallow.layer_nodes.values() for n in names}
    per_block = [r for r in plan.redistributions if r.consumer in shallow.layer_nodes[
        shallow.num_layers - 1]]
    full_last = [r for r in wide.redistributions if r.consumer in set(last)]
    assert len(full_last) == len(per_block)
    assert all(r.consumer not in inside or r.consumer in expanded for r in wide.redistributions)


def test_a_plan_of_the_full_graph_is_left_as_it_is(graphs):
    _, full = graphs
    plan = solve(full, preset("local-cpu", num_nodes=1, devices_per_node=2),
                 TrainingSpec(4, 16), tp=2)
    assert expand_plan(plan, full, full) is plan
