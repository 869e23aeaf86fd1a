"""The bytes each rank moves per mesh axis in one training step, counted as the dry run counts
them: every collective and point-to-point op the runtime issues, its largest buffer
(nccl-tests' "size": the gathered output of an all-gather, the input of a reduce-scatter, the
tensor of an all-reduce, send or recv), summed by mesh axis, and the ops counted by
"op@axis" in the recorder's spelling (autoplan/runtime/collective_log.py).

[Note: traffic per axis] What the runtime issues in one step on a rank of pipeline rank r
(autoplan/runtime/engine.py), m microbatches, D = dp x cp ranks sharing gradients (dp_shard),
e the compute dtype's bytes, f the reduce dtype's (fp32 under a 16-bit plan: FSDP2's
MixedPrecisionPolicy(reduce_dtype=float32), runtime/precision.py; else the compute dtype):

- dp (the dp axis, "dp_cp" under cp). One FSDP2 unit per block module and one per stage
  module for the rest (engine.py `_apply_data_parallel`); a unit's bytes are its parameters'
  local (after tp) elements, each dim 0 padded to a multiple of D as FSDP2 pads its shards
  (torch/distributed/fsdp/_fully_shard/_fsdp_param.py `padded_sharded_param_size`):
  ZeRO 0/1 (`replicate`): one `allreduce_` of the unit's trainable gradients (f, unpadded) per
  step -- the last microbatch's without pp (`set_requires_gradient_sync`, engine.py), the
  stage's REDUCE_GRAD with pp; ZeRO 2/3 (`fully_shard`): a `_reduce_scatter_base_` of the
  padded trainable gradients (f) per microbatch without pp, once per stage with pp (torch's
  deferred reduction, [Note: deferred reduction] in cost_model/rank_memory.py), and an
  `_allgather_base_` of the padded parameters (e) whenever a unit is used sharded
  (`_gathers`: ZeRO-2 gathers in the forward and keeps them to the end of the backward;
  ZeRO-3 reshards after each forward; without pp it reshards after each backward, with pp
  torch keeps them gathered after the first backward, `set_reshard_after_backward(False)`);
  ZeRO-1 adds, per step, one `_allgather_base_` per trainable parameter of its rows padded to
  dp x cp equal pieces (a `broadcast_` for one of fewer rows), in the master dtype
  (runtime/zero1.py `ShardedOptimizer.step`);
- pp: a `send` and a `recv_` of each tensor live across a stage boundary per microbatch and
  chunk, the activations forward and their gradients backward (torch.distributed.pipelining;
  passes/stages.py: what is produced before the cut -- graph inputs, the nodes before the
  blocks that a block depends on, the blocks before it -- and read after it), at the tensor
  a tp rank holds (a tp-th under sequence parallelism); the stage loss's `allreduce_` over pp
  (engine.py `_forward_backward`, 4 bytes) and, with clipping, the squared norm's
  (runtime/parallel.py `clip_grad_norm`, 8 bytes); a weight tied across pipeline ranks has
  its local gradient all-reduced over the ranks holding it (runtime/tied.py
  `sync_tied_grads`: "pp" when they are the whole pp axis, else "pp[k]");
- tp: every redistribution of the plan (passes/sharding.py inserts one before its consumer
  wherever the value's placement is not the one the consumer's strategy reads; consumers in
  one block, or in one part outside the blocks, share it) per microbatch forward, and its
  gradient's in the backward as DTensor runs it (`backward_redistribution` in comm.py).
  Gradients that arrive Partial follow DTensor (`_partial_gradients`):
  a split consumer hands a value it reads replicated a Partial gradient (Megatron's f,
  Shoeybi et al. 2019 section 3), and so does an op whose backward DTensor runs on a Partial
  gradient and replicated operands (views, sums, products, casts: an unfused norm's ops) when
  its own gradient is Partial; where all a value's gradients are Partial they add up first,
  and one reduction follows -- at a redistribution, its backward (S -> R's turns into a
  reduce-scatter); at a replicated parameter, FSDP2's, once per reduction of its unit (it
  brings the accumulated gradient to the parameter's placement, `_get_grad_inner_tensor` in
  torch/distributed/fsdp/_fully_shard/_fsdp_param.py: once per step under ZeRO 0/1 or pp,
  per microbatch under ZeRO 2/3 without pp; f bytes where microbatches were accumulated
  first, else e); anywhere else (a fused kernel, a matmul, softmax, where Partial meets
  another gradient) an all-reduce of the value per microbatch. An all-gathered activation
  that an op saves for its backward (activations.saved_tensors' rules; through views that keep it
  whole) is all-gathered again there ([Note: gathered inputs saved sharded] in
  passes/regather.py), unless its block is checkpointed or the op is fused into a kernel
  (which saves local tensors). A checkpointed block's recomputation reissues the block's
  forward collectives up to its last op that saves a tensor, not after it: torch's
  checkpoint stops recomputing once every saved tensor is back (torch.utils.checkpoint's
  early stop), so the reduce-scatter after a block's last matmul runs once. The RMSNorm and
  SwiGLU patterns run as one kernel where no redistribution cuts them (passes/kernels.py
  `kernel_patterns`, with the kernels on). With the kernels at tp > 1 and pp 1 the logits'
  all-gather before the token loss is not run: the vocab-parallel cross-entropy all-reduces
  (N,) and (2, N) fp32 statistics per microbatch instead (`allreduce_`, [Note:
  vocab-parallel loss] in passes/kernels.py);
- cp: per attention op and microbatch, an all-gather of K and of V as they reach the fused
  attention (the whole sequence; the rank's heads, a tp-th where the attention splits them;
  the h_kv heads before GQA's expansion where the rewrite takes them,
  passes/context_parallel.py `gathered_kv`)
  forward and a reduce-scatter of each gradient backward, and the gathers again in
  recomputation ([Note: context parallelism] in cost_model/context_parallel.py); axis "cp", or
  "dp_cp" at dp 1, where the recorder names the one group so;
- scalars: the step loss's `allreduce_` over dp x cp (4 bytes) when D > 1, and with clipping
  one `all_reduce` (4 bytes) per gradient per mesh axis it is sharded on (DTensor's
  `full_tensor` of a norm of a Shard gradient).

A shallow graph (N of L blocks captured, [Note: shallow planning capture]) is priced as the
runtime's graph of L blocks with the plan retargeted to it ([Note: plan retargeting] in
passes/expand.py): block k >= N - 1 is block N - 1's nodes, and the value it reads from
block k - 1 that block's counterpart (blocks align node by node); a value from before the
blocks that every captured block reads (rotary tables, a mask) is read by every block, one
that only the first reads is the residual stream entering block 0, which a deeper block
reads from the block before instead -- with one block captured, the values block 0 reads in
the shape and dtype of a value it hands to the nodes after the blocks (as solver/problem.py
`_edges` tells them apart). A value scales from the captured batch B and sequence S to the
plan's microbatch b and seq_len / cp tokens by the dims it has (`_Context.scale_of`: dim 0
of B, a later dim of S; GPT-2's position embedding (1, S, H) has no batch). A graph captured
in a wider floating dtype than the plan computes in has its floating values priced at e, as
the solver prices them; the model's own casts, which such a graph lacks, are not seen (the
golden llama3-405b graph, fp32: its last rank's final norm reads the gathered residual
itself, which its pow saves, so a re-gather is priced that the bf16 graph's cast avoids).

What is not priced here (and a dry run would show): a uneven split (the tp rank 0's share is
priced), the interleaved schedule's gather pattern under ZeRO-3 (priced as 1F1B per chunk),
DTensor's own redistributions inside an op's backward when the gradient reaches it in a
placement its forward's strategy did not give it (a plan that keeps the residual stream
Partial: llama-tiny of 4 blocks at dp2 x tp2 ZeRO-3 measured 2.6 times the tp bytes priced,
weight-gradient gathers and reduce-scatters in the matmuls' backward), and fp32 plans at
dp x cp 1 whose replicated parameters get Partial gradients (no FSDP2 unit reduces them:
priced once per step, e bytes, not measured).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from autoplan.cost_model.comm import backward_redistribution
from autoplan.cost_model.context_parallel import attention_nodes
from autoplan.graph import CapturedGraph
from autoplan.plan import Plan

__all__ = ["RankTraffic", "rank_traffic"]

# collective name (Redistribution.collective / redistribute_time_s) -> the functional op
# DTensor dispatches, as the recorder names it
# (S(i) -> S(j): DTensor of torch 2.13 all-gathers the whole tensor and keeps its chunk, as
# the dry run records it)
_FUNCTIONAL = {"all_gather": "all_gather_into_tensor", "all_reduce": "all_reduce",
               "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_gather_into_tensor"}
# aten base names (op_classes.op_name) of ops whose backward DTensor runs on a Partial gradient
# and replicated operands, keeping it Partial: linear in the gradient, spelled in views,
# expansions and products (derivatives.yaml: pow's and rsqrt's are products with the saved
# value, mean's an expansion): an unfused norm's ops
_PARTIAL_THROUGH = frozenset({
    "view", "_unsafe_view", "reshape", "alias", "t", "transpose", "permute", "expand",
    "unsqueeze", "squeeze", "clone", "contiguous", "slice", "select", "add", "sub", "neg",
    "mul", "div", "mean", "sum", "to", "_to_copy", "type_as", "pow", "rsqrt"})
# views that keep a tensor whole and contiguous: a saved one is re-gathered
# (passes/regather.py `_tag_of`)
_WHOLE_VIEWS = ("view", "_unsafe_view", "reshape", "alias", "unsqueeze", "squeeze")


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


def rank_traffic(plan: Plan, graph: CapturedGraph, *, clip: bool = True,
                 kernels: bool = True) -> list[RankTraffic]:
    """Per pipeline rank, the bytes and ops by mesh axis of one training step of `plan`
    ([Note: traffic per axis]), for the rank at dp, cp and tp coordinate 0.

    Args:
        plan: the plan; its strategies and redistributions name `graph`'s nodes.
        graph: the graph the plan was made on (a shallow capture of N blocks: block k >= N is
            block N - 1's, [Note: plan retargeting]), or the runtime's graph with the plan
            retargeted to it; both price the same. Values are scaled to the plan's microbatch
            (b seq_len / cp tokens).
        clip: the runtime clips the gradient norm (`max_grad_norm` set: its scalar
            all-reduces).
        kernels: the runtime runs its fused kernels (`DistributedModel(kernels=)`): the
            vocab-parallel loss at tp > 1 and pp 1.

    Returns one RankTraffic per pipeline rank, bytes per step.
    """
    ctx = _Context(plan, graph, kernels)
    out = []
    for r in range(plan.mesh.pp):
        t = RankTraffic()
        stages = [s for s in range(len(plan.stages)) if s % plan.mesh.pp == r]
        _data_parallel(ctx, t, r, stages)
        _pipeline(ctx, t, r, stages, clip)
        _tensor_parallel(ctx, t, set(stages))
        _context_parallel(ctx, t, set(stages))
        _scalars(ctx, t, stages, clip)
        out.append(t)
    return out


class _Context:
    """What the rules read of the plan and graph: parameters per unit, where each node of the
    graph runs in the model of `graph.total_layers` blocks, the bytes of values."""

    def __init__(self, plan: Plan, graph: CapturedGraph, kernels: bool = True):
        from autoplan.passes.stages import constant_like_nodes

        self.plan, self.graph, self.kernels = plan, graph, kernels
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

    def units(self, stage: int) -> list[list]:
        """The FSDP2 units of pipeline stage `stage` with parameters: each block's, then the
        stage root's (what the stage holds outside its blocks)."""
        st, last = self.plan.stages[stage], len(self.plan.stages) - 1
        out = [self.block_params[min(k, self.N - 1)] for k in range(st.layer_start,
                                                                      st.layer_end)]
        root = (self.pre if stage == 0 else []) + [p for p in (self.post if stage == last
                                                                else [])
                                                   if stage != 0 or p not in self.pre]
        return [u for u in out + [root] if u]

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
            producers, grads = node_producers(g.gm), self.once(_grad_carriers)
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


def _data_parallel(ctx: _Context, t: RankTraffic, r: int, stages: list[int]) -> None:
    plan, D = ctx.plan, ctx.D
    if D == 1:
        return
    axis, zero, pp = ctx.dp_axis, plan.zero_stage, plan.mesh.pp
    for s in stages:
        for unit in ctx.units(s):
            trainable = [p for p in unit if p.trainable]
            if zero <= 1:
                if trainable:
                    t.add("allreduce_", axis, ctx.f * sum(ctx.numel(p, False)
                                                          for p in trainable))
                continue
            if trainable:
                t.add("_reduce_scatter_base_", axis,
                      ctx.f * sum(ctx.numel(p, True) for p in trainable),
                      1 if pp > 1 else ctx.m)
            t.add("_allgather_base_", axis, ctx.e * sum(ctx.numel(p, True) for p in unit),
                  _gathers(plan, s))
    if zero == 1:
        _sharded_optimizer(ctx, t, stages)


def _gathers(plan: Plan, stage: int) -> int:
    """FSDP2 all-gathers of one unit of `stage` per step ([Note: traffic per axis]): a state
    machine over the stage's forward and backward actions in the schedule's order."""
    m, pp = plan.num_microbatches, plan.mesh.pp
    if pp == 1:
        return m * (2 if plan.zero_stage == 3 else 1)
    r = stage % pp
    if plan.schedule == "gpipe":
        order = ["F"] * m + ["B"] * m
    else:  # torch's Schedule1F1B: pp - r warm-up forwards, then B, F pairs, then the Bs
        warm = min(m, pp - r)
        order = ["F"] * warm
        for _ in range(m - warm):
            order += ["B", "F"]
        order += ["B"] * warm
    gathered, count = False, 0
    for action in order:
        if not gathered:
            count += 1
            gathered = True
        if action == "F" and plan.zero_stage == 3:
            gathered = False  # reshard_after_forward
    return count


def _sharded_optimizer(ctx: _Context, t: RankTraffic, stages: list[int]) -> None:
    """ZeRO-1's gather of the updated parameters (runtime/zero1.py ShardedOptimizer.step,
    [Note: ZeRO-1 partition]): per trainable parameter of at least D rows one
    `_allgather_base_` of its rows padded to D equal pieces (ceil(rows / D) each), per smaller
    one a `broadcast_` of it whole from its owner; fp32 masters under mixed precision."""
    master = 4 if ctx.mixed else ctx.e
    for s in stages:
        for unit in ctx.units(s):
            for p in unit:
                if not p.trainable:
                    continue
                shape = ctx.local_shape(p)
                rows = shape[0] if shape else 1
                if rows >= ctx.D:
                    t.add("_allgather_base_", ctx.dp_axis, ctx.numel(p, True) * master)
                else:
                    t.add("broadcast_", ctx.dp_axis, ctx.numel(p, False) * master)


def _pipeline(ctx: _Context, t: RankTraffic, r: int, stages: list[int], clip: bool) -> None:
    plan = ctx.plan
    pp = plan.mesh.pp
    if pp == 1:
        return
    boundary = ctx.once(_boundary_bytes)
    last = len(plan.stages) - 1
    for s in stages:
        for nbytes in boundary:
            sides = (s > 0) + (s < last)
            t.add("send", "pp", nbytes, sides * ctx.m)
            t.add("recv_", "pp", nbytes, sides * ctx.m)
    t.add("allreduce_", "pp", 4)  # the stage losses' mean
    if clip:
        t.add("allreduce_", "pp", 8)  # the squared norm, float64
    # tied weights across pipeline ranks: the pre and post copies
    tied = [p for p in ctx.pre if p in ctx.post]
    holders = {0 % pp, last % pp}
    if tied and len(holders) > 1 and r in holders:
        axis = "pp" if pp == 2 else f"pp[{len(holders)}]"
        for p in tied:
            if not p.trainable:
                continue
            n = ctx.numel(p, True) // ctx.D if plan.zero_stage >= 2 and ctx.D > 1 \
                else ctx.numel(p, False)
            t.add("allreduce_", axis, n * 4 if ctx.mixed else n * ctx.e)


def _boundary_bytes(ctx: _Context) -> list[float]:
    """The tensors a tp rank sends across an interior stage boundary, bytes each: the values
    live across the cut after block 0 (passes/stages.py `split_stages`): produced before it
    (a graph input, a node before the blocks that a block depends on, block 0's), read after
    it (by a later block, the nodes after the blocks, or -- one block captured -- by every
    block, `shared`); constant-like values are recomputed by every stage; at their local size
    under tp."""
    out = []
    for n in ctx.graph.gm.graph.nodes:
        if n.op not in ("placeholder", "call_function") or n.name in ctx.constant:
            continue
        k = ctx.layer_of.get(n.name)
        if (k is None and n.name not in ctx.pre_nodes) or (k is not None and k > 0):
            continue
        after = any(ctx.layer_of.get(u.name, 0) >= 1 or
                    (u.name not in ctx.layer_of and u.name not in ctx.pre_nodes)
                    for u in n.users)
        if after or (ctx.N == 1 and n.name in ctx.shared):
            nbytes = ctx.value_bytes(n)
            if ctx.plan.mesh.tp > 1 and (ctx.placement(n.name) or "R").startswith("S("):
                nbytes /= ctx.plan.mesh.tp
            out.append(nbytes)
    return out


def _tensor_parallel(ctx: _Context, t: RankTraffic, stages: set[int]) -> None:
    """tp's traffic where the consumers run on `stages` ([Note: traffic per axis]), each op
    counted where it runs in the model of L blocks."""
    plan, tp = ctx.plan, ctx.plan.mesh.tp
    if tp == 1:
        return
    forward, backward, params = _redistributions(ctx, stages)
    for kind, nbytes, times, again in forward.values():
        t.add(_FUNCTIONAL[kind], "tp", nbytes, (times + again) * ctx.m)
    for p, q, nbytes, partial in backward.values():
        kind = _collective(*backward_redistribution(p, q, grad_placement="P" if partial
                                                    else None), tp)
        if kind in _FUNCTIONAL:
            t.add(_FUNCTIONAL[kind], "tp", nbytes, ctx.m)
    for name in ctx.once(_partial_gradients)[1]:  # all-reduced where the gradient is
        t.add("all_reduce", "tp", ctx.value_bytes(ctx.nodes[name]),
              ctx.m * len(ctx.instances(name, stages)))
    reductions, width = _param_reductions(ctx)
    for numel in params.values():
        t.add("all_reduce", "tp", numel * width, reductions)
    if ctx.once(_vocab_parallel_logits) is not None:
        # (N,) row maxima, then (2, N) sums, fp32 (fp64 for fp64 logits)
        rows = plan.microbatch_size * plan.seq_len / plan.mesh.cp
        stat = 8 if ctx.e == 8 else 4
        t.add("allreduce_", "tp", rows * stat, ctx.m)
        t.add("allreduce_", "tp", 2 * rows * stat, ctx.m)


def _redistributions(ctx: _Context, stages: set[int]) -> tuple[dict, dict, dict]:
    """The redistributions whose consumers run on `stages`: (forward: per (value, dst,
    where) [kind, bytes, runs per microbatch (again in recomputation), re-gathered in the
    backward], backward: per redistribution [src, dst, bytes, its gradient Partial],
    parameters whose Partial gradient FSDP2 reduces: (parameter, instance) -> local
    elements)."""
    from autoplan.passes.sharding import tensor_args

    tp = ctx.plan.mesh.tp
    logits = ctx.once(_vocab_parallel_logits)
    regathered, no_grad = ctx.once(_regathered), ctx.once(_no_gradient)
    gives, _, partial_params = ctx.once(_partial_gradients)
    forward: dict[tuple, list] = {}  # per (value, dst, where): [kind, bytes, times, again]
    backward: dict[tuple, list] = {}  # a redistribution's: [src, dst, bytes, Partial grad]
    params: dict[tuple, int] = {}  # a parameter's Partial gradient, reduced by FSDP2
    for v in ctx.graph.gm.graph.nodes:
        s = ctx.strategies.get(v.name)
        if v.op == "output":
            wanted, split = ["R"] * len(tensor_args(v)), False
        elif s is not None:
            wanted, split = list(s.inputs), any(o != "R" for o in s.outputs)
        else:
            continue
        for u, q in zip(tensor_args(v), wanted):
            if v.op == "output" and u.name == logits:
                continue  # the vocab-parallel loss reads the logits' shards
            for where in ctx.instances(v.name, stages):
                found = ctx.source(u, v.name, where)
                if found is None:
                    continue
                name, inst = found
                p = ctx.placement(name)
                if p is None or "," in p:  # a multi-output node: its getitems carry the values
                    continue
                nbytes = ctx.value_bytes(ctx.nodes[name])
                kind = _collective(p, q, tp)
                if kind in _FUNCTIONAL:
                    # consumers of one gathered value share it: issued before the first,
                    # re-gathered in the backward when one holds it (not checkpointed)
                    entry = forward.setdefault((name, inst, q, where), [
                        kind, nbytes, 1 + ctx.recomputed(v.name, where), False])
                    entry[3] |= kind == "all_gather" and (u.name, v.name) in regathered and \
                        not ctx.checkpointed(where) and not ctx.fused(v.name, where)
                if q == "P" or u.name in no_grad or name in no_grad:
                    continue
                if p != q:
                    entry = backward.setdefault((name, inst, q, where), [p, q, nbytes, False])
                    entry[3] |= (u.name, v.name) in gives
                elif u.name in partial_params:
                    params[(name, inst)] = ctx.numel(ctx.params[str(u.target)], False)
    return forward, backward, params


def _partial_gradients(ctx: _Context) -> tuple[set, set, set]:
    """Where the tp gradients that arrive Partial are reduced, as DTensor runs the backward
    ([Note: traffic per axis]): a split consumer hands a value it reads replicated a Partial
    gradient (Megatron's f); so does an op DTensor runs backward on a Partial gradient and
    replicated operands (`_PARTIAL_THROUGH`, all-R, not fused into a kernel) whose own
    gradient is Partial. Where every gradient a value gets is Partial they add up Partial,
    and the value's is Partial: a parameter's is reduced by FSDP2, an op of
    `_PARTIAL_THROUGH` hands it on, any other op's value is all-reduced; where Partial and
    other gradients meet, the value's is all-reduced. A Partial gradient reaching a
    redistribution takes its backward (S -> R's becomes a reduce-scatter). Returns
    ({(value, consumer) handing it a Partial gradient}, {values all-reduced}, {parameters
    with a Partial gradient}), by the graph's node names."""
    from autoplan.op_classes import op_name
    from autoplan.passes.sharding import tensor_args

    no_grad = ctx.once(_no_gradient)
    logits = ctx.once(_vocab_parallel_logits)
    partial: set[str] = set()  # values whose gradient is Partial, handed on to their inputs
    gives: set[tuple[str, str]] = set()
    reduced: set[str] = set()
    params: set[str] = set()

    def through(w) -> bool:
        s = ctx.strategies.get(w.name)
        return (w.op == "call_function" and s is not None and
                op_name(str(w.target)) in _PARTIAL_THROUGH and
                all(x == "R" for x in (*s.inputs, *s.outputs)) and
                not ctx.fused(w.name, ctx.instances(w.name)[-1]))  # as the deepest block

    for x in reversed(ctx.graph.gm.graph.nodes):
        p = ctx.placement(x.name) if x.op in ("get_attr", "call_function") else None
        if p is None or "," in p or x.name in no_grad:
            continue
        handed = []
        for w in x.users:
            s = ctx.strategies.get(w.name)
            if w.op == "output":
                if x.name == logits:
                    continue
                wanted, split = ["R"] * len(tensor_args(w)), False
            elif s is None or w.name in no_grad:
                handed.append(False)
                continue
            else:
                wanted, split = list(s.inputs), any(o != "R" for o in s.outputs)
            for a, q in zip(tensor_args(w), wanted):
                if a is not x:
                    continue
                hands = q == "R" and (split or (w.name in partial and through(w)))
                if hands:
                    gives.add((x.name, w.name))
                handed.append(hands and p == q)  # else a redistribution's backward took it
        if not any(handed):
            continue
        if not all(handed):  # Partial meets other gradients
            reduced.add(x.name)
        elif x.op == "get_attr":
            params.add(x.name)
        elif through(x):
            partial.add(x.name)
        else:
            reduced.add(x.name)
    return gives, reduced, params


def _param_reductions(ctx: _Context) -> tuple[int, int]:
    """(how many times per step FSDP2 reduces a unit's gradients, the bytes of an element of
    the gradient it reads then): once per step under ZeRO 0/1 or pp, reading the gradient
    accumulated in f when microbatches were accumulated first; else per microbatch, in e."""
    plan = ctx.plan
    if plan.zero_stage <= 1 or plan.mesh.pp > 1:
        accumulated = plan.mesh.pp > 1 or ctx.m > 1
        return 1, (ctx.f if accumulated else ctx.e)
    return ctx.m, ctx.e


def _vocab_parallel_logits(ctx: _Context) -> str | None:
    """The logits node the runtime's vocab-parallel loss reads as tp shards (passes/kernels.py
    `keep_logits_sharded`: the fused kernels, tp > 1, pp 1, the token loss of a model that
    returns no loss of its own, logits Shard of their last dim), or None."""
    from autoplan.passes.sharding import tensor_args

    plan, g = ctx.plan, ctx.graph
    if not ctx.kernels or plan.mesh.tp == 1 or plan.mesh.pp > 1 or "loss" in g.output_names:
        return None
    out = next(n for n in g.gm.graph.nodes if n.op == "output")
    args = tensor_args(out)
    if g.main_output_index >= len(args):
        return None
    logits = args[g.main_output_index]
    val = logits.meta.get("val")
    if not isinstance(val, torch.Tensor) or \
            ctx.placement(logits.name) not in (f"S({val.ndim - 1})", "S(-1)"):
        return None
    return logits.name


def _no_gradient(ctx: _Context) -> set[str]:
    """Values autograd gives no gradient (activations.grad_carriers: none descends from a trainable
    parameter -- graph inputs, buffers, frozen weights, masks, rotary tables -- or they are
    not floating)."""
    from autoplan.cost_model.activations import PARAM_PREFIX

    carriers = ctx.once(_grad_carriers)
    out = set()
    for n in ctx.graph.gm.graph.nodes:
        val = n.meta.get("val")
        name = PARAM_PREFIX + str(n.target) if n.op == "get_attr" else n.name
        if name not in carriers or \
                (isinstance(val, torch.Tensor) and not val.dtype.is_floating_point):
            out.add(n.name)
    return out


def _grad_carriers(ctx: _Context) -> frozenset[str]:
    from autoplan.cost_model.activations import grad_carriers

    return grad_carriers(ctx.graph.gm, ctx.graph.params)


def _collective(src: str, dst: str, tp: int) -> str:
    """The collective DTensor runs to turn `src` into `dst` on the tp axis (comm.py
    `redistribute_time_s`'s table): "all_gather", "all_reduce", "reduce_scatter",
    "all_to_all", or "none" (nothing moves: the same placement, a slice, to Partial)."""
    if src == dst or tp == 1 or dst == "P" or src == "R":
        return "none"
    if src == "P":
        return "all_reduce" if dst == "R" else "reduce_scatter"
    return "all_gather" if dst == "R" else "all_to_all"


def _regathered(ctx: _Context) -> set[tuple[str, str]]:
    """(value, consumer) pairs where the consumer holds the value's tp all-gather for its
    backward (activations.saved_tensors' rules; directly, or through views that keep it whole and
    contiguous, as linear's flatten): [Note: gathered inputs saved sharded] in
    passes/regather.py re-gathers it there. An op fused into a kernel saves local tensors,
    which are not re-gathered."""
    from autoplan.cost_model.activations import node_producers, saved_tensors

    g = ctx.graph
    infos = [g.nodes[n.name] for n in g.gm.graph.nodes if n.name in g.nodes]
    saved = {(s.consumer, s.owner) for s in saved_tensors(
        infos, producers=node_producers(g.gm), grads=ctx.once(_grad_carriers))}

    def holds(value, consumer) -> bool:
        if (consumer.name, value.name) in saved:
            return True
        name = str(consumer.target).split(".")[-2] if "." in str(consumer.target) else ""
        return name in _WHOLE_VIEWS and consumer.args and consumer.args[0] is value and \
            any(holds(consumer, w) for w in consumer.users)

    return {(u.name, v.name) for v in g.gm.graph.nodes for u in v.all_input_nodes
            if v.op == "call_function" and holds(u, v)}


def _context_parallel(ctx: _Context, t: RankTraffic, stages: set[int]) -> None:
    """cp's gathers of K and V and reduce-scatters of their gradients ([Note: traffic per
    axis]): K and V as the attention reads them, the whole sequence, a tp-th where the
    attention splits them."""
    from autoplan.passes.context_parallel import gathered_kv

    plan = ctx.plan
    cp, tp = plan.mesh.cp, plan.mesh.tp
    if cp == 1:
        return
    for name in attention_nodes(ctx.graph):
        node, s = ctx.nodes[name], ctx.strategies.get(name)
        given = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal",
                          "scale", "enable_gqa"), node.args)) | dict(node.kwargs)
        kv = gathered_kv(given["key"], given["value"], bool(given.get("enable_gqa", False)), tp)
        for where in ctx.instances(name, stages):
            for i in (1, 2):  # K, V, at the attention's placement (the query's)
                split = tp > 1 and s is not None and s.inputs[i].startswith("S(")
                one = ctx.value_bytes(kv[i - 1]) * cp / (tp if split else 1)
                t.add("all_gather_into_tensor", ctx.cp_axis, one,
                      ctx.m * (1 + ctx.recomputed(name, where)))
                t.add("reduce_scatter_tensor", ctx.cp_axis, one, ctx.m)


def _meta(node) -> tuple | None:
    """(shape, dtype) of `node`'s value, or None."""
    val = node.meta.get("val")
    return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None


def _scalars(ctx: _Context, t: RankTraffic, stages: list[int], clip: bool) -> None:
    plan = ctx.plan
    if ctx.D > 1:
        t.add("allreduce_", ctx.dp_axis, 4)  # the step's loss
    if not clip:
        return
    last = len(plan.stages) - 1
    for s in stages:
        for unit in ctx.units(s):
            for p in unit:
                if not p.trainable:
                    continue
                if s == last and s != 0 and p in ctx.pre:
                    continue  # a tied weight's norm counts in its first stage only
                if plan.zero_stage >= 2 and ctx.D > 1:
                    t.add("all_reduce", ctx.dp_axis, 4)
                if plan.mesh.tp > 1 and ctx.param_placement(p.fqn).startswith("S("):
                    t.add("all_reduce", "tp", 4)
