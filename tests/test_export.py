"""Export: per-rank local graphs with every inserted collective explicit."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from autoplan.capture import capture_preset
from autoplan.passes.export import count_collectives, export_plan
from autoplan.solver import plan as solve
from autoplan.spec import TrainingSpec
from autoplan.topology import preset

COMM = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    graph = capture_preset("llama-tiny", batch=2, seq_len=16)
    topo = preset("local-cpu", devices_per_node=4)
    spec, fixed = TrainingSpec(4, 16), dict(tp=2, pp=2, num_microbatches=2)
    # A tiny model is latency-bound: with ample memory the planner replicates everything.
    # Give it 70% of that plan's memory, so that it has to split weights on the tp axis.
    ample = solve(graph, topo, spec, **fixed).prediction.memory_bytes
    device = dataclasses.replace(topo.device, mem_bytes=0.7 * ample / spec.max_memory_fraction)
    plan = solve(graph, dataclasses.replace(topo, device=device), spec, **fixed)
    out = tmp_path_factory.mktemp("export")
    files = export_plan(graph, plan, out)
    return plan, out, files


def test_files_per_rank_and_stage(exported):
    plan, out, files = exported
    assert json.loads((out / "plan.json").read_text())["mesh"] == {"pp": 2, "dp": 1, "tp": 2}
    for rank, stage in [(0, 0), (1, 0), (2, 1), (3, 1)]:
        for ext in ("py", "dot", "json"):
            assert f"rank{rank}_stage{stage}.{ext}" in files
        code = (out / f"rank{rank}_stage{stage}.py").read_text()
        assert code.startswith("# autoplan export")
        assert "def forward(" in code
    assert not list(out.glob(".*")), "temporary files left behind"


def test_export_over_an_earlier_one_leaves_only_this_plan(tmp_path):
    """A pp1 x tp1 export into a directory holding a 4-rank one: the 4-rank graphs go, the
    user's own files stay; a failing export creates no directory."""
    graph = capture_preset("llama-tiny", batch=2, seq_len=16)
    spec = TrainingSpec(4, 16)
    out = tmp_path / "graphs"
    export_plan(graph, solve(graph, preset("local-cpu", devices_per_node=4), spec, tp=2, pp=2,
                             num_microbatches=2), out)
    (out / "notes.txt").write_text("mine")
    files = export_plan(graph, solve(graph, preset("local-cpu", devices_per_node=1), spec), out)
    assert sorted(p.name for p in out.iterdir()) == sorted([*files, "notes.txt"])
    assert sorted(files) == ["plan.json", "rank0_stage0.dot", "rank0_stage0.json",
                             "rank0_stage0.py"]
    shallow = capture_preset("llama-tiny", batch=2, seq_len=16, num_layers=1)
    plan = solve(shallow, preset("local-cpu", devices_per_node=1), spec)
    with pytest.raises(ValueError, match="export needs the full model"):
        export_plan(shallow, plan, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_collectives_in_graphs_are_the_plans(exported):
    """Every redistribution the plan costs with a collective appears once in the traced local
    graph of its stage, and no other collective does (DTensor added nothing implicit)."""
    plan, out, _ = exported
    layer_stage = {}
    for s in plan.stages:
        for k in range(s.layer_start, s.layer_end):
            layer_stage[k] = s.index
    for stage in (0, 1):
        rows = json.loads((out / f"rank{2 * stage}_stage{stage}.json").read_text())
        traced = sum(1 for r in rows if r["collective"] and "wait_tensor" not in r["target"])
        names = {r["name"] for r in rows}
        del names
        planned = [r for r in plan.redistributions
                   if r.collective in COMM and _stage_of(plan, r.consumer) == stage]
        assert traced == len(planned), (stage, traced, [(r.producer, r.consumer, r.collective)
                                                        for r in planned])
    assert any(r.collective in COMM for r in plan.redistributions), "plan has no tp collective"


def _stage_of(plan, node_name):
    graph = _GRAPH[0]
    layer = next((k for k, names in graph.layer_nodes.items() if node_name in names), None)
    if layer is None:
        return 0 if node_name in _PRE[0] else len(plan.stages) - 1
    return next(s.index for s in plan.stages if s.layer_start <= layer < s.layer_end)


_GRAPH, _PRE = [None], [set()]


@pytest.fixture(autouse=True, scope="module")
def _graph_facts():
    from autoplan.passes.pipeline import assign_stages
    from autoplan.plan import Stage

    graph = capture_preset("llama-tiny", batch=2, seq_len=16)
    _GRAPH[0] = graph
    stages, _ = assign_stages(graph.gm, graph, (Stage(0, 0, 1), Stage(1, 1, 2)))
    _PRE[0] = {n for n, s in stages.items() if s == 0}


def test_count_collectives_reads_functional_collectives():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        return torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(x, "sum", "0"))

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        gm = make_fx(f, tracing_mode="fake")(torch.randn(4))
    finally:
        dist.destroy_process_group()
    assert count_collectives(gm) == {"all_reduce": 1}
