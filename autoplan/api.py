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

Every rank plans the same way (capture and solver are deterministic); rank 0's plan and weights
are broadcast anyway, so all ranks start from one plan and one set of weights.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from autoplan.plan import Plan
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology, load_topology, preset

__all__ = ["autoparallel", "AutoParallel", "PlanOptions"]


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """What `@autoparallel` was given; see `autoparallel` for the fields."""

    global_batch: int
    seq_len: int
    cluster: str = "local-cpu"
    num_nodes: int = 1
    world_size: int | None = None
    dtype: str = "float32"
    optimizer: Callable | None = None
    max_grad_norm: float | None = None
    device_memory_bytes: float | None = None
    overrides: tuple[tuple[str, object], ...] = ()


class AutoParallel:
    """A model under autoplan: `.step(input_ids, labels)`, `.plan`, `.report()`, `.export()`.

    Args:
        module: the model (real weights, on CPU, or on meta for planning only).
        options: PlanOptions.
    """

    def __init__(self, module: nn.Module, options: PlanOptions):
        self.module = module
        self.options = options
        self._plan: Plan | None = None
        self._graph = None
        self._engine = None

    # -- planning ---------------------------------------------------------------------------
    @property
    def topology(self) -> Topology:
        topo = self._cluster()
        if self.options.device_memory_bytes is not None:
            device = dataclasses.replace(topo.device, mem_bytes=self.options.device_memory_bytes)
            topo = dataclasses.replace(topo, device=device)
        return topo

    def _cluster(self) -> Topology:
        o = self.options
        world = dist.get_world_size() if dist.is_initialized() else (o.world_size or 1)
        if o.cluster.endswith((".yaml", ".yml", ".json")):
            topo = load_topology(o.cluster)
            return dataclasses.replace(topo, num_nodes=o.num_nodes)
        if o.cluster == "local-cpu":
            if world % o.num_nodes:
                raise ValueError(f"world size {world} does not divide into {o.num_nodes} nodes")
            return preset("local-cpu", num_nodes=o.num_nodes,
                          devices_per_node=world // o.num_nodes)
        return preset(o.cluster, num_nodes=o.num_nodes)

    @property
    def spec(self) -> TrainingSpec:
        return TrainingSpec(global_batch=self.options.global_batch, seq_len=self.options.seq_len,
                            dtype=self.options.dtype)

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

    def _example(self, batch: int) -> tuple[torch.Tensor]:
        device = "meta" if _on_meta(self.module) else "cpu"
        return (torch.zeros(batch, self.options.seq_len, dtype=torch.long, device=device),)

    def _make_plan(self) -> Plan:
        from autoplan.capture import capture
        from autoplan.solver import plan as solve

        topo = self.topology
        if dist.is_initialized() and dist.get_world_size() != topo.world_size:
            raise ValueError(
                f"cluster {topo.name!r} has {topo.world_size} devices but this process group "
                f"has {dist.get_world_size()} ranks")
        name = type(self.module).__name__
        graph = capture(self.module, self._example(self.options.global_batch), model_name=name)
        plan = solve(graph, topo, self.spec, **dict(self.options.overrides))
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [plan.to_json() if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0)
            plan = Plan.from_json(box[0])
        self._graph = graph
        return plan

    # -- training ---------------------------------------------------------------------------
    def _compile(self):
        from autoplan.capture import capture
        from autoplan.runtime.engine import DistributedModel

        if not dist.is_initialized():
            if self.topology.world_size != 1:
                raise RuntimeError(
                    f"the plan needs {self.topology.world_size} ranks: run under torchrun or "
                    "autoplan.runtime.LocalCluster (this process has no process group)")
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        plan = self.plan
        if _on_meta(self.module):
            raise ValueError(
                "the model is on the meta device: materialise it before training (e.g. "
                "model.to_empty(device='cpu') and its init_weights(), which also recomputes "
                "non-persistent buffers such as rotary tables), or load a checkpoint")
        _broadcast_weights(self.module)
        # The runtime graph is captured at the microbatch size: view shapes are static.
        graph = capture(self.module, self._example(plan.microbatch_size),
                        model_name=type(self.module).__name__)
        return DistributedModel(graph, plan, self.module, optimizer=self.options.optimizer,
                                max_grad_norm=self.options.max_grad_norm)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """One optimizer step on the global batch (same tensors on every rank); returns the
        global mean loss. input_ids, labels: (global_batch, seq_len) int64."""
        if self._engine is None:
            self._engine = self._compile()
        return self._engine.step(input_ids, labels)

    __call__ = step

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
            write_report(plan, Path(out_dir), graph=self._graph, topology=self.topology)
        return render_markdown(plan, graph=self._graph, topology=self.topology)

    def export(self, out_dir: str | os.PathLike) -> dict[str, Path]:
        """Per-rank graph code, Graphviz and JSON in `out_dir` (a planning process only: see
        autoplan.passes.export)."""
        from autoplan.capture import capture
        from autoplan.passes.export import export_plan

        plan = self.plan
        graph = capture(self.module, self._example(plan.microbatch_size),
                        model_name=type(self.module).__name__)
        return export_plan(graph, plan, out_dir)


def _on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters())


