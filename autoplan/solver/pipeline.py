"""Analytic step time and memory of one configuration, given a solved placement.

[Note: step time] For pp ranks, v model chunks per rank (interleaved 1F1B), m microbatches, R =
dp x cp x tp ranks per pipeline stage and N = min(world, devices_per_node) ranks per node (with
context parallelism every per-microbatch figure is one cp rank's: seq_len / cp tokens, the K/V
collectives in tp_comm_r, [Note: context parallelism] in solver/context.py):

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
  speed(a_j R). `bubble_s` = pipeline - m (t_comp + t_comm).
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
- offload (a configuration's `offload`, [Note: offload] in solver/offload.py): the optimizer
  term becomes the host step, and the host <-> device transfers join the exposed
  communication; the offloaded states leave the device's memory for the host's.

[Note: memory per rank] Rank r holds the layers of its stages; the first rank also what comes
before the blocks, the last rank what comes after. Its peak is cost_model.memory.
peak_memory_bytes ([Note: peak moments] there) with model_state_bytes of its parameter elements
(after tp), its activations per microbatch times pipeline_in_flight_microbatches(schedule, pp,
m, r, v), the logits (graph output, replicated) on the last rank, and what this runtime adds
(autoplan/runtime/engine.py, step 4: one FSDP2 unit per block, autoplan/passes/blocks.py, and
one for the rest of the stage):
- with dp > 1 under ZeRO 0-2 every unit's parameters are gathered (FSDP2's replicate gathers
  them too) and stay gathered from the forward to the end of the backward, so the stage's are,
  whole; ZeRO-2 also holds the all-gather input (a dp-th) and the unsharded gradients of the
  whole stage before the reduction: `gather_unit_bytes` = the stage's parameters at compute
  precision;
- ZeRO-3 (dp > 1) reshards each block after its forward: held at once are the rest of the
  stage (a root unit stays gathered from forward to backward) and two blocks (the current one
  and the one FSDP2 prefetches), and the unsharded gradients of the rest and one block --
  except under the interleaved schedule, whose torch runtime gathers whole stages
  (`STAGES_UNSHARDED` of the rank's v chunks at once; measured by the dry run on a LoRA
  Llama at pp2 x dp2 v2: the whole rank gathered in the forward);
- mixed precision at dp 1: FSDP2 still makes the 16-bit compute copy of the units;
- gradients exist while activations are at their height only when an earlier microbatch's
  backward made them (`grads_at_activation_peak`): gradient accumulation without pipelining
  (m > 1), 1F1B with more microbatches than the rank holds in flight; not for m = 1 or GPipe
  (the step starts with set_to_none gradients);
- pipeline receive buffers (comm_buffers): the runtime allocates a receive buffer when it posts
  the receive and drops it once the forward or backward of its microbatch consumed it ([Note:
  in-flight receive buffers] in autoplan/_torch_compat.py): one buffer per side the rank
  receives across, activations from the previous stage and gradients from the next, boundary
  bytes each (torch's 1F1B and GPipe post a receive just before the compute that reads it; its
  interleaved runtime posts them as early as the sender allows, which its action IR shows is
  one of each at a rank's peak). A received activation, once its forward ran, is the stage's
  input, saved for backward and counted with the activations (the first layer's input);
- stage outputs kept for backward: torch's pipeline stage keeps each microbatch's output until
  that microbatch's backward (`fwd_cache`; the next stage received a copy), one boundary per
  in-flight chunk-microbatch of a chunk that sends forward: in_flight x (v, less the last
  stage's chunk on the last rank) boundary bytes at moment A, counted with the activations
  (Megatron-LM's `deallocate_output_tensor` frees these; torch 2.13 does not). GPipe holds all
  m, 1F1B min(m, pp - r): nothing in the runtime grows with m beyond what is in flight.
A boundary (stage output, receive buffer) is the tensor a tp rank sends and receives: the
producer's local value (runtime/parallel.py tp_stage_forward), the whole residual stream when it
is replicated and a tp-th of it when it is split (sequence parallelism, [Note: sequence
parallelism] in solver/sequence.py): Costs.boundary_bytes per candidate of the block-output
node, RankMemory.boundary_coef boundaries per rank. (Korthikanti et al. 2022 count neither:
Megatron-LM's `deallocate_output_tensor` frees the outputs' data once sent.)
`rank_memories` gives the ILP the same quantities as linear forms, one per moment and rank.

[Note: deferred reduction] With pipelining, torch's schedules (torch 2.13, torch/distributed/
pipelining/stage.py `backward_maybe_with_nosync`, `perform_reduce_grad`) run every backward of an
FSDP2 stage with `set_requires_gradient_sync(False)` and `set_reshard_after_backward(False)` and
reduce each stage once, in its REDUCE_GRAD action after its last backward. Under ZeRO-2/3 with
dp > 1 (`_deferred_reduction`) a rank therefore holds, in place of the above:
- from its first backward on, each chunk's gradients unsharded, accumulated in the policy's
  reduce dtype (fp32 under mixed precision, `_reduce_bytes`; FSDP2's
  `unsharded_accumulated_grad`), and no sharded gradient until the chunk is reduced. Moment A
  (activations at their height, once an earlier microbatch's backward ran: `_grads_at_peak`)
  holds them for all of the rank's parameters; the gathered parameters at A are as above (a
  forward reshards a ZeRO-3 block after it);
- moment B, the last backward of the rank's first chunk (stage r, the chunk that finishes last:
  backward runs from the last stage to the first), holds that chunk gathered whole (a block
  gathered for a backward stays gathered; its unsharded parameters at compute precision), its gradients unsharded, the other chunks reduced
  (their gradients sharded, their parameters resharded), and -- when its REDUCE_GRAD starts,
  one microbatch's last activations and receive buffer aside, counted at B to keep one form
  per moment -- the reduce-scatter input FSDP2 copies the first unit's gradients into (the
  stage's root unit where it holds parameters, "pre" on the first rank and "post" on the last
  with one chunk, FSDP2 reducing its states root first; else a block: `_first_reduced`).
Measured by the dry run (0.5B GPT-2, pp2 x dp2 ZeRO-3: 4.116 GB with one chunk, 3.436 GB with
two, against 4.119 and 3.440 by this account), and on tiny GPTs at pp2 x dp4 (ZeRO-2, ZeRO-3,
1F1B, interleaved, fp32 and bf16): -3% .. +6%.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from autoplan.cost_model.comm import collective_time_s, pipeline_hop_time_s
from autoplan.cost_model.memory import (
    STATE_BYTES_PER_PARAM, model_state_bytes, peak_memory_bytes, pipeline_in_flight_microbatches,
)
from autoplan.plan import Stage
from autoplan.solver import offload as off
from autoplan.solver.ilp_types import RankMemory, Solution
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology

__all__ = ["DP_SYNC_OVERLAP", "OPTIMIZER_BYTES_PER_PARAM", "OPTIMIZER_OPS_PER_TENSOR",
           "optimizer_pass", "frozen_param_bytes", "Config",
           "Assessment", "stages_of", "config_stages",
           "assess", "pipeline_time_s", "rank_memories", "rank_peaks"]

DP_SYNC_OVERLAP = 0.0
"""Fraction of the data-parallel gradient sync (and ZeRO-3 parameter gathers) hidden behind
compute: none is credited. autoplan/runtime/engine.py makes one FSDP2 (or replicate) unit per
block, so on GPUs FSDP2 can overlap a block's reduce-scatter with the next block's backward and
prefetch the next block's all-gather; that overlap is not modelled (the dp collectives are priced
in full, a conservative bound). On CPU ranks (gloo) there is none to credit: a 13 MB all_reduce
issued asynchronously while the rank computes adds about as much to the step as one issued after
the compute (2 and 4 ranks of this repository's 2-core machine, 2026-12-04, ~7 vs 11 ms and 55
vs 61 ms), because gloo's transfers need the cores the compute holds. Megatron-LM, in the runs of
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



