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
   layout-invariant (`passes.rng`, [Note: RNG contract]). The plan's FP8 linears become calls
   of the FP8 linear (`passes.float8`, [Note: float8 recipe]). The RMSNorm and SwiGLU patterns
   become the fused kernels' ops (`passes.kernels`, [Note: kernel fusion]; `kernels=False`: not).
   Under cp (the graph captured at seq_len / cp tokens per sample), attention gathers K and V
   over the cp axis and positions become the rank's global ones (`passes.context_parallel`, [Note:
   context parallelism] in cost_model/context_parallel.py).
4. Each repeated block becomes a called module (`passes.blocks`), checkpointed inside when the
   plan says so (`passes.checkpointing`); with `compile`, each block's forward goes through
   torch.compile ([Note: compiled stages] in runtime/compiled.py).
5. Data parallelism by ZeRO stage, with torch's FSDP2 machinery on the dp sub-mesh, one unit
   per block plus one for the rest of the stage: 0 -> `replicate` (DDP-style all-reduce),
   2 -> `fully_shard(reshard_after_forward=False)`, 3 -> `fully_shard(reshard_after_forward=
   True)` for the blocks (False for the rest: the backward starts with it); a 16-bit plan
   adds FSDP2's MixedPrecisionPolicy ([Note: precision recipe]). ZeRO-1
   (optimizer states only) is not expressible in FSDP2: it runs `replicate` for the gradients
   and a sharded optimizer (`ShardedOptimizer`, runtime/zero1.py): each dp rank steps its
   rows of every parameter, then all-gathers them ([Note: ZeRO-1 partition]).
6. Pipeline parallelism: `torch.distributed.pipelining` stages and schedules (GPipe, 1F1B,
   interleaved 1F1B, interleaved zero bubble) with static shapes; without pp, microbatches are plain gradient
   accumulation (replicated gradients, ZeRO 0/1, are reduced once, after the last microbatch).
7. Allocation: `to_empty` gives this rank its shards only, a `WeightSource` fills them one
   full tensor at a time ([Note: sharded construction] in runtime/weights.py), and the build is
   checked against the plan (runtime/checks.py).
8. Weights used by several stages (tied embedding and head) get their gradients summed over
   the stages that hold them before the optimizer step, so the copies stay identical.

Steps 2-5 are the lowering (autoplan/passes/lowering.py `lower_rank`, [Note: pass order]), called
by `RankStages` (autoplan/runtime/rank_stages.py), this engine's base class, which does the
runtime's part of them (tp parameters as DTensors, compile, FSDP2).

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

import functools
from math import nan
from collections import defaultdict
from collections.abc import Mapping
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from autoplan.graph import CapturedGraph
from autoplan.inputs import InputSpec
from autoplan.runtime.evaluate import eval_batch
from autoplan.runtime.step_inputs import StepInputs, loss_mode
from autoplan.runtime.tied import sync_tied_grads, tied_groups
from autoplan.passes.expand import counterparts
from autoplan.runtime.optim import default_adamw, whole_tensor_reason
from autoplan.passes.sharding import value_placements
from autoplan.plan import Plan, optimizer_pieces, parse_placement
from autoplan.runtime import parallel as _compat
from autoplan.runtime.checks import check_against_plan, check_context_parallel
from autoplan.runtime.offload import HostOptimizer
from autoplan.runtime.memory_stats import PhasePeaks
from autoplan.runtime.expert_parallel import ExpertParallel, check_expert_parallel
from autoplan.runtime.precision import LossScaler, Precision
from autoplan.runtime.rank_stages import RankStages
from autoplan.runtime.shutdown import forget_at_exit
from autoplan.runtime.weights import ModuleWeights, WeightSource, allocate as _allocate
from autoplan._torch_compat import (concrete_value, flatten_mesh as _flatten_mesh, shared_mesh,
                                   implicit_replication, outside_fake_mode,
                                   quiet_understood_warnings)

__all__ = ["DistributedModel", "cross_entropy_loss"]


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy. logits: (B, T, V); labels: (B, T) int64."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


class DistributedModel(RankStages):
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
            only if its namesake there is seq_len long (passes/context_parallel.py).

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
        self.float8_linears: set[str] = set()  # weight FQNs of the FP8 linears built
        self.compile = plan.compiled if compile is None else bool(compile)
        self.compiled: dict[int, list[str]] = {}  # by stage: the module paths compiled
        if self.compile and plan.float8_linears:  # the planner refuses it too (planner.py)
            raise ValueError(f"compile=True with a float8 plan ({len(plan.float8_linears)} FP8 "
                             "linears): the FP8 linear does not run compiled yet (its amax "
                             "all-reduces are eager collectives); build it with compile=False")
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
                # one mesh (one set of groups) per shape in a process, shared by its engines
                self.mesh = shared_mesh(self.device.type, plan.mesh.shape, plan.mesh.axis_names)
                # in a group autoplan created, its groups go at exit ([Note: orderly exit])
                forget_at_exit(self.mesh)
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
                # expert parallelism inside dp (runtime/expert_parallel.py): groups before stages
                # use them
                check_expert_parallel(plan)
                self.expert_parallel = ExpertParallel(self.mesh, plan.mesh.ep,
                                                      plan.placement_of) \
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
            self._check_elementwise(optimizer, params)
            # CPU offload ([Note: offload] in cost_model/offload.py): ZeRO 0/1 step on the host
            # here; ZeRO-3's is FSDP2's CPUOffloadPolicy (rank_stages.py apply_data_parallel)
            host = plan.offload == "optimizer"
            if plan.zero_stage == 1 and plan.mesh.dp_shard > 1:
                # an expert slice is partitioned over the ranks that hold it (dp / ep)
                ep = self.expert_parallel
                groups = {id(p): ep.outer_mesh for p in ep.params} if ep else None
                self.optimizer = _compat.ShardedOptimizer(params, make_opt, self.dp_mesh,
                                                          offload=host, groups=groups)
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

    def _check_elementwise(self, optimizer, params) -> None:
        """ValueError, at build, when this plan hands the user's `optimizer` pieces of each
        tensor (ZeRO-1's rows, offloaded tp shards) and it reads whole tensors ([Note:
        elementwise optimizer] in runtime/optim.py): its update would silently differ from
        one process's. The planner leaves such plans out; this catches one given by hand or
        read from a file."""
        plan = self.plan
        why = optimizer_pieces(plan.zero_stage, plan.mesh.dp, plan.mesh.cp, plan.mesh.tp,
                               plan.offload)
        if optimizer is None or why is None:
            return
        reason = whole_tensor_reason(optimizer, params)
        if reason is not None:
            raise ValueError(
                f"plan: {why}, but {reason}. Plan with this optimizer given (@autoparallel("
                f"optimizer=...) leaves such plans out), or fix zero_stage 0, 2 or 3 and no "
                f"'optimizer' offload at tp > 1")

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

    def save_pretrained(self, path, *, config=None, max_shard_bytes: int = 5_000_000_000,
                        extra_files=None) -> None:
        """A consolidated Hugging Face checkpoint of the trained weights (collective); see
        autoplan.runtime.hf_checkpoint.save_pretrained."""
        from autoplan.runtime.hf_checkpoint import save_pretrained

        save_pretrained(self, path, config=config, max_shard_bytes=max_shard_bytes,
                        extra_files=extra_files)

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
