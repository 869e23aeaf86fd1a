"""torch's FP8 matmul, `torch._scaled_mm` (private in torch 2.13; torchao's float8 training calls
it the same way), for the FP8 linear ([Note: float8 recipe] in autoplan/float8.py)."""

from __future__ import annotations

import torch

__all__ = ["scaled_mm"]


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) in `out_dtype`, fp32 accumulation: a (M, K) FP8,
    row-major; b (K, N) FP8, column-major (CUDA's requirement); scale_a (M, 1) and scale_b
    (1, N) fp32 (rowwise) or 0-d (tensorwise). Raises RuntimeError where torch does (shapes,
    layouts, dims not multiples of 16 on CUDA, a GPU without FP8)."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
