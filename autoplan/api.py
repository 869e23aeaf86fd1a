"""`@autoparallel`: plan, compile and train a model with one decorator.

    @autoparallel(cluster="local-cpu", global_batch=8, seq_len=128)
    class GPT(nn.Module): ...

    model = GPT(config)                 # an AutoParallel wrapper; nothing planned yet
    loss = model.step(input_ids, labels)  # first call: capture, plan, compile; then train

The decorator takes a module class, a factory function or a module instance. Inside a process
group (torchrun, or `autoplan.runtime.LocalCluster`) the model trains for real on that group's
ranks, which must number the topology's world size; without one, the wrapper plans (and
reports/exports) for the topology without running (`world_size` sets the rank count of the
`local-cpu` preset).

Every rank plans the same way (capture and solver are deterministic); rank 0's plan is
broadcast anyway, so all ranks run one plan. Each rank then builds only its shards
([Note: sharded construction] in autoplan/runtime/weights.py): from the factory's recorded
construction, a Hugging Face checkpoint (`weights=` / `from_pretrained`), or the real weights of
the model given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from autoplan.plan import Plan
from autoplan.runtime.construction import (is_dcp as _is_dcp, meta_skeleton,
                                           on_meta as _on_meta,
                                           record_construction as _record_construction,
                                           frozen_weights_dtype, resolve_dtype, weight_source)
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology, load_topology, preset

__all__ = ["autoparallel", "AutoParallel", "PlanOptions", "from_pretrained"]


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """What `@autoparallel` was given; see `autoparallel` for the fields."""

    global_batch: int
    seq_len: int | None = None
    cluster: str = "local-cpu"
    num_nodes: int | None = None
    world_size: int | None = None
    dtype: str | None = None
    optimizer: Callable | None = None
    lr_scheduler: Callable | None = None
    loss_fn: Callable | None = None
    max_grad_norm: float | None = None
    device_memory_bytes: float | None = None
    weights: str | None = None
    adapter: str | None = None
    init: Callable | None = None
    seed: int | None = None
    kernels: bool = True
    compile: bool = False
    example_batch: object = None
    batch_dims: tuple[tuple[str, int | None], ...] = ()
    overrides: tuple[tuple[str, object], ...] = ()


class AutoParallel:
    """A model under autoplan: `.step(batch)` / `.step(input_ids, labels)`, `.eval_step`,
    `.plan`, `.report()`, `.export()`.

    Args:
        module: the model (real weights, on CPU, or on meta for planning only).
        options: PlanOptions.
    """

    def __init__(self, module: nn.Module, options: PlanOptions, init_trace=None,
                 record_s: float | None = None):
        self.module = module
        self.options = options
        self._init_trace = init_trace  # the factory's construction, recorded on meta
        self._plan: Plan | None = None
        self._graph = None
        self._engine = None
        self.metrics = None  # StepMetrics of the last step (autoplan.runtime.batch)
        self._progress = None  # runtime.job.Progress: where each rank is, for PeerError
        self._vocab: dict[str, int] | None = None  # input name -> rows of its embedding
        self._inputs = None  # autoplan.inputs.InputSpec: the batch planned for
        # seconds per build phase so far, in order (see build_stats)
        self._build_stats: dict[str, float | bool] = {} if record_s is None else {
            "record_s": record_s}
        if options.example_batch is not None:
            self._inputs = self._spec_of(options.example_batch)
        # the compute dtype: dtype= or the weights' own ([Note: dtype of the weights] in
        # runtime/construction.py), and where it came from, for the report
        self.dtype, self.dtype_origin = resolve_dtype(module, options.dtype, options.weights)

    # -- planning ---------------------------------------------------------------------------
    @property
    def topology(self) -> Topology:
        topo = self._cluster()
        if self.options.device_memory_bytes is not None:
            device = dataclasses.replace(topo.device, mem_bytes=self.options.device_memory_bytes)
            topo = dataclasses.replace(topo, device=device)
        return topo

    def _cluster(self) -> Topology:
        """The cluster to plan for. Under torchrun the job's process group is joined first
        (runtime/job.py): the world size is the job's and the node count torchrun's, so a
        launch never plans a single rank per process."""
        from autoplan.runtime import job

        o = self.options
        job.join()
        world = dist.get_world_size() if _in_job() else (o.world_size or 1)
        nodes = job.num_nodes(o.num_nodes, world)
        if o.cluster.endswith((".yaml", ".yml", ".json")):
            topo = load_topology(o.cluster)
            return topo.with_nodes(nodes) if nodes else topo
        if o.cluster == "local-cpu":
            nodes = nodes or 1
            if world % nodes:
                raise ValueError(f"world size {world} does not divide into {nodes} nodes")
            return preset("local-cpu", num_nodes=nodes, devices_per_node=world // nodes)
        return preset(o.cluster, num_nodes=nodes or 1)

    @property
    def spec(self) -> TrainingSpec:
        return TrainingSpec(global_batch=self.options.global_batch, seq_len=self._seq_len(),
                            dtype=self.dtype)

    @property
    def inputs(self):
        """The batch the plan is made for (autoplan.inputs.InputSpec): from `example_batch=`,
        else the first batch given to `step`, else the token-LM form of seq_len."""
        from autoplan.inputs import InputSpec

        if self._inputs is None:
            if self.options.seq_len is None:
                raise ValueError("autoparallel: no seq_len= and no example_batch=: give one, "
                                 "or call step(batch) before asking for the plan")
            self._inputs = InputSpec.tokens(self.options.global_batch, self.options.seq_len)
        return self._inputs

    def _spec_of(self, batch):
        from autoplan.inputs import InputSpec

        return InputSpec.of(batch, self.module, self.options.global_batch,
                            dict(self.options.batch_dims))

    def _seq_len(self) -> int:
        """seq_len=, else tokens per sample of the batch: dim 1 of `input_ids` (or of the first
        integer input of two dims), else 1 (tokens/s are then samples/s)."""
        if self.options.seq_len is not None:
            return self.options.seq_len
        leaves = self.inputs.model_leaves
        ids = [leaf for leaf in leaves if leaf.name == "input_ids"] or [
            leaf for leaf in leaves if len(leaf.shape) == 2 and "int" in leaf.dtype]
        if ids and ids[0].batch_dim is not None:
            return ids[0].shape[1 - ids[0].batch_dim]
        return 1

    @property
    def plan(self) -> Plan:
        """The plan (made on first access)."""
        if self._plan is None:
            self._plan = self._make_plan()
        return self._plan

    @property
    def graph(self):
        """The captured graph (autoplan.graph.CapturedGraph) the plan was made for; capturing
        and planning on first access, as `plan` does."""
        _ = self.plan
        return self._graph

    def _capture(self, source: nn.Module, batch_size: int, planning: bool = False,
                 seq_len: int | None = None):
        """The graph of `source` called on the planned batch at `batch_size` samples (planning:
        a few identical blocks scaled to the real depth, [Note: shallow planning capture]);
        `seq_len`: tokens per sample of the token-LM batch instead of the planned ones (a cp
        rank's seq_len / cp). Returns (graph, whether it was read from the capture cache)."""
        from autoplan.capture.cache import cached_capture
        from autoplan.inputs import InputSpec

        spec = self.inputs
        if seq_len is not None and seq_len != self.spec.seq_len:
            spec = InputSpec.tokens(spec.global_batch, seq_len)  # cp: the token form only
        example = spec.example(batch_size, "meta" if _on_meta(source) else "cpu")
        args, kwargs = spec.call([t if leaf.to_model else None
                                  for leaf, t in zip(spec.leaves, example)])
        name = type(self.module).__name__
        # read back from the capture cache when this capture was made before, by an earlier
        # job or another rank of this machine ([Note: capture cache] in capture/cache.py)
        graph, how = cached_capture(source, args, example_kwargs=kwargs, model_name=name,
                                    planning=planning)
        graph.batch_size, graph.seq_len = batch_size, seq_len or self.spec.seq_len
        return graph, how == "hit"

    def _make_plan(self) -> Plan:
        from autoplan.progress import phase
        from autoplan.runtime.precision import Precision
        from autoplan.units import plural

        topo = self.topology
        if _in_job() and dist.get_world_size() != topo.world_size:
            raise ValueError(
                f"cluster {topo.name!r} has {topo.world_size} devices "
                f"({plural(topo.num_nodes, 'node')} x {topo.devices_per_node}) but this job has "
                f"{dist.get_world_size()} ranks: "
                f"start {topo.world_size} ranks (torchrun --nnodes {topo.num_nodes} "
                f"--nproc_per_node {topo.devices_per_node}), or plan for this job's size "
                "(cluster=\"local-cpu\" takes the job's, a preset takes num_nodes=)")
        name = type(self.module).__name__
        # Planned on the graph the runtime will run: a meta copy in the compute dtype (a 16-bit
        # graph has the model's own upcasts as nodes; see [Note: precision recipe]).
        with self._timed("capture_for_planning_s"), phase(f"capturing {name}"):
            source = self._capture_source(Precision.of(self.dtype))
            graph, cached = self._capture(source, self.options.global_batch, planning=True)
        self._build_stats["capture_for_planning_cached"] = cached
        with self._timed("plan_s"):
            # cp searched where the runtime can run it for this model, batch and loss
            why_not = None if "cp" in dict(self.options.overrides) else \
                self._cp_refusal(graph, topo)
            request = self._cache_request(graph, topo, cp_searched=why_not is None)
            plan = self._cached_plan(request, topo)
            from_cache = plan is not None
            if plan is None:
                with phase(f"planning {name} for {topo.world_size} x {topo.device.name}"):
                    plan = self._solve(graph, topo, request, why_not)
            if _in_job() and dist.get_world_size() > 1:
                box = [plan.to_json() if dist.get_rank() == 0 else None]
                dist.broadcast_object_list(box, src=0)
                plan = Plan.from_json(box[0])
        self._build_stats["plan_from_cache"] = from_cache
        self._graph = graph
        return plan

    def _cache_request(self, graph, topo: Topology, cp_searched: bool) -> dict | None:
        """The plan cache's request for this model ([Note: plan cache] in autoplan/cache.py):
        the captured graph's fingerprint, the cluster, the training spec, the overrides and
        whether cp is searched (`_cp_refusal`); None when the cache is off
        (AUTOPLAN_PLAN_CACHE=0) or an override is not JSON data."""
        from autoplan.cache import graph_fingerprint

        if os.environ.get("AUTOPLAN_PLAN_CACHE", "1") == "0":
            return None
        overrides = dict(self.options.overrides)
        if not all(v is None or isinstance(v, (bool, int, float, str))
                   for v in overrides.values()):
            return None
        return {"command": "autoparallel", "graph": graph_fingerprint(graph),
                "topology": topo.to_dict(), "spec": dataclasses.asdict(self.spec),
                "overrides": overrides, "compiled": self.options.compile,
                "cp_searched": cp_searched,
                "frozen_weights_dtype": self._frozen_weights_dtype()}

    def _cached_plan(self, request: dict | None, topo: Topology) -> Plan | None:
        """The cache's plan for `request`, its warnings said again; None on a miss."""
        import warnings

        from autoplan.cache import PlanCache
        from autoplan.progress import note
        from autoplan.solver.search import ReplicatedWeightsWarning

        entry = PlanCache().get(request) if request is not None else None
        if entry is None:
            return None
        note(f"plan of {type(self.module).__name__} for {topo.world_size} x "
             f"{topo.device.name} read from the plan cache ({PlanCache().path(request)}; "
             "AUTOPLAN_PLAN_CACHE=0 plans anew)")
        for message in entry["warnings"]:
            warnings.warn(message, ReplicatedWeightsWarning, stacklevel=2)
        return Plan.from_dict(entry["plan"])

    def _solve(self, graph, topo: Topology, request: dict | None, why_not: str | None) -> Plan:
        """Solve, and store the plan with the solver's warnings about it (rank 0 of a job
        writes; a cache that cannot be written is a detail line, not a failure). `why_not`:
        why cp is not searched (cp 1 then, unless given), None to search it."""
        import warnings

        from autoplan.cache import PlanCache
        from autoplan.progress import detail
        from autoplan.solver import InvalidConfig
        from autoplan.solver import plan as solve
        from autoplan.solver.search import ReplicatedWeightsWarning

        with warnings.catch_warnings(record=True) as caught:
            # cp searched as `autoplan plan` searches it (where nothing fits without it, or
            # faster beyond the error band) when the runtime can run it for this model, batch
            # and loss (runtime/checks.py); cp 1 otherwise, unless given
            overrides = dict(self.options.overrides)
            try:
                plan = solve(graph, topo, self.spec, compiled=self.options.compile,
                             frozen_weights_dtype=self._frozen_weights_dtype(),
                             **({} if why_not is None else {"cp": 1}), **overrides)
            except InvalidConfig as e:  # one that a cp > 1 could have satisfied says why
                if why_not is None or not ("does not fit world size" in e.reason or
                                           "no configuration of" in e.reason):
                    raise
                raise InvalidConfig(f"{e.reason} (planned with cp 1: {why_not})",
                                    option=e.option) from None
        for w in caught:  # shown as they would have been
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if request is not None and (not _in_job() or dist.get_rank() == 0):
            said = [str(w.message) for w in caught
                    if issubclass(w.category, ReplicatedWeightsWarning)]
            try:
                PlanCache().put(request, {"plan": plan.to_dict(), "warnings": said})
            except OSError as e:
                detail(f"plan cache not written: {e}")
        return plan

    def _frozen_weights_dtype(self) -> str | None:
        """The dtype the frozen parameters' weights come in (runtime/construction.py
        frozen_weights_dtype): where it is the 16-bit compute dtype, the planner holds them in
        it ([Note: frozen dtype] in solver/frozen.py)."""
        return frozen_weights_dtype(self.module, self.options.weights)

    def _cp_refusal(self, graph, topo: Topology) -> str | None:
        """Why the runtime could not run a cp > 1 plan of this model, batch and loss, or None:
        runtime/checks.py context_parallel_refusal, then the graph rewrite itself
        (passes/context.py: its attentions, masks and position source) tried on a copy of
        the planning graph; a mask too large to evaluate here is checked at build. None
        without a trial where the search has no cp > 1 for this sequence and world
        (solver/context.py cp_degrees)."""
        import copy

        import torch.fx

        from autoplan.passes.context import apply_context_parallel
        from autoplan.runtime.checks import context_parallel_refusal
        from autoplan.solver.context import cp_degrees

        if not any(cp > 1 for cp in cp_degrees(graph, self.spec.seq_len, topo.world_size)):
            return None  # the search has no cp > 1 to try

        refusal = context_parallel_refusal(graph, self.inputs, self.options.loss_fn,
                                           self.options.compile)
        if refusal is not None:
            return str(refusal)
        trial = torch.fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph))
        try:  # cp 1: the same checks at the planned length; the copy is dropped. Masks of
            # over 4M entries (b s^2: past 1K tokens at batch 4) are left to the build, which
            # evaluates them at seq / cp per microbatch (a 128K mask would be 17 GB here)
            apply_context_parallel(trial, seq_len=self.spec.seq_len, cp=1, rank=0,
                                   group_name="trial", check_masks_up_to=1 << 22)
        except ValueError as e:
            return str(e)
        return None

    # -- training ---------------------------------------------------------------------------
    def _compile(self):
        """The engine (`_build_engine`); a build that fails takes down the one-rank process
        group it set up for itself, so that the process is as it was (a later fake or real
        group of another size can be made)."""
        before = len(_PRIVATE_GROUP)
        try:
            return self._build_engine()
        except BaseException:
            if len(_PRIVATE_GROUP) > before and dist.is_initialized() and \
                    dist.group.WORLD is _PRIVATE_GROUP[-1]:
                dist.destroy_process_group()
                _PRIVATE_GROUP.pop()
            raise

    def _build_engine(self):
        from autoplan.progress import phase
        from autoplan.runtime import job
        from autoplan.runtime.engine import DistributedModel
        from autoplan.runtime.step_inputs import loss_mode

        from autoplan.runtime.checks import check_context_parallel

        topo = self.topology  # joins torchrun's process group
        # nothing to train on is said before anything is set up ([Note: step loss])
        loss_mode(self.graph, self.inputs, self.options.loss_fn)
        # and a cp plan this runtime cannot run (its batch, loss, dropout, pp/tp/compile)
        check_context_parallel(self.plan, self.graph, self.inputs, self.options.loss_fn,
                               self.options.compile)
        if not _in_job():
            if topo.world_size != 1:
                raise RuntimeError(
                    f"the plan needs {topo.world_size} ranks: run under torchrun or "
                    "autoplan.runtime.LocalCluster (this process has no process group)")
            if not dist.is_initialized():
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                _PRIVATE_GROUP.append(dist.group.WORLD)
        graph, plan, planned, reuse, cached = self._runtime_graph()
        self._build_stats["capture_reused"] = reuse
        self._build_stats["capture_runtime_cached"] = cached
        with self._timed("build_s"), phase(f"building this rank's shards ({plan.mesh})"):
            engine = DistributedModel(graph, plan, self._weight_source(graph),
                                      optimizer=self.options.optimizer,
                                      lr_scheduler=self.options.lr_scheduler,
                                      loss_fn=self.options.loss_fn,
                                      max_grad_norm=self.options.max_grad_norm,
                                      device=job.device(), seed=self.options.seed,
                                      inputs=self.inputs, kernels=self.options.kernels,
                                      compile=self.options.compile, planned_graph=planned)
        if self.options.weights is not None and _is_dcp(self.options.weights):
            with self._timed("build_s"):
                engine.load(self.options.weights)
        return engine

    def _runtime_graph(self):
        """(graph, plan, planned graph, reused, from the capture cache): the graph a rank runs
        and the plan extended to it (below)."""
        from autoplan.passes.expand import plan_for_graph
        from autoplan.progress import phase
        from autoplan.runtime.precision import Precision

        plan = self.plan
        precision = Precision.of(plan.dtype)
        name = type(self.module).__name__
        # The runtime graph is captured at the microbatch size (view shapes are static) and in
        # the compute dtype ([Note: precision recipe]), from a meta copy: nothing allocated.
        # One capture serves both when planning captured every block at the global batch and
        # the plan runs one microbatch of it per rank (dp 1, one microbatch): the same call of
        # `capture` on the same source would be made again.
        # Under context parallelism (cp > 1) the runtime graph is captured at a cp rank's own
        # tokens, seq_len / cp per sample: every view shape is then local, and
        # passes/context.py gives it global positions and attention over the cp group.
        planned = self._graph
        cp = plan.mesh.cp
        reuse = planned.num_layers == planned.total_layers and cp == 1 and \
            planned.batch_size == plan.microbatch_size and plan.dtype == self.dtype
        with self._timed("capture_runtime_s"), \
                phase(f"capturing {name} at microbatch {plan.microbatch_size}"
                      + (f", {self.spec.seq_len // cp} tokens per cp rank" if cp > 1 else "")):
            graph, cached = (planned, False) if reuse else self._capture(
                self._capture_source(precision), plan.microbatch_size,
                seq_len=self.spec.seq_len // cp)
            plan = plan_for_graph(plan, planned, graph)  # planned on a few blocks, run on all
        return graph, plan, planned, reuse, cached

    def dry_run(self, ranks=None, *, steps: int = 2, export=None) -> list:
        """One training step of each of `ranks` (global ranks; default rank 0) of this plan,
        in this process, on torch's fake process group of the plan's world size and on fake
        tensors: the real runtime built for that rank, nothing allocated ([Note: dry run] in
        autoplan/runtime/dryrun.py). Returns a `RankDryRun` per rank: measured peak memory
        by category, collectives per mesh axis, FLOPs, beside the plan's prediction.

        Call it where no process group exists (a planning process, not a training job): the
        plan may be for a cluster this machine is not (`cluster=`, `nodes=`). Raises
        ValueError for a rank outside the plan or inside a process group; DryRunError where
        the runtime reads a tensor's value (fp16 loss scaling); DryRunOutOfMemory (a
        DryRunError) for a rank whose live tensors exceed the device memory of the cluster
        (`device_memory_bytes=` when given), naming the rank, the moment and the category,
        as the cluster would fail. `dataclasses.replace(plan, dry_run=tuple(r.record() for r
        in rows))` is the plan whose report has a Dry run section.

        `export`: a directory to write each rank's whole step into (every op and collective
        in order, the pipeline actions, the traffic per mesh axis: [Note: whole-step export]
        in autoplan/runtime/step_export.py), once every rank has run; each row's `ops` then
        holds its op sequence. OSError when it cannot be written."""
        from autoplan.runtime.dryrun import dry_run

        graph, plan, planned, _reuse, _cached = self._runtime_graph()
        rows = dry_run(graph, plan, ranks, planned_graph=planned, inputs=self.inputs,
                       optimizer=self.options.optimizer, loss_fn=self.options.loss_fn,
                       max_grad_norm=self.options.max_grad_norm,
                       kernels=self.options.kernels, steps=steps,
                       device_mem_bytes=self.topology.device.mem_bytes,
                       record_ops=export is not None)
        if export is not None:
            from autoplan.runtime.step_export import step_files, write_step_files

            write_step_files(step_files(rows, plan), export)
        return rows

    @contextlib.contextmanager
    def _timed(self, key: str):
        """Add the block's wall time to build_stats()[key] (seconds)."""
        import time

        start = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - start
            self._build_stats[key] = self._build_stats.get(key, 0.0) + took

    def build_stats(self) -> dict[str, float | bool]:
        """Wall time of each build phase on this rank so far, seconds, in the order they ran
        (a phase not yet run is absent):

        - `record_s`: running the decorated class or factory on the meta device with its
          construction recorded (absent for a model given as an instance);
        - `capture_for_planning_s`: torch.export of the model (a few blocks) at the global
          batch, for planning, or its graph read from the capture cache
          (`capture_for_planning_cached`: which; [Note: capture cache] in
          autoplan/capture/cache.py);
        - `plan_s`: the plan, solved or read from the plan cache (`plan_from_cache`: which),
          and broadcast from rank 0;
        - `capture_runtime_s`: torch.export of the whole model at the microbatch size (or its
          graph read from the capture cache: `capture_runtime_cached`), and the plan extended
          to all its blocks (`capture_reused`: True when the planning capture was already that
          graph -- every block, one microbatch of the global batch -- and served the runtime
          as it was);
        - `build_s`: this rank's stages, shards, weights, optimizer and schedule
          (DistributedModel), and a checkpoint given as `weights=` loaded;
        - `first_step_s`: the first `step`, from the checked batch to the loss;
        - `total_s`: the sum of the phases above (construction to the first loss, less the
          caller's own work between them).

        Not collective; times are this rank's (`bench/runtime_vs_native.py` takes the slowest
        rank's)."""
        out = dict(self._build_stats)
        out["total_s"] = sum(v for k, v in out.items() if k.endswith("_s"))
        return out

    def _capture_source(self, precision) -> nn.Module:
        """What planning and the runtime capture (the same, so that their graphs match node for
        node): the model itself when it has real fp32 weights and trains in fp32 (constants
        torch.export lifts out of forward keep their values), else a meta copy with its
        floating parameters in the compute dtype (a bf16 model trained in fp32 is captured
        in fp32: [Note: dtype of the weights])."""
        if not _on_meta(self.module) and not precision.mixed and all(
                p.dtype == torch.float32 for p in self.module.parameters()
                if p.is_floating_point()):
            return self.module
        return meta_skeleton(self.module, precision.compute_dtype)

    def _weight_source(self, graph):
        """Where this rank's shards come from ([Note: sharded construction])."""
        return weight_source(self.module, self._init_trace, self.options.weights,
                             self.options.init, graph, adapter=self.options.adapter)

    def build(self) -> "AutoParallel":
        """Capture, plan and build this rank's shards now (the first `step` otherwise does);
        collective: every rank calls it. Returns self."""
        if self._engine is None:
            self._engine = self._compile()
        return self

    def memory_stats(self) -> dict[str, object]:
        """This rank's measured memory peaks by phase (construction, first step, last step)
        next to the plan's prediction; see DistributedModel.memory_stats."""
        return self.build()._engine.memory_stats()

    def step(self, *batch) -> float:
        """One optimizer step on the global batch (same tensors on every rank); returns the
        global mean loss, and leaves what the step measured (time, tokens/s, MFU, peak memory,
        beside the plan's predictions) in `self.metrics` (a StepMetrics).

        `step(input_ids, labels)`: (global_batch, seq_len) integer token ids, labels -100
        ignored; `step(batch)`: a dict (the model is called with the keys its forward takes),
        a tuple (positional arguments) or a tensor; see autoplan/inputs.py for how each form
        is called and what the loss reads. The first batch fixes the plan's inputs unless
        `example_batch=` did.

        Raises ValueError naming the value for a batch the plan cannot take (structure, shape,
        dtype, ids outside the vocabulary, no label to train on) before any rank computes;
        FrozenSetChangedError (a ValueError) naming the parameters whose `requires_grad`
        changed since the model was planned ([Note: frozen parameters] in
        autoplan/runtime/engine.py).
        """
        import time

        from autoplan.progress import detail, phase
        from autoplan.runtime import job
        from autoplan.runtime.batch import StepMetrics

        from autoplan.runtime.checks import check_frozen_set

        leaves = self._checked(batch)
        if self._engine is None:
            self._engine = self._compile()
        # the parameters that train are the ones planned ([Note: frozen parameters])
        check_frozen_set(self._engine.graph, self.module)
        if self._progress is None:
            self._progress = job.Progress()
        engine = self._engine
        where = f"step {engine.num_steps + 1}"
        self._progress.mark(where)
        start = time.perf_counter()
        is_first = engine.num_steps == 0
        try:
            with phase("first step") if is_first else contextlib.nullcontext():
                loss = engine.step_batch(leaves)
        except RuntimeError as e:  # a collective timed out or lost its peer: name the peer
            others = self._progress.others(where) if job.is_collective_failure(e) else None
            if not others:
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise job.PeerError(
                f"rank {dist.get_rank()}, {where}: a collective failed ({first[:200]}); "
                f"ranks not in {where}:\n{others}") from e
        took = time.perf_counter() - start
        if is_first:
            self._build_stats["first_step_s"] = took
        self._progress.mark(f"after {where}")
        spec = self.spec
        plan, pred = engine.plan, engine.plan.prediction
        peak = engine.memory.peaks.get("first_step" if engine.num_steps == 1 else "step")
        tokens = spec.global_batch * spec.seq_len
        self.metrics = StepMetrics(
            step=engine.num_steps, loss=loss, step_time_s=took, tokens=tokens,
            tokens_per_s=tokens / took, mfu=pred.mfu * pred.step_time_s / took,
            peak_memory_bytes=peak,
            predicted_step_time_s=pred.step_time_s, predicted_mfu=pred.mfu,
            predicted_peak_memory_bytes=plan.prediction.memory_bytes,
            memory_measure=engine.memory.as_dict()["measure"])
        detail(str(self.metrics))
        return loss

    def eval_step(self, *batch, return_outputs: bool = False):
        """The loss of a batch without training (no gradients, no update, dropout off): the
        global mean, as `step` computes it; with `return_outputs`, also the model's outputs
        for the whole batch, (loss, outputs), on every rank. Takes the batch as `step` does.
        Collective: every rank calls it."""
        leaves = self._checked(batch)
        if self._engine is None:
            self._engine = self._compile()
        return self._engine.eval_batch(leaves, return_outputs=return_outputs)

    def _checked(self, batch: tuple) -> list[torch.Tensor]:
        """The batch's leaves, checked against the planned inputs (the first batch fixes them
        when nothing did); raises ValueError in the user's words (runtime/batch.py)."""
        from autoplan.runtime.batch import checked_leaves, embedding_rows, is_token_pair

        if self._inputs is None and self._plan is None and not is_token_pair(batch):
            self._inputs = self._spec_of(batch[0]) if len(batch) == 1 else None
        if self._vocab is None:  # read from the graph once, not on every step
            self._vocab = embedding_rows(self.graph)
        return checked_leaves(self.inputs, batch, self._vocab, self.graph.input_names,
                              seq_len=self.spec.seq_len)

    def save(self, path: str | os.PathLike) -> None:
        """Sharded checkpoint (torch.distributed.checkpoint) of parameters and optimizer
        states; every rank calls it. Loadable under any other plan or world size."""
        if self._engine is None:
            self._engine = self._compile()
        self._engine.save(path)

    def load(self, path: str | os.PathLike) -> None:
        """Load a checkpoint written by `save`, resharding to this plan; every rank calls it."""
        if self._engine is None:
            self._engine = self._compile()
        self._engine.load(path)

    def save_pretrained(self, path: str | os.PathLike, *,
                        max_shard_bytes: int = 5_000_000_000,
                        selected_adapters: list[str] | None = None,
                        save_embedding_layers: bool | str = "auto") -> None:
        """A consolidated Hugging Face checkpoint of the trained weights (safetensors, plus the
        model's `config.json` when it has an HF config) that
        `AutoModelForCausalLM.from_pretrained(path)` loads; every rank calls it. Gathered tensor
        by tensor: no rank holds more than its shards plus one full tensor.

        A PEFT model (`peft.PeftModel`) writes what `PeftModel.save_pretrained` writes, which
        `PeftModel.from_pretrained(base, path)` loads: each adapter's
        `adapter_model.safetensors` (PEFT's names) and `adapter_config.json`, "default" in
        `path` and any other in `path/<name>` (`selected_adapters`: which, default all;
        `save_embedding_layers` as PEFT's), rank 0 writing ([Note: PEFT names] in
        autoplan/runtime/adapters.py)."""
        from autoplan.runtime.adapters import is_peft_model, save_adapters

        engine = self.build()._engine
        if is_peft_model(self.module):
            save_adapters(engine, self.module, path, selected_adapters=selected_adapters,
                          save_embedding_layers=save_embedding_layers)
            return
        engine.save_pretrained(path, config=getattr(self.module, "config", None),
                               max_shard_bytes=max_shard_bytes)

    def bytes_read(self) -> int | None:
        """Bytes this rank read from the HF checkpoint given as `weights=` (None otherwise)."""
        source = self.build()._engine.weight_source
        return getattr(source, "bytes_read", None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters held by this rank (collective over tp/dp)."""
        if self._engine is None:
            return {k: v.detach().clone() for k, v in self.module.named_parameters()}
        return self._engine.full_state_dict()

    # -- reports ----------------------------------------------------------------------------
    def report(self, out_dir: str | os.PathLike | None = None) -> str:
        """The plan report as Markdown; with `out_dir`, also writes plan.json, report.md and
        report.html there."""
        from autoplan.report import render_markdown, write_report

        plan = self.plan
        if out_dir is not None:
            write_report(plan, Path(out_dir), graph=self._graph, topology=self.topology,
                         dtype_origin=self.dtype_origin)
        return render_markdown(plan, graph=self._graph, topology=self.topology,
                               dtype_origin=self.dtype_origin)

    def export(self, out_dir: str | os.PathLike, *, timeout_s: float = 600.0) -> dict[str, Path]:
        """Per-rank graph code, Graphviz and JSON in `out_dir`, captured at the plan's
        microbatch size; returns {file name: path}. Not collective: in a training job call it
        on one rank (rank 0). The graphs are traced on a fake process group of the plan's
        size; in a process that trains (a default group exists) that happens in a forked child
        (runtime/job.py run_isolated, at most `timeout_s` seconds), which leaves the job's
        group untouched."""
        from autoplan.passes.expand import plan_for_graph
        from autoplan.passes.export import export_plan
        from autoplan.progress import phase
        from autoplan.runtime.job import run_isolated
        from autoplan.runtime.precision import Precision

        plan = self.plan
        name = type(self.module).__name__
        source = self._capture_source(Precision.of(plan.dtype))
        with phase(f"exporting {name}'s per-rank graphs to {out_dir}"):
            graph, _ = self._capture(source, plan.microbatch_size)
            plan = plan_for_graph(plan, self._graph, graph)
            kernels = self.options.kernels
            if not dist.is_initialized():
                return export_plan(graph, plan, out_dir, kernels)
            return run_isolated(export_plan, graph, plan, out_dir, kernels, timeout_s=timeout_s)


# The world of one this process set up to train alone: not a job (a later model may still be
# planned for world_size= ranks without training).
_PRIVATE_GROUP: list = []


def _in_job() -> bool:
    """Whether this process is a rank of a real job (torchrun, LocalCluster, a user's own
    init_process_group), not alone in the world of one autoplan set up to train."""
    return dist.is_initialized() and not (_PRIVATE_GROUP and dist.group.WORLD is _PRIVATE_GROUP[-1])


def from_pretrained(path: str | os.PathLike, *, peft_config=None,
                    adapter: str | os.PathLike | None = None, **options) -> AutoParallel:
    """An `AutoParallel` over the Hugging Face causal LM in checkpoint directory `path`
    (config.json + safetensors): the model is built from its config on meta and each rank
    reads only the slices of the weights it owns. `options` are `autoparallel`'s
    (global_batch, seq_len, cluster, dtype, overrides, ...). Without `dtype`, it trains in the
    checkpoint's dtype (its safetensors headers: a bf16 checkpoint with bf16 compute and fp32
    masters); `dtype` given, the weights are cast on load ([Note: dtype of the weights] in
    autoplan/runtime/construction.py).

    Fine-tuning with PEFT, as `get_peft_model(AutoModelForCausalLM.from_pretrained(path),
    peft_config)` on one process: `peft_config` (a `peft.PeftConfig`, e.g. `LoraConfig`)
    wraps the model in its adapters, initialised by PEFT's init (recorded on meta and
    replayed on each rank's shards, [Note: RNG contract for initialisation]); the base
    weights, frozen, come from `path`. `adapter`: a directory written by
    `PeftModel.save_pretrained` (or `AutoParallel.save_pretrained`) to go on training, as
    `PeftModel.from_pretrained(model, adapter, is_trainable=True)`: its adapter_config.json
    and its adapter weights.

    Raises ValueError when `path` has no config.json, for both `peft_config` and `adapter`,
    and without `dtype` for a checkpoint whose floating tensors are of several dtypes."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"from_pretrained: {str(path)!r} has no config.json")
    if peft_config is not None and adapter is not None:
        raise ValueError("from_pretrained: peft_config= and adapter= are both given; the "
                         "adapter directory holds its own config: give one of them")
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    if adapter is not None:
        from peft import PeftConfig

        peft_config = PeftConfig.from_pretrained(str(adapter))
        peft_config.inference_mode = False  # trained on, as is_trainable=True loads it

    def build():
        # sdpa: one fused attention op per layer in the captured graph (as autoplan.models);
        # built in fp32 whatever config.json's dtype (a bf16 checkpoint's says bfloat16): the
        # capture and the shards take the plan's dtypes, buffers keep the model's own
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                              dtype=torch.float32)
        if peft_config is None:
            return model
        from peft import get_peft_model

        return get_peft_model(model, peft_config)

    build.__name__ = type(config).__name__.replace("Config", "")
    return autoparallel(build, weights=str(path), adapter=None if adapter is None else
                        str(adapter), **options)()


