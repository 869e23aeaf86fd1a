"""Plain MLPs for planner and solver tests: no attention, no embeddings, float inputs.

`MLP` is a stack of identical Linear -> GELU -> Linear blocks held in an `nn.ModuleList`
(`blocks`), so `autoplan.capture` finds the repeated blocks like a transformer's layers.
`WideMLP` is one such block on its own: the textbook tensor-parallel case (the first Linear
split by columns, the second by rows; Shoeybi et al. 2019, "Megatron-LM", section 3).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MLPBlock", "MLP", "WideMLP"]


class MLPBlock(nn.Module):
    """`fc2(gelu(fc1(x)))`: x (..., dim) -> (..., dim) through a (..., hidden_dim) activation."""

    def __init__(self, dim: int, hidden_dim: int, *, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))  # (..., hidden_dim)
        return self.fc2(h)  # (..., dim)


class MLP(nn.Module):
    """`num_blocks` MLPBlocks applied in sequence: x (..., dim) -> (..., dim).

    Raises:
        ValueError: a size below 1.
    """

    def __init__(self, dim: int, hidden_dim: int, num_blocks: int = 2, *,
                 bias: bool = True) -> None:
        super().__init__()
        if min(dim, hidden_dim, num_blocks) < 1:
            raise ValueError(f"MLP sizes must be >= 1, got dim={dim}, hidden_dim={hidden_dim}, "
                             f"num_blocks={num_blocks}")
        self.blocks = nn.ModuleList(
            [MLPBlock(dim, hidden_dim, bias=bias) for _ in range(num_blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class WideMLP(MLPBlock):
    """A single Linear -> GELU -> Linear block with no repeated structure (num_layers = 0)."""
