"""Rank jobs of tests/test_capture_cache.py (ranks import them by name)."""

from __future__ import annotations

import torch
from torch import nn


class Stack(nn.Module):
    """Three identical blocks of Linear + tanh; forward(x (B, 8)) -> (B, 8)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def capture_together(directory: str) -> tuple[str, str]:
    """Every rank captures the same model into one cache directory at the same moment;
    returns (how, the graph's code)."""
    import torch.distributed as dist

    from autoplan.capture.cache import CaptureCache, cached_capture

    with torch.device("meta"):
        model = Stack()
    dist.barrier()
    graph, how = cached_capture(model, (torch.zeros(4, 8, device="meta"),), model_name="Stack",
                                planning=False, cache=CaptureCache(directory))
    return how, graph.gm.code
