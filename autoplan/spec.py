"""What to train: the training setup that, with the model and the topology, defines a plan."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TrainingSpec", "precision_recipe", "ROUTING_SKEW"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

ROUTING_SKEW = 1.52
"""The default `TrainingSpec.routing_skew`: 1 + MaxVio, MaxVio = max_i load_i / mean load - 1
over the experts, measured at 0.52 for a 3B-parameter MoE (0.72 at 1B) trained with the usual
auxiliary balancing loss, and at 0.04 with DeepSeek's auxiliary-loss-free balancing (Wang et
al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts", arXiv
2408.15664, the main results' table: MaxVio_global over the validation set; figures as
recalled when this default was set, the paper's text was not at hand to re-check). The auxiliary-loss figure, as
Mixtral and Qwen3 balance; a model balanced as DeepSeek-V3 is (arXiv 2412.19437, section
2.1.2) may set 1.04. Per expert, taken as the busiest ep rank's share: exact with one expert
per rank, an overestimate for a rank that holds several (their loads average), an
underestimate of a single step's peak (a batch's is above the validation set's); [Note:
expert parallelism] in autoplan/cost_model/expert_parallel.py."""


def precision_recipe(dtype: str, frozen_dtype: str = "", num_float8_linears: int = 0) -> str:
    """What the runtime does for a compute dtype, in words ([Note: precision recipe] in
    autoplan/runtime/precision.py); `frozen_dtype` as `Plan.frozen_dtype` (the compute dtype:
    frozen parameters held in it only); `num_float8_linears`: the linears run in FP8 ([Note:
    float8 recipe] in autoplan/float8.py). Raises ValueError for an unknown dtype."""
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
    if num_float8_linears:
        text += (f"; {num_float8_linears} linears in FP8 (e4m3, power-of-two scales per row, "
                 f"the input gradient's weight per tensor, weight gradients in {name})")
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
        routing_skew: the busiest expert-holding rank's routed (token, choice) pairs over the
            mean rank's (>= 1; dimensionless), for a mixture-of-experts model: the expert
            compute and the all-to-alls of expert parallelism run at the busiest rank's pace,
            and its receive buffers hold that many pairs ([Note: expert parallelism] in
            cost_model/expert_parallel.py). Default ROUTING_SKEW (a published measurement);
            1.0 prices balanced routing. No effect on a dense model.
        float8: the FP8 linear layers of the `float8` recipe ([Note: float8 recipe] in
            autoplan/float8.py): "off" (default), "on" (every eligible linear whose planned
            placements run it) or "auto" (those where it is faster); needs dtype "bfloat16"
            and a device with a "float8" peak ([Note: float8 pricing] in
            cost_model/float8.py).
        float8_only: with float8 "on", the weight FQNs of the only linears that may run in
            FP8 -- a plan's own `float8_linears`, to reprice it as it runs (solver `reprice`);
            () (default): every eligible one.
    """

    global_batch: int
    seq_len: int
    dtype: str = "float32"
    optimizer: str = "adamw"
    max_memory_fraction: float = 0.9
    frozen_dtype: str = ""
    routing_skew: float = ROUTING_SKEW
    float8: str = "off"
    float8_only: tuple[str, ...] = ()

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
        if self.float8 not in ("off", "on", "auto"):
            raise ValueError(f"training spec: float8 {self.float8!r} is not one of 'off', "
                             "'on', 'auto'")
        if self.float8_only and self.float8 != "on":
            raise ValueError(f"training spec: float8_only ({len(self.float8_only)} linears) "
                             f"with float8 {self.float8!r}; it narrows float8 'on'")
        if self.float8 != "off" and self.dtype != "bfloat16":
            raise ValueError(f"training spec: float8 {self.float8!r} under dtype "
                             f"{self.dtype!r}; the float8 recipe runs its other ops in "
                             "bfloat16: give dtype='bfloat16'")
        if isinstance(self.routing_skew, bool) or not isinstance(
                self.routing_skew, (int, float)) or not 1.0 <= self.routing_skew < float("inf"):
            raise ValueError(f"training spec: routing_skew {self.routing_skew!r} must be a "
                             "number >= 1 (the busiest rank's routed tokens over the mean)")

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def mixed_precision(self) -> bool:
        return self.dtype != "float32"
