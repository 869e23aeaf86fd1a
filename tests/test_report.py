"""Plan reports: Markdown sections and numbers, one number format ([Note: number format]) and
one parameter count in report and summary, grouping per block role, the self-contained HTML
page, the pipeline timeline illustration, and atomic writes. Chart geometry:
test_report_charts.py."""

from __future__ import annotations

import dataclasses
import json
import re
from html.parser import HTMLParser

import pytest

from autoplan.plan import (
    Alternative, DryRunRecord, MeshShape, Plan, Prediction, Redistribution, Stage,
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
    assert F.fmt_flops(p.tflops_per_device * 1e12, per_s=True) in md
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
    assert "toy on dgx-h100: pp2xdp1xtp2" in summary and "10 ms" in summary


# --- number format ([Note: number format] in report/facts.py) ---------------------------------

@pytest.mark.parametrize("fmt,value,text", [
    (F.fmt_time, 0.0, "0 s"), (F.fmt_time, 1.78e-15, "0 s"),  # a float residue is 0
    (F.fmt_time, 4.2e-5, "42 \u00b5s"), (F.fmt_time, 6.27e-3, "6.27 ms"),
    (F.fmt_time, 0.0009996, "1 ms"), (F.fmt_time, 31.0, "31 s"), (F.fmt_time, 2400.0, "2400 s"),
    (F.fmt_bytes, 0.0, "0 B"), (F.fmt_bytes, 372.0, "372 B"), (F.fmt_bytes, 372e3, "372 kB"),
    (F.fmt_bytes, 999.7e3, "1 MB"), (F.fmt_bytes, 70.1e9, "70.1 GB"),
    (F.fmt_bytes, 1e21, "1000 EB"), (F.fmt_count, 0.125, "0.125"), (F.fmt_count, 12, "12"),
    (F.fmt_count, 67.6e3, "67.6 k"), (F.fmt_count, 70.6e9, "70.6 G"),
    (F.fmt_flops, 9.421e17, "942 PFLOP"), (F.fmt_pct, 1.78e-15, "0 %"),
    (F.fmt_pct, 1.05e-4, "0.0105 %"), (F.fmt_pct, 0.0099996, "1.0 %"), (F.fmt_pct, 0.48, "48.0 %"),
    (F.fmt_pct, 3e-8, "< 0.001 %"),
])
def test_number_formats(fmt, value, text):
    assert fmt(value) == text


def test_pct_sign_and_plurals():
    assert F.fmt_pct(0.07, sign=True) == "+7.0 %" and F.fmt_pct(-0.032, sign=True) == "-3.2 %"
    assert F.fmt_flops(8.786e8, per_s=True) == "879 MFLOP/s"
    assert [F.plural(n, "microbatch") for n in (0, 1, 2)] == [
        "0 microbatches", "1 microbatch", "2 microbatches"]
    assert F.plural(1, "sample") == "1 sample" and F.plural(8, "node") == "8 nodes"


def _tiny_plan() -> Plan:
    """What `autoplan plan --model gpt2-tiny` gives on 4 CPU ranks: pp 1, one microbatch of
    one sample, a float-residue bubble and a few hundred kB per rank."""
    return _hand_made(mesh=MeshShape(1, 4, 1), global_batch=4, num_microbatches=1,
                      microbatch_size=1, schedule="1f1b", num_virtual_stages=1,
                      stages=(Stage(0, 0, 2),), redistributions=(),
                      prediction=Prediction(6.27e-3, 5.84e-3, 4.28e-4, 1.78e-15, 372e3,
                                            {"params": 300e3, "activations": 72e3,
                                             "peak": 372e3}, 1.1e9, 8.786e-4, 0.044))


def test_summary_and_report_numbers_for_a_tiny_plan():
    plan = _tiny_plan()
    summary = render_summary(plan)
    assert "bubble 0 s)" in summary
    assert "372 kB per device" in summary
    assert "schedule    1f1b, 1 microbatch of 1 sample" in summary
    assert "879 MFLOP/s per device" in summary and "communication 428 \u00b5s" in summary
    md = render_markdown(plan)
    assert "| pipeline bubble | 0 s | 0 % |" in md
    assert "| **peak** | **372 kB** |  |" in md
    assert "dp 4 x 1 microbatch x 1 sample;" in md
    page = render_html(plan)
    captions = " ".join(re.findall(r"<figcaption>(.*?)</figcaption>", page))
    assert "for 1 microbatch on 1 pp rank," in captions
    svg_texts = " ".join(re.findall(r"<text [^>]*>([^<]*)</text>", page))
    for text in (summary, md, captions, svg_texts):
        assert not re.search(r"\d[eE][+-]?\d", text), "an exponent: " + text
        assert "microbatches of 1" not in text and "(s)" not in text


def _tied_graph():
    """A captured graph without torch: 2 of 8 blocks captured, an embedding tied to the head
    and a buffer, the way capture records them (graph.ParamInfo)."""
    from autoplan.graph import CapturedGraph, ParamInfo

    params = [ParamInfo("blocks.0.fc.weight", (4, 4), "float32", 16, False, 0),
              ParamInfo("blocks.1.fc.weight", (4, 4), "float32", 16, False, 1),
              ParamInfo("embed.weight", (10, 4), "float32", 40, False, None, ("head.weight",)),
              ParamInfo("rope.inv_freq", (2,), "float32", 2, True, None)]
    return CapturedGraph(None, {}, {p.fqn: p for p in params}, ("x",), ((1, 16),),
                         ("int64",), "blocks", 2, total_layers=8)


def test_parameter_counts_agree_between_report_and_summary(llama):
    """The summary and the report count sharded parameters alike, in one phrasing: the real
    model's (8 blocks), a tied weight once, no buffers."""
    graph = _tied_graph()
    plan = _hand_made(param_placements=(
        ("blocks.0.fc.weight", "S(0)"), ("blocks.1.fc.weight", "S(0)"),
        ("embed.weight", "R"), ("head.weight", "R"), ("rope.inv_freq", "R")))
    assert F.sharded_params(plan, graph) == (8, 9)
    assert F.sharded_params(plan) == (2, 5)  # without the graph: per name in the plan
    phrase = "8 of 9 parameters sharded on the tp axis (a tied weight counted once, no buffers)"
    assert phrase in render_summary(plan, graph=graph)
    assert phrase in render_markdown(plan, graph=graph)
    assert "| `rope.inv_freq` (buffer) | 2 | `R` | 1 |" in render_markdown(plan, graph=graph)
    graph, topology, plan = llama
    summary = render_summary(plan, topology=topology, graph=graph)
    line = next(x for x in summary.splitlines() if x.startswith("params"))
    counted = re.search(r"\d+ of \d+ parameters sharded on the tp axis \([^)]*\)", line)
    assert counted and counted.group(0) in render_markdown(plan, graph=graph,
                                                            topology=topology)


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
    assert "usable (90%) 72 GB" in page  # the budget the search held every rank to
    assert F.fmt_time(plan.prediction.step_time_s) in page
    at_80 = dataclasses.replace(plan, max_memory_fraction=0.8)
    assert "usable (80%) 64 GB" in render_html(at_80, graph=graph, topology=topology)
    assert '"max_memory_fraction": 0.8' in at_80.to_json()
    assert "max_memory_fraction" not in plan.to_json()  # the default: plan.json as before
    assert Plan.from_json(at_80.to_json()) == at_80


def test_dry_run_section_in_markdown_html_and_plan_json():
    """A plan with a dry run of two ranks (`Plan.dry_run`): the Markdown has a section per
    rank, measured beside predicted; a peak within the band says so, one outside names the
    category that differs most in bytes; the HTML adds a well-formed chart; plan.json
    round-trips; a plan without a dry run has no section and no "dry_run" key."""
    predicted = {"params": 1e9, "grads": 1e9, "optimizer": 5e8, "activations": 4e8,
                 "temporaries": 1e8}
    near = DryRunRecord(
        rank=0, coordinates={"pp": 0, "dp": 0, "cp": 0, "tp": 0}, peak_bytes=int(3e9),
        peak_by_category={k: int(v) for k, v in predicted.items()},
        peak_moment="backward of microbatch 4 of 4", bytes_by_axis={"pp": 4096, "tp": 10**6},
        flops=int(2.6e14), predicted_peak_bytes=3e9, predicted_by_category=predicted,
        predicted_flops=2.5e14, priced_bytes_by_axis={"pp": 4096.0, "tp": 8e5})
    far = DryRunRecord(
        rank=3, coordinates={"pp": 1, "dp": 0, "cp": 0, "tp": 1}, peak_bytes=int(4.5e9),
        peak_by_category={**{k: int(v) for k, v in predicted.items()}, "temporaries": int(16e8)},
        peak_moment="optimizer step", bytes_by_axis={}, flops=0, predicted_peak_bytes=3e9,
        predicted_by_category=predicted, predicted_flops=2.5e14)
    band = {"low": -0.06, "high": 0.06, "rows": 10, "source": "bench/fidelity.py",
            "covers": "local plans", "not_covered": ""}
    plan = _hand_made(dry_run=(near, far), prediction=dataclasses.replace(
        _hand_made().prediction, error_bands={"peak_memory": band}))
    md = render_markdown(plan)
    section = md[md.index("## Dry run"):md.index("## Pipeline stages")]
    assert "### Rank 0 (pp0 dp0 cp0 tp0)" in section and "### Rank 3 (pp1 dp0 cp0 tp1)" in section
    assert "| **peak** (backward of microbatch 4 of 4) | **3 GB** | **3 GB** | +0.0% |" in section
    assert "| FLOPs | 260 TFLOP | 250 TFLOP | -3.8% |" in section
    assert "is within the plan's memory band, -6% to +6%" in section
    assert ("The peak's error -33.3% is outside the plan's memory band, -6% to +6%; the "
            "category that differs most is **temporaries**: 1.6 GB measured, 100 MB predicted "
            "(-93.8%).") in section
    assert "| `pp` | 4.1 kB | 4.1 kB | +0.0% |" in section
    assert "| `tp` | 1 MB | 800 kB | -20.0% |" in section
    assert ("Collective bytes differ beyond +-5%; the axis that differs most is **tp**: 1 MB "
            "measured, 800 kB priced (-20.0%).") in section
    assert "No collective or point-to-point op." in section
    page = render_html(plan)
    parser = _Tags()
    parser.feed(page)
    assert not parser.errors and not parser.stack, (parser.errors, parser.stack)
    assert '<section id="dry_run">' in page and "dry run: memory per rank" in page
    assert Plan.from_json(plan.to_json()) == plan
    assert "dry_run" not in _hand_made().to_dict() and "## Dry run" not in render_markdown(
        _hand_made())


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
