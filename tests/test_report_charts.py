"""The report's charts: every label inside its chart and clear of the others and of marker
lines, from the charts' own text-width estimate ([Note: text extent] in report/svg.py) and,
where Chromium (or playwright) is installed, from the boxes a browser lays out; the estimate
against DejaVu Sans widths; the timeline caption promising only the labels it draws."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest

import test_report
from autoplan.plan import Alternative, MeshShape, Plan, Prediction
from autoplan.report import facts as F
from autoplan.report import render_html, svg
from autoplan.topology import preset

llama = test_report.llama  # Llama-3-8B tp 2 x pp 2 on one DGX H100 node, planned once here
_hand_made = test_report._hand_made


# --- chart geometry: every label inside its chart, none over another or a marker line ------
# [Note: text extent] in report/svg.py: an SVG cannot measure text, so the charts estimate
# each label's width (svg.text_width); these checks take the boxes that estimate gives, and
# test_text_width_covers_dejavu_sans / the Chromium test below check the estimate itself.

def _text_boxes(chart: str) -> tuple[tuple[float, float], list[tuple], list[tuple]]:
    """((width, height) of the viewBox, [(x0, y0, x1, y1, text, font size)] of every <text>,
    estimated, [(x, y0, y1)] of every dashed marker line)."""
    root = ET.fromstring(chart)
    _, _, width, height = map(float, root.get("viewBox").split())
    boxes, lines = [], []
    for el in root.iter("text"):
        text = (el.text or "") + "".join(c.tail or "" for c in el)  # leave out <title>
        size, x, y = float(el.get("font-size")), float(el.get("x")), float(el.get("y"))
        w = svg.text_width(text, size)
        x0 = {"start": x, "middle": x - w / 2, "end": x - w}[el.get("text-anchor", "start")]
        boxes.append((x0, y - 0.8 * size, x0 + w, y + 0.2 * size, text, size))
    for el in root.iter("line"):
        if el.get("stroke-dasharray"):
            lines.append((float(el.get("x1")), float(el.get("y1")), float(el.get("y2"))))
    return (width, height), boxes, lines


def _problems(view: tuple[float, float], boxes: list[tuple], lines: list[tuple]) -> list[str]:
    """Text boxes outside the viewBox, over each other or across a marker line."""
    width, height = view
    problems = [f"{b[4]!r} outside the viewBox 0 0 {width:.0f} {height:.0f}: "
                f"x {b[0]:.1f}..{b[2]:.1f}, y {b[1]:.1f}..{b[3]:.1f}"
                for b in boxes if b[0] < 0 or b[2] > width or b[1] < 0 or b[3] > height]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]:
                problems.append(f"{a[4]!r} overlaps {b[4]!r}")
        for x, y0, y1 in lines:
            if a[0] < x < a[2] and a[1] < max(y0, y1) and min(y0, y1) < a[3]:
                problems.append(f"{a[4]!r} crosses the marker line at x = {x:.1f}")
    return problems


def _geometry_problems(chart: str) -> list[str]:
    return _problems(*_text_boxes(chart))


def _charts(page: str) -> list[str]:
    return re.findall(r"<svg .*?</svg>", page, re.S)


def _crowded_plan() -> Plan:
    """Long runner-up labels and a peak memory just under the device's (80 GB)."""
    long_alt = Alternative(MeshShape(1, 64, 4), 3, 128, "interleaved-1f1b", 0.0121, 79.5e9,
                           "communication: +2 ms per step vs the chosen plan",
                           checkpointing="selective", num_virtual_stages=4)
    over = Alternative(MeshShape(2, 16, 2), 0, 16, "1f1b", 0.009, 86e9,
                       "memory: needs 86 GB per device, over the budget")
    breakdown = {"params": 20e9, "grads": 20e9, "optimizer": 20e9, "activations": 16e9,
                 "peak": 76e9}
    return _hand_made(prediction=Prediction(0.010, 0.007, 0.001, 0.002, 76e9, breakdown,
                                            1e15, 25.0, 0.25),
                      alternatives=(long_alt, over, _hand_made().alternatives[0]))


@pytest.mark.parametrize("text,width_px", [
    ("compute", 48.76), ("0123456789", 70.0), ("pp1 dp64 tp4 z3 m128 i1f1b v4 sel-ckpt", 221.52),
    ("device memory 80 GB", 122.66), ("MWm%@", 52.55)])
def test_text_width_covers_dejavu_sans(text, width_px):
    """Widths at 11 px in DejaVu Sans (Linux's system-ui), as headless Chromium lays them
    out: the estimate never falls short (font size x 0.6 x characters did: "compute")."""
    assert width_px <= svg.text_width(text, 11) < 1.35 * width_px


def test_chart_labels_fit_and_do_not_overlap():
    page = render_html(_crowded_plan(), topology=preset("dgx-h100", num_nodes=8))
    assert "device memory 80 GB" in page and "pp1 dp64 tp4 z3 m128" in page
    for chart in _charts(page):
        assert not _geometry_problems(chart), _geometry_problems(chart)


def test_real_report_charts_fit(llama):
    graph, topology, plan = llama
    for chart in _charts(render_html(plan, graph=graph, topology=topology)):
        assert not _geometry_problems(chart), _geometry_problems(chart)


