"""Turn the chosen configuration and placement into a `Plan` (every field filled).

The ILP chose one candidate per representative node; every captured block takes the choice of
the representative by position ([Note: layer sharing] in problem.py). Redistributions are listed
for every edge of the captured graph whose producer output placement differs from the consumer's
input placement, so the passes insert exactly what the solver priced -- once per value and
target placement for consumers that share it ([Note: one redistribution per value] in
problem.py): the record names the first such consumer in graph order, and the rewrite gives the
others its result.
"""

from __future__ import annotations

import dataclasses
import operator

from autoplan.cost_model.comm import pipeline_hop_time_s, redistribute_time_s
from autoplan.cost_model.compute import at_tokens, module_input_bytes
from autoplan.cost_model.config import config_stages
from autoplan.cost_model.fidelity import error_bands
from autoplan.cost_model.float8 import eligible, float8_choice
from autoplan.cost_model.step_time import Assessment
from autoplan.cost_model.traffic import rank_traffic
from autoplan.experts import BACKWARD_FLOPS_FACTOR as EXPERTS_BACKWARD_FACTOR
from autoplan.experts import EXPERTS_TARGET
from autoplan.plan import (
    Alternative, MeshShape, NodeStrategy, Plan, Prediction, Redistribution,
)
from autoplan.solver.costs import token_scale
from autoplan.solver.frozen import has_frozen
from autoplan.solver.problem import Problem, share_key
from autoplan.solver.problem_saved import tensor_bytes
from autoplan.strategies import Candidate, tensor_args

__all__ = ["build_plan", "chosen_candidates", "as_alternatives"]


def chosen_candidates(problem: Problem, choice: dict[str, int]) -> dict[str, Candidate]:
    """Candidate of every node of the graph (block nodes take their representative's)."""
    out = {}
    for name, cands in problem.cands.items():
        rep = problem.rep[name]
        out[name] = cands[choice[rep]] if rep in choice else cands[0]
    return out


def build_plan(search, best: Assessment, alternatives: list[tuple]) -> Plan:
    """The Plan of `best` with `alternatives` [(Assessment, reason)]."""
    cfg, sol = best.config, best.solution
    problem = search.problem(cfg.tp)
    graph, spec, topology = search.graph, search.spec, search.topology
    chosen = chosen_candidates(problem, sol.choice)
    scale = token_scale(problem, cfg.microbatch_size, spec.seq_len, cfg.cp)
    strategies = tuple(NodeStrategy(n.name, chosen[n.name].inputs, chosen[n.name].outputs)
                       for n in graph.gm.graph.nodes
                       if n.op == "call_function" and n.name in chosen)
    plan = Plan(
        model=graph.model_name, topology=topology.name,
        mesh=MeshShape(cfg.pp, cfg.dp, cfg.tp, ep=cfg.ep, cp=cfg.cp), zero_stage=cfg.zero_stage,
        global_batch=spec.global_batch, num_microbatches=cfg.num_microbatches,
        microbatch_size=cfg.microbatch_size, seq_len=spec.seq_len, schedule=cfg.schedule,
        stages=config_stages(cfg, search.total_layers),
        max_memory_fraction=spec.max_memory_fraction,
        routing_skew=spec.routing_skew if any(
            info.target == EXPERTS_TARGET for info in graph.nodes.values()) else 1.0,
        prediction=_prediction(search, best),
        num_virtual_stages=cfg.num_virtual_stages,
        checkpointing=cfg.checkpointing,
        param_placements=_param_placements(graph, chosen),
        strategies=strategies,
        redistributions=_redistributions(search, problem, chosen, scale),
        alternatives=as_alternatives(alternatives),
        dtype=spec.dtype, offload=cfg.offload,
        frozen_dtype=spec.frozen_dtype if has_frozen(graph) else "",
        float8_linears=_float8_linears(search, problem, chosen, scale))
    # bytes per rank per mesh axis, read off the plan itself ([Note: traffic per axis])
    traffic = tuple(dict(t.bytes_by_axis) for t in rank_traffic(
        plan, graph, all_to_all=topology.device.all_to_all))
    flops = flops_by_pp_rank(graph, plan, chosen,
                             token_scale(problem, 1, spec.seq_len) * spec.global_batch)
    return dataclasses.replace(plan, prediction=dataclasses.replace(
        plan.prediction, bytes_by_axis_by_pp_rank=traffic, flops_by_pp_rank=flops))


