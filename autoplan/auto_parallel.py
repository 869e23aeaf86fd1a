"""`AutoParallel`: a model under autoplan, what `@autoparallel` returns (autoplan/api.py).

Its planning half (cluster, capture, plan cache, solve) is its base class `PlanningSession`
(autoplan/session.py); here: the build of this rank's runtime (`DistributedModel`), the
training and evaluation steps, checkpoints and weights, the dry run, the report and the export.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from autoplan.options import PlanOptions
from autoplan.plan import Plan
from autoplan.runtime.construction import is_dcp as _is_dcp, resolve_dtype, weight_source
from autoplan.session import _PRIVATE_GROUP, PlanningSession, _in_job, _private_group

__all__ = ["AutoParallel"]


class AutoParallel(PlanningSession):
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
        if options.dtype is None and options.search.float8 != "off":
            # the float8 recipe is bf16 with FP8 linears ([Note: float8 recipe])
            self.dtype, self.dtype_origin = "bfloat16", "the float8 recipe's"

    # -- training ---------------------------------------------------------------------------
    def _compile(self):
        """The engine (`_build_engine`); a build that fails takes down the one-rank process
        group it set up for itself, so that the process is as it was (a later fake or real
        group of another size can be made). In a group autoplan created, the engine is
        dropped at exit, so that the group ends before the interpreter does ([Note: orderly
        exit] in autoplan/runtime/shutdown.py)."""
        from autoplan.runtime.shutdown import release_at_exit

        before = len(_PRIVATE_GROUP)
        try:
            engine = self._build_engine()
        except BaseException:
            if len(_PRIVATE_GROUP) > before and dist.is_initialized() and \
                    dist.group.WORLD is _private_group():
                dist.destroy_process_group()
                _PRIVATE_GROUP.pop()
            raise
        release_at_exit(self._release_runtime)
        return engine

    def _release_runtime(self) -> None:
        """Drop this rank's runtime (the engine: FSDP2's state and the pipeline stages hold
        the job's process groups), so that they can be destroyed at exit ([Note: orderly exit]
        in autoplan/runtime/shutdown.py). A later step would build it again."""
        self._engine = None

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
                from autoplan.runtime.shutdown import init_default_group

                # destroyed at exit, its worker threads joined ([Note: orderly exit])
                init_default_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                _PRIVATE_GROUP.append(weakref.ref(dist.group.WORLD))
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
        # passes/context_parallel.py gives it global positions and attention over the cp group.
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

    def dry_run(self, ranks=None, *, steps: int = 1, export=None) -> list:
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
        # dry_run retargets the plan made on `planned` itself: given `plan` (already named
        # after `graph`'s nodes) it would map the names a second time, onto other nodes
        rows = dry_run(graph, self.plan, ranks, planned_graph=planned, inputs=self.inputs,
                       optimizer=self.options.optimizer, loss_fn=self.options.loss_fn,
                       max_grad_norm=self.options.max_grad_norm,
                       kernels=self.options.kernels, steps=steps,
                       device_mem_bytes=self.topology.device.mem_bytes,
                       record_ops=export is not None,
                       device_kernels=self.topology.device.fuses_pointwise,
                       device_all_to_all=self.topology.device.all_to_all)
        if export is not None:
            from autoplan.runtime.step_export import step_files, write_step_files

            write_step_files(step_files(rows, plan), export)
        return rows

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
        model's `config.json` when it has an HF config, and its `generation_config.json` when
        it generates, as transformers' `save_pretrained` writes them) that
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
                               max_shard_bytes=max_shard_bytes,
                               extra_files=_generation_config(self.module))

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


def _generation_config(module) -> dict[str, str]:
    """{"generation_config.json": text} for an HF model that generates and has a generation
    config (what transformers' `save_pretrained` writes beside config.json), else {}."""
    gen = getattr(module, "generation_config", None)
    can = getattr(module, "can_generate", None)
    if gen is None or not callable(can) or not can() or not hasattr(gen, "to_json_string"):
        return {}
    return {"generation_config.json": gen.to_json_string(use_diff=True)}
