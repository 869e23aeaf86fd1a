"""torch.distributed building blocks the engine composes: data parallelism by ZeRO stage,
pipeline schedules, a ZeRO-1 optimizer, global gradient clipping, and the forward of a
tp-sharded stage (local tensors in and out, DTensor inside).

Library first: ZeRO-0/2/3 are FSDP2's `replicate` / `fully_shard`; schedules are
`torch.distributed.pipelining`'s. ZeRO-1 has no FSDP2 spelling, so `ShardedOptimizer` is ours
(runtime/zero1.py: states partitioned in equal parts, [Note: ZeRO-1 partition]; torch's
ZeroRedundancyOptimizer owns whole parameters and does not take DTensor parameters).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp import fully_shard as _fully_shard
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from autoplan._torch_compat import (chunk_spec, implicit_replication,
                                   in_flight_interleaved_schedule_class,
                                   in_flight_pipeline_stage_class, pipeline_eval,
                                   replicate_module, unshard_async)
from autoplan.options import INTERLEAVED_SCHEDULES
from autoplan.passes.regather import held_sharded
from autoplan.plan import parse_placement
from autoplan.runtime.zero1 import ShardedOptimizer

__all__ = ["replicate", "fully_shard", "prefetch_forward", "ShardedOptimizer", "build_schedule",
           "clip_grad_norm", "pipeline_eval", "local_tensor", "owning_outputs", "tp_stage_forward"]


def replicate(module: nn.Module, dp_mesh, *, mp_policy=None, ignored_params=None) -> nn.Module:
    """ZeRO-0: parameters replicated on the dp axis, gradients all-reduced (averaged);
    `mp_policy`: FSDP2's MixedPrecisionPolicy (None: fp32); `ignored_params`: parameters left
    alone (expert weights under expert parallelism, runtime/expert_parallel.py)."""
    module = replicate_module(module, dp_mesh, mp_policy=mp_policy,
                              ignored_params=ignored_params)
    return guard_unit_input_grads(module)


class _UnitInputGrads(torch.autograd.Function):
    """Identity on a unit's DTensor inputs; in backward a plain-tensor gradient of one of them
    (FSDP2's materialized zeros, [Note: unit inputs without a gradient]) becomes None."""

    @staticmethod
    def forward(ctx, *inputs):
        ctx.set_materialize_grads(False)
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        out = []
        for g in grads:
            if g is not None and not isinstance(g, DTensor):
                if bool(g.any()):
                    raise RuntimeError(
                        f"a DTensor input of an FSDP2 unit received a plain-tensor gradient "
                        f"{tuple(g.shape)} that is not zero: it would be accumulated without "
                        "its placement; report this model to autoplan")
                g = None
            out.append(g)
        return tuple(out)


def guard_unit_input_grads(module: nn.Module) -> nn.Module:
    """`module` (an FSDP2 unit: `replicate` / `fully_shard` applied) with its DTensor inputs
    passed through `_UnitInputGrads` before FSDP2's pre-forward hook sees them.

    [Note: unit inputs without a gradient]
    FSDP2 passes a unit's inputs through one autograd Function (`RegisterPostBackwardFunction`,
    which runs the unit's post-backward). For an input the unit gives no gradient (unused
    there, or used only where no gradient flows) autograd materializes the missing gradient
    as zeros of a *plain* tensor, whatever the input's type. Where all of a DTensor's
    gradients are such zeros (a tensor handed to every block and used by none; T5's position
    bias in each decoder block while the attention dropout dropped the mask's gradient), the
    sum is a plain tensor, and a DTensor parameter upstream receives a plain gradient: FSDP2
    fails ("Expected DTensor"). The identity in front of FSDP2's (the hook is prepended after
    FSDP2's own) turns such a gradient back into None -- what the unit produced, as one
    process would have it -- and refuses one that is not zero, which no path of ours makes.
    tests/test_fsdp_units.py.
    """
    def pre_forward(_module, args, kwargs):
        if not torch.is_grad_enabled():
            return None
        flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        at = [i for i, t in enumerate(flat) if isinstance(t, DTensor) and t.requires_grad]
        if not at:
            return None
        for i, t in zip(at, _UnitInputGrads.apply(*(flat[i] for i in at))):
            flat[i] = t
        return torch.utils._pytree.tree_unflatten(flat, spec)

    module.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
    return module


def fully_shard(module: nn.Module, dp_mesh, *, reshard_after_forward: bool,
                mp_policy=None, ignored_params=None, offload: bool = False) -> nn.Module:
    """ZeRO-3 (reshard_after_forward=True) or ZeRO-2 (False) with FSDP2 on the dp axis;
    `mp_policy`: FSDP2's MixedPrecisionPolicy (None: fp32); `ignored_params`: parameters
    FSDP2 leaves alone; `offload`: FSDP2's CPUOffloadPolicy -- sharded parameters, their
    gradients and so the optimizer states in host memory, each shard copied to the device for
    its all-gather ([Note: offload] in autoplan/cost_model/offload.py). Pinned host memory needs
    an accelerator, so it is pinned only when the mesh is not on CPU."""
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=dp_mesh.device_type != "cpu")
    if ignored_params:
        kwargs["ignored_params"] = set(ignored_params)
    module = _fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                          **kwargs)
    return guard_unit_input_grads(module)


