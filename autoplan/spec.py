"""What to train: the training setup that, with the model and the topology, defines a plan."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TrainingSpec", "precision_recipe"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def precision_recipe(dtype: str, frozen_dtype: str = "") -> str:
    """What the runtime does for a compute dtype, in words ([Note: precision recipe] in
    autoplan/runtime/precision.py); `frozen_dtype` as `Plan.frozen_dtype` (the compute dtype:
    frozen parameters held in it only). Raises ValueError for an unknown dtype."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} not in {sorted(_DTYPE_BYTES)}")
    if dtype == "float32":
        return "fp32 weights, activations, gradients and optimizer states"
    name = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    masters = "fp32 master weights and AdamW states" if frozen_dtype != dtype else (
        f"fp32 master weights and AdamW states of the trainable parameters, frozen ones held "
        f"in {name} only")
    text = (f"{name} forward/backward, {masters}, dp gradient reduction in fp32, tp partial "
            f"sums in {name}")
    return text + (", dynamic loss scaling" if dtype == "float16" else "")


@dataclass(frozen=True)
class TrainingSpec:
    """One optimizer step.

    Attributes:
        global_batch: samples per optimizer step over all ranks.
        seq_len: tokens per sample.
        dtype: compute dtype ("float32", or "bfloat16"/"float16" for mixed precision with fp32
            master weights and optimizer states).
        optimizer: "adamw" (2 fp32 states per parameter) or "sgd" (none).
        max_memory_fraction: fraction of device memory the plan may use (headroom for the
            allocator and the framework).
        frozen_dtype: the dtype frozen parameters (`requires_grad=False`) are held in: ""
            (default) as the trainable ones (fp32 masters under a 16-bit dtype), or `dtype`
            (the frozen base in 16-bit only). `autoplan.solver.plan` chooses it when left ""
            ([Note: frozen dtype] in solver/planner.py) and records it in `Plan.frozen_dtype`;
            the cost model prices what it says ([Note: frozen pricing] in
            cost_model/memory.py).
    """

    global_batch: int
    seq_len: int
    dtype: str = "float32"
    optimizer: str = "adamw"
    max_memory_fraction: float = 0.9
    frozen_dtype: str = ""

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.seq_len < 1:
            raise ValueError(
                f"training spec: global_batch={self.global_batch} and seq_len={self.seq_len} "
                "must be >= 1")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"training spec: dtype {self.dtype!r} not in {sorted(_DTYPE_BYTES)}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"training spec: optimizer {self.optimizer!r} not in ['adamw', 'sgd']")
        if self.frozen_dtype not in ("", self.dtype):
            raise ValueError(f"training spec: frozen_dtype {self.frozen_dtype!r} is neither '' "
                             f"(as the trainable parameters) nor the compute dtype "
                             f"{self.dtype!r}")

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def mixed_precision(self) -> bool:
        return self.dtype != "float32"
