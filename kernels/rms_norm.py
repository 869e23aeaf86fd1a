"""Fused RMSNorm over the last dim, with weight (Zhang & Sennrich 2019, "Root Mean Square Layer
Normalization", eq. 4):

    y = w * x / sqrt(mean(x^2) + eps)

computed the way Hugging Face's ``LlamaRMSNorm`` does: normalize in float32, cast back to the
input dtype, then multiply by the weight (so y has dtype promote(x.dtype, w.dtype)). The fused
kernel reads x once in the forward and x, dy once in the backward; on CPU the runtime uses the
torch reference, whose backward is autograd's.

Backward (n = x * rstd, rstd = 1 / sqrt(mean(x^2) + eps), g = dy * w, H = hidden size):

    dx = rstd * (g - n * mean(g * n))        dw = sum over rows of dy * n
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import pick_triton

__all__ = ["rms_norm", "rms_norm_backward", "rms_norm_reference"]

MAX_FUSED_HIDDEN = 65536  # one program holds a whole row: Triton blocks top out near 2**20 elements
_MAX_BWD_PROGRAMS = 256  # backward programs, each accumulating a partial weight gradient


@triton.jit
def _fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, hidden, eps,
                BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc_ty = rstd_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(acc_ty)
    mean_sq = tl.sum(x * x, axis=0) / hidden
    if acc_ty == tl.float64:
        rstd = 1.0 / tl.sqrt(mean_sq + eps)
    else:  # IEEE-rounded sqrt and division in float32 (tl.sqrt and / may be approximate)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
    # HF casts the normalized value to the input dtype before the weight multiply; do the same.
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(acc_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(acc_ty)
    tl.store(y_ptr + row * stride_y + offs, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr,
                stride_dy, stride_x, stride_dx, num_rows, hidden,
                BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    acc_ty = rstd_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(acc_ty)
    dw = tl.zeros((BLOCK_H,), acc_ty)
    # Rows pid, pid + P, pid + 2P, ...: the weight gradient stays in registers across rows.
    for row in range(pid, num_rows, num_programs):
        row64 = tl.cast(row, tl.int64)
        x = tl.load(x_ptr + row64 * stride_x + offs, mask=mask, other=0.0).to(acc_ty)
        dy = tl.load(dy_ptr + row64 * stride_dy + offs, mask=mask, other=0.0).to(acc_ty)
        rstd = tl.load(rstd_ptr + row64)
        normed = x * rstd
        # As HF: its forward multiplies the weight by normed rounded to x's dtype, and its
        # autograd rounds dy * w to x's dtype (both no-ops for float32).
        g = (dy * w).to(x_ptr.dtype.element_ty).to(acc_ty)
        dw += dy * normed.to(x_ptr.dtype.element_ty).to(acc_ty)
        dx = rstd * (g - normed * (tl.sum(g * normed, axis=0) / hidden))
        tl.store(dx_ptr + row64 * stride_dx + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_partial_ptr + pid * hidden + offs, dw, mask=mask)


def _pick_triton(use_triton: bool | None, tensors: list[torch.Tensor], fn: str) -> bool:
    return pick_triton(use_triton, tensors, fn, _fwd_kernel)


def _acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        hidden = x.shape[-1]
        x_2d = x.reshape(-1, hidden).contiguous()  # (N, H)
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        y = torch.empty(x_2d.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(x_2d.shape[0], dtype=_acc_dtype(x.dtype, weight.dtype), device=x.device)
        if x_2d.shape[0]:
            _fwd_kernel[(x_2d.shape[0],)](x_2d, weight.contiguous(), y, rstd, x_2d.stride(0),
                                          y.stride(0), hidden, eps,
                                          BLOCK_H=triton.next_power_of_2(hidden))
        ctx.save_for_backward(x_2d, weight, rstd)
        ctx.x_shape = x.shape
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x_2d, weight, rstd = ctx.saved_tensors
        num_rows, hidden = x_2d.shape
        dy_2d = dy.reshape(-1, hidden).contiguous()
        dx = torch.empty_like(x_2d)
        num_programs = max(1, min(num_rows, _MAX_BWD_PROGRAMS))
        dw_partial = torch.zeros(num_programs, hidden, dtype=rstd.dtype, device=x_2d.device)
        if num_rows:
            _bwd_kernel[(num_programs,)](dy_2d, x_2d, weight.contiguous(), rstd, dx, dw_partial,
                                         dy_2d.stride(0), x_2d.stride(0), dx.stride(0), num_rows,
                                         hidden, BLOCK_H=triton.next_power_of_2(hidden))
        return dx.reshape(ctx.x_shape), dw_partial.sum(0).to(weight.dtype), None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Torch reference of :func:`rms_norm`: HF ``LlamaRMSNorm.forward`` (float64 stays float64)."""
    acc = _acc_dtype(x.dtype, weight.dtype)
    x_acc = x.to(acc)
    rstd = torch.rsqrt(x_acc.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    return weight * (x_acc * rstd).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             use_triton: bool | None = None) -> torch.Tensor:
    """RMSNorm over the last dim: ``weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)``.

    Zhang & Sennrich 2019, eq. 4, in Hugging Face LlamaRMSNorm's precision: the statistics and the
    normalization in float32 (float64 if x or weight is float64), the weight multiply after the
    cast back to x.dtype.

    Args:
        x: (..., H) float16/bfloat16/float32/float64.
        weight: (H,) floating point.
        eps: added to the mean square before the square root.
        use_triton: None picks the fused Triton kernel for CUDA tensors and the reference otherwise;
            True forces Triton (on CPU only under TRITON_INTERPRET=1); False forces the reference.

    Returns:
        (..., H) tensor of dtype promote(x.dtype, weight.dtype); differentiable in x and weight.

    Raises:
        ValueError: if x or weight is not floating point, if weight is not (H,) for x's last dim
            H, if the tensors are on different devices, or if the Triton path is asked for with
            H > MAX_FUSED_HIDDEN or cannot run.
    """
    if not (x.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"rms_norm: x and weight must be floating point, got {x.dtype} and "
                         f"{weight.dtype}")
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight must be (H,) with H = x's last dim; got x "
                         f"{tuple(x.shape)} and weight {tuple(weight.shape)}")
    wants_triton = use_triton or (use_triton is None and x.is_cuda)
    if wants_triton and x.shape[-1] > MAX_FUSED_HIDDEN:
        raise ValueError(f"rms_norm: hidden size {x.shape[-1]} exceeds the fused kernel's "
                         f"single-block limit {MAX_FUSED_HIDDEN}; use use_triton=False")
    if not _pick_triton(use_triton, [x, weight], "rms_norm"):
        return rms_norm_reference(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps)


