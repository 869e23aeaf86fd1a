"""The planning half of `AutoParallel` (autoplan/auto_parallel.py): the cluster to plan for,
the training spec and the planned batch, the capture for planning, the cp trial, the plan cache,
the solve; in a job, rank 0 captures first and solves for every rank (runtime/leader.py,
[Note: leader rank]).

`PlanningSession` is `AutoParallel`'s base class: it reads the wrapper's `module`, `options`
(`PlanOptions`), `dtype`, and the state `AutoParallel.__init__` sets (`_plan`, `_graph`,
`_inputs`, `_build_stats`). Also here: whether this process is a rank of a real job
(`_in_job`), against the one-rank group a lone process sets up to train (`_PRIVATE_GROUP`).

`audit` (random ops and batch couplings, the options they hold) and `solve` (the plan, the
couplings' check, the solver's warnings recorded for the caller to say) are the planning both
entry points run: `PlanningSession` and `autoplan plan` (autoplan/cli.py `_plan`). The runtime
is imported where the decorator's model needs it, not with this module: `autoplan plan`
imports no runtime.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from autoplan.options import SearchOptions
from autoplan.plan import Plan
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology, load_topology, preset

__all__ = ["PlanningSession", "audit", "solve"]


def _leader():
    """autoplan.runtime.leader where rank 0 works for the job's ranks (`leader.shared()`),
    else None: alone, or on the fake process group (a planning process imports no runtime)."""
    if not (_in_job() and dist.get_world_size() > 1):
        return None
    from autoplan.runtime import leader

    return leader if leader.shared() else None


# The world of one this process set up to train alone: not a job (a later model may still be
# planned for world_size= ranks without training). Weak references: a destroyed group ends
# here too, its worker threads with it ([Note: orderly exit] in autoplan/runtime/shutdown.py).
_PRIVATE_GROUP: list[weakref.ref] = []


def _private_group():
    """The world of one autoplan set up for this process to train alone, or None."""
    return _PRIVATE_GROUP[-1]() if _PRIVATE_GROUP else None


def _in_job() -> bool:
    """Whether this process is a rank of a real job (torchrun, LocalCluster, a user's own
    init_process_group), not alone in the world of one autoplan set up to train."""
    return dist.is_initialized() and not (_PRIVATE_GROUP and
                                          dist.group.WORLD is _private_group())


class PlanningSession:
    """Cluster, spec, capture and plan of an `AutoParallel` (its base class; see the module
    docstring for the state it reads)."""

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
        from autoplan.runtime.construction import on_meta

        spec = self.inputs
        if seq_len is not None and seq_len != self.spec.seq_len:
            spec = InputSpec.tokens(spec.global_batch, seq_len)  # cp: the token form only
        example = spec.example(batch_size, "meta" if on_meta(source) else "cpu")
        from autoplan.runtime.precision import Precision

        precision = Precision.of(self.dtype)  # floating inputs in its compute dtype
        compute = precision.compute_dtype if precision.mixed else None
        args, kwargs = spec.call([
            None if not leaf.to_model else
            t.to(compute) if compute is not None and t.is_floating_point() else t
            for leaf, t in zip(spec.leaves, example)])
        name = type(self.module).__name__
        # read back from the capture cache when this capture was made before, by an earlier
        # job or another rank of this machine ([Note: capture cache] in capture/cache.py):
        # in a job rank 0 captures first, the others then read its entry ([Note: leader rank])
        def work():
            return cached_capture(source, args, example_kwargs=kwargs, model_name=name,
                                  planning=planning)

        leader = _leader()
        graph, how = leader.leader_first(work, what=f"capturing {name} at batch {batch_size}") \
            if leader else work()
        graph.batch_size, graph.seq_len = batch_size, seq_len or self.spec.seq_len
        return graph, how == "hit"

    def _capture_source(self, precision) -> nn.Module:
        """What planning and the runtime capture (the same, so that their graphs match node for
        node): the model itself when it has real fp32 weights and trains in fp32 (constants
        torch.export lifts out of forward keep their values), else a meta copy with its
        floating parameters in the compute dtype (a bf16 model trained in fp32 is captured
        in fp32: [Note: dtype of the weights])."""
        from autoplan.runtime.construction import meta_skeleton, on_meta

        if not on_meta(self.module) and not precision.mixed and all(
                p.dtype == torch.float32 for p in self.module.parameters()
                if p.is_floating_point()):
            return self.module
        return meta_skeleton(self.module, precision.compute_dtype)

    def _make_plan(self) -> Plan:
        from autoplan.batch_coupling import check_plan
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
        _refuse_stateful_parametrizations(self.module, name)
        # Planned on the graph the runtime will run: a meta copy in the compute dtype (a 16-bit
        # graph has the model's own upcasts as nodes; see [Note: precision recipe]).
        with self._timed("capture_for_planning_s"), phase(f"capturing {name}"):
            source = self._capture_source(Precision.of(self.dtype))
            graph, cached = self._capture(source, self.options.global_batch, planning=True)
        self._build_stats["capture_for_planning_cached"] = cached
        with self._timed("plan_s"):
            def make() -> tuple[str, list, bool, list]:
                # before the search: random ops keyed by sample, and the ops a cut batch or a
                # repeated forward would change held to plans that keep them
                couplings, search = audit(graph, self.options.search, name)
                # cp searched where the runtime can run it for this model, batch and loss
                why_not = None if search.cp is not None else self._cp_refusal(graph, topo)
                request = self._cache_request(graph, topo, search, cp_searched=why_not is None)
                cached = self._cached_plan(request, topo)
                if cached is not None:
                    return cached[0].to_json(), cached[1], True, couplings
                with phase(f"planning {name} for {topo.world_size} x {topo.device.name}"):
                    plan, said = self._solve(graph, topo, search, couplings, request, why_not)
                return plan.to_json(), said, False, couplings

            # in a job rank 0 audits and plans, every rank takes its couplings and plan ([Note:
            # leader rank]: every rank captured the same graph); the solver's warnings are said
            # on every rank, as where each solved
            leader = _leader()
            plan_json, said, from_cache, self._couplings = leader.from_leader(
                make, what=f"planning {name} for {topo.world_size} ranks") if leader else make()
            if leader and dist.get_rank() != 0:
                for category, message in said:
                    warnings.warn(message, category, stacklevel=2)
            plan = Plan.from_json(plan_json)
        check_plan(plan, self._couplings, name)  # a cached plan, as `solve` checks a new one
        self._build_stats["plan_from_cache"] = from_cache
        self._graph = graph
        return plan

    def _cache_request(self, graph, topo: Topology, search: SearchOptions,
                       cp_searched: bool) -> dict | None:
        """The plan cache's request for this model ([Note: plan cache] in autoplan/cache.py):
        the captured graph's fingerprint, the cluster, the training spec, the options `search`
        fixes (`SearchOptions.given`, those the batch couplings hold included) and whether cp
        is searched (`_cp_refusal`); None when the cache is off (AUTOPLAN_PLAN_CACHE=0)."""
        from autoplan.cache import graph_fingerprint

        if os.environ.get("AUTOPLAN_PLAN_CACHE", "1") == "0":
            return None
        overrides = search.given()
        if "placements" in overrides:  # parse_pins' sorted (pattern, placement) pairs
            overrides["placements"] = [list(p) for p in overrides["placements"]]
        if overrides.get("stages") is not None:
            overrides["stages"] = list(overrides["stages"])
        return {"command": "autoparallel", "graph": graph_fingerprint(graph),
                "topology": topo.to_dict(), "spec": dataclasses.asdict(self.spec),
                "overrides": overrides, "compiled": self.options.compile,
                "cp_searched": cp_searched,
                "elementwise_optimizer": self._optimizer_reads_whole_tensors() is None,
                "frozen_weights_dtype": self._frozen_weights_dtype()}

    def _cached_plan(self, request: dict | None,
                     topo: Topology) -> tuple[Plan, list[tuple[type, str]]] | None:
        """The cache's plan for `request` and its warnings, said again ((category, message)
        each); None on a miss."""
        from autoplan.cache import PlanCache
        from autoplan.progress import note
        from autoplan.solver.configurations import ReplicatedWeightsWarning

        entry = PlanCache().get(request) if request is not None else None
        if entry is None:
            return None
        note(f"plan of {type(self.module).__name__} for {topo.world_size} x "
             f"{topo.device.name} read from the plan cache ({PlanCache().path(request)}; "
             "AUTOPLAN_PLAN_CACHE=0 plans anew)")
        for message in entry["warnings"]:
            warnings.warn(message, ReplicatedWeightsWarning, stacklevel=2)
        return (Plan.from_dict(entry["plan"]),
                [(ReplicatedWeightsWarning, message) for message in entry["warnings"]])

    def _solve(self, graph, topo: Topology, search: SearchOptions, couplings: list,
               request: dict | None,
               why_not: str | None) -> tuple[Plan, list[tuple[type, str]]]:
        """Solve (`solve`), say the solver's warnings again, and store the plan with its
        ReplicatedWeightsWarnings (a cache that cannot be written is a detail line, not a
        failure). `couplings`: `audit`'s. `why_not`: why cp is not searched (cp 1 then,
        unless given), None to search it. Returns the plan and the warnings said, (category,
        message) each."""

        from autoplan.cache import PlanCache
        from autoplan.progress import detail
        from autoplan.solver.configurations import ReplicatedWeightsWarning

        plan, caught = solve(graph, topo, self.spec, search, given=self.options.search,
                             couplings=couplings, name=type(self.module).__name__,
                             why_not_cp=why_not, compiled=self.options.compile,
                             frozen_weights_dtype=self._frozen_weights_dtype(),
                             whole_tensors=self._optimizer_reads_whole_tensors())
        for w in caught:  # shown as they would have been
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if request is not None and (not _in_job() or dist.get_rank() == 0):
            replicated = [str(w.message) for w in caught
                          if issubclass(w.category, ReplicatedWeightsWarning)]
            try:
                PlanCache().put(request, {"plan": plan.to_dict(), "warnings": replicated})
            except OSError as e:
                detail(f"plan cache not written: {e}")
        return plan, [(w.category, str(w.message)) for w in caught]

    def _optimizer_reads_whole_tensors(self) -> str | None:
        """Why the user's `optimizer=` must be handed whole tensors, or None (no optimizer
        given: the default AdamW; or an elementwise one): runtime/optim.py
        whole_tensor_reason, [Note: elementwise optimizer]. Probed once per session."""
        if not hasattr(self, "_whole_tensor_reason"):
            from autoplan.runtime.optim import whole_tensor_reason

            opt = self.options.optimizer
            self._whole_tensor_reason = None if opt is None else whole_tensor_reason(
                opt, self.module.named_parameters())
        return self._whole_tensor_reason

    def _frozen_weights_dtype(self) -> str | None:
        """The dtype the frozen parameters' weights come in (runtime/construction.py
        frozen_weights_dtype): where it is the 16-bit compute dtype, the planner holds them in
        it ([Note: frozen dtype] in solver/frozen.py)."""
        from autoplan.runtime.construction import frozen_weights_dtype

        return frozen_weights_dtype(self.module, self.options.weights)

    def _cp_refusal(self, graph, topo: Topology) -> str | None:
        """Why the runtime could not run a cp > 1 plan of this model, batch and loss, or None:
        runtime/checks.py context_parallel_refusal, then the cp step of the lowering itself
        (passes/lowering.py try_context_parallel: its attentions, masks and position source)
        tried on a copy of the planning graph; a mask too large to evaluate here is checked at
        build. None without a trial where the search has no cp > 1 for this sequence and world
        (solver/context.py cp_degrees)."""
        from autoplan.passes.lowering import try_context_parallel
        from autoplan.runtime.checks import context_parallel_refusal
        from autoplan.solver.context import cp_degrees

        if not any(cp > 1 for cp in cp_degrees(graph, self.spec.seq_len, topo.world_size)):
            return None  # the search has no cp > 1 to try

        refusal = context_parallel_refusal(graph, self.inputs, self.options.loss_fn,
                                           self.options.compile)
        if refusal is not None:
            return str(refusal)
        try:  # cp 1: the same checks at the planned length. Masks of over 4M entries (b s^2:
            # past 1K tokens at batch 4) are left to the build, which evaluates them at seq /
            # cp per microbatch (a 128K mask would be 17 GB here)
            try_context_parallel(graph, self.spec.seq_len, check_masks_up_to=1 << 22)
        except ValueError as e:
            return str(e)
        return None

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


def audit(graph, search: SearchOptions, name: str) -> tuple[list, SearchOptions]:
    """Before the search, before any rank starts: the random ops keyed by sample ([Note: RNG
    contract] in autoplan/passes/rng.py), a model with one the runtime cannot key refused
    naming the node, its module and source line (a seeded op without a layout-invariant
    version, a draw whose samples are not on dim 0); and the ops whose numbers a cut batch or
    a repeated forward would change ([Note: batch coupling] in autoplan/batch_coupling.py).
    Returns (those couplings, `search` with the choices they need held: batch_coupling.py
    `held_overrides`). `name`: the model's, for the messages.

    Raises ValueError for a random op the contract cannot key and for an option that breaks a
    coupling (dp=2 with batch_norm in training mode), naming the op and what to do."""
    from autoplan.batch_coupling import batch_couplings, held_overrides
    from autoplan.passes.rng import random_op_indices
    from autoplan.strategies.samples import sample_facts

    samples = sample_facts(graph.gm, graph.batch_size)
    try:
        random_op_indices(graph.gm, samples, batch_size=graph.batch_size)
    except ValueError as e:
        raise ValueError(f"{name}: {e}. Every random op must be keyed by sample to train as one "
                         "process would on any plan; set its probability to 0 (e.g. "
                         "drop_path_rate=0), or draw with an op the contract keys (dropout, "
                         "rand, bernoulli) over a tensor whose dim 0 holds the samples") from None
    buffers = {n for fqn, p in graph.params.items() if p.is_buffer for n in (fqn, *p.aliases)}
    couplings = batch_couplings(graph.gm, buffers, samples, batch_size=graph.batch_size)
    held = held_overrides(search.given(), couplings, name)
    return couplings, dataclasses.replace(search, **held)


def solve(graph, topology: Topology, spec: TrainingSpec, search: SearchOptions, *,
          given: SearchOptions, couplings: list, name: str, why_not_cp: str | None = None,
          whole_tensors: str | None = None, **kwargs) -> tuple[Plan, list]:
    """The plan of `graph` (autoplan.solver `plan`) for the options `search` (`audit`'s: the
    user's, `given`, with the choices `couplings` hold), checked against the couplings
    (batch_coupling.py `check_plan`), and the warnings the solver gave (warnings.
    WarningMessage, each ReplicatedWeightsWarning recorded however often it was said before),
    for the caller to say. `why_not_cp`: why the runtime cannot run cp > 1 (cp 1 then, unless
    given), None to search it. `whole_tensors`: why the optimizer reads whole tensors, or None
    (an elementwise one). `kwargs`: plan()'s (compiled, frozen_weights_dtype).

    Raises what plan() raises; an InvalidConfig says the couplings that held the search, or
    that cp was held to 1 and why, where either may be the cause."""
    from autoplan.batch_coupling import check_plan
    from autoplan.solver import InvalidConfig
    from autoplan.solver import plan as solve_plan
    from autoplan.solver.configurations import ReplicatedWeightsWarning

    held = sorted(set(search.given()) - set(given.given()))  # by the couplings
    cp_held = why_not_cp is not None and search.cp is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ReplicatedWeightsWarning)  # each plan says its own
        try:
            plan = solve_plan(graph, topology, spec,
                              dataclasses.replace(search, cp=1) if cp_held else search,
                              elementwise_optimizer=whole_tensors is None, **kwargs)
        except InvalidConfig as e:  # one that a cp > 1 could have satisfied says why
            if whole_tensors is not None and "reads whole tensors" in e.reason:
                raise InvalidConfig(f"{e.reason}. The probe: {whole_tensors}") from None
            if held:  # held by the batch couplings: say which op holds most of them
                by = max(couplings, key=lambda c: len(set(c.keeps) & set(held)))
                raise InvalidConfig(
                    f"{e.reason} (the search was held to "
                    f"{', '.join(f'{k}={getattr(search, k)!r}' for k in held)} by {by}; "
                    "[Note: batch coupling] in autoplan/batch_coupling.py)",
                    option=e.option) from None
            if not cp_held or not ("does not fit world size" in e.reason or
                                   "no configuration of" in e.reason):
                raise
            raise InvalidConfig(f"{e.reason} (planned with cp 1: {why_not_cp})",
                                option=e.option) from None
    check_plan(plan, couplings, name)  # a microbatch of 1 sample
    return plan, list(caught)


def _refuse_stateful_parametrizations(module: nn.Module, name: str) -> None:
    """Refuse at planning a model with spectral normalisation (torch.nn.utils.parametrizations.
    spectral_norm, or the older hook of torch.nn.utils.spectral_norm), naming the weight. Its
    forward in training runs a power-iteration step that writes the buffers `_u`, `_v`
    (`weight_u`, `weight_v`) in place, so the weight one step uses depends on how many forwards
    ran before it: a plan with several microbatches or recomputed activations runs more of them
    per step than one process, and `eval_step` runs them where one process in eval mode does
    not. weight_norm (stateless) trains as one process does."""
    from autoplan._torch_compat import spectral_normalised

    found = spectral_normalised(module)
    if found:
        raise ValueError(
            f"{name}: {', '.join(found)} {'is' if len(found) == 1 else 'are'} spectral-normalised "
            "(torch.nn.utils.parametrizations.spectral_norm), whose every forward in training "
            "writes its power-iteration buffers (_u, _v) in place: a plan that runs more "
            "forwards per step than one process (microbatches, recomputed activations), or "
            "eval_step, changes them as one process does not. Remove it "
            "(torch.nn.utils.parametrize.remove_parametrizations(module, 'weight'); the older "
            "hook: torch.nn.utils.remove_spectral_norm(module)) or use weight_norm, which "
            "keeps no state")
