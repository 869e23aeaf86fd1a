"""Build-time check that what the runtime built is what the plan says (STYLE rule 14): the
tp placement of every parameter, the ZeRO stage's dp sharding (an expert slice under ep:
Shard(0) on the ep mesh instead), the master and compute dtypes.
A mismatch is a `PlanMismatchError` naming the parameter and both values, at build time."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from autoplan.plan import parse_placement

__all__ = ["PlanMismatchError", "check_against_plan", "check_context_parallel"]

_FLOATING = {"float32", "bfloat16", "float16", "float64"}


class PlanMismatchError(ValueError):
    """The built model differs from its plan (the message names what and where)."""


def _axis_placement(p: torch.Tensor, axis: str):
    if not isinstance(p, DTensor):
        return None
    names = p.device_mesh.mesh_dim_names or ()
    return p.placements[names.index(axis)] if axis in names else None


def check_context_parallel(plan) -> None:
    """NotImplementedError for a plan with context parallelism (cp > 1): the planner prices
    it ([Note: context parallelism] in autoplan/solver/context.py), this runtime does not run
    it yet, and building it without would train something else than the plan says."""
    if plan.mesh.cp > 1:
        raise NotImplementedError(
            f"the plan has context parallelism (cp {plan.mesh.cp} in {plan.mesh}), which this "
            "runtime does not run yet: missing are the sequence split of each batch over the "
            "cp axis (chunks i and 2 cp - 1 - i on cp rank i, labels shifted before the "
            "split), the matching position ids, rotary tables and causal-mask rows, and the "
            "all-gather of K and V over the cp axis inside attention; plan with cp=1 (the "
            "default of @autoparallel) to train")


def check_against_plan(model) -> None:
    """Check a DistributedModel against its plan; raises PlanMismatchError."""
    plan, precision = model.plan, model.precision
    problems = []
    for _, module in model.stages:
        wrapped = isinstance(module, FSDPModule)
        if (plan.mesh.dp > 1 or precision.mixed) and list(module.parameters()) and not wrapped:
            problems.append(f"a stage is not wrapped by FSDP2 (dp {plan.mesh.dp}, "
                            f"dtype {plan.dtype})")
        for fqn, p in module.named_parameters():
            want_dtype = precision.master_dtype or p.dtype
            if p.dtype != want_dtype:
                problems.append(f"{fqn}: master weights are {p.dtype}, the recipe needs "
                                f"{want_dtype}")
            if plan.mesh.tp > 1:
                got = _axis_placement(p, "tp")
                want = parse_placement(plan.placement_of(fqn))
                if got != want:
                    problems.append(f"{fqn}: tp placement {got}, the plan says {want}")
            if _axis_placement(p, "ep") is not None:
                # an expert slice under ep: whole, outside ZeRO (runtime/moe.py)
                if _axis_placement(p, "ep") != Shard(0):
                    problems.append(f"{fqn}: ep placement {_axis_placement(p, 'ep')}, expert "
                                    "parallelism splits the experts Shard(0)")
            elif plan.mesh.dp > 1 and p.is_floating_point():
                got = _axis_placement(p, "dp")
                sharded = got is not None and (got.is_shard() or "Shard" in type(got).__name__)
                if sharded != (plan.zero_stage >= 2):
                    problems.append(f"{fqn}: dp placement {got}, ZeRO-{plan.zero_stage} "
                                    f"{'shards' if plan.zero_stage >= 2 else 'replicates'} it")
    # The runtime graph runs in the compute dtype: its floating parameters were captured so.
    want = str(precision.compute_dtype).removeprefix("torch.")
    wrong = sorted(f"{p.fqn} ({p.dtype})" for p in model.graph.params.values()
                   if not p.is_buffer and p.dtype in _FLOATING and p.dtype != want)
    if wrong:
        problems.append(f"the runtime graph was captured with parameters not in {want}: "
                        f"{wrong[:3]}")
    if problems:
        raise PlanMismatchError(f"the built model differs from plan {plan.mesh}, ZeRO-"
                                f"{plan.zero_stage}, {plan.dtype}: " + "; ".join(problems[:6]))
