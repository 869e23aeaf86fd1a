"""Fused SwiGLU gating: y = silu(gate) * up (Shazeer 2020, "GLU Variants Improve Transformer",
eq. 6, with Swish_1 = SiLU; the Llama MLP's ``act_fn(gate_proj(x)) * up_proj(x)``).

silu(g) = g * sigmoid(g). With a column-parallel gate/up projection each tp rank holds matching
shards of gate and up, so the gating is local; fusing it saves writing and re-reading silu(gate).

Backward (s = sigmoid(g)):

    d gate = dy * up * s * (1 + g * (1 - s))        d up = dy * silu(g)

The forward rounds silu(gate) to the input dtype before the multiply, as eager
``F.silu(gate) * up`` does, so bfloat16 results match eager PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._dispatch import pick_triton

__all__ = ["swiglu", "swiglu_backward", "swiglu_reference"]

_BLOCK = 1024  # elements per program


@triton.jit
def _fwd_kernel(gate_ptr, up_ptr, y_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc_ty = tl.float64 if gate_ptr.dtype.element_ty == tl.float64 else tl.float32
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(acc_ty)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(acc_ty)
    silu = (g * tl.sigmoid(g)).to(y_ptr.dtype.element_ty).to(acc_ty)
    tl.store(y_ptr + offs, (silu * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(dy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc_ty = tl.float64 if gate_ptr.dtype.element_ty == tl.float64 else tl.float32
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(acc_ty)
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(acc_ty)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(acc_ty)
    sig = tl.sigmoid(g)
    silu = g * sig
    dgate = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(dgate_ptr + offs, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offs, (dy * silu).to(dup_ptr.dtype.element_ty), mask=mask)


def _pick_triton(use_triton: bool | None, tensors: list[torch.Tensor], fn: str) -> bool:
    return pick_triton(use_triton, tensors, fn, _fwd_kernel)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        numel = gate.numel()
        if numel:
            _fwd_kernel[(triton.cdiv(numel, _BLOCK),)](gate, up, y, numel, BLOCK=_BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        numel = gate.numel()
        if numel:
            _bwd_kernel[(triton.cdiv(numel, _BLOCK),)](dy, gate, up, dgate, dup, numel,
                                                       BLOCK=_BLOCK)
        return dgate, dup


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`swiglu`: ``F.silu(gate) * up``."""
    return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """SwiGLU gating ``silu(gate) * up`` (Shazeer 2020, eq. 6), elementwise.

    Args:
        gate: (...) float16/bfloat16/float32/float64, e.g. (B, T, F_local) from gate_proj.
        up: same shape and dtype as gate, from up_proj.
        use_triton: None picks the fused Triton kernel for CUDA tensors and the reference otherwise;
            True forces Triton (on CPU only under TRITON_INTERPRET=1); False forces the reference.

    Returns:
        (...) tensor of gate's shape and dtype; differentiable in gate and up. The fused kernel
        computes in float32 (float64 for float64 inputs).

    Raises:
        ValueError: if gate and up differ in shape or dtype, are not floating point, are on
            different devices, or if use_triton=True cannot run.
    """
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate and up must have one shape and dtype, got "
                         f"{tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")
    if not gate.is_floating_point():
        raise ValueError(f"swiglu: gate and up must be floating point, got {gate.dtype}")
    if not _pick_triton(use_triton, [gate, up], "swiglu"):
        return swiglu_reference(gate, up)
    return _SwiGLU.apply(gate, up)


def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (d gate, d up) of :func:`swiglu` given the upstream gradient dy (the module
    docstring's formulas), as the graph op ``autoplan::swiglu_backward`` (kernels/ops.py) needs.

    Args:
        dy: the gradient of swiglu(gate, up), gate's shape and dtype.
        gate, up, use_triton: as :func:`swiglu`.

    Returns:
        (d gate, d up), each of gate's shape and dtype: the fused kernel on the Triton path,
        autograd's formulas for :func:`swiglu_reference` otherwise (op for op the unfused
        graph's backward).

    Raises:
        ValueError: as :func:`swiglu`, or if dy differs from gate in shape or dtype.
    """
    if dy.shape != gate.shape or dy.dtype != gate.dtype or gate.shape != up.shape:
        raise ValueError(f"swiglu_backward: dy, gate and up must have one shape and dtype, got "
                         f"{tuple(dy.shape)} {dy.dtype}, {tuple(gate.shape)} {gate.dtype} and "
                         f"{tuple(up.shape)} {up.dtype}")
    if not _pick_triton(use_triton, [dy, gate, up], "swiglu_backward"):
        # autograd's backward of F.silu(gate) * up, op for op (an op's impl runs below
        # autograd: no torch.autograd.grad here)
        dgate = torch.ops.aten.silu_backward(dy * up, gate)
        dup = dy * F.silu(gate)
        return dgate, dup
    gate, up, dy = gate.contiguous(), up.contiguous(), dy.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    numel = gate.numel()
    if numel:
        _bwd_kernel[(triton.cdiv(numel, _BLOCK),)](dy, gate, up, dgate, dup, numel, BLOCK=_BLOCK)
    return dgate, dup
