"""Memory per rank: model states by ZeRO stage, activations by checkpointing policy and pipeline
schedule, and the peak they compose to.

Sources: ZeRO (Rajbhandari et al. 2020, section 5, Table 1) for model states; Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models", Table 2) for activations;
Narayanan et al. SC'21 and Megatron-LM's interleaved schedule for microbatches in flight. The
same formulas, symbolically, are in `autoplan.cost_model.symbolic` (tests check they agree).
Activations derived from a captured graph: see [Note: saved tensors] below.
"""

from __future__ import annotations

import functools

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.fx

from autoplan.cost_model.compute import DTYPE_BYTES, matmul_dims
from autoplan.graph import NodeInfo
from autoplan.op_classes import ATTENTION_OPS, MATMUL_OPS, NO_GRAD_OPS, VIEW_OPS, op_name

__all__ = [
    "STATE_BYTES_PER_PARAM", "FSDP2_MIXED_STATE_BYTES", "model_state_bytes", "activation_bytes_per_layer_closed_form",
    "activation_bytes_from_graph", "saved_tensors", "node_producers", "SavedTensor",
    "pipeline_in_flight_microbatches", "peak_memory_bytes", "RECOMPUTE_POLICIES", "PARAM_PREFIX",
    "core_attention_regions",
    "loss_working_bytes", "vocab_parallel_loss_bytes", "attention_dropout_scores",
    "grad_carriers",
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
def pipeline_in_flight_microbatches(schedule: str, pp: int, num_microbatches: int,
                                    stage: int = 0, num_virtual_stages: int = 1) -> float:
    """Microbatches whose activations a pipeline rank holds at its peak, in units of one
    microbatch through all of the rank's layers.

    - "gpipe": all m forwards run before any backward: m.
    - "1f1b": rank r runs pp - r warm-up forwards before its first backward: min(m, pp - r)
      (Narayanan et al. SC'21, section 2.2.1).
    - "interleaved-1f1b" with v = num_virtual_stages chunks of 1/v of the rank's layers:
      Megatron-LM's warm-up of 2 (pp - r - 1) + (v - 1) pp chunk-forwards, plus the one in
      steady state, capped at m v: min(2 (pp - r - 1) + (v - 1) pp + 1, m v) / v. For r = 0
      this is pp (1 + (pp - 1) / (pp v)), Korthikanti et al. 2022's factor (section 4,
      pipeline parallelism).
      With v = 1 it is 1f1b.

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
        in_flight = min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) / v
    else:
        raise ValueError(
            f"unknown schedule {schedule!r}; known: ['gpipe', '1f1b', 'interleaved-1f1b']")
    if v > 1 and schedule != "interleaved-1f1b":
        raise ValueError(f"num_virtual_stages={v} needs schedule 'interleaved-1f1b', "
                         f"got {schedule!r}")
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


# --- activations from the captured graph --------------------------------------------------------
# [Note: saved tensors]
# The activation memory of a layer is what autograd keeps from its forward for its backward. We
# derive it per op class from the ops' own backward formulas (torch/csrc/autograd/derivatives.yaml
# says what each op saves):
# | op class                                   | saves (global shapes)                          |
# |--------------------------------------------|------------------------------------------------|
# | linear, mm, addmm                          | the activation operand (m x k); the weight is a |
# |                                            | parameter, not an activation                   |
# | bmm, matmul, baddbmm                       | both operands (unless one is a parameter)      |
# | layer_norm / rms_norm                      | input + per-row fp32 statistics (2 or 1 x 4 B) |
# | gelu, silu, pow, log, erf, var, ...        | input                                          |
# | softmax, log_softmax, relu, tanh, sigmoid, | output                                         |
# | exp, rsqrt, sqrt                           |                                                |
# | dropout, native_dropout                    | a 1-byte mask per element (training, p > 0)    |
# | masked_fill, where                         | the boolean mask/condition: in - out bytes     |
# | mul, div of two activations                | both operands (each for the other's gradient)  |
# | fused attention (sdpa, flash, efficient)   | q, k, v, output, fp32 log-sum-exp per row      |
# |   with dropout (dropout_p > 0)             | and a 1-byte keep mask per score (the runtime's|
# |                                            | keyed attention dropout, passes/rng.py)        |
# | embedding                                  | int64 indices                                  |
# | cross_entropy_loss                         | log-probabilities (in_bytes)                   |
# | views, add/sub, casts, clone, cat, sum,    | nothing                                        |
# | mean, cumsum, comparisons, creation ops    |                                                |
# | index, index_select, gather                | their integer indices: negligible, not counted |
# | an op whose first output is not floating   | nothing: autograd does not record it           |
# | any other op                               | all its inputs (conservative; kind "unknown")  |
# Floating tensors are counted at `dtype_bytes` when given (a graph captured in fp32 that trains
# in bf16), else at the op's output dtype; masks are 1 byte, statistics 4, indices 8.
# A tensor saved by two ops is counted once when `producers` (from `node_producers`) says where
# each argument comes from; without it each consumer's copy counts (an over-estimate when, e.g.,
# separate q/k/v projections read the same normed input).
# Only what a gradient needs: autograd records an op only when an input requires a gradient,
# and keeps an operand only for a gradient that needs it (derivatives.yaml's saved inputs are
# those of the formulas it evaluates, per `needs_input_grad`). With `grads` (`grad_carriers`:
# what descends from a trainable parameter; buffers, frozen parameters and graph inputs do not)
# an op none of whose inputs requires one saves nothing (the rotary tables computed from
# `inv_freq`); a matmul keeps a only when b requires a gradient and b only when a does (the
# input of a frozen weight's linear is not kept for it); mul keeps each operand for the
# other's gradient (q * cos keeps cos, not q; a frozen norm weight's product keeps nothing),
# div its divisor always and its dividend for the divisor's. Each operand is then its
# producer's value, so the input a norm's pow and its mul both keep counts once. Measured
# (LoRA r=16 on a 0.48B Llama at tp4, bench/finetune_memory.py, the dry run's activations at
# the end of the forward): 161.5 MB; priced 230.1 MB before this rule.
# Selective recompute (Korthikanti et al. 2022, "selective activation recomputation") drops the
# attention scores: the saved tensors of the ops between a score matmul (a batched matmul whose
# contraction dim is smaller than both output dims, q @ k^T) and the next matmul (scores @ v),
# plus that matmul's scores operand -- the 5as^2b term. Full recompute keeps only the layer input.
# `activation_bytes_from_graph(policy="selective")` is this published variant (the formula
# checks against Table 2). What autoplan plans and runs as "selective" is op-level: see
# [Note: selective saved set] in autoplan/op_classes.py.

PARAM_PREFIX = "param:"
"""`node_producers` marks an argument that is a parameter/buffer (or a view of one) so."""

_NO_SAVE = frozenset({
    "add", "sub", "rsub", "neg", "clone", "contiguous", "copy", "copy_", "_to_copy", "to",
    "type_as", "cat", "stack", "sum", "mean", "tril", "triu", "repeat", "roll", "flip",
    "constant_pad_nd", "pad", "nll_loss", "nll_loss_forward", "nll_loss2d_forward", "cumsum",
    "diff", "index", "index_select", "gather",
})
_NORMS = {"layer_norm": 2, "native_layer_norm": 2, "rms_norm": 1, "_fused_rms_norm": 1,
          "group_norm": 0, "native_group_norm": 0, "batch_norm": 0, "native_batch_norm": 0}
_SAVES_INPUT = frozenset({
    "gelu", "silu", "mish", "elu", "log", "pow", "erf", "sin", "cos", "hardswish", "softplus",
    "leaky_relu", "var", "std", "var_mean", "abs",
})
_SAVES_OUTPUT = frozenset({
    "softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax", "relu", "tanh",
    "sigmoid", "exp", "rsqrt", "sqrt", "reciprocal",
})
_DROPOUT = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout"})
_BATCHED = frozenset({"bmm", "matmul", "baddbmm"})
_FLOATING = frozenset({"float64", "float32", "bfloat16", "float16", "float8_e4m3fn",
                       "float8_e5m2"})


@dataclass(frozen=True)
class SavedTensor:
    """One tensor that autograd keeps from the forward for the backward.

    Attributes:
        owner: node whose output it is (its shard factor applies); the consumer itself when
            the producer is unknown.
        slot: which tensor of the owner: "out", "mask", "stats", or "arg<i>" (producer unknown).
        consumer: the node whose backward needs it.
        nbytes: bytes at global (unsharded) shapes.
        kind: the rule that counted it ([Note: saved tensors]).
        attention_scores: True for the tensors selective recompute drops.
    """

    owner: str
    slot: str
    consumer: str
    nbytes: float
    kind: str
    attention_scores: bool = False


def node_producers(
        graph: torch.fx.Graph | torch.fx.GraphModule) -> dict[str, tuple[str | None, ...]]:
    """Where each positional argument of each call_function node comes from: the argument
    node's name for an activation, PARAM_PREFIX + FQN for a parameter/buffer (a get_attr node,
    possibly behind view ops such as t/permute/alias), None for a non-tensor argument."""
    graph = graph.graph if isinstance(graph, torch.fx.GraphModule) else graph
    result = {}
    for node in graph.nodes:
        if node.op == "call_function":
            result[node.name] = tuple(_producer(a) for a in node.args)
    return result


def _producer(arg) -> str | None:
    if not isinstance(arg, torch.fx.Node):
        return None
    root = arg
    while (root.op == "call_function" and root.args and isinstance(root.args[0], torch.fx.Node)
           and root.target is not operator.getitem and op_name(str(root.target)) in VIEW_OPS):
        root = root.args[0]
    return PARAM_PREFIX + str(root.target) if root.op == "get_attr" else arg.name


def grad_carriers(graph: torch.fx.Graph | torch.fx.GraphModule, params) -> frozenset[str]:
    """The values that require a gradient in a training step ([Note: saved tensors], "only
    what a gradient needs"): PARAM_PREFIX + FQN of every trainable parameter (each alias of
    a tied one), and the name of every call_function node with an input among them.
    Buffers, frozen parameters, graph inputs and constants require none.

    Args:
        graph: the captured graph; params: `CapturedGraph.params` (FQN -> ParamInfo).
    """
    graph = graph.graph if isinstance(graph, torch.fx.GraphModule) else graph
    trainable = {name for p in params.values() if p.trainable and not p.is_buffer
                 for name in (p.fqn, *p.aliases)}
    out = {PARAM_PREFIX + name for name in trainable}
    carrying: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr" and node.target in trainable:
            carrying.add(node)
        elif node.op == "call_function" and any(a in carrying for a in node.all_input_nodes):
            carrying.add(node)
            out.add(node.name)
    return frozenset(out)


class _Rules:
    """Saved tensors of one node ([Note: saved tensors]); `items` collects them."""

    def __init__(self, node: NodeInfo, producers: Sequence[str | None] | None,
                 dtype_bytes: int | None, grads: frozenset[str] | None = None,
                 value_numel: Mapping[str, int] | None = None):
        self.node, self.producers, self.items = node, producers, []
        out_width = DTYPE_BYTES.get(node.dtypes[0], 4) if node.dtypes else 4
        self.width = dtype_bytes or out_width
        self.scale = self.width / out_width
        self.numel0 = math.prod(node.shapes[0]) if node.shapes else 0
        # [Note: saved tensors], "only what a gradient needs": None without producers
        self.grads = grads if producers is not None else None
        self.value_numel = value_numel or {}

    def carries(self, i: int) -> bool:
        """Whether argument i requires a gradient (`grad_carriers`; True when unknown)."""
        if self.grads is None:
            return True
        p = self.producers
        return i < len(p) and p[i] is not None and p[i] in self.grads

    def arg_bytes(self, i: int) -> float:
        """Bytes of argument i at the activation width: its producer's first output, or
        the op's output size where the producer is not known."""
        numel = self.value_numel.get(self.producers[i]) if self.producers is not None and \
            i < len(self.producers) else None
        return (self.numel0 if numel is None else numel) * self.width

    def is_param(self, i: int) -> bool:
        p = self.producers
        return p is not None and (i >= len(p) or p[i] is None or p[i].startswith(PARAM_PREFIX))

    def known_activation(self, i: int) -> bool:
        return self.producers is not None and not self.is_param(i)

    def arg(self, i: int, nbytes: float, kind: str) -> None:
        if self.producers is not None:
            if self.is_param(i):
                return
            self.items.append((self.producers[i], "out", nbytes, kind))
        else:
            self.items.append((self.node.name, f"arg{i}", nbytes, kind))

    def own(self, slot: str, nbytes: float, kind: str) -> None:
        self.items.append((self.node.name, slot, nbytes, kind))

    def rows(self) -> int:
        shape = self.node.shapes[0] if self.node.shapes else ()
        return self.numel0 // shape[-1] if shape and shape[-1] else 0

    def apply(self) -> None:
        name, node, w = op_name(self.node.target), self.node, self.width
        floating = not node.dtypes or node.dtypes[0] in _FLOATING
        if name in VIEW_OPS or name in NO_GRAD_OPS or name in _NO_SAVE or not floating:
            return
        if self.grads is not None and node.name not in self.grads:
            return  # nothing upstream requires a gradient: autograd records no backward
        if name in MATMUL_OPS and name != "convolution":
            self.matmul(name)
        elif name in ATTENTION_OPS:
            self.own("out", node.in_bytes * self.scale + self.numel0 * w + self.rows() * 4,
                     "attention_qkv_out")
        elif name in _NORMS:
            self.arg(0, self.numel0 * w, "norm_input")
            if _NORMS[name]:
                self.own("stats", _NORMS[name] * self.rows() * 4, "norm_stats")
        elif name in _SAVES_INPUT:
            self.arg(0, self.numel0 * w, "activation_input")
        elif name in _SAVES_OUTPUT:
            self.own("out", self.numel0 * w, "softmax_output" if "softmax" in name
                     else "activation_output")
        elif name in _DROPOUT:
            self.own("mask", self.numel0, "dropout_mask")
        elif name in ("masked_fill", "where"):
            self.arg(1 if name == "masked_fill" else 0,
                     max(0, node.in_bytes - node.out_bytes), "mask")
        elif name in ("mul", "div"):
            self.product()
        elif name == "embedding":
            self.arg(1, self.rows() * 8, "indices")
        elif name in ("cross_entropy_loss", "cross_entropy"):
            self.own("log_probs", node.in_bytes * self.scale, "log_probs")
        else:
            self.own("inputs", node.in_bytes * self.scale, "unknown")

    def matmul(self, name: str) -> None:
        batch, m, n, k = matmul_dims(self.node)
        first = {"addmm": 1, "baddbmm": 1}.get(name, 0)
        # a's gradient needs b and b's needs a: each is kept when the other requires one
        if self.carries(first + 1):
            self.arg(first, batch * m * k * self.width, "matmul_operand")
        # The second operand of linear/mm/addmm is a weight unless producers say otherwise.
        if (name in _BATCHED or (name != "linear" and self.known_activation(first + 1))) \
                and self.carries(first):
            self.arg(first + 1, batch * k * n * self.width, "matmul_operand")

    def product(self) -> None:
        if self.producers is None:
            if self.node.in_bytes > self.node.out_bytes:
                self.own("operands", self.node.in_bytes * self.scale, "product_operands")
            return
        acts = [i for i in (0, 1) if self.known_activation(i)]
        if len(acts) == 2 and self.grads is None:
            self.own("operands", self.node.in_bytes * self.scale, "product_operands")
        elif len(acts) == 2:
            # mul: a's gradient needs b, b's needs a; div (a / b): a's needs b, b's both
            div = op_name(self.node.target) == "div"
            for i in (0, 1):
                if self.carries(1 - i) or (div and i == 1 and self.carries(0)):
                    self.arg(i, self.arg_bytes(i), "product_operands")
        elif len(acts) == 1 and self.producers[1 - acts[0]] is not None:
            if self.carries(1 - acts[0]):  # other: a parameter, kept for its gradient
                self.arg(acts[0], self.numel0 * self.width, "product_operands")


