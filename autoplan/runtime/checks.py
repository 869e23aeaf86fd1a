"""Build-time check that what the runtime built is what the plan says (docs/design.md, house
rule 14): the tp placement of every parameter, the ZeRO stage's dp sharding (an expert slice
under ep: Shard(0) on the ep mesh instead), the dtype each parameter is held in (trainable: the
master dtype; frozen: `Plan.frozen_dtype` when set), the compute dtype, and the linears that
run in FP8 (`Plan.float8_linears`: the FP8 linear calls in the built modules, counted).
A mismatch is a `PlanMismatchError` naming the parameter and both values, at build time.
`check_context_parallel` refuses, before building, a cp plan the runtime cannot run."""

from __future__ import annotations

import torch
import torch.fx
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from autoplan.float8 import float8_addmm, float8_linear
from autoplan.passes.rng import random_op_indices
from autoplan.plan import parse_placement
from autoplan.runtime.precision import Precision
from autoplan.runtime.step_inputs import loss_mode

__all__ = ["PlanMismatchError", "check_against_plan", "check_context_parallel",
           "context_parallel_refusal", "FrozenSetChangedError", "check_frozen_set"]

_FLOATING = {"float32", "bfloat16", "float16", "float64"}


class PlanMismatchError(ValueError):
    """The built model differs from its plan (the message names what and where)."""


def _axis_placement(p: torch.Tensor, axis: str):
    if not isinstance(p, DTensor):
        return None
    names = p.device_mesh.mesh_dim_names or ()
    return p.placements[names.index(axis)] if axis in names else None


def check_context_parallel(plan, graph, inputs, loss_fn, compile: bool) -> None:
    """Refuse, before anything is set up, a cp > 1 plan this runtime cannot run as planned
    ([Note: context parallelism] in autoplan/cost_model/context_parallel.py; the graph's attention and
    positions are checked where they are rewritten, passes/context_parallel.py). `graph`: the
    captured graph, `inputs`: the planned batch (InputSpec), `loss_fn`: the user's or None.

    Raises what `context_parallel_refusal` returns: NotImplementedError for compile with cp,
    ValueError for a batch or loss that cannot be cut along the sequence and for a model with
    random ops (dropout)."""
    if plan.mesh.cp == 1:
        return
    refusal = context_parallel_refusal(graph, inputs, loss_fn, compile,
                                       f"the plan {plan.mesh} has context parallelism "
                                       f"(cp {plan.mesh.cp})")
    if refusal is not None:
        raise refusal


def context_parallel_refusal(graph, inputs, loss_fn, compile: bool,
                             subject: str = "context parallelism") -> Exception | None:
    """Why this runtime cannot run context parallelism for this model, batch and loss, as the
    exception to raise (its message starts with `subject`), or None when it can: compile=True
    (NotImplementedError); a batch other than the token-LM form `step(input_ids, labels)`, the
    model's own loss or a user's loss_fn ([Note: step loss]), random ops (dropout), and no
    position source in the graph (ValueError). `@autoparallel` plans cp 1 where this is not
    None, and `check_context_parallel` raises it for a cp plan."""
    if compile:
        return NotImplementedError(
            f"{subject} with compile=True (the K/V gather is not traced by torch.compile "
            "here): this runtime runs cp eagerly, with data, tensor and pipeline parallelism "
            "and ZeRO; build with compile=False or plan with cp=1")
    if inputs.form != "tokens":
        return ValueError(
            f"{subject}: cp takes the token-LM batch step(input_ids, labels), each cut along "
            f"the sequence; this plan's batch is a {inputs.describe()}, whose sequence dims "
            "the runtime cannot tell; train with cp=1")
    mode = loss_mode(graph, inputs, loss_fn)
    if mode != "tokens":
        why = {"model": "the model's own loss shifts its labels inside the model, per local "
                        "chunk, and would pair each chunk's last token with the wrong target",
               "user": "a loss_fn is a mean over the rank's tokens, and cp ranks hold "
                       "different shares of every sample's trained tokens"}[mode]
        return ValueError(
            f"{subject}: cp trains on the token cross-entropy of the logits against the "
            f"batch's labels, summed per rank over the global batch's trained tokens; {why}. "
            "Leave loss_fn out and give labels of the next tokens (step(input_ids, labels)), "
            "or train with cp=1")
    random_ops = random_op_indices(graph.gm, batch_size=graph.batch_size)
    if random_ops:
        return ValueError(
            f"{subject}: a model with random ops ({len(random_ops)}: "
            f"{sorted(random_ops)[:3]}...): the random-op stream is keyed by sample ([Note: RNG "
            "contract] in autoplan/passes/rng.py) and a cp rank holds part of each sample, so "
            "its dropout masks would differ from one process's; set the model's dropout to 0 "
            "or train with cp=1")
    return None


