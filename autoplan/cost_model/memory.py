"""Memory per rank: model states by ZeRO stage, activations by checkpointing policy and pipeline
schedule, and the peak they compose to.

Sources: ZeRO (Rajbhandari et al. 2020, section 5, Table 1) for model states; Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models", Table 2) for activations;
Narayanan et al. SC'21 and Megatron-LM's interleaved schedule for microbatches in flight. The
same formulas, symbolically, are in `autoplan.cost_model.symbolic` (tests check they agree).
Activations derived from a captured graph: activations.py ([Note: saved tensors]).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from autoplan.cost_model.schedule_moments import zero_bubble_in_flight
from autoplan.options import INTERLEAVED_SCHEDULES, SCHEDULES

__all__ = [
    "STATE_BYTES_PER_PARAM", "FSDP2_MIXED_STATE_BYTES", "model_state_bytes",
    "microbatches_per_round",
    "activation_bytes_per_layer_closed_form", "pipeline_in_flight_microbatches",
    "peak_memory_bytes", "RECOMPUTE_POLICIES", "loss_working_bytes", "vocab_parallel_loss_bytes",
]

RECOMPUTE_POLICIES = ("none", "selective", "full")

# (params, grads, optimizer states) bytes per parameter, by (mixed_precision, optimizer).
# Mixed-precision Adam: fp16/bf16 params and grads, K = 12 (fp32 master params, momentum,
# variance) -- ZeRO section 5. Mixed-precision SGD keeps only the fp32 master params (K = 4).
# fp32 training: params and grads 4 bytes, Adam momentum + variance 8, SGD (no momentum) none.
STATE_BYTES_PER_PARAM = {
    (True, "adamw"): (2.0, 2.0, 12.0),
    (True, "sgd"): (2.0, 2.0, 4.0),
    (False, "adamw"): (4.0, 4.0, 8.0),
    (False, "sgd"): (4.0, 4.0, 0.0),
}


# autoplan's runtime recipe ([Note: precision recipe] in autoplan/runtime/precision.py): FSDP2's
# MixedPrecisionPolicy keeps the parameters as fp32 masters (sharded like parameters), reduces
# gradients in fp32 and AdamW keeps fp32 moments; the 16-bit compute copy of a data-parallel unit
# is a transient, priced with the gathered unit (peak_memory_bytes). Same 16 bytes per parameter
# as ZeRO's K = 12 recipe, split 4 + 4 + 8: ZeRO-1/2 then shard less than the paper's split.
FSDP2_MIXED_STATE_BYTES = {"adamw": (4.0, 4.0, 8.0), "sgd": (4.0, 4.0, 0.0)}


def model_state_bytes(num_params: float, zero_stage: int, dp: int, *,
                      mixed_precision: bool = True,
                      optimizer: str = "adamw", recipe: str = "zero",
                      frozen_params: float = 0.0,
                      frozen_param_bytes: float | None = None) -> dict[str, float]:
    """Bytes per rank of parameters, gradients and optimizer states (ZeRO Table 1).

    Stage 1 shards the optimizer states over the dp ranks, stage 2 also the gradients, stage 3
    also the parameters. For mixed-precision Adam (2 + 2 + K=12 bytes per parameter):
    stage 0: 16 Psi; 1: 4 Psi + 12 Psi / N_d; 2: 2 Psi + 14 Psi / N_d; 3: 16 Psi / N_d.

    [Note: frozen pricing] A frozen parameter (`requires_grad=False`, [Note: frozen
    parameters] in autoplan/runtime/engine.py) is held, and sharded by ZeRO-3, like any other,
    but has no gradient and no optimizer state: of `num_params`, the `frozen_params` cost
    `frozen_param_bytes` each in "params" (the compute dtype's width when the plan holds the
    frozen base in 16-bit, `Plan.frozen_dtype`; default: a trainable parameter's) and nothing
    in "grads" and "optimizer". With no frozen parameter the figures are the paper's.

    Args:
        num_params: parameters held by this rank before ZeRO sharding (after tensor and
            pipeline splitting), frozen ones included.
        zero_stage: 0, 1, 2 or 3.
        dp: data-parallel degree N_d (>= 1).
        mixed_precision: 16-bit params/grads with fp32 master states; False for fp32 training.
        optimizer: "adamw" or "sgd" (see STATE_BYTES_PER_PARAM).
        recipe: "zero" (the paper's mixed-precision split, above) or "fsdp2" (what autoplan's
            runtime holds: under mixed precision FSDP2_MIXED_STATE_BYTES, and at stage 2 the
            parameters sharded as at stage 3, FSDP2's fully_shard keeping only the shard as
            the parameter; its gathered copy is not counted here).
        frozen_params: how many of `num_params` are frozen (0 <= frozen_params <= num_params).
        frozen_param_bytes: bytes per frozen parameter; None: the recipe's "params" bytes.

    Returns {"params", "grads", "optimizer"} in bytes. Raises ValueError for a bad stage, dp,
    parameter count, frozen count, optimizer or recipe.
    """
    if recipe not in ("zero", "fsdp2"):
        raise ValueError(f"recipe {recipe!r} is not 'zero' or 'fsdp2'")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage} is not one of 0, 1, 2, 3")
    if dp < 1 or num_params < 0:
        raise ValueError(f"dp={dp} must be >= 1 and num_params={num_params} >= 0")
    if frozen_params and not 0 <= frozen_params <= num_params * (1 + 1e-12):
        raise ValueError(f"frozen_params={frozen_params} must be in [0, num_params="
                         f"{num_params}]")
    key = (bool(mixed_precision), optimizer)
    if key not in STATE_BYTES_PER_PARAM:
        raise ValueError(f"optimizer {optimizer!r} not in ['adamw', 'sgd']")
    params, grads, states = STATE_BYTES_PER_PARAM[key]
    if recipe == "fsdp2" and mixed_precision:
        params, grads, states = FSDP2_MIXED_STATE_BYTES[optimizer]
    frozen_b = params if frozen_param_bytes is None else frozen_param_bytes
    trainable = max(0.0, num_params - frozen_params)  # >= 0 through float residue
    # FSDP2 (fully_shard, the runtime's ZeRO-2 and 3) keeps every parameter sharded; ZeRO-2's
    # whole gathered copy is a unit it holds besides (cost_model/rank_memory.py [Note: memory
    # per rank])
    params_sharded = zero_stage >= 3 or (recipe == "fsdp2" and zero_stage == 2)
    return {
        "params": (trainable * params + frozen_params * frozen_b)
        / (dp if params_sharded else 1),
        "grads": trainable * grads / (dp if zero_stage >= 2 else 1),
        "optimizer": trainable * states / (dp if zero_stage >= 1 else 1),
    }


def activation_bytes_per_layer_closed_form(s: float, b: float, h: float, a: float,
                                           t: float = 1, *, sequence_parallel: bool = False,
                                           recompute: str = "none") -> float:
    """Activation bytes of one transformer layer (Korthikanti et al. 2022, Table 2).

    16-bit activations, dropout masks counted, s = sequence length, b = microbatch size,
    h = hidden size, a = attention heads, t = tensor-parallel size:

    | recompute  | sequence_parallel=False          | sequence_parallel=True      |
    |------------|----------------------------------|-----------------------------|
    | "none"     | sbh (10 + 24/t + 5as/(ht))       | sbh (34/t + 5as/(ht))       |
    | "selective"| sbh (10 + 24/t)                  | 34 sbh / t                  |
    | "full"     | 2 sbh (layer input)              | 2 sbh / t (input is s-split)|

    With t = 1 the first row is the "no parallelism" row, sbh (34 + 5as/h).
    Raises ValueError for an unknown recompute policy or t < 1.
    """
    if recompute not in RECOMPUTE_POLICIES:
        raise ValueError(f"recompute {recompute!r} not in {list(RECOMPUTE_POLICIES)}")
    if t < 1:
        raise ValueError(f"tensor-parallel size t={t} must be >= 1")
    sbh = s * b * h
    scores = 5 * a * s / (h * t)
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if recompute == "selective":
        return sbh * (34 / t if sequence_parallel else 10 + 24 / t)
    return sbh * ((34 / t if sequence_parallel else 10 + 24 / t) + scores)


@functools.lru_cache(maxsize=65536)  # called per rank of every configuration the search bounds
def microbatches_per_round(pp: int, num_microbatches: int) -> int:
    """The microbatches the interleaved schedule runs through one chunk before the next
    (torch 2.13 ScheduleInterleaved1F1B, `microbatches_per_round`: m over its rounds of at
    least pp): pp when pp divides m, m when m < pp."""
    return num_microbatches // max(1, num_microbatches // pp)


def pipeline_in_flight_microbatches(schedule: str, pp: int, num_microbatches: int,
                                    stage: int = 0, num_virtual_stages: int = 1) -> float:
    """Microbatches whose activations a pipeline rank holds at its peak, in units of one
    microbatch through all of the rank's layers.

    - "gpipe": all m forwards run before any backward: m.
    - "1f1b": rank r runs pp - r warm-up forwards before its first backward: min(m, pp - r)
      (Narayanan et al. SC'21, section 2.2.1).
    - "interleaved-zb" (torch's ScheduleInterleavedZeroBubble): a microbatch is held from
      its forward to its weight gradient; the rank's largest count over its actions, over v
      (cost_model/schedule_moments.py `zero_bubble_in_flight`).
    - "interleaved-1f1b" with v = num_virtual_stages chunks of 1/v of the rank's layers:
      Megatron-LM's warm-up of 2 (pp - r - 1) + (v - 1) R chunk-forwards, plus the one in
      steady state, capped at m v: min(2 (pp - r - 1) + (v - 1) R + 1, m v) / v, with R =
      `microbatches_per_round` (pp when pp divides m). For r = 0 this is
      pp (1 + (pp - 1) / (pp v)), Korthikanti et al. 2022's factor (section 4, pipeline
      parallelism). With v = 1 it is 1f1b.

    Raises ValueError for an unknown schedule or out-of-range numbers.
    """
    p, m, r, v = pp, num_microbatches, stage, num_virtual_stages
    if p < 1 or m < 1 or v < 1 or not 0 <= r < p:
        raise ValueError(f"pp={p}, num_microbatches={m}, num_virtual_stages={v} must be >= 1 "
                         f"and stage={r} in [0, {p})")
    if schedule == "gpipe":
        in_flight = float(m)
    elif schedule == "1f1b" or (schedule == "interleaved-1f1b" and v == 1):
        in_flight = float(min(m, p - r))
    elif schedule == "interleaved-1f1b":
        in_flight = min(2 * (p - r - 1) + (v - 1) * microbatches_per_round(p, m) + 1,
                        m * v) / v
    elif schedule == "interleaved-zb":
        in_flight = sum(zero_bubble_in_flight(p, v, m, r)) / v
    else:
        raise ValueError(f"unknown schedule {schedule!r}; known: {list(SCHEDULES)}")
    if v > 1 and schedule not in INTERLEAVED_SCHEDULES:
        raise ValueError(f"num_virtual_stages={v} needs schedule 'interleaved-1f1b' or "
                         f"'interleaved-zb', got {schedule!r}")
    return in_flight


def peak_memory_bytes(*, model_states: Mapping[str, float], activation_bytes: float,
                      in_flight_microbatches: float, zero_stage: int = 0, dp: int = 1,
                      layer_param_bytes: float = 0.0, recompute_bytes: float = 0.0,
                      output_bytes: float = 0.0, comm_buffer_bytes: float = 0.0,
                      prefetch_layers: int = 1, gather_unit_bytes: float | None = None,
                      grads_at_activation_peak: bool = True,
                      late_activation_bytes: float = 0.0,
                      cast_unit: bool = False,
                      unsharded_grad_bytes: float | None = None) -> dict[str, float]:
    """Peak memory of one rank, with its breakdown, bytes.

    [Note: peak moments] The peak is a peak, not a sum of unrelated maxima: it is the larger of
    two moments, each counting what is live then once.

    A. Activations at their height: the backward of the rank's last layer for the oldest
       microbatch in flight is about to start (its recomputation, if any, running):
       params + optimizer + (gradients, if `grads_at_activation_peak`: earlier microbatches'
       backward already made them) + activation_bytes x in_flight_microbatches +
       recompute_bytes + output_bytes (logits and loss working set, last pipeline stage).
    B. The backward of the rank's first layer (of its last microbatch), before the gradient
       reduction: params + optimizer + the gradients in full (the unsharded gradients of the
       data-parallel unit, ZeRO-2/3 with dp > 1, on top of model_states["grads"]) +
       `late_activation_bytes` (what that layer and the layers before it still hold) +
       recompute_bytes (that layer's recomputation).

    Both moments also hold the data-parallel gather buffers and the collective buffers
    (`comm_buffer_bytes`: NCCL/DDP buckets, pipeline receive buffers):
    - per-layer units (`gather_unit_bytes` None; FSDP with one unit per block, prefetching the
      next): ZeRO-3 holds the gathered parameters of the current layer and of `prefetch_layers`
      next ones, (1 + prefetch_layers) x layer_param_bytes, and the unsharded gradient of one
      layer, layer_param_bytes, is B's extra;
    - one unit of `gather_unit_bytes` (the runtime's: one FSDP2 unit per pipeline stage, see
      cost_model/rank_memory.py [Note: memory per rank]): with dp > 1 every ZeRO stage holds the
      gathered unit (FSDP2's replicate gathers too), ZeRO-2/3 also its all-gather input, one
      dp-th of it; B's extra unsharded gradient is the whole unit.

    Args:
        model_states: {"params", "grads", "optimizer"} bytes of this rank (`model_state_bytes`).
        activation_bytes: saved activations of one microbatch through all of this rank's layers
            (after tensor/sequence sharding and the checkpointing policy).
        in_flight_microbatches: from `pipeline_in_flight_microbatches` (1 without pipelining).
        zero_stage, dp: ZeRO stage and data-parallel degree.
        layer_param_bytes: parameters of the largest layer on this rank at compute precision,
            before ZeRO sharding.
        recompute_bytes: activations rematerialised for a backward (full recompute: one layer's
            activations without checkpointing; selective: its attention scores).
        output_bytes, comm_buffer_bytes: see above.
        prefetch_layers: layers gathered ahead under ZeRO-3 with per-layer units.
        gather_unit_bytes: parameters of one data-parallel unit at compute precision, unsharded
            (None: per-layer units).
        grads_at_activation_peak: whether gradients exist at moment A (True for gradient
            accumulation and steady-state 1F1B; False for one microbatch or GPipe, when the
            step starts without gradients).
        late_activation_bytes: activations held at moment B (one layer of one microbatch and
            what precedes the layers on the first pipeline rank).
        cast_unit: mixed precision at dp 1: FSDP2 still makes the unit's 16-bit compute copy
            (`gather_unit_bytes`), held like a gathered unit.
        unsharded_grad_bytes: with `gather_unit_bytes`, the unsharded gradients that exist at
            once before their reduction when they are fewer than the gathered unit (ZeRO-3
            with one unit per block); default: `gather_unit_bytes`.

    Returns the breakdown of the larger moment: params, grads, optimizer, activations,
    temporaries, comm_buffers, and "peak" = their sum. Raises ValueError for a missing
    model-state entry or a negative size.
    """
    missing = sorted({"params", "grads", "optimizer"} - set(model_states))
    if missing:
        raise ValueError(f"model_states lacks {missing}; pass model_state_bytes(...)")
    sizes = dict(activation_bytes=activation_bytes, in_flight_microbatches=in_flight_microbatches,
                 layer_param_bytes=layer_param_bytes, recompute_bytes=recompute_bytes,
                 output_bytes=output_bytes, comm_buffer_bytes=comm_buffer_bytes,
                 gather_unit_bytes=gather_unit_bytes or 0.0,
                 late_activation_bytes=late_activation_bytes)
    negative = {k: v for k, v in sizes.items() if not v >= 0}
    if negative:
        raise ValueError(f"sizes must be >= 0: {negative}")
    sharded = zero_stage >= 2 and dp > 1
    if gather_unit_bytes is None:
        gathered = (1 + prefetch_layers) * layer_param_bytes if zero_stage == 3 and dp > 1 \
            else 0.0
        unsharded_grad = layer_param_bytes if sharded else 0.0
    else:
        gathered = gather_unit_bytes * (1 + (1 / dp if sharded else 0)) if dp > 1 \
            else (gather_unit_bytes if cast_unit else 0.0)
        grad_unit = gather_unit_bytes if unsharded_grad_bytes is None else unsharded_grad_bytes
        unsharded_grad = grad_unit if sharded else 0.0
    grads = float(model_states["grads"])
    base = {"params": float(model_states["params"]),
            "optimizer": float(model_states["optimizer"]),
            "comm_buffers": float(comm_buffer_bytes)}
    moment_a = {**base, "grads": grads if grads_at_activation_peak else 0.0,
                "activations": activation_bytes * in_flight_microbatches,
                "temporaries": gathered + recompute_bytes + output_bytes}
    moment_b = {**base, "grads": grads + unsharded_grad, "activations": late_activation_bytes,
                "temporaries": gathered + recompute_bytes}
    breakdown = max(moment_a, moment_b, key=lambda m: sum(m.values()))
    breakdown = {k: breakdown[k] for k in ("params", "grads", "optimizer", "activations",
                                           "temporaries", "comm_buffers")}
    breakdown["peak"] = sum(breakdown.values())
    return breakdown


# [Note: loss working set]
# Without a `loss` output the runtime computes the token cross-entropy itself
# (runtime/step_inputs.py token_loss: F.cross_entropy over logits.float()). Its forward saves
# the log-probabilities, fp32, one per logit (log_softmax saves its output, nll_loss reads it);
# its backward holds them, the gradient of the log-probabilities (nll_loss_backward, fp32) and
# the logits' gradient (_log_softmax_backward_data, fp32) at once: 3 x 4 B per logit, measured
# on gloo ranks with torch's memory tracker (bench/runtime_memory.py), on top of the layers'
# activations at moment A of [Note: peak moments]. A 16-bit logits' gradient is cast down after
# the log-probabilities are freed, so it adds nothing to that moment. The logits themselves are
# not held then without pipelining (the runtime drops its reference before the backward, as
# torchtitan does); a pipeline's last stage keeps them in its output cache until the
# microbatch's backward (solver/search.py `output_bytes`).
#
# With tp > 1 and no pipelining, logits whose placement splits the vocabulary (Shard of their
# last dim) go to the vocab-parallel cross-entropy instead (passes/kernels.py
# keep_logits_sharded, kernels/cross_entropy.py; Shoeybi et al. 2019, sec. 3), which holds
# only this tp rank's shard, V / tp of each row (`vocab_parallel_loss_bytes`): it saves the
# local logits (their dtype, w bytes) and per-row statistics; its backward computes the
# gradient of the shard. The Triton kernel (devices that fuse, `DeviceSpec.fuses_pointwise`)
# writes it at once, w bytes per logit: 2 w per local logit. The torch reference (CPU,
# cross_entropy_grad_reference) holds with the saved logits an fp32 copy of 16-bit ones, three
# fp32 temporaries of the softmax and its gradient at once and the bool mask of the target
# column: w + (4 if w != 4) + 13 bytes per local logit -- measured with LiveTensorBytes on
# (4096, 16384) logits through the head's matmul and back (2026-12-05): 4.25 x the logits'
# bytes in fp32 (17 B per logit), 9.5 x in bf16 (19 B); the plain loss measured 3.0 x and 6.0 x
# there (12 B per logit, as above). The planner
# prices this per candidate of the logits' producer (Costs.loss_rows), so that a placement
# that splits the vocabulary is credited with the smaller loss.

LOSS_WORKING_LOGIT_COPIES = 3  # log-probabilities, their gradient, the logits' gradient (fp32)


def loss_working_bytes(logits_bytes: float, dtype_bytes: float) -> float:
    """Bytes the runtime's token cross-entropy holds at its backward ([Note: loss working
    set]), for logits of `logits_bytes` at `dtype_bytes` bytes per element (one microbatch).
    Raises ValueError for a negative size or a dtype width <= 0."""
    if logits_bytes < 0 or dtype_bytes <= 0:
        raise ValueError(f"loss_working_bytes: logits_bytes={logits_bytes} must be >= 0 and "
                         f"dtype_bytes={dtype_bytes} > 0")
    return LOSS_WORKING_LOGIT_COPIES * 4.0 * logits_bytes / dtype_bytes


def vocab_parallel_loss_bytes(local_logits_bytes: float, dtype_bytes: float,
                              fused: bool) -> float:
    """Bytes the vocab-parallel cross-entropy holds at its backward ([Note: loss working
    set]), for a tp rank's shard of the logits of `local_logits_bytes` at `dtype_bytes` bytes
    per element (one microbatch): 2 w per logit with the fused kernel (`fused`), else
    w + (4 if w != 4) + 13 (the torch reference, measured). Raises ValueError as loss_working_bytes."""
    if local_logits_bytes < 0 or dtype_bytes <= 0:
        raise ValueError(f"vocab_parallel_loss_bytes: local_logits_bytes={local_logits_bytes} "
                         f"must be >= 0 and dtype_bytes={dtype_bytes} > 0")
    per_logit = 2.0 * dtype_bytes if fused else (
        dtype_bytes + (4.0 if dtype_bytes != 4 else 0.0) + 13.0)
    return per_logit * local_logits_bytes / dtype_bytes
