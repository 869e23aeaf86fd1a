"""What every bench writes, written one way: its JSON results (atomically: a bench killed while
it writes leaves the previous file whole), its Markdown table, and its section of
docs/benchmarks.md.

A bench imports this file as `_results` (the benches are scripts, not a package: each puts
bench/ on sys.path first, the way a script run as `python bench/<name>.py` finds it anyway).

Two ways a bench owns its part of docs/benchmarks.md, as they did in README.md before:
- a section: from its heading (`## Cost model fidelity`) up to the next heading
  (`replace_section`), the bench writes the heading's prose and table;
- a marked table: between `<!-- name:begin -->` and `<!-- name:end -->` (`replace_marked`),
  the prose around it written by hand.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["BENCHMARKS", "write_atomic", "write_json", "table_row", "table_head",
           "replace_section", "replace_marked", "machine_facts"]

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "docs" / "benchmarks.md"


def machine_facts() -> dict:
    """Where a bench ran: platform, CPU count, load average (1 / 5 / 15 min) and torch."""
    import platform

    import torch

    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "loadavg": " / ".join(f"{x:.1f}" for x in os.getloadavg()),
            "torch": torch.__version__}


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it and one rename (os.replace is
    atomic on POSIX within a file system); creates the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, doc) -> None:
    """`doc` as the benches' JSON (indent 1, a final newline), written atomically."""
    write_atomic(path, json.dumps(doc, indent=1) + "\n")


def table_row(cells: Sequence[str]) -> str:
    """One Markdown table row: `| a | b |`; an empty cell is `| |`."""
    return "|" + "|".join(f" {c} " if c != "" else " " for c in cells) + "|"


def table_head(columns: Sequence[str]) -> list[str]:
    """A Markdown table's header row and its rule: `| a | b |`, `|---|---|`."""
    return [table_row(columns), "|" + "---|" * len(columns)]


def replace_section(head: str, body: str, *, until: str = "\n#",
                    path: Path = BENCHMARKS) -> None:
    """Replace the text from the line `head` up to the next `until` (`"\\n#"`: a heading of any
    level; `"\\n## "`: the next section of that level) with `body`, which starts with `head`;
    appended at the end of the file when `head` is not in it."""
    text = Path(path).read_text()
    start = text.find(head)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + body
    else:
        nxt = text.find(until, start + len(head))
        text = text[:start] + body + ("" if nxt < 0 else text[nxt:])
    write_atomic(path, text)


def replace_marked(name: str, table: str, path: Path = BENCHMARKS) -> None:
    """Replace what lies between `<!-- name:begin -->` and `<!-- name:end -->` in `path` with
    `table`. Raises SystemExit naming the markers when the file lacks them."""
    text = Path(path).read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"{Path(path).name} lacks the {begin} ... {end} markers")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    write_atomic(path, f"{head}{begin}\n{table}\n{end}{tail}")
