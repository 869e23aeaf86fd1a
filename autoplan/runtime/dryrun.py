"""Dry run at the scale of the plan: one rank of a plan of any world size, in this process, on
fake tensors -- the real runtime, nothing allocated.

[Note: dry run] For each chosen global rank, `dry_run` initialises torch's `fake` process-group
backend at that rank and the plan's world size (collectives return at once and move nothing),
builds the rank's `DistributedModel` through the constructor a training job calls (sharded
construction, tp placements, FSDP2 units with the plan's mixed-precision policy, the pipeline
schedule with the plan's microbatches and virtual stages, cp, the fused kernels), with every
tensor a fake tensor (torch's FakeTensorMode: shapes, dtypes and devices, no storage), and
runs one whole `step`: every microbatch, backward with recomputation, gradient reduction,
tied-weight sums, clipping and the optimizer step. Before it, the rank is left as a first step
leaves it at the cost of an optimizer step (`_create_optimizer_states`: every gradient zeros,
then the step's own tail, which creates the optimizer states), so that the measured step is
one of the steady state the plan prices; tests/test_dryrun_vs_real.py holds it against two
real steps. A `DryRunRecorder` (dryrun_recorder.py:
a TorchDispatchMode under DTensor, as torch's MemTracker sits) sees every local aten op of
the rank and records:

- memory: the bytes of every fake storage from its allocation until it is freed (resizes
  included: FSDP2 frees and re-allocates unsharded parameters with `UntypedStorage.resize_`),
  as autoplan/runtime/live_bytes.py counts real CPU storages; the step's peak is taken by
  category (`CATEGORIES`), as the cost model counts them (cost_model/memory.py): storages
  that are, at the end of the step, a parameter (or buffer), a gradient or an optimizer
  state count as such; a pipeline receive buffer (filled by `recv`) "comm_buffers"; what
  FSDP2 resizes (unsharded parameters) or fills by an all-gather or reduce-scatter
  "temporaries"; any other storage counts by where it was allocated: in the optimizer step
  "optimizer", outside backward "activations" (the loss included), in backward (with its
  recomputation), "temporaries"; and the moment of each allocation and free (`moment`:
  construction, the forward or backward of microbatch j, the optimizer step, ...), so that
  the peak, and the first allocation above the device's memory (`DryRunOutOfMemory`: the
  rank fails as it would on the cluster), say when they happen;
- every collective and point-to-point op (c10d and functional collectives), with its
  process group named by mesh axis, dtype and bytes -- a plan for GPUs runs DTensor's
  Shard(i) -> Shard(j) as NCCL ranks do, one all-to-all of the local tensor
  (`device_all_to_all`, `_torch_compat.shard_dim_all_to_all`), not as gloo ranks do (an
  all-gather of the whole tensor, whose chunk can stay a view of all of it);
- FLOPs, with torch.utils.flop_counter's formulas (matmuls and attention) on local shapes.

Checked against real runs: tests/test_dryrun_vs_real.py runs the same plans on 4 gloo ranks,
their collectives recorded by the same code (collective_log.py) and their tensors counted by
`LiveTensorBytes`: bytes per axis are equal, and so is the peak, up to scalars and the buffers
of a collective still in flight (the test's docstring says by how much).

Known mislabel: FSDP2's replicate (ZeRO 0/1) accumulates a microbatch's gradients in unsharded
buffers of its own until the last microbatch's all-reduce, and those count as "temporaries"
(they are gradients, but no parameter holds them at the end of the step); the peak is right.

What the dry run does not see: the weights' values (the weight source allocates its shards
and fills nothing: the values of a fake tensor do not exist), memory below the dispatcher
(kernel scratch, NCCL buffers, allocator fragmentation), and the Python heap. A value read
back to Python (the loss, the gradient norm, the optimizer's step count) has none: the
runtime reads it through `_torch_compat.concrete_value`, which gives NaN, or the stated
stand-in, for a fake tensor. Any other read of a value raises `DryRunError` naming the op
and the runtime line that asked for it.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autoplan import _torch_compat as tc
from autoplan.graph import CapturedGraph
from autoplan.plan import DryRunRecord, Plan
from autoplan.runtime.collective_log import Collective, bytes_by_axis, label_collectives
from autoplan.runtime.dryrun_recorder import (CATEGORIES, DryRunRecorder, follow_moments,
                                              optimizer_phases)
from autoplan.runtime.offload import HostOptimizer
from autoplan.runtime.dryrun_plan import (predicted_rank_memory, priced_rank_traffic,
                                          rank_coordinates)
from autoplan.runtime.parallel import local_tensor
from autoplan.runtime.step_ops import OpLog

__all__ = ["CATEGORIES", "Collective", "RankDryRun", "DryRunError", "DryRunOutOfMemory",
           "DryRunRecorder", "FakeWeights", "dry_run", "predicted_rank_memory",
           "priced_rank_traffic",
           "rank_coordinates"]


class DryRunError(RuntimeError):
    """A part of the runtime that cannot run on fake tensors (it reads a tensor's value)."""


class DryRunOutOfMemory(DryRunError):
    """A rank whose live tensors exceed the device's memory during its dry run: where the
    cluster would fail with out of memory.

    Attributes:
        rank: the global rank; coordinates: its mesh coordinate by axis.
        moment: when ("backward of microbatch 1 of 4", "optimizer step", "construction").
        category: the category (`CATEGORIES`) of the allocation that went above.
        alloc_bytes: that allocation's bytes.
        live_bytes: live tensor bytes with it, > device_mem_bytes.
        live_by_category: `live_bytes` by category.
        device_mem_bytes: the device's memory, bytes.
    """

    def __init__(self, rank: int, coordinates: dict[str, int], moment: str, category: str,
                 alloc_bytes: int, live_by_category: dict[str, int], device_mem_bytes: float):
        from autoplan.units import fmt_bytes

        self.rank, self.coordinates, self.moment = rank, coordinates, moment
        self.category, self.alloc_bytes = category, alloc_bytes
        self.live_by_category = live_by_category
        self.live_bytes = sum(live_by_category.values())
        self.device_mem_bytes = device_mem_bytes
        where = " ".join(f"{k}{v}" for k, v in coordinates.items())
        held = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in
                         sorted(live_by_category.items(), key=lambda kv: -kv[1]) if v)
        super().__init__(
            f"rank {rank} ({where}) runs out of memory in the {moment}: {fmt_bytes(alloc_bytes)} "
            f"of {category} bring its live tensors to {fmt_bytes(self.live_bytes)} ({held}), "
            f"above the device's {fmt_bytes(device_mem_bytes)}")