@dataclass(frozen=True)
class Config:
    """One point of the outer search (mesh, ZeRO stage, microbatching, schedule)."""

    pp: int
    dp: int
    tp: int
    zero_stage: int
    num_microbatches: int
    microbatch_size: int
    schedule: str
    num_virtual_stages: int = 1
    cp: int = 1
    stage_layers: tuple[int, ...] = ()
    """Blocks per pipeline stage, in stage order, as the user pinned them (`stages=` of
    `plan()`); () for the even split of `stages_of`."""

    @property
    def dp_shard(self) -> int:
        """Ranks that reduce gradients and share ZeRO shards: dp x cp (torchtitan's
        dp_shard x cp FSDP mesh, [Note: context parallelism] in solver/context.py)."""
        return self.dp * self.cp

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def __str__(self) -> str:
        v = f" v{self.num_virtual_stages}" if self.num_virtual_stages > 1 else ""
        cp = f" x cp{self.cp}" if self.cp > 1 else ""
        stages = (f" (stages of {'/'.join(map(str, self.stage_layers))} blocks)"
                  if self.stage_layers else "")
        return (f"pp{self.pp} x dp{self.dp}{cp} x tp{self.tp}, ZeRO-{self.zero_stage}, "
                f"{self.num_microbatches} microbatches of {self.microbatch_size}, "
                f"{self.schedule}{v}{stages}")


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
    transient_bytes: float = 0.0  # the checkpointing policy's, on every rank (with_transient)


def stages_of(total_layers: int, num_stages: int) -> tuple[Stage, ...]:
    """Split `total_layers` blocks into `num_stages` contiguous stages, as evenly as possible,
    the first stages taking one more when it does not divide (the last stage carries the head)."""
    if total_layers == 0:
        return tuple(Stage(i, 0, 0) for i in range(num_stages))
    base, extra = divmod(total_layers, num_stages)
    out, start = [], 0
    for i in range(num_stages):
        n = base + (1 if i < extra else 0)
        out.append(Stage(i, start, start + n))
        start += n
    return tuple(out)


def config_stages(cfg: Config, total_layers: int) -> tuple[Stage, ...]:
    """The pipeline stages of `cfg`: its pinned `stage_layers`, else `stages_of`'s even
    split of `total_layers` into pp x v stages."""
    return _stages(cfg.pp * cfg.num_virtual_stages, cfg.stage_layers, total_layers)


