"""Measured memory of this process by phase: the runtime's side of "what runs is what was
planned" for memory.

On CPU the measure is the resident set: its high-water mark (`VmHWM` in /proc/self/status) is
reset at the start of a phase by writing "5" to /proc/self/clear_refs (Linux,
Documentation/filesystems/proc.rst, "clear_refs") and read at its end. It includes everything
the process holds (interpreter, libraries, allocator slack), so it is an upper bound on tensor
memory; `LiveTensorBytes` (autoplan.runtime.live_bytes) counts tensor storages alone. On CUDA the
measure is torch.cuda's peak allocated bytes, reset per phase.
"""

from __future__ import annotations

import contextlib
import os

import torch

__all__ = ["resident_bytes", "PhasePeaks"]


def _status_field(name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024  # kB -> bytes
    except OSError:
        return None
    return None


def resident_bytes() -> int | None:
    """Resident set size of this process now, bytes (None off Linux)."""
    return _status_field("VmRSS")


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")


def _peak(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _status_field("VmHWM")


class PhasePeaks:
    """Peak memory per named phase, bytes: `with peaks.phase("construction"): ...`.

    `as_dict()` gives {"<phase>_peak_bytes": int}, the device kind, the least resident bytes
    seen before a phase (`baseline_bytes`: interpreter and libraries; the least, because what
    construction leaves for the garbage collector may be returned to the system later, and a
    baseline that held it would make a later phase's peak look smaller than nothing) and, on
    CPU, each peak minus that baseline ("<phase>_above_baseline_bytes", never negative: a
    phase's high-water mark is at least the resident set it started with)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.peaks: dict[str, int] = {}
        self.baseline_bytes = resident_bytes() if self.device.type != "cuda" else 0

    @contextlib.contextmanager
    def phase(self, name: str):
        now = resident_bytes() if self.device.type != "cuda" else None
        if now is not None and self.baseline_bytes is not None:
            self.baseline_bytes = min(self.baseline_bytes, now)
        _reset_peak(self.device)
        try:
            yield
        finally:
            peak = _peak(self.device)
            if peak is not None:
                self.peaks[name] = peak

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {f"{k}_peak_bytes": v for k, v in self.peaks.items()}
        if self.baseline_bytes:
            out.update({f"{k}_above_baseline_bytes": v - self.baseline_bytes
                        for k, v in self.peaks.items()})
        out["measure"] = "cuda_max_allocated" if self.device.type == "cuda" else "resident_hwm"
        out["baseline_bytes"] = self.baseline_bytes
        return out
