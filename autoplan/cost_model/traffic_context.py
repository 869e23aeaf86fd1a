"""What the traffic rules (traffic.py, traffic_tp.py) share: what they add up (`RankTraffic`,
one pipeline rank's bytes and ops by mesh axis) and what they read of a plan and its graph,
computed once per plan (`TrafficContext`) ([Note: traffic per axis] in traffic.py).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from autoplan.graph import CapturedGraph
from autoplan.plan import Plan

__all__ = ["RankTraffic", "TrafficContext", "gradient_carriers"]


@dataclass
class RankTraffic:
    """One pipeline rank's traffic in one training step.

    Attributes:
        bytes_by_axis: bytes by mesh axis (the recorder's labels: "dp", "dp_cp", "tp", "cp",
            "pp", "pp[k]"), each op's largest buffer summed.
        counts: ops by "op@axis" (`Collective.op`, e.g. "_allgather_base_@dp").
    """

    bytes_by_axis: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, op: str, axis: str, nbytes: float, times: int = 1) -> None:
        if times <= 0:
            return
        self.bytes_by_axis[axis] = self.bytes_by_axis.get(axis, 0.0) + nbytes * times
        key = f"{op}@{axis}"
        self.counts[key] = self.counts.get(key, 0) + times


class TrafficContext:
    """What the rules read of the plan and graph: parameters per unit, where each node of the
    graph runs in the model of `graph.total_layers` blocks, the bytes of values."""

    def __init__(self, plan: Plan, graph: CapturedGraph, kernels: bool = True,
                 all_to_all: bool = False):
        from autoplan.passes.stages import constant_like_nodes

        self.plan, self.graph, self.kernels, self.all_to_all = plan, graph, kernels, all_to_all
        mesh = plan.mesh
        self.D = mesh.dp * mesh.cp
        self.dp_axis = "dp" if mesh.cp == 1 else "dp_cp"
        # the cp group is the dp x cp group at dp 1, which the recorder names "dp_cp"
        self.cp_axis = "cp" if mesh.dp > 1 else "dp_cp"
        self.e = torch.empty((), dtype=getattr(torch, plan.dtype)).element_size()
        self.mixed = self.e < 4
        self.f = 4 if self.mixed else self.e  # FSDP2's reduce dtype
        self.m = plan.num_microbatches
        self.N = max(graph.num_layers, 1)
        self.L = max(graph.total_layers, self.N)
        widths = [i.dtype for i in graph.params.values() if not i.is_buffer]
        # floating values in the dtype the parameters were captured in run in the compute dtype
        self.captured_dtype = max(set(widths), key=widths.count) if widths else plan.dtype
        self.nodes = {n.name: n for n in graph.gm.graph.nodes}
        self.layer_of = {name: k for k, names in graph.layer_nodes.items() for name in names}
        self.index_in_block = {name: i for names in graph.layer_nodes.values()
                               for i, name in enumerate(names)}
        self.strategies = {s.node: s for s in plan.strategies}
        self.params = {name: info for info in graph.params.values()
                       for name in (info.fqn, *info.aliases)}  # a tied weight by any name
        self._param_placements = dict(plan.param_placements)
        self._once: dict = {}
        self.order = {n.name: i for i, n in enumerate(graph.gm.graph.nodes)}
        buffers = {f for f, i in graph.params.items() if i.is_buffer}
        self.constant = constant_like_nodes(graph.gm, buffers)
        self.stage_of_block = {k: s.index for s in plan.stages
                               for k in range(s.layer_start, s.layer_end)}
        self._parts()
        self._block_inputs()
        self._parts_of_params()

    def once(self, fn):
        """`fn(self)`, computed on the first call (what every pipeline rank reads)."""
        if fn not in self._once:
            self._once[fn] = fn(self)
        return self._once[fn]

    # -- parameters ------------------------------------------------------------------------
    def _parts_of_params(self) -> None:
        """Block k's parameters (block N - 1's stand for the deeper ones) and the parameters
        outside the blocks by the part of the nodes that read them: "pre", "post" (a node of
        a block counts as after)."""
        g = self.graph
        self.block_params: dict[int, list] = defaultdict(list)
        self.pre, self.post = [], []
        readers: dict[str, list[str]] = defaultdict(list)
        for n in g.gm.graph.nodes:
            if n.op == "get_attr":
                readers[str(n.target)] += [u.name for u in n.users]
        for fqn, info in g.params.items():
            if info.is_buffer:
                continue
            if info.layer_id is not None:
                self.block_params[info.layer_id].append(info)
                continue
            where = [name for a in (fqn, *info.aliases) for name in readers.get(a, [])]
            if not g.layer_nodes or any(name in self.pre_nodes for name in where):
                self.pre.append(info)
            if g.layer_nodes and any(name not in self.pre_nodes for name in where):
                self.post.append(info)

    def local_shape(self, info) -> list[int]:
        """Parameter `info`'s shape on tp rank 0 (torch.chunk: the first rank's share)."""
        shape = list(info.shape)
        placement = self.param_placement(info.fqn)
        if self.plan.mesh.tp > 1 and placement.startswith("S("):
            d = int(placement[2:-1]) % len(shape)
            shape[d] = math.ceil(shape[d] / self.plan.mesh.tp)
        return shape

    def numel(self, info, padded: bool) -> int:
        shape = self.local_shape(info)
        if not shape:
            return 1
        rows = math.ceil(shape[0] / self.D) * self.D if padded else shape[0]
        return rows * math.prod(shape[1:])

    def expert_slices(self) -> frozenset[str]:
        """FQNs of the expert weights a plan with ep > 1 holds as slices outside FSDP2
        (runtime/expert_parallel.py); none at ep 1."""
        if not hasattr(self, "_slices"):
            from autoplan.cost_model.expert_parallel import expert_weights

            self._slices = frozenset(expert_weights(self.graph) if self.plan.mesh.ep > 1
                                     else ())
        return self._slices

    def units(self, stage: int) -> list[list]:
        """The FSDP2 units of pipeline stage `stage` with parameters: each block's, then the
        stage root's (what the stage holds outside its blocks)."""
        st = self.plan.stages[stage]
        out = [self.block_params[min(k, self.N - 1)] for k in range(st.layer_start,
                                                                      st.layer_end)]
        return [u for u in out + [self.root_unit(stage)] if u]

    def root_unit(self, stage: int) -> list:
        """The parameters of pipeline stage `stage`'s root FSDP2 unit: what the stage holds
        outside its blocks (the first stage's embeddings, the last's final norm and head)."""
        last = len(self.plan.stages) - 1
        return (self.pre if stage == 0 else []) + [p for p in (self.post if stage == last
                                                                else [])
                                                   if stage != 0 or p not in self.pre]

    # -- placements --------------------------------------------------------------------------
    def param_placement(self, fqn: str) -> str:
        """`Plan.placement_of`, read from a dict once."""
        return self._param_placements.get(fqn, "R")

    def placement(self, name: str) -> str | None:
        """The tp placement the plan gives node `name`'s value (a parameter's by its FQN)."""
        if not hasattr(self, "_produced"):
            from autoplan.passes.sharding import value_placements

            self._produced = value_placements(self.plan)
        node = self.nodes[name]
        if node.op == "get_attr":
            return self.param_placement(str(node.target))
        return self._produced.get(name)

    def fused(self, name: str, where) -> bool:
        """Whether node `name`, where it runs at `where`, is in a pattern the runtime fuses
        into one kernel (passes/kernels.py `kernel_patterns`): with the kernels on, and no
        redistribution inserted for any of the pattern's nodes (a redistribution cuts it)."""
        if not self.kernels:
            return False
        if not hasattr(self, "_patterns"):
            from autoplan.passes.kernels import kernel_patterns

            self._patterns = {n.name: nodes for _, _, nodes in kernel_patterns(self.graph.gm)
                              for n in nodes}
            self._fused: dict[tuple, bool] = {}
        nodes = self._patterns.get(name)
        if nodes is None:
            return False
        key = (nodes[-1].name, where)
        if key not in self._fused:
            self._fused[key] = self._uncut(nodes, where)
        return self._fused[key]

    def _uncut(self, nodes, where) -> bool:
        from autoplan.passes.sharding import tensor_args

        for n in nodes:
            s = self.strategies.get(n.name)
            for a, q in zip(tensor_args(n), s.inputs if s is not None else ()):
                found = self.source(a, n.name, where)
                p = self.placement(found[0]) if found is not None else None
                if p is not None and p != q and not (p == "R" and q == "P"):
                    return False
        return True

    # -- values ------------------------------------------------------------------------------
    def value_bytes(self, node) -> float:
        """Bytes of `node`'s (first) value at the plan's microbatch, whole on tp: a parameter
        its compute-dtype copy; an activation in the compute dtype where the graph holds it in
        the dtype its parameters were captured in, else in its own (the model's upcasts)."""
        if node.op == "get_attr":
            info = self.params.get(str(node.target))
            return float(info.numel * self.e) if info is not None else 0.0
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            val = val[0] if val else None
        if not isinstance(val, torch.Tensor):
            return 0.0
        width = val.element_size()
        if val.dtype.is_floating_point and str(val.dtype).removeprefix("torch.") == \
                self.captured_dtype:
            width = self.e
        return val.numel() * width * self.scale_of(tuple(val.shape))

    def scale_of(self, shape: tuple[int, ...]) -> float:
        """How a value of captured `shape` scales to the plan's microbatch: by b / B where
        dim 0 is the captured batch B, by (seq_len / cp) / S where a later dim is the
        captured sequence S, by both where dim 0 is B x S tokens (a flattened (B S, H));
        a value of neither (GPT-2's position embedding (1, S, H)) only by what it has."""
        g, plan = self.graph, self.plan
        B, S = g.batch_size, g.seq_len or plan.seq_len
        batch, seq = plan.microbatch_size / B, plan.seq_len / plan.mesh.cp / S
        if not shape:
            return 1.0
        if shape[0] == B * S and S > 1:
            return batch * seq
        return (batch if shape[0] == B else 1.0) * (seq if S in shape[1:] else 1.0)

    # -- where nodes run ---------------------------------------------------------------------
    def _parts(self) -> None:
        """The nodes outside the blocks by the stage they run in (passes/stages.py
        `assign_stages`): "pre" (stage 0) for the graph inputs and the nodes a block depends
        on, "post" (the last stage) for the others."""
        self.pre_nodes: set[str] = set()
        for n in reversed(self.graph.gm.graph.nodes):
            if n.name in self.layer_of or n.name in self.pre_nodes:
                self.pre_nodes.update(a.name for a in n.all_input_nodes
                                      if a.name not in self.layer_of)
        self.pre_nodes.update(n.name for n in self.graph.gm.graph.nodes
                              if n.op == "placeholder")

    def part(self, name: str) -> str:
        return "pre" if name in self.pre_nodes else "post"

    def instances(self, name: str, stages: set[int] | None = None) -> list:
        """Where node `name` runs in the model of L blocks (on `stages` only, when given): the
        blocks it stands for (block k < N - 1 itself, block N - 1 every block from N - 1 on),
        or its part outside."""
        k = self.layer_of.get(name)
        if k is None:
            out = [self.part(name)]
        elif k < self.N - 1:
            out = [k]
        elif stages is None:
            out = list(range(self.N - 1, self.L))
        else:
            out = [j for s in sorted(stages) for j in range(
                max(self.plan.stages[s].layer_start, self.N - 1), self.plan.stages[s].layer_end)]
        return out if stages is None else [w for w in out if self.stage_of(w) in stages]

    def stage_of(self, where) -> int:
        if isinstance(where, int):
            return self.stage_of_block[where]
        return 0 if where == "pre" else len(self.plan.stages) - 1

    def _block_inputs(self) -> None:
        """What the blocks read from before them ([Note: traffic per axis], a shallow graph):
        `shared`, the values every captured block reads; `stream`, with one block captured,
        each value block 0 reads that a deeper block reads from the block before instead ->
        that block's value (the one block 0 hands on in its shape and dtype)."""
        readers: dict[str, set[int]] = defaultdict(set)
        for name, k in self.layer_of.items():
            for a in self.nodes[name].all_input_nodes:
                if a.name not in self.layer_of and a.op != "get_attr":
                    readers[a.name].add(k)
        self.stream: dict[str, str] = {}
        if self.N == 1 and self.L > 1:
            handed = [a for name in self.layer_of for a in [self.nodes[name]]
                      if any(u.name not in self.layer_of for u in a.users)]
            for u in readers:
                if u in self.constant:
                    continue
                want = _meta(self.nodes[u])
                w = next((a.name for a in handed if want is not None and _meta(a) == want),
                         None)
                if w is not None:
                    self.stream[u] = w
        self.shared = {u for u, ks in readers.items()
                       if len(ks) == self.N and u not in self.stream}

    def source(self, u, v: str, where) -> tuple[str, object] | None:
        """(the node whose value, and placement, edge u -> v carries where v runs at
        `where`, that value's instance: (name, block) or (name, part)), or None where the edge
        is not in the model at `where` (the stream's first edge past block 0)."""
        lu, lv = self.layer_of.get(u.name), self.layer_of.get(v)
        if u.op == "get_attr":
            info = self.params.get(str(u.target))
            block = info is not None and info.layer_id is not None and isinstance(where, int)
            return u.name, (where if block else self.stage_of(where))
        if lu is None:
            if lv is None or u.name in self.shared:
                return u.name, self.part(u.name)
            if u.name in self.stream and where > 0:
                return self.stream[u.name], where - 1
            return (u.name, self.part(u.name)) if where == lv else None
        if not isinstance(where, int):  # read outside the blocks: the last block's value
            return u.name, (lu if lu < self.N - 1 else self.L - 1)
        k = where - (lv - lu)
        names = self.graph.layer_nodes.get(min(k, self.N - 1), ())
        i = self.index_in_block.get(u.name, len(names))
        return (names[i] if i < len(names) else u.name), k

    def last_saving(self) -> dict[int, int]:
        """Captured block -> position of its last node that saves a tensor for the backward
        (activations.saved_tensors): a checkpointed block's recomputation ends there."""
        if not hasattr(self, "_last_saving"):
            from autoplan.cost_model.activations import node_producers, saved_tensors

            g = self.graph
            producers, grads = node_producers(g.gm), self.once(gradient_carriers)
            self._last_saving = {}
            for k, names in g.layer_nodes.items():
                infos = [g.nodes[n] for n in names if n in g.nodes]
                saved = saved_tensors(infos, producers=producers, grads=grads)
                self._last_saving[k] = max((self.order[s.consumer] for s in saved), default=-1)
        return self._last_saving

    def checkpointed(self, where) -> bool:
        """Whether what runs at `where` (a block, or a part outside) is checkpointed."""
        return self.plan.checkpointing in ("full", "selective") and isinstance(where, int)

    def recomputed(self, v: str, where) -> bool:
        """Whether node `v` of a block runs again in its block's recomputation."""
        if not self.checkpointed(where):
            return False
        return self.order[v] <= self.last_saving().get(self.layer_of[v], -1)


def _meta(node) -> tuple | None:
    """(shape, dtype) of `node`'s value, or None."""
    val = node.meta.get("val")
    return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None


def gradient_carriers(ctx: TrafficContext) -> frozenset[str]:
    """The graph's values a gradient flows through (activations.grad_carriers), for
    `ctx.once`."""
    from autoplan.cost_model.activations import grad_carriers

    return grad_carriers(ctx.graph.gm, ctx.graph.params)
