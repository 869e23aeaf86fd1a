"""CPython's cyclic garbage collector paused around planning ([Note: collector paused]).

    with collector_paused():
        result = plan(graph, topology, spec)
    no_collection_at_exit()      # a command-line process: one collection fewer at its exit

[Note: collector paused]
Planning allocates mostly long-lived objects (the modules torch, transformers and OR-Tools
import, the captured graph, the search's caches) and many small acyclic ones, which reference
counting frees. Both kinds trigger the cyclic collector, and each of its full collections
re-scans every live object -- some 360,000 once torch and transformers are imported -- to
find next to nothing. Measured on the 2-core machine: inside `plan()` 0.2 s of a 1 s search;
over a whole cold `autoplan plan` process (imports, capture, solve, report) about 15 % of its
CPU time in 7 full and ~1,000 young collections, for about 10 MB of cyclic garbage (the
temporary FX graphs torch.export builds) left until the collector runs again. Training loops
(the runtime, `autoplan demo`, `calibrate`) keep the collector running.

The interpreter's exit collects too: after the atexit handlers it runs one full collection
over every object still alive if the collector is enabled, then tears the modules down and
collects twice more whatever its state -- 1.6-2.1 s of CPU after a cold `autoplan plan` had
printed and written everything, of which the first collection is 0.5 s. A command whose
process ends with it therefore disables the collector at exit (`no_collection_at_exit`, an
atexit handler): the teardown's collections still free everything and run every finalizer.
(Freezing every object instead would cut the exit to 0.2 s, but the objects of extensions
that check for leaks at exit, triton's nanobind types, are then never freed, and nanobind
prints a page of "leaked" lines on stderr.)

[Note: exit without teardown] Even without that collection, a cold `autoplan plan` spent
1.2-1.9 s after it had printed and written everything, tearing down the modules of torch,
transformers and OR-Tools and the search's models: 15-20 % of the command. Once `plan` has
returned, the process holds nothing that must outlive it: the files are written and closed
(atomic renames), the plan cache too, and no rank, process group or thread runs. So the
`autoplan` command's entry point (cli.py `console`) ends such a command with `os._exit` after
flushing stdout, stderr and logging (`exit_now`): no atexit handler, no module teardown, no
finalizer -- the operating system frees the memory. Only commands that ask for it do
(`exit_without_teardown`); `main()` called in a process (the tests, a notebook) returns as
before.

Importing this module imports no torch (the command line uses it before it imports torch).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused", "no_collection_at_exit", "exit_without_teardown",
           "exit_now"]

_WITHOUT_TEARDOWN = [False]  # a command asked for `exit_now` ([Note: exit without teardown])


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Disable the cyclic garbage collector for the block; the previous state (enabled or
    not) is restored on exit, also on error, so that nesting is harmless."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            _enable_without_a_young_scan()


def _enable_without_a_young_scan() -> None:
    """Re-enable the collector with what the paused block allocated in the oldest generation.
    Enabled as is, the young generation would hold every object allocated while paused (some
    400,000 after a cold capture) and the next allocation would trigger a collection scanning
    them all; `freeze` moves every tracked object to the permanent generation and `unfreeze`
    back into the oldest one, where the next full collection sees them, as it would have.
    Skipped where something else froze objects (gc.freeze before a fork): `unfreeze` would
    thaw those too."""
    if gc.get_freeze_count():
        gc.enable()
        return
    gc.freeze()
    gc.enable()
    gc.unfreeze()


def no_collection_at_exit() -> None:
    """Disable the collector when the interpreter exits ([Note: collector paused]), which
    skips the full collection its finalization runs only for an enabled collector; registered
    once however often it is called (`main()` may run many times in one process, as in the
    tests)."""
    atexit.unregister(gc.disable)
    atexit.register(gc.disable)


def exit_without_teardown() -> None:
    """A command whose process may end without the interpreter's teardown once it returns
    ([Note: exit without teardown]): `exit_now` then ends it; the collector is also disabled
    at exit (`no_collection_at_exit`) for a process that exits the ordinary way."""
    _WITHOUT_TEARDOWN[0] = True
    no_collection_at_exit()


def exit_now(status: int) -> int:
    """End the process with `status` without the interpreter's teardown where the command
    asked for it (`exit_without_teardown`), after flushing stdout, stderr and logging; else
    return `status` (the caller exits the ordinary way)."""
    if not _WITHOUT_TEARDOWN[0]:
        return status
    import logging
    import os
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more to say
            pass
    os._exit(status)
