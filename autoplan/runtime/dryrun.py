"""Dry run at the scale of the plan: one rank of a plan of any world size, in this process, on
fake tensors -- the real runtime, nothing allocated.

[Note: dry run] For each chosen global rank, `dry_run` initialises torch's `fake` process-group
backend at that rank and the plan's world size (collectives return at once and move nothing),
builds the rank's `DistributedModel` through the constructor a training job calls (sharded
construction, tp placements, FSDP2 units with the plan's mixed-precision policy, the pipeline
schedule with the plan's microbatches and virtual stages, cp, the fused kernels), with every
tensor a fake tensor (torch's FakeTensorMode: shapes, dtypes and devices, no storage), and
runs one whole `step`: every microbatch, backward with recomputation, gradient reduction,
tied-weight sums, clipping and the optimizer step. A `DryRunRecorder` (a TorchDispatchMode
under DTensor, as torch's MemTracker sits) sees every local aten op of the rank and records:

- memory: the bytes of every fake storage from its allocation until it is freed (resizes
  included: FSDP2 frees and re-allocates unsharded parameters with `UntypedStorage.resize_`),
  as autoplan/runtime/live_bytes.py counts real CPU storages; the step's peak is taken by
  category (`CATEGORIES`), as the cost model counts them (cost_model/memory.py): storages
  that are, at the end of the step, a parameter (or buffer), a gradient or an optimizer
  state count as such; a pipeline receive buffer (filled by `recv`) "comm_buffers"; what
  FSDP2 resizes (unsharded parameters) or fills by an all-gather or reduce-scatter
  "temporaries"; any other storage counts by where it was allocated: in the optimizer step
  "optimizer", outside backward "activations" (the loss included), in backward (with its
  recomputation), "temporaries";
- every collective and point-to-point op (c10d and functional collectives), with its
  process group named by mesh axis, dtype and bytes;
- FLOPs, with torch.utils.flop_counter's formulas (matmuls and attention) on local shapes.

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
import weakref
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from autoplan import _torch_compat as tc
from autoplan.graph import CapturedGraph
from autoplan.plan import Plan
from autoplan.runtime.live_bytes import patch_resize
from autoplan.runtime.parallel import local_tensor

__all__ = ["CATEGORIES", "Collective", "RankDryRun", "DryRunError", "DryRunRecorder",
           "FakeWeights", "dry_run", "predicted_rank_memory", "rank_coordinates"]

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries", "comm_buffers")


class DryRunError(RuntimeError):
    """A part of the runtime that cannot run on fake tensors (it reads a tensor's value)."""


@dataclass(frozen=True)
class Collective:
    """One collective or point-to-point op a rank issued.

    Attributes:
        op: the op's name (`all_gather_into_tensor`, `_reduce_scatter_base_`, `send`, ...).
        axis: the mesh axis of its process group (`tp`, `dp`, `pp`, `cp`, `dp_cp`, `world`;
            `pp[2]`: 2 ranks of a pp line, as the tied-weight groups are; `ranks[k]`: a group
            of k ranks on no axis).
        group_size: ranks in the group.
        dtype: dtype of the data moved (`bfloat16`).
        bytes: the op's largest buffer: the gathered output of an all-gather, the input of a
            reduce-scatter, the tensor of an all-reduce, send, recv or broadcast (nccl-tests'
            "size").
    """

    op: str
    axis: str
    group_size: int
    dtype: str
    bytes: int


@dataclass(frozen=True)
class RankDryRun:
    """What one rank did in one training step of a dry run, next to the plan's prediction.

    Attributes:
        rank: the global rank.
        coordinates: its mesh coordinate by axis, {"pp", "dp", "cp", "tp"} (cp 0 without cp).
        peak_bytes: the step's peak of live tensor storage on the rank, bytes.
        peak_by_category: `peak_bytes` by `CATEGORIES` at that moment, bytes.
        resident_bytes: live storage when the step began (parameters and buffers), bytes.
        collectives: every collective / p2p op of the step, in issue order.
        bytes_by_axis: the sum of `Collective.bytes` by axis.
        flops: FLOPs of the step on this rank (matmuls and attention; recomputation included).
        predicted_peak_bytes: the plan's peak for this rank (`predicted_rank_memory`).
        predicted_by_category: its breakdown by category.
        predicted_flops: `plan.prediction.model_flops / world_size` (no recomputation).
        local_param_bytes: this rank's parameter shards (each tensor once), bytes.
        num_params: this rank's parameter tensors.
        build_s, step_s: wall seconds of the construction and of the measured step.
        counts: collectives by "op@axis".
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


def predicted_rank_memory(plan: Plan, rank: int) -> dict[str, float]:
    """The plan's predicted memory of global `rank`, bytes by category and "peak": its
    pipeline rank's entry of `Prediction.memory_by_pp_rank` (every rank of a pipeline stage
    holds the same), or the most loaded rank's figures for a plan written without it."""
    by_rank = plan.prediction.memory_by_pp_rank
    if by_rank:
        return dict(by_rank[rank_coordinates(plan, rank)["pp"]])
    return {**plan.prediction.memory_breakdown, "peak": plan.prediction.memory_bytes}