def _is_score_matmul(node: NodeInfo, producers: Sequence[str | None] | None) -> bool:
    if op_name(node.target) not in _BATCHED:
        return False
    if producers is not None and any(p is None or p.startswith(PARAM_PREFIX)
                                     for p in producers[:2]):
        return False
    _, m, n, k = matmul_dims(node)
    return k < m and k < n


def core_attention_regions(graph) -> list[tuple[str, ...]]:
    """The attention cores of the blocks of `graph` (a CapturedGraph): per score matmul of a
    block, the node names of its core, in graph order ([Note: core attention]).

    A core starts at a score matmul (a batched matmul of two activations whose contraction dim
    is smaller than both output dims: q @ k^T) and holds every block op its value reaches
    through the other ops (scale, mask, softmax, dropout, casts, views) up to and including the
    matmuls that consume it (scores @ v). Fused attention (sdpa, flash) has no score matmul and
    no core. The names are the captured graph's, which the rewritten per-rank graphs keep."""
    fx_nodes = {n.name: n for n in graph.gm.graph.nodes}
    producers = node_producers(graph.gm)
    regions = []
    for names in graph.layer_nodes.values():
        block = set(names)
        for name in names:
            info = graph.nodes.get(name)
            if info is None or not _is_score_matmul(info, producers.get(name)):
                continue
            region, todo = {name}, [name]
            while todo:
                for user in fx_nodes[todo.pop()].users:
                    if user.name in block and user.name not in region:
                        region.add(user.name)
                        if op_name(str(user.target)) not in MATMUL_OPS:
                            todo.append(user.name)
            regions.append(tuple(n for n in names if n in region))
    return regions