def _rank_layers(cfg: Config, total_layers: int) -> tuple[int, ...]:
    """Layers per pipeline rank (its v chunks together)."""
    return _layers_per_rank(cfg.pp, cfg.num_virtual_stages, total_layers, cfg.stage_layers)


@functools.lru_cache(maxsize=4096)
def _stages(num_stages: int, stage_layers: tuple[int, ...],
            total_layers: int) -> tuple[Stage, ...]:
    if not stage_layers:
        return stages_of(total_layers, num_stages)
    starts = [sum(stage_layers[:i]) for i in range(len(stage_layers) + 1)]
    return tuple(Stage(i, starts[i], starts[i + 1]) for i in range(len(stage_layers)))


@functools.lru_cache(maxsize=4096)
def _layers_per_rank(pp: int, v: int, total_layers: int,
                     stage_layers: tuple[int, ...] = ()) -> tuple[int, ...]:
    per_rank = [0] * pp
    for st in _stages(pp * v, stage_layers, total_layers):
        per_rank[st.index % pp] += st.num_layers
    return tuple(per_rank)


def _share(part: str, r: int, cfg: Config, layers: list[int], total_layers: int) -> float:
    """Fraction of a part's (weighted total) quantity that rank r holds."""
    if part == "layer":
        return layers[r] / total_layers if total_layers else 0.0
    if part == "pre":
        return 1.0 if r == 0 else 0.0
    return 1.0 if r == cfg.pp - 1 else 0.0


def _shares(r: int, cfg: Config, layers, total_layers: int) -> dict[str, float]:
    """`_share` of each part ("pre", "layer", "post") on rank r."""
    return {p: _share(p, r, cfg, layers, total_layers) for p in ("pre", "layer", "post")}


def _unit_factor(cfg: Config, mixed_precision: bool) -> float:
    """Gathered bytes per parameter byte at moment A ([Note: memory per rank]); at dp 1 under
    mixed precision, FSDP2's 16-bit compute copy of the unit."""
    if cfg.dp_shard == 1:
        return 1.0 if mixed_precision else 0.0
    if cfg.pp > 1 and cfg.schedule == "interleaved-1f1b":
        return 1.0  # whole stages gathered ahead (STAGES_UNSHARDED); the inputs are transient
    return 1.0 + (1.0 / cfg.dp_shard if cfg.zero_stage >= 2 else 0.0)


STAGES_UNSHARDED = 3
"""Pipeline stages a rank holds gathered at once under the interleaved schedule: torch 2.13's
`_PipelineScheduleRuntime` lowers it with `_add_unshard_reshard(max_active_stages=3)`
(torch/distributed/pipelining/schedules.py), which unshards every FSDP2 unit of a stage before
its first compute and reshards it only when it falls out of the next three stages the rank
computes."""


def _per_block(cfg: Config) -> bool:
    """ZeRO-3 gathers one block at a time ([Note: memory per rank])."""
    return cfg.zero_stage == 3 and cfg.dp_shard > 1


def _held_layers(cfg: Config, layers_r: int, gathered: bool) -> float:
    """Of a rank's `layers_r` layers, the fraction whose parameters are gathered at once
    (`gathered`: the current and the prefetched next one) or whose unsharded gradients exist
    at once (the current one); all of them unless ZeRO-3 gathers per block."""
    if not layers_r:
        return 0.0
    if not _per_block(cfg):
        return 1.0
    if gathered and cfg.pp > 1 and cfg.schedule == "interleaved-1f1b":
        # torch's runtime schedule gathers whole stages (UNSHARD/RESHARD actions, [Note:
        # memory per rank]): up to STAGES_UNSHARDED of the rank's v chunks at once
        return min(1.0, STAGES_UNSHARDED / cfg.num_virtual_stages)
    return min(1.0, (2.0 if gathered else 1.0) / layers_r)


def _recv_buffer_bytes(cfg: Config, r: int, boundary_bytes: float) -> float:
    """Pipeline receive buffers of rank r, one posted receive per side it receives across
    ([Note: memory per rank])."""
    if cfg.pp == 1:
        return 0.0
    sides = (r > 0) + (r < cfg.pp - 1) if cfg.num_virtual_stages == 1 else 2
    return sides * boundary_bytes


def _sent_output_bytes(cfg: Config, r: int, boundary_bytes: float) -> float:
    """Stage outputs rank r keeps for backward per in-flight microbatch (in units of one
    microbatch through all of its layers, as `pipeline_in_flight_microbatches` counts): one
    boundary per chunk that sends forward, all v but the last stage's ([Note: memory per
    rank])."""
    if cfg.pp == 1:
        return 0.0
    sending = cfg.num_virtual_stages - (1 if r == cfg.pp - 1 else 0)
    return sending * boundary_bytes


def _late_coef(r: int, layers: list[int], shares: dict, total_layers: int) -> dict:
    """Activation coefficients of moment B: one layer of one microbatch (when the rank holds
    layers) and what precedes the layers (first rank): [Note: peak moments]."""
    coef = {"pre": shares["pre"]}
    if total_layers and layers[r]:
        coef["layer"] = 1.0 / total_layers
    return coef