def rank_coordinates(plan: Plan, rank: int) -> dict[str, int]:
    """Mesh coordinate of global `rank` by axis name ({"pp", "dp", "cp", "tp"}), the last axis
    innermost as `init_device_mesh` lays it out. Raises ValueError for a rank outside."""
    shape, names = plan.mesh.shape, plan.mesh.axis_names
    if not 0 <= rank < plan.mesh.world_size:
        raise ValueError(f"rank {rank} is not in the plan's {plan.mesh.world_size} ranks "
                         f"({plan.mesh})")
    out, rest = {}, rank
    for name, size in zip(reversed(names), reversed(shape)):
        out[name] = rest % size
        rest //= size
    return {"pp": out["pp"], "dp": out["dp"], "cp": out.get("cp", 0), "tp": out["tp"]}


class FakeWeights:
    """The weight source of a dry run ([Note: sharded construction] in runtime/weights.py):
    the shards the allocation made stay as they are (fake: no values to fill); the buffers
    still on meta (rotary tables) get a fake tensor of their shape."""

    def fill(self, targets) -> None:
        for fqn, owners in targets.buffers.items():
            module, leaf = owners[0]
            b = module._buffers[leaf]
            targets.put(fqn, torch.empty(b.shape, dtype=b.dtype, device=targets.device))


# The c10d and functional collectives a rank issues, by op packet name (wait_tensor and the
# coalescing bookkeeping move nothing).
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
_NOT_COLLECTIVES = {"wait_tensor", "barrier", "monitored_barrier_"}