def check_against_plan(model) -> None:
    """Check a DistributedModel against its plan; raises PlanMismatchError."""
    plan = model.plan
    precision = Precision.of(plan.dtype, plan.frozen_dtype)  # what the plan says
    problems = []
    for _, module in model.stages:
        wrapped = isinstance(module, FSDPModule)
        if (plan.mesh.dp_shard > 1 or precision.mixed) and list(module.parameters()) and \
                not wrapped:
            problems.append(f"a stage is not wrapped by FSDP2 (dp {plan.mesh.dp}, cp "
                            f"{plan.mesh.cp}, "
                            f"dtype {plan.dtype})")
        for fqn, p in module.named_parameters():
            want_dtype = precision.param_dtype(p.requires_grad) if p.is_floating_point() \
                else p.dtype
            if p.dtype != want_dtype:
                role = "trainable" if p.requires_grad else "frozen"
                problems.append(f"{fqn}: a {role} parameter held in {p.dtype}, the plan holds "
                                f"{role} parameters in {want_dtype}")
            if plan.mesh.tp > 1:
                got = _axis_placement(p, "tp")
                want = parse_placement(plan.placement_of(fqn))
                if got != want:
                    problems.append(f"{fqn}: tp placement {got}, the plan says {want}")
            if _axis_placement(p, "ep") is not None:
                # an expert slice under ep: whole, outside ZeRO (runtime/expert_parallel.py)
                if _axis_placement(p, "ep") != Shard(0):
                    problems.append(f"{fqn}: ep placement {_axis_placement(p, 'ep')}, expert "
                                    "parallelism splits the experts Shard(0)")
            elif plan.mesh.dp_shard > 1 and p.is_floating_point():
                # the data-parallel axis: dp, or dp x cp flattened (runtime/engine.py)
                got = _axis_placement(p, "dp" if plan.mesh.cp == 1 else "dp_cp")
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
    problems += _float8_problems(model)
    if problems:
        raise PlanMismatchError(f"the built model differs from plan {plan.mesh}, ZeRO-"
                                f"{plan.zero_stage}, {plan.dtype}: " + "; ".join(problems[:6]))


def _float8_problems(model) -> list[str]:
    """The plan's FP8 linears held by this rank's stages against the FP8 linear calls in the
    modules built ([Note: float8 recipe] in autoplan/float8.py)."""
    held = set().union(*(model._stage_param_fqns.get(i, set()) for i, _ in model.stages))
    want = set(model.plan.float8_linears) & held
    calls = sum(1 for _, module in model.stages for m in module.modules()
                if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
                if n.op == "call_function" and n.target in (float8_linear, float8_addmm))
    made = set(model.float8_linears)
    if calls == len(want) and made == want:
        return []
    return [f"{calls} FP8 linear calls built for {sorted(made)[:3]}, the plan runs "
            f"{len(want)} linears of this rank in FP8: {sorted(want)[:3]}"]


class FrozenSetChangedError(PlanMismatchError):
    """The model's frozen parameters (`requires_grad=False`) are not those it was planned and
    built with."""


def check_frozen_set(graph, module: torch.nn.Module) -> None:
    """Refuse a model whose frozen set changed after planning ([Note: frozen parameters] in
    autoplan/runtime/engine.py): the plan priced gradients and optimizer states for the
    parameters that trained then, and the runtime's optimizer holds exactly those.

    `graph`: the CapturedGraph the runtime was built from (every block); `module`: the user's
    model (`AutoParallel.module`). Parameters the graph does not name are not compared.
    Raises FrozenSetChangedError naming the parameters on each side (at most 8 each)."""
    planned = {fqn: info.trainable for fqn, info in graph.params.items() if not info.is_buffer}
    froze, unfroze = [], []
    for fqn, p in module.named_parameters():
        was = planned.get(fqn)
        if was is None or was == p.requires_grad:
            continue
        (froze if was else unfroze).append(fqn)
    if not froze and not unfroze:
        return
    parts = []
    if froze:
        parts.append(f"{len(froze)} frozen since: {froze[:8]}")
    if unfroze:
        parts.append(f"{len(unfroze)} trainable since: {unfroze[:8]}")
    raise FrozenSetChangedError(
        f"{type(module).__name__}: the parameters that train changed after the model was "
        f"planned and built ({'; '.join(parts)}); the plan's gradients, their reduction and "
        "the optimizer's states are for the set it was planned with. To train another set, "
        "write the weights out (save_pretrained) and wrap the model again with the new "
        "requires_grad flags, or set them back")
