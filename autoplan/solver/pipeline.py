"""Analytic step time and memory of one configuration, given a solved placement.

[Note: step time] For pp ranks, v model chunks per rank (interleaved 1F1B), m microbatches:

    t_stage  = max over pp ranks r of (compute_r + tp_comm_r + p2p_r)   one microbatch, fwd+bwd
    bubble   = (pp - 1) / v * t_stage          (Narayanan et al. SC'21: bubble fraction
                                                (p-1)/m for GPipe and 1F1B, (p-1)/(v m)
                                                interleaved; FORMULAS.md "FLOPs and pipeline")
    dp_sync  = ZeRO 0: all_reduce(G); ZeRO 1/2: reduce_scatter(G) + all_gather(W);
               ZeRO 3: m * (reduce_scatter(G) + 2 all_gather(W))  (parameters gathered for
               the forward and again for the backward of every microbatch: 1.5x the traffic of
               ZeRO 0-2 per step without accumulation; ZeRO section 7, FORMULAS.md)
               over the dp group (stride tp), G / W = the rank's gradient / parameter bytes
    step     = m * t_stage + bubble + (1 - DP_SYNC_OVERLAP) * dp_sync

p2p_r = 2 v p2p_time_s(boundary bytes) per microbatch on a pipeline rank (the activation forward
and its gradient backward, v times with interleaving) when pp > 1.

[Note: memory per rank] Rank r holds the layers of its stages; the first rank also what comes
before the blocks, the last rank what comes after. Its peak is
cost_model.memory.peak_memory_bytes with model_state_bytes of its parameter elements (after
tp), its activations per microbatch times pipeline_in_flight_microbatches(schedule, pp, m, r, v),
ZeRO-3 gathered layers (1 + ZERO3_PREFETCH_LAYERS) and the ZeRO-2/3 unsharded layer gradient,
and the logits (graph output, replicated) on the last rank. The same quantities, linear in the
placements, are the ILP's memory constraints (`rank_memories`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autoplan.cost_model.comm import collective_time_s, p2p_time_s
from autoplan.cost_model.memory import (
    STATE_BYTES_PER_PARAM, model_state_bytes, peak_memory_bytes, pipeline_in_flight_microbatches,
)
from autoplan.plan import Stage
from autoplan.solver.ilp import RankMemory, Solution
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology

__all__ = ["DP_SYNC_OVERLAP", "ZERO3_PREFETCH_LAYERS", "Config", "Assessment", "stages_of",
           "assess", "rank_memories"]

DP_SYNC_OVERLAP = 0.5
"""Fraction of the data-parallel gradient sync (and ZeRO-3 parameter gathers) hidden behind
backward compute. Assumption, not fitted: bucketed all-reduce starts while the backward of the
later layers still runs (PyTorch DDP, Li et al. VLDB 2020, section 3.2.3; FSDP prefetching), and
roughly half of it overlaps for typical bucket sizes. `autoplan calibrate` does not fit it yet."""

ZERO3_PREFETCH_LAYERS = 1
"""Layers FSDP gathers ahead under ZeRO-3 (torch FSDP2 default forward prefetch of one)."""


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

    def __str__(self) -> str:
        v = f" v{self.num_virtual_stages}" if self.num_virtual_stages > 1 else ""
        return (f"pp{self.pp} x dp{self.dp} x tp{self.tp}, ZeRO-{self.zero_stage}, "
                f"{self.num_microbatches} microbatches of {self.microbatch_size}, "
                f"{self.schedule}{v}")


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


def _rank_layers(cfg: Config, total_layers: int) -> list[int]:
    stages = stages_of(total_layers, cfg.pp * cfg.num_virtual_stages)
    per_rank = [0] * cfg.pp
    for st in stages:
        per_rank[st.index % cfg.pp] += st.num_layers
    return per_rank


def _share(part: str, r: int, cfg: Config, layers: list[int], total_layers: int) -> float:
    """Fraction of a part's (weighted total) quantity that rank r holds."""
    if part == "layer":
        return layers[r] / total_layers if total_layers else 0.0
    if part == "pre":
        return 1.0 if r == 0 else 0.0
    return 1.0 if r == cfg.pp - 1 else 0.0


def _state_bytes_per_elem(cfg: Config, spec: TrainingSpec) -> float:
    return sum(model_state_bytes(1.0, cfg.zero_stage, cfg.dp, mixed_precision=spec.mixed_precision,
                                 optimizer=spec.optimizer).values())


def _layer_param_bytes(sol: Solution, total_layers: int, spec: TrainingSpec) -> float:
    if total_layers:
        return sol.param_elems.get("layer", 0.0) / total_layers * spec.dtype_bytes
    return sum(sol.param_elems.values()) * spec.dtype_bytes


def _transient_factor(cfg: Config) -> float:
    gathered = 1 + ZERO3_PREFETCH_LAYERS if cfg.zero_stage == 3 and cfg.dp > 1 else 0
    return gathered + (1 if cfg.zero_stage >= 2 and cfg.dp > 1 else 0)