@torch.no_grad()
def _broadcast_weights(module: nn.Module) -> None:
    if dist.get_world_size() == 1:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=0)


def autoparallel(target=None, *, global_batch: int, seq_len: int, cluster: str = "local-cpu",
                 num_nodes: int = 1, world_size: int | None = None, dtype: str = "float32",
                 optimizer: Callable | None = None, max_grad_norm: float | None = None,
                 device_memory_bytes: float | None = None, **overrides):
    """Decorate a module class, a factory function or an instance.

    Args:
        global_batch, seq_len: the training step (samples, tokens per sample).
        cluster: a topology preset name or a topology YAML file.
        num_nodes: nodes of the cluster; world_size: ranks of the `local-cpu` preset when
            planning outside a process group.
        dtype: compute dtype; optimizer: `params -> Optimizer` (default AdamW(lr=1e-3));
        max_grad_norm: clip the global gradient norm.
        device_memory_bytes: memory per device the plan may use (replaces the cluster's figure,
            e.g. to leave room for something else).
        **overrides: fix solver choices: tp, pp, dp, zero_stage, num_microbatches, schedule,
            num_virtual_stages, allow_tp_across_nodes, checkpointing ("none" | "selective" |
            "full").

    Returns an `AutoParallel` (instance), or a callable returning one (class / factory).
    Raises ValueError for unknown override names.
    """
    allowed = {"tp", "pp", "dp", "zero_stage", "num_microbatches", "schedule",
               "num_virtual_stages", "allow_tp_across_nodes", "time_limit_s", "checkpointing"}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ValueError(f"autoparallel: unknown option(s) {unknown}; allowed: {sorted(allowed)}")
    options = PlanOptions(global_batch=global_batch, seq_len=seq_len, cluster=cluster,
                          num_nodes=num_nodes, world_size=world_size, dtype=dtype,
                          optimizer=optimizer, max_grad_norm=max_grad_norm,
                          device_memory_bytes=device_memory_bytes, overrides=tuple(sorted(overrides.items())))

    def wrap(obj):
        if isinstance(obj, nn.Module):
            return AutoParallel(obj, options)
        if callable(obj):
            @functools.wraps(obj, updated=())
            def build(*args, **kwargs):
                module = obj(*args, **kwargs)
                if not isinstance(module, nn.Module):
                    raise TypeError(f"autoparallel: {getattr(obj, '__name__', obj)} returned "
                                    f"{type(module).__name__}, not an nn.Module")
                return AutoParallel(module, options)
            return build
        raise TypeError(f"autoparallel: cannot decorate {type(obj).__name__}; expected an "
                        "nn.Module class, a factory function or an instance")

    return wrap if target is None else wrap(target)
