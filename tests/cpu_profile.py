"""A pytest plugin (opt-in) that writes the CPU seconds of every test: this process, every live
process below it (the session's gloo rank pools, torchrun and CLI subprocesses) and the
children they reaped, read from /proc. Unlike `--durations` it does not move with the load of
a shared machine, so it says where `make test`'s time goes (`make test-cpu`).

    CPU_PROFILE_OUT=out/test_cpu.json python -m pytest -p tests.cpu_profile -n 2 tests

Writes a JSON list of [test id, CPU seconds, wall seconds], one per test, at the session's end,
the slowest first. Under pytest-xdist each worker counts its own tests (its process tree: its
rank pools and subprocesses, not the other worker's) into a part file beside the output, and
the controller merges the parts when the workers are done. Linux only (reads /proc); elsewhere
it writes nothing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_rows: list[tuple[str, float, float]] = []
_started: dict[str, tuple[float, float]] = {}


def _stat(pid: str) -> tuple[int, int] | None:
    """(parent pid, CPU ticks of the process and of its reaped children) of /proc/pid/stat."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone between the listing and the read
        return None
    fields = text[text.rindex(")") + 2:].split()  # fields from the 3rd (state) on
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return int(fields[1]), utime + stime + cutime + cstime


def tree_cpu_s(root: int | None = None) -> float:
    """CPU seconds of process `root` (this one by default), its live descendants and the
    children each reaped."""
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(p))}
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    ticks, todo = 0, [root or os.getpid()]
    while todo:
        pid = todo.pop()
        ticks += stats.get(pid, (0, 0))[1]
        todo += children.get(pid, [])
    return ticks / _TICKS_PER_S


def _enabled() -> bool:
    return bool(os.environ.get("CPU_PROFILE_OUT")) and Path("/proc/self/stat").exists()


def _parts(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f"{out.name}.*.part"))


_counting = True  # False in an xdist controller, which sees its workers' tests in its hooks


def pytest_configure(config):
    global _counting
    if not _enabled() or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _counting = not getattr(config.option, "numprocesses", None)
    for part in _parts(Path(os.environ["CPU_PROFILE_OUT"])):  # an earlier run's
        part.unlink()


def pytest_runtest_logstart(nodeid, location):
    if _enabled() and _counting:
        _started[nodeid] = (tree_cpu_s(), time.perf_counter())


def pytest_runtest_logfinish(nodeid, location):
    if nodeid in _started:
        cpu0, wall0 = _started.pop(nodeid)
        _rows.append((nodeid, round(tree_cpu_s() - cpu0, 2),
                      round(time.perf_counter() - wall0, 2)))


def _write(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[\n" + ",\n".join(json.dumps(list(row)) for row in rows) + "\n]\n")


def pytest_sessionfinish(session, exitstatus):
    if not _enabled():
        return
    out = Path(os.environ["CPU_PROFILE_OUT"])
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # an xdist worker: its part, merged by the controller
        _write(out.with_name(f"{out.name}.{worker}.part"), _rows)
        return
    rows = list(_rows)  # without xdist this process ran the tests; with it, none
    for part in _parts(out):
        rows += json.loads(part.read_text())
        part.unlink()
    _write(out, sorted(rows, key=lambda row: -row[1]))
