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
  deferred reduction, [Note: deferred reduction] in solver/pipeline.py), and an
  `_allgather_base_` of the padded parameters (e) whenever a unit is used sharded
  (`_gathers`: ZeRO-2 gathers in the forward and keeps them to the end of the backward;
  ZeRO-3 reshards after each forward; without pp it reshards after each backward, with pp
  torch keeps them gathered after the first backward, `set_reshard_after_backward(False)`);
  ZeRO-1 adds, per step, one `_allgather_base_` per trainable parameter of its rows padded to
  dp x cp equal pieces (a `broadcast_` for one of fewer rows), in the master dtype
  (runtime/zero1.py `ShardedOptimizer.step`);
- pp: a `send` and a `recv_` of each stage-boundary tensor per microbatch and chunk, the
  activations forward and their gradients backward (torch.distributed.pipelining), at the
  tensor a tp rank holds (a tp-th under sequence parallelism); the stage loss's `allreduce_`
  over pp (engine.py `_forward_backward`, 4 bytes) and, with clipping, the squared norm's
  (runtime/parallel.py `clip_grad_norm`, 8 bytes); a weight tied across pipeline ranks has
  its local gradient all-reduced over the ranks holding it (runtime/tied.py
  `sync_tied_grads`: "pp" when they are the whole pp axis, else "pp[k]");
