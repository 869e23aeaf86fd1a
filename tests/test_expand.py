"""A plan made on a shallow capture (a few blocks scaled to the real depth) carries over to the
graphs the runtime and export run: every block captured, at the microbatch size
([Note: plan retargeting] in autoplan/passes/expand.py)."""

from __future__ import annotations

import pytest
import torch

from autoplan.capture import capture
from autoplan.capture.planning import capture_for_planning
from autoplan.models import build_model
from autoplan.passes.expand import plan_for_graph
from autoplan.solver import plan
from autoplan.spec import TrainingSpec
from autoplan.topology import preset


def test_a_shallow_plan_restated_for_the_full_graph_is_the_full_graphs_plan():
    """llama-tiny (width 64) of 6 layers at tp 2: the plan made on 2 captured blocks, restated
    for the full capture, has the strategies and redistributions of the plan made on the full
    capture -- node for node, in the full graph's names; and at the microbatch size (batch 1:
    HF's mask path has one op fewer) every op of every block still has its strategy."""
    model = build_model("llama-tiny", device="meta", num_hidden_layers=6, hidden_size=64,
                        intermediate_size=128)
    inputs = (torch.zeros(8, 16, dtype=torch.long),)
    shallow = capture_for_planning(model, inputs, model_name="m")
    full = capture(model, inputs, model_name="m")
    assert shallow.num_layers < full.num_layers == 6
    topo = preset("local-cpu", num_nodes=1, devices_per_node=4)
    spec = TrainingSpec(global_batch=8, seq_len=16)
    fixed = dict(tp=2, dp=2, pp=1, zero_stage=0, num_microbatches=1, checkpointing="none")
    by_shallow, by_full = plan(shallow, topo, spec, **fixed), plan(full, topo, spec, **fixed)
    assert any(p != "R" for _, p in by_full.param_placements)  # something is split
    restated = plan_for_graph(by_shallow, shallow, full)
    assert restated.strategies == by_full.strategies
    key = lambda r: (r.producer, r.consumer, r.arg_index, r.src, r.dst)  # noqa: E731
    assert sorted(map(key, restated.redistributions)) == \
        sorted(map(key, by_full.redistributions))
    assert restated.param_placements == by_full.param_placements
    for batch in (4, 1):
        runtime = capture(model, (torch.zeros(batch, 16, dtype=torch.long),), model_name="m")
        named = {s.node for s in plan_for_graph(by_shallow, shallow, runtime).strategies}
        assert all(n in named for names in runtime.layer_nodes.values() for n in names)
    # restated twice, the names would be mapped onto other nodes (AutoParallel.dry_run did
    # so: the head of a 4-layer model ran row-parallel against a column-parallel plan)
    with pytest.raises(ValueError, match="retargeted already"):
        plan_for_graph(restated, shallow, full)


def test_a_plan_for_another_model_is_refused():
    small = build_model("llama-tiny", device="meta", num_hidden_layers=2)
    deep = build_model("llama-tiny", device="meta", num_hidden_layers=4)
    inputs = (torch.zeros(4, 16, dtype=torch.long),)
    a, b = capture(small, inputs), capture(deep, inputs)
    p = plan(a, preset("local-cpu", num_nodes=1, devices_per_node=2),
             TrainingSpec(global_batch=4, seq_len=16), tp=2)
    with pytest.raises(ValueError, match="not the same model"):
        plan_for_graph(p, a, b)