@dataclass(frozen=True)
class RankDryRun:
    """What one rank did in one training step of a dry run, next to the plan's prediction.

    Attributes:
        rank: the global rank.
        coordinates: its mesh coordinate by axis, {"pp", "dp", "cp", "tp"} (cp 0 without cp).
        peak_bytes: the step's peak of live tensor storage on the rank's device, bytes (an
            offloaded plan's host-resident states and host copies left out).
        peak_by_category: `peak_bytes` by `CATEGORIES` at that moment, bytes.
        peak_by_op: what is live at that moment by category and by the op that allocated
            it, {category: [(op, bytes, tensors), ...]}, the 8 largest ops of each category
            (`DryRunRecorder.live_by_op`): which tensors make the peak, to hold against the
            cost model's saved tensors ([Note: saved tensors] in cost_model/activations.py).
        resident_bytes: live storage when the step began (parameters and buffers), bytes.
        collectives: every collective / p2p op of the step, in issue order.
        bytes_by_axis: the sum of `Collective.bytes` by axis.
        flops: FLOPs of the step on this rank (matmuls and attention; recomputation included).
        predicted_peak_bytes: the plan's peak for this rank (`predicted_rank_memory`).
        predicted_by_category: its breakdown by category.
        predicted_flops: the FLOPs the plan prices for a rank at this pp coordinate
            (`Prediction.flops_by_pp_rank`, recomputation included; `model_flops /
            world_size` for a plan written without it).
        priced_bytes_by_axis: the plan's bytes per mesh axis for this rank's pipeline rank
            (`priced_rank_traffic`), what `bytes_by_axis` is held against.
        peak_moment: when the peak occurs ("backward of microbatch 3 of 4", `DryRunRecorder`).
        local_param_bytes: this rank's parameter shards (each tensor once), bytes.
        num_params: this rank's parameter tensors.
        build_s, step_s: wall seconds of the construction and of the measured step.
        counts: collectives by "op@axis".
        actions: under pp, this rank's pipeline actions in the measured step, in the order it
            ran them, in the notation of torch's schedule IR (`_Action`: "0F1" stage 0's
            forward of microbatch 1, "0B1" its backward, "0SEND_F1" / "1RECV_F1" / "1SEND_B1"
            / "0RECV_B1" the p2p, "0REDUCE_GRAD" the stage's gradient reduction;
            `DryRunRecorder.follow_actions`).
        ops: with `dry_run(record_ops=True)`, every op of the measured step in order (an
            `OpLog` of `StepOp`s, [Note: whole-step export] in runtime/step_export.py); None
            otherwise.
    """

    rank: int
    coordinates: dict[str, int]
    peak_bytes: int
    peak_by_category: dict[str, int]
    resident_bytes: int
    collectives: tuple[Collective, ...]
    bytes_by_axis: dict[str, int]
    flops: int
    predicted_peak_bytes: float
    predicted_by_category: dict[str, float]
    predicted_flops: float
    local_param_bytes: int = 0
    num_params: int = 0
    build_s: float = 0.0
    step_s: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    peak_moment: str = ""
    actions: tuple[str, ...] = ()
    ops: OpLog | None = None
    priced_bytes_by_axis: dict[str, float] = field(default_factory=dict)
    peak_by_op: dict[str, list[tuple[str, int, int]]] = field(default_factory=dict)

    def record(self) -> DryRunRecord:
        """What the plan records of this rank (`Plan.dry_run`, plan.json's "dry_run")."""
        return DryRunRecord(
            rank=self.rank, coordinates=dict(self.coordinates), peak_bytes=self.peak_bytes,
            peak_by_category=dict(self.peak_by_category), peak_moment=self.peak_moment,
            bytes_by_axis=dict(self.bytes_by_axis), flops=self.flops,
            predicted_peak_bytes=self.predicted_peak_bytes,
            predicted_by_category=dict(self.predicted_by_category),
            predicted_flops=self.predicted_flops,
            priced_bytes_by_axis=dict(self.priced_bytes_by_axis))


