"""Analytic step time of one configuration, given a solved placement (`assess`, with the
rank memory of rank_memory.py), and its pipeline term alone (`pipeline_time_s`).

[Note: step time] For pp ranks, v model chunks per rank (interleaved 1F1B), m microbatches, R =
dp x cp x tp ranks per pipeline stage and N = min(world, devices_per_node) ranks per node (with
context parallelism every per-microbatch figure is one cp rank's: seq_len / cp tokens, the K/V
collectives in tp_comm_r, [Note: context parallelism] in cost_model/context_parallel.py):

    t_comp   = max over pp ranks r of compute_r / speed(N)     one microbatch, fwd + bwd
    t_comm   = max over pp ranks r of (tp_comm_r + p2p_r)      (compute and comm of the busiest)
    pipeline = sum over slots j = 0 .. m v + pp - 2 of
               (t_comp speed(N) / speed(a_j R) + t_comm) / v,   a_j = min(j + 1, pp, m v,
                                                                         m v + pp - 1 - j)
    step     = pipeline + dp_sync + dp_local + optimizer + drift

- speed(n) = DeviceSpec.speed(n): the fraction of its solo speed a device keeps while n devices
  of its node compute (1 for GPUs; measured for CPU ranks sharing cores, `autoplan calibrate`).
  In SPMD all N ranks of a node compute at once, so a microbatch's compute runs at speed(N).
- The pipeline is m v + pp - 1 slots of one chunk-microbatch each, a_j of the pp stages busy in
  slot j (fill and drain). With dedicated devices (speed 1) this is the textbook
  m t_stage + (pp - 1) t_stage / v (Narayanan et al. SC'21: bubble fraction (p - 1) / m,
  (p - 1) / (v m) interleaved; FORMULAS.md "FLOPs and pipeline"). Ranks that share cores run
  faster while others idle in the bubble, so there a slot's compute takes t_comp speed(N) /
  speed(a_j R). `bubble_s` = pipeline - m (t_comp + t_comm). Under the zero-bubble schedule
  the slots are units of a third of a chunk-microbatch, 3 m v + pp - 1 of them, and the busy
  ranks of each come from running torch's actions in unit time ([Note: zero-bubble time] in
  cost_model/schedule_time.py).
- p2p_r = 2 v pipeline_hop_time_s(boundary bytes) per microbatch on a pipeline rank (the
  activation forward and its gradient backward, v times with interleaving) when pp > 1: one
  message of the slowest hop, at the link level it crosses given where the stages' ranks sit
  on the nodes (cost_model/comm.py [Note: pipeline hops]); the R pairs of a stage boundary
  send at once.
- dp_sync, over the dp group (stride tp; dp x cp ranks with context parallelism, whose ranks
  reduce and shard like data-parallel ones), G / W = the rank's gradient / parameter bytes, as the
  runtime issues it (autoplan/runtime/engine.py, step 4: one FSDP2 unit per block and one per
  stage root, `_dp_units`; each collective below is issued per unit on the unit's share of
  the bytes, so the latency and straggler terms are paid per unit):
    ZeRO 0: all_reduce(G) (FSDP2 replicate)          ZeRO 1: all_reduce(G) + all_gather(M)
    ZeRO 2: reduce_scatter(G) + all_gather(W)       ZeRO 3: reduce_scatter(G) + 2 all_gather(W)
  (ZeRO-1's M: the parameters it steps at the master precision they are held in, fp32 under
  mixed precision, gathered with one all-gather per parameter tensor: runtime/zero1.py [Note:
  ZeRO-1 partition])
  (ZeRO-3 gathers the parameters for the forward and again for the backward: 1.5x the traffic of
  ZeRO 0-2, ZeRO section 7, FORMULAS.md). Without pipelining the engine accumulates microbatches
  by calling backward m times: replicated gradients (ZeRO 0, 1) are reduced once, after the
  last (DDP's no_sync), while ZeRO 2/3 reduce-scatter (and re-gather) on every one, m times, so
  that gradients stay sharded; the pipelining schedules reduce once, on the last microbatch,
  while ZeRO-3 still gathers for every microbatch. DP_SYNC_OVERLAP of it is hidden behind compute.
- dp_local: the local passes of the runtime around the dp collectives -- packing gradients into
  a flat buffer, dividing, unpacking; copying parameter shards into and gathered parameters out
  of each FSDP2 all-gather (`_dp_local_s`) -- at mem_bw, over speed(N); exposed, like
  dp_sync.
- optimizer = [(parameters whose states this rank steps) x OPTIMIZER_BYTES_PER_PARAM /
  mem_bw + (parameter tensors it steps) x OPTIMIZER_OPS_PER_TENSOR x op_s] / speed(N): a
  memory-bound pass over the states plus the host time of the per-tensor ops (the fused
  AdamW update's figures on devices that fuse, `optimizer_pass`) (op_s =
  DeviceSpec.optimizer_op_s, or dtensor_optimizer_op_s when the parameters are DTensors: tp > 1,
  or dp > 1 with FSDP2, i.e. ZeRO 0, 2, 3).
- drift = DeviceSpec.skew_slope(N) x (m t_comp + optimizer) when the rank meets others at
  collectives (tp x dp x cp > 1): ranks sharing cores drift apart in proportion to the compute
  between their meetings, and the sum of that compute over a step is the step's compute, so the
  step waits slope x compute for stragglers beyond the per-collective intercept that
  `collective_time_s` adds (cost_model/comm.py [Note: stragglers]). 0 on the GPU presets
  (no fit); pipeline send/recv between stages is the pipeline term's.
- offload (a configuration's `offload`, [Note: offload] in cost_model/offload.py): the optimizer
  term becomes the host step, and the host <-> device transfers join the exposed
  communication; the offloaded states leave the device's memory for the host's.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

from autoplan.cost_model import offload as offload_costs
from autoplan.cost_model.comm import pipeline_hop_time_s
from autoplan.cost_model.config import Config, rank_layers, rank_shares
from autoplan.cost_model.dp_sync import (
    dp_local_s, dp_sync_s, num_dp_gathers, num_dp_reductions, num_dp_units,
)
from autoplan.cost_model.placement_totals import Solution
from autoplan.cost_model.rank_memory import (
    ExpertSlices, candidate_ranks, frozen_param_bytes, rank_peak,
)
from autoplan.cost_model.schedule_time import busy_ranks, zero_bubble_units
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology

__all__ = ["DP_SYNC_OVERLAP", "OPTIMIZER_BYTES_PER_PARAM", "OPTIMIZER_OPS_PER_TENSOR",
           "optimizer_pass", "Assessment", "assess", "pipeline_time_s"]

DP_SYNC_OVERLAP = 0.0
"""Fraction of the data-parallel gradient sync (and ZeRO-3 parameter gathers) hidden behind
compute: none is credited. autoplan/runtime/engine.py makes one FSDP2 (or replicate) unit per
block, so on GPUs FSDP2 can overlap a block's reduce-scatter with the next block's backward, and
the runtime prefetches the next block's all-gather without waiting for it
([Note: forward prefetch] in runtime/parallel.py); that overlap is not modelled (the dp collectives are priced
in full, a conservative bound; issue 27 is to price it). On CPU ranks (gloo) little is hidden: a
13 MB all_reduce issued asynchronously while the rank computes adds about as much to the step
as one issued after the compute (2 and 4 ranks of this repository's 2-core machine, 2026-12-04,
~7 vs 11 ms and 55 vs 61 ms), because gloo's transfers need the cores the compute holds; the
prefetched ZeRO-3 all-gathers took a dp4 step 3.5% below FSDP2's blocking default, a control
run of the default itself 1.2% above it (bench/overlap.py, 2026-12-07). Megatron-LM, in the runs of
Narayanan et al. SC'21 that bench/published.py checks, all-reduced the data-parallel gradients
after the pipeline flush."""


OPTIMIZER_BYTES_PER_PARAM = {"adamw": 80.0, "sgd": 12.0}
"""Bytes an optimizer step moves per fp32 parameter it updates. Derived from torch's AdamW
(torch/optim/adam.py, `_single_tensor_adam` with decoupled weight decay; the foreach variant
makes the same passes): param.mul_ (read/write p: 2 accesses), exp_avg.lerp_ (m, g -> m: 3),
exp_avg_sq.mul_ + addcmul_ (v -> v, v, g -> v: 5), denom = sqrt, div, add_ (6), param.addcdiv_
(p, m, denom -> p: 4): 20 accesses of 4 bytes. SGD without momentum: param.add_(grad): 3 x 4."""


OPTIMIZER_OPS_PER_TENSOR = {"adamw": 9, "sgd": 1}
"""Ops an optimizer step runs per parameter tensor, from the same functions: AdamW's step
counter add_, then param.mul_, exp_avg.lerp_, exp_avg_sq.mul_ and addcmul_, sqrt, div, add_,
param.addcdiv_ (bias corrections are Python floats); SGD without momentum: param.add_."""


FUSED_ADAMW_BYTES_PER_PARAM, FUSED_ADAMW_OPS_PER_TENSOR = 28.0, 2
"""The fused AdamW update ([Note: fused AdamW] in autoplan/runtime/optim.py, kernels/adamw.py),
the runtime's default on devices whose kernels fuse: one kernel reads p, g, m, v and writes p, m,
v once, 7 accesses of 4 bytes; per tensor the step counter's add_ and the kernel's launch."""


def optimizer_pass(spec: TrainingSpec, device) -> tuple[float, int]:
    """(bytes moved per fp32 parameter, ops per parameter tensor) of one optimizer step on
    `device` (a DeviceSpec): the fused AdamW update where the device's kernels fuse
    (`DeviceSpec.fuses_pointwise`: the GPU presets, where the runtime's default AdamW runs the
    Triton kernel), else torch's unfused passes (OPTIMIZER_BYTES_PER_PARAM,
    OPTIMIZER_OPS_PER_TENSOR; 0 for an optimizer not in them)."""
    if spec.optimizer == "adamw" and device.fuses_pointwise:
        return FUSED_ADAMW_BYTES_PER_PARAM, FUSED_ADAMW_OPS_PER_TENSOR
    return (OPTIMIZER_BYTES_PER_PARAM.get(spec.optimizer, 0.0),
            OPTIMIZER_OPS_PER_TENSOR.get(spec.optimizer, 0))


@dataclass
class Assessment:
    """Predicted figures of one configuration (seconds, bytes)."""

    config: Config
    step_time_s: float
    compute_s: float
    comm_s: float
    bubble_s: float
    dp_sync_s: float
    memory_bytes: float
    memory_breakdown: dict[str, float] = field(default_factory=dict)
    fits: bool = True
    solution: Solution | None = None
    optimizer_s: float = 0.0
    cp_comm_s: float = 0.0
    offload: str = "none"
    host_memory_bytes: float = 0.0
    offload_transfer_s: float = 0.0
    transient_bytes: float = 0.0  # the checkpointing policy's (rank_memory.rank_peak)


def pipeline_time_s(cfg: Config, sol: Solution, topology: Topology, *, total_layers: int,
                    boundary_bytes: float) -> float:
    """The pipeline term of [Note: step time] (seconds): `assess`'s step time less the
    exposed data-parallel and offload time and the optimizer, all >= 0 -- so never more than
    `assess(cfg, sol, ...).step_time_s`, whatever the ZeRO stage, offload and memory (the
    planner's first bound, planner.py)."""
    return _stage_times(cfg, sol, topology, total_layers, boundary_bytes)[-1]


def _stage_times(cfg: Config, sol: Solution, topology: Topology, total_layers: int,
                 boundary_bytes: float) -> tuple:
    """(layers per rank, busy ranks per node, speed, candidate ranks, their shares, t_comp,
    t_comm, the busiest rank's cp communication, pipeline) of [Note: step time]."""
    layers = rank_layers(cfg, total_layers)
    v = cfg.num_virtual_stages
    busy = min(topology.devices_per_node, cfg.world_size)
    speed = topology.device.speed(busy)
    # what a tp rank sends: its local boundary (a tp-th under sequence parallelism)
    sent_bytes = boundary_bytes if sol.boundary_bytes is None else sol.boundary_bytes
    p2p = 2 * v * pipeline_hop_time_s(sent_bytes, topology, pp=cfg.pp,
                                      stage_ranks=cfg.tp * cfg.cp * cfg.dp, num_virtual_stages=v)
    per_rank = []
    ranks = candidate_ranks(cfg, layers)
    shares = {r: rank_shares(r, cfg, layers, total_layers) for r in ranks}

    def on(r: int, per_part: dict[str, float]) -> float:
        return sum(per_part.get(p, 0.0) * s for p, s in shares[r].items())

    for r in ranks:
        comp = on(r, sol.compute_s) / speed
        comm = on(r, sol.comm_s)
        per_rank.append((comp + comm + p2p, comp, comm + p2p, on(r, sol.cp_comm_s)))
    _t_stage, comp, comm, cp_comm = max(per_rank)
    pipeline = _pipeline_s(cfg, comp, comm, topology, busy)
    return layers, busy, speed, ranks, shares, comp, comm, cp_comm, pipeline


def assess(cfg: Config, sol: Solution, spec: TrainingSpec, topology: Topology, *,
           total_layers: int, output_bytes: float, boundary_bytes: float,
           param_tensors: dict[str, float] | None = None,
           offload: str = "none", transient_bytes: float = 0.0,
           experts: ExpertSlices | None = None, memory: bool = True) -> Assessment:
    """[Note: step time] and [Note: memory per rank] of `cfg` with placement `sol`;
    `param_tensors`: parameter tensors per part ("pre", "layer": all blocks, "post") for the
    optimizer's per-tensor ops (none: not priced); `offload`: [Note: offload] (the host
    memory is checked against the rank's share of its node's); `transient_bytes`: the
    checkpointing policy's recomputation transient (rank_memory.rank_peak); `experts`: the
    expert slices of an ep > 1 configuration, held whole beside FSDP2 (rank_memory.ExpertSlices;
    the step time of ep is cost_model/expert_parallel.py's, added by the caller); `memory`
    False: the step time alone, the same float (a bound's, [Note: time first] in
    solver/branch_bound.py), device memory not priced (memory_bytes NaN, fits False).

    Raises ValueError (from the cost model) when a mesh group straddles nodes unevenly.
    """
    layers, busy, speed, ranks, shares, comp, comm, cp_comm, pipeline = _stage_times(
        cfg, sol, topology, total_layers, boundary_bytes)
    param_tensors = param_tensors or {}

    def on(r: int, per_part: dict[str, float]) -> float:
        return sum(per_part.get(p, 0.0) * s for p, s in shares[r].items())

    breakdown, peak = {}, math.nan
    if memory:
        memories = {r: rank_peak(cfg, sol, spec, r, layers, total_layers, output_bytes,
                                  boundary_bytes, offload, shares[r], experts=experts,
                                  transient_bytes=transient_bytes) for r in ranks}
        worst = max(ranks, key=lambda r: memories[r]["peak"])
        breakdown = {k: val for k, val in memories[worst].items() if k != "peak"}
        peak = memories[worst]["peak"]
    elems, frozen = _most_elems(cfg, sol, spec, topology, [shares[r] for r in ranks], speed)
    tensors = max(on(r, param_tensors) for r in ranks)  # trainable ones (Problem.param_tensors)
    dp_sync = dp_sync_s(cfg, spec, topology, elems, num_dp_units(cfg, layers), frozen, tensors)
    exposed = (1 - DP_SYNC_OVERLAP) * dp_sync + dp_local_s(
        cfg, spec, topology, elems, frozen) / speed
    if offload == "none":
        transfers, optimizer = 0.0, _optimizer_s(cfg, spec, topology, elems - frozen, tensors,
                                                 speed)
    else:
        transfers, optimizer = offload_costs.offload_time_s(
            offload=offload, zero_stage=cfg.zero_stage, dp=cfg.dp_shard, elems=elems,
            tensors=tensors, gathers=num_dp_gathers(cfg),
            reductions=num_dp_reductions(cfg), spec=spec, topology=topology,
            optimizer_bytes_per_param=OPTIMIZER_BYTES_PER_PARAM.get(spec.optimizer, 0.0),
            optimizer_ops_per_tensor=OPTIMIZER_OPS_PER_TENSOR.get(spec.optimizer, 0),
            speed=speed, ranks_on_node=busy, frozen=frozen,
            frozen_param_bytes=frozen_param_bytes(spec))
        exposed += transfers
    host = offload_costs.host_state_bytes(elems, cfg.zero_stage, cfg.dp_shard, offload, spec,
                                frozen=frozen, frozen_param_bytes=frozen_param_bytes(spec))
    m = cfg.num_microbatches
    if cfg.tp * cfg.dp_shard > 1:  # drift between meetings ([Note: step time])
        exposed += topology.device.skew_slope(busy) * (m * comp + optimizer)
    fits = memory and peak <= spec.max_memory_fraction * topology.device.mem_bytes and (
        offload == "none" or host <= offload_costs.host_budget_bytes(topology, spec, busy))
    return Assessment(cfg, pipeline + exposed + optimizer, m * comp + optimizer,
                      m * comm + exposed, _bubble_s(cfg, pipeline, m * (comp + comm)),
                      dp_sync, peak, breakdown, fits, sol, optimizer, m * cp_comm, offload, host,
                      transfers, transient_bytes)


def _bubble_s(cfg: Config, pipeline_s: float, busy_s: float) -> float:
    """The pipeline's idle part: exactly 0 without pp (not a float residue of the
    difference), never negative."""
    return 0.0 if cfg.pp == 1 else max(0.0, pipeline_s - busy_s)


def _pipeline_s(cfg: Config, comp: float, comm: float, topology: Topology, busy: int) -> float:
    """The pipeline term of [Note: step time]: m v + pp - 1 slots of one chunk-microbatch."""
    pp, v, m = cfg.pp, cfg.num_virtual_stages, cfg.num_microbatches
    per_stage = max(1, busy // pp)  # R ranks of a stage on this node
    device = topology.device
    if cfg.schedule == "interleaved-zb" and pp > 1:  # units of a third of a chunk-microbatch
        unit = (comp + comm) / (3 * v)
        if not device.shared_speed:
            return zero_bubble_units(pp, v, m) * unit
        return sum((comp * device.speed(busy) / device.speed(a * per_stage) + comm) / (3 * v)
                   for a in busy_ranks(cfg.schedule, pp, v, m))
    if not device.shared_speed:  # dedicated devices: every slot at speed 1
        return (m * v + pp - 1) * (comp + comm) / v
    total = 0.0
    for j in range(m * v + pp - 1):
        active = min(j + 1, pp, m * v, m * v + pp - 1 - j)
        scale = device.speed(busy) / device.speed(active * per_stage)
        total += (comp * scale + comm) / v
    return total


def _optimizer_s(cfg: Config, spec: TrainingSpec, topology: Topology, elems: float,
                 tensors: float, speed: float) -> float:
    """Optimizer step of one rank ([Note: step time], optimizer): a memory-bound pass over the
    states it steps plus the host time of the per-tensor ops."""
    # ZeRO >= 1 shards the states: a dp-th of the elements, a shard of every tensor (ZeRO-1:
    # plain tensors, views of its rows, runtime/zero1.py; FSDP2's ZeRO 2, 3: DTensors)
    shard, device = cfg.dp_shard, topology.device
    per_param, ops = optimizer_pass(spec, device)
    nbytes = elems / (shard if cfg.zero_stage >= 1 else 1) * per_param
    zero1 = cfg.zero_stage == 1 and shard > 1
    dtensor = not zero1 and (cfg.tp > 1 or shard > 1)
    op_s = device.dtensor_optimizer_op_s if dtensor else device.optimizer_op_s
    host = tensors * ops * op_s
    return (nbytes / device.mem_bw_bytes_per_s + host) / speed


def _most_elems(cfg: Config, sol: Solution, spec: TrainingSpec, topology: Topology,
                shares: list[dict[str, float]], speed: float) -> tuple[float, float]:
    """(parameter elements, of which frozen) of the rank whose parameters cost the most
    ([Note: step time]: dp_sync, dp_local, optimizer): the rank with the most elements when
    all train; with frozen ones (no reduction, no optimizer step), the rank where those terms
    (the per-tensor ops left out: every rank is priced at the most tensors) take longest."""
    ranks = [(sol.param_elems_on(share), sol.frozen_elems_on(share)) for share in shares]
    if not any(frozen for _elems, frozen in ranks):
        return max(ranks)

    def cost_s(t: tuple[float, float]) -> float:
        elems, frozen = t
        return (dp_sync_s(cfg, spec, topology, elems, frozen=frozen)
                + dp_local_s(cfg, spec, topology, elems, frozen) / speed
                + _optimizer_s(cfg, spec, topology, elems - frozen, 0.0, speed))
    return max(ranks, key=cost_s)
