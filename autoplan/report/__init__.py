"""Plan reports: Markdown, one self-contained HTML page with charts, and the files on disk.

    render_markdown(plan, graph=..., topology=...) -> str
    render_html(plan, graph=..., topology=...)     -> str   (inline CSS and SVG, no network)
    render_summary(plan, topology=..., graph=...)  -> str   (a few lines for the terminal)
    write_report(plan, out_dir, ...)               -> {"plan.json": Path, ...}

The pieces: facts.py (the numbers, grouped per block role), formulas.py (the closed forms a plan
uses), timeline.py (the pipeline schedule illustration), markdown.py, html.py, svg.py. Every
number is printed by the formatters in facts.py ([Note: number format]).
"""

from __future__ import annotations

from autoplan.report.html import render_html
from autoplan.report.markdown import render_markdown, render_summary
from autoplan.report.write import write_report

__all__ = ["render_markdown", "render_html", "render_summary", "write_report"]