class FakeWeights:
    """The weight source of a dry run ([Note: sharded construction] in runtime/weights.py):
    the shards the allocation made stay as they are (fake: no values to fill); the buffers
    still on meta (rotary tables) get a fake tensor of their shape."""

    def fill(self, targets) -> None:
        for fqn, owners in targets.buffers.items():
            module, leaf = owners[0]
            b = module._buffers[leaf]
            targets.put(fqn, torch.empty(b.shape, dtype=b.dtype, device=targets.device))


def dry_run(graph: CapturedGraph, plan: Plan, ranks: Sequence[int] | None = None, *,
            planned_graph: CapturedGraph | None = None, inputs=None, optimizer=None,
            loss_fn=None, max_grad_norm: float | None = 1.0, kernels: bool = True,
            steps: int = 1, device_mem_bytes: float | None = None,
            record_ops: bool = False, device_kernels: bool = False,
            device_all_to_all: bool = False) -> list[RankDryRun]:
    """One training step of each of `ranks` (default: rank 0) of `plan`, each in this process
    on a fake process group of the plan's world size and on fake tensors ([Note: dry run]).

    Args:
        graph: the graph the runtime runs, as `AutoParallel` captures it: the whole model at
            the plan's microbatch size, seq_len / cp tokens per sample under cp.
        plan: the plan (made on `graph`, or on `planned_graph`).
        ranks: global ranks to dry-run, one after the other.
        planned_graph: the graph the plan was made on when it is not `graph` (a few blocks,
            the global batch, the whole sequence): the plan is retargeted to `graph`
            (passes/expand.py plan_for_graph) and cp tells positions apart with it.
        inputs, optimizer, loss_fn, max_grad_norm, kernels: as `DistributedModel` takes them.
        steps: training steps to run, the last measured. Before the first, the optimizer's
            states are created as a first step leaves them (an optimizer step on zero
            gradients, `_create_optimizer_states`), so that one step is a step of the steady
            state the plan predicts.
        device_mem_bytes: the memory of the device the plan is for, bytes (the topology's
            `device.mem_bytes`); a rank whose live tensors exceed it, at any moment of its
            construction or steps, fails as on the cluster (an offloaded plan's host-resident
            states left aside: `_check_fits`). None: not checked.
        device_kernels: the plan's devices run the Triton kernels (`DeviceSpec.fuses_pointwise`:
            the GPU presets, as the cost model prices them): the kernels called outside the
            custom ops (the vocab-parallel loss, the fused AdamW) allocate what their Triton
            path allocates and launch nothing (kernels/_dispatch.py device_allocations); False:
            they run the torch reference a CPU rank runs.
        device_all_to_all: the plan's ranks have all-to-all (`DeviceSpec.all_to_all`: NCCL on
            the GPU presets): a Shard(i) -> Shard(j) redistribution runs one, as DTensor does on
            a GPU mesh (`_torch_compat.shard_dim_all_to_all`), and is priced so; False: gloo's
            all-gather and chunk, as on CPU ranks.
        record_ops: keep every op of the measured step in `RankDryRun.ops` (for
            `export_step`, runtime/step_export.py).

    Returns a RankDryRun per rank, in the order given. Raises ValueError when a process
    group is initialised already (a dry run needs its own), or a rank is outside the plan;
    DryRunError where the runtime reads a tensor's value; DryRunOutOfMemory (a DryRunError)
    for the first rank that exceeds `device_mem_bytes`, naming the moment and the category.
    """
    from autoplan.passes.expand import plan_for_graph

    if dist.is_initialized():
        raise ValueError("dry_run sets up a fake process group of its own for each rank; this "
                         "process already has one (call it outside a training job)")
    if steps < 1:
        raise ValueError(f"dry_run: steps={steps}; at least one step is measured")
    if planned_graph is not None:
        plan = plan_for_graph(plan, planned_graph, graph)
    ranks = [0] if ranks is None else list(ranks)
    for rank in ranks:
        rank_coordinates(plan, rank)  # a rank outside the plan fails before any is run
    return [_dry_run_rank(graph, plan, rank, planned_graph=planned_graph, inputs=inputs,
                          optimizer=optimizer, loss_fn=loss_fn, max_grad_norm=max_grad_norm,
                          kernels=kernels, steps=steps, device_mem_bytes=device_mem_bytes,
                          record_ops=record_ops, device_kernels=device_kernels,
                          device_all_to_all=device_all_to_all)
            for rank in ranks]