def _grads_at_activation_peak(cfg: Config, in_flight: float) -> bool:
    return _grads_at_peak(cfg.schedule, cfg.pp, cfg.num_microbatches, in_flight)


def _grads_at_peak(schedule: str, pp: int, m: int, in_flight: float) -> bool:
    if pp == 1:
        return m > 1
    return schedule != "gpipe" and m > in_flight


def rank_memories(cfg: Config, spec: TrainingSpec, total_layers: int,
                  output_bytes: float, offload: str = "none",
                  frozen: bool = False) -> list[RankMemory]:
    """[Note: memory per rank] as linear forms for the ILP: per pipeline rank, one form per
    moment of [Note: peak moments] (A: activations at their height, B: the backward of the
    rank's first layer), so that "every form within the budget" is exactly "the peak within
    the budget". Device memory only: `offload` states are on the host ([Note: offload]).
    The stage outputs and receive buffers are counts of boundaries (`boundary_coef`), priced
    at the block-output node's placement (Costs.boundary_bytes). `frozen`: the model has
    frozen parameters, priced per element by `RankMemory.frozen_coef` (held and gathered,
    no gradient, no optimizer state: [Note: frozen pricing] in cost_model/memory.py)."""
    layers = _rank_layers(cfg, total_layers)
    states = off.device_states(model_state_bytes(
        1.0, cfg.zero_stage, cfg.dp_shard, mixed_precision=spec.mixed_precision,
        optimizer=spec.optimizer, recipe="fsdp2"), offload)
    kept = states["params"] + states["optimizer"]
    kept_frozen = off.device_states(model_state_bytes(
        1.0, cfg.zero_stage, cfg.dp_shard, mixed_precision=spec.mixed_precision,
        optimizer=spec.optimizer, recipe="fsdp2", frozen_params=1.0,
        frozen_param_bytes=frozen_param_bytes(spec)), offload)["params"]
    unit = _unit_factor(cfg, spec.mixed_precision) * spec.dtype_bytes
    unsharded = spec.dtype_bytes if cfg.zero_stage >= 2 and cfg.dp_shard > 1 else 0.0
    out = []
    for r in range(cfg.pp):
        in_flight = pipeline_in_flight_microbatches(cfg.schedule, cfg.pp, cfg.num_microbatches,
                                                    r, cfg.num_virtual_stages)
        grads_a = states["grads"] if _grads_at_activation_peak(cfg, in_flight) else 0.0
        recv = _recv_buffer_bytes(cfg, r, 1.0)
        sent = in_flight * _sent_output_bytes(cfg, r, 1.0)
        shares = _shares(r, cfg, layers, total_layers)
        held = {p: _held_layers(cfg, layers[r], True) if p == "layer" else 1.0 for p in shares}
        grad_held = {p: _held_layers(cfg, layers[r], False) if p == "layer" else 1.0
                     for p in shares}
        # a frozen element at both moments: held (and gathered), no gradient
        frozen_coef = {p: (kept_frozen + unit * held[p]) * sh
                       for p, sh in shares.items()} if frozen else None
        moment_a = RankMemory({p: (kept + grads_a + unit * held[p]) * sh
                               for p, sh in shares.items()},
                              {p: in_flight * sh for p, sh in shares.items()},
                              output_bytes if r == cfg.pp - 1 else 0.0, sent + recv,
                              frozen_coef, _loss_coef(cfg))
        if _deferred_reduction(cfg):
            out += _deferred_forms(cfg, spec, r, layers, shares, states, kept_frozen, unit,
                                   held, grads_a, in_flight, output_bytes, sent, recv,
                                   frozen, total_layers)
            continue
        moment_b = RankMemory({p: (kept + states["grads"] + unit * held[p]
                                   + unsharded * grad_held[p]) * sh
                               for p, sh in shares.items()}, _late_coef(r, layers, shares,
                                                                        total_layers), 0.0, recv,
                              frozen_coef)
        out += [moment_a, moment_b]
    return out


def _loss_coef(cfg: Config) -> float:
    """RankMemory.loss_coef of moment A on the last rank: the loss priced per candidate of
    the logits' producer (Costs.loss_rows) without pipelining; with it, in `output_bytes`."""
    return 1.0 if cfg.pp == 1 else 0.0


def _deferred_reduction(cfg: Config) -> bool:
    """Whether the rank's FSDP2 units defer their reduction to the end of the step ([Note:
    deferred reduction]): pipelining with ZeRO-2/3 over more than one rank."""
    return cfg.pp > 1 and cfg.dp_shard > 1 and cfg.zero_stage >= 2


def _reduce_bytes(spec: TrainingSpec) -> float:
    """Bytes of an unsharded gradient element before its reduction: FSDP2 accumulates in the
    policy's reduce dtype, fp32 under mixed precision (runtime/precision.py policy), else in
    the parameter's dtype."""
    return 4.0 if spec.mixed_precision else float(spec.dtype_bytes)