def rank_memories(cfg: Config, spec: TrainingSpec, total_layers: int,
                  output_bytes: float) -> list[RankMemory]:
    """[Note: memory per rank] as linear forms for the ILP, one per pipeline rank."""
    layers = _rank_layers(cfg, total_layers)
    state = _state_bytes_per_elem(cfg, spec)
    transient = _transient_factor(cfg) * spec.dtype_bytes
    out = []
    for r in range(cfg.pp):
        in_flight = pipeline_in_flight_microbatches(cfg.schedule, cfg.pp, cfg.num_microbatches,
                                                    r, cfg.num_virtual_stages)
        pcoef, acoef = {}, {}
        for part in ("pre", "layer", "post"):
            share = _share(part, r, cfg, layers, total_layers)
            pcoef[part] = state * share
            acoef[part] = in_flight * share
        if total_layers:
            pcoef["layer"] += transient / total_layers
        else:
            pcoef = {k: v + transient for k, v in pcoef.items()}
        out.append(RankMemory(pcoef, acoef, output_bytes if r == cfg.pp - 1 else 0.0))
    return out


def assess(cfg: Config, sol: Solution, spec: TrainingSpec, topology: Topology, *,
           total_layers: int, output_bytes: float, boundary_bytes: float) -> Assessment:
    """[Note: step time] and [Note: memory per rank] of `cfg` with placement `sol`.

    Raises ValueError (from the cost model) when a mesh group straddles nodes unevenly.
    """
    layers = _rank_layers(cfg, total_layers)
    v = cfg.num_virtual_stages
    p2p = 0.0
    if cfg.pp > 1:
        crosses = cfg.tp * cfg.dp >= topology.devices_per_node
        p2p = 2 * v * p2p_time_s(boundary_bytes, topology, crosses_nodes=crosses)
    per_rank = []
    for r in range(cfg.pp):
        comp = sum(sol.compute_s.get(p, 0.0) * _share(p, r, cfg, layers, total_layers)
                   for p in ("pre", "layer", "post"))
        comm = sum(sol.comm_s.get(p, 0.0) * _share(p, r, cfg, layers, total_layers)
                   for p in ("pre", "layer", "post"))
        per_rank.append((comp + comm + p2p, comp, comm + p2p))
    t_stage, comp, comm = max(per_rank)
    memories = [_rank_peak(cfg, sol, spec, r, layers, total_layers, output_bytes)
                for r in range(cfg.pp)]
    worst = max(range(cfg.pp), key=lambda r: memories[r]["peak"])
    elems = max(sum(sol.param_elems.get(p, 0.0) * _share(p, r, cfg, layers, total_layers)
                    for p in ("pre", "layer", "post")) for r in range(cfg.pp))
    dp_sync = _dp_sync_s(cfg, spec, topology, elems)
    m = cfg.num_microbatches
    bubble = (cfg.pp - 1) / v * t_stage
    exposed = (1 - DP_SYNC_OVERLAP) * dp_sync
    breakdown = {k: val for k, val in memories[worst].items() if k != "peak"}
    peak = memories[worst]["peak"]
    return Assessment(cfg, m * t_stage + bubble + exposed, m * comp, m * comm + exposed, bubble,
                      dp_sync, peak, breakdown,
                      peak <= spec.max_memory_fraction * topology.device.mem_bytes, sol)


def _rank_peak(cfg, sol, spec, r, layers, total_layers, output_bytes) -> dict[str, float]:
    share = {p: _share(p, r, cfg, layers, total_layers) for p in ("pre", "layer", "post")}
    elems = sum(sol.param_elems.get(p, 0.0) * s for p, s in share.items())
    acts = sum(sol.act_bytes.get(p, 0.0) * s for p, s in share.items())
    states = model_state_bytes(elems, cfg.zero_stage, cfg.dp,
                               mixed_precision=spec.mixed_precision, optimizer=spec.optimizer)
    in_flight = pipeline_in_flight_microbatches(cfg.schedule, cfg.pp, cfg.num_microbatches, r,
                                                cfg.num_virtual_stages)
    return peak_memory_bytes(
        model_states=states, activation_bytes=acts, in_flight_microbatches=in_flight,
        zero_stage=cfg.zero_stage, dp=cfg.dp,
        layer_param_bytes=_layer_param_bytes(sol, total_layers, spec),
        output_bytes=output_bytes if r == cfg.pp - 1 else 0.0,
        prefetch_layers=ZERO3_PREFETCH_LAYERS)


def _dp_sync_s(cfg: Config, spec: TrainingSpec, topology: Topology, elems: float) -> float:
    if cfg.dp == 1:
        return 0.0
    _p, grad_b, _o = STATE_BYTES_PER_PARAM[(spec.mixed_precision, spec.optimizer)]
    grads, weights = elems * grad_b, elems * spec.dtype_bytes
    t = lambda kind, n: collective_time_s(kind, n, cfg.dp, topology, stride=cfg.tp)  # noqa: E731
    if cfg.zero_stage == 0:
        return t("all_reduce", grads)
    if cfg.zero_stage in (1, 2):
        return t("reduce_scatter", grads) + t("all_gather", weights)
    return cfg.num_microbatches * (t("reduce_scatter", grads) + 2 * t("all_gather", weights))
