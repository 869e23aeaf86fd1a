"""Fine-tuning: which dtype the frozen parameters are held in, as a plan choice.

[Note: frozen dtype] A model with frozen parameters (`ParamInfo.trainable` False: a LoRA base,
a frozen embedding) is priced as fine-tuning ([Note: frozen pricing] in cost_model/memory.py):
gradients, their data-parallel reduction and optimizer states for the trainable parameters
only, the parameters themselves (and ZeRO-3's gathers of them) for all. Under a 16-bit plan
the frozen ones can be held in two ways (`Plan.frozen_dtype`, [Note: frozen parameters] in
autoplan/runtime/engine.py):

- "" : as the trainable ones, an fp32 master each (4 bytes per element), cast to the compute
  dtype for the forward like any parameter. Saved, a frozen weight is bit-identical to its
  start;
- the compute dtype: the frozen base in 16-bit only (2 bytes per element), as LoRA set-ups run
  it (QLoRA's and PEFT's recipes keep the base in the compute dtype or lower). The compute
  reads the same 16-bit numbers either way, but an fp32 weight held in 16-bit is rounded.

The rule (agreed with the runtime): the compute dtype when nothing is lost -- the frozen
weights are already in the compute dtype (`weights_dtype`: a bf16 checkpoint for a bf16
plan) -- or when the fp32 variant fits nowhere on the devices (no plan without CPU offload
fits; a 16-bit base is preferred to offloading, which costs host transfers every step);
otherwise "", which changes nothing a weight holds. A spec that already names the compute
dtype keeps it; fp32 plans and models without frozen parameters are planned as they are, so
their plans are unchanged byte for byte.

`weights_dtype` must come from the caller: capture casts every floating parameter to the compute
dtype (api.meta_skeleton, [Note: shallow planning capture]), so the captured graph cannot say
what the weights were. None (not known) is taken as "may be fp32": nothing is rounded unless
the fp32 variant does not fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from autoplan.graph import CapturedGraph
from autoplan.spec import TrainingSpec

__all__ = ["has_frozen", "plan_frozen_dtype"]


def has_frozen(graph: CapturedGraph) -> bool:
    """True when some parameter (not a buffer) of `graph` is frozen."""
    return any(not p.trainable and not p.is_buffer for p in graph.params.values())


def plan_frozen_dtype(graph: CapturedGraph, spec: TrainingSpec,
                      run: Callable[[TrainingSpec, bool], object], *,
                      weights_dtype: str | None = None, offload_searched: bool = True):
    """The plan of `graph` with the frozen parameters' dtype chosen by [Note: frozen dtype].

    Args:
        graph, spec: what is planned; `spec.frozen_dtype` set to the compute dtype is kept.
        run: `run(spec, offload)` plans with that spec (`offload` False: no CPU offload
            searched) and returns the plan, or raises NoFeasiblePlan when nothing fits.
        weights_dtype: the dtype the frozen weights start in ("bfloat16" for a bf16
            checkpoint); None: not known.
        offload_searched: the caller searches CPU offload where nothing fits (no offload
            fixed); the fp32 variant is then tried without it first.

    Raises what `run` raises (NoFeasiblePlan from the 16-bit variant when neither fits).
    """
    from autoplan.solver.configurations import NoFeasiblePlan

    if not spec.mixed_precision or spec.frozen_dtype or not has_frozen(graph):
        return run(spec, offload_searched)
    sixteen = dataclasses.replace(spec, frozen_dtype=spec.dtype)
    if weights_dtype == spec.dtype:  # nothing is rounded
        return run(sixteen, offload_searched)
    try:
        return run(spec, False)
    except NoFeasiblePlan:  # the fp32 masters fit nowhere on the devices
        return run(sixteen, offload_searched)
