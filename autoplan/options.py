"""`PlanOptions`: what `@autoparallel` was given (autoplan/api.py `autoparallel` documents
each field)."""

from __future__ import annotations

import dataclasses
from typing import Callable

__all__ = ["PlanOptions"]


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """What `@autoparallel` was given; see `autoparallel` for the fields."""

    global_batch: int
    seq_len: int | None = None
    cluster: str = "local-cpu"
    num_nodes: int | None = None
    world_size: int | None = None
    dtype: str | None = None
    optimizer: Callable | None = None
    lr_scheduler: Callable | None = None
    loss_fn: Callable | None = None
    max_grad_norm: float | None = None
    device_memory_bytes: float | None = None
    weights: str | None = None
    adapter: str | None = None
    init: Callable | None = None
    seed: int | None = None
    kernels: bool = True
    compile: bool = False
    example_batch: object = None
    batch_dims: tuple[tuple[str, int | None], ...] = ()
    overrides: tuple[tuple[str, object], ...] = ()