def prefetch_forward(units: list[nn.Module]) -> None:
    """Each FSDP2 unit of `units` (the blocks of a stage, in the order they run) issues the
    next one's parameter all-gather right after its own, without waiting for it
    ([Note: forward prefetch]).

    Note [forward prefetch]: FSDP2 prefetches the backward's all-gathers by itself (the next
    unit in reverse post-forward order), but in the forward it issues a unit's all-gather in
    that unit's own pre-forward, and by default (`unshard_async_op` False) as a blocking
    collective: on GPUs the all-gather stream and a host running ahead of the device overlap
    it with the previous unit's compute, on gloo nothing does -- the rank waits for each
    block's parameters before computing it. So the runtime sets both explicitly: block i's
    pre-forward issues block i + 1's all-gather (`FSDPModule.set_modules_to_forward_prefetch`,
    one unit ahead, as torchtitan's explicit prefetching), and every unit's all-gathers are
    issued with async_op=True and waited for where the unit runs
    (`_torch_compat.unshard_async`), so that gloo's own thread carries block i + 1's while
    block i computes (and block i - 1's while block i runs its backward). Memory: with
    async_op a unit's all-gather buffer is freed right after its copy-out, so block i runs
    beside one prefetched buffer -- the current block and the prefetched one that
    cost_model/memory.py prices under ZeRO-3, as FSDP2's default holds (the blocking default
    keeps the current buffer until the next copy-out instead); a blocking explicit prefetch
    would hold one block more. Measured by bench/overlap.py (dp4 ZeRO-3 on gloo)."""
    for unit, following in zip(units, units[1:]):
        unit.set_modules_to_forward_prefetch([following])
    for unit in units:
        unshard_async(unit)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def build_schedule(plan, stages: list[tuple[int, nn.Module]], num_stages: int,
                   device: torch.device, pp_group, loss_fn: Callable,
                   examples: dict[int, tuple[tuple, tuple]],
                   input_batch_dims: list[int | None] | None = None):
    """A torch.distributed.pipelining schedule for this rank's stages (plan.schedule).

    `input_batch_dims`: the batch dim of each input of the first stage, which the schedule
    splits into microbatches (None: the input goes whole to every microbatch; default dim 0).

    `examples`: stage index -> (input tensors, output tensors) of one microbatch, local shapes
    and dtypes: static metadata, so that the schedule runs no forward of its own to infer them
    (an extra forward would also move the stages' random-op microbatch counters).

    The stages hold a receive buffer only while its microbatch is in flight, and the
    interleaved schedule lets go of a send once it completed ([Note: in-flight receive
    buffers] in autoplan/_torch_compat/pipelining.py), so a rank's memory does not grow with
    the number of microbatches beyond what its schedule keeps in flight."""
    stage_cls = in_flight_pipeline_stage_class()
    pipeline_stages = [stage_cls(m, idx, num_stages, device, group=pp_group,
                                 input_args=examples[idx][0], output_args=examples[idx][1])
                       for idx, m in stages]
    for stage in pipeline_stages:
        stage.split_backward = plan.schedule == "interleaved-zb"
    m = plan.num_microbatches
    chunks = None if input_batch_dims is None else tuple(
        chunk_spec(d) for d in input_batch_dims)
    if plan.schedule in INTERLEAVED_SCHEDULES:
        return in_flight_interleaved_schedule_class(plan.schedule)(
            pipeline_stages, m, loss_fn=loss_fn, args_chunk_spec=chunks)
    if len(pipeline_stages) != 1:
        raise ValueError(f"schedule {plan.schedule!r} takes one stage per rank; this rank "
                         f"holds {len(pipeline_stages)}")
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[plan.schedule]
    return cls(pipeline_stages[0], m, loss_fn=loss_fn, args_chunk_spec=chunks)


