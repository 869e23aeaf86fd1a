"""`eval_step`: the loss and outputs of a batch under the plan, without training (no
gradients, no update, dropout off as in `model.eval()`), on every rank."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from autoplan._torch_compat import implicit_replication, pipeline_eval

__all__ = ["eval_batch"]


@torch.no_grad()
def eval_batch(engine, leaves: list[torch.Tensor], return_outputs: bool = False):
    """The loss of the global batch (flat leaves of `engine.inputs`) as `step_batch` computes
    it ([Note: step loss] in runtime/step_inputs.py), without training. With
    `return_outputs`, (loss, outputs): the model's outputs for the whole batch on every rank,
    the microbatches' and dp ranks' output tensors concatenated on dim 0 (0-d outputs, such as
    a loss, averaged). Collective over all ranks."""
    batch = engine.batch
    if return_outputs and engine.plan.mesh.cp > 1:
        raise NotImplementedError(
            f"eval_step(return_outputs=True) under context parallelism (cp "
            f"{engine.plan.mesh.cp}): each rank holds two chunks of every sample's outputs, "
            "which are not put back in sequence order; ask for the loss only")
    local = batch.local(leaves)
    parts = batch.start(leaves, local, training=False)
    for state in engine._random_states.values():
        state.drawing = False
    engine._microbatch = defaultdict(int)
    try:
        with implicit_replication():
            outs, loss = _forward_only(engine, local, parts)
    finally:
        for state in engine._random_states.values():
            state.drawing = True
    dp = engine.plan.mesh.dp_shard  # dp x cp: a cp rank holds a share of its samples' loss
    if dp > 1:
        dist.all_reduce(loss, group=engine.dp_mesh.get_group())
        loss = loss / dp
    if not return_outputs:
        return float(loss)
    return float(loss), engine.graph.unflatten_output(_gather(engine, outs))


def _forward_only(engine, local: list[torch.Tensor], parts: list) -> tuple[list, torch.Tensor]:
    """(each microbatch's output as a tuple of tensors, on every rank; this dp rank's mean
    loss)."""
    batch, m = engine.batch, engine.plan.num_microbatches
    if engine._schedule is None:
        (_, module), = engine.stages
        outs = [module(*batch.model_inputs(p)) for p in parts]
        outs = [o if isinstance(o, tuple) else (o,) for o in outs]
        loss = sum(batch.loss(o, t).detach().float() for o, t in zip(outs, batch.targets))
        return outs, loss / m
    is_first = any(idx == 0 for idx, _ in engine.stages)
    is_last = any(idx == engine.num_stages - 1 for idx, _ in engine.stages)
    losses: list[torch.Tensor] = []
    outs = pipeline_eval(engine._schedule,
                         tuple(batch.model_inputs(local)) if is_first else (),
                         torch.arange(m, device=engine.device) if is_last else None, losses)
    loss = torch.stack([l.float() for l in losses]).mean() / engine._loss_scale() \
        if is_last else torch.zeros((), device=engine.device)
    group = engine.mesh["pp"].get_group()
    dist.all_reduce(loss, group=group)
    box = [[o if isinstance(o, tuple) else (o,) for o in outs] if is_last else None]
    last = dist.get_global_rank(group, (engine.num_stages - 1) % engine.plan.mesh.pp)
    dist.broadcast_object_list(box, src=last, group=group)
    return box[0], loss


def _full_logits(engine, local: torch.Tensor) -> torch.Tensor:
    """The whole (..., V) logits from this tp rank's vocab shard (..., V_local), all-gathered
    over tp (the stage keeps them sharded for the vocab-parallel loss)."""
    from torch.distributed.tensor import DTensor, Shard

    vocab = engine.batch.vocab_parallel[2]
    shape = (*local.shape[:-1], vocab)
    return DTensor.from_local(local.detach(), engine.mesh["tp"], (Shard(local.dim() - 1),),
                              run_check=False, shape=torch.Size(shape),
                              stride=torch._prims_common.make_contiguous_strides_for(shape)
                              ).full_tensor()


def _gather(engine, outs: list[tuple]) -> list[torch.Tensor]:
    """Per output: the microbatches' tensors and then the dp ranks' concatenated on dim 0;
    0-d tensors averaged."""
    dp, group = engine.plan.mesh.dp, engine.mesh["dp"].get_group()
    flat = []
    for k in range(len(outs[0])):
        parts = [o[k] for o in outs]
        if engine.batch.vocab_parallel is not None and k == engine.graph.main_output_index:
            parts = [_full_logits(engine, p) for p in parts]
        if parts[0].dim() == 0:
            t = torch.stack([p.float() for p in parts]).mean().to(parts[0].dtype)
        else:
            t = torch.cat(parts)
        if dp > 1:
            if t.dim() == 0:
                t = t.clone()
                dist.all_reduce(t, group=group)
                t = t / dp
            else:
                gathered = [torch.empty_like(t) for _ in range(dp)]
                dist.all_gather(gathered, t.contiguous(), group=group)
                t = torch.cat(gathered)
        flat.append(t)
    return flat
