"""Shared dispatch between a Triton kernel and its torch reference."""

from __future__ import annotations

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["pick_triton"]


def pick_triton(use_triton: bool | None, tensors: list[torch.Tensor], fn: str, kernel) -> bool:
    """None: Triton on CUDA, the reference elsewhere. True: Triton (CPU: only interpreted).

    Raises ValueError when the tensors span devices, or when Triton is forced on CPU tensors
    without the interpreter."""
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
