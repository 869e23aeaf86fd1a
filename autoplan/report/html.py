"""The plan report as ONE self-contained HTML page: the Markdown report's sections (converted by
a small converter for the subset markdown.py writes) with inline SVG charts, inline CSS, no
scripts and no URLs, so it opens offline and can be mailed as one file.

Charts: step time split, memory per rank by kind vs device memory (with the runners-up), the
dry-run ranks' measured memory by kind beside the prediction (when the plan records a dry
run), the pipeline timeline (an illustration of the schedule's order from the predicted
per-stage times, see timeline.py), compute/communication per part, and the alternatives' step
times.
"""

from __future__ import annotations

import re
from html import escape

from autoplan.graph import CapturedGraph
from autoplan.plan import Plan
from autoplan.report import facts as F
from autoplan.report import svg
from autoplan.report.markdown import markdown_sections
from autoplan.report.timeline import predicted_stage_s, simulate, stage_times
from autoplan.topology import Topology

__all__ = ["render_html", "markdown_to_html"]

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222;
       max-width: 1100px; margin: 2em auto; padding: 0 1em; }
h1 { font-size: 1.6em; border-bottom: 2px solid #4e79a7; }
h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ddd; }
h3 { font-size: 1.05em; }
table { border-collapse: collapse; margin: .5em 0 1em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f5f8; }
tr:nth-child(even) td { background: #fafbfc; }
code, pre { font: 12px/1.4 ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; }
pre { background: #f6f8fa; padding: .6em; overflow-x: auto; }
figure { margin: 1em 0; } figcaption { color: #555; font-size: 12px; }
svg text { font-family: system-ui, sans-serif; }
details summary { cursor: pointer; color: #555; }
"""

_MEMORY_COLORS = dict(zip(F.MEMORY_KINDS, svg.PALETTE))


def _inline(text: str) -> str:
    out = escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)


def _cells(line: str) -> list[str]:
    parts = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [p.strip().replace("\\|", "|") for p in parts]


def markdown_to_html(lines: list[str]) -> str:
    """HTML of the Markdown subset markdown.py writes: #/##/### headings, pipe tables,
    paragraphs, 4-space code blocks, `$$ latex $$` lines, inline `code` and **bold**."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif m := re.match(r"(#{1,3}) (.*)", line):
            out.append(f"<h{len(m.group(1))}>{_inline(m.group(2))}</h{len(m.group(1))}>")
            i += 1
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            head = "".join(f"<th>{_inline(c)}</th>" for c in rows[0])
            body = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>"
                           for r in rows[2:])
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif line.startswith("    "):
            out.append(f"<pre>{escape(line[4:])}</pre>")
            i += 1
        elif line.startswith("$$"):
            out.append(f"<details><summary>LaTeX</summary><pre>{escape(line.strip('$ '))}"
                       "</pre></details>")
            i += 1
        else:
            para = []
            while i < len(lines) and lines[i].strip() and not re.match(r"[#|$]|    ", lines[i]):
                para.append(lines[i])
                i += 1
            out.append(f"<p>{_inline(' '.join(para))}</p>")
    return "\n".join(out)


def _alt_label(a) -> str:
    schedule = {"interleaved-1f1b": "i1f1b", "interleaved-zb": "izb"}.get(a.schedule,
                                                                         a.schedule)
    v = f" v{a.num_virtual_stages}" if a.num_virtual_stages > 1 else ""
    ckpt = {"none": ""}.get(a.checkpointing, f" {a.checkpointing[:3]}-ckpt")
    cp = f" cp{a.mesh.cp}" if a.mesh.cp > 1 else ""
    offload = {"none": ""}.get(getattr(a, "offload", "none"), " offload")
    return (f"pp{a.mesh.pp} dp{a.mesh.dp}{cp} tp{a.mesh.tp} z{a.zero_stage} "
            f"m{a.num_microbatches} {schedule}{v}{ckpt}{offload}")


def _figure(chart: str, caption: str) -> str:
    """`caption` is Markdown inline text (`code`, **bold**)."""
    return f"<figure>{chart}<figcaption>{_inline(caption)}</figcaption></figure>"


def _step_chart(plan: Plan) -> str:
    p = plan.prediction
    parts = [("compute", p.compute_s), ("communication", p.comm_s), ("bubble", p.bubble_s)]
    chart = svg.stacked_bars([("step time", parts)], fmt=F.fmt_time, title="step time split")
    return _figure(chart, "Predicted step time: compute, exposed communication and pipeline "
                          "bubble on the critical path.")


def _memory_chart(plan: Plan, topology: Topology | None) -> str:
    rows = [(f"chosen plan ({str(plan.mesh).replace('x', ' ')})", F.memory_rows(plan))]
    for a in plan.alternatives:
        rows.append((_alt_label(a), [("total (runner-up)", a.memory_bytes)]))
    markers = _memory_markers(plan, topology)
    colors = {**_MEMORY_COLORS, "total (runner-up)": "#bab0ac"}
    chart = svg.stacked_bars(rows, fmt=F.fmt_bytes, title="memory per rank", markers=markers,
                             colors=colors)
    caption = ("Peak memory of the most loaded rank by kind (the plan records that rank's "
               "breakdown) and the runners-up's totals, against the device memory and the "
               f"{plan.max_memory_fraction:.0%} of it the plan may use.")
    host = plan.prediction.host_memory_bytes
    if host:  # offloaded states: host memory, a bar of its own against the host's share
        share = F.host_share_bytes(plan, topology)
        chart += svg.stacked_bars(
            [("host (offloaded)", [("offloaded states", host)])], fmt=F.fmt_bytes,
            title="host memory per rank",
            markers=[("host memory per rank", share)] if share else [],
            colors={"offloaded states": "#76b7b2"})
        caption += (f" Below: the host memory of its offloaded states ({plan.offload}), "
                    "against its share of the node's host memory.")
    return _figure(chart, caption)


def _memory_markers(plan: Plan, topology: Topology | None) -> list[tuple[str, float]]:
    """The device's memory and the usable part of it (`Plan.max_memory_fraction`), the
    budget the search held every rank to; none without a topology."""
    if topology is None:
        return []
    mem = topology.device.mem_bytes
    return [("device memory", mem),
            (f"usable ({plan.max_memory_fraction:.0%})", plan.max_memory_fraction * mem)]


def _dry_run_chart(plan: Plan, topology: Topology | None) -> str:
    """Measured beside predicted memory by kind, a pair of bars per dry-run rank."""
    rows = []
    for r in plan.dry_run:
        rows.append((f"rank {r.rank} measured", [(k, float(r.peak_by_category.get(k, 0)))
                                                 for k in F.MEMORY_KINDS]))
        rows.append((f"rank {r.rank} predicted", [(k, float(r.predicted_by_category.get(k, 0)))
                                                  for k in F.MEMORY_KINDS]))
    markers = _memory_markers(plan, topology)
    chart = svg.stacked_bars(rows, fmt=F.fmt_bytes, title="dry run: memory per rank",
                             markers=markers, colors=_MEMORY_COLORS)
    return _figure(chart, "Each dry-run rank's measured peak by kind beside the plan's "
                          "prediction for its pipeline stage.")


def _label_text(num_labelled: int, num_blocks: int) -> str:
    """What the caption says about block labels: only what the chart draws."""
    form = "`2F0` is stage 2's forward of microbatch 0, PyTorch pipelining's text form"
    if num_labelled == num_blocks:
        return f"Each block is labelled `stage F|B microbatch` ({form})."
    if num_labelled == 0:
        return (f"The blocks are too narrow for labels; each block's tooltip names it "
                f"({form}).")
    return (f"{F.plural(num_labelled, 'block')} of {num_blocks} are wide enough for their "
            f"label `stage F|B microbatch` ({form}); each block's tooltip names it.")


def _timeline_chart(plan: Plan, parts) -> str:
    fwd, bwd = stage_times(plan, parts)
    m, pp, v = plan.num_microbatches, plan.mesh.pp, plan.num_virtual_stages
    blocks = simulate(plan.schedule, pp, m, v, fwd, bwd)
    step = plan.prediction.step_time_s
    costs = ("stage cost in proportion to its blocks, backward = 2 x forward" if parts is None
             else "stage cost from the per-part costs below")
    caption = (f"An illustration of the {plan.schedule} schedule's order for "
               f"{F.plural(m, 'microbatch')} on {F.plural(pp, 'pp rank')}, drawn from the "
               f"predicted per-stage times ({costs}). Pipeline transfers are not drawn. ")
    num_labelled = svg.labelled_blocks(blocks, pp, step, fmt=F.fmt_time)
    out = _figure(svg.timeline(blocks, pp, step, fmt=F.fmt_time, title="pipeline timeline"),
                  caption + _label_text(num_labelled, len(blocks)))
    if m * v > 16:  # too many blocks to read: also zoom on the warm-up and steady state
        window = min((pp + 4) * predicted_stage_s(plan), step)  # fill + a few steady ones
        zoom = svg.timeline(blocks, pp, step, fmt=F.fmt_time, window_s=window,
                            title="pipeline timeline, start")
        shown = sum(1 for b in blocks if b.start_s < window)
        num_labelled = svg.labelled_blocks(blocks, pp, step, fmt=F.fmt_time, window_s=window)
        out += _figure(zoom, f"The first {F.fmt_time(window)} of the same step. "
                             + _label_text(num_labelled, shown))
    return out


def _parts_chart(parts) -> str:
    names = {"pre": "before the blocks", "block": "one block", "post": "after the blocks"}
    rows = [(names[p.part], [("compute fwd", p.compute_fwd_s), ("compute bwd", p.compute_bwd_s),
                             ("comm fwd", p.comm_fwd_s), ("comm bwd", p.comm_bwd_s)])
            for p in parts]
    colors = {"compute fwd": svg.PALETTE[0], "compute bwd": "#a0cbe8",
              "comm fwd": svg.PALETTE[2], "comm bwd": "#ff9d9a"}
    chart = svg.stacked_bars(rows, fmt=F.fmt_time, title="compute and communication per part",
                             colors=colors)
    return _figure(chart, "Compute and tp communication of one microbatch per part of the "
                          "model on one rank (every block is alike).")


def _alternatives_chart(plan: Plan) -> str:
    rows = [("chosen plan", [("chosen", plan.prediction.step_time_s)])]
    for a in plan.alternatives:
        kind = "over the memory budget" if a.reason.startswith("memory") else "runner-up"
        rows.append((_alt_label(a), [(kind, a.step_time_s)]))
    colors = {"chosen": svg.PALETTE[4], "runner-up": svg.PALETTE[0],
              "over the memory budget": svg.PALETTE[2]}
    chart = svg.stacked_bars(rows, fmt=F.fmt_time, title="alternatives", colors=colors)
    return _figure(chart, "Predicted step time of the chosen plan and the runners-up.")


def render_html(plan: Plan, *, graph: CapturedGraph | None = None,
                topology: Topology | None = None, dtype_origin: str = "") -> str:
    """The report as one self-contained HTML page (module docstring); same arguments and
    errors as `render_markdown`."""
    parts = F.part_costs(plan, graph, topology) if graph is not None and topology else None
    charts = {"prediction": _step_chart(plan), "memory": _memory_chart(plan, topology),
              "stages": _timeline_chart(plan, parts)}
    if parts:
        charts["parts"] = _parts_chart(parts)
    if plan.alternatives:
        charts["alternatives"] = _alternatives_chart(plan)
    if plan.dry_run:
        charts["dry_run"] = _dry_run_chart(plan, topology)
    body = []
    for key, lines in markdown_sections(plan, graph, topology, parts, dtype_origin):
        body.append(f'<section id="{key}">{markdown_to_html(lines)}{charts.get(key, "")}'
                    "</section>")
    title = escape(f"autoplan: {plan.model} on {plan.topology}")
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{title}</title><style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")