def _dry_run_rank(graph, plan, rank, *, inputs, steps, device_mem_bytes, record_ops,
                  device_kernels=False, device_all_to_all=False,
                  **engine_args) -> RankDryRun:
    from kernels._dispatch import device_allocations

    from autoplan.inputs import InputSpec
    from autoplan.runtime.engine import DistributedModel

    inputs = inputs or InputSpec.tokens(plan.global_batch, plan.seq_len)
    dist.init_process_group("fake", store=tc.fake_store(), rank=rank,
                            world_size=plan.mesh.world_size)
    fake = tc.fake_tensor_mode()
    recorder = DryRunRecorder(fake, record_ops=record_ops)
    try:
        kernel_path = device_allocations() if device_kernels else contextlib.nullcontext()
        all_to_all = tc.shard_dim_all_to_all() if device_all_to_all else \
            contextlib.nullcontext()
        with fake, recorder, _named_value_reads(rank), optimizer_phases(recorder), kernel_path, \
                all_to_all:
            start_s = time.perf_counter()
            engine = DistributedModel(graph, plan, FakeWeights(), seed=0, device="cpu",
                                      inputs=inputs, **engine_args)
            if engine._schedule is not None:  # the pipeline's warm-up vote, without peers
                tc.vote_pipeline_mode_locally(engine._schedule)
            built_s = time.perf_counter()
            leaves = inputs.example(plan.global_batch, "cpu")
            recorder.phase = "step"
            _create_optimizer_states(engine, leaves, recorder)
            follow_moments(recorder, engine)
            for _ in range(steps - 1):
                engine.step_batch(leaves)
            start, resident = len(recorder.events), recorder.current
            del recorder.collectives[:], recorder.actions[:]  # the measured step's only
            if recorder.ops is not None:
                recorder.ops.clear()
            recorder.part = "before the forward"
            recorder.flops = 0
            step_start_s = time.perf_counter()
            engine.step_batch(leaves)
            step_s = time.perf_counter() - step_start_s
            del leaves
        categories = _final_categories(engine, recorder)
        if device_mem_bytes is not None:
            _check_fits(recorder, categories, rank, plan, device_mem_bytes)
        # the device's peak: an offloaded plan's host-resident states left out
        peak, by_category, peak_end = recorder.peak(start, categories,
                                                    _HOST_CATEGORIES[plan.offload])
        peak_by_op = recorder.live_by_op(peak_end, categories)
        for category in _HOST_CATEGORIES[plan.offload]:  # not on the device: as by_category
            peak_by_op.pop(category, None)
        calls = tuple(label_collectives(recorder.collectives, engine))
        shards = [local_tensor(p) for p in engine._unique_params()]
    finally:
        dist.destroy_process_group()
        tc.clear_dtensor_caches()
    by_axis, counts = bytes_by_axis(calls)
    predicted = predicted_rank_memory(plan, rank)
    prediction = plan.prediction
    return RankDryRun(
        rank=rank, coordinates=rank_coordinates(plan, rank), peak_bytes=peak,
        peak_by_category=by_category, resident_bytes=resident, collectives=calls,
        bytes_by_axis=by_axis, flops=recorder.flops,
        predicted_peak_bytes=predicted["peak"],
        predicted_by_category={k: v for k, v in predicted.items() if k != "peak"},
        predicted_flops=(prediction.flops_by_pp_rank[rank_coordinates(plan, rank)["pp"]]
                         if prediction.flops_by_pp_rank
                         else prediction.model_flops / plan.mesh.world_size),
        local_param_bytes=sum(t.numel() * t.element_size() for t in shards),
        num_params=len(shards), build_s=built_s - start_s, step_s=step_s, counts=counts,
        peak_moment=recorder.moment_at(peak_end), actions=tuple(recorder.actions),
        ops=recorder.ops, priced_bytes_by_axis=priced_rank_traffic(
            plan, rank, graph, all_to_all=device_all_to_all),
        peak_by_op=peak_by_op)


