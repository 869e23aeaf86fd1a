"""Expert parallelism priced: the MoE layers of a graph and what a degree ep changes in a
plan's step time and memory.

[Note: expert parallelism] A mixture-of-experts layer is one `autoplan.experts` node ([Note:
experts op] in autoplan/experts.py). Under expert parallelism groups of ep consecutive dp ranks
hold disjoint slices of its E experts (E / ep each, torchtitan's ep borrowing the data-parallel
ranks: the batch and the other weights stay split and replicated over all dp ranks). Each rank
sends every (token, choice) pair of its tokens to the rank holding the expert (dispatch) and
gets the weighted output back (combine): an all-to-all each, and both again, reversed, in the
backward (runtime/moe.py). Compared with ep = 1 (every dp rank holds every expert):

- the experts' FLOPs per rank are unchanged on average (a rank computes E / ep experts for ep
  ranks' tokens), but each expert's GEMMs get ep times the rows, m = ep T k / E, higher on the
  efficiency curve ([Note: matmul efficiency curve] in cost_model/compute.py), and the rank
  reads 1 / ep of the expert weights: `experts_time_s`, a roofline of the layer's experts on
  the busiest rank, priced at ep and at 1, its difference added per MoE layer and microbatch;
- per MoE layer and microbatch, 4 all-to-alls of n = T k H x dtype bytes per rank (T = the
  microbatch's tokens on the rank, k choices, width H), over the ep group (stride tp: dp ranks
  are tp apart), priced per topology level by `collective_time_s("all_to_all", ...)` ([Note:
  collective cost] and [Note: hierarchical collectives] in cost_model/comm.py; on `local-cpu`
  the fitted gloo entry); plus 3 small ones for the expert ids and routing weights (T k x 8
  bytes) and 1 for the counts, which cost their latency. Each pp rank runs its 1 / pp of the
  layers;
- the experts' weights, gradients and optimizer states per rank become their 1 / ep slice,
  whole: the runtime leaves them out of FSDP2 (ZeRO), so no unit gathers them and they are
  not in the unsharded gradients of the deferred reduction; each pipeline rank's peak is
  priced again with them apart (rank_memory.ExpertSlices, `rank_peaks`); without ep they are
  FSDP2's like any other weight;
- they leave the dp group's collectives (`dp_sync_s` in cost_model/dp_sync.py, of the ZeRO
  stage, over the rest of the parameters): their gradients are all-reduced over the dp / ep
  ranks holding the same slice, at 1 / ep of the size (stride tp x ep), once per step.

ep is searched with everything else: every configuration (pp, dp, tp, ZeRO stage,
microbatches, schedule, checkpointing, offload) comes at ep = 1 and at each degree > 1 that
applies (solver/expert_degree.py; a degree that a larger one dominates is left out, which
changes no optimum: `undominated`). An ep configuration's step time is its ep = 1 pricing
plus these differences (`ep_step_delta_s`, `with_expert_parallel`), its memory per rank
priced with the slices held whole (step_time.assess' `experts`): exact for the quantities
above because ep changes no placement -- at tp > 1 the runtime runs ep only with the experts
split on tp (Shard(0)), and a placement that does not split them is no placement of an ep
configuration (solver/search.py); under ZeRO-1 a slice's optimizer states are partitioned over
its dp / ep ranks. So a plan that fits only with ep is found (DeepSeek-V3 on 256 DGX-H100
nodes: pp 4 x dp 64 x tp 8 with ep 8, where no ep = 1 plan of its configuration fits).

Routing is never balanced. `TrainingSpec.routing_skew` (option `routing_skew`, default
spec.py ROUTING_SKEW, 1.52: 1 + the MaxVio Wang et al. 2024 measured under an auxiliary
balancing loss, arXiv 2408.15664; 1.04 under DeepSeek's auxiliary-loss-free balancing) is
the busiest expert-holding rank's (token, choice) pairs over the mean. Every rank waits for
the busiest at the next collective, so it prices:
- time: the busiest rank's expert compute under ep (`experts_time_s`: skew x the FLOPs and
  the received rows) and under tp's split of whole experts (strategies/
  experts_candidates.py: compute.op_time_s' `routing_skew`, in the placement ILP and the
  report's parts alike); the big all-to-alls at skew x n bytes (the busiest rank receives, and
  sends back, that many). At ep = 1 a rank computes its own T k pairs whatever the routing:
  no skew. Not priced: the per-expert spread inside a rank (the GEMMs are priced at the mean
  rows per expert);
- memory: the busiest rank's receive buffers and what the exchange saves for the backward
  (`expert_slices`' act_bytes) at skew x the pairs: the dropless runtime sizes them by the
  pairs routed (runtime/expert_parallel.py `experts_all_to_all`).
The bytes per mesh axis (Prediction.bytes_by_axis_by_pp_rank) stay the mean rank's, which is
what a dry run measures: it routes balanced ([Note: dry run routing] in
runtime/expert_parallel.py), so bench/dryrun.py plans its ep case at routing_skew 1, the skew
its ranks see, and the fidelity of the skew itself rests on its source, not on our runs.

Routing limits (DeepSeek-V3's `topk_group` of `n_group` groups: each token's experts on at
most 4 nodes) are not priced and need not be: our runtime sends every (token, choice) pair to
its expert's rank, k of them per token whatever the groups (no per-node deduplication, which
is what makes the limit pay in DeepEP), and the all-to-all is priced per topology level over
the whole ep group as it runs; a limit changes which ranks receive, not how many bytes leave.
"""