@torch.no_grad()
def clip_grad_norm(model, max_norm: float) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / (total_norm + 1e-6)), where total_norm is the
    L2 norm over all parameters of the whole model (each tied weight once), exactly as
    torch.nn.utils.clip_grad_norm_ computes it on one process. Returns total_norm."""
    seen_tied = set()
    sq = torch.zeros((), dtype=torch.float64, device=model.device)
    grads = []
    tied_first = model.tied_owner_stage  # global: the first stage holding each tied weight
    for idx, m in model.stages:
        for name, p in m.named_parameters():
            if p.grad is None:
                continue
            grads.append(p.grad)
            if name in model._tied and (tied_first[name] != idx or name in seen_tied):
                continue
            seen_tied.add(name)
            norm = torch.linalg.vector_norm(p.grad)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            sq += norm.double() ** 2
    if model.plan.mesh.pp > 1:
        dist.all_reduce(sq, group=model.mesh["pp"].get_group())
    total = sq.sqrt().float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local_tensor(g).mul_(coef)
    return total


def tp_stage_forward(gm: torch.fx.GraphModule, mesh, in_placements: list[str],
                     out_placements: list[str], *, hold_sharded: bool = True) -> Callable:
    """Forward for a tp-sharded stage: local tensors in, DTensor interpretation, local out;
    with `hold_sharded`, all-gathered activations are saved for the backward as their shards
    ([Note: gathered inputs saved sharded] in autoplan/passes/regather.py; off for compiled
    stages, whose saved set the compiled graph decides)."""
    inner = gm.forward

    def forward(*args):
        wrapped = [
            DTensor.from_local(a, mesh, (parse_placement(p),), run_check=False)
            if isinstance(a, torch.Tensor) else a
            for a, p in zip(args, in_placements)]
        with implicit_replication(), (held_sharded() if hold_sharded
                                      else contextlib.nullcontext()):
            out = inner(*wrapped)
        if isinstance(out, tuple):
            return tuple(o.to_local() if isinstance(o, DTensor) else o for o in out)
        return out.to_local() if isinstance(out, DTensor) else out

    return forward


def owning_outputs(forward: Callable) -> Callable:
    """`forward` with its plain-tensor outputs that are views (a stage's final reshape,
    DTensor's `to_local`) turned into tensors that own their view: FSDP2 registers its
    pre-backward hook on a unit's outputs and warns for a view, on which an in-place op would
    drop the hook. `aten._unsafe_view` keeps the storage and the gradient (reshaped back), as
    torch's own matmul does for its output reshape; nothing else reads the viewed value."""

    def own(t):
        if type(t) is torch.Tensor and t._base is not None:
            return torch.ops.aten._unsafe_view(t, t.shape)
        return t

    def wrapped(*args, **kwargs):
        out = forward(*args, **kwargs)
        return tuple(own(o) for o in out) if isinstance(out, tuple) else own(out)

    return wrapped