def attention_dropout_scores(gm: torch.fx.GraphModule | torch.fx.Graph) -> dict[str, float]:
    """{attention node: score elements, B x H x T x S} of the graph's attention ops that drop
    probabilities (scaled_dot_product_attention with dropout_p > 0): the runtime keeps a
    1-byte mask per score for their backward ([Note: saved tensors])."""
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    out = {}
    for node in graph.nodes:
        if node.op != "call_function" or op_name(str(node.target)) not in ATTENTION_OPS:
            continue
        p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        q, k = (a.meta.get("val") if isinstance(a, torch.fx.Node) else None
                for a in node.args[:2])
        if isinstance(p, (int, float)) and p > 0 and q is not None and k is not None:
            out[node.name] = float(math.prod(q.shape[:-1]) * k.shape[-2])
    return out


def saved_tensors(nodes: Sequence[NodeInfo], *,
                  producers: Mapping[str, Sequence[str | None]] | None = None,
                  dtype_bytes: int | None = None,
                  attention_dropout: Mapping[str, float] | None = None,
                  grads: frozenset[str] | None = None,
                  value_numel: Mapping[str, int] | None = None) -> list[SavedTensor]:
    """The tensors autograd saves for the backward of `nodes` (one layer, graph order), by the
    rules of [Note: saved tensors], unsharded and not deduplicated.

    Args:
        nodes: captured ops in graph order.
        producers: `node_producers(gm)` for exact attribution (parameters excluded, a tensor
            saved by several ops counted once by `activation_bytes_from_graph`).
        dtype_bytes: width of floating activations (2 for bf16 training); default: as captured.
        attention_dropout: `attention_dropout_scores(gm)`: the attention ops that drop
            probabilities, whose 1-byte masks count as attention scores (selective
            recomputation drops them).
        grads: `grad_carriers(gm, params)`: with `producers`, only what a gradient needs is
            saved ([Note: saved tensors]); None: every value requires one.
        value_numel: node name -> elements of its first output (global), for the operands
            of a product saved one by one; default: the product's output size.

    Raises ValueError for a matmul without FLOPs (see compute.matmul_dims).
    """
    result: list[SavedTensor] = []
    in_scores = False
    dropping = attention_dropout or {}
    for node in nodes:
        node_prod = None if producers is None else producers.get(node.name, ())
        rules = _Rules(node, node_prod, dtype_bytes, grads, value_numel)
        rules.apply()
        if node.name in dropping:
            result.append(SavedTensor(node.name, "dropout_mask", node.name,
                                      dropping[node.name], "attention_dropout_mask", True))
        is_matmul = op_name(node.target) in MATMUL_OPS
        starts = is_matmul and _is_score_matmul(node, node_prod)
        for index, (owner, slot, nbytes, kind) in enumerate(rules.items):
            # inside the score region; the closing matmul's first operand is the scores too
            scores = in_scores and (not is_matmul or index == 0)
            result.append(SavedTensor(owner, slot, node.name, float(nbytes), kind, scores))
        if is_matmul:
            in_scores = starts
    return result


