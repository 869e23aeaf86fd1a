"""The kernels as graph ops: ``torch.ops.autoplan.rms_norm`` and ``torch.ops.autoplan.swiglu``.

Registered with ``torch.library.custom_op`` so that FX, make_fx and torch.export keep each as one
node (the exported per-rank graphs name it), with a fake impl (shapes on meta/fake tensors) and an
autograd formula whose backward is one more op (``rms_norm_backward``, ``swiglu_backward``). Each
impl dispatches as kernels/_dispatch.py does with ``use_triton=None``: the Triton kernel for CUDA
tensors, the torch reference elsewhere (the CPU ranks here; the interpreter is for tests only).

The ops take plain (local) tensors; autoplan/passes/kernels.py puts them into the rewritten graphs
behind a wrapper that unwraps DTensors to their shards where the op is local.
"""

from __future__ import annotations

import torch

from kernels.rms_norm import rms_norm, rms_norm_backward
from kernels.swiglu import swiglu, swiglu_backward

__all__ = ["rms_norm_op", "rms_norm_backward_op", "swiglu_op", "swiglu_backward_op"]


@torch.library.custom_op("autoplan::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kernels.rms_norm as one op: x (..., H), weight (H,) -> (..., H) of dtype
    promote(x.dtype, weight.dtype)."""
    return rms_norm(x, weight, eps).contiguous()


@rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("autoplan::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.rms_norm_backward as one op: (dx (..., H), dweight (H,))."""
    dx, dw = rms_norm_backward(dy, x, weight, eps)
    return dx.contiguous(), dw.contiguous()


@rms_norm_backward_op.register_fake
def _(dy, x, weight, eps):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_grad(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(dy, x, weight, ctx.eps)
    return dx, dw, None


rms_norm_op.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


@torch.library.custom_op("autoplan::swiglu", mutates_args=())
def swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """kernels.swiglu as one op: silu(gate) * up, gate's shape and dtype."""
    return swiglu(gate, up).contiguous()


@swiglu_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("autoplan::swiglu_backward", mutates_args=())
def swiglu_backward_op(dy: torch.Tensor, gate: torch.Tensor,
                       up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.swiglu_backward as one op: (d gate, d up)."""
    dgate, dup = swiglu_backward(dy, gate, up)
    return dgate.contiguous(), dup.contiguous()


@swiglu_backward_op.register_fake
def _(dy, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx, dy):
    gate, up = ctx.saved_tensors
    return swiglu_backward_op(dy, gate, up)


swiglu_op.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)
