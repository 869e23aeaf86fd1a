"""The training engine: one rank's share of a planned model, and its optimizer step.

Build order (each step needs the previous one):
1. DeviceMesh ("pp", "dp", "tp") from the plan, tp innermost.
2. The captured graph is retargeted to the device, loaded with the full weights, and split into
   pipeline stages (`passes.split_stages`); this rank keeps the stages `s` with
   `s % pp == pp_rank` (interleaved schedules hold several).
3. Tensor parallelism: `passes.apply_placements` inserts the plan's redistributions, parameters
   become DTensors on the tp sub-mesh with their planned placements, and the stage runs under
   DTensor; stage inputs/outputs cross stage boundaries as local tensors.
4. Data parallelism by ZeRO stage, with torch's FSDP2 machinery on the dp sub-mesh:
   0 -> `replicate` (DDP-style all-reduce), 2 -> `fully_shard(reshard_after_forward=False)`,
   3 -> `fully_shard(reshard_after_forward=True)`. ZeRO-1 (optimizer states only) is not
   expressible in FSDP2: it runs `replicate` for the gradients and a sharded optimizer
   (`ShardedOptimizer`): each dp rank steps the parameters it owns, then all-gathers them.
5. Pipeline parallelism: `torch.distributed.pipelining` stages and schedules (GPipe, 1F1B,
   interleaved 1F1B); without pp, microbatches are plain gradient accumulation (replicated
   gradients, ZeRO 0/1, are reduced once, after the last microbatch).
6. Weights used by several stages (tied embedding and head) get their gradients summed over
   the stages that hold them before the optimizer step, so the copies stay identical.

The loss is the mean token cross-entropy of the global batch, as a single process computes it:
each microbatch's mean loss is scaled by 1/num_microbatches and dp gradients are averaged.
"""

from __future__ import annotations

import copy
import gc
from collections import defaultdict
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from autoplan.graph import CapturedGraph
from autoplan.passes.checkpointing import wrap_checkpointing
from autoplan.passes.device import materialize
from autoplan.passes.pipeline import split_stages
from autoplan.passes.sharding import apply_placements, check_redistributions, value_placements
from autoplan.plan import Plan, parse_placement
from autoplan.runtime import parallel as _compat
from autoplan._torch_compat import implicit_replication

__all__ = ["DistributedModel", "cross_entropy_loss"]


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy. logits: (B, T, V); labels: (B, T) int64."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def _stage_forward(gm: torch.fx.GraphModule, mesh, in_placements: list[str],
                   out_placements: list[str]) -> Callable:
    """Forward for a tp-sharded stage: local tensors in, DTensor interpretation, local out."""
    inner = gm.forward

    def forward(*args):
        wrapped = [
            DTensor.from_local(a, mesh, (parse_placement(p),), run_check=False)
            if isinstance(a, torch.Tensor) else a
            for a, p in zip(args, in_placements)]
        with implicit_replication():
            out = inner(*wrapped)
        if isinstance(out, tuple):
            return tuple(o.to_local() if isinstance(o, DTensor) else o for o in out)
        return out.to_local() if isinstance(out, DTensor) else out

    return forward


