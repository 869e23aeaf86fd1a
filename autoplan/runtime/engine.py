"""The training engine: one rank's share of a planned model, and its optimizer step.

Build order (each step needs the previous one), all on the meta device until step 7:
1. DeviceMesh ("pp", "dp", "tp") from the plan, tp innermost; ("pp", "dp", "cp", "tp") with
   context parallelism, whose dp and cp axes are flattened into the data-parallel mesh
   ("dp_cp") that gradients reduce and ZeRO shards over (torchtitan's dp_shard x cp).
2. The captured graph (in the plan's compute dtype) gets meta weights in the master dtype, is
   retargeted to the device and split into pipeline stages (`passes.split_stages`); this rank
   keeps the stages `s` with `s % pp == pp_rank` (interleaved schedules hold several).
3. Tensor parallelism: `passes.apply_placements` inserts the plan's redistributions, parameters
   become DTensors on the tp sub-mesh with their planned placements, and the stage runs under
   DTensor; stage inputs/outputs cross stage boundaries as local tensors. Random ops become
   layout-invariant (`passes.rng`, [Note: RNG contract]). The RMSNorm and SwiGLU patterns
   become the fused kernels' ops (`passes.kernels`, [Note: kernel fusion]; `kernels=False`: not).
   Under cp (the graph captured at seq_len / cp tokens per sample), attention gathers K and V
   over the cp axis and positions become the rank's global ones (`passes.context`, [Note:
   context parallelism] in solver/context.py).
4. Each repeated block becomes a called module (`passes.blocks`), checkpointed inside when the
   plan says so (`passes.checkpointing`); with `compile`, each block's forward goes through
   torch.compile ([Note: compiled stages] in runtime/compiled.py).
5. Data parallelism by ZeRO stage, with torch's FSDP2 machinery on the dp sub-mesh, one unit
   per block plus one for the rest of the stage: 0 -> `replicate` (DDP-style all-reduce),
   2 -> `fully_shard(reshard_after_forward=False)`, 3 -> `fully_shard(reshard_after_forward=
   True)`; a 16-bit plan adds FSDP2's MixedPrecisionPolicy ([Note: precision recipe]). ZeRO-1
   (optimizer states only) is not expressible in FSDP2: it runs `replicate` for the gradients
   and a sharded optimizer (`ShardedOptimizer`, runtime/zero1.py): each dp rank steps its
   rows of every parameter, then all-gathers them ([Note: ZeRO-1 partition]).
6. Pipeline parallelism: `torch.distributed.pipelining` stages and schedules (GPipe, 1F1B,
   interleaved 1F1B) with static shapes; without pp, microbatches are plain gradient
   accumulation (replicated gradients, ZeRO 0/1, are reduced once, after the last microbatch).
7. Allocation: `to_empty` gives this rank its shards only, a `WeightSource` fills them one
   full tensor at a time ([Note: sharded construction] in runtime/weights.py), and the build is
   checked against the plan (runtime/checks.py).
8. Weights used by several stages (tied embedding and head) get their gradients summed over
   the stages that hold them before the optimizer step, so the copies stay identical.

[Note: frozen parameters] A parameter with `requires_grad=False` stays frozen, as on one process
and as FSDP2, DeepSpeed and Megatron-Core keep it: every step that rebuilds a Parameter (tp's
DTensor, a stage's own copy of a tied weight, the allocation) carries `requires_grad` over, so
autograd gives it no gradient; FSDP2 reduces only the gradients that exist (a unit may mix
frozen and trainable parameters); the optimizer factory is given the trainable parameters
only (no state, no step, no weight decay for the frozen ones), ZeRO-1 partitions and gathers
only those, and clipping, tied-gradient sums and the loss scaler see only gradients that
exist. The frozen set is part of the plan's model (`ParamInfo.trainable`): the planner prices
gradients, their reduction and optimizer states for trainable parameters only, and a model
whose frozen set changed after planning is refused at its next step (`AutoParallel.step`).
Under a 16-bit plan with `frozen_dtype` set, frozen parameters are held in the compute dtype
(no fp32 master), which computes the same numbers: the compute reads a 16-bit cast of the
master either way.

The batch is any pytree of tensors (autoplan/inputs.py), split along each tensor's batch dim
over dp ranks and microbatches (runtime/step_inputs.py); the loss is the user's, the model's
own or the token cross-entropy ([Note: step loss]): each microbatch's mean loss is scaled by
1/num_microbatches and dp gradients are averaged. Under cp each rank keeps its two chunks of
every sample's tokens (token-LM batches and the token loss only; runtime/checks.py).
"""