def autoparallel(target=None, *, global_batch: int, seq_len: int | None = None,
                 cluster: str = "local-cpu",
                 num_nodes: int | None = None, world_size: int | None = None,
                 dtype: str | None = None,
                 optimizer: Callable | None = None, lr_scheduler: Callable | None = None,
                 loss_fn: Callable | None = None, max_grad_norm: float | None = None,
                 device_memory_bytes: float | None = None, weights: str | None = None,
                 adapter: str | None = None, init: Callable | None = None,
                 seed: int | None = None, kernels: bool = True,
                 compile: bool = False, example_batch=None,
                 batch_dims: dict[str, int | None] | None = None,
                 **overrides):
    """Decorate a module class, a factory function or an instance.

    A class or factory is run on the meta device with its construction recorded; each rank
    later replays it on its own shards only ([Note: RNG contract for initialisation]): the
    weights equal `torch.manual_seed(s); factory()` on one process, s being the generator state
    when the factory was called. An instance with real weights is sharded slice by slice; an
    instance on meta is initialised by `init` (default: HF `init_weights()`, else every
    module's `reset_parameters()`), recorded and replayed the same way.

    Args:
        global_batch, seq_len: the training step (samples, tokens per sample). seq_len may be
            left out when the batch is declared (example_batch=, or the first `step(batch)`):
            dim 1 of its input_ids, else 1.
        cluster: a topology preset name or a topology YAML file.
        num_nodes: nodes of the cluster (default: torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE
            under torchrun, a topology file's own, else 1); world_size: ranks of the
            `local-cpu` preset when planning outside a process group.
        dtype: compute dtype, "float32", or "bfloat16" / "float16" for mixed precision
            ([Note: precision recipe] in runtime/precision.py); default: the dtype of the
            weights -- an HF checkpoint's given as `weights=` (its safetensors headers), else
            the model's floating parameters (all bf16: "bfloat16"), float32 for a `save`
            directory or a model without floating parameters; weights of several floating
            dtypes raise ValueError asking for it. Weights in another dtype are cast on load
            ([Note: dtype of the weights] in runtime/construction.py).
        optimizer: `named_params -> Optimizer`, given (FQN, parameter) pairs, which torch
            optimizers take as they take parameters, so that groups can be built by name
            (e.g. no weight decay on norms and biases); default AdamW(lr=1e-3) (with kernels
            on, its fused update: [Note: fused AdamW] in runtime/optim.py);
        lr_scheduler: `optimizer -> LRScheduler`, stepped after every optimizer step;
        loss_fn: `(output, batch) -> scalar`, the mean loss of one microbatch (its samples
            equally weighted: the step's loss is the mean over microbatches and dp ranks),
            given the model's output (a ModelOutput, tuple, tensor) and the batch as `step`
            got it, cut to the microbatch; with `step(input_ids, labels)`: `(logits, labels)`.
            Default: the model's own `loss` output when it returns one (an HF model given
            `labels`), else token cross-entropy of its logits against the batch's `labels`
            over the global batch's trained tokens (-100 ignored), as one process computes
            it on the whole batch;
        max_grad_norm: clip the global gradient norm.
        device_memory_bytes: memory per device the plan may use (replaces the cluster's figure,
            e.g. to leave room for something else).
        weights: a Hugging Face checkpoint directory (config.json + safetensors; each rank
            reads only its slices) or a directory written by `save`, loaded at build. For a
            PEFT model (`get_peft_model(...)`), the base model's checkpoint: base weights are
            read under the names the model had before PEFT wrapped it, adapter weights come
            from their init (or `adapter`); a base weight the checkpoint lacks is an error
            ([Note: PEFT names] in autoplan/runtime/adapters.py).
        adapter: for a PEFT model, a directory written by `PeftModel.save_pretrained` (its
            `adapter_model.safetensors`) whose weights the adapters start from, instead of
            their init.
        init: `module -> None`, the init of a model given on meta (see above).
        seed: the seed of dropout and every other random op in training ([Note: RNG contract]
            in autoplan/passes/rng.py; default: rank 0's `torch.initial_seed()`).
        kernels: run the fused kernels (RMSNorm, SwiGLU gating, the vocab-parallel loss) in
            place of the patterns they implement in the rewritten graphs ([Note: kernel fusion]
            in autoplan/passes/kernels.py; Triton on CUDA, the torch reference on CPU), and the
            default optimizer's fused AdamW update; False keeps the captured ops and
            torch.optim.AdamW. A runtime choice: the plan is the same either way.
        compile: run each rank's stage modules through torch.compile (TorchInductor; C++ on
            CPU, Triton on CUDA): one compiled region per repeated block (a model without
            blocks: its whole stage), on the DTensors of tensor parallelism, inside FSDP2's
            and the pipeline's collectives, as torchtitan compiles per block
            ([Note: compiled stages] in autoplan/runtime/compiled.py). The plan is priced for
            it (`Plan.compiled`: no DTensor host time per op, pointwise chains fused;
            [Note: compiled execution] in autoplan/cost_model/compute.py). The first step
            pays the compilation (TORCHINDUCTOR_CACHE_DIR keeps the kernels between runs);
            results equal the eager run's (tests/test_compile.py).
        example_batch: the batch to plan for, as `step` takes it (a dict, tuple or tensor;
            tensors on meta do), at global_batch samples; default: the first batch given to
            `step`, or (global_batch, seq_len) token ids and labels (autoplan/inputs.py).
        batch_dims: the batch dim of an input where it is ambiguous, by name
            ([Note: batch dims] in autoplan/inputs.py; None: not split, whole to every
            microbatch).
        **overrides: fix solver choices: tp, pp, dp, zero_stage, num_microbatches, schedule,
            num_virtual_stages, allow_tp_across_nodes, checkpointing ("none" |
            "core-attention" | "selective" | "full"), ep (expert parallelism inside dp, [Note: expert parallelism]),
            sequence_parallel (True / False: Megatron-LM's sequence parallelism on the tp axis
            fixed on or off, [Note: sequence parallelism] in autoplan/solver/sequence.py),
            cp (context parallelism, [Note: context parallelism] in autoplan/solver/context.py:
            every sample's sequence cut into 2 cp chunks over cp ranks, K and V all-gathered
            in attention; searched as `autoplan plan` searches it where the runtime can run
            it -- the token-LM batch and loss, fused causal attention, a position index, no
            dropout, compile=False; with dp, tp, pp and ZeRO -- and 1 otherwise, the reason
            given where a cp 1 plan cannot be made; a given cp the runtime cannot run raises
            when built, naming why).
            offload ("none" | "optimizer" | "optimizer+params": CPU offload, [Note:
            offload] in autoplan/solver/offload.py).

    Returns an `AutoParallel` (instance), or a callable returning one (class / factory).
    Raises ValueError for unknown override names.
    """
    allowed = {"tp", "pp", "dp", "zero_stage", "num_microbatches", "schedule",
               "num_virtual_stages", "allow_tp_across_nodes", "time_limit_s", "checkpointing",
               "ep", "sequence_parallel", "cp", "offload"}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        import difflib
        import inspect

        names = sorted(allowed | set(inspect.signature(autoparallel).parameters) - {"target",
                                                                                  "overrides"})
        hints = {u: difflib.get_close_matches(u, names, n=1) for u in unknown}
        said = "; ".join(f"did you mean {h[0]!r} for {u!r}?" for u, h in hints.items() if h)
        raise ValueError(f"autoparallel: unknown option(s) {unknown}; "
                         f"{said + ' ' if said else ''}the options are {names}")
    for name, value, least in (("global_batch", global_batch, 1), ("seq_len", seq_len, 1),
                               ("num_nodes", num_nodes, 1), ("world_size", world_size, 1)):
        if value is None and name != "global_batch":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"autoparallel: {name}={value!r}; expected an integer >= {least}")
    for name, value in (("kernels", kernels), ("compile", compile)):
        if not isinstance(value, bool):
            raise ValueError(f"autoparallel: {name}={value!r}; expected True or False")
    options = PlanOptions(global_batch=global_batch, seq_len=seq_len, cluster=cluster,
                          num_nodes=num_nodes, world_size=world_size, dtype=dtype,
                          optimizer=optimizer, lr_scheduler=lr_scheduler, loss_fn=loss_fn,
                          max_grad_norm=max_grad_norm,
                          device_memory_bytes=device_memory_bytes, weights=weights,
                          adapter=adapter, init=init,
                          seed=seed, kernels=kernels, compile=compile,
                          example_batch=example_batch,
                          batch_dims=tuple(sorted((batch_dims or {}).items())),
                          overrides=tuple(sorted(overrides.items())))

    def wrap(obj):
        if isinstance(obj, nn.Module):
            return AutoParallel(obj, options)
        if callable(obj):
            @functools.wraps(obj, updated=())
            def build(*args, **kwargs):
                import time

                start = time.perf_counter()
                module, trace = _record_construction(obj, args, kwargs)
                if not isinstance(module, nn.Module):
                    raise TypeError(f"autoparallel: {getattr(obj, '__name__', obj)} returned "
                                    f"{type(module).__name__}, not an nn.Module")
                return AutoParallel(module, options, init_trace=trace,
                                    record_s=time.perf_counter() - start)
            return build
        raise TypeError(f"autoparallel: cannot decorate {type(obj).__name__}; expected an "
                        "nn.Module class, a factory function or an instance")

    return wrap if target is None else wrap(target)