def as_alternatives(runners_up: list[tuple]) -> tuple[Alternative, ...]:
    """The plan's `Alternative`s of [(Assessment, reason)]."""
    return tuple(
        Alternative(MeshShape(a.config.pp, a.config.dp, a.config.tp, ep=a.config.ep,
                              cp=a.config.cp),
                    a.config.zero_stage, a.config.num_microbatches, a.config.schedule,
                    a.step_time_s, a.memory_bytes, reason, a.config.checkpointing,
                    a.config.num_virtual_stages, a.config.offload, tuple(a.config.stage_layers))
        for a, reason in runners_up)


def flops_by_pp_rank(graph, plan: Plan, chosen: dict[str, Candidate],
                     tokens_scale: float) -> tuple[float, ...]:
    """The matmul and attention FLOPs one rank of each pipeline rank executes per step.

    [Note: FLOPs per rank] A rank runs its own stages (`plan.stages`, k % pp == its pp
    coordinate): its blocks, the ops before the first block on stage 0 (the embedding), those
    after the last on the last stage (the head). Each op's forward FLOPs are the captured
    ones (torch.utils.flop_counter: matmuls, attention) scaled to the step's tokens; its
    backward twice that times its `backward_share` ([Note: backward share] in
    capture/facts.py: a frozen weight's matmul computes only the input gradient); the
    recomputation of activation checkpointing adds the forward of what it drops ("full": each
    block's ops up to the last one that saves a tensor for the backward -- torch's checkpoint
    stops recomputing once every saved tensor is packed again (`set_checkpoint_early_stop`),
    and under tp the DTensor op packs its inputs before its local kernel runs, so that last
    op's own FLOPs are not recomputed at tp > 1; "core-attention": the unfused attention
    cores, cost_model.activations.core_attention_regions, none with fused attention; "selective"
    keeps every matmul and attention output). Attention's backward is 2.5 times its forward
    (torch.utils.flop_counter's sdpa_backward_flop_count: the scores recomputed and four
    gradient matmuls), the routed experts' 3 times (autoplan/experts.py BACKWARD_FLOPS_FACTOR:
    the forward's matmuls again and both gradients of each, whatever is frozen), any other
    op's twice; under cp > 1 a causal attention runs (2 cp + 1) /
    (4 cp) of its full rows (each query chunk against the key chunks up to its own, which the
    flop counter counts, where at cp 1 it counts the masked half too). An op split over tp
    by its chosen strategy (`split_of`) runs a tp-th of its FLOPs on each tp rank, a
    replicated one all of them; the tokens are split over dp x cp. This
    is what a dry run counts on the rank (autoplan/runtime/dryrun.py), where
    `model_flops / world_size` assumes stages of equal work and every op split.

    Args:
        graph: the planning graph (N captured blocks stand for `graph.total_layers`);
        plan: its plan; chosen: each node's Candidate; tokens_scale: the step's tokens over
            the captured ones (all dp and cp ranks).
    Returns one figure per pipeline rank, FLOPs.
    """
    from autoplan.cost_model.activations import (
        core_attention_regions, grad_carriers, node_producers, saved_tensors
    )
    from autoplan.cost_model.context_parallel import attention_nodes
    from autoplan.solver.costs import split_of

    mesh = plan.mesh
    n_cap = max(graph.num_layers, 1)
    layer_of = {name for names in graph.layer_nodes.values() for name in names}
    attention = set(attention_nodes(graph))
    producers, grads = node_producers(graph.gm), grad_carriers(graph.gm, graph.params)
    fx_nodes = {n.name: n for n in graph.gm.graph.nodes}

    def causal(name: str) -> bool:
        node = fx_nodes[name]
        given = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"),
                         node.args)) | dict(node.kwargs)
        return bool(given.get("is_causal")) or given.get("attn_mask") is not None

    # under cp a causal attention's query chunk j attends to key chunks 0..j only: rank i
    # runs (i + 1) + (2 cp - i) of the (2 cp)^2 / cp chunk pairs the full rows would be
    # (passes/context_parallel.py load_balanced_attention; solver/context.py)
    cp_share = (2 * mesh.cp + 1) / (4 * mesh.cp) if mesh.cp > 1 else 1.0

    def fwd_flops(name: str) -> float:
        info, cand = graph.nodes[name], chosen.get(name)
        split = cand is not None and mesh.tp > 1 and split_of(cand)
        f = info.flops / (mesh.tp if split else 1)
        return f * cp_share if name in attention and cp_share != 1.0 and causal(name) else f

    def work(name: str) -> float:
        info = graph.nodes[name]
        if info.target == EXPERTS_TARGET:  # every gradient, the forward again
            return fwd_flops(name) * (1 + (EXPERTS_BACKWARD_FACTOR if info.backward_share
                                           else 0.0))
        bwd = 2.5 if name in attention else 2.0
        return fwd_flops(name) * (1 + bwd * info.backward_share)

    def recomputed(names) -> float:
        """Forward FLOPs of recomputing the checkpointed ops `names` (graph order): up to
        the last that saves a tensor, that one's own only at tp 1 (the Note above)."""
        infos = [graph.nodes[n] for n in names if n in graph.nodes]
        savers = {it.consumer for it in saved_tensors(infos, producers=producers, grads=grads)}
        last = max((i for i, n in enumerate(names) if n in savers), default=-1)
        return sum(fwd_flops(n) for i, n in enumerate(names)
                   if n in graph.nodes and graph.nodes[n].flops
                   and (i < last or (i == last and mesh.tp == 1)))

    # per block (the captured blocks' mean): forward and backward, and what recomputation
    # adds under the plan's checkpointing; outside the blocks: before the first and after
    block_work = sum(work(n) for names in graph.layer_nodes.values() for n in names
                     if n in graph.nodes and graph.nodes[n].flops) / n_cap
    if plan.checkpointing == "full":
        redo = sum(recomputed(names) for names in graph.layer_nodes.values()) / n_cap
    elif plan.checkpointing == "core-attention":
        redo = sum(recomputed(region) for region in core_attention_regions(graph)) / n_cap
    else:
        redo = 0.0
    pre = post = 0.0
    seen_block = False
    for node in graph.gm.graph.nodes:
        seen_block |= node.name in layer_of
        if node.name in layer_of or node.name not in graph.nodes \
                or not graph.nodes[node.name].flops:
            continue
        if seen_block:
            post += work(node.name)
        else:
            pre += work(node.name)
    last = len(plan.stages) - 1
    share = tokens_scale / (mesh.dp * mesh.cp)
    out = []
    for r in range(mesh.pp):
        total = 0.0
        for st in plan.stages:
            if st.index % mesh.pp == r:
                total += (st.layer_end - st.layer_start) * (block_work + redo)
                total += (pre if st.index == 0 else 0.0) + (post if st.index == last else 0.0)
        out.append(total * share)
    return tuple(out)