class DryRunRecorder(TorchDispatchMode):
    """Records, for the local ops of one rank under a FakeTensorMode (`fake_mode`): live fake
    storage bytes with their allocation site, the collectives and the FLOPs ([Note: dry run]).
    Use as a context manager, inside `fake_mode`."""

    def __init__(self, fake_mode):
        super().__init__()
        self.fake_mode = fake_mode
        self.current = 0
        self.live: dict[int, tuple[int, int, str]] = {}  # storage key -> (alloc id, bytes, site)
        self.events: list[tuple[int, int]] = []  # (alloc id, +-bytes) in order
        self.sites: dict[int, str] = {}  # alloc id -> allocation site
        self._next_id = 0
        self.collectives: list[tuple[str, tuple[int, ...], str, int]] = []
        self.flops = 0
        self.phase = "construction"  # construction | forward | optimizer (set by the caller)
        self._resize = None

    # -- memory ------------------------------------------------------------------------------
    def _storage(self, t):
        if isinstance(t, DTensor):
            t = t._local_tensor
        if not tc.is_fake(t):
            return None
        return t.untyped_storage()

    def _site(self, func) -> str:
        if self.phase == "optimizer":
            return "optimizer"
        if self.phase == "construction":
            return "construction"
        return "temporaries" if tc.in_backward() else "activations"

    def _add(self, st, site: str) -> None:
        key, nbytes = st._cdata, st.nbytes()
        aid = self._next_id
        self._next_id += 1
        self.live[key] = (aid, nbytes, site)
        self.sites[aid] = site
        self.current += nbytes
        self.events.append((aid, nbytes))
        weakref.finalize(st, self._free, key, aid)

    def _free(self, key: int, aid: int) -> None:
        entry = self.live.get(key)
        if entry is None or entry[0] != aid:
            return
        del self.live[key]
        self.current -= entry[1]
        self.events.append((aid, -entry[1]))

    def _resized(self, st, site: str | None = None) -> None:
        entry = self.live.get(st._cdata)
        if entry is None:
            return
        aid, old, was = entry
        site = site or was
        self.sites[aid] = site
        new = st.nbytes()
        if new != old:
            self.live[st._cdata] = (aid, new, site)
            self.current += new - old
            self.events.append((aid, new - old))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor lowers to local ops, which come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # DTensor's sharding propagation runs ops in a fake mode of its own: not the rank's
        if tc.active_fake_mode() is not self.fake_mode:
            return out
        inputs = {st._cdata for leaf in tree_leaves((args, kwargs))
                  if isinstance(leaf, torch.Tensor) and (st := self._storage(leaf)) is not None}
        site = None
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and (st := self._storage(leaf)) is not None:
                if st._cdata in self.live:
                    self._resized(st)
                elif st._cdata not in inputs:
                    site = site or self._site(func)
                    self._add(st, site)
        self._record_collective(func, args, kwargs, out)
        packet = func.overloadpacket
        formula = flop_registry.get(packet) or _EXTRA_FLOPS.get(packet)
        if formula is not None and self.phase != "construction":
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out

    def _record_collective(self, func, args, kwargs, out) -> None:
        namespace = _packet_namespace(func)
        if namespace not in _COLLECTIVE_NAMESPACES:
            return
        name = func.overloadpacket.__name__
        if name in _NOT_COLLECTIVES:
            return
        # a c10d op takes its ProcessGroup, a functional one its group's name
        ranks = next((r for a in tree_leaves((args, kwargs))
                      if (r := tc.group_ranks(a)) is not None), ())
        sizes, dtype = [], ""
        for value in list(args) + list(kwargs.values()) + [out]:
            tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
            if tensors:
                sizes.append(sum(t.numel() * t.element_size() for t in tensors))
                dtype = dtype or str(tensors[0].dtype).removeprefix("torch.")
        self.collectives.append((name, tuple(ranks), dtype, max(sizes, default=0)))
        # the buffer an in-place c10d op fills: a pipeline receive buffer, or a gathered /
        # reduce-scattered one (FSDP2's), counted as the plan counts them
        if namespace == "c10d" and args and name not in ("send", "allreduce_", "broadcast_"):
            for t in tree_leaves(args[0]):
                if isinstance(t, torch.Tensor) and (aid := self.alloc_id(t)) is not None:
                    self.sites[aid] = "comm_buffers" if name.startswith("recv") \
                        else "temporaries"

    def __enter__(self):
        # FSDP2's unsharded parameters, resized outside dispatch
        self._resize = patch_resize(lambda storage: self._resized(storage, "temporaries"))
        return super().__enter__()

    def __exit__(self, *exc):
        self._resize()
        return super().__exit__(*exc)

    # -- results -----------------------------------------------------------------------------
    def peak(self, start: int, categories: dict[int, str]) -> tuple[int, dict[str, int]]:
        """The peak of live bytes over events[start:] and its bytes by category: `categories`
        (alloc id -> category) first, else the allocation site."""
        live: dict[int, int] = defaultdict(int)
        total = 0
        for aid, delta in self.events[:start]:
            live[aid] += delta
            total += delta
        best, best_at = total, start
        for i in range(start, len(self.events)):
            total += self.events[i][1]
            if total > best:
                best, best_at = total, i + 1
        for aid, delta in self.events[start:best_at]:
            live[aid] += delta
        by = dict.fromkeys(CATEGORIES, 0)
        for aid, nbytes in live.items():
            if nbytes:
                cat = categories.get(aid) or self.sites[aid]
                by[cat if cat in by else "params"] += nbytes
        return best, by

    def alloc_id(self, t: torch.Tensor) -> int | None:
        st = self._storage(t)
        entry = self.live.get(st._cdata) if st is not None else None
        return entry[0] if entry is not None else None


def _sdpa_cpu_flop(query, key, value, *args, out_val=None, **kwargs):
    from torch.utils.flop_counter import sdpa_flop

    return sdpa_flop(query, key, value, out_val=out_val)


def _sdpa_cpu_backward_flop(grad_out, query, key, value, *args, out_val=None, **kwargs):
    from torch.utils.flop_counter import sdpa_backward_flop

    return sdpa_backward_flop(grad_out, query, key, value, out_val=out_val)


# torch's formulas cover the CUDA attention kernels; a dry run on the CPU device picks these
_EXTRA_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flop,
}


def _packet_namespace(func) -> str:
    return getattr(func, "namespace", "")


def dry_run(graph: CapturedGraph, plan: Plan, ranks: Sequence[int] | None = None, *,
            planned_graph: CapturedGraph | None = None, inputs=None, optimizer=None,
            loss_fn=None, max_grad_norm: float | None = 1.0, kernels: bool = True,
            steps: int = 2) -> list[RankDryRun]:
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
        steps: training steps to run; the last is measured (the first creates the optimizer
            states, so that the second is a step of the steady state the plan predicts).

    Returns a RankDryRun per rank, in the order given. Raises ValueError when a process
    group is initialised already (a dry run needs its own), or a rank is outside the plan;
    DryRunError where the runtime reads a tensor's value.
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
                          kernels=kernels, steps=steps) for rank in ranks]


