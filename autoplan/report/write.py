"""Writing report files atomically: all-or-nothing per call.

Everything is rendered in memory first; then each file is written to a temporary file in the
target directory and, once all are written, moved into place with `os.replace` (atomic on POSIX
and Windows within one file system). A failure before the moves removes the temporary files
(and the directory, if this call created it), so no half-written output is ever left.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # write_files (a cached report, autoplan/cache.py) needs no torch
    from autoplan.graph import CapturedGraph
    from autoplan.plan import Plan
    from autoplan.topology import Topology

__all__ = ["render_report", "write_files", "write_report"]


def _write_temp(directory: Path, name: str, text: str) -> Path:
    """A new hidden file next to the target, with the permissions a plain open() gives."""
    tmp = directory / f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_files(files: dict[str, str], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write {file name: text} into `out_dir` (created if missing), all or nothing (module
    docstring). Returns {file name: path}. Raises OSError when the directory is not writable."""
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    temps: dict[str, Path] = {}
    try:
        for name, text in files.items():
            temps[name] = _write_temp(out, name, text)
        for name, tmp in temps.items():
            os.replace(tmp, out / name)
    except BaseException:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    return {name: out / name for name in files}


def render_report(plan: Plan, *, graph: CapturedGraph | None = None,
                  topology: Topology | None = None, dtype_origin: str = "") -> dict[str, str]:
    """The text of `plan.json`, `report.md` and `report.html`, by file name (what
    `write_report` writes); `dtype_origin` as `render_markdown`'s. Raises ValueError from
    rendering."""
    from autoplan.report.html import render_html
    from autoplan.report.markdown import render_markdown

    return {
        "plan.json": plan.to_json() + "\n",
        "report.md": render_markdown(plan, graph=graph, topology=topology,
                                     dtype_origin=dtype_origin),
        "report.html": render_html(plan, graph=graph, topology=topology,
                                   dtype_origin=dtype_origin),
    }


def write_report(plan: Plan, out_dir: str | os.PathLike, *, graph: CapturedGraph | None = None,
                 topology: Topology | None = None, dtype_origin: str = "") -> dict[str, Path]:
    """Write `plan.json`, `report.md` and `report.html` into `out_dir`, atomically.

    Returns {"plan.json": path, "report.md": path, "report.html": path}. Raises ValueError from
    rendering (nothing is written then) and OSError from the file system.
    """
    return write_files(render_report(plan, graph=graph, topology=topology,
                                     dtype_origin=dtype_origin), out_dir)
