"""Memory of each pipeline rank of a configuration: its peak by category (`rank_peaks`,
`rank_peak`) and the same as linear forms of the placement for the ILP (`rank_memories`).

Long because: the peak and its linear forms price the same moments term by term
(tests/test_planner_scale.py holds them equal, placement by placement), so they share their
helpers (in-flight chunks, gathered units, receive buffers, deferred reduction) here; split,
one side would be changed without the other.

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
  and the one FSDP2 prefetches), and the unsharded gradients of the rest and one block
  (under the interleaved schedule, whose torch runtime gathers whole stages, the moments are
  walked from its actions: [Note: interleaved moments] in cost_model/schedule_moments.py);
- mixed precision at dp 1: FSDP2 still makes the 16-bit compute copy of the units;
- gradients exist while activations are at their height only when an earlier microbatch's
  backward made them (`grads_at_activation_peak`): gradient accumulation without pipelining
  (m > 1), 1F1B with more microbatches than the rank holds in flight; not for m = 1 or GPipe
  (the step starts with set_to_none gradients);
- pipeline receive buffers (comm_buffers): the runtime allocates a receive buffer when it posts
  the receive and drops it once the forward or backward of its microbatch consumed it ([Note:
  in-flight receive buffers] in autoplan/_torch_compat/pipelining.py): one buffer per side the
  rank receives across, activations from the previous stage and gradients from the next, boundary
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

[Note: first gather] (`_first_gather`): under ZeRO-3 one more moment, the step's first
forward, holds two units' all-gather outputs beside their parameters and no activation.

[Note: backward gradients] Under mixed precision a block's backward makes its weights'
gradients in the compute dtype on the unsharded parameters; FSDP2 adds them into its fp32
accumulation (or reduction) buffers and frees them in the unit's post-backward, once the unit's
backward is done. So while a block's backward runs the rank holds that block's gradients in
the compute dtype (one FSDP2 unit per block) and, on the last rank, those of the stage's root
unit (the head and final norm, whose backward ran first and whose post-backward waits for the
whole stage): `_backward_grad_share`, at moment A after the loss and at moment B, not at the
loss. Measured by the dry run on llama3-405b's last rank (pp 32 x cp 8 x tp 4): 2.68 GB of
such gradients at its peak (the head's 1.05 GB and one block's 1.6 GB), and on GPT 1T's ranks
one block's 1.95 GB.

[Note: interleaved in-flight chunks] Under the interleaved schedule a rank's in-flight
chunk-microbatches are not spread evenly over its v chunks: its forwards before the first
backward run in groups of R microbatches per chunk (Megatron-LM's order, torch's
ScheduleInterleaved1F1B: the k-th forward is of chunk (k // R) % v, R =
memory.microbatches_per_round, pp when pp divides m), so the last rank holds (v - 1) R
microbatches of its first chunks and one of its last -- 32 of chunk 31 and 1 of
chunk 63 on llama3-405b's pp 32 x v 2, measured by the dry run (bench/dryrun.py). Each part's
activations count the microbatches of the chunks that hold it (`in_flight_by_part`): "pre" its
first chunk's, "post" its last chunk's, "layer" the chunks' weighted by their layers. With
126 layers in 64 stages the last rank's chunks hold 2 and 1 blocks: 65 block-microbatches,
not the 49.5 of 16.5 microbatches through all 3, and its logits' producer once, not 16.5
times.

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
  forward reshards a ZeRO-3 block after it). Under the interleaved schedule the chunks do not
  reach these heights together, and moment A is every moment of [Note: interleaved moments]
  (cost_model/schedule_moments.py) that no other covers;
- moment B, the last backward of the rank's first chunk (stage r, the chunk that finishes last:
  backward runs from the last stage to the first), holds that chunk gathered whole (a block
  gathered for a backward stays gathered; its unsharded parameters at compute precision), its gradients unsharded, the other chunks reduced
  (their gradients sharded, their parameters resharded), and -- when its REDUCE_GRAD starts,
  one microbatch's last activations and receive buffer aside, counted at B to keep one form
  per moment -- the reduce-scatter input FSDP2 copies the first unit's gradients into (the
  stage's root unit where it holds parameters, "pre" on the first rank and "post" on the last
  with one chunk, FSDP2 reducing its states root first; else a block: `_first_reduced`).
Measured by the dry run (0.5B GPT-2, pp2 x dp2 ZeRO-3: 4.116 GB with one chunk, 3.436 GB with
two on the first rank, against 4.119 and 3.440 by this account; the last rank with two chunks
at m 2: 3.224 GB, priced 3.181), and on tiny GPTs at pp2 x dp4 (ZeRO-2, ZeRO-3,
1F1B, interleaved, fp32 and bf16): -3% .. +6%.
"""

from __future__ import annotations

import dataclasses
import functools

from autoplan.cost_model import offload as offload_costs
from autoplan.cost_model.config import Config, config_stages, rank_layers, rank_shares
from autoplan.cost_model.memory import (
    microbatches_per_round, model_state_bytes, peak_memory_bytes, pipeline_in_flight_microbatches,
)
from autoplan.cost_model.placement_totals import RankMemory, Solution
from autoplan.cost_model.schedule_moments import (MomentTerms, interleaved_moments, moment_terms,
                                                  zero_bubble_in_flight)
from autoplan.options import INTERLEAVED_SCHEDULES
from autoplan.spec import TrainingSpec

__all__ = ["ExpertSlices", "frozen_param_bytes", "memory_floor_bytes", "rank_memories",
           "rank_peaks", "rank_peak", "candidate_ranks", "grads_at_activation_peak"]


