"""Triton kernels for what the rewritten (tensor-parallel) graphs need and a compiler cannot fuse
across collectives: vocab-parallel cross-entropy, RMSNorm, SwiGLU gating, AdamW on flat shards;
and the grouped GEMM that the routed-experts op (autoplan/experts.py) runs on CUDA
(grouped_gemm.py, its reference the op's eager math).

Each module holds the Triton kernel(s), a torch reference of the same math, and a dispatcher that
takes ``use_triton``: None (the default) runs Triton for CUDA tensors and the reference
otherwise, True forces Triton, False forces the reference.

Triton on CPU tensors needs the Triton interpreter, which ``TRITON_INTERPRET=1`` selects only if
it is set before triton is first imported: triton.jit picks the interpreter or the compiler when
it decorates, and triton.language decorates its own helpers (tl.sum, ...) at import.
"""

from kernels.adamw import adamw_step, adamw_step_reference
from kernels.cross_entropy import (
    cross_entropy_grad,
    cross_entropy_grad_reference,
    cross_entropy_loss_from_stats,
    cross_entropy_stats,
    cross_entropy_stats_reference,
    vocab_parallel_cross_entropy,
)
from kernels.grouped_gemm import (
    grouped_experts,
    grouped_experts_backward,
    grouped_mm,
    grouped_mm_reference,
    grouped_weight_grad,
    grouped_weight_grad_reference,
)
from kernels.rms_norm import rms_norm, rms_norm_reference
from kernels.swiglu import swiglu, swiglu_reference

__all__ = [
    "adamw_step",
    "adamw_step_reference",
    "cross_entropy_grad",
    "cross_entropy_grad_reference",
    "cross_entropy_loss_from_stats",
    "cross_entropy_stats",
    "cross_entropy_stats_reference",
    "grouped_experts",
    "grouped_experts_backward",
    "grouped_mm",
    "grouped_mm_reference",
    "grouped_weight_grad",
    "grouped_weight_grad_reference",
    "rms_norm",
    "rms_norm_reference",
    "swiglu",
    "swiglu_reference",
    "vocab_parallel_cross_entropy",
]