def _last_chunk_fraction(cfg: Config, r: int, layers) -> dict[str, float]:
    """Of each part rank r holds, the fraction in its first chunk (stage r), the chunk whose
    backward ends the step and is reduced last ([Note: deferred reduction]): all of "pre"
    (stage 0), stage r's share of the rank's layers, "post" only when the rank has one chunk
    (the last stage is the last rank's last chunk)."""
    v = cfg.num_virtual_stages
    layer = 1.0
    if v > 1 and layers[r]:
        layer = config_stages(cfg, sum(layers))[r].num_layers / layers[r]
    return {"pre": 1.0, "layer": layer, "post": 1.0 if v == 1 else 0.0}


def _first_reduced(cfg: Config, r: int, layers, total_layers: int) -> dict[str, float]:
    """The unit FSDP2 reduces first when the last chunk's reduction starts, as a share of
    each part ([Note: deferred reduction]): the stage's root unit where it holds parameters
    ("pre" on the first rank, "post" on the last with one chunk), else the first block."""
    if r == 0:
        return {"pre": 1.0}
    if r == cfg.pp - 1 and cfg.num_virtual_stages == 1:
        return {"post": 1.0}
    return {"layer": 1.0 / total_layers} if total_layers and layers[r] else {}


def _deferred_forms(cfg, spec, r, layers, shares, states, kept_frozen, unit, held, grads_a,
                    in_flight, output_bytes, sent, recv, frozen, total_layers):
    """Moments A and B of [Note: deferred reduction] as linear forms (rank_memories)."""
    kept = states["params"] + states["optimizer"]
    rb = _reduce_bytes(spec)
    last = _last_chunk_fraction(cfg, r, layers)
    first = _first_reduced(cfg, r, layers, total_layers)
    grads_a = rb if grads_a else 0.0

    def frozen_coef(gathered, width):
        return {p: (kept_frozen + width * gathered[p]) * sh
                for p, sh in shares.items()} if frozen else None

    # the last chunk gathered whole: its unsharded parameters at compute precision (the
    # all-gather input of one unit at a time is transient)
    late = {p: states["grads"] * (1 - last[p]) + (rb + spec.dtype_bytes) * last[p]
            for p in shares}
    moment_a = RankMemory({p: (kept + grads_a + unit * held[p]) * sh
                           for p, sh in shares.items()},
                          {p: in_flight * sh for p, sh in shares.items()},
                          output_bytes if r == cfg.pp - 1 else 0.0, sent + recv,
                          frozen_coef(held, unit))
    moment_b = RankMemory({p: (kept + late[p]) * sh + rb * first.get(p, 0.0)
                           for p, sh in shares.items()},
                          _late_coef(r, layers, shares, total_layers), 0.0, recv,
                          frozen_coef(last, spec.dtype_bytes))
    return [moment_a, moment_b]


def _candidate_ranks(cfg: Config, layers: list[int]) -> list[int]:
    """The pipeline ranks that can be the busiest or the fullest: the first, the last and the
    first rank of every run of middle ranks with equal layers and equal
    `_grads_at_activation_peak`. Inside such a run every quantity of [Note: step time] and
    [Note: memory per rank] is non-increasing in r (the microbatches in flight,
    `pipeline_in_flight_microbatches`, fall with r under every schedule; the receive
    buffers, stage outputs and parts are those of any middle rank), so the run's first rank
    bounds the others and, coming first, is the one `max` picks on a tie.
    tests/test_planner_scale.py checks assess against every rank."""
    return _ranks_to_check(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.num_virtual_stages,
                           tuple(layers))