def _rms_norm_backward_reference(dy, x, weight, eps):
    """Autograd's backward of :func:`rms_norm_reference`, op for op (torch's derivatives.yaml
    formulas for mul, rsqrt, mean and pow), written out: a custom op's impl runs below autograd,
    so it cannot call torch.autograd.grad."""
    acc = _acc_dtype(x.dtype, weight.dtype)
    a = x.to(acc)  # (..., H)
    r = torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    c = (a * r).to(x.dtype)
    dy = dy.to(torch.promote_types(x.dtype, weight.dtype))
    dw = (dy * c).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)  # (H,)
    dn = (dy * weight).to(x.dtype).to(acc)  # mul, then the casts' backward
    dr = (dn * a).sum(-1, keepdim=True)  # mul: sum_to_size of the broadcast rstd
    de = -0.5 * dr * r.pow(3)  # rsqrt: -0.5 * grad * result^3
    dp = de.expand(a.shape) / a.shape[-1]  # mean over H
    da = dn * r + dp * (2 * a)  # mul's and pow's (grad * 2 * self) contributions
    return da.to(x.dtype), dw


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (dx, dweight) of :func:`rms_norm` given the upstream gradient dy, without a saved
    forward: the statistics are recomputed (one read of x), as the graph op
    ``autoplan::rms_norm_backward`` (kernels/ops.py) needs.

    Args:
        dy: (..., H), the gradient of rms_norm(x, weight, eps).
        x, weight, eps, use_triton: as :func:`rms_norm`.

    Returns:
        dx (..., H) of x's dtype and dweight (H,) of weight's dtype: the module docstring's
        formulas on the Triton path, autograd's formulas for :func:`rms_norm_reference` op by op
        otherwise (so the reference path is the unfused graph's backward to rounding).

    Raises:
        ValueError: as :func:`rms_norm`, or if dy's shape is not x's.
    """
    if dy.shape != x.shape:
        raise ValueError(f"rms_norm_backward: dy {tuple(dy.shape)} must have x's shape "
                         f"{tuple(x.shape)}")
    wants_triton = use_triton or (use_triton is None and x.is_cuda)
    if wants_triton and x.shape[-1] > MAX_FUSED_HIDDEN:
        raise ValueError(f"rms_norm_backward: hidden size {x.shape[-1]} exceeds the fused "
                         f"kernel's single-block limit {MAX_FUSED_HIDDEN}; use use_triton=False")
    if not _pick_triton(use_triton, [dy, x, weight], "rms_norm_backward"):
        return _rms_norm_backward_reference(dy, x, weight, eps)
    hidden = x.shape[-1]
    x_2d = x.reshape(-1, hidden).contiguous()  # (N, H)
    dy_2d = dy.reshape(-1, hidden).contiguous()  # (N, H)
    acc = _acc_dtype(x.dtype, weight.dtype)
    rstd = torch.rsqrt(x_2d.to(acc).pow(2).mean(-1) + eps)  # (N,), as _fwd_kernel's
    num_rows = x_2d.shape[0]
    dx = torch.empty_like(x_2d)
    num_programs = max(1, min(num_rows, _MAX_BWD_PROGRAMS))
    dw_partial = torch.zeros(num_programs, hidden, dtype=acc, device=x.device)
    if num_rows:
        _bwd_kernel[(num_programs,)](dy_2d, x_2d, weight.contiguous(), rstd, dx, dw_partial,
                                     dy_2d.stride(0), x_2d.stride(0), dx.stride(0), num_rows,
                                     hidden, BLOCK_H=triton.next_power_of_2(hidden))
    return dx.reshape(x.shape), dw_partial.sum(0).to(weight.dtype)
