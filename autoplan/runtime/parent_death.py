"""Ranks die with the process that started them ([Note: ranks die with their parent]).

[Note: ranks die with their parent]
A `LocalCluster` rank is a child process that waits for jobs from its parent. When the parent
is killed (SIGKILL, the OOM killer, a terminal closing) nothing stops its ranks: they are
re-parented to init and keep training, holding memory and cores, for as long as their job
lasts. So each rank, first thing:
  1. on Linux asks the kernel for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG), then
     checks that the parent is still the one that started it (it may have died before the
     prctl call);
  2. elsewhere, or when the cluster was started from a thread other than the main one (the
     kernel sends PR_SET_PDEATHSIG when the *thread* that forked the child ends, not its
     process), runs a watchdog thread that exits the rank within `poll_s` of its parent pid
     changing (os.getppid());
  3. a rank forked by a fork server (`LocalCluster`: [Note: ranks fork from a preloaded
     server] in launcher.py) has the server as its parent: PR_SET_PDEATHSIG then follows the
     server, which exits when the process that started it does (EOF on its `alive` pipe), and
     a watchdog thread polls the starting process itself (`_alive`: gone, or a zombie), for
     the window before the prctl call and for a server a forked child of the starter keeps
     alive.
SIGTERM of the parent, the orderly stop, first closes its clusters: `close_on_sigterm` installs
a handler (main thread only, and only over the default action or another such handler) that
kills and reaps the ranks, removes their files, then lets SIGTERM end the process as it would
have.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Callable

__all__ = ["close_on_sigterm", "die_with_parent"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _set_pdeathsig(sig: int) -> bool:
    """Ask Linux to send `sig` to this process when its parent thread ends; whether it did."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc symbols, no prctl
        return False


def _watch_parent(parent_pid: int, poll_s: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    os._exit(1)  # the parent is gone: nobody reads this rank's results


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (exists and is not a zombie: a killed process its own parent
    has not reaped yet is dead to us)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True  # no /proc: existence is all we can tell


def _watch_starter(starter_pid: int, poll_s: float) -> None:
    while _alive(starter_pid):
        time.sleep(poll_s)
    os._exit(1)  # whoever started this rank is gone: nobody reads its results


def die_with_parent(parent_pid: int, *, use_prctl: bool = True, poll_s: float = 0.5) -> None:
    """Make this process end when process `parent_pid` (its parent, or the process that had a
    fork server start it) ends ([Note: ranks die with their parent]): by PR_SET_PDEATHSIG when
    `use_prctl` and Linux allow it, else by a daemon thread that polls os.getppid() every
    `poll_s` seconds; started through a fork server, by both (the signal follows the server,
    the thread polls `parent_pid`). Exits at once when the parent is already gone."""
    if os.getppid() != parent_pid:
        # started through a fork server (launcher.py [Note: ranks fork from a preloaded
        # server]): the server is the parent, and it ends when the process that started it
        # does (multiprocessing/forkserver.py: EOF on its `alive` pipe); PR_SET_PDEATHSIG
        # follows the server, a watch thread the starter itself (dead before the prctl call,
        # or a server kept alive by a child the starter forked)
        if use_prctl:
            _set_pdeathsig(signal.SIGKILL)
        if not _alive(parent_pid):
            os._exit(1)
        threading.Thread(target=_watch_starter, args=(parent_pid, poll_s), daemon=True,
                         name="autoplan-parent-watch").start()
        return
    if use_prctl and _set_pdeathsig(signal.SIGKILL):
        if os.getppid() != parent_pid:
            os._exit(1)
        return
    threading.Thread(target=_watch_parent, args=(parent_pid, poll_s), daemon=True,
                     name="autoplan-parent-watch").start()


def close_on_sigterm(close: Callable[[], None]) -> Callable[[], None]:
    """On SIGTERM call `close()`, then end as the previous handler would ([Note: ranks die
    with their parent]). Installed only from the main thread and over the default action or
    another `close_on_sigterm` handler (a user's own handler or SIG_IGN is left alone).
    Returns a function that uninstalls it (a no-op when another handler has replaced it)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL and not getattr(previous, "_autoplan_closes", False):
        return lambda: None

    def on_sigterm(signum, frame):
        close()
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # the default action: end by SIGTERM

    on_sigterm._autoplan_closes = True
    signal.signal(signal.SIGTERM, on_sigterm)

    def uninstall() -> None:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is on_sigterm):
            signal.signal(signal.SIGTERM, previous)
    return uninstall
