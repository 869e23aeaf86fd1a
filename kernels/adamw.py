"""Fused AdamW update on a flat float32 shard (Loshchilov & Hutter 2019, "Decoupled Weight Decay
Regularization", Algorithm 2, in the form of ``torch.optim.AdamW(foreach=False)``).

With ZeRO the optimizer states live in flat per-rank shards; one kernel reads param, grad,
exp_avg, exp_avg_sq once and writes param, exp_avg, exp_avg_sq once, where the unfused update
makes about ten passes. For step t (1-based), elementwise:

    p  <- p * (1 - lr * weight_decay)                     (decoupled weight decay)
    m  <- lerp(m, g, 1 - beta1)                           (= beta1 * m + (1 - beta1) * g)
    v  <- v * beta2 + (1 - beta2) * g * g
    p  <- p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

The kernel follows torch's operation order and roundings: the scalars are formed in float64 on
the host and rounded to float32 once, lerp and addcmul are fused multiply-adds (as in ATen's CPU
kernels), sqrt and the divisions are IEEE-rounded (``tl.sqrt_rn``, ``tl.div_rn``), so it matches
torch.optim.AdamW(foreach=False) to within float32 rounding (tested at rtol 1e-6). Not bit for bit
on CPU: ATen's vectorized float32 sqrt is not always correctly rounded (1 ulp off for about one
element in six on an AVX-512 build), and the kernel's is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import launches, pick_triton

__all__ = ["adamw_step", "adamw_step_reference"]

_BLOCK = 1024  # elements per program


@triton.jit
def _adamw_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, numel,
                  decay, lerp_weight, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
                  neg_step_size, SMALL_LERP_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    p = tl.load(param_ptr + offs, mask=mask, other=0.0)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
    p = p * decay  # decay is exactly 1.0 without weight decay
    # ATen's lerp: m + w * (g - m) for w < 0.5, else g - (g - m) * (1 - w); one fma either way.
    if SMALL_LERP_WEIGHT:
        m = tl.fma(g - m, lerp_weight, m)
    else:
        m = tl.fma(g - m, lerp_weight - 1.0, g)
    # ATen's addcmul, v + ((1 - beta2) * g) * g, compiles to one fma on x86 CPUs; so does this.
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)
    tl.store(param_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)


def _pick_triton(use_triton: bool | None, tensors: list[torch.Tensor], fn: str) -> bool:
    return pick_triton(use_triton, tensors, fn, _adamw_kernel)


def _check(param, grad, exp_avg, exp_avg_sq, step, betas, fn):
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg),
                    ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{fn}: {name} must be a flat contiguous float32 shard, got "
                             f"{t.dtype} of shape {tuple(t.shape)}")
        if t.shape != param.shape:
            raise ValueError(f"{fn}: {name} has shape {tuple(t.shape)}, param {tuple(param.shape)}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{fn}: step must be an int >= 1 (the count including this update), "
                         f"got {step!r}")
    if len(betas) != 2:
        raise ValueError(f"{fn}: betas must be (beta1, beta2), got {betas!r}")


def adamw_step_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                         exp_avg_sq: torch.Tensor, step: int, lr: float,
                         betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Torch reference of :func:`adamw_step`: the body of torch.optim.adam._single_tensor_adam
    with decoupled weight decay (no amsgrad, no maximize), op for op."""
    _check(param, grad, exp_avg, exp_avg_sq, step, betas, "adamw_step_reference")
    beta1, beta2 = betas
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, step: int, lr: float,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 1e-2, use_triton: bool | None = None) -> None:
    """One AdamW update of a flat shard, in place (Loshchilov & Hutter 2019, Algorithm 2).

    Same math as torch.optim.AdamW(foreach=False, amsgrad=False, maximize=False) for one step:
    param, exp_avg and exp_avg_sq are updated in place; grad is read only.

    Args:
        param, grad, exp_avg, exp_avg_sq: (numel,) contiguous float32 tensors on one device.
        step: the step count including this update (1 on the first update), i.e. torch's
            ``state["step"]`` after its increment.
        lr: learning rate. betas: (beta1, beta2). eps: added to the bias-corrected sqrt(v).
        weight_decay: decoupled weight decay coefficient (AdamW's default 1e-2).
        use_triton: None picks the fused Triton kernel for CUDA tensors and the reference otherwise;
            True forces Triton (on CPU only under TRITON_INTERPRET=1); False forces the reference.

    Raises:
        ValueError: if a tensor is not a flat contiguous float32 shard of param's shape, if step is
            not an int >= 1, if betas is not a pair, if the tensors are on different devices, or if
            use_triton=True cannot run.
    """
    _check(param, grad, exp_avg, exp_avg_sq, step, betas, "adamw_step")
    if not _pick_triton(use_triton, [param, grad, exp_avg, exp_avg_sq], "adamw_step"):
        adamw_step_reference(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay)
        return
    numel = param.numel()
    if numel == 0 or not launches():
        return
    beta1, beta2 = betas
    # The host scalars in float64, as torch forms them; Triton rounds float arguments to float32.
    lerp_weight = 1 - beta1
    _adamw_kernel[(triton.cdiv(numel, _BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, numel,
        1 - lr * weight_decay, lerp_weight, beta2, 1 - beta2, (1 - beta2**step) ** 0.5, eps,
        -(lr / (1 - beta1**step)),
        SMALL_LERP_WEIGHT=abs(lerp_weight) < 0.5, BLOCK=_BLOCK,
        # No contraction beyond the explicit fmas: p * decay + q must round twice, as in torch.
        enable_fp_fusion=False)