@functools.lru_cache(maxsize=16384)
def _ranks_to_check(schedule: str, pp: int, m: int, v: int,
                    layers: tuple[int, ...]) -> tuple[int, ...]:
    """_candidate_ranks on the numbers it depends on (cached: configurations differing only
    in tp, cp, dp, ZeRO, microbatch size or policy share it)."""
    out = []
    flag = None
    for r in range(pp):
        in_flight = pipeline_in_flight_microbatches(schedule, pp, m, r, v)
        now = (layers[r], _grads_at_peak(schedule, pp, m, in_flight))
        if r in (0, 1, pp - 1) or now != flag:
            out.append(r)
        flag = now
    return tuple(out)


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
    layers = _rank_layers(cfg, total_layers)
    v = cfg.num_virtual_stages
    busy = min(topology.devices_per_node, cfg.world_size)
    speed = topology.device.speed(busy)
    # what a tp rank sends: its local boundary (a tp-th under sequence parallelism)
    sent_bytes = boundary_bytes if sol.boundary_bytes is None else sol.boundary_bytes
    p2p = 2 * v * pipeline_hop_time_s(sent_bytes, topology, pp=cfg.pp,
                                      stage_ranks=cfg.tp * cfg.cp * cfg.dp, num_virtual_stages=v)
    per_rank = []
    ranks = _candidate_ranks(cfg, layers)
    shares = {r: _shares(r, cfg, layers, total_layers) for r in ranks}

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
           offload: str = "none") -> Assessment:
    """[Note: step time] and [Note: memory per rank] of `cfg` with placement `sol`;
    `param_tensors`: parameter tensors per part ("pre", "layer": all blocks, "post") for the
    optimizer's per-tensor ops (none: not priced); `offload`: [Note: offload] (the host
    memory is checked against the rank's share of its node's).

    Raises ValueError (from the cost model) when a mesh group straddles nodes unevenly.
    """
    layers, busy, speed, ranks, shares, comp, comm, cp_comm, pipeline = _stage_times(
        cfg, sol, topology, total_layers, boundary_bytes)
    param_tensors = param_tensors or {}

    def on(r: int, per_part: dict[str, float]) -> float:
        return sum(per_part.get(p, 0.0) * s for p, s in shares[r].items())

    memories = {r: _rank_peak(cfg, sol, spec, r, layers, total_layers, output_bytes,
                              boundary_bytes, offload, shares[r]) for r in ranks}
    worst = max(ranks, key=lambda r: memories[r]["peak"])
    elems, frozen = _most_elems(cfg, sol, spec, topology, [shares[r] for r in ranks], speed)
    tensors = max(on(r, param_tensors) for r in ranks)  # trainable ones (Problem.param_tensors)
    dp_sync = _dp_sync_s(cfg, spec, topology, elems, _dp_units(cfg, layers), frozen, tensors)
    exposed = (1 - DP_SYNC_OVERLAP) * dp_sync + _dp_local_s(
        cfg, spec, topology, elems, frozen) / speed
    if offload == "none":
        transfers, optimizer = 0.0, _optimizer_s(cfg, spec, topology, elems - frozen, tensors,
                                                 speed)
    else:
        transfers, optimizer = off.offload_time_s(
            offload=offload, zero_stage=cfg.zero_stage, dp=cfg.dp_shard, elems=elems,
            tensors=tensors, gathers=_gathers(cfg),
            reductions=_reductions(cfg), spec=spec, topology=topology,
            optimizer_bytes_per_param=OPTIMIZER_BYTES_PER_PARAM.get(spec.optimizer, 0.0),
            optimizer_ops_per_tensor=OPTIMIZER_OPS_PER_TENSOR.get(spec.optimizer, 0),
            speed=speed, ranks_on_node=busy, frozen=frozen,
            frozen_param_bytes=frozen_param_bytes(spec))
        exposed += transfers
    host = off.host_state_bytes(elems, cfg.zero_stage, cfg.dp_shard, offload, spec,
                                frozen=frozen, frozen_param_bytes=frozen_param_bytes(spec))
    m = cfg.num_microbatches
    if cfg.tp * cfg.dp_shard > 1:  # drift between meetings ([Note: step time])
        exposed += topology.device.skew_slope(busy) * (m * comp + optimizer)
    breakdown = {k: val for k, val in memories[worst].items() if k != "peak"}
    peak = memories[worst]["peak"]
    fits = peak <= spec.max_memory_fraction * topology.device.mem_bytes and (
        offload == "none" or host <= off.host_budget_bytes(topology, spec, busy))
    return Assessment(cfg, pipeline + exposed + optimizer, m * comp + optimizer,
                      m * comm + exposed, _bubble_s(cfg, pipeline, m * (comp + comm)),
                      dp_sync, peak, breakdown, fits, sol, optimizer, m * cp_comm, offload, host,
                      transfers)


def _bubble_s(cfg: Config, pipeline_s: float, busy_s: float) -> float:
    """The pipeline's idle part: exactly 0 without pp (not a float residue of the
    difference), never negative."""
    return 0.0 if cfg.pp == 1 else max(0.0, pipeline_s - busy_s)