from __future__ import annotations

import dataclasses
import math

from autoplan.cost_model.comm import collective_time_s
from autoplan.cost_model.compute import matmul_efficiency
from autoplan.cost_model.config import Config
from autoplan.cost_model.dp_sync import dp_sync_s
from autoplan.cost_model.rank_memory import ExpertSlices
from autoplan.cost_model.step_time import DP_SYNC_OVERLAP, Assessment
from autoplan.experts import BACKWARD_FLOPS_FACTOR, EXPERTS_OP
from autoplan.graph import CapturedGraph
from autoplan.spec import TrainingSpec
from autoplan.topology import DeviceSpec, Topology

__all__ = ["ExpertLayers", "expert_layers", "expert_weights", "expert_slices", "ep_step_delta_s",
           "experts_time_s", "with_expert_parallel", "EP_SAVED_INDEX_BYTES", "EXPERTS_REASON"]

EXPERTS_REASON = "experts "
"""How the reason of the runner-up that says why a mixture-of-experts plan's experts lie as
they do begins (solver/outcome.py `expert_layout`; the report's experts line finds it)."""


@dataclasses.dataclass(frozen=True)
class ExpertLayers:
    """The MoE layers of a captured graph, scaled to the full depth.

    Attributes:
        num_layers: MoE layers of the full model (captured ones x total / captured layers).
        num_experts: E of every layer (ep must divide each).
        top_k: choices per token (the largest over the layers).
        hidden: H, the tokens' width.
        intermediate: I, an expert's intermediate size (the first MoE layer's).
        expert_elems: expert weight elements of the full model (gate_up_proj + down_proj).
        model_elems: parameter elements of the full model (blocks scaled likewise).
        frozen_expert_elems, frozen_model_elems: of those, the frozen ones (no gradient, no
            optimizer state: [Note: frozen pricing] in cost_model/memory.py).
    """

    num_layers: float
    num_experts: tuple[int, ...]
    top_k: int
    hidden: int
    intermediate: int
    expert_elems: float
    model_elems: float
    frozen_expert_elems: float = 0.0
    frozen_model_elems: float = 0.0


def expert_weights(graph: CapturedGraph) -> list[str]:
    """FQNs of the expert weights (gate_up_proj, down_proj) every experts node of `graph`
    reads, in graph order, each once ([Note: experts op] in autoplan/experts.py)."""
    out: list[str] = []
    for n in graph.gm.graph.nodes:
        if n.target is EXPERTS_OP:
            out += [str(a.target) for a in n.args[3:5] if str(a.target) not in out]
    return out


