"""This rank's stages of a planned model, built on meta by the lowering (autoplan/passes/
lowering.py `lower_rank`, [Note: pass order]): steps 2-5 of the build order in
autoplan/runtime/engine.py, and the tensors the allocation must fill.

`RankStages` is `DistributedModel`'s base class: it reads the engine's plan, graph, mesh,
ranks, precision and options that `DistributedModel.__init__` sets, and it is the lowering's
`RankRuntime`: the steps of the pass order that are the runtime's (meta weights in the master
dtype, the expert weights over ep, tp parameters as DTensors, compile, the tp stage forward,
FSDP2 by ZeRO stage).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autoplan.batch_coupling import batch_couplings, check_plan
from autoplan.passes.lowering import LoweringOptions, RankCoords, lower_rank
from autoplan.passes.sharding import value_placements
from autoplan.passes.stages import StageGraph
from autoplan.plan import parse_placement
from autoplan.runtime import parallel as _compat
from autoplan.runtime.compiled import compile_flat_stage, compile_stage, pin_cache_to_groups
from autoplan.runtime.expert_parallel import experts_all_to_all
from autoplan.runtime.weights import Targets, weights_to_meta as _weights_to_meta

__all__ = ["RankStages"]


class RankStages:
    """This rank's stages, planned and sharded on meta, and their parameters
    (`DistributedModel`'s base class; the lowering's `RankRuntime`)."""

    experts_op = staticmethod(experts_all_to_all)
    forward_prefetch = True
    """ZeRO 2/3: each block unit issues the next block's all-gather in its own pre-forward
    ([Note: forward prefetch]); bench/overlap.py turns it off to measure what it buys."""

    def _build_stages(self) -> list[tuple[int, nn.Module]]:
        """This rank's stages, planned and sharded on the meta device (the caller allocates
        them: each rank holds only its shards, [Note: sharded construction] in
        runtime/weights.py)."""
        plan, graph = self.plan, self.graph
        # a plan given to the runtime keeps what batch_norm in training mode and in-place
        # buffer updates need ([Note: batch coupling]; planning checked every kind)
        buffers = {fqn for fqn, p in graph.params.items() if p.is_buffer}
        check_plan(plan, batch_couplings(graph.gm, buffers), graph.model_name)
        cp_group = self.mesh["cp"].get_group().group_name if plan.mesh.cp > 1 else ""
        lowered = lower_rank(
            graph, plan, RankCoords(self.pp_rank, self.cp_rank, self.tp_rank, cp_group),
            LoweringOptions(device=self.device, kernels=self.kernels, compile=self.compile,
                            seed=self.seed, token_loss=self.batch.mode == "tokens"),
            runtime=self, planned=self.planned_nodes)
        self.num_stages = lowered.num_stages
        # Parameter FQNs of every stage (tied weights span stages)
        self._stage_param_fqns = lowered.stage_param_fqns
        self._random_states = lowered.random_states
        self.kernel_counts.update(lowered.kernel_counts)
        self.float8_linears = lowered.float8_linears
        if lowered.vocab_size is not None:  # the token loss on vocab-sharded logits
            self._vocab_parallel_loss(lowered.vocab_size)
        # before the first compiled call ([Note: compile cache and process groups])
        if self.compile:
            pin_cache_to_groups(self.mesh)
        self.stage_graphs = {sg.index: sg for sg in lowered.stage_graphs}
        return lowered.modules  # on meta: the caller allocates

    def _vocab_parallel_loss(self, vocab: int) -> None:
        """The last stage returns its shard of the logits (tp > 1, pp 1; the lowering's step
        6): `StepInputs.token_loss` runs kernels' vocab-parallel cross-entropy over the tp
        group, this rank's shard starting at its token id (torch.chunk's sizes of `vocab`)."""
        sizes = [c.shape[0] for c in torch.empty(vocab, device="meta").chunk(self.plan.mesh.tp)]
        self.batch.vocab_parallel = (self.mesh["tp"].get_group(),
                                     sum(sizes[:self.tp_rank]), vocab)

    # -- the lowering's runtime steps ([Note: pass order] in autoplan/passes/lowering.py) ----
    def weights_to_meta(self, gm: torch.fx.GraphModule) -> None:
        """The graph's weights on meta in the master dtype (rebinding them must not touch the
        caller's CapturedGraph)."""
        _weights_to_meta(gm, self.precision.master_dtype, self.precision.frozen_dtype)

    def shard_experts(self, gm: torch.fx.GraphModule, routed) -> None:
        self.expert_parallel.shard(gm, routed)

    def compile_blocks(self, index: int, gm: torch.fx.GraphModule, blocks: list[str]) -> None:
        self.compiled[index] = compile_stage(gm, blocks, self.plan.checkpointing)

    def compile_flat(self, index: int, gm: torch.fx.GraphModule) -> None:
        self.compiled[index] = compile_flat_stage(gm)

    def tp_forward(self, sg: StageGraph) -> None:
        produced = value_placements(self.plan)
        sg.gm.forward = _compat.tp_stage_forward(
            sg.gm, self.mesh["tp"], [produced.get(n, "R") for n in sg.input_names],
            [produced.get(n, "R") for n in sg.output_names], hold_sharded=not self.compile)

    def _targets(self) -> Targets:
        """The tensors this rank must fill: its parameters, and the buffers still on meta
        (lifted constants keep their captured values)."""
        params: dict[str, list[torch.Tensor]] = defaultdict(list)
        buffers: dict[str, list[tuple[nn.Module, str]]] = defaultdict(list)
        for _, module in self.stages:
            for fqn, p in module.named_parameters():
                params[fqn].append(p)
        for sg in self.stage_graphs.values():
            for fqn, b in sg.gm.named_buffers():
                if b.is_meta:
                    owner, _, leaf = fqn.rpartition(".")
                    buffers[fqn].append((sg.gm.get_submodule(owner), leaf))
        return Targets(dict(params), dict(buffers), self.device)

    def distribute_params(self, gm: torch.fx.GraphModule) -> None:
        """The stage's parameters as DTensors on the tp sub-mesh, in their planned placements."""
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
                    # a frozen parameter stays frozen ([Note: frozen parameters])
                    owner._parameters[leaf] = nn.Parameter(
                        distribute_tensor(p.data, tp_mesh, placement),
                        requires_grad=p.requires_grad)

    def apply_data_parallel(self, gm: nn.Module, blocks: list[str]) -> nn.Module:
        """FSDP2 by ZeRO stage on the dp axis, one unit per block module (`blocks`) and one
        for the rest of the stage, as torchtitan's apply_fsdp: ZeRO-3 gathers one block at a
        time (FSDP2 prefetches the next). The stage's root unit (embeddings, final norm, head)
        is not resharded after the forward (FSDP2's default for a root): the backward starts
        with it, so resharding would all-gather it again at once, and hold its all-gather
        output beside its unsharded parameters while every activation is live (measured by
        the dry run on a LoRA Llama at dp4 ZeRO-3: 2 x 412 MB at the peak). With a 16-bit
        plan also at dp 1, because FSDP2's MixedPrecisionPolicy is what casts the fp32
        master weights for compute."""
        plan = self.plan
        mp = self.precision.policy()
        if not list(gm.parameters()) or (plan.mesh.dp_shard == 1 and mp is None):
            return gm
        dp_mesh = self.dp_mesh  # dp, or dp x cp flattened
        # expert weights under ep are reduced by runtime/expert_parallel.py, not by FSDP2
        ignored = set(self.expert_parallel.params) if self.expert_parallel else None
        gm.forward = _compat.owning_outputs(gm.forward)
        units = [gm.get_submodule(path) for path in blocks]
        for module in units + [gm]:
            if plan.zero_stage in (0, 1):
                _compat.replicate(module, dp_mesh, mp_policy=mp, ignored_params=ignored)
            else:
                _compat.fully_shard(module, dp_mesh, mp_policy=mp, ignored_params=ignored,
                                    reshard_after_forward=plan.zero_stage == 3
                                    and module is not gm,
                                    offload=plan.offload == "optimizer+params")
        if plan.zero_stage >= 2 and self.forward_prefetch and plan.mesh.dp_shard > 1:
            _compat.prefetch_forward(units)
        return gm

    def _unique_named_params(self) -> list[tuple[str, nn.Parameter]]:
        """(FQN, parameter) of this rank, each tensor once (a tied weight under its first
        name), in the model's order: what the optimizer factory receives."""
        seen, out = set(), []
        for _, m in self.stages:
            for name, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def _unique_params(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for _, m in self.stages:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out
