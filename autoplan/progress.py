"""Progress on stderr: one line per long phase (capture, solve, build, first step), shown by
rank 0 only, so that nothing runs silently for a minute.

    with phase("planning llama3-70b on 64 x H100"):
        ...

On a terminal the phase shows a rich spinner while it runs; otherwise (a log file, CI, a
pipe) a plain line when it starts and one when it ends, with the seconds it took. Verbosity
0 prints nothing (`autoplan ... --quiet`, `AUTOPLAN_VERBOSITY=0`), 1 the phases (default), 2
also `detail` lines. Importing this module imports neither torch nor rich.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

__all__ = ["phase", "detail", "set_verbosity", "verbosity"]

_level: int | None = None


def set_verbosity(level: int) -> None:
    """0: silent, 1: phases (default), 2: phases and details."""
    global _level
    _level = int(level)


def verbosity() -> int:
    if _level is not None:
        return _level
    try:
        return int(os.environ.get("AUTOPLAN_VERBOSITY", "1"))
    except ValueError:
        return 1


def _is_rank0() -> bool:
    """Rank 0 of a torchrun/LocalCluster job (the environment says), or a lone process."""
    return os.environ.get("RANK", "0") == "0"


def _shown(level: int) -> bool:
    return verbosity() >= level and _is_rank0()


def detail(message: str) -> None:
    """A line at verbosity 2 (rank 0, stderr)."""
    if _shown(2):
        print(f"autoplan: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def phase(what: str):
    """Show `what` while the block runs, and how long it took; an exception leaves the line
    marked "failed" and propagates."""
    if not _shown(1):
        yield
        return
    start = time.perf_counter()
    status = None
    if sys.stderr.isatty():
        from rich.console import Console

        console = Console(stderr=True)
        status = console.status(f"autoplan: {what} ...")
        status.start()
    else:
        print(f"autoplan: {what} ...", file=sys.stderr, flush=True)
    ok = False
    try:
        yield
        ok = True
    finally:
        if status is not None:
            status.stop()
        took = time.perf_counter() - start
        print(f"autoplan: {what}: {'done' if ok else 'failed'} in {took:.1f} s",
              file=sys.stderr, flush=True)