def expert_layers(graph: CapturedGraph) -> ExpertLayers | None:
    """The graph's MoE layers, or None when it has none."""
    nodes = [n for n in graph.gm.graph.nodes if n.target is EXPERTS_OP]
    if not nodes:
        return None
    scale = graph.total_layers / graph.num_layers if graph.num_layers else 1.0
    shapes = [[tuple(a.meta["val"].shape) if "val" in a.meta else tuple(
        graph.params[str(a.target)].shape) for a in n.args[:5]] for n in nodes]
    frozen = [graph.params[str(a.target)] for n in nodes for a in n.args[3:5]
              if a.op == "get_attr" and str(a.target) in graph.params
              and not graph.params[str(a.target)].trainable]
    return ExpertLayers(
        frozen_expert_elems=scale * sum(p.numel for p in frozen),
        frozen_model_elems=sum(p.numel * (scale if p.layer_id is not None else 1.0)
                               for p in graph.params.values()
                               if not p.is_buffer and not p.trainable),
        num_layers=len(nodes) * scale,
        num_experts=tuple(s[3][0] for s in shapes),
        top_k=max(s[1][1] for s in shapes),
        hidden=shapes[0][0][1],
        intermediate=shapes[0][4][2],
        expert_elems=scale * sum(math.prod(s[3]) + math.prod(s[4]) for s in shapes),
        model_elems=sum(p.numel * (scale if p.layer_id is not None else 1.0)
                        for p in graph.params.values() if not p.is_buffer))


def experts_time_s(layers: ExpertLayers, tokens: int, ep: int, spec: TrainingSpec,
                   device: DeviceSpec, tp: int = 1) -> float:
    """Forward + backward seconds of one MoE layer's routed experts on the busiest rank, per
    microbatch of `tokens` tokens per rank, under expert parallelism ep (1: the rank computes
    every expert for its own tokens). The roofline of cost_model/compute.py ([Note:
    roofline]) on what the rank runs: `spec.routing_skew` times the mean's 2 x T k x 3 I H
    FLOPs at the per-expert GEMMs' efficiency, m = ep T k / E rows each ([Note: matmul
    efficiency curve]); bytes: its E / ep experts' weights (3 E I H / ep elements) and its
    tokens in and out (2 T H at ep 1, the received pairs 2 T k H under ep, times the skew);
    the backward 3x the forward (autoplan/experts.py BACKWARD_FLOPS_FACTOR). `expert_layers`'
    first layer's E stands for every layer. Under tp, which splits the experts (E / (ep tp) on
    a rank, the tokens replicated), a rank computes 1 / tp of the choices, with the same rows
    per expert."""
    num_experts, k = layers.num_experts[0], layers.top_k
    hidden, inter, width = layers.hidden, layers.intermediate, spec.dtype_bytes
    skew = spec.routing_skew if ep > 1 or tp > 1 else 1.0  # a rank's work is its own tokens'
    flops = skew * 2 * tokens * k * 3 * inter * hidden / tp
    rows = (k / tp if ep > 1 else 1) * tokens * hidden
    nbytes = (3 * num_experts * inter * hidden / (ep * tp) + 2 * skew * rows) * width
    efficiency = matmul_efficiency(min(ep * tokens * k / num_experts, inter, hidden), device)
    forward = max(flops / (device.flops_per_s(spec.dtype) * efficiency),
                  nbytes / device.mem_bw_bytes_per_s)
    return (1 + BACKWARD_FLOPS_FACTOR) * forward


def ep_step_delta_s(layers: ExpertLayers, cfg: Config, spec: TrainingSpec,
                    topology: Topology) -> tuple[float, float, float]:
    """(all-to-all seconds per step, change of the exposed dp sync seconds, change of the
    routed experts' compute seconds per step) of `cfg`'s expert parallelism (`cfg.ep`) against
    the same configuration at ep = 1, on the busiest rank ([Note: expert parallelism]). None
    of the three depends on the placement (at tp > 1, among those that split the experts on
    tp: the only ones ep runs with), so they shift every placement's step time alike."""
    ep = cfg.ep
    tokens = cfg.microbatch_size * spec.seq_len
    per_rank_layers = layers.num_layers / cfg.pp
    pairs = tokens * layers.top_k / cfg.tp  # a tp rank exchanges the choices of its experts
    a2a = lambda n: collective_time_s("all_to_all", n, ep, topology, stride=cfg.tp)  # noqa: E731
    # the busiest rank receives routing_skew times the mean's pairs, and every rank waits
    # for it; the ids and weights' exchanges cost their latency either way
    per_layer = (4 * a2a(spec.routing_skew * pairs * layers.hidden * spec.dtype_bytes)
                 + 4 * a2a(pairs * 8))
    a2a_s = per_layer * per_rank_layers * cfg.num_microbatches
    compute_s = (experts_time_s(layers, tokens, ep, spec, topology.device, cfg.tp)
                 - experts_time_s(layers, tokens, 1, spec, topology.device, cfg.tp)
                 ) * per_rank_layers * cfg.num_microbatches
    # per device: the experts split on tp; the rest as if split too (only the difference of
    # the dp collectives' bandwidth terms, linear in the bytes, matters here)
    experts = layers.expert_elems / (cfg.pp * cfg.tp)
    total = layers.model_elems / (cfg.pp * cfg.tp)
    frozen_experts = layers.frozen_expert_elems / (cfg.pp * cfg.tp)
    frozen_total = layers.frozen_model_elems / (cfg.pp * cfg.tp)
    base = Config(cfg.pp, cfg.dp, cfg.tp, cfg.zero_stage, cfg.num_microbatches,
                  cfg.microbatch_size, cfg.schedule, cfg.num_virtual_stages)
    before = dp_sync_s(base, spec, topology, total, frozen=frozen_total)
    # the slices outside FSDP2: all-reduced over the dp / ep ranks that hold one (stride
    # tp x ep), and under ZeRO-1 their stepped rows all-gathered there ([Note: ZeRO-1
    # partition]); no ZeRO-2/3 gathers
    outer = Config(cfg.pp, cfg.dp // ep, cfg.tp * ep, 1 if cfg.zero_stage == 1 else 0,
                   cfg.num_microbatches, cfg.microbatch_size, cfg.schedule,
                   cfg.num_virtual_stages)
    after = dp_sync_s(base, spec, topology, total - experts,
                      frozen=frozen_total - frozen_experts) + dp_sync_s(
        outer, spec, topology, experts / ep, frozen=frozen_experts / ep)
    return a2a_s, (1 - DP_SYNC_OVERLAP) * (after - before), compute_s


