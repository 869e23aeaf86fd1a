"""Plan reports: Markdown sections and numbers, grouping per block role, the self-contained
HTML page, the pipeline timeline illustration, and atomic writes."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import pytest

from autoplan.plan import (
    Alternative, MeshShape, Plan, Prediction, Redistribution, Stage,
)
from autoplan.report import render_html, render_markdown, render_summary, write_report
from autoplan.report import facts as F
from autoplan.report import write as write_mod
from autoplan.report.timeline import rank_orders, simulate, stage_times
from autoplan.topology import preset

SECTIONS = ("## Summary", "### Mesh axes on the topology", "## Predicted step",
            "## Memory per rank", "## Pipeline stages", "## Tensor-parallel placements",
            "## Redistributions", "## Compute and communication per part", "## Alternatives",
            "## Formulas")


@pytest.fixture(scope="module")
def llama():
    """A real plan from the solver: Llama-3-8B captured with 2 of its 32 blocks, tp 2 x pp 2
    on one DGX H100 node."""
    from autoplan.capture import capture_preset
    from autoplan.solver import plan
    from autoplan.spec import TrainingSpec

    graph = capture_preset("llama3-8b", batch=1, seq_len=256, num_layers=2)
    topology = preset("dgx-h100", num_nodes=1)
    result = plan(graph, topology, TrainingSpec(32, 256, "bfloat16"), tp=2, pp=2)
    return graph, topology, result


def _hand_made(**changes) -> Plan:
    """pp 2 x dp 1 x tp 2, interleaved 1F1B with 2 chunks per rank, no graph needed."""
    fields = dict(
        model="toy", topology="dgx-h100", mesh=MeshShape(pp=2, dp=1, tp=2), zero_stage=1,
        global_batch=8, num_microbatches=4, microbatch_size=2, seq_len=16,
        schedule="interleaved-1f1b", num_virtual_stages=2,
        stages=(Stage(0, 0, 2), Stage(1, 2, 4), Stage(2, 4, 6), Stage(3, 6, 8)),
        prediction=Prediction(step_time_s=0.010, compute_s=0.007, comm_s=0.001,
                              bubble_s=0.002, memory_bytes=3e9,
                              memory_breakdown={"params": 1e9, "grads": 1e9, "optimizer": 5e8,
                                                "activations": 4e8, "temporaries": 1e8,
                                                "peak": 3e9},
                              model_flops=1e15, tflops_per_device=25.0, mfu=0.25),
        param_placements=(("blocks.0.fc.weight", "S(0)"), ("blocks.1.fc.weight", "S(0)"),
                          ("head.weight", "R")),
        redistributions=(Redistribution("a", "b", 0, "P", "R", "all_reduce", 1000, 1e-5),),
        alternatives=(Alternative(MeshShape(1, 2, 2), 1, 4, "1f1b", 0.012, 2e9,
                                  "communication: +2 ms per step vs the chosen plan"),),
        dtype="bfloat16")
    fields.update(changes)
    return Plan(**fields)


# --- Markdown --------------------------------------------------------------------------------

def test_markdown_has_sections_and_the_plans_numbers(llama):
    graph, topology, plan = llama
    md = render_markdown(plan, graph=graph, topology=topology)
    for section in SECTIONS:
        assert section in md, section
    p = plan.prediction
    assert F.fmt_time(p.step_time_s) in md
    assert F.fmt_bytes(p.memory_bytes) in md
    assert F.fmt_pct(p.mfu) in md
    assert f"{p.tflops_per_device:.4g}" in md
    # the precision recipe the runtime runs for this dtype
    assert "bf16 forward/backward, fp32 master weights and AdamW states" in md
    assert "80 GB per H100-SXM-80GB" in md  # device memory next to the plan's
    assert "32 blocks (planned from 2 captured identical blocks)" in md
    assert f"pp {plan.mesh.pp} x dp {plan.mesh.dp} x tp {plan.mesh.tp}" in md
    assert re.search(r"\| `tp` \| 2 \| 1 \| intra-node \| 2 ranks inside one node over nvlink",
                     md)
    # params: ~8.0e9 for Llama 3 8B (model card), tied weights and buffers excluded
    assert 7.9e9 < F.model_num_params(graph) < 8.1e9
    for name in ("model_flops", f"zero_stage{plan.zero_stage}_bytes", "act_layer_tp"):
        assert f"### `{name}`" in md
    for alt in plan.alternatives:
        assert alt.reason.replace("|", "\\|") in md


def test_placements_are_grouped_per_block_role(llama):
    graph, topology, plan = llama
    md = render_markdown(plan, graph=graph, topology=topology)
    table = md[md.index("## Tensor-parallel placements"):md.index("## Redistributions")]
    assert "model.layers.0." not in table and "model.layers.1." not in table
    placement = plan.placement_of("model.layers.0.mlp.up_proj.weight")
    assert f"| `model.layers.*.mlp.up_proj.weight` | 14336x4096 | `{placement}` | 32 |" in table
    groups = F.param_groups(plan, graph)
    assert len({g.role for g in groups}) == len(groups)  # one row per role (placements agree)


def test_redistributions_grouped_per_role_and_counted(llama):
    graph, topology, plan = llama
    groups = F.redistribution_groups(plan, graph)
    assert plan.redistributions and len(groups) < len(plan.redistributions)
    keys = [(g.where, g.edge, g.src, g.dst) for g in groups]
    assert len(keys) == len(set(keys))
    block = [g for g in groups if g.part == "block"]
    assert block and all(g.count in (1, graph.total_layers - 1, graph.total_layers)
                         for g in block)
    md = render_markdown(plan, graph=graph, topology=topology)
    for g in groups:
        assert f"| {g.collective} |" in md


def test_hand_made_plan_renders_without_graph_or_topology():
    plan = _hand_made()
    md = render_markdown(plan)
    for section in set(SECTIONS) - {"## Compute and communication per part"}:
        assert section in md, section
    assert "| `blocks.*.fc.weight` | - | `S(0)` | 2 |" in md
    assert "`a -> b[0]`" in md and "all_reduce" in md
    # bubble of interleaved 1F1B: (p - 1) / (v m) = 1 / 8 (Narayanan et al. SC'21, 2.2.2)
    assert "### `bubble_fraction_interleaved` = 0.125 for this plan" in md
    assert "communication: +2 ms per step vs the chosen plan" in md
    summary = render_summary(plan)
    assert str(plan) in summary and "10 ms" in summary


# --- HTML --------------------------------------------------------------------------------------

class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack, self.seen, self.errors = [], [], []

    def handle_starttag(self, tag, attrs):
        self.seen.append((tag, dict(attrs)))
        if tag not in ("meta", "br", "img", "link", "rect", "line", "path"):
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.seen.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        if tag in ("rect", "line", "path"):
            return
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(tag)


def test_html_is_self_contained_with_charts(llama):
    graph, topology, plan = llama
    page = render_html(plan, graph=graph, topology=topology)
    assert page.startswith("<!doctype html>")
    assert not re.search(r"https?://", page), "no URL at all: the page must open offline"
    assert "<script" not in page and "<link" not in page and "@import" not in page
    parser = _Tags()
    parser.feed(page)
    assert not parser.errors and not parser.stack, (parser.errors, parser.stack)
    for tag, attrs in parser.seen:
        assert "src" not in attrs and "href" not in attrs, (tag, attrs)
    assert page.count("<svg") >= 4  # step split, memory, timeline, parts, alternatives
    for key in ("summary", "memory", "stages", "parts", "alternatives", "formulas"):
        assert f'<section id="{key}">' in page
    assert "device memory 80 GB" in page
    assert F.fmt_time(plan.prediction.step_time_s) in page


def test_html_without_graph_still_draws_timeline():
    page = render_html(_hand_made())
    assert "<svg" in page and "pipeline timeline" in page
    assert "0F0" in page  # stage 0 forward of microbatch 0, PyTorch's text form


# --- timeline illustration -------------------------------------------------------------------

@pytest.mark.parametrize("schedule,pp,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1),
                                             ("1f1b", 4, 3, 1), ("interleaved-1f1b", 4, 8, 2),
                                             ("interleaved-1f1b", 2, 4, 3)])
def test_schedule_orders_and_dependencies(schedule, pp, m, v):
    stages = pp * v
    orders = rank_orders(schedule, pp, m, v)
    for r, order in enumerate(orders):
        expect = {(k, c * pp + r, i) for k in "FB" for c in range(v) for i in range(m)}
        assert sorted(order) == sorted(expect)  # every block exactly once, on its rank
    f, b = 1.0, 2.0
    blocks = simulate(schedule, pp, m, v, [f] * stages, [b] * stages)
    end = {(x.kind, x.stage, x.microbatch): x.end_s for x in blocks}
    for x in blocks:
        if x.kind == "F" and x.stage > 0:
            assert x.start_s >= end[("F", x.stage - 1, x.microbatch)]
        if x.kind == "B":
            dep = ("B", x.stage + 1, x.microbatch) if x.stage < stages - 1 else \
                ("F", x.stage, x.microbatch)
            assert x.start_s >= end[dep]
    for r in range(pp):  # a rank runs one block at a time
        mine = sorted((x.start_s, x.end_s) for x in blocks if x.rank == r)
        assert all(a[1] <= c[0] + 1e-12 for a, c in zip(mine, mine[1:]))
    makespan = max(x.end_s for x in blocks)
    if m % pp == 0 or v == 1:
        # balanced stages: m v (f + b) of work per rank plus the bubble (p - 1)(f + b)
        # (Narayanan et al. SC'21, sections 2.2.1 and 2.2.2)
        assert makespan == pytest.approx(m * v * (f + b) + (pp - 1) * (f + b))


def test_stage_times_match_the_predicted_stage_time():
    plan = _hand_made()
    fwd, bwd = stage_times(plan)
    # the busiest rank takes bubble * v / (pp - 1) per microbatch
    per_rank = [fwd[0] + bwd[0] + fwd[2] + bwd[2], fwd[1] + bwd[1] + fwd[3] + bwd[3]]
    assert max(per_rank) == pytest.approx(0.002 * 2 / 1)
    assert all(b == pytest.approx(2 * f) for f, b in zip(fwd, bwd))


# --- writing ---------------------------------------------------------------------------------

def test_write_report_writes_three_files(tmp_path):
    plan = _hand_made()
    out = tmp_path / "new" / "dir"
    paths = write_report(plan, out)
    assert set(paths) == {"plan.json", "report.md", "report.html"}
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "report.html", "report.md"]
    assert Plan.from_json(paths["plan.json"].read_text()) == plan
    assert json.loads(paths["plan.json"].read_text())["schema_version"] == plan.schema_version
    assert paths["report.md"].read_text() == render_markdown(plan)
    assert paths["plan.json"].stat().st_mode & 0o044  # readable like any file, not 0600


def test_write_report_failure_leaves_nothing(tmp_path, monkeypatch):
    plan = _hand_made()
    # a rendering failure: nothing is created
    monkeypatch.setattr("autoplan.report.html.render_html",
                        lambda *a, **k: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(ValueError, match="boom"):
        write_report(plan, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    monkeypatch.undo()

    # a write failure on the third file: no output, no temporary file, old files untouched
    calls = []
    real = write_mod._write_temp

    def flaky(directory, name, text):
        calls.append(name)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(directory, name, text)

    monkeypatch.setattr(write_mod, "_write_temp", flaky)
    with pytest.raises(OSError, match="disk full"):
        write_report(plan, tmp_path / "b")
    assert not (tmp_path / "b").exists()
    old = tmp_path / "c"
    old.mkdir()
    (old / "report.md").write_text("old report")
    calls.clear()
    with pytest.raises(OSError):
        write_report(plan, old)
    assert sorted(p.name for p in old.iterdir()) == ["report.md"]
    assert (old / "report.md").read_text() == "old report"
