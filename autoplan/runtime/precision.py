"""The precision recipe a plan's dtype stands for, and dynamic loss scaling for fp16.

[Note: precision recipe] `dtype="bfloat16"` / `"float16"` means mixed precision as Megatron-LM
and torchtitan train (Micikevicius et al. 2018, "Mixed Precision Training"):
- the runtime graph is captured with the parameters in the 16-bit dtype, so forward and
  backward run as the model runs with 16-bit weights (the ops where the model upcasts itself --
  norms, softmax, rotary tables -- upcast as written; the loss is computed in fp32);
- the parameters the optimizer steps are fp32 master weights, and AdamW's states are fp32;
- FSDP2's MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32) casts the masters for
  compute and reduces gradients across dp in fp32 (also at dp 1, where it only casts);
- tensor-parallel partial sums are reduced in the dtype of the activations (16-bit), as the
  plan prices them;
- fp16 adds dynamic loss scaling (`LossScaler`);
- frozen parameters (`requires_grad=False`) are fp32 masters too, unless the plan holds them in
  the compute dtype (`Plan.frozen_dtype`): then they are 16-bit only -- the value the compute
  reads either way, a 16-bit cast of the fp32 weight -- and FSDP2's policy leaves them
  uncast (it asks a uniform original dtype of the trainable parameters only;
  torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py `_init_mp_dtypes`).
`"float32"` trains in fp32 throughout.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from autoplan.spec import precision_recipe

__all__ = ["Precision", "LossScaler", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Precision:
    """The recipe of one compute dtype ([Note: precision recipe]).

    Attributes:
        compute_dtype: the dtype forward and backward run in.
        master_dtype: dtype of the parameters the optimizer steps (None: as captured, fp32).
        loss_scaling: dynamic loss scaling (fp16 only).
        frozen_dtype: dtype of the frozen parameters where it is not the master dtype (the
            compute dtype under a plan with `frozen_dtype` set), else None.
    """

    compute_dtype: torch.dtype
    master_dtype: torch.dtype | None
    loss_scaling: bool
    frozen_dtype: torch.dtype | None = None

    @staticmethod
    def of(dtype: str, frozen_dtype: str = "") -> "Precision":
        """The recipe of compute dtype `dtype`, frozen parameters held in `frozen_dtype`
        ("": as the trainable ones; else `dtype` itself, as `Plan.frozen_dtype`).

        Raises ValueError for a dtype name other than float32, bfloat16, float16, and for a
        `frozen_dtype` other than "" or `dtype`."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
        if frozen_dtype not in ("", dtype):
            raise ValueError(f"frozen_dtype {frozen_dtype!r} is neither '' nor the compute "
                             f"dtype {dtype!r}")
        compute = DTYPES[dtype]
        mixed = compute != torch.float32
        frozen = compute if mixed and frozen_dtype == dtype else None
        return Precision(compute, torch.float32 if mixed else None, compute == torch.float16,
                         frozen)

    def param_dtype(self, trainable: bool) -> torch.dtype:
        """The dtype a floating parameter is held in: the master dtype (the compute dtype
        under fp32), or `frozen_dtype` for a frozen one when set."""
        if not trainable and self.frozen_dtype is not None:
            return self.frozen_dtype
        return self.master_dtype or self.compute_dtype

    @property
    def mixed(self) -> bool:
        return self.master_dtype is not None

    def policy(self) -> MixedPrecisionPolicy | None:
        """FSDP2's policy for this recipe (None for fp32)."""
        if not self.mixed:
            return None
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)

    def describe(self) -> str:
        """The recipe in words (autoplan.spec.precision_recipe, which the report prints)."""
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                torch.float16: "float16"}[self.compute_dtype]
        frozen = "" if self.frozen_dtype is None else name
        return precision_recipe(name, frozen)


class LossScaler:
    """Dynamic loss scaling for fp16 (torch.amp.GradScaler's algorithm and defaults: initial
    scale 2**16, halve on overflow and skip the step, double after 2000 good steps), over
    every rank: one rank's overflow skips the step on all ranks.

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval: as GradScaler's.
        device: the rank's device; the overflow flag is all-reduced there (NCCL: CUDA).
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 device: torch.device | str = "cpu"):
        self.scale = float(init_scale)
        self.device = torch.device(device)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._good_steps = 0

    @torch.no_grad()
    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide the local gradients by the scale; True when no rank found inf/nan (the
        step may proceed). Updates the scale."""
        found = torch.zeros((), device=self.device)
        for g in grads:
            g.mul_(1.0 / self.scale)
            if not torch.isfinite(g).all():
                found.fill_(1.0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        if found.item():
            self.scale *= self.backoff_factor
            self._good_steps = 0
            return False
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0
        return True
