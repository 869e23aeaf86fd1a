"""Shared dispatch between a Triton kernel and its torch reference."""

from __future__ import annotations

import contextlib
import contextvars

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["pick_triton", "device_allocations", "launches"]

_DEVICE_ALLOCATIONS = contextvars.ContextVar("kernels_device_allocations", default=False)


@contextlib.contextmanager
def device_allocations():
    """Within: every kernel takes its Triton path's allocations -- the outputs it writes, the
    contiguous copies it makes -- and launches nothing, whatever the tensors' device. For a dry
    run on this machine of a plan for GPUs (autoplan/runtime/dryrun.py, fake tensors that
    claim the CPU): its memory is then what the GPU's kernels allocate, as the custom ops'
    `register_fake` (kernels/ops.py) give for the others, not what the torch reference (what a
    CPU rank runs) allocates. Nothing computed inside it has values."""
    token = _DEVICE_ALLOCATIONS.set(True)
    try:
        yield
    finally:
        _DEVICE_ALLOCATIONS.reset(token)


def launches() -> bool:
    """False inside `device_allocations`: the kernel's outputs are allocated, not written."""
    return not _DEVICE_ALLOCATIONS.get()


def pick_triton(use_triton: bool | None, tensors: list[torch.Tensor], fn: str, kernel) -> bool:
    """None: Triton on CUDA, the reference elsewhere. True: Triton (CPU: only interpreted).

    Inside `device_allocations`: always the Triton path (which then launches nothing).

    Raises ValueError when the tensors span devices, or when Triton is forced on CPU tensors
    without the interpreter."""
    if not launches():
        return True
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{fn}: all tensors must be on one device, "
                         f"got {sorted(map(str, devices))}")
    device = next(iter(devices))
    if use_triton is None:
        return device.type == "cuda"
    if not use_triton:
        return False
    # Both the module's kernels and triton.language's own helpers (tl.sum, ...) are
    # decorated at import: all must be interpreted for CPU tensors.
    interpreted = all(isinstance(f, InterpretedFunction) for f in (kernel, tl.sum))
    if device.type != "cuda" and not interpreted:
        raise ValueError(f"{fn}: use_triton=True on {device} tensors needs the Triton interpreter: "
                         "set TRITON_INTERPRET=1 before triton is first imported (triton.jit picks "
                         "the interpreter when it decorates), or pass use_triton=None or False")
    return True