def _pipeline_s(cfg: Config, comp: float, comm: float, topology: Topology, busy: int) -> float:
    """The pipeline term of [Note: step time]: m v + pp - 1 slots of one chunk-microbatch."""
    pp, v, m = cfg.pp, cfg.num_virtual_stages, cfg.num_microbatches
    per_stage = max(1, busy // pp)  # R ranks of a stage on this node
    device = topology.device
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


def rank_peaks(cfg: Config, sol: Solution, spec: TrainingSpec, *, total_layers: int,
               output_bytes: float, boundary_bytes: float,
               offload: str = "none") -> list[dict[str, float]]:
    """[Note: memory per rank] of every pipeline rank of `cfg` (not only the candidates
    `assess` weighs): per pp rank, bytes by category (params, grads, optimizer, activations,
    temporaries, comm_buffers) of its larger moment and "peak", their sum. What the dry run
    holds each rank against (autoplan/runtime/dryrun.py)."""
    layers = _rank_layers(cfg, total_layers)
    return [_rank_peak(cfg, sol, spec, r, layers, total_layers, output_bytes, boundary_bytes,
                       offload) for r in range(cfg.pp)]


def _rank_peak(cfg, sol, spec, r, layers, total_layers, output_bytes,
               boundary_bytes, offload="none", share=None) -> dict[str, float]:
    share = share or _shares(r, cfg, layers, total_layers)
    elems, frozen = sol.param_elems_on(share), sol.frozen_elems_on(share)
    acts = sum(sol.act_bytes.get(p, 0.0) * s for p, s in share.items())
    late = sum(sol.act_bytes.get(p, 0.0) * c
               for p, c in _late_coef(r, layers, share, total_layers).items())
    states = off.device_states(model_state_bytes(
        elems, cfg.zero_stage, cfg.dp_shard, mixed_precision=spec.mixed_precision,
        optimizer=spec.optimizer, recipe="fsdp2", frozen_params=frozen,
        frozen_param_bytes=frozen_param_bytes(spec) if frozen else None), offload)
    in_flight = pipeline_in_flight_microbatches(cfg.schedule, cfg.pp, cfg.num_microbatches, r,
                                                cfg.num_virtual_stages)
    # gathered parameters and unsharded gradients held at once ([Note: memory per rank]);
    # frozen parameters are gathered like the others but have no gradient
    block = sol.param_elems.get("layer", 0.0) * share["layer"]
    rest = elems - block
    gathered = rest + block * _held_layers(cfg, layers[r], True)
    frozen_block = sol.frozen_elems.get("layer", 0.0) * share["layer"]
    grad_unit = (rest - (frozen - frozen_block)) + (block - frozen_block) * _held_layers(
        cfg, layers[r], False)
    # the stage outputs kept for backward are held per in-flight microbatch, like activations;
    # they and the receive buffers are the producer's local tensor (1/tp of it when split)
    if sol.boundary_bytes is not None:
        boundary_bytes = sol.boundary_bytes
    if cfg.pp == 1 and sol.loss_bytes is not None:  # the placement's loss (Costs.loss_rows)
        output_bytes += sol.loss_bytes
    sent = _sent_output_bytes(cfg, r, boundary_bytes)
    if _deferred_reduction(cfg):
        return _deferred_peak(cfg, sol, spec, r, layers, total_layers, share, states,
                              gathered=gathered, acts=acts + sent, late=late,
                              in_flight=in_flight,
                              output_bytes=output_bytes if r == cfg.pp - 1 else 0.0,
                              recv=_recv_buffer_bytes(cfg, r, boundary_bytes))
    return peak_memory_bytes(
        model_states=states, activation_bytes=acts + sent, in_flight_microbatches=in_flight,
        zero_stage=cfg.zero_stage, dp=cfg.dp_shard,
        output_bytes=output_bytes if r == cfg.pp - 1 else 0.0,
        comm_buffer_bytes=_recv_buffer_bytes(cfg, r, boundary_bytes),
        gather_unit_bytes=gathered * spec.dtype_bytes,
        unsharded_grad_bytes=grad_unit * spec.dtype_bytes,
        grads_at_activation_peak=_grads_at_activation_peak(cfg, in_flight),
        late_activation_bytes=late, cast_unit=spec.mixed_precision)


def _deferred_peak(cfg, sol, spec, r, layers, total_layers, share, states, *, gathered,
                   acts, late, in_flight, output_bytes, recv) -> dict[str, float]:
    """The peak of rank r under [Note: deferred reduction], with its breakdown (as
    peak_memory_bytes gives it): the larger of moments A and B."""
    unit = _unit_factor(cfg, spec.mixed_precision) * spec.dtype_bytes
    rb = _reduce_bytes(spec)
    last = _last_chunk_fraction(cfg, r, layers)
    first = _first_reduced(cfg, r, layers, total_layers)
    elems, frozen = sol.param_elems_on(share), sol.frozen_elems_on(share)
    trainable = elems - frozen
    in_last = {p: s * last[p] for p, s in share.items()}
    last_elems = sol.param_elems_on(in_last)
    last_trainable = last_elems - sol.frozen_elems_on(in_last)
    sharded_grad = states["grads"] / trainable if trainable else 0.0
    first_trainable = sol.param_elems_on(first) - sol.frozen_elems_on(first)
    base = {"params": states["params"], "optimizer": states["optimizer"]}
    grads_a = _grads_at_activation_peak(cfg, in_flight)
    late_grads = (trainable - last_trainable) * sharded_grad + last_trainable * rb
    moments = [
        {**base, "grads": trainable * rb if grads_a else 0.0,
         "activations": acts * in_flight, "temporaries": gathered * unit + output_bytes,
         "comm_buffers": recv},
        {**base, "grads": late_grads + first_trainable * rb, "activations": late,
         "temporaries": last_elems * spec.dtype_bytes, "comm_buffers": recv},
    ]
    breakdown = max(moments, key=lambda m: sum(m.values()))
    breakdown = {k: float(breakdown[k]) for k in ("params", "grads", "optimizer", "activations",
                                                  "temporaries", "comm_buffers")}
    breakdown["peak"] = sum(breakdown.values())
    return breakdown


def frozen_param_bytes(spec: TrainingSpec) -> float | None:
    """Bytes a rank holds per frozen parameter element before ZeRO sharding ([Note: frozen
    pricing] in cost_model/memory.py): the compute dtype's width when the frozen base is held
    in it (`spec.frozen_dtype`, Plan.frozen_dtype), else None (as a trainable one: its fp32
    master)."""
    return float(spec.dtype_bytes) if spec.frozen_dtype else None


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
        return (_dp_sync_s(cfg, spec, topology, elems, frozen=frozen)
                + _dp_local_s(cfg, spec, topology, elems, frozen) / speed
                + _optimizer_s(cfg, spec, topology, elems - frozen, 0.0, speed))
    return max(ranks, key=cost_s)


def _grad_weight_bytes(spec: TrainingSpec, elems: float,
                       frozen: float = 0.0) -> tuple[float, float]:
    """(gradient bytes, compute-precision weight bytes) of `elems` parameters, `frozen` of
    them without a gradient."""
    _p, grad_b, _o = STATE_BYTES_PER_PARAM[(spec.mixed_precision, spec.optimizer)]
    return (elems - frozen) * grad_b, elems * spec.dtype_bytes


def _reductions(cfg: Config) -> int:
    """Gradient reductions per step ([Note: step time], dp_sync): one, except for ZeRO 2/3
    accumulating microbatches without pipelining, which reduce-scatter every microbatch."""
    return cfg.num_microbatches if cfg.pp == 1 and cfg.zero_stage >= 2 else 1


def _dp_local_s(cfg: Config, spec: TrainingSpec, topology: Topology, elems: float,
                frozen: float = 0.0) -> float:
    """The local passes around the dp collectives ([Note: step time], dp_local), memory-bound:
    FSDP2 packs the gradients into a flat buffer, divides them by dp in place and unpacks the
    result into the gradient tensors (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py,
    foreach_reduce): 3 passes reading and writing G, per reduction; ZeRO-1's optimizer
    (runtime/zero1.py ShardedOptimizer) copies its rows of each parameter into the all-gather's
    input (M / dp) and, where a tensor's rows do not divide by dp, every rank's rows out of the
    gathered buffer (at most M; priced in full), M at master precision; every FSDP2
    parameter all-gather of ZeRO 2/3 copies the shards in (foreach_all_gather: W / dp read and written) and the gathered buffer
    out into the unsharded parameters (foreach_all_gather_copy_out, split_with_sizes_copy: W
    read and written). `frozen` of the `elems` have no gradient, and ZeRO-1 leaves them out
    ([Note: frozen parameters] in autoplan/runtime/engine.py)."""
    if cfg.dp_shard == 1:
        return 0.0
    grads, weights = _grad_weight_bytes(spec, elems, frozen)
    device = topology.device
    passes = _reductions(cfg) * 3 * 2 * grads
    if cfg.zero_stage == 1:
        stepped = (elems - frozen) * _master_bytes(spec)
        passes += 2 * stepped / cfg.dp_shard + 2 * stepped
    passes += _gathers(cfg) * (2 * weights / cfg.dp_shard + 2 * weights)
    return passes / device.mem_bw_bytes_per_s


def _master_bytes(spec: TrainingSpec) -> float:
    """Bytes per element of a parameter as the runtime holds it: its fp32 master under mixed
    precision (FSDP2's recipe, cost_model/memory.py FSDP2_MIXED_STATE_BYTES)."""
    return model_state_bytes(1.0, 0, 1, mixed_precision=spec.mixed_precision,
                             optimizer=spec.optimizer, recipe="fsdp2")["params"]


def _dp_sync_s(cfg: Config, spec: TrainingSpec, topology: Topology, elems: float,
               units: int = 1, frozen: float = 0.0, tensors: float = 1.0) -> float:
    """The dp group's collectives per step ([Note: step time], dp_sync); with context
    parallelism the group is dp x cp ranks (the dp and cp axes are adjacent, so stride tp).
    FSDP2 issues each reduction and gather once per unit (`units`, `_dp_units`), each on that
    unit's share of the bytes: the bandwidth terms sum to the whole, the latency and straggler
    terms are paid per unit. ZeRO-1's gather of the updated parameters is one all-gather per
    parameter tensor (`tensors`, at least one) of their fp32 masters under mixed precision
    (runtime/zero1.py ShardedOptimizer, [Note: ZeRO-1 partition]). `frozen` of the `elems` have no
    gradient to reduce and ZeRO-1 does not gather them; ZeRO-2/3 gather them as any
    parameter ([Note: frozen parameters] in autoplan/runtime/engine.py)."""
    if cfg.dp_shard == 1:
        return 0.0
    grads, weights = _grad_weight_bytes(spec, elems, frozen)

    def t(kind: str, nbytes: float, n: int = units) -> float:
        return n * collective_time_s(kind, nbytes / n, cfg.dp_shard, topology, stride=cfg.tp)

    reductions = _reductions(cfg)
    if cfg.zero_stage == 0:
        return reductions * t("all_reduce", grads)
    if cfg.zero_stage == 1:
        stepped = (elems - frozen) * _master_bytes(spec)
        return reductions * t("all_reduce", grads) + t("all_gather", stepped,
                                                        max(1, round(tensors)))
    return reductions * t("reduce_scatter", grads) + _gathers(cfg) * t("all_gather", weights)


def _dp_units(cfg: Config, layers) -> int:
    """FSDP2 units on the busiest pipeline rank (autoplan/runtime/engine.py
    `_apply_data_parallel`: one per block module and one per stage module for the rest): its
    blocks, plus the stage root on the first and last pipeline ranks, which hold the parameters
    outside the blocks (embeddings, final norm, head); middle ranks' roots hold none and issue
    no collective."""
    return max(1, max(n + (r == 0 or r == cfg.pp - 1) for r, n in enumerate(layers)))


def _gathers(cfg: Config) -> int:
    """FSDP2 parameter all-gathers per step ([Note: step time], dp_sync): ZeRO-2 one per
    microbatch, ZeRO-3 two (forward and backward); none below ZeRO-2."""
    return {2: 1, 3: 2}.get(cfg.zero_stage, 0) * cfg.num_microbatches