@pytest.mark.parametrize("ratio", [0.5, 0.9, 0.95, 0.97, 0.99, 1.0, 1.01, 1.05, 1.5, 1.99])
def test_totals_keep_clear_of_the_marker_line(ratio):
    """A bar whose total lands on or near the device-memory line: the total is written where
    it crosses no line and stays inside the chart."""
    rows = [("chosen plan", [("params", 40e9), ("activations", ratio * 80e9 - 40e9)]),
            ("a long runner-up label " * 3, [("total", 70.1e9)])]
    chart = svg.stacked_bars(rows, fmt=F.fmt_bytes, title="memory per rank",
                             markers=[("device memory", 80e9)])
    assert not _geometry_problems(chart), _geometry_problems(chart)
    assert "a long runner-up label a long" in chart  # cut to fit, in full in its tooltip


def test_timeline_caption_promises_only_drawn_labels():
    """Labels in the caption only when the chart draws them: 64 microbatches leave blocks
    too narrow for `2F0` in the full step, the zoom labels some."""
    plan = _hand_made(num_microbatches=64, global_batch=128)
    page = render_html(plan)
    full, zoom = re.findall(r"<figure><svg [^>]*aria-label=\"(pipeline timeline[^\"]*)\""
                            r".*?</svg><figcaption>(.*?)</figcaption>", page, re.S)
    charts = {title: chart for chart in _charts(page)
              for title in re.findall(r'aria-label="([^"]*)"', chart)}
    for (title, caption) in (full, zoom):
        drawn = len(re.findall(r'fill="#fff">\d+[FB]\d+</text>', charts[title]))
        if drawn == 0:
            assert "too narrow for labels" in caption, caption
        else:
            assert "labelled" in caption or "wide enough" in caption, caption
            assert f"{drawn} block" in caption or "Each block is labelled" in caption, caption
    assert "too narrow" in full[1] and "too narrow" not in zoom[1]


# The same checks on the boxes a browser lays out, with real fonts, where one is installed
# (skipped otherwise): the estimate above must hold for them too, or its checks prove nothing.
_MEASURE_JS = """(() => {
  const out = [];
  document.querySelectorAll("svg").forEach(svg => {
    const vb = svg.viewBox.baseVal, texts = [];
    svg.querySelectorAll("text").forEach(t => {
      const b = t.getBBox();
      let s = "";
      t.childNodes.forEach(n => { if (n.nodeType === 3) s += n.textContent; });
      texts.push([b.x, b.y, b.x + b.width, b.y + b.height, s,
                  parseFloat(t.getAttribute("font-size"))]);
    });
    const lines = [...svg.querySelectorAll("line[stroke-dasharray]")].map(
      l => [l.x1.baseVal.value, l.y1.baseVal.value, l.y2.baseVal.value]);
    out.push({view: [vb.width, vb.height], texts: texts, lines: lines});
  });
  return out;
})()"""


def _measure_in_browser(page: str, tmp_path) -> list[dict] | None:
    """Per <svg> of `page`, the text boxes Chromium lays out ({view, texts, lines}); None
    when neither a Chromium binary nor playwright is installed."""
    binary = next(filter(None, map(shutil.which, ("chromium", "chromium-browser",
                                                  "google-chrome", "chromium-headless-shell"))),
                  None)
    if binary is not None:
        script = ("<pre id=\"measured\"></pre><script>document.getElementById('measured')"
                  f".textContent = JSON.stringify({_MEASURE_JS});</script></body>")
        path = tmp_path / "measure.html"
        path.write_text(page.replace("</body>", script), encoding="utf-8")
        dom = subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu",
                              "--dump-dom", path.as_uri()], capture_output=True, text=True,
                             timeout=120, check=True).stdout
        measured = re.search(r'<pre id="measured">(.*?)</pre>', dom, re.S).group(1)
        return json.loads(html.unescape(measured))
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    with sync_playwright() as p:
        browser = p.chromium.launch()
        tab = browser.new_page()
        tab.set_content(page)
        measured = tab.evaluate(_MEASURE_JS)
        browser.close()
    return measured


def test_chart_labels_fit_in_headless_chromium(llama, tmp_path):
    graph, topology, plan = llama
    crowded = render_html(_crowded_plan(), topology=preset("dgx-h100", num_nodes=8))
    real = render_html(plan, graph=graph, topology=topology)
    page = crowded.replace("</body>", "".join(_charts(real)) + "</body>")
    measured = _measure_in_browser(page, tmp_path)
    if measured is None:
        pytest.skip("no Chromium (chromium, google-chrome, chromium-headless-shell) and no "
                    "playwright installed")
    assert len(measured) == len(_charts(page))
    for chart, svg_boxes in zip(_charts(page), measured):
        boxes = [tuple(b) for b in svg_boxes["texts"]]
        assert not _problems(svg_boxes["view"], boxes, svg_boxes["lines"])
        for (x0, _, x1, _, text, size) in boxes:  # the estimate holds for the real font
            assert x1 - x0 <= svg.text_width(text, size) + 0.5, (text, x1 - x0)