class DistributedModel:
    """This rank's part of a planned model, trainable with `step`.

    Args:
        graph: the captured graph the plan was made for.
        plan: the plan.
        state: the full model (nn.Module) or its weights by FQN, identical on every rank;
            a mapping must include non-persistent buffers (e.g. rotary inv_freq).
        optimizer: `params -> torch.optim.Optimizer` (default AdamW(lr=1e-3)).
        loss_fn: `(output, labels) -> scalar mean loss` (default token cross-entropy).
        device: "cpu" or "cuda".
        max_grad_norm: clip the global gradient norm to this (None: no clipping).

    Must be constructed on every rank of a process group of size plan.mesh.world_size.
    Raises ValueError when the world size does not match the plan.
    """

    def __init__(self, graph: CapturedGraph, plan: Plan, state: dict[str, torch.Tensor], *,
                 optimizer: Callable | None = None, loss_fn: Callable = cross_entropy_loss,
                 device: str = "cpu", max_grad_norm: float | None = None):
        if not dist.is_initialized() or dist.get_world_size() != plan.mesh.world_size:
            have = dist.get_world_size() if dist.is_initialized() else 0
            raise ValueError(
                f"plan needs {plan.mesh.world_size} ranks ({plan.mesh}); the process group "
                f"has {have}")
        self.plan = plan
        self.graph = graph
        self.loss_fn = loss_fn
        self.max_grad_norm = max_grad_norm
        self.grad_norm: float | None = None  # before clipping, of the last step
        self.device = torch.device(device)
        self.mesh = init_device_mesh(self.device.type, plan.mesh.shape,
                                     mesh_dim_names=plan.mesh.axis_names)
        self.pp_rank = self.mesh["pp"].get_local_rank()
        self.dp_rank = self.mesh["dp"].get_local_rank()
        self.tp_rank = self.mesh["tp"].get_local_rank()
        self.stages = self._build_stages(state)
        self._tied = self._tied_groups()
        params = self._unique_params()
        make_opt = optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        if plan.zero_stage == 1 and plan.mesh.dp > 1:
            self.optimizer = _compat.ShardedOptimizer(params, make_opt, self.mesh["dp"])
        else:
            self.optimizer = make_opt(params)
        self._schedule = self._build_schedule() if plan.mesh.pp > 1 else None
        # Construction leaves the full model's weights in reference cycles (fx graph modules);
        # free them now, not at a time of the cycle collector's choosing.
        gc.collect()

    # -- construction -------------------------------------------------------------------
    def _build_stages(self, state) -> list[tuple[int, nn.Module]]:
        plan, graph = self.plan, self.graph
        # A fresh module hierarchy over the captured graph: rebinding weights below must not
        # touch the caller's CapturedGraph.
        gm = torch.fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph))
        materialize(gm, state, self.device)
        stage_graphs = split_stages(gm, graph, plan.stages)
        self.num_stages = len(stage_graphs)
        param_fqns = {fqn for fqn, p in graph.params.items() if not p.is_buffer}
        # Parameter FQNs of every stage (tied weights span stages); the graphs of the stages
        # other ranks run are dropped with the full weights `materialize` loaded into them.
        self._stage_param_fqns = {
            sg.index: {n.target for n in sg.gm.graph.nodes
                       if n.op == "get_attr" and n.target in param_fqns}
            for sg in stage_graphs}
        mine = [sg for sg in stage_graphs if sg.index % plan.mesh.pp == self.pp_rank]
        del gm, stage_graphs
        produced = value_placements(plan)
        inserted, out, held = [], [], set()
        for sg in mine:
            _untie_across_stages(sg.gm)
            inserted += apply_placements(sg.gm, plan)
            # consumers this rank runs (a stage input placeholder named after its producer in
            # an earlier stage is not one)
            held |= {n.meta.get("orig_name", n.name) for n in sg.gm.graph.nodes
                     if n.op == "call_function"}
            if sg.index == self.num_stages - 1:
                held.add("output")
            # Checkpoint after placements: a block's redistributions are recomputed with it.
            wrap_checkpointing(sg.gm, graph, plan.checkpointing)
            if plan.mesh.tp > 1:
                self._distribute_params(sg.gm)
                sg.gm.forward = _stage_forward(
                    sg.gm, self.mesh["tp"],
                    [produced.get(n, "R") for n in sg.input_names],
                    [produced.get(n, "R") for n in sg.output_names])
            out.append((sg.index, self._apply_data_parallel(sg.gm)))
        # Lint: the redistributions inserted in this rank's stages are exactly the plan's.
        check_redistributions([r for r in plan.redistributions if r.consumer in held], inserted)
        self.stage_graphs = {sg.index: sg for sg in mine}
        return out

    def _distribute_params(self, gm: torch.fx.GraphModule) -> None:
        tp_mesh = self.mesh["tp"]
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            owner_path, _, leaf = node.target.rpartition(".")
            owner = gm.get_submodule(owner_path) if owner_path else gm
            placement = (parse_placement(self.plan.placement_of(node.target)),)
            if leaf in owner._parameters:
                p = owner._parameters[leaf]
                if not isinstance(p, DTensor):
                    owner._parameters[leaf] = nn.Parameter(
                        distribute_tensor(p.data, tp_mesh, placement))
            # Buffers (rotary tables, lifted constants) stay plain tensors: only constant-like
            # nodes read them, and those run replicated (implicit replication).

    def _apply_data_parallel(self, gm: nn.Module) -> nn.Module:
        plan = self.plan
        if plan.mesh.dp == 1 or not list(gm.parameters()):
            return gm
        dp_mesh = self.mesh["dp"]
        if plan.zero_stage in (0, 1):
            return _compat.replicate(gm, dp_mesh)
        return _compat.fully_shard(gm, dp_mesh, reshard_after_forward=plan.zero_stage == 3)

    def _unique_params(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for _, m in self.stages:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _tied_groups(self):
        """For parameters held by several stages: the local copies, and a process group over
        the pp ranks that hold copies (same dp and tp coordinates), or None when local."""
        holders: dict[str, set[int]] = defaultdict(set)
        stage_params: dict[str, list] = defaultdict(list)
        pp = self.plan.mesh.pp
        for idx, fqns in self._stage_param_fqns.items():
            for fqn in fqns:
                holders[fqn].add(idx)
        for idx, m in self.stages:
            for name, p in m.named_parameters():
                if len(holders.get(name, ())) > 1:
                    stage_params[name].append(p)
        # Each tied weight counts once in a global gradient norm: in its first stage.
        self.tied_owner_stage = {fqn: min(h) for fqn, h in holders.items() if len(h) > 1}
        groups = {}
        # Every rank creates every group, in the same order (new_group is collective).
        mesh_ranks = self.mesh.mesh  # (pp, dp, tp) tensor of global ranks
        for fqn in sorted(n for n, h in holders.items() if len(h) > 1):
            pp_ranks = sorted({s % pp for s in holders[fqn]})
            mine = None
            if len(pp_ranks) > 1:
                for d in range(self.plan.mesh.dp):
                    for t in range(self.plan.mesh.tp):
                        ranks = [int(mesh_ranks[r, d, t]) for r in pp_ranks]
                        g = dist.new_group(ranks)
                        if dist.get_rank() in ranks:
                            mine = g
            if fqn in stage_params:
                groups[fqn] = (stage_params[fqn], mine)
        return groups

    # -- training -----------------------------------------------------------------------
    def _build_schedule(self):
        return _compat.build_schedule(self.plan, self.stages, self.num_stages, self.device,
                                      self.mesh["pp"].get_group(), self._pp_loss)

    def _pp_loss(self, output, labels):
        return self.loss_fn(output, labels)

    def _local_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        dp = self.plan.mesh.dp
        if tensor.shape[0] != self.plan.global_batch:
            raise ValueError(
                f"batch has {tensor.shape[0]} samples; the plan was made for global_batch "
                f"{self.plan.global_batch}")
        return tensor.chunk(dp)[self.dp_rank].to(self.device)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """One optimizer step on the global batch (same tensors on every rank).

        input_ids, labels: (global_batch, seq_len). Returns the global mean loss (every rank).
        """
        x, y = self._local_batch(input_ids), self._local_batch(labels)
        self.optimizer.zero_grad(set_to_none=True)
        # Constant-like tensors (position ids, masks) stay plain tensors inside a DTensor
        # stage; their use in backward (e.g. embedding_dense_backward) needs the same implicit
        # replication as the forward, so forward and backward both run inside it.
        with implicit_replication():
            local = self._forward_backward(x, y)
        self._sync_tied_grads()
        if self.max_grad_norm is not None:
            self.grad_norm = float(self.clip_grad_norm(self.max_grad_norm))
        self.optimizer.step()
        if self.plan.mesh.dp > 1:
            dist.all_reduce(local, group=self.mesh["dp"].get_group())
            local = local / self.plan.mesh.dp
        return float(local)

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of all microbatches; returns this dp rank's mean loss."""
        m = self.plan.num_microbatches
        if self._schedule is not None:
            losses: list[torch.Tensor] = []
            is_first = any(idx == 0 for idx, _ in self.stages)
            is_last = any(idx == self.num_stages - 1 for idx, _ in self.stages)
            self._schedule.step(*((x,) if is_first else ()), target=y if is_last else None,
                                losses=losses)
            local = torch.stack([l.detach() for l in losses]).mean() if is_last \
                else torch.zeros(())
            dist.all_reduce(local, group=self.mesh["pp"].get_group())
        else:
            (_, module), = self.stages
            # Gradient accumulation: replicated gradients (ZeRO 0, 1) are reduced once, after
            # the last microbatch (DDP's no_sync); ZeRO 2/3 reduce-scatter every microbatch, so
            # that no rank ever holds the stage's whole gradient.
            sync_last_only = self.plan.zero_stage <= 1 and isinstance(module, FSDPModule)
            total = torch.zeros(())
            for i, (xm, ym) in enumerate(zip(x.chunk(m), y.chunk(m))):
                if sync_last_only:
                    module.set_requires_gradient_sync(i == m - 1)
                loss = self.loss_fn(module(xm), ym) / m
                loss.backward()
                total += loss.detach()
            local = total
        return local

    def _sync_tied_grads(self) -> None:
        for fqn, (copies, group) in self._tied.items():
            grads = [p.grad for p in copies if p.grad is not None]
            if not grads:
                continue
            total = _compat.local_tensor(grads[0]).clone()
            for g in grads[1:]:
                total += _compat.local_tensor(g)
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in grads:
                _compat.local_tensor(g).copy_(total)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip all gradients by their global L2 norm over every rank (tied weights once)."""
        return _compat.clip_grad_norm(self, max_norm)

    # -- state --------------------------------------------------------------------------
    def save(self, path) -> None:
        """Sharded checkpoint of parameters and optimizer states (collective); see
        autoplan.runtime.checkpoint."""
        from autoplan.runtime.checkpoint import save

        save(self, path)

    def load(self, path) -> None:
        """Load a checkpoint written by `save` under any plan (collective, reshards)."""
        from autoplan.runtime.checkpoint import load

        load(self, path)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) parameters held by this rank, by FQN (collective over tp/dp)."""
        out = {}
        for _, m in self.stages:
            for name, p in m.named_parameters():
                t = p.full_tensor() if isinstance(p, DTensor) else p
                out[name] = t.detach().clone()
        return out


def _untie_across_stages(gm: torch.fx.GraphModule) -> None:
    """Give this stage its own Parameter objects, so stages never share one across modules."""
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            owner_path, _, leaf = node.target.rpartition(".")
            owner = gm.get_submodule(owner_path) if owner_path else gm
            if leaf in owner._parameters:
                owner._parameters[leaf] = nn.Parameter(owner._parameters[leaf].detach().clone())