from __future__ import annotations

import copy
import functools
from math import nan
from collections import defaultdict
from collections.abc import Mapping
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from autoplan.graph import CapturedGraph
from autoplan.inputs import InputSpec
from autoplan.runtime.evaluate import eval_batch
from autoplan.runtime.step_inputs import StepInputs, loss_mode
from autoplan.runtime.tied import sync_tied_grads, tied_groups, untie_across_stages
from autoplan.passes.blocks import install_blocks
from autoplan.passes.checkpointing import wrap_checkpointing
from autoplan.passes.context import apply_context_parallel, check_whole_graph
from autoplan.passes.device import retarget_device
from autoplan.passes.expand import counterparts
from autoplan.passes.kernels import fuse_kernels, keep_logits_sharded
from autoplan.runtime.optim import default_adamw
from autoplan.passes.pipeline import split_stages
from autoplan.passes.rng import RandomState, make_random_ops_layout_invariant, random_op_indices
from autoplan.passes.sharding import apply_placements, check_redistributions, value_placements
from autoplan.plan import Plan, parse_placement
from autoplan.runtime import parallel as _compat
from autoplan.runtime.checks import check_against_plan, check_context_parallel
from autoplan.runtime.offload import HostOptimizer
from autoplan.runtime.compiled import (compile_flat_stage, compile_stage, pin_cache_to_groups,
                                      random_ops_eager)
from autoplan.runtime.memory_stats import PhasePeaks
from autoplan.runtime.moe import ExpertParallel, check_expert_parallel
from autoplan.runtime.precision import LossScaler, Precision
from autoplan.runtime.weights import (ModuleWeights, Targets, WeightSource, allocate as _allocate,
                                      weights_to_meta as _weights_to_meta)
from autoplan._torch_compat import (concrete_value, flatten_mesh as _flatten_mesh,
                                   implicit_replication, outside_fake_mode,
                                   quiet_understood_warnings)

__all__ = ["DistributedModel", "cross_entropy_loss"]


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy. logits: (B, T, V); labels: (B, T) int64."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