- tp: every redistribution of the plan (`Plan.redistributions`, passes/sharding.py inserts
  each) per microbatch forward, and its gradient's in the backward as DTensor runs it
  (`backward_redistribution` in comm.py, with a partial gradient where the consumer splits
  its work: Megatron's f, Shoeybi et al. 2019 section 3); a value read replicated by a split
  consumer has its gradient all-reduced once (the consumers' partial sums add up first); an
  all-gathered activation saved by a matmul is all-gathered again in the backward ([Note:
  gathered inputs saved sharded] in passes/regather.py) unless its block is checkpointed,
  whose recomputation reissues the block's forward collectives instead;
- cp: per attention op and microbatch, an all-gather of K and of V (whole sequence, the
  rank's heads) forward and a reduce-scatter of each gradient backward, and the gathers again
  in recomputation ([Note: context parallelism] in solver/context.py);
- scalars: the step loss's `allreduce_` over dp x cp (4 bytes) when D > 1, and with clipping
  one `all_reduce` (4 bytes) per gradient per mesh axis it is sharded on (DTensor's
  `full_tensor` of a norm of a Shard gradient).

What is not priced here (and a dry run would show): a uneven split (the tp rank 0's share is
priced), the vocab-parallel loss's own all-reduces (tp > 1 without pp, the fused kernel), the
interleaved schedule's gather pattern under ZeRO-3 (priced as 1F1B per chunk).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from autoplan.cost_model.comm import backward_redistribution
from autoplan.cost_model.context import attention_nodes, kv_bytes
from autoplan.graph import CapturedGraph
from autoplan.plan import Plan

__all__ = ["RankTraffic", "rank_traffic"]

# collective name (Redistribution.collective / redistribute_time_s) -> the functional op
# DTensor dispatches, as the recorder names it
# (S(i) -> S(j): DTensor of torch 2.13 all-gathers the whole tensor and keeps its chunk, as
# the dry run records it)
_FUNCTIONAL = {"all_gather": "all_gather_into_tensor", "all_reduce": "all_reduce",
               "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_gather_into_tensor"}
_MATMULS = ("mm", "addmm", "bmm", "matmul", "linear", "baddbmm")
_VIEWS = ("view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand",
          "unsqueeze", "squeeze", "alias", "clone", "contiguous")


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


def rank_traffic(plan: Plan, graph: CapturedGraph, *,
                 clip: bool = True) -> list[RankTraffic]:
    """Per pipeline rank, the bytes and ops by mesh axis of one training step of `plan`
    ([Note: traffic per axis]), for the rank at dp, cp and tp coordinate 0.

    Args:
        plan: the plan; its strategies and redistributions name `graph`'s nodes.
        graph: the graph the plan was made on (a shallow capture of N blocks: block k >= N is
            block N - 1's, [Note: plan retargeting]), or the runtime's graph with the plan
            retargeted to it; values are scaled to the plan's microbatch (b seq_len / cp
            tokens).
        clip: the runtime clips the gradient norm (`max_grad_norm` set: its scalar
            all-reduces).

    Returns one RankTraffic per pipeline rank, bytes per step.
    """
    ctx = _Context(plan, graph)
    out = []
    for r in range(plan.mesh.pp):
        t = RankTraffic()
        stages = [s for s in range(len(plan.stages)) if s % plan.mesh.pp == r]
        _data_parallel(ctx, t, r, stages)
        _pipeline(ctx, t, r, stages, clip)
        _tensor_parallel(ctx, t, stages)
        _context_parallel(ctx, t, stages)
        _scalars(ctx, t, stages, clip)
        out.append(t)
    return out


class _Context:
    """What the rules read of the plan and graph: parameters per unit, parts of nodes."""

    def __init__(self, plan: Plan, graph: CapturedGraph):
        self.plan, self.graph = plan, graph
        mesh = plan.mesh
        self.D = mesh.dp * mesh.cp
        self.dp_axis = "dp" if mesh.cp == 1 else "dp_cp"
        self.e = torch.empty((), dtype=getattr(torch, plan.dtype)).element_size()
        self.mixed = self.e < 4
        self.f = 4 if self.mixed else self.e  # FSDP2's reduce dtype
        self.m = plan.num_microbatches
        self.N = max(graph.num_layers, 1)
        self.scale = (plan.microbatch_size * plan.seq_len / mesh.cp) / (
            graph.batch_size * (graph.seq_len or plan.seq_len))
        self.nodes = {n.name: n for n in graph.gm.graph.nodes}
        self.layer_of = {name: k for k, names in graph.layer_nodes.items() for name in names}
        self.strategies = {s.node: s for s in plan.strategies}
        self.first_layer_pos, self.order = None, {}
        for i, n in enumerate(graph.gm.graph.nodes):
            self.order[n.name] = i
            if n.name in self.layer_of and self.first_layer_pos is None:
                self.first_layer_pos = i
        self._parts_of_params()

    # -- parameters ------------------------------------------------------------------------
    def _parts_of_params(self) -> None:
        """Block k's parameters (block N - 1's stand for the deeper ones) and the parameters
        outside the blocks by where they are read: "pre" (before the first block), "post"."""
        g = self.graph
        self.block_params: dict[int, list] = defaultdict(list)
        self.pre, self.post = [], []
        readers: dict[str, list[int]] = defaultdict(list)
        for n in g.gm.graph.nodes:
            if n.op == "get_attr":
                readers[str(n.target)] += [self.order[u.name] for u in n.users]
        for fqn, info in g.params.items():
            if info.is_buffer:
                continue
            if info.layer_id is not None:
                self.block_params[info.layer_id].append(info)
                continue
            where = [pos for name in (fqn, *info.aliases) for pos in readers.get(name, [])]
            first = self.first_layer_pos
            if first is None or any(p < first for p in where):
                self.pre.append(info)
            if first is not None and any(p > first for p in where):
                self.post.append(info)

    def local_shape(self, info) -> list[int]:
        """Parameter `info`'s shape on tp rank 0 (torch.chunk: the first rank's share)."""
        shape = list(info.shape)
        placement = self.plan.placement_of(info.fqn)
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

    # -- nodes -------------------------------------------------------------------------------
    def stage_of_node(self, name: str) -> int | None:
        """The pipeline stage running node `name` of the graph (block k -> its stage; before
        the blocks -> 0; after -> the last), the layer of a deep block by its stand-in."""
        last = len(self.plan.stages) - 1
        if name in self.layer_of:
            k = self.layer_of[name]
            return next(s.index for s in self.plan.stages if s.layer_start <= k < s.layer_end)
        pos = self.order.get(name)
        if pos is None:
            return last
        return 0 if self.first_layer_pos is None or pos < self.first_layer_pos else last

    def times_on(self, name: str, stages: list[int]) -> int:
        """How many nodes of the runtime graph node `name` stands for on `stages`: its own
        stage's one, or, for the last captured block of a shallow capture, every deeper
        block on them."""
        k = self.layer_of.get(name)
        if k is None or k < self.N - 1 or self.graph.total_layers <= self.N:
            return int(self.stage_of_node(name) in stages)
        deep = range(self.N - 1, self.graph.total_layers)
        return sum(1 for j in deep for s in stages
                   if self.plan.stages[s].layer_start <= j < self.plan.stages[s].layer_end)

    def value_bytes(self, node, index: int | None = None) -> float:
        if node.op == "get_attr":  # a parameter: its compute-dtype copy, whole on tp
            info = self.graph.params.get(str(node.target))
            return float(info.numel * self.e) if info is not None else 0.0
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            val = val[index or 0]
        if not isinstance(val, torch.Tensor):
            return 0.0
        nbytes = val.numel() * val.element_size()
        return nbytes if node.op == "get_attr" else nbytes * self.scale


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
    boundary = _boundary_bytes(ctx)
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
    produced up to block 0 that a later block reads (constant-like values are recomputed by
    every stage: passes/pipeline.py), at their local size under tp."""
    from autoplan.passes.pipeline import constant_like_nodes
    from autoplan.passes.sharding import value_placements

    g = ctx.graph
    buffers = {f for f, i in g.params.items() if i.is_buffer}
    constant = constant_like_nodes(g.gm, buffers)
    produced = value_placements(ctx.plan)
    before = {n.name for n in g.gm.graph.nodes if n.op == "call_function"
              and ctx.layer_of.get(n.name, 0) == 0 and n.name not in constant
              and (n.name in ctx.layer_of or ctx.order[n.name] < (ctx.first_layer_pos or 0))}
    out = []
    for n in g.gm.graph.nodes:
        if n.name not in before:
            continue
        if any(ctx.layer_of.get(u.name, -1) >= 1 for u in n.users):
            nbytes = ctx.value_bytes(n)
            if ctx.plan.mesh.tp > 1 and produced.get(n.name, "R").startswith("S("):
                nbytes /= ctx.plan.mesh.tp
            out.append(nbytes)
    return out


def _tensor_parallel(ctx: _Context, t: RankTraffic, stages: list[int]) -> None:
    plan, tp = ctx.plan, ctx.plan.mesh.tp
    if tp == 1:
        return
    from autoplan.passes.sharding import tensor_args, value_placements

    produced = value_placements(plan)
    recompute = plan.checkpointing in ("full", "selective")
    groups: dict[tuple, set] = defaultdict(set)  # (value, index) -> {(p, q, split)}
    for v in ctx.graph.gm.graph.nodes:
        s = ctx.strategies.get(v.name)
        if v.op == "output":
            wanted, split = ["R"] * len(tensor_args(v)), False
        elif s is not None:
            wanted, split = list(s.inputs), any(o != "R" for o in s.outputs)
        else:
            continue
        for u, q in zip(tensor_args(v), wanted):
            p = ctx.plan.placement_of(str(u.target)) if u.op == "get_attr" \
                else produced.get(u.name)
            if p is None or "," in p:  # a multi-output node: its getitems carry the values
                continue
            groups[(u.name, v.name if v.op != "output" else "output")].add((p, q, split))
    seen_fwd: set = set()
    saved = _regathered(ctx)
    for (u, consumer), keys in groups.items():
        node = ctx.nodes[u]
        times = ctx.times_on(consumer if consumer != "output" else u, stages)
        if not times:
            continue
        nbytes = ctx.value_bytes(node)
        block = consumer in ctx.layer_of
        for p, q, split in keys:
            if (u, q) not in seen_fwd:
                seen_fwd.add((u, q))
                kind = _collective(p, q, tp)
                if kind in _FUNCTIONAL:
                    size = nbytes
                    again = 1 + (recompute and block)
                    regather = kind == "all_gather" and u in saved and not (recompute and block)
                    t.add(_FUNCTIONAL[kind], "tp", size, times * ctx.m * (again + regather))
    # backward: per value, one collective per (p, q, split) its consumers' gradients take
    back: dict[tuple, int] = {}
    no_grad = _no_gradient(ctx)
    for (u, consumer), keys in groups.items():
        if u in no_grad:
            continue
        times = ctx.times_on(consumer if consumer != "output" else u, stages)
        for p, q, split in keys:
            if q == "P":
                continue
            g = "P" if q == "R" and split else None
            gd, gs = backward_redistribution(p, q, grad_placement=g)
            back[(u, gd, gs)] = max(back.get((u, gd, gs), 0), times)
    for (u, gd, gs), times in back.items():
        kind = _collective(gd, gs, tp)
        if kind in _FUNCTIONAL and times:
            nbytes = ctx.value_bytes(ctx.nodes[u])
            t.add(_FUNCTIONAL[kind], "tp", nbytes, times * ctx.m)


def _no_gradient(ctx: _Context) -> set[str]:
    """Values autograd gives no gradient: integer and boolean ones, and the constant-like
    ones (no graph input, no parameter upstream: masks, rotary tables; passes/pipeline.py)."""
    from autoplan.passes.pipeline import constant_like_nodes

    g = ctx.graph
    out = set(constant_like_nodes(g.gm, {f for f, i in g.params.items() if i.is_buffer}))
    for n in g.gm.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and not val.dtype.is_floating_point:
            out.add(n.name)
    return out


def _collective(src: str, dst: str, tp: int) -> str:
    """The collective DTensor runs to turn `src` into `dst` on the tp axis (comm.py
    `redistribute_time_s`'s table): "all_gather", "all_reduce", "reduce_scatter",
    "all_to_all", or "none" (nothing moves: the same placement, a slice, to Partial)."""
    if src == dst or tp == 1 or dst == "P" or src == "R":
        return "none"
    if src == "P":
        return "all_reduce" if dst == "R" else "reduce_scatter"
    return "all_gather" if dst == "R" else "all_to_all"


def _regathered(ctx: _Context) -> set[str]:
    """Values all-gathered on tp whose gathered form a matmul saves for its backward (through
    views): [Note: gathered inputs saved sharded] in passes/regather.py."""
    out = set()
    for r in ctx.plan.redistributions:
        if r.collective != "all_gather" or r.producer not in ctx.nodes:
            continue
        node = ctx.nodes.get(r.consumer)
        while node is not None:
            name = str(node.target).split(".")[-2] if "." in str(node.target) else ""
            if name in _MATMULS:
                out.add(r.producer)
                break
            if name not in _VIEWS or len(node.users) != 1:
                break
            node = next(iter(node.users))
    return out


def _context_parallel(ctx: _Context, t: RankTraffic, stages: list[int]) -> None:
    plan = ctx.plan
    cp, tp = plan.mesh.cp, plan.mesh.tp
    if cp == 1:
        return
    recompute = plan.checkpointing in ("full", "selective")
    for name in attention_nodes(ctx.graph):
        times = ctx.times_on(name, stages)
        if not times:
            continue
        whole, heads = kv_bytes(ctx.graph, name)
        s = ctx.strategies.get(name)
        split = s is not None and any(p.startswith("S(") for p in s.inputs[1:3])
        one = whole * ctx.scale * cp / 2 / (min(tp, heads) if split and tp > 1 else 1)
        t.add("all_gather_into_tensor", "cp", one, 2 * times * ctx.m * (1 + recompute))
        t.add("reduce_scatter_tensor", "cp", one, 2 * times * ctx.m)


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
                if plan.mesh.tp > 1 and plan.placement_of(p.fqn).startswith("S("):
                    t.add("all_reduce", "tp", 4)