def _dry_run_rank(graph, plan, rank, *, inputs, steps, **engine_args) -> RankDryRun:
    from autoplan.inputs import InputSpec
    from autoplan.runtime.engine import DistributedModel

    inputs = inputs or InputSpec.tokens(plan.global_batch, plan.seq_len)
    dist.init_process_group("fake", store=tc.fake_store(), rank=rank,
                            world_size=plan.mesh.world_size)
    fake = tc.fake_tensor_mode()
    recorder = DryRunRecorder(fake)
    try:
        with fake, recorder, _named_value_reads(rank), _phases(recorder):
            start_s = time.perf_counter()
            engine = DistributedModel(graph, plan, FakeWeights(), seed=0, device="cpu",
                                      inputs=inputs, **engine_args)
            if engine._schedule is not None:  # the pipeline's warm-up vote, without peers
                tc.vote_pipeline_mode_locally(engine._schedule)
            built_s = time.perf_counter()
            leaves = inputs.example(plan.global_batch, "cpu")
            recorder.phase = "step"
            for _ in range(steps - 1):  # the first step creates the optimizer states
                engine.step_batch(leaves)
            start, resident = len(recorder.events), recorder.current
            del recorder.collectives[:]  # the measured step's only
            recorder.flops = 0
            step_start_s = time.perf_counter()
            engine.step_batch(leaves)
            step_s = time.perf_counter() - step_start_s
            del leaves
        peak, by_category = recorder.peak(start, _final_categories(engine, recorder))
        calls = tuple(_labelled(recorder.collectives, engine))
        shards = [local_tensor(p) for p in engine._unique_params()]
    finally:
        dist.destroy_process_group()
        tc.clear_dtensor_caches()
    by_axis: dict[str, int] = defaultdict(int)
    counts: dict[str, int] = defaultdict(int)
    for c in calls:
        by_axis[c.axis] += c.bytes
        counts[f"{c.op}@{c.axis}"] += 1
    predicted = predicted_rank_memory(plan, rank)
    prediction = plan.prediction
    return RankDryRun(
        rank=rank, coordinates=rank_coordinates(plan, rank), peak_bytes=peak,
        peak_by_category=by_category, resident_bytes=resident, collectives=calls,
        bytes_by_axis=dict(by_axis), flops=recorder.flops,
        predicted_peak_bytes=predicted["peak"],
        predicted_by_category={k: v for k, v in predicted.items() if k != "peak"},
        predicted_flops=prediction.model_flops / plan.mesh.world_size,
        local_param_bytes=sum(t.numel() * t.element_size() for t in shards),
        num_params=len(shards), build_s=built_s - start_s, step_s=step_s, counts=dict(counts))


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
    return out


def _labelled(calls, engine) -> list[Collective]:
    """The recorded collectives with their groups named by mesh axis."""
    axes: dict[tuple[int, ...], str] = {}
    with tc.outside_fake_mode():
        for name in engine.mesh.mesh_dim_names:
            axes[tuple(sorted(engine.mesh[name].mesh.flatten().tolist()))] = name
        if engine.plan.mesh.cp > 1:
            axes[tuple(sorted(engine.dp_mesh.mesh.flatten().tolist()))] = "dp_cp"
    axes[tuple(range(engine.plan.mesh.world_size))] = "world"
    out = []
    for op, ranks, dtype, nbytes in calls:
        key = tuple(sorted(ranks))
        axis = axes.get(key)
        if axis is None:  # a subset of an axis's group (tied weights: 2 ranks of a pp line)
            axis = next((f"{name}[{len(key)}]" for members, name in axes.items()
                         if set(key) <= set(members)), f"ranks[{len(key)}]")
        out.append(Collective(op, axis, len(key), dtype, nbytes))
    return out


@contextlib.contextmanager
def _phases(recorder: DryRunRecorder):
    """Tells the recorder where the step is: "optimizer" inside any optimizer's step (torch's
    global step hooks: ZeRO-1's inner optimizer too); the recorder tells forward from backward
    itself."""
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    outer = {}

    def pre(optimizer, args, kwargs):
        outer[id(optimizer)] = recorder.phase
        recorder.phase = "optimizer"

    def post(optimizer, args, kwargs):
        recorder.phase = outer.pop(id(optimizer), "step")

    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


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
                  if "/autoplan/" in f.filename and not f.filename.endswith("dryrun.py")]
        where = f"{frames[-1].filename.split('/autoplan/')[-1]}:{frames[-1].lineno} " \
                f"({frames[-1].line})" if frames else "torch"
        raise DryRunError(
            f"rank {rank}: autoplan/{where} reads a tensor's value ({error}), which a dry run "
            "on fake tensors does not have") from error