class DistributedModel:
    """This rank's part of a planned model, trainable with `step`.

    Args:
        graph: the captured graph the plan was made for.
        plan: the plan.
        state: the full model (nn.Module) or its weights by FQN, identical on every rank;
            a mapping must include non-persistent buffers (e.g. rotary inv_freq).
        optimizer: `named_params -> torch.optim.Optimizer`, given this rank's trainable
            (FQN, parameter) pairs ([Note: frozen parameters]; the model's own names; torch
            optimizers take them as they take parameters, and groups can be built by name);
            default AdamW(lr=1e-3), with `kernels` the
            fused one (runtime/optim.py FusedAdamW, [Note: fused AdamW]).
        loss_fn: `(output, labels) -> scalar mean loss` of one microbatch (default: token
            cross-entropy weighted by the global batch's trained tokens, see `_token_loss`).
        device: "cpu" or "cuda".
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        lr_scheduler: `optimizer -> torch.optim.lr_scheduler.LRScheduler`, stepped after every
            optimizer step (None: none).
        inputs: the batch the graph was captured for (autoplan.inputs.InputSpec; default: the
            token-LM form, input_ids and labels of (global_batch, seq_len)).
        kernels: replace the RMSNorm and SwiGLU patterns of the stage graphs with the fused
            kernels' ops (autoplan/passes/kernels.py; Triton on CUDA, the torch reference on
            CPU), and step the default optimizer with the fused AdamW update; False runs the
            captured ops as they are and torch.optim.AdamW.
        compile: run each block module of this rank's stages (a stage without blocks: the
            whole stage) through torch.compile (inductor), [Note: compiled stages] in
            autoplan/runtime/compiled.py; None: as the plan assumed (`plan.compiled`).
        planned_graph: under cp, the graph the plan was made on (at the whole sequence): an
            aten.arange that is seq_len / cp long in `graph` is taken as a position index
            only if its namesake there is seq_len long (passes/context.py).

    The loss ([Note: step loss]): `loss_fn(output, target)` when given (the token-LM form:
    `(logits, labels)`; any other: the model's output and the batch as given to `step`, one
    microbatch of each); else the
    model's own `loss` output (an HF model given `labels`); else the token cross-entropy of the
    main output (`logits`) against the batch's `labels`.

    Must be constructed on every rank of a process group of size plan.mesh.world_size.
    Raises ValueError when the world size does not match the plan or when every parameter
    is frozen (nothing to train).
    """

    def __init__(self, graph: CapturedGraph, plan: Plan,
                 weights: WeightSource | nn.Module | Mapping[str, torch.Tensor], *,
                 optimizer: Callable | None = None, loss_fn: Callable | None = None,
                 device: str = "cpu", max_grad_norm: float | None = None,
                 seed: int | None = None, lr_scheduler: Callable | None = None,
                 inputs: InputSpec | None = None, kernels: bool = True,
                 compile: bool | None = None, planned_graph: CapturedGraph | None = None):
        if not dist.is_initialized() or dist.get_world_size() != plan.mesh.world_size:
            have = dist.get_world_size() if dist.is_initialized() else 0
            raise ValueError(
                f"plan needs {plan.mesh.world_size} ranks ({plan.mesh}); the process group "
                f"has {have}")
        quiet_understood_warnings()
        self.plan = plan
        self.graph = graph
        # cp: the graph captured at the whole sequence, to tell position indexes apart
        self.planned_nodes = counterparts(planned_graph, graph) \
            if planned_graph is not None and plan.mesh.cp > 1 else None
        self.inputs = inputs or InputSpec.tokens(plan.global_batch, plan.seq_len)
        self.loss_fn = loss_fn
        self.kernels = kernels
        self.kernel_counts: dict[int, dict[str, int]] = {}  # by stage: fuse_kernels' counts
        self.compile = plan.compiled if compile is None else bool(compile)
        self.compiled: dict[int, list[str]] = {}  # by stage: the module paths compiled
        # no loss to train on, or a cp plan this runtime cannot run: raise before building
        loss_mode(graph, self.inputs, loss_fn)
        check_context_parallel(plan, graph, self.inputs, loss_fn, self.compile)
        self.max_grad_norm = max_grad_norm
        self.grad_norm: float | None = None  # before clipping, of the last step
        self.device = torch.device(device)
        self.precision = Precision.of(plan.dtype, plan.frozen_dtype)
        self.memory = PhasePeaks(self.device)
        self.num_steps = 0
        self.skipped_steps = 0  # fp16 steps skipped for an overflowing gradient
        self.seed = _common_seed(seed)
        if not isinstance(weights, (nn.Module, Mapping)):
            source = weights
        else:
            source = ModuleWeights(weights)
        with self.memory.phase("construction"):
            # Up to the allocation everything is on the meta device or is bookkeeping read
            # back as Python values (the mesh's rank tables, FSDP2's sub-meshes): built outside
            # the fake mode of a dry run (runtime/dryrun.py), whose allocation and step make
            # fake tensors; a no-op otherwise.
            with outside_fake_mode():
                self.mesh = init_device_mesh(self.device.type, plan.mesh.shape,
                                             mesh_dim_names=plan.mesh.axis_names)
                self.pp_rank = self.mesh["pp"].get_local_rank()
                self.dp_rank = self.mesh["dp"].get_local_rank()
                self.tp_rank = self.mesh["tp"].get_local_rank()
                self.cp_rank = self.mesh["cp"].get_local_rank() if plan.mesh.cp > 1 else 0
                # gradients reduce and shard over dp x cp ([Note: context parallelism])
                self.dp_mesh = self.mesh["dp"] if plan.mesh.cp == 1 else \
                    _flatten_mesh(self.mesh["dp", "cp"], "dp_cp")
                self.batch = StepInputs(graph, self.inputs, loss_fn,
                                        global_batch=plan.global_batch,
                                        num_microbatches=plan.num_microbatches, dp=plan.mesh.dp,
                                        dp_rank=self.dp_rank, device=self.device,
                                        cp=plan.mesh.cp, cp_rank=self.cp_rank)
                # expert parallelism inside dp (runtime/moe.py): groups before stages use them
                check_expert_parallel(plan)
                self.expert_parallel = ExpertParallel(self.mesh, plan.mesh.ep) \
                    if plan.mesh.ep > 1 else None
                self.stages = self._build_stages()
            for _, module in self.stages:
                _allocate(module, self.device)
            self._tied = tied_groups(self)
            source.fill(self._targets())
            self.weight_source = source
            check_against_plan(self)
            # the optimizer steps the trainable parameters only ([Note: frozen parameters]);
            # a rank whose stages are wholly frozen (the bottom of a model frozen under pp)
            # gets its frozen ones, which never have a gradient: it steps nothing, keeps no
            # state, and its learning-rate schedule and checkpoint keys are as on every rank
            if graph.num_trainable_params == 0:
                raise ValueError(
                    "every parameter of the model is frozen (requires_grad=False): nothing to "
                    "train; unfreeze the parameters to train (param.requires_grad_(True)) or "
                    "evaluate the model without autoplan")
            named = self._unique_named_params()
            params = [(n, p) for n, p in named if p.requires_grad] or named
            # default: AdamW(lr=1e-3), its update the fused kernel where kernels are on
            # ([Note: fused AdamW] in runtime/optim.py)
            make_opt = optimizer or functools.partial(default_adamw, fused=self.kernels)
            # CPU offload ([Note: offload] in solver/offload.py): ZeRO 0/1 step on the host
            # here; ZeRO-3's is FSDP2's CPUOffloadPolicy (_apply_data_parallel)
            host = plan.offload == "optimizer"
            if plan.zero_stage == 1 and plan.mesh.dp_shard > 1:
                self.optimizer = _compat.ShardedOptimizer(params, make_opt, self.dp_mesh,
                                                          offload=host)
            elif host:
                self.optimizer = HostOptimizer(params, make_opt)
            else:
                self.optimizer = make_opt(params)
            # the scheduler drives the torch optimizer itself (ZeRO-1's inner one)
            self.lr_scheduler = lr_scheduler(getattr(self.optimizer, "inner", self.optimizer)) \
                if lr_scheduler is not None else None
            self.scaler = LossScaler(device=self.device) if self.precision.loss_scaling \
                else None
            self._schedule = self._build_schedule() if plan.mesh.pp > 1 else None
            self._count_microbatches()
            # No gc.collect() here: the graphs built above hold meta tensors only (weights
            # are allocated as shards at the end of _build_stages), so their reference cycles
            # free no memory worth a full collection, which took 0.3-0.8 s per rank in a
            # process that has captured a model (bench/runtime_vs_native.py, build_stats()).

    # -- construction -------------------------------------------------------------------
    def _build_stages(self) -> list[tuple[int, nn.Module]]:
        """This rank's stages, planned and sharded on the meta device (the caller allocates
        them: each rank holds only its shards, [Note: sharded construction] in
        runtime/weights.py)."""
        plan, graph = self.plan, self.graph
        # A fresh module hierarchy over the captured graph, its weights on meta (in the master
        # dtype): rebinding them must not touch the caller's CapturedGraph.
        gm = torch.fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph))
        random_ops = random_op_indices(gm)
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
            # Buffers (rotary tables, lifted constants) stay plain tensors: only constant-like
            # nodes read them, and those run replicated (implicit replication).

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
        # expert weights under ep are reduced by runtime/moe.py, not by FSDP2
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

    # -- training -----------------------------------------------------------------------
    def _build_schedule(self):
        last = self.num_stages - 1  # its output leaves replicated (the model's output)
        examples = {idx: (self._examples(self.stage_graphs[idx].input_names),
                          self._examples(self.stage_graphs[idx].output_names, idx == last))
                    for idx, _ in self.stages}
        return _compat.build_schedule(self.plan, self.stages, self.num_stages, self.device,
                                      self.mesh["pp"].get_group(), self._pp_loss, examples,
                                      input_batch_dims=self.batch.batch_dims)

    def _examples(self, names: list[str], replicated: bool = False) -> tuple[torch.Tensor, ...]:
        """Empty tensors shaped like this rank's local part of the named values at the
        microbatch size (the runtime graph's shapes, cut by the value's tp placement)."""
        vals = {n.name: n.meta.get("val") for n in self.graph.gm.graph.nodes}
        produced = value_placements(self.plan)
        out = []
        for name in names:
            val = vals[name]
            shape = list(val.shape)
            placement = parse_placement("R" if replicated else produced.get(name, "R"))
            if self.plan.mesh.tp > 1 and placement.is_shard():
                chunks = torch.empty(shape[placement.dim], device="meta").chunk(
                    self.plan.mesh.tp)
                shape[placement.dim] = chunks[self.tp_rank].shape[0] \
                    if self.tp_rank < len(chunks) else 0
            # floating values carry gradients between stages (the metadata says so)
            out.append(torch.empty(shape, dtype=val.dtype, device=self.device,
                                   requires_grad=val.dtype.is_floating_point))
        return tuple(out)

    def _pp_loss(self, output, index):
        """The schedule's loss: its target is the microbatch index (torch.arange(m), split
        by the schedule), which picks the microbatch's target of any structure."""
        # a dry run's fake index has no value; the microbatches' targets are of one shape (the
        # plan splits the batch evenly), which is all a dry run reads (runtime/dryrun.py)
        j = int(concrete_value(index, 0))
        return self.batch.loss(output, self.batch.targets[j]) * self._loss_scale()

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """One optimizer step on a token-LM batch (same tensors on every rank): input_ids,
        labels (global_batch, seq_len). Returns the global mean loss (every rank)."""
        return self.step_batch([input_ids, labels])

    def step_batch(self, leaves: list[torch.Tensor]) -> float:
        """One optimizer step on the global batch given as the flat leaves of `self.inputs`
        (same tensors on every rank; `InputSpec.flatten` of the batch). Returns the global mean
        loss (every rank)."""
        local = self.batch.local(leaves)
        self._parts = self.batch.start(leaves, local)
        self.num_steps += 1
        with self.memory.phase("first_step" if self.num_steps == 1 else "step"):
            return self._step(local)

    def eval_batch(self, leaves: list[torch.Tensor], return_outputs: bool = False):
        """The loss (and with `return_outputs` the outputs) of a batch without training; see
        autoplan.runtime.evaluate.eval_batch. Collective."""
        return eval_batch(self, leaves, return_outputs)

    def _step(self, local: list[torch.Tensor]) -> float:
        for state in self._random_states.values():
            state.step = self.num_steps - 1
        self._microbatch = defaultdict(int)
        self.optimizer.zero_grad(set_to_none=True)
        # Constant-like tensors (position ids, masks) stay plain tensors inside a DTensor
        # stage; their use in backward (e.g. embedding_dense_backward) needs the same implicit
        # replication as the forward, so forward and backward both run inside it.
        with implicit_replication():
            loss = self._forward_backward(local)
        if self.expert_parallel is not None:
            self.expert_parallel.reduce_gradients()
        sync_tied_grads(self)
        if self.scaler is None or self.scaler.unscale_and_check(self._local_grads()):
            if self.max_grad_norm is not None:
                # NaN in a dry run: a fake norm has no value (runtime/dryrun.py)
                self.grad_norm = concrete_value(self.clip_grad_norm(self.max_grad_norm), nan)
            self.optimizer.step()
        else:
            self.skipped_steps += 1
        if self.lr_scheduler is not None:  # every step, skipped or not (as HF's Trainer)
            self.lr_scheduler.step()
        if self.plan.mesh.dp_shard > 1:  # each cp rank holds a share of its samples' loss
            dist.all_reduce(loss, group=self.dp_mesh.get_group())
            loss = loss / self.plan.mesh.dp_shard
        return concrete_value(loss, nan)  # NaN in a dry run (runtime/dryrun.py)

    def _count_microbatches(self) -> None:
        """Before each forward of a stage (microbatch j, in increasing order on every stage
        under every schedule), point its random ops at the samples that microbatch holds:
        dp_rank * local_batch + j * microbatch_size ([Note: RNG contract]). Shape inference
        (meta inputs) is not a microbatch."""
        local_batch = self.plan.global_batch // self.plan.mesh.dp
        mb = local_batch // self.plan.num_microbatches
        self._microbatch: dict[int, int] = defaultdict(int)
        for idx, module in self.stages:
            state = self._random_states.get(idx)
            if state is None:
                continue

            def hook(_module, args, idx=idx, state=state):
                if any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
                    return
                j = self._microbatch[idx]
                self._microbatch[idx] = j + 1
                state.sample_offset = self.dp_rank * local_batch + j * mb

            module.register_forward_pre_hook(hook)

    def _local_grads(self) -> list[torch.Tensor]:
        return [_compat.local_tensor(p.grad) for p in self._unique_params()
                if p.grad is not None]

    def _loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def memory_stats(self) -> dict[str, object]:
        """Measured peaks of this rank by phase, bytes: `construction_peak_bytes`,
        `first_step_peak_bytes`, `step_peak_bytes` (the last step after the first), with the
        measure used (resident set high-water mark on CPU, CUDA's max allocated on GPU), the
        baseline resident bytes before construction, this rank's parameter bytes and the plan's
        predicted peak (`predicted_peak_bytes`)."""
        out = self.memory.as_dict()
        out["local_param_bytes"] = sum(
            _compat.local_tensor(p).numel() * _compat.local_tensor(p).element_size()
            for p in self._unique_params())
        out["predicted_peak_bytes"] = self.plan.prediction.memory_bytes
        return out

    def _forward_backward(self, local: list[torch.Tensor]) -> torch.Tensor:
        """Forward and backward of all microbatches of this dp rank's leaves; returns this dp
        rank's mean loss."""
        m, parts = self.plan.num_microbatches, self._parts
        if self._schedule is not None:
            losses: list[torch.Tensor] = []
            is_first = any(idx == 0 for idx, _ in self.stages)
            is_last = any(idx == self.num_stages - 1 for idx, _ in self.stages)
            index = torch.arange(m, device=self.device) if is_last else None
            self._schedule.step(*(self.batch.model_inputs(local) if is_first else ()),
                                target=index, losses=losses, return_outputs=False)
            loss = torch.stack([l.detach().float() for l in losses]).mean() \
                / self._loss_scale() if is_last else torch.zeros((), device=self.device)
            dist.all_reduce(loss, group=self.mesh["pp"].get_group())
            return loss
        (_, module), = self.stages
        # Gradient accumulation: replicated gradients (ZeRO 0, 1) are reduced once, after
        # the last microbatch (DDP's no_sync); ZeRO 2/3 reduce-scatter every microbatch, so
        # that no rank ever holds the stage's whole gradient.
        sync_last_only = self.plan.zero_stage <= 1 and isinstance(module, FSDPModule)
        total = torch.zeros((), device=self.device)
        for i, part in enumerate(parts):
            if sync_last_only:
                module.set_requires_gradient_sync(i == m - 1)
            out = module(*self.batch.model_inputs(part))  # the hook counts microbatch i
            loss = self.batch.loss(out, self.batch.targets[i]) / m
            # the loss saved what its backward needs: the logits go before the backward, not
            # after it (torchtitan frees its `pred` likewise; [Note: loss working set] in
            # cost_model/memory.py)
            del out
            (loss * self._loss_scale() if self.scaler else loss).backward()
            total += loss.detach().float()
        return total

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

    def save_pretrained(self, path, *, config=None, max_shard_bytes: int = 5_000_000_000) -> None:
        """A consolidated Hugging Face checkpoint of the trained weights (collective); see
        autoplan.runtime.hf_checkpoint.save_pretrained."""
        from autoplan.runtime.hf_checkpoint import save_pretrained

        save_pretrained(self, path, config=config, max_shard_bytes=max_shard_bytes)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) parameters held by this rank, by FQN (collective over tp/dp)."""
        out = {}
        for _, m in self.stages:
            for name, p in m.named_parameters():
                t = p.full_tensor() if isinstance(p, DTensor) else p
                out[name] = t.detach().clone()
        return out


def _common_seed(seed: int | None) -> int:
    """The seed of the random ops: `seed`, or rank 0's `torch.initial_seed()` (the last
    `torch.manual_seed`), the same on every rank."""
    if seed is None:
        box = [torch.initial_seed()]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        seed = int(box[0])
    return int(seed)