def _float8_linears(search, problem: Problem, chosen: dict[str, Candidate],
                    scale: float) -> tuple[str, ...]:
    """The weight FQNs of the linears the chosen candidates run in FP8, sorted ([Note: float8
    pricing] in cost_model/float8.py: the choice build_costs priced)."""
    graph, spec, topology = search.graph, search.spec, search.topology
    if spec.float8 == "off":
        return ()
    fx_nodes = {node.name: node for node in graph.gm.graph.nodes}
    out = []
    for name, fqn in eligible(graph).items():
        scaled = at_tokens(graph.nodes[name], scale, module_input_bytes(fx_nodes[name]))
        c = chosen[name]
        if float8_choice(spec.float8, scaled, fx_nodes[name], c.inputs,
                         shard_factor=c.shard_factor, tp=problem.tp, topology=topology,
                         dtype=spec.dtype, weight_trainable=graph.params[fqn].trainable,
                         weight_fqn=fqn, only=spec.float8_only) is not None:
            out.append(fqn)
    return tuple(sorted(_uncaptured_blocks(graph, out)))


def _param_placements(graph, chosen) -> tuple[tuple[str, str], ...]:
    placement = {}
    for node in graph.gm.graph.nodes:
        if node.op == "get_attr" and node.name in chosen:
            placement[str(node.target)] = chosen[node.name].outputs[0]
    out = {}
    for fqn, info in graph.params.items():
        p = placement.get(fqn) or next((placement[a] for a in info.aliases if a in placement),
                                       "R")
        for name in (fqn, *info.aliases):
            out[name] = p
    return tuple(sorted(_uncaptured_blocks(graph, out).items()))


def _uncaptured_blocks(graph, by_fqn):
    """`by_fqn` (a dict FQN -> value, or a list of FQNs) with, under a shallow capture
    (num_layers < total_layers), the blocks that were not captured given block 0's entries,
    FQN by FQN ("model.layers.0.x" -> "model.layers.31.x")."""
    head = f"{graph.block_path(0)}." if graph.layer_prefix else None
    if not (head and graph.num_layers and graph.total_layers > graph.num_layers):
        return by_fqn
    out = dict.fromkeys(by_fqn) if isinstance(by_fqn, list) else dict(by_fqn)
    for name, p in list(out.items()):
        if name.startswith(head):
            for k in range(graph.num_layers, graph.total_layers):
                out[f"{graph.block_path(k)}.{name[len(head):]}"] = p
    return list(out) if isinstance(by_fqn, list) else out


