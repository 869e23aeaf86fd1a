"""This rank's stages of a planned model, built on the meta device: steps 2-5 of the build
order in autoplan/runtime/engine.py (the captured graph retargeted and split into pipeline
stages, this rank's stages given the plan's placements, cp, the fused kernels, expert
parallelism, layout-invariant random ops, block modules, checkpointing, compile, tp parameters
as DTensors and FSDP2 by ZeRO stage), and the tensors the allocation must fill.

`RankStages` is `DistributedModel`'s base class: it reads the engine's plan, graph, mesh,
ranks, precision and options that `DistributedModel.__init__` sets.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autoplan.batch_coupling import batch_couplings, check_plan
from autoplan.passes.blocks import install_blocks
from autoplan.passes.checkpointing import wrap_checkpointing
from autoplan.passes.context_parallel import apply_context_parallel, check_whole_graph
from autoplan.passes.device import retarget_device
from autoplan.passes.kernels import fuse_kernels, keep_logits_sharded
from autoplan.passes.stages import split_stages
from autoplan.passes.rng import RandomState, make_random_ops_layout_invariant, random_op_indices
from autoplan.passes.sharding import apply_placements, check_redistributions, value_placements
from autoplan.plan import parse_placement
from autoplan.runtime import parallel as _compat
from autoplan.runtime.compiled import (compile_flat_stage, compile_stage, pin_cache_to_groups,
                                      random_ops_eager)
from autoplan.runtime.tied import untie_across_stages
from autoplan.runtime.weights import Targets, weights_to_meta as _weights_to_meta

__all__ = ["RankStages"]


class RankStages:
    """This rank's stages, planned and sharded on meta, and their parameters
    (`DistributedModel`'s base class)."""

    def _build_stages(self) -> list[tuple[int, nn.Module]]:
        """This rank's stages, planned and sharded on the meta device (the caller allocates
        them: each rank holds only its shards, [Note: sharded construction] in
        runtime/weights.py)."""
        plan, graph = self.plan, self.graph
        # A fresh module hierarchy over the captured graph, its weights on meta (in the master
        # dtype): rebinding them must not touch the caller's CapturedGraph.
        gm = torch.fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph))
        # a plan given to the runtime keeps what batch_norm in training mode and in-place
        # buffer updates need ([Note: batch coupling]; planning checked every kind)
        buffers = {fqn for fqn, p in graph.params.items() if p.is_buffer}
        check_plan(plan, batch_couplings(gm, buffers), graph.model_name)
        random_ops = random_op_indices(gm, batch_size=graph.batch_size)
        if random_ops and self.compile and plan.checkpointing == "selective":
            raise ValueError(
                f"compile=True with checkpointing='selective' on a model with random ops "
                f"({len(random_ops)}: {sorted(random_ops)[:3]}...): a selectively checkpointed "
                "block is compiled whole and the random ops run eagerly ([Note: compiled "
                "stages]); plan with checkpointing='full' or 'none', or compile=False")
        _weights_to_meta(gm, self.precision.master_dtype, self.precision.frozen_dtype)
        retarget_device(gm, self.device)
        if plan.mesh.cp > 1 and plan.mesh.pp > 1:  # stage by stage below
            check_whole_graph(gm, plan.seq_len, plan.mesh.cp)
        stage_graphs = split_stages(gm, graph, plan.stages)
        self.num_stages = len(stage_graphs)
        param_fqns = {fqn for fqn, p in graph.params.items() if not p.is_buffer}
        # Parameter FQNs of every stage (tied weights span stages); the graphs of the stages
        # other ranks run are dropped.
        self._stage_param_fqns = {
            sg.index: {n.target for n in sg.gm.graph.nodes
                       if n.op == "get_attr" and n.target in param_fqns}
            for sg in stage_graphs}
        mine = [sg for sg in stage_graphs if sg.index % plan.mesh.pp == self.pp_rank]
        del gm, stage_graphs
        produced = value_placements(plan)
        inserted, out, held = [], [], set()
        self._random_states: dict[int, RandomState] = {}
        unplanned: set[tuple[str, str]] = set()  # planned redistributions the kernels replace
        if self.compile:  # [Note: compile cache and process groups]
            pin_cache_to_groups(self.mesh)
        for sg in mine:
            untie_across_stages(sg.gm)
            inserted += apply_placements(sg.gm, plan)
            if plan.mesh.cp > 1:  # attention over the cp group, global positions
                apply_context_parallel(sg.gm, seq_len=plan.seq_len, cp=plan.mesh.cp,
                                       rank=self.cp_rank,
                                       group_name=self.mesh["cp"].get_group().group_name,
                                       tp=plan.mesh.tp, planned=self.planned_nodes,
                                       whole=plan.mesh.pp == 1)
            if self.kernels and sg.index == self.num_stages - 1:
                unplanned |= self._vocab_parallel_loss(sg.gm, produced)
            if self.expert_parallel is not None:
                self.expert_parallel.apply(sg.gm)
            # Random ops read (seed, step, sample) -- never the layout ([Note: RNG contract]);
            # before checkpointing, so that recomputed blocks replay the forward's state.
            if random_ops:
                make_random_ops_layout_invariant(sg.gm, random_ops)
                sg.gm.random_state.seed = self.seed
                self._random_states[sg.index] = sg.gm.random_state
                if self.compile:  # drawn eagerly ([Note: compiled stages])
                    random_ops_eager(sg.gm)
            # consumers this rank runs (a stage input placeholder named after its producer in
            # an earlier stage is not one)
            held |= {n.meta.get("orig_name", n.name) for n in sg.gm.graph.nodes
                     if n.op == "call_function"}
            if sg.index == self.num_stages - 1:
                held.add("output")
            # The kernels' patterns become one op each ([Note: kernel fusion]), after the
            # redistributions are in place (a pattern cut by one stays unfused).
            if self.kernels:
                self.kernel_counts[sg.index] = fuse_kernels(sg.gm)
            if plan.mesh.tp > 1:
                self._distribute_params(sg.gm)
            # Each block a called module (one FSDP2 unit each), after placements and the tp
            # parameters: a block takes its redistributions and DTensor parameters with it.
            blocks = install_blocks(sg.gm, graph)
            # Compile the block forwards on DTensors, inside checkpointing, the tp wrapper and
            # the FSDP2 hooks ([Note: compiled stages]).
            if self.compile and blocks:
                self.compiled[sg.index] = compile_stage(sg.gm, blocks, plan.checkpointing)
            # Checkpoint after placements: a block's redistributions are recomputed with it.
            # (compile_stage checkpoints selectively compiled blocks itself.)
            wrap_checkpointing(sg.gm, graph, plan.checkpointing,
                               [] if self.compile and plan.checkpointing == "selective"
                               else blocks)
            if self.compile and not blocks:
                self.compiled[sg.index] = compile_flat_stage(sg.gm)
            if plan.mesh.tp > 1:
                sg.gm.forward = _compat.tp_stage_forward(
                    sg.gm, self.mesh["tp"],
                    [produced.get(n, "R") for n in sg.input_names],
                    [produced.get(n, "R") for n in sg.output_names],
                    hold_sharded=not self.compile)
            out.append((sg.index, self._apply_data_parallel(sg.gm, blocks)))
        # Lint: the redistributions inserted in this rank's stages are exactly the plan's.
        check_redistributions([r for r in plan.redistributions if r.consumer in held
                               and (r.producer, r.consumer) not in unplanned],
                              [r for r in inserted if (r.producer, r.consumer) not in unplanned])
        self.stage_graphs = {sg.index: sg for sg in mine}
        return out  # on meta: the caller allocates

    def _vocab_parallel_loss(self, gm, produced) -> set[tuple[str, str]]:
        """The token loss on vocab-sharded logits (tp > 1, pp 1): the last stage returns its
        shard and `StepInputs.token_loss` runs kernels' vocab-parallel cross-entropy. Returns
        the plan's redistribution that no longer runs (an all-gather of the logits)."""
        plan, graph = self.plan, self.graph
        if plan.mesh.tp == 1 or plan.mesh.pp > 1 or self.batch.mode != "tokens":
            return set()
        kept = keep_logits_sharded(gm, graph.main_output_index, produced)
        if kept is None:
            return set()
        vocab = next(n for n in graph.gm.graph.nodes if n.name == kept[0]).meta["val"].shape[-1]
        sizes = [c.shape[0] for c in torch.empty(vocab, device="meta").chunk(plan.mesh.tp)]
        self.batch.vocab_parallel = (self.mesh["tp"].get_group(),
                                     sum(sizes[:self.tp_rank]), vocab)
        return {kept}

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
                    # a frozen parameter stays frozen ([Note: frozen parameters])
                    owner._parameters[leaf] = nn.Parameter(
                        distribute_tensor(p.data, tp_mesh, placement),
                        requires_grad=p.requires_grad)

    def _apply_data_parallel(self, gm: nn.Module, blocks: list[str]) -> nn.Module:
        """FSDP2 by ZeRO stage on the dp axis, one unit per block module (`blocks`) and one
        for the rest of the stage, as torchtitan's apply_fsdp: ZeRO-3 gathers one block at a
        time (FSDP2 prefetches the next). With a 16-bit plan also at dp 1, because FSDP2's
        MixedPrecisionPolicy is what casts the fp32 master weights for compute."""
        plan = self.plan
        mp = self.precision.policy()
        if not list(gm.parameters()) or (plan.mesh.dp_shard == 1 and mp is None):
            return gm
        dp_mesh = self.dp_mesh  # dp, or dp x cp flattened
        # expert weights under ep are reduced by runtime/expert_parallel.py, not by FSDP2
        ignored = set(self.expert_parallel.params) if self.expert_parallel else None
        gm.forward = _compat.owning_outputs(gm.forward)
        for module in [gm.get_submodule(path) for path in blocks] + [gm]:
            if plan.zero_stage in (0, 1):
                _compat.replicate(module, dp_mesh, mp_policy=mp, ignored_params=ignored)
            else:
                _compat.fully_shard(module, dp_mesh, mp_policy=mp, ignored_params=ignored,
                                    reshard_after_forward=plan.zero_stage == 3,
                                    offload=plan.offload == "optimizer+params")
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
