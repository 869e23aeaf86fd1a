"""Cost coefficients of the placement ILP for one (tp, microbatch size) pair.

Everything is per microbatch and per occurrence (the ILP multiplies by the weights of
`Problem`). The captured graph holds `B_g` samples of `S_g` tokens; a microbatch of `b` samples
of `spec.seq_len` tokens scales activation sizes, FLOPs and bytes by

    scale = (b * seq_len) / (B_g * S_g)

(linear in tokens: the quadratic attention term is taken as linear, an approximation that is
exact when the graph is captured at the planned sequence length). Parameter tensors do not scale.

- compute of node n under candidate c: cost_model.compute.op_time_s + backward_time_s at
  shard_factor(c), seconds; with tp > 1 every op (views included) also pays the device's
  `dtensor_op_overhead_s` once in the forward and once in the backward (if it has one), since the
  runtime runs tensor-parallel stages on DTensors;
- edge (u -> v) with producer placement p and consumer placement q: forward
  `redistribute_time_s(p, q)` plus backward `redistribute_time_s(*backward_redistribution(p, q,
  grad_placement=g))` where g = "P" when q = "R" and v's candidate splits the work (the
  gradient of a replicated input of a split op is a partial sum: Megatron's f operator,
  Shoeybi et al. 2019 section 3); pairs DTensor cannot do (S -> P) are absent, and so are
  pairs that would gather or reshuffle a split parameter (S(d) -> R / S(e)): autograd would
  keep the gathered copy of every layer until the backward, memory the model does not price;
- edges of one value that consumers share ([Note: one redistribution per value] in
  problem.py): the redistribution p -> q is paid once when any of them carries it, at the
  largest weight among them -- forward once per (p, q), backward once per (p, q, split) (the
  consumers' gradients add up before the one backward collective; so also for p = q, e.g. the
  backward all-reduce of a replicated input that q, k and v projections read);
  `redistribution_units`;
- the backward all-gather of a gathered activation that autograd holds as its shard ([Note:
  gathered inputs saved sharded] in autoplan/passes/regather.py): an edge S(d) -> R into a
  node whose input an op saves (`Problem.regathered`) gathers the shard again in that op's
  backward. [Note: regather priced] The runtime issues that all-gather before the op's
  input-gradient matmul and waits for it at the weight-gradient one (Megatron-LM's overlap,
  Korthikanti et al. 2022 section 4.2.2), so the backward pays what the matmul does not hide:
  max(0, all-gather - input-gradient matmul), the latter priced as the forward matmul split tp
  ways (cost_model.compute.op_time_s; a smaller bound than an unsplit matmul's). An op that is
  no matmul hides nothing: the whole all-gather. Added to the pair's backward time and kept in
  `Costs.regather_s` (checkpointing recomputes the gather instead: solver/checkpointing.py);
- activation bytes: each saved tensor divided by tp when its owner's candidate output is S(d)
  (a flattening view's saved value owned by its view chain's root: problem.py);
- parameter elements per device: numel / tp when the get_attr candidate is S(d).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autoplan.cost_model.comm import backward_redistribution, redistribute_time_s
from autoplan.cost_model.compute import (
    at_tokens, backward_time_s, dtensor_dispatches, module_input_bytes, op_time_s
)
from autoplan.cost_model.float8 import eligible, float8_choice
from autoplan.cost_model.memory import loss_working_bytes, vocab_parallel_loss_bytes
from autoplan.op_classes import MATMUL_OPS, op_name
from autoplan.solver.problem import OUTPUT, Problem, boundary_bytes, boundary_node
from autoplan.spec import TrainingSpec
from autoplan.strategies import tensor_args
from autoplan.topology import Topology

__all__ = ["Costs", "Unit", "token_scale", "build_costs", "split_of", "out_divisor",
           "redistribution_units"]


@dataclass
class Costs:
    """Per-candidate and per-pair costs (seconds, bytes) for one (tp, microbatch) pair.

    Attributes:
        scale: token scale of the microbatch vs the captured graph.
        compute_s: ILP node -> [fwd + bwd compute seconds per candidate].
        pairs: per edge (index into problem.edges): {(p, q, split): (fwd_s, bwd_s, collective)}.
        act_bytes: ILP node -> [saved-activation bytes per candidate] (all saved tensors it
            owns, times their multiplicity), plus key None for tensors of nodes outside the ILP.
        param_elems: ILP get_attr node -> [elements per device per candidate] x multiplicity.
        output_bytes: global bytes of the graph output per microbatch (logits).
        loss_bytes: what the runtime's token loss holds at its backward, one microbatch
            (cost_model.memory.loss_working_bytes of the main output; 0 when the model
            returns its own `loss`, whose saved tensors are the graph's).
        loss_rows: {the logits' producer (ILP node): [bytes per candidate]}: the token loss's
            working set without pipelining, where the runtime runs the vocab-parallel
            cross-entropy on logits a candidate splits on the vocabulary (tp > 1,
            `vocab_parallel_loss_bytes`) and `loss_bytes` for the others ([Note: loss
            working set] in cost_model/memory.py; at tp 1 every entry is `loss_bytes`, and
            its least / tp bounds any tp's from below); empty when the model returns its own
            loss. With pipelining `loss_bytes` holds (the runtime runs the plain loss).
        node_comm_s: ILP node -> [(forward, backward) seconds per candidate] of collectives
            that belong to the node itself rather than to an edge: the K/V all-gather and
            reduce-scatter of attention under context parallelism ([Note: context
            parallelism] in cost_model/context_parallel.py); per occurrence, like compute_s.
        regather_s: edge index -> {pair key: seconds} of `pairs`' backward that is the
            all-gather again of a gathered input held as its shard ([Note: regather priced]).
        boundary_bytes: {block-output node (problem.boundary_node): [bytes per candidate]}:
            the residual stream between blocks, one microbatch, as a tp rank holds it -- a
            pipeline stage's output kept for its backward and a receive buffer are the
            producer's local tensor (runtime/parallel.py tp_stage_forward), 1/tp of it when
            the candidate splits it (sequence parallelism); [Note: memory per rank] in
            cost_model/rank_memory.py. Empty without blocks.
        float8_forward_s: ILP node -> [forward seconds of the candidate in FP8, or None where
            it runs in the compute dtype] for the linears a float8 plan may run in FP8 ([Note:
            float8 pricing] in cost_model/float8.py); what checkpointing recomputes.
    """

    scale: float
    compute_s: dict[str, list[float]]
    pairs: list[dict[tuple, tuple[float, float, str]]]
    act_bytes: dict
    param_elems: dict[str, list[float]]
    output_bytes: float
    node_comm_s: dict[str, list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
    regather_s: dict[int, dict[tuple, float]] = dataclasses.field(default_factory=dict)
    boundary_bytes: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    loss_bytes: float = 0.0
    loss_rows: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    float8_forward_s: dict[str, list[float | None]] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Unit:
    """One priced redistribution: `cost_s` (seconds per microbatch, weight included) in `part`,
    paid once when any edge e of `uses` carries one of its pairs: uses = ((edge index, (pair
    key, ...)), ...)."""

    part: str
    cost_s: float
    uses: tuple[tuple[int, tuple[tuple, ...]], ...]


def redistribution_units(problem: Problem, costs: Costs) -> list[Unit]:
    """The communication terms of the placement ILP (module docstring): one per (edge, pair)
    for an edge no other edge shares with, one per shared (p, q) forward and (p, q, split)
    backward for a group of edges ([Note: one redistribution per value] in problem.py).
    R -> P (no data moves; DTensor does it inside each consumer's op) and getitem pairs are
    never shared; p = q pairs share their backward (the gradients add up first). Kept on `costs` (a Costs is not changed after it is built;
    dataclasses.replace makes a new one)."""
    cached = costs.__dict__.get("_units")
    if cached is not None and cached[0] is problem:
        return cached[1]
    units = _units(problem, costs)
    costs.__dict__["_units"] = (problem, units)
    return units


def _units(problem: Problem, costs: Costs) -> list[Unit]:
    groups: dict[tuple, list[int]] = {}
    for i, edge in enumerate(problem.edges):
        if edge.share is not None and not edge.getitem:
            groups.setdefault((edge.share, edge.part), []).append(i)
    shared = {i for members in groups.values() if len(members) > 1 for i in members}
    # sorted: the pairs come from sets, whose order changes between processes (string
    # hashing); the ILP's rows, and so which of two equal placements it returns, must not
    units = []
    for i, (edge, pairs) in enumerate(zip(problem.edges, costs.pairs)):
        for key in sorted(pairs):
            fwd, bwd, _name = pairs[key]
            if i not in shared or key[1] == "P":
                units.append(Unit(edge.part, edge.weight * (fwd + bwd), ((i, (key,)),)))
    for (_share, part), members in groups.items():
        if len(members) < 2:
            continue
        fwd: dict[tuple, float] = {}
        bwd: dict[tuple, float] = {}
        uses: dict[tuple, dict[int, list]] = {}  # (p, q) -> edge -> its keys (p, q, split)
        for i in members:
            w = problem.edges[i].weight
            for key in sorted(costs.pairs[i]):
                (f, b, _name), (p, q, _split) = costs.pairs[i][key], key
                if q == "P":
                    continue
                fwd[(p, q)] = max(fwd.get((p, q), 0.0), w * f)
                bwd[key] = max(bwd.get(key, 0.0), w * b)
                uses.setdefault((p, q), {}).setdefault(i, []).append(key)
        for pq, by_edge in uses.items():
            # p = q: nothing moves forward, but the consumers' gradients still add up
            # before the one backward redistribution (e.g. Megatron's f all-reduce of a
            # replicated input read by q, k and v projections)
            units.append(Unit(part, fwd[pq], tuple((i, tuple(keys))
                                                   for i, keys in by_edge.items())))
            for key in dict.fromkeys(k for keys in by_edge.values() for k in keys):
                units.append(Unit(part, bwd[key], tuple((i, (key,)) for i, keys
                                                        in by_edge.items() if key in keys)))
    return units


def token_scale(problem: Problem, microbatch_size: int, seq_len: int, cp: int = 1) -> float:
    """(b * seq_len / cp) / (B_g * S_g); see the module docstring (cp: the context-parallel
    degree, each rank holding seq_len / cp tokens of every sample, [Note: context
    parallelism] in cost_model/context_parallel.py)."""
    graph = problem.graph
    return (microbatch_size * seq_len / cp) / (graph.batch_size * (graph.seq_len or seq_len))


def split_of(cand) -> bool:
    """True when the candidate splits the op's work over the tp ranks."""
    return cand.shard_factor > 1


def out_divisor(cand, tp: int, index: int = 0) -> float:
    """How many ways the candidate's output `index` is split on each rank (tp or 1)."""
    outs = cand.outputs
    return float(tp) if index < len(outs) and outs[index].startswith("S(") else 1.0


def _token_loss_input(problem: Problem) -> str | None:
    """The ILP node whose output the runtime's token loss reads (the graph's main output,
    CapturedGraph.main_output_index), or None when the model returns its own `loss`."""
    graph = problem.graph
    if "loss" in graph.output_names:
        return None
    out, = (n for n in graph.gm.graph.nodes if n.op == "output")
    args = tensor_args(out)
    if graph.main_output_index >= len(args):
        return None
    return problem.rep.get(args[graph.main_output_index].name)


def _loss_row(problem: Problem, edge, logits_bytes: float, dtype_bytes: float,
              fused: bool) -> list[float]:
    """Costs.loss_rows' row of the logits' producer: per candidate, the vocab-parallel
    cross-entropy's working set on a tp rank's shard where the candidate splits the logits'
    last dim (the vocabulary, passes/kernels.py keep_logits_sharded), else the plain loss's."""
    tp = problem.tp
    if tp == 1:
        return [loss_working_bytes(logits_bytes, dtype_bytes)] * len(problem.cands[edge.src])
    shape = problem.graph.nodes[edge.src].shapes[edge.out_index]
    vocab = {f"S({len(shape) - 1})", "S(-1)"}
    plain = loss_working_bytes(logits_bytes, dtype_bytes)
    return [vocab_parallel_loss_bytes(logits_bytes / tp, dtype_bytes, fused)
            if c.outputs[edge.out_index] in vocab else plain
            for c in problem.cands[edge.src]]


def build_costs(problem: Problem, microbatch_size: int, spec: TrainingSpec,
                topology: Topology, cp: int = 1) -> Costs:
    """All ILP coefficients for `problem` at microbatch size `microbatch_size`, on each of
    `cp` context-parallel ranks (seq_len / cp tokens per sample; the cp collectives are added
    by solver/context.py's `with_context_parallel`)."""
    scale = token_scale(problem, microbatch_size, spec.seq_len, cp)
    costs = Costs(scale, {}, [], {}, {}, 0.0)
    device, tp = topology.device, problem.tp
    graph = problem.graph
    fx_nodes = {node.name: node for node in graph.gm.graph.nodes}
    loss_input = _token_loss_input(problem)
    fp8 = eligible(graph) if spec.float8 != "off" else {}
    for n in problem.nodes:
        info = graph.nodes.get(n)
        if info is None or n in problem.constants:
            continue
        scaled = at_tokens(info, scale, module_input_bytes(fx_nodes[n]))
        host = _dtensor_host_s(info, device) if tp > 1 else 0.0
        skew = spec.routing_skew  # the routed experts split over tp: the busiest rank's pace
        costs.compute_s[n] = [
            op_time_s(scaled, device, spec.dtype, shard_factor=c.shard_factor,
                      routing_skew=skew)
            + backward_time_s(scaled, device, spec.dtype, shard_factor=c.shard_factor,
                              routing_skew=skew) + host
            for c in problem.cands[n]]
        if n in fp8:  # [Note: float8 pricing]
            times = [float8_choice(spec.float8, scaled, fx_nodes[n], c.inputs,
                                   shard_factor=c.shard_factor, tp=tp, topology=topology,
                                   dtype=spec.dtype,
                                   weight_trainable=graph.params[fp8[n]].trainable,
                                   weight_fqn=fp8[n], only=spec.float8_only)
                     for c in problem.cands[n]]
            costs.float8_forward_s[n] = [t and t.forward_s for t in times]
            costs.compute_s[n] = [old if t is None else t.forward_s + t.backward_s + host
                                  for old, t in zip(costs.compute_s[n], times)]
    for i, edge in enumerate(problem.edges):
        pairs = _edge_pairs(problem, edge, scale, topology)
        regather = _regather_s(problem, edge, pairs, scale, spec, topology, fx_nodes)
        for key, extra_s in regather.items():
            fwd, bwd, name = pairs[key]
            pairs[key] = (fwd, bwd + extra_s, name)
        if regather:
            costs.regather_s[i] = regather
        costs.pairs.append(pairs)
        if edge.dst == OUTPUT:
            costs.output_bytes += edge.nbytes * scale
            if edge.src == loss_input:
                costs.loss_bytes += loss_working_bytes(edge.nbytes * scale, spec.dtype_bytes)
                costs.loss_rows[edge.src] = _loss_row(
                    problem, edge, edge.nbytes * scale, spec.dtype_bytes,
                    device.fuses_pointwise)
    acts: dict = {}
    for owner, nbytes, mult, _part in problem.saved:
        if owner is None or owner not in problem.cands:
            acts.setdefault(None, [0.0])[0] += nbytes * scale * mult
            continue
        row = acts.setdefault(owner, [0.0] * len(problem.cands[owner]))
        for i, c in enumerate(problem.cands[owner]):
            row[i] += nbytes * scale * mult / out_divisor(c, tp)
    costs.act_bytes = acts
    for g, (_fqn, numel, _parts, mult) in problem.params.items():
        costs.param_elems[g] = [numel * mult / out_divisor(c, tp) for c in problem.cands[g]]
    out = boundary_node(problem)
    if out is not None:
        costs.boundary_bytes[out] = [boundary_bytes(problem) * scale / out_divisor(c, tp)
                                     for c in problem.cands[out]]
    return costs


def _dtensor_host_s(info, device) -> float:
    """DTensor dispatch overhead of one op, forward plus backward (module docstring)."""
    return device.dtensor_op_overhead_s * dtensor_dispatches(info)


def _regather_s(problem: Problem, edge, pairs: dict, scale: float, spec: TrainingSpec,
                topology: Topology, fx_nodes: dict) -> dict[tuple, float]:
    """{pair key: exposed seconds of the backward all-gather again} for the S(d) -> R pairs
    of an activation edge whose gathered value an op saves ([Note: regather priced])."""
    saver = problem.regathered.get(edge.dst) if edge.dst != OUTPUT else None
    if (problem.tp == 1 or saver is None or edge.getitem or not edge.scales or not edge.grad):
        return {}
    hidden_s = 0.0
    info = problem.graph.nodes.get(saver)
    if info is not None and op_name(str(info.target)) in MATMUL_OPS:
        scaled = at_tokens(info, scale, module_input_bytes(fx_nodes[saver]))
        hidden_s = op_time_s(scaled, topology.device, spec.dtype, shard_factor=problem.tp)
    return {key: max(0.0, fwd - hidden_s) for key, (fwd, _bwd, _name) in pairs.items()
            if key[0].startswith("S(") and key[1] == "R"}


def _edge_pairs(problem: Problem, edge, scale: float, topology: Topology) -> dict:
    tp = problem.tp
    nbytes = edge.nbytes * (scale if edge.scales else 1.0)
    srcs = {c.outputs[edge.out_index] for c in problem.cands[edge.src]}
    if edge.dst == OUTPUT:
        dsts = {("R", False)}
    else:
        dsts = {(c.inputs[edge.arg_index], split_of(c)) for c in problem.cands[edge.dst]}
    pairs = {}
    for p in srcs:
        for q, split in dsts:
            if edge.getitem:
                if p == q:
                    pairs[(p, q, split)] = (0.0, 0.0, "none")
                continue
            if not edge.scales and p != q and p != "R":
                # A split parameter is used as it is stored (or sliced further from R): an
                # all-gathered weight would be saved by autograd for the backward in every
                # layer -- ZeRO-3 on the dp axis is the way to store weights split.
                continue
            try:
                name, fwd = redistribute_time_s(p, q, nbytes, tp, topology)
                bwd = 0.0
                if edge.grad:
                    g = "P" if (q == "R" and split) else None
                    gd, gs = backward_redistribution(p, q, grad_placement=g)
                    bwd = redistribute_time_s(gd, gs, nbytes, tp, topology)[1]
            except ValueError:
                continue  # DTensor cannot do it (S -> P): the pair is not offered
            pairs[(p, q, split)] = (fwd, bwd, name)
    return pairs
