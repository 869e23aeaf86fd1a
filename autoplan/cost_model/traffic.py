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
  module for the rest (runtime/rank_stages.py `apply_data_parallel`); a unit's bytes are its
  parameters' local (after tp) elements, each dim 0 padded to a multiple of D as FSDP2 pads its shards
  (torch/distributed/fsdp/_fully_shard/_fsdp_param.py `padded_sharded_param_size`):
  ZeRO 0/1 (`replicate`): one `allreduce_` of the unit's trainable gradients (f, unpadded) per
  step -- the last microbatch's without pp (`set_requires_gradient_sync`, engine.py), the
  stage's REDUCE_GRAD with pp; ZeRO 2/3 (`fully_shard`): a `_reduce_scatter_base_` of the
  padded trainable gradients (f) per microbatch without pp, once per stage with pp (torch's
  deferred reduction, [Note: deferred reduction] in cost_model/rank_memory.py), and an
  `_allgather_base_` of the padded parameters (e) whenever a unit is used sharded
  (`_gathers`: ZeRO-2 gathers in the forward and keeps them to the end of the backward;
  ZeRO-3 reshards after each forward, except the stage's root unit, as FSDP2 leaves a root
  (runtime/rank_stages.py); without pp it reshards after each backward, with pp
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
  gradient's in the backward as DTensor runs it (`backward_redistribution` in comm.py); a
  Shard(i) -> Shard(j) is one `all_to_all_single` of the rank's local tensor where the ranks
  have all-to-all (`DeviceSpec.all_to_all`: NCCL), else gloo's all-gather of the whole tensor.
  Gradients that arrive Partial follow DTensor (traffic_tp.py `_partial_gradients`):
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
  that needs a gradient (not token ids) and that an op saves for its backward
  (activations.saved_tensors' rules; through views that keep it whole) is all-gathered
  again there ([Note: gathered inputs saved sharded] in
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
- ep ([Note: expert parallelism] in cost_model/expert_parallel.py; runtime/expert_parallel.py
  `_exchange`): per MoE layer and microbatch, the (token, choice) pairs of the rank's tokens
  (its tp share, 1 / tp of the choices, under ep x tp) exchanged in its ep group (axis "dp",
  "dp[ep]" where ep < dp, as the dry run names a group inside an axis's):
  forward `alltoall_base_`s of their hidden states, routing weights and expert ids and of the
  experts' outputs back (again in recomputation), backward those of the hidden states', the
  weights' and the outputs' gradients -- routed balanced, as the dry run routes ([Note: dry
  run routing]); a real run also exchanges the per-rank counts first (ep int64s) and sends
  what its router chose. The expert slices are outside FSDP2: no unit gathers or reduces
  them; their gradients are all-reduced over the dp / ep ranks holding the same slice once a
  step (f bytes) and, under ZeRO-1, their stepped rows gathered there;
- scalars: the step loss's `allreduce_` over dp x cp (4 bytes) when D > 1, and with clipping
  one `all_reduce` (4 bytes) per gradient per mesh axis (or ep group) it is sharded on
  (DTensor's `full_tensor` of a norm of a Shard gradient).

A shallow graph (N of L blocks captured, [Note: shallow planning capture]) is priced as the
runtime's graph of L blocks with the plan retargeted to it ([Note: plan retargeting] in
passes/expand.py): block k >= N - 1 is block N - 1's nodes, and the value it reads from
block k - 1 that block's counterpart (blocks align node by node); a value from before the
blocks that every captured block reads (rotary tables, a mask) is read by every block, one
that only the first reads is the residual stream entering block 0, which a deeper block
reads from the block before instead -- with one block captured, the values block 0 reads in
the shape and dtype of a value it hands to the nodes after the blocks (as solver/problem.py
`_edges` tells them apart). A value scales from the captured batch B and sequence S to the
plan's microbatch b and seq_len / cp tokens by the dims it has (`TrafficContext.scale_of`: dim 0
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

from autoplan.cost_model.context_parallel import attention_nodes
from autoplan.cost_model.traffic_context import RankTraffic, TrafficContext
from autoplan.cost_model.traffic_tp import tensor_parallel
from autoplan.experts import EXPERTS_OP
from autoplan.graph import CapturedGraph
from autoplan.plan import Plan

__all__ = ["rank_traffic"]


def rank_traffic(plan: Plan, graph: CapturedGraph, *, clip: bool = True,
                 kernels: bool = True, all_to_all: bool = False) -> list[RankTraffic]:
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
        all_to_all: the ranks' collectives have all-to-all (`DeviceSpec.all_to_all`: NCCL),
            which a Shard(i) -> Shard(j) redistribution runs; False (gloo): an all-gather of
            the whole tensor (the default, as `dry_run`'s).

    Returns one RankTraffic per pipeline rank, bytes per step.
    """
    ctx = TrafficContext(plan, graph, kernels, all_to_all)
    out = []
    for r in range(plan.mesh.pp):
        t = RankTraffic()
        stages = [s for s in range(len(plan.stages)) if s % plan.mesh.pp == r]
        _data_parallel(ctx, t, r, stages)
        _pipeline(ctx, t, r, stages, clip)
        tensor_parallel(ctx, t, set(stages))
        _context_parallel(ctx, t, set(stages))
        _expert_parallel(ctx, t, stages)
        _scalars(ctx, t, stages, clip)
        out.append(t)
    return out


def _data_parallel(ctx: TrafficContext, t: RankTraffic, r: int, stages: list[int]) -> None:
    plan, D = ctx.plan, ctx.D
    if D == 1:
        return
    axis, zero, pp = ctx.dp_axis, plan.zero_stage, plan.mesh.pp
    slices = ctx.expert_slices()
    for s in stages:
        units = ctx.units(s)
        root = units[-1] if ctx.root_unit(s) else None  # units() lists the root last
        for unit in units:
            held = [p for p in unit if p.fqn not in slices]  # outside FSDP2 under ep
            trainable = [p for p in held if p.trainable]
            if zero <= 1:
                if trainable:
                    t.add("allreduce_", axis, ctx.f * sum(ctx.numel(p, False)
                                                          for p in trainable))
                continue
            if trainable:
                t.add("_reduce_scatter_base_", axis,
                      ctx.f * sum(ctx.numel(p, True) for p in trainable),
                      1 if pp > 1 else ctx.m)
            t.add("_allgather_base_", axis, ctx.e * sum(ctx.numel(p, True) for p in held),
                  _gathers(plan, s, root=unit is root))
    if zero == 1:
        _sharded_optimizer(ctx, t, stages)


def _gathers(plan: Plan, stage: int, root: bool = False) -> int:
    """FSDP2 all-gathers of one unit of `stage` per step ([Note: traffic per axis]): a state
    machine over the stage's forward and backward actions in the schedule's order. The stage's
    `root` unit is not resharded after the forward, under ZeRO-3 either (runtime/rank_stages.py
    `apply_data_parallel`)."""
    m, pp = plan.num_microbatches, plan.mesh.pp
    reshard_after_forward = plan.zero_stage == 3 and not root
    if pp == 1:
        return m * (2 if reshard_after_forward else 1)
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
        if action == "F" and reshard_after_forward:
            gathered = False
    return count


def _sharded_optimizer(ctx: TrafficContext, t: RankTraffic, stages: list[int]) -> None:
    """ZeRO-1's gather of the updated parameters (runtime/zero1.py ShardedOptimizer.step,
    [Note: ZeRO-1 partition]): per trainable parameter of at least D rows one
    `_allgather_base_` of its rows padded to D equal pieces (ceil(rows / D) each), per smaller
    one a `broadcast_` of it whole from its owner; fp32 masters under mixed precision."""
    master = 4 if ctx.mixed else ctx.e
    slices = ctx.expert_slices()
    for s in stages:
        for unit in ctx.units(s):
            for p in unit:
                if not p.trainable or p.fqn in slices:  # _expert_parallel's
                    continue
                shape = ctx.local_shape(p)
                rows = shape[0] if shape else 1
                if rows >= ctx.D:
                    t.add("_allgather_base_", ctx.dp_axis, ctx.numel(p, True) * master)
                else:
                    t.add("broadcast_", ctx.dp_axis, ctx.numel(p, False) * master)


def _expert_parallel(ctx: TrafficContext, t: RankTraffic, stages: list[int]) -> None:
    """ep's exchanges and its expert slices' own reductions ([Note: traffic per axis])."""
    plan = ctx.plan
    ep, tp = plan.mesh.ep, plan.mesh.tp
    if ep == 1:
        return
    outer = ctx.D // ep  # the ranks holding the same slice
    # labelled as the dry run labels a group inside dp (runtime/collective_log.py)
    group = ctx.dp_axis if ep == ctx.D else f"{ctx.dp_axis}[{ep}]"
    for n in ctx.graph.gm.graph.nodes:
        if n.target is not EXPERTS_OP:
            continue
        hidden, index, weights = n.args[:3]
        k = index.meta["val"].shape[-1]
        states = ctx.value_bytes(hidden) * k / tp        # the pairs' hidden states, (R, H)
        ids, routing = ctx.value_bytes(index) / tp, ctx.value_bytes(weights) / tp
        for where in ctx.instances(n.name, set(stages)):
            runs = ctx.m * (1 + ctx.recomputed(n.name, where))
            for nbytes in (states, routing, ids, states):  # dispatch, and the outputs back
                t.add("alltoall_base_", group, nbytes, runs)
            for nbytes in (states, routing, states):       # their gradients
                t.add("alltoall_base_", group, nbytes, ctx.m)
    if outer == 1:
        return
    group = ctx.dp_axis if outer == ctx.D else f"{ctx.dp_axis}[{outer}]"
    slices = ctx.expert_slices()
    master = 4 if ctx.mixed else ctx.e
    for s in stages:
        for unit in ctx.units(s):
            for p in unit:
                if p.fqn not in slices or not p.trainable:
                    continue
                shape = ctx.local_shape(p)
                numel = math.prod(shape) // ep
                t.add("allreduce_", group, ctx.f * numel)
                if plan.zero_stage == 1:  # its rows stepped over the outer ranks, gathered
                    rows = shape[0] // ep
                    t.add("_allgather_base_", group,
                          math.ceil(rows / outer) * outer * math.prod(shape[1:]) * master)


def _pipeline(ctx: TrafficContext, t: RankTraffic, r: int, stages: list[int], clip: bool) -> None:
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


def _boundary_bytes(ctx: TrafficContext) -> list[float]:
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


def _context_parallel(ctx: TrafficContext, t: RankTraffic, stages: set[int]) -> None:
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


def _scalars(ctx: TrafficContext, t: RankTraffic, stages: list[int], clip: bool) -> None:
    plan = ctx.plan
    if ctx.D > 1:
        t.add("allreduce_", ctx.dp_axis, 4)  # the step's loss
    if not clip:
        return
    last = len(plan.stages) - 1
    slices, ep = ctx.expert_slices(), plan.mesh.ep
    for s in stages:
        for unit in ctx.units(s):
            for p in unit:
                if not p.trainable:
                    continue
                if s == last and s != 0 and p in ctx.pre:
                    continue  # a tied weight's norm counts in its first stage only
                if p.fqn in slices:  # an ep slice: Shard(0) on the ep group
                    t.add("all_reduce", ctx.dp_axis if ep == ctx.D else f"{ctx.dp_axis}[{ep}]",
                          4)
                elif plan.zero_stage >= 2 and ctx.D > 1:
                    t.add("all_reduce", ctx.dp_axis, 4)
                if plan.mesh.tp > 1 and ctx.param_placement(p.fqn).startswith("S("):
                    t.add("all_reduce", "tp", 4)
