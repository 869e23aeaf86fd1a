"""Plan reports: Markdown, one self-contained HTML page with charts, and the files on disk.

    render_markdown(plan, graph=..., topology=...) -> str
    render_html(plan, graph=..., topology=...)     -> str   (inline CSS and SVG, no network)
    render_summary(plan, topology=..., graph=...)  -> str   (a few lines for the terminal)
    render_report(plan, graph=..., topology=...)   -> {"plan.json": str, ...}
    write_report(plan, out_dir, ...)               -> {"plan.json": Path, ...}
    write_files({"report.md": str, ...}, out_dir)  -> {"report.md": Path, ...}

The pieces: facts.py (the numbers; the costs per part of the model from
cost_model/part_costs.py), roles.py (parameters and redistributions grouped per block role),
formulas.py (the closed forms a plan uses), timeline.py (the pipeline schedule illustration),
markdown.py (the Markdown report and the terminal summary), html.py (the HTML page), svg.py
(its charts), measured.py (the Dry run section: what dry-run ranks measured beside the plan),
diff.py (what differs between two plans: `autoplan diff` and `autoplan explain`), write.py
(files written atomically). Every number is printed by autoplan/units.py ([Note: number
format]).

The names are imported on first use (PEP 562 module `__getattr__`, as in autoplan/__init__.py):
the renderers import torch, and `autoplan plan` writes a cached report (autoplan/cache.py) with
`write_files` alone, without them.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "render_markdown": "autoplan.report.markdown",
    "render_summary": "autoplan.report.markdown",
    "render_html": "autoplan.report.html",
    "render_report": "autoplan.report.write",
    "write_report": "autoplan.report.write",
    "write_files": "autoplan.report.write",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """Import a public name's module on first use and cache the name here."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'autoplan.report' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