def with_expert_parallel(a: Assessment, delta: tuple[float, float, float]) -> Assessment:
    """The assessment `a` of an ep > 1 configuration as ep = 1 prices it (its memory already
    priced with the expert slices held whole: step_time.assess' `experts`) with the step
    time of ep added: `delta`, its configuration's `ep_step_delta_s` (the all-to-alls, the
    changed dp sync, the experts' compute)."""
    a2a_s, sync_s, compute_s = delta
    return dataclasses.replace(
        a, step_time_s=a.step_time_s + a2a_s + sync_s + compute_s,
        comm_s=a.comm_s + a2a_s + sync_s, compute_s=a.compute_s + compute_s)


EP_SAVED_INDEX_BYTES = 3 * 8
"""int64 bytes per (token, choice) pair the exchange keeps besides its two (T k, H) buffers:
the received expert ids (saved by the experts op), the pair order and the token of each pair
(saved by the index ops that gather and combine), autoplan/runtime/expert_parallel.py."""


def expert_slices(layers: ExpertLayers, ep: int, tokens: int = 0,
                  dtype_bytes: int = 2, routing_skew: float = 1.0,
                  tp: int = 1) -> ExpertSlices:
    """The expert weights of `layers` as a rank holds them under ep (rank_memory.ExpertSlices:
    its 1 / ep slice, whole, outside FSDP2), and what the exchange keeps for the backward per
    microbatch of `tokens` tokens per rank, activations `dtype_bytes` wide: per MoE layer the
    received (token, choice) pairs (T k, H) and routing weights (T k,) the experts op saves in
    place of the rank's hidden (T, H) and weights (T, k), the combined outputs (T k, H)
    `index_add` keeps (its derivative reads the source: derivatives.yaml), and the int64
    indices (EP_SAVED_INDEX_BYTES); the hidden and weights the plan's saved tensors price
    ([Note: saved tensors]) stay saved by the router. On the busiest rank (the one that sets
    the peak), `routing_skew` times the mean's pairs: the dropless exchange sizes its receive
    buffers by the pairs routed ([Note: expert parallelism]). Measured by the dry run
    (bench/dryrun.py, mixtral-8x7b-ep8, balanced routing: 4 (T, H) buffers per MoE layer and
    microbatch at top-2). Under tp (which splits the experts, [Note: experts over ep and tp]
    in runtime/expert_parallel.py) a rank holds 1 / (ep tp) of them and exchanges the pairs of
    its tp share, 1 / tp of its tokens' choices."""
    pairs = tokens * layers.top_k * routing_skew / tp
    per_layer = pairs * (2 * layers.hidden * dtype_bytes + dtype_bytes + EP_SAVED_INDEX_BYTES)
    return ExpertSlices(layers.expert_elems / tp, layers.frozen_expert_elems / tp, ep,
                        act_bytes=per_layer * layers.num_layers if ep > 1 else 0.0,
                        num_layers=layers.num_layers)
