"""What went wrong in a job of `LocalCluster` (autoplan/runtime/launcher.py): each rank's
outcome, the ranks' stacks, and the `RankError` that names the rank at fault.

[Note: naming the failed rank]
When one rank faults, its peers fail too, for a secondary reason: a collective with a vanished
peer raises "Connection reset by peer", one with a stuck peer times out. The error the user
sees names the root cause, chosen in this order:
  1. a rank whose process died (exit code or signal; `run` polls every process's exit code
     while it waits for results, so a death is seen within _POLL_S);
  2. a rank that raised, other than for a lost or timed-out peer (the first to report);
  3. a rank that gave no result and is not inside torch.distributed (it hangs in its own code);
  4. a rank that gave no result, waiting in a collective;
  5. a rank that raised for a lost or timed-out peer (the first to report).
After the first fault the other ranks get FAULT_GRACE_S to report; those that do not are
"hung": each worker registers faulthandler on SIGUSR1 (and on fatal signals) to write all its
threads' stacks to a file, so a hung or crashed rank's stack is shown although it cannot report.
The other failed ranks are folded below the root cause, a few lines each.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["RankError", "Outcome", "frame_text", "main_stack", "dump_stacks", "death_stack",
           "exit_text", "root_rank", "fold", "rank_error"]

_FOLD_FRAMES = 3  # innermost frames shown for each rank that is not the root cause
# What a rank raises when a peer vanished or stopped answering, in gloo's words ("Read error
# [addr]: Connection reset by peer", "Timed out waiting 3000ms for recv operation to complete",
# "Application timeout caused pair closure") and NCCL's watchdog's.
_PEER_LOSS = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Timed out waiting \d+ms|"
                        r"pair closure|Socket Timeout|Watchdog caught collective operation timeout")


class RankError(RuntimeError):
    """A job failed; `rank` is the rank that caused it ([Note: naming the failed rank]).

    Attributes:
        rank: the root-cause rank.
        cause: what happened to it, short text: "died: killed by signal SIGKILL, 12 s in",
            "raised ValueError: ...", "hung: no result after 50 s, stack: ...".
        others: the other ranks that failed, rank -> short text ("RuntimeError: Connection
            reset by peer", "no result after 9 s, waiting in all_reduce (...)").
    The message adds the root rank's traceback or stack and a few lines per other rank.
    Picklable (rebuilt from these attributes and the message).
    """

    def __init__(self, rank: int, cause: str, others: dict[int, str] | None = None,
                 message: str | None = None):
        self.rank = rank
        self.cause = cause
        self.others = dict(others or {})
        lines = [f"rank {rank} {cause}"] + [f"rank {r}: {t}" for r, t in self.others.items()]
        super().__init__(message if message is not None else "\n".join(lines))

    def __reduce__(self):
        return type(self), (self.rank, self.cause, self.others, str(self))


@dataclass
class Outcome:
    """What one rank did in one job, as the parent learnt it."""
    kind: Literal["ok", "raised", "died", "hung"]
    seq: int             # order in which the parent learnt it
    elapsed_s: float     # since the job was sent
    value: Any = None    # the result, when ok
    summary: str = ""    # one line: the exception, the exit, the wait
    detail: str = ""     # the traceback (raised) or stack dump (died, hung)


# -- stacks and tracebacks ------------------------------------------------------------------------
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+),? in (\S+)')


def frame_text(line: str) -> str:
    path, lineno, func = _FRAME.match(line).groups()
    return f"{func} ({os.path.basename(path)}:{lineno})"


def _job_frames(frames: list[str]) -> list[str]:
    """Innermost-first frame lines cut below the job: `_worker` and the process start-up go."""
    cut = next((i for i, f in enumerate(frames) if " in _worker" in f), len(frames))
    return frames[:cut]


def main_stack(dump: str) -> list[str]:
    """Frame lines of the thread running the job (the one whose stack holds `_worker`) in a
    faulthandler dump, innermost first, down to the job function; the last such thread block
    when there are several."""
    blocks: list[list[str]] = []
    for line in dump.splitlines():
        if re.match(r"^(Current thread|Thread) 0x", line):
            blocks.append([])
        elif blocks and _FRAME.match(line):
            blocks[-1].append(line.strip())
    main = [b for b in blocks if any(" in _worker" in f for f in b)]
    return _job_frames(main[-1] if main else (blocks[-1] if blocks else []))


def _traceback_frames(tb: str) -> list[str]:
    """Frame lines of a formatted traceback, innermost first, down to the job function."""
    return _job_frames([line.strip() for line in reversed(tb.splitlines()) if _FRAME.match(line)])


def _in_collective(o: Outcome) -> bool:
    frames = main_stack(o.detail)
    return bool(frames) and "torch/distributed" in frames[0]


def dump_stacks(procs: dict[int, tuple[int, str]]) -> dict[int, str]:
    """Ask live ranks for their stacks (SIGUSR1, [Note: naming the failed rank]): rank ->
    (pid, stack file) in, rank -> the dump out ("" for one that wrote none within 2 s, or is
    still starting: its file is opened before faulthandler is registered)."""
    procs = {r: pp for r, pp in procs.items() if os.path.exists(pp[1])}
    before = {r: os.path.getsize(path) for r, (_, path) in procs.items()}
    for pid, _ in procs.values():
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    size, deadline = dict(before), time.monotonic() + 2.0
    waiting = set(procs)
    while waiting and time.monotonic() < deadline:
        time.sleep(0.05)
        for r in list(waiting):
            now = os.path.getsize(procs[r][1])
            if before[r] < now == size[r]:  # written and no longer growing
                waiting.discard(r)
            size[r] = now
    dumps = {}
    for r, (_, path) in procs.items():
        with open(path, errors="replace") as f:
            f.seek(before[r])
            dumps[r] = f.read()
    return dumps


def death_stack(path: str) -> str:
    """The stack faulthandler wrote when a fatal signal killed the rank, or ""."""
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        text = f.read()
    at = text.rfind("Fatal Python error")
    return text[at:] if at >= 0 else ""


def exit_text(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


# -- choosing and telling the root cause --------------------------------------------------------
def root_rank(faults: dict[int, Outcome]) -> int:
    """The rank that caused the failure, by [Note: naming the failed rank]'s order."""
    def order(r: int) -> tuple[int, int]:
        o = faults[r]
        if o.kind == "died":
            return 0, o.seq
        if o.kind == "raised":
            return (4 if _PEER_LOSS.search(o.summary) else 1), o.seq
        return (3 if _in_collective(o) else 2), o.seq
    return min(faults, key=order)


def _cause(o: Outcome) -> str:
    """The root rank's short cause."""
    if o.kind == "raised":
        return f"raised {o.summary}"
    frames = [frame_text(f) for f in main_stack(o.detail)[:2]]
    if o.kind == "died":
        at = f" at {frames[0]}" if frames else ""
        return f"died: {o.summary}{at}, {o.elapsed_s:.1f} s in"
    stack = " <- ".join(frames) if frames else "not available"
    return f"hung: no result after {o.elapsed_s:.0f} s, stack: {stack}"


def fold(o: Outcome) -> list[str]:
    """A few frames of a rank that is not the root cause: the innermost one, then the
    innermost ones outside torch (where the job called in)."""
    frames = _traceback_frames(o.detail) if o.kind == "raised" else main_stack(o.detail)
    torch_dir = os.path.dirname(torch.__file__)
    shown = frames[:1] + [f for f in frames[1:] if torch_dir not in f][:_FOLD_FRAMES - 1]
    texts = [frame_text(f) for f in shown]
    return [f"    in {t}" for t in texts if t not in o.summary]  # a hung rank's is there


def _root_detail(r: int, o: Outcome) -> list[str]:
    if o.kind == "raised":
        return [f"rank {r}'s traceback:", o.detail.rstrip()]
    frames = main_stack(o.detail)
    if not frames:
        return []
    return [f"rank {r}'s stack (most recent call first):"] + [f"  {f}" for f in frames]


def rank_error(faults: dict[int, Outcome], job: str) -> RankError:
    root = root_rank(faults)
    cause = _cause(faults[root])
    others = {r: faults[r].summary for r in sorted(faults) if r != root}
    lines = [f"rank {root} {cause} (job {job})"]
    for r, text in others.items():
        lines += [f"rank {r}: {text}"] + fold(faults[r])
    lines += _root_detail(root, faults[root])
    return RankError(root, cause, others, "\n".join(lines))