def _unit_factor(cfg: Config, mixed_precision: bool) -> float:
    """Gathered bytes per parameter byte at moment A ([Note: memory per rank]); at dp 1 under
    mixed precision, FSDP2's 16-bit compute copy of the unit."""
    if cfg.dp_shard == 1:
        return 1.0 if mixed_precision else 0.0
    if cfg.pp > 1 and cfg.schedule in INTERLEAVED_SCHEDULES:
        return 1.0  # whole stages gathered ahead ([Note: interleaved moments]); inputs transient
    return 1.0 + (1.0 / cfg.dp_shard if cfg.zero_stage >= 2 else 0.0)


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


def in_flight_by_part(cfg: Config, r: int, total_layers: int) -> dict[str, float]:
    """The microbatches whose activations rank r holds at moment A ([Note: peak moments]),
    per part: {"pre", "layer", "post"} -> chunk-microbatches of the part's chunks, weighted
    by the chunk's share of the part ([Note: interleaved in-flight chunks]). Without
    interleaving every part's is `pipeline_in_flight_microbatches`."""
    v = cfg.num_virtual_stages
    in_flight = pipeline_in_flight_microbatches(cfg.schedule, cfg.pp, cfg.num_microbatches, r,
                                                v)
    if v == 1 or cfg.schedule not in INTERLEAVED_SCHEDULES:
        return dict.fromkeys(("pre", "layer", "post"), in_flight)
    if cfg.schedule == "interleaved-zb":
        counts = list(zero_bubble_in_flight(cfg.pp, v, cfg.num_microbatches, r))
    else:
        counts = [0] * v
        per_round = microbatches_per_round(cfg.pp, cfg.num_microbatches)
        for k in range(round(in_flight * v)):  # the forwards before the first backward, +1
            counts[(k // per_round) % v] += 1
    stages = config_stages(cfg, total_layers)
    held = [stages[r + j * cfg.pp].num_layers for j in range(v)] if total_layers else []
    layer = (sum(n * c for n, c in zip(counts, held)) / sum(held)) if sum(held) else in_flight
    return {"pre": float(counts[0]), "layer": layer, "post": float(counts[-1])}


def grads_at_activation_peak(cfg: Config, in_flight: float) -> bool:
    return _grads_at_peak(cfg.schedule, cfg.pp, cfg.num_microbatches, in_flight)


def _grads_at_peak(schedule: str, pp: int, m: int, in_flight: float) -> bool:
    if pp == 1:
        return m > 1
    return schedule != "gpipe" and m > in_flight


def rank_memories(cfg: Config, spec: TrainingSpec, total_layers: int,
                  output_bytes: float, offload: str = "none",
                  frozen: bool = False,
                  experts: ExpertSlices | None = None) -> list[RankMemory]:
    """[Note: memory per rank] as linear forms for the ILP: per pipeline rank, one form per
    moment of [Note: peak moments] (A: activations at their height, B: the backward of the
    rank's first layer), so that "every form within the budget" is exactly "the peak within
    the budget". Device memory only: `offload` states are on the host ([Note: offload]).
    The stage outputs and receive buffers are counts of boundaries (`boundary_coef`), priced
    at the block-output node's placement (Costs.boundary_bytes). `frozen`: the model has
    frozen parameters, priced per element by `RankMemory.frozen_coef` (held and gathered,
    no gradient, no optimizer state: [Note: frozen pricing] in cost_model/memory.py).
    `experts`: the expert slices of an ep > 1 configuration ([Note: expert slices in the
    forms])."""
    layers = rank_layers(cfg, total_layers)
    slices = _slice_coefs(cfg, spec, experts, offload)
    states = offload_costs.device_states(model_state_bytes(
        1.0, cfg.zero_stage, cfg.dp_shard, mixed_precision=spec.mixed_precision,
        optimizer=spec.optimizer, recipe="fsdp2"), offload)
    kept = states["params"] + states["optimizer"]
    kept_frozen = offload_costs.device_states(model_state_bytes(
        1.0, cfg.zero_stage, cfg.dp_shard, mixed_precision=spec.mixed_precision,
        optimizer=spec.optimizer, recipe="fsdp2", frozen_params=1.0,
        frozen_param_bytes=frozen_param_bytes(spec)), offload)["params"]
    unit = _unit_factor(cfg, spec.mixed_precision) * spec.dtype_bytes
    unsharded = spec.dtype_bytes if cfg.zero_stage >= 2 and cfg.dp_shard > 1 else 0.0
    out = []
    for r in range(cfg.pp):
        in_flight = pipeline_in_flight_microbatches(cfg.schedule, cfg.pp, cfg.num_microbatches,
                                                    r, cfg.num_virtual_stages)
        grads_a = states["grads"] if grads_at_activation_peak(cfg, in_flight) else 0.0
        recv = _recv_buffer_bytes(cfg, r, 1.0)
        sent = in_flight * _sent_output_bytes(cfg, r, 1.0)
        shares = rank_shares(r, cfg, layers, total_layers)
        held = {p: _held_layers(cfg, layers[r], True) if p == "layer" else 1.0 for p in shares}
        grad_held = {p: _held_layers(cfg, layers[r], False) if p == "layer" else 1.0
                     for p in shares}
        # a frozen element at both moments: held (and gathered), no gradient
        frozen_coef = {p: (kept_frozen + unit * held[p]) * sh
                       for p, sh in shares.items()} if frozen else None
        parts_in_flight = in_flight_by_part(cfg, r, total_layers)
        bwd = _backward_grad_share(cfg, spec, r, layers)
        moments_a = _moments_a(cfg, r, RankMemory(
            {p: (kept + grads_a + unit * held[p]) * sh for p, sh in shares.items()},
            {p: parts_in_flight[p] * sh for p, sh in shares.items()}, 0.0, sent + recv,
            frozen_coef), output_bytes, bwd)
        with_slices = functools.partial(_with_slices, slices, shares["layer"])
        first = _first_gather(cfg, r, layers)
        if first is not None:  # [Note: first gather]
            grads_c = states["grads"] if _grads_at_first_gather(cfg) else 0.0
            out.append(with_slices(RankMemory(
                {p: (kept + grads_c + spec.dtype_bytes * first.get(p, 0.0)) * sh
                 for p, sh in shares.items()}, {}, 0.0, recv,
                {p: (kept_frozen + spec.dtype_bytes * first.get(p, 0.0)) * sh
                 for p, sh in shares.items()} if frozen else None),
                grads=_grads_at_first_gather(cfg), acts=False, transient=False))
        grads_at_a = grads_at_activation_peak(cfg, in_flight)
        if _deferred_reduction(cfg):
            *forms_a, form_b = _deferred_forms(cfg, spec, r, layers, shares, states,
                                               kept_frozen, unit, held, grads_a, in_flight,
                                               output_bytes, sent, recv, frozen, total_layers,
                                               bwd)
            # the expert slices' gradients where the moment holds FSDP2's: an interleaved
            # moment's when it holds any, moment A's under grads_at_activation_peak
            grads = [any(t.unsharded.values()) or any(t.sharded.values())
                     for t, _b, _l in _interleaved_terms(cfg, r, total_layers)] \
                if _interleaved(cfg) else [grads_at_a] * len(forms_a)
            out += [with_slices(f, grads=g, acts=True) for f, g in zip(forms_a, grads)]
            out.append(with_slices(form_b, grads=True, acts=False))
            continue
        moment_b = RankMemory({p: (kept + states["grads"] + unit * held[p]
                                   + unsharded * grad_held[p]) * sh + bwd.get(p, 0.0)
                               for p, sh in shares.items()}, _late_coef(r, layers, shares,
                                                                        total_layers), 0.0, recv,
                              frozen_coef)
        out += [with_slices(f, grads=grads_at_a, acts=True) for f in moments_a]
        out.append(with_slices(moment_b, grads=True, acts=False))
    return out


# [Note: expert slices in the forms] Under ep > 1 a rank holds the routed experts' weights as
# slices beside FSDP2 (ExpertSlices), which rank_peak prices apart (`_rank_states`' extra),
# and the forms follow it term by term. An expert weight's elements (Problem.experts) get
# none of FSDP2's coefficients -- no gathered unit, no unsharded gradient, no reduction --
# but their slice's states per element (`_slice_coefs`): params and optimizer at every
# moment, gradients where the moment holds FSDP2's (moment A under
# `grads_at_activation_peak`, moment B, the first gather under `_grads_at_first_gather`, an
# interleaved moment holding any) and, at every moment but the first gather, one MoE
# layer's slice gradient (the transient of its backward's accumulation, m > 1). The
# exchange's activations (ExpertSlices.act_bytes, independent of the placement) are a
# constant of each moment whose activations are the blocks' in flight (moments A, the
# interleaved moments), not of moment B's late activations. Before, the ILP priced the
# expert weights as FSDP2 holds the dense ones, replicated over the ep ranks: for
# DeepSeek-V3 on 256 dgx-h100 nodes every memory-constrained ILP with ep > 1 was infeasible
# (467 GB on a placement that assess put at 70.9 GB), and the search fell back to the
# placement of least memory.
@dataclasses.dataclass(frozen=True)
class _SliceCoefs:
    """Bytes per element of an expert weight under ep (elements as Solution counts them):
    its slice's states by category, trainable and frozen; one MoE layer's gradient transient
    per trainable element (0 without it); the exchange's activations per microbatch."""

    trainable: dict[str, float]
    frozen: dict[str, float]
    transient: float
    act_bytes: float


def _slice_coefs(cfg: Config, spec: TrainingSpec, experts: ExpertSlices | None,
                 offload: str) -> _SliceCoefs | None:
    """[Note: expert slices in the forms] of `experts`; None without ep."""
    if experts is None or experts.ep == 1:
        return None
    one = _expert_slice_states(cfg, spec, ExpertSlices(1.0, 0.0, experts.ep), 1.0, offload)
    frozen = _expert_slice_states(cfg, spec, ExpertSlices(1.0, 1.0, experts.ep), 1.0, offload)
    transient = one["grads"] / experts.num_layers \
        if experts.num_layers and cfg.num_microbatches > 1 else 0.0
    return _SliceCoefs(one, frozen, transient, experts.act_bytes)


def _with_slices(slices: _SliceCoefs | None, layer_share: float, form: RankMemory, *,
                 grads: bool, acts: bool, transient: bool = True) -> RankMemory:
    """`form` with the expert slices of a rank holding `layer_share` of the layers ([Note:
    expert slices in the forms]): their states, with gradients when `grads`; the exchange's
    activations when `acts`; one MoE layer's gradient transient when `transient`."""
    if slices is None:
        return form

    def coef(states: dict[str, float], extra: float) -> dict[str, float]:
        held = states["params"] + states["optimizer"] + (states["grads"] if grads else 0.0)
        return {"layer": held * layer_share + (extra if layer_share else 0.0)}

    const = slices.act_bytes * form.act_coef.get("layer", 0.0) if acts else 0.0
    return dataclasses.replace(
        form, const_bytes=form.const_bytes + const,
        expert_coef=coef(slices.trainable, slices.transient if transient else 0.0),
        expert_frozen_coef=coef(slices.frozen, 0.0))


def _backward_grad_share(cfg: Config, spec: TrainingSpec, r: int, layers) -> dict[str, float]:
    """[Note: backward gradients]: bytes per trainable parameter element of each part that
    rank r holds as compute-dtype gradients during a block's backward: one of its blocks
    (1 / T of "layer" per block of the model: the coefficient is per element of the part's
    total) and, on the last rank, what comes after the blocks; none without mixed
    precision."""
    if not spec.mixed_precision or not layers[r]:
        return {}
    total = sum(layers)
    out = {"layer": spec.dtype_bytes / total}
    if r == cfg.pp - 1:
        out["post"] = float(spec.dtype_bytes)
    return out


def _moments_a(cfg: Config, r: int, form: RankMemory, output_bytes: float,
               bwd: dict[str, float]) -> list[RankMemory]:
    """Moment A of rank r as linear forms ([Note: peak moments]): `form` (no output, no
    loss) with `bwd` (`_backward_grad_share`) on its parameter coefficients; on the last
    rank two, at its loss (the logits and the loss's working set: `output_bytes`, the token
    loss per candidate without pipelining) and at the backward of its last layer after it
    (without them), which alone holds a recomputation's transient and the backward's
    gradients."""
    block = dataclasses.replace(form, param_coef={
        p: c + bwd.get(p, 0.0) for p, c in form.param_coef.items()})
    if r != cfg.pp - 1 or not (output_bytes or _loss_coef(cfg)):
        return [block]
    return [dataclasses.replace(form, const_bytes=form.const_bytes + output_bytes,
                                loss_coef=_loss_coef(cfg), at_loss=True), block]


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
                    in_flight, output_bytes, sent, recv, frozen, total_layers, bwd):
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
    if _interleaved(cfg):
        moments_a = [_interleaved_form(cfg, r, t, shares, kept, states["grads"], rb, unit,
                                       kept_frozen if frozen else None, output_bytes, recv,
                                       bwd, backward, at_loss)
                     for t, backward, at_loss in _interleaved_terms(cfg, r, total_layers)]
    else:
        parts_in_flight = in_flight_by_part(cfg, r, total_layers)
        moments_a = _moments_a(cfg, r, RankMemory(
            {p: (kept + grads_a + unit * held[p]) * sh for p, sh in shares.items()},
            {p: parts_in_flight[p] * sh for p, sh in shares.items()}, 0.0, sent + recv,
            frozen_coef(held, unit)), output_bytes, bwd)
    moment_b = RankMemory({p: (kept + late[p]) * sh + rb * first.get(p, 0.0) + bwd.get(p, 0.0)
                           for p, sh in shares.items()},
                          _late_coef(r, layers, shares, total_layers), 0.0, recv,
                          frozen_coef(last, spec.dtype_bytes))
    return [*moments_a, moment_b]


def _interleaved(cfg: Config) -> bool:
    """Whether the rank's moments under deferred reduction are walked from the interleaved
    schedule's actions ([Note: interleaved moments] in cost_model/schedule_moments.py)."""
    return cfg.schedule == "interleaved-zb" or (
        cfg.schedule == "interleaved-1f1b" and cfg.num_virtual_stages > 1)


def _interleaved_terms(cfg: Config, r: int,
                       total_layers: int) -> tuple[tuple[MomentTerms, bool, bool], ...]:
    """(MomentTerms, backward, at_loss) of every moment of rank r that no other covers
    ([Note: interleaved moments])."""
    v = cfg.num_virtual_stages
    stages = config_stages(cfg, total_layers)
    chunks = tuple(stages[r + j * cfg.pp].num_layers if total_layers else 0
                   for j in range(v))
    return _terms_of(cfg.pp, v, cfg.num_microbatches, r, chunks, _per_block(cfg),
                     cfg.schedule)


@functools.lru_cache(maxsize=4096)
def _terms_of(pp: int, v: int, m: int, r: int, chunks: tuple[int, ...],
              per_block: bool, schedule: str) -> tuple[tuple[MomentTerms, bool, bool], ...]:
    """_interleaved_terms on the numbers it depends on (cached: configurations differing in
    tp, cp, dp, microbatch size or policy share it)."""
    return tuple((t, mo.backward, mo.at_loss)
                 for mo in interleaved_moments(pp, v, m, r, chunks, per_block, schedule)
                 for t in moment_terms(mo, pp, r, chunks))


def _interleaved_form(cfg, r, t: MomentTerms, shares, kept, sharded_grad, rb, unit,
                      kept_frozen, output_bytes, recv, bwd, backward, at_loss) -> RankMemory:
    """One moment of [Note: interleaved moments] as a linear form (rank_memories): the
    compute-dtype gradients of a block's backward (`bwd`) at a backward, the logits and the
    loss at the last rank's loss."""
    param = {p: (kept + rb * t.unsharded.get(p, 0.0) + sharded_grad * t.sharded.get(p, 0.0)
                 + unit * t.gathered.get(p, 0.0)) * sh + (bwd.get(p, 0.0) if backward else 0.0)
             for p, sh in shares.items()}
    frozen = {p: (kept_frozen + unit * t.gathered.get(p, 0.0)) * sh
              for p, sh in shares.items()} if kept_frozen is not None else None
    acts = {p: t.act.get(p, 0.0) * sh for p, sh in shares.items()}
    if at_loss:
        return RankMemory(param, acts, output_bytes, t.sent + recv, frozen, _loss_coef(cfg),
                          at_loss=True)
    return RankMemory(param, acts, 0.0, t.sent + recv, frozen)


def candidate_ranks(cfg: Config, layers: list[int]) -> list[int]:
    """The pipeline ranks that can be the busiest or the fullest: the first, the last and the
    first rank of every run of middle ranks with equal layers and equal
    `grads_at_activation_peak`. Inside such a run every quantity of [Note: step time] and
    [Note: memory per rank] is non-increasing in r (the microbatches in flight,
    `pipeline_in_flight_microbatches`, fall with r under every schedule but zero bubble; the
    receive buffers, stage outputs and parts are those of any middle rank), so the run's
    first rank bounds the others and, coming first, is the one `max` picks on a tie. Under
    zero bubble the microbatches in flight rise with r ([Note: zero-bubble memory]), so the
    last rank of every run is kept too. tests/test_context_parallel.py checks assess over
    these against every rank."""
    return _ranks_to_check(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.num_virtual_stages,
                           tuple(layers))


@functools.lru_cache(maxsize=16384)
def _ranks_to_check(schedule: str, pp: int, m: int, v: int,
                    layers: tuple[int, ...]) -> tuple[int, ...]:
    """candidate_ranks on the numbers it depends on (cached: configurations differing only
    in tp, cp, dp, ZeRO, microbatch size or policy share it)."""
    keys = [(layers[r], _grads_at_peak(schedule, pp, m,
                                       pipeline_in_flight_microbatches(schedule, pp, m, r, v)))
            for r in range(pp)]
    rising = schedule == "interleaved-zb"
    return tuple(r for r in range(pp)
                 if r in (0, 1, pp - 1) or keys[r] != keys[r - 1]
                 or (rising and (r == pp - 2 or keys[r] != keys[r + 1])))


@dataclasses.dataclass(frozen=True)
class ExpertSlices:
    """The routed experts' weights of a plan with expert parallelism ep > 1, as each rank
    holds them ([Note: expert parallelism] in cost_model/expert_parallel.py;
    autoplan/runtime/expert_parallel.py): a rank holds the 1 / ep slice of every expert weight
    of its layers, whole -- FSDP2 leaves them out (`ignored_params`), so no ZeRO stage shards
    them, no unit gathers them (the op reads the slice itself) and they are not in the
    deferred reduction --, its gradient whole (`p.grad` in the parameter's dtype, made by the
    first backward, summed over the slice's dp / ep ranks before the optimizer step) and its
    optimizer states whole.

    Attributes:
        elems: expert weight elements of the blocks ("layer" part, full depth, as
            `Solution.param_elems["layer"]` counts them), all experts.
        frozen_elems: of those, the frozen ones (no gradient, no optimizer state).
        ep: the expert-parallel degree.
        act_bytes: what the ep exchange keeps for the backward per microbatch, all MoE layers
            of the full model (cost_model/expert_parallel.py `expert_slices`): held like the
            blocks' activations, in the "layer" part.
        num_layers: MoE layers of the full model: with more than one microbatch, one layer's
            slice gradient is a transient of its backward (autograd adds the new gradient to
            `.grad`).
    """

    elems: float
    frozen_elems: float
    ep: int
    act_bytes: float = 0.0
    num_layers: float = 0.0


def _without_experts(sol: Solution, experts: ExpertSlices) -> Solution:
    """`sol` with the expert weights out of its "layer" part: what FSDP2 manages."""
    elems = dict(sol.param_elems)
    elems["layer"] = max(0.0, elems.get("layer", 0.0) - experts.elems)
    frozen = dict(sol.frozen_elems)
    if experts.frozen_elems:
        frozen["layer"] = max(0.0, frozen.get("layer", 0.0) - experts.frozen_elems)
    return dataclasses.replace(sol, param_elems=elems, frozen_elems=frozen)


def _expert_slice_states(cfg: Config, spec: TrainingSpec, experts: ExpertSlices,
                         layer_share: float, offload: str) -> dict[str, float]:
    """{"params", "grads", "optimizer"} bytes of the expert slice a rank holding
    `layer_share` of the layers keeps (ExpertSlices): the fsdp2 recipe's states of its
    elements, unsharded (ZeRO-0, dp 1) but under ZeRO-1, whose optimizer states are
    partitioned over the dp / ep ranks holding the slice (runtime/expert_parallel.py), on the
    device as `offload` leaves them."""
    elems = experts.elems * layer_share / experts.ep
    frozen = experts.frozen_elems * layer_share / experts.ep
    zero, ranks = (1, cfg.dp // experts.ep) if cfg.zero_stage == 1 else (0, 1)
    return offload_costs.device_states(model_state_bytes(
        elems, zero, ranks, mixed_precision=spec.mixed_precision, optimizer=spec.optimizer,
        recipe="fsdp2", frozen_params=frozen,
        frozen_param_bytes=frozen_param_bytes(spec) if frozen else None), offload)


def _rank_states(cfg: Config, sol: Solution, spec: TrainingSpec, share: dict[str, float],
                 offload: str, experts: ExpertSlices | None) -> tuple:
    """(the Solution FSDP2 manages, its model states on the device, the expert slices' states
    beside it) of a rank holding `share` of the parts, bytes by category ("params", "grads",
    "optimizer"): rank_peak's."""
    # under ep the expert slices are held beside what FSDP2 manages (ExpertSlices): priced
    # apart, their gradients like the others' (from the first backward on)
    extra = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    if experts is not None and experts.ep > 1:
        sol = _without_experts(sol, experts)
        extra = _expert_slice_states(cfg, spec, experts, share["layer"], offload)
    elems, frozen = sol.param_elems_on(share), sol.frozen_elems_on(share)
    states = offload_costs.device_states(model_state_bytes(
        elems, cfg.zero_stage, cfg.dp_shard, mixed_precision=spec.mixed_precision,
        optimizer=spec.optimizer, recipe="fsdp2", frozen_params=frozen,
        frozen_param_bytes=frozen_param_bytes(spec) if frozen else None), offload)
    return sol, states, extra


def memory_floor_bytes(cfg: Config, sol: Solution, spec: TrainingSpec, *, total_layers: int,
                       offload: str = "none",
                       experts: ExpertSlices | None = None) -> float:
    """A floor of the largest `rank_peak` of `cfg` at `sol`, bytes, at a fraction of
    rank_peaks' price ([Note: time first] in solver/branch_bound.py): per candidate rank the
    parameters and optimizer states on the device, which every moment holds, and the
    activations of moment A (the microbatches in flight, with the expert exchange's under ep),
    which every moment A holds -- except where the moments are walked from the interleaved
    schedule's actions (deferred reduction, v > 1: [Note: interleaved moments]), whose
    activations are priced per moment: there the states alone."""
    layers = rank_layers(cfg, total_layers)
    walked = _deferred_reduction(cfg) and _interleaved(cfg)
    most = 0.0
    for r in candidate_ranks(cfg, layers):
        share = rank_shares(r, cfg, layers, total_layers)
        _sol, states, extra = _rank_states(cfg, sol, spec, share, offload, experts)
        floor = states["params"] + states["optimizer"] + extra["params"] + extra["optimizer"]
        if not walked:
            in_flight = in_flight_by_part(cfg, r, total_layers)
            floor += sum(sol.act_bytes.get(p, 0.0) * s * in_flight[p] for p, s in share.items())
            if experts is not None and experts.ep > 1:
                floor += experts.act_bytes * share["layer"] * in_flight["layer"]
        most = max(most, floor)
    return most


def rank_peaks(cfg: Config, sol: Solution, spec: TrainingSpec, *, total_layers: int,
               output_bytes: float, boundary_bytes: float,
               offload: str = "none",
               experts: ExpertSlices | None = None,
               transient_bytes: float = 0.0) -> list[dict[str, float]]:
    """[Note: memory per rank] of every pipeline rank of `cfg` (not only the candidates
    `assess` weighs): per pp rank, bytes by category (params, grads, optimizer, activations,
    temporaries, comm_buffers) of its larger moment and "peak", their sum. What the dry run
    holds each rank against (autoplan/runtime/dryrun.py). `experts`: the expert weights'
    slices under expert parallelism (ExpertSlices), held outside FSDP2."""
    layers = rank_layers(cfg, total_layers)
    return [rank_peak(cfg, sol, spec, r, layers, total_layers, output_bytes, boundary_bytes,
                       offload, experts=experts, transient_bytes=transient_bytes)
            for r in range(cfg.pp)]


def rank_peak(cfg, sol, spec, r, layers, total_layers, output_bytes,
               boundary_bytes, offload="none", share=None,
               experts: ExpertSlices | None = None,
               transient_bytes: float = 0.0) -> dict[str, float]:
    """[Note: memory per rank] of rank r: bytes by category of its largest moment ([Note:
    peak moments]) and "peak". `transient_bytes`: the checkpointing policy's recomputation
    transient (solver/checkpointing.py), on a rank that holds layers at every moment but its
    loss (the last rank's moment A splits in two: at the loss, with the logits and the
    loss's working set, and at the backward of its last layer, with the transient)."""
    share = share or rank_shares(r, cfg, layers, total_layers)
    sol, states, extra = _rank_states(cfg, sol, spec, share, offload, experts)
    elems, frozen = sol.param_elems_on(share), sol.frozen_elems_on(share)
    parts_in_flight = in_flight_by_part(cfg, r, total_layers)
    in_flight = pipeline_in_flight_microbatches(cfg.schedule, cfg.pp, cfg.num_microbatches, r,
                                                cfg.num_virtual_stages)
    # the activations at moment A over the microbatches in flight: one microbatch's through
    # all of the rank's layers when its chunks hold alike ([Note: interleaved in-flight
    # chunks])
    acts = sum(sol.act_bytes.get(p, 0.0) * s * parts_in_flight[p]
               for p, s in share.items()) / in_flight
    if experts is not None and experts.ep > 1:
        acts += experts.act_bytes * share["layer"] * parts_in_flight["layer"] / in_flight
    late = sum(sol.act_bytes.get(p, 0.0) * c
               for p, c in _late_coef(r, layers, share, total_layers).items())
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
    output_bytes = output_bytes if r == cfg.pp - 1 else 0.0
    transient = transient_bytes if layers[r] else 0.0

    def peak(output: float, recompute: float) -> dict[str, float]:
        if _deferred_reduction(cfg):
            return _deferred_peak(cfg, sol, spec, r, layers, total_layers, share, states,
                                  gathered=gathered, acts=acts + sent, late=late,
                                  in_flight=in_flight, output_bytes=output,
                                  recv=_recv_buffer_bytes(cfg, r, boundary_bytes), extra=extra,
                                  recompute_bytes=recompute)
        return _peak(cfg, spec, states, extra, acts + sent, late, in_flight, output,
                     _recv_buffer_bytes(cfg, r, boundary_bytes), gathered, grad_unit,
                     recompute)

    bwd = _backward_grad_share(cfg, spec, r, layers)
    # bwd is the compute dtype's width times a share of each part: trainable elements on it
    bwd_share = {p: c / spec.dtype_bytes for p, c in bwd.items()}
    grads_bwd = spec.dtype_bytes * (sol.param_elems_on(bwd_share)
                                    - sol.frozen_elems_on(bwd_share))
    if _deferred_reduction(cfg) and _interleaved(cfg):
        out = _interleaved_peak(cfg, sol, spec, r, layers, total_layers, share, states,
                                extra, output_bytes=output_bytes, transient=transient,
                                grads_bwd=grads_bwd, sent_bytes=boundary_bytes,
                                recv=_recv_buffer_bytes(cfg, r, boundary_bytes),
                                act_bytes_of=_act_bytes_of(sol, experts, share),
                                late=late)
    elif output_bytes and (transient or grads_bwd):  # the loss, then its last layer's backward
        out = max(peak(output_bytes, 0.0), peak(0.0, transient + grads_bwd),
                  key=lambda m: m["peak"])
    else:
        out = peak(output_bytes, transient + grads_bwd)
    if experts is not None and experts.ep > 1 and experts.num_layers and share["layer"] \
            and cfg.num_microbatches > 1:
        # a MoE layer's backward makes its slice's gradient anew and adds it to the one the
        # earlier microbatches left (autograd's accumulation): one layer's slice gradient more
        moe_layers = experts.num_layers * share["layer"]
        out["temporaries"] += extra["grads"] / moe_layers
        out["peak"] += extra["grads"] / moe_layers
    first = _first_gather(cfg, r, layers)
    if first is not None:  # [Note: first gather]: before any backward, so no such transient
        grads_c = states["grads"] + extra["grads"] if _grads_at_first_gather(cfg) else 0.0
        c = {"params": states["params"] + extra["params"], "grads": grads_c,
             "optimizer": states["optimizer"] + extra["optimizer"], "activations": 0.0,
             "temporaries": spec.dtype_bytes * sol.param_elems_on(
                 {p: s * first.get(p, 0.0) for p, s in share.items()}),
             "comm_buffers": _recv_buffer_bytes(cfg, r, boundary_bytes)}
        c["peak"] = sum(c.values())
        if c["peak"] > out["peak"]:
            return c
    return out


def _first_gather(cfg: Config, r: int, layers) -> dict[str, float] | None:
    """[Note: first gather] Under ZeRO-3 with one FSDP2 unit per block (dp > 1; not the
    interleaved schedule, whose UNSHARD is [Note: interleaved moments]), the step's first
    forward gathers the stage's root unit and then the first block, and FSDP2 keeps an
    all-gather's output until the next unit's all-gather is copied out: at the first block's
    copy-out the rank holds the root's all-gather output and parameters and the block's, with
    no activation yet. Per part, the gathered multiple of its elements at that moment (2 of the
    root parts, 2 blocks of the rank's); None where it does not apply. Measured by the dry run
    of bench/finetune_memory.py's LoRA Llama at dp 4 ZeRO-3 (28 storages, 0.921 GB: its 412 MB
    root twice and a 48 MB block twice); without it that rank was priced 7% low."""
    if not _per_block(cfg) or _interleaved(cfg):
        return None
    out = {"pre": 2.0, "post": 2.0}
    if layers[r]:
        out["layer"] = 2.0 / layers[r]
    return out


def _grads_at_first_gather(cfg: Config) -> bool:
    """Whether gradients exist when a forward gathers the root ([Note: first gather]): with
    more than one microbatch and no pipelining the root is resharded after each backward and
    gathered again by the next forward, after the earlier microbatches' gradients were made;
    a pipeline's stages keep their units gathered until the step's end (deferred reduction)."""
    return not _deferred_reduction(cfg) and cfg.num_microbatches > 1


def _peak(cfg, spec, states, extra, acts, late, in_flight, output_bytes, recv, gathered,
          grad_unit, recompute_bytes) -> dict[str, float]:
    """peak_memory_bytes of a rank without deferred reduction (rank_peak's terms)."""
    return peak_memory_bytes(
        model_states={k: states[k] + extra[k] for k in extra}, activation_bytes=acts,
        in_flight_microbatches=in_flight,
        zero_stage=cfg.zero_stage, dp=cfg.dp_shard, recompute_bytes=recompute_bytes,
        output_bytes=output_bytes, comm_buffer_bytes=recv,
        gather_unit_bytes=gathered * spec.dtype_bytes,
        unsharded_grad_bytes=grad_unit * spec.dtype_bytes,
        grads_at_activation_peak=grads_at_activation_peak(cfg, in_flight),
        late_activation_bytes=late, cast_unit=spec.mixed_precision)


def _deferred_peak(cfg, sol, spec, r, layers, total_layers, share, states, *, gathered,
                   acts, late, in_flight, output_bytes, recv, extra,
                   recompute_bytes=0.0) -> dict[str, float]:
    """The peak of rank r under [Note: deferred reduction], with its breakdown (as
    peak_memory_bytes gives it): the larger of moments A and B. `extra`: states held outside
    FSDP2 (the expert slices, ExpertSlices), their gradients from the first backward on;
    `recompute_bytes`: a recomputation's transient, at both moments."""
    unit = _unit_factor(cfg, spec.mixed_precision) * spec.dtype_bytes
    trainable = sol.param_elems_on(share) - sol.frozen_elems_on(share)
    moment_a = {"params": states["params"] + extra["params"],
                "optimizer": states["optimizer"] + extra["optimizer"],
                "grads": trainable * _reduce_bytes(spec) + extra["grads"]
                if grads_at_activation_peak(cfg, in_flight) else 0.0,
                "activations": acts * in_flight,
                "temporaries": gathered * unit + output_bytes + recompute_bytes,
                "comm_buffers": recv}
    return _largest([moment_a, _deferred_moment_b(cfg, sol, spec, r, layers, total_layers,
                                                  share, states, late=late, recv=recv,
                                                  extra=extra,
                                                  recompute_bytes=recompute_bytes)])


def _deferred_moment_b(cfg, sol, spec, r, layers, total_layers, share, states, *, late, recv,
                       extra, recompute_bytes) -> dict[str, float]:
    """Moment B of [Note: deferred reduction] by category: the rank's first chunk gathered
    whole with its gradients unsharded, the other chunks reduced, the reduce-scatter input of
    the unit FSDP2 reduces first."""
    rb = _reduce_bytes(spec)
    last = _last_chunk_fraction(cfg, r, layers)
    first = _first_reduced(cfg, r, layers, total_layers)
    trainable = sol.param_elems_on(share) - sol.frozen_elems_on(share)
    in_last = {p: s * last[p] for p, s in share.items()}
    last_elems = sol.param_elems_on(in_last)
    last_trainable = last_elems - sol.frozen_elems_on(in_last)
    sharded_grad = states["grads"] / trainable if trainable else 0.0
    first_trainable = sol.param_elems_on(first) - sol.frozen_elems_on(first)
    late_grads = (trainable - last_trainable) * sharded_grad + last_trainable * rb \
        + extra["grads"]
    return {"params": states["params"] + extra["params"],
            "optimizer": states["optimizer"] + extra["optimizer"],
            "grads": late_grads + first_trainable * rb, "activations": late,
            "temporaries": last_elems * spec.dtype_bytes + recompute_bytes, "comm_buffers": recv}


def _largest(moments: list[dict[str, float]]) -> dict[str, float]:
    """Of moments by category, the largest, with "peak" = its sum."""
    breakdown = max(moments, key=lambda m: sum(m.values()))
    breakdown = {k: float(breakdown[k]) for k in ("params", "grads", "optimizer", "activations",
                                                  "temporaries", "comm_buffers")}
    breakdown["peak"] = sum(breakdown.values())
    return breakdown


def _act_bytes_of(sol: Solution, experts: ExpertSlices | None, share: dict):
    """Activation bytes per microbatch of each part on a rank holding `share` of it, the
    exchange's of the expert slices under ep with the layers' (ExpertSlices.act_bytes)."""
    def of(part: str) -> float:
        out = sol.act_bytes.get(part, 0.0) * share.get(part, 0.0)
        if part == "layer" and experts is not None and experts.ep > 1:
            out += experts.act_bytes * share["layer"]
        return out
    return of


def _interleaved_peak(cfg, sol, spec, r, layers, total_layers, share, states, extra, *,
                      output_bytes, transient, grads_bwd, sent_bytes, recv, act_bytes_of,
                      late) -> dict[str, float]:
    """The peak of rank r under deferred reduction and the interleaved schedule, with its
    breakdown: the largest of the moments of [Note: interleaved moments] (the logits and the
    loss at the loss; a recomputation's transient at any other moment with blocks' activations
    in flight, a block's compute-dtype gradients at a backward) and moment B of [Note:
    deferred reduction]."""
    unit = _unit_factor(cfg, spec.mixed_precision) * spec.dtype_bytes
    rb = _reduce_bytes(spec)
    elems, frozen = sol.param_elems_on(share), sol.frozen_elems_on(share)
    trainable = elems - frozen
    sharded_grad = states["grads"] / trainable if trainable else 0.0
    base = {"params": states["params"] + extra["params"],
            "optimizer": states["optimizer"] + extra["optimizer"]}

    # per part, the rank's elements (all, trainable) and activation bytes: a moment is linear
    # in them. A parameter several parts share (a tied embedding and head) lies in one part
    # of a pipeline rank only (pp > 1 under deferred reduction), so param_elems_on of one part
    # at a time counts it once
    parts = [p for p in share if share[p]]
    all_p = {p: sol.param_elems_on({p: share[p]}) for p in parts}
    trainable_p = {p: all_p[p] - sol.frozen_elems_on({p: share[p]}) for p in parts}
    act_p = {p: act_bytes_of(p) for p in parts}

    moments = []
    for t, backward, at_loss in _interleaved_terms(cfg, r, total_layers):
        with_grads = any(t.unsharded.values()) or any(t.sharded.values())
        recompute = grads_bwd if backward else 0.0
        if not at_loss and t.act.get("layer", 0.0) and share["layer"]:
            recompute += transient
        moments.append({
            **base,
            "grads": sum(trainable_p[p] * (t.unsharded.get(p, 0.0) * rb
                                           + t.sharded.get(p, 0.0) * sharded_grad)
                         for p in parts) + (extra["grads"] if with_grads else 0.0),
            "activations": sum(act_p[p] * t.act.get(p, 0.0) for p in parts)
            + t.sent * sent_bytes,
            "temporaries": unit * sum(all_p[p] * t.gathered.get(p, 0.0) for p in parts)
            + (output_bytes if at_loss else 0.0) + recompute,
            "comm_buffers": recv})
    return _largest([*moments, _deferred_moment_b(
        cfg, sol, spec, r, layers, total_layers, share, states, late=late, recv=recv,
        extra=extra, recompute_bytes=transient + grads_bwd)])


def frozen_param_bytes(spec: TrainingSpec) -> float | None:
    """Bytes a rank holds per frozen parameter element before ZeRO sharding ([Note: frozen
    pricing] in cost_model/memory.py): the compute dtype's width when the frozen base is held
    in it (`spec.frozen_dtype`, Plan.frozen_dtype), else None (as a trainable one: its fp32
    master)."""
    return float(spec.dtype_bytes) if spec.frozen_dtype else None