def activation_bytes_from_graph(nodes: Sequence[NodeInfo],
                                shard_factor: Mapping[str, float] | None = None, *,
                                policy: str = "none", dtype_bytes: int | None = None,
                                producers: Mapping[str, Sequence[str | None]] | None = None,
                                layer_input_bytes: float | None = None,
                                grads: frozenset[str] | None = None,
                                value_numel: Mapping[str, int] | None = None) -> float:
    """Bytes one rank keeps from the forward of `nodes` (one layer, one microbatch at the
    captured shapes) for the backward ([Note: saved tensors]).

    Args:
        nodes: the layer's captured ops in graph order.
        shard_factor: node name -> how many ways that node's output is split on this rank (tensor
            or sequence parallelism); a saved tensor is divided by its owner's factor, and nodes
            not listed are unsharded.
        policy: "none"; "selective" (drops the attention scores, the 5as^2b term of Korthikanti
            et al. Table 2); "full" (keeps only the layer input).
        dtype_bytes: width of floating activations; default: as captured.
        producers: `node_producers(gm)`; see `saved_tensors`.
        layer_input_bytes: global bytes of the layer input for "full"; default: the first
            node's first output (a pre-norm layer starts with a shape-preserving norm), at the
            activation width, divided by that node's shard factor.
        grads, value_numel: see `saved_tensors` (what requires a gradient).

    Raises ValueError for an unknown policy, an empty layer, or a shard factor < 1.
    """
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"policy {policy!r} not in {list(RECOMPUTE_POLICIES)}")
    if not nodes:
        raise ValueError("activation_bytes_from_graph: no nodes")
    factors = dict(shard_factor or {})
    bad = {k: v for k, v in factors.items() if not v >= 1}
    if bad:
        raise ValueError(f"shard factors must be >= 1: {bad}")
    if policy == "full":
        first = nodes[0]
        if layer_input_bytes is None:
            rules = _Rules(first, None, dtype_bytes)
            layer_input_bytes = rules.numel0 * rules.width
        return layer_input_bytes / factors.get(first.name, 1.0)
    seen: dict[tuple[str, str], float] = {}
    for item in saved_tensors(nodes, producers=producers, dtype_bytes=dtype_bytes,
                              grads=grads, value_numel=value_numel):
        if policy == "selective" and item.attention_scores:
            continue
        seen[(item.owner, item.slot)] = item.nbytes / factors.get(item.owner, 1.0)
    return sum(seen.values())