def _check_fits(recorder: DryRunRecorder, categories: dict[int, str], rank: int, plan: Plan,
                device_mem_bytes: float) -> None:
    """Raise DryRunOutOfMemory at the first event whose live bytes on the device exceed its
    memory. Offloaded states live in host memory ([Note: offload] in cost_model/offload.py), and
    a dry run holds every fake tensor on one device: their categories are left out (the
    optimizer states; with "optimizer+params" the parameter shards and gradients too)."""
    host = _HOST_CATEGORIES[plan.offload]
    end = recorder.first_above(device_mem_bytes, categories, host)
    if end is None:
        return
    aid, delta = recorder.events[end - 1]
    live = {k: v for k, v in recorder.live_by_category(end, categories).items()
            if k not in host}
    raise DryRunOutOfMemory(rank, rank_coordinates(plan, rank), recorder.moment_at(end),
                            recorder.category_of(aid, categories), delta, live,
                            device_mem_bytes)


# The categories that an offloaded plan holds in host memory, by Plan.offload
_HOST_CATEGORIES = {"none": frozenset(), "optimizer": frozenset({"optimizer"}),
                    "optimizer+params": frozenset({"params", "grads", "optimizer"})}


def _create_optimizer_states(engine, leaves, recorder: DryRunRecorder) -> None:
    """The first training step's lasting effect, without its forward and backward: every
    trainable parameter's gradient set to zeros of its own type and placements (as its
    backward and reduction leave it), then the rest of `engine.step_batch` as a step runs it
    (tied and expert gradient sums, clipping, the optimizer step, which creates the optimizer
    states, the learning-rate schedule). The measured step that follows is one of the steady
    state the plan predicts, at the cost of an optimizer step instead of a whole one
    ([Note: dry run]). The collectives it issues are not the measured step's."""
    def zero_gradients(_local):
        for p in engine._unique_params():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if (aid := recorder.alloc_id(p.grad)) is not None:
                    recorder.sites[aid] = "grads"
        return torch.zeros((), device=engine.device)

    engine._forward_backward = zero_gradients
    recorder.part = recorder.optimizer_moment = "first optimizer step (creating its states)"
    try:
        engine.step_batch(leaves)
    finally:
        del engine._forward_backward  # the class's method again
        recorder.optimizer_moment, recorder.part = "optimizer step", "before the forward"


