"""The data-parallel terms of the step ([Note: step time] in cost_model/step_time.py): the dp
group's collectives per step (`dp_sync_s`), the local passes of the runtime around them
(`dp_local_s`), and the counts they are issued in (FSDP2 units, gradient reductions, parameter
gathers), as autoplan/runtime/engine.py issues them.
"""

from __future__ import annotations

from autoplan.cost_model.comm import collective_time_s
from autoplan.cost_model.config import Config
from autoplan.cost_model.memory import STATE_BYTES_PER_PARAM, model_state_bytes
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology

__all__ = ["dp_sync_s", "dp_local_s", "num_dp_units", "num_dp_gathers", "num_dp_reductions"]


def _grad_weight_bytes(spec: TrainingSpec, elems: float,
                       frozen: float = 0.0) -> tuple[float, float]:
    """(gradient bytes, compute-precision weight bytes) of `elems` parameters, `frozen` of
    them without a gradient."""
    _p, grad_b, _o = STATE_BYTES_PER_PARAM[(spec.mixed_precision, spec.optimizer)]
    return (elems - frozen) * grad_b, elems * spec.dtype_bytes


def num_dp_reductions(cfg: Config) -> int:
    """Gradient reductions per step ([Note: step time], dp_sync): one, except for ZeRO 2/3
    accumulating microbatches without pipelining, which reduce-scatter every microbatch."""
    return cfg.num_microbatches if cfg.pp == 1 and cfg.zero_stage >= 2 else 1


def dp_local_s(cfg: Config, spec: TrainingSpec, topology: Topology, elems: float,
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
    passes = num_dp_reductions(cfg) * 3 * 2 * grads
    if cfg.zero_stage == 1:
        stepped = (elems - frozen) * _master_bytes(spec)
        passes += 2 * stepped / cfg.dp_shard + 2 * stepped
    passes += num_dp_gathers(cfg) * (2 * weights / cfg.dp_shard + 2 * weights)
    return passes / device.mem_bw_bytes_per_s


def _master_bytes(spec: TrainingSpec) -> float:
    """Bytes per element of a parameter as the runtime holds it: its fp32 master under mixed
    precision (FSDP2's recipe, cost_model/memory.py FSDP2_MIXED_STATE_BYTES)."""
    return model_state_bytes(1.0, 0, 1, mixed_precision=spec.mixed_precision,
                             optimizer=spec.optimizer, recipe="fsdp2")["params"]


def dp_sync_s(cfg: Config, spec: TrainingSpec, topology: Topology, elems: float,
               units: int = 1, frozen: float = 0.0, tensors: float = 1.0) -> float:
    """The dp group's collectives per step ([Note: step time], dp_sync); with context
    parallelism the group is dp x cp ranks (the dp and cp axes are adjacent, so stride tp).
    FSDP2 issues each reduction and gather once per unit (`units`, `num_dp_units`), each on that
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

    reductions = num_dp_reductions(cfg)
    if cfg.zero_stage == 0:
        return reductions * t("all_reduce", grads)
    if cfg.zero_stage == 1:
        stepped = (elems - frozen) * _master_bytes(spec)
        return reductions * t("all_reduce", grads) + t("all_gather", stepped,
                                                        max(1, round(tensors)))
    return reductions * t("reduce_scatter", grads) + num_dp_gathers(cfg) * t("all_gather", weights)


def num_dp_units(cfg: Config, layers) -> int:
    """FSDP2 units on the busiest pipeline rank (autoplan/runtime/rank_stages.py
    `apply_data_parallel`: one per block module and one per stage module for the rest): its
    blocks, plus the stage root on the first and last pipeline ranks, which hold the parameters
    outside the blocks (embeddings, final norm, head); middle ranks' roots hold none and issue
    no collective."""
    return max(1, max(n + (r == 0 or r == cfg.pp - 1) for r, n in enumerate(layers)))


def num_dp_gathers(cfg: Config) -> int:
    """FSDP2 parameter all-gathers per step ([Note: step time], dp_sync): ZeRO-2 one per
    microbatch, ZeRO-3 two (forward and backward); none below ZeRO-2."""
    return {2: 1, 3: 2}.get(cfg.zero_stage, 0) * cfg.num_microbatches
