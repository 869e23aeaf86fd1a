"""Progress on stderr: one line per long phase (capture, solve, build, first step), shown by
rank 0 only, so that nothing runs silently for a minute.

    with phase("planning llama3-70b on 64 x H100"):
        ...

On a terminal the phase shows a rich spinner while it runs; otherwise (a log file, CI, a
pipe) a plain line once it has run for a second, and one when it ends, with the seconds it
took; a phase shorter than that prints nothing. Verbosity
0 prints nothing (`autoplan ... --quiet`, `AUTOPLAN_VERBOSITY=0`), 1 the phases (default), 2
also `detail` lines. Importing this module imports neither torch nor rich.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

__all__ = ["phase", "detail", "note", "set_verbosity", "verbosity"]

_level: int | None = None
_lock = threading.Lock()  # one line at a time: the announcing timer thread and the caller


def _write(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _say(line: str) -> None:
    with _lock:
        _write(line)


def set_verbosity(level: int | None) -> None:
    """0: silent, 1: phases (default), 2: phases and details; None: back to
    AUTOPLAN_VERBOSITY's (default 1)."""
    global _level
    _level = None if level is None else int(level)


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


def note(message: str) -> None:
    """A line at verbosity 1 (rank 0, stderr): what a run did instead of a phase (a plan read
    from the cache)."""
    if _shown(1):
        _say(f"autoplan: {message}")


def detail(message: str) -> None:
    """A line at verbosity 2 (rank 0, stderr)."""
    if _shown(2):
        _say(f"autoplan: {message}")


@contextlib.contextmanager
def phase(what: str, *, quiet_below_s: float = 1.0):
    """Show `what` while the block runs, and how long it took; an exception marks the line
    "failed" and propagates. A phase over within `quiet_below_s` seconds prints nothing (a
    tiny model's build stays quiet; a large one's says what it is doing)."""
    if not _shown(1):
        yield
        return
    start = time.perf_counter()
    status = None
    announced, finished = threading.Event(), threading.Event()
    if sys.stderr.isatty():
        from rich.console import Console

        status = Console(stderr=True).status(f"autoplan: {what} ...")
        status.start()
        timer = None
    else:
        def announce():
            with _lock:  # never after the phase's last line
                if not finished.is_set():
                    announced.set()
                    _write(f"autoplan: {what} ...")

        timer = threading.Timer(quiet_below_s, announce)
        timer.daemon = True
        timer.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        with _lock:
            finished.set()
        if timer is not None:
            timer.cancel()
        if status is not None:
            status.stop()
        took = time.perf_counter() - start
        if announced.is_set() or took >= quiet_below_s:
            _say(f"autoplan: {what}: {'done' if ok else 'failed'} in {took:.1f} s")