def _final_categories(engine, recorder: DryRunRecorder) -> dict[int, str]:
    """Allocation id -> "params" / "grads" / "optimizer" for the storages that are one at the
    end of the step ([Note: dry run]); buffers count with the parameters."""
    out: dict[int, str] = {}

    def put(t, category):
        if isinstance(t, torch.Tensor):
            aid = recorder.alloc_id(t)
            if aid is not None:
                out.setdefault(aid, category)

    for _, module in engine.stages:
        for p in module.parameters():
            put(p, "params")
            put(p.grad, "grads")
        for b in module.buffers():
            put(b, "params")
    optimizer = getattr(engine.optimizer, "inner", engine.optimizer)
    for state in optimizer.state.values():
        for t in state.values():
            put(t, "optimizer")
    # the host optimizer's fp32 copies of the parameters it steps, in host memory with its
    # states (runtime/offload.py HostOptimizer; ZeRO-1's `host`)
    host = engine.optimizer if isinstance(engine.optimizer, HostOptimizer) else getattr(
        engine.optimizer, "host", None)
    for _, copy in getattr(host, "pairs", ()):
        put(copy, "optimizer")
    return out


@contextlib.contextmanager
def _named_value_reads(rank: int):
    """Turns a fake tensor's "no value" errors into a DryRunError naming the runtime line that
    read the value, and the op."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                               DynamicOutputShapeException)

    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        frames = [f for f in traceback.extract_tb(error.__traceback__)
                  if "/autoplan/" in f.filename
                  and not f.filename.endswith(("dryrun.py", "dryrun_recorder.py"))]
        where = f"{frames[-1].filename.split('/autoplan/')[-1]}:{frames[-1].lineno} " \
                f"({frames[-1].line})" if frames else "torch"
        raise DryRunError(
            f"rank {rank}: autoplan/{where} reads a tensor's value ({error}), which a dry run "
            "on fake tensors does not have") from error