def _redistributions(search, problem: Problem, chosen, scale: float) -> tuple:
    graph, topology, tp = search.graph, search.topology, problem.tp
    params = {n.name for n in graph.gm.graph.nodes if n.op == "get_attr"}
    out, recorded = [], set()
    for node in graph.gm.graph.nodes:
        if node.op == "output":
            consumer, wanted = "output", ["R"] * len(tensor_args(node))
        elif node.name in chosen and node.op == "call_function":
            consumer, wanted = node.name, list(chosen[node.name].inputs)
        else:
            continue
        for j, (u, dst) in enumerate(zip(tensor_args(node), wanted)):
            if u.name not in chosen:
                continue
            k = node.args[1] if node.target is operator.getitem else 0
            src = chosen[u.name].outputs[k]
            if src == dst:
                continue
            group = share_key(problem, u.name, k, consumer) if dst != "P" else None
            if group is not None and (group, dst) in recorded:
                continue  # the first consumer's redistribution serves this one too
            recorded.add((group, dst))
            nbytes = tensor_bytes(graph, u, k, search.spec.dtype_bytes) * (
                1.0 if u.name in params else scale)
            name, t = redistribute_time_s(src, dst, nbytes, tp, topology)
            out.append(Redistribution(u.name, consumer, j, src, dst, name, int(nbytes), t))
    return tuple(out)


def _prediction(search, best: Assessment) -> Prediction:
    graph, spec, topology = search.graph, search.spec, search.topology
    n_cap = max(graph.num_layers, 1)
    layer_of = {name for names in graph.layer_nodes.values() for name in names}
    fwd = sum(info.flops * (graph.total_layers / n_cap if name in layer_of else 1.0)
              for name, info in graph.nodes.items())
    problem = search.problem(best.config.tp)
    tokens_scale = token_scale(problem, 1, spec.seq_len) * spec.global_batch  # all cp ranks
    model_flops = 3.0 * fwd * tokens_scale
    world = topology.world_size
    per_device = model_flops / best.step_time_s / world if best.step_time_s > 0 else 0.0
    peak = topology.device.peak_flops_per_s.get(spec.dtype, 0.0)
    stage_s, p2p_s = _stage_time_s(search, best)
    return Prediction(
        step_time_s=best.step_time_s, compute_s=best.compute_s, comm_s=best.comm_s,
        bubble_s=best.bubble_s, memory_bytes=best.memory_bytes,
        memory_breakdown=dict(best.memory_breakdown), model_flops=model_flops,
        tflops_per_device=per_device / 1e12, mfu=per_device / peak if peak else 0.0,
        stage_time_s=stage_s, p2p_s=p2p_s, cp_comm_s=best.cp_comm_s,
        host_memory_bytes=best.host_memory_bytes, offload_s=best.offload_transfer_s,
        memory_by_pp_rank=tuple(search.rank_peaks(best)),
        error_bands={k: dataclasses.asdict(b) for k, b in zip(
            ("step_time", "peak_memory"), error_bands(topology.device.name))})


def _stage_time_s(search, best: Assessment) -> tuple[float, float]:
    """(t_comp + t_comm, its pipeline transfers) of [Note: step time] in pipeline.py: one
    microbatch through the busiest pp rank. Without pp, the placement's totals (compute at the
    node's speed); with pp, from the bubble, (pp - 1) / v slots of it, (pp - 1) / (3 v)
    under zero bubble ([Note: zero-bubble time]) (exact on dedicated devices); the
    transfers: 2 v p2p messages of the stage boundary."""
    cfg, sol, topology = best.config, best.solution, search.topology
    if cfg.pp == 1:
        busy = min(topology.devices_per_node, cfg.dp * cfg.cp * cfg.tp)
        return (sum(sol.compute_s.values()) / topology.device.speed(busy)
                + sum(sol.comm_s.values())), 0.0
    boundary = (search.boundary_bytes(cfg.tp, cfg.microbatch_size, cfg.cp)
                if sol.boundary_bytes is None else sol.boundary_bytes)
    p2p = 2 * cfg.num_virtual_stages * pipeline_hop_time_s(
        boundary, topology, pp=cfg.pp, stage_ranks=cfg.tp * cfg.cp * cfg.dp,
        num_virtual_stages=cfg.num_virtual_stages)
    slots = (cfg.pp - 1) / cfg.num_virtual_stages / (3 if cfg.schedule == "interleaved-zb"
                                                      else 1)
    return best.bubble_s / slots, p2p
