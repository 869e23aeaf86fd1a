"""An illustration of a plan's pipeline schedule: which pp rank runs which stage's forward or
backward of which microbatch, and when.

The order of work on each rank is the schedule's (below); durations come from the plan's
predicted per-microbatch stage time, split over stages in proportion to their predicted cost.
Start times follow from the order and the dependencies (the forward of stage s needs the forward
of stage s - 1 for the same microbatch; the backward of stage s needs the backward of stage
s + 1, or the forward of the last stage). Point-to-point transfers are not drawn.

Per-rank orders (stage `s = chunk * pp + r` runs on rank r, as `Stage` says):
- "gpipe": every forward, then every backward (Huang et al. 2019).
- "1f1b": pp - r - 1 warm-up forwards, then one forward / one backward alternately, then the
  remaining backwards (Narayanan et al. SC'21, section 2.2.1; PipeDream-Flush).
- "interleaved-1f1b": Megatron-LM's order: microbatches in groups of pp, each group through
  chunk 0, 1, ..., v - 1 forward (and v - 1, ..., 0 backward); 2 (pp - r - 1) + (v - 1) pp
  warm-up forwards (Narayanan et al. SC'21, section 2.2.2; megatron/core/pipeline_parallel/
  schedules.py).
- "interleaved-zb": torch's ScheduleInterleavedZeroBubble order, each backward as its input
  gradient "I" and its weight gradient "W", half of the backward's time each
  (cost_model/schedule_time.py `torch_rank_orders`, [Note: zero-bubble time]).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cost_model.schedule_time import run_in_order, torch_rank_orders
from autoplan.options import INTERLEAVED_SCHEDULES, SCHEDULES

__all__ = ["Block", "rank_orders", "simulate", "stage_costs", "busiest_rank_s",
           "predicted_stage_s", "stage_times"]


@dataclass(frozen=True)
class Block:
    """One forward ("F"), backward ("B"), or input or weight half of a backward ("I", "W") of
    `stage` for `microbatch` on pp rank `rank`;
    `label` is PyTorch pipelining's text form (`2F0`: stage 2 forward microbatch 0)."""

    rank: int
    stage: int
    microbatch: int
    kind: str
    start_s: float
    end_s: float

    @property
    def label(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def _chunk_order(pp: int, m: int, v: int, backward: bool) -> list[tuple[int, int]]:
    """(chunk, microbatch) in Megatron's interleaved order (v = 1: microbatch order)."""
    out = []
    for g in range(0, m, pp):
        group = range(g, min(g + pp, m))
        for c in range(v):
            out += [(v - 1 - c if backward else c, i) for i in group]
    return out


def rank_orders(schedule: str, pp: int, m: int, v: int = 1) -> list[list[tuple[str, int, int]]]:
    """Per pp rank, the work in order: (kind "F" | "B" | "I" | "W", stage, microbatch).

    Raises ValueError for an unknown schedule or v > 1 without an interleaved schedule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}")
    if v > 1 and schedule not in INTERLEAVED_SCHEDULES:
        raise ValueError(f"num_virtual_stages={v} needs one of {INTERLEAVED_SCHEDULES}, got "
                         f"{schedule!r}")
    if schedule == "interleaved-zb":
        return torch_rank_orders(schedule, pp, v, m)
    fwd, bwd = _chunk_order(pp, m, v, False), _chunk_order(pp, m, v, True)
    orders = []
    for r in range(pp):
        f = [("F", c * pp + r, i) for c, i in fwd]
        b = [("B", c * pp + r, i) for c, i in bwd]
        if schedule == "gpipe":
            orders.append(f + b)
            continue
        warm = pp - r - 1 if schedule == "1f1b" or v == 1 else 2 * (pp - r - 1) + (v - 1) * pp
        warm = min(warm, len(f))
        order = f[:warm]
        for k in range(len(f) - warm):
            order += [f[warm + k], b[k]]
        orders.append(order + b[len(f) - warm:])
    return orders


def simulate(schedule: str, pp: int, m: int, v: int, fwd_s: list[float],
             bwd_s: list[float]) -> list[Block]:
    """Start and end of every block when each rank runs its `rank_orders` as soon as the
    dependencies allow (module docstring; cost_model/schedule_time.py `run_in_order`).

    Args:
        fwd_s, bwd_s: forward / backward seconds of one microbatch per stage (pp * v each).
    """
    num_stages = pp * v
    assert len(fwd_s) == len(bwd_s) == num_stages, (len(fwd_s), len(bwd_s), num_stages)

    def seconds(kind: str, s: int) -> float:
        return fwd_s[s] if kind == "F" else bwd_s[s] if kind == "B" else bwd_s[s] / 2

    return [Block(r, s, i, kind, start, end) for r, kind, s, i, start, end in run_in_order(
        rank_orders(schedule, pp, m, v), num_stages, seconds)]


def stage_costs(plan, parts=None) -> tuple[list[float], list[float]]:
    """Unscaled (forward, backward) cost of one microbatch per stage, seconds when `parts`
    (report.facts.part_costs) is given: a stage's blocks times the cost of one block, plus the
    part before the blocks on stage 0 and the part after them on the last stage. Without
    `parts`, a stage costs its number of blocks (at least 1) and backward = 2 x forward, the
    usual ratio for matmul-dominated layers. A block's backward includes what activation
    checkpointing recomputes: `parts` count it (report.facts.PartCost)."""
    last = len(plan.stages) - 1
    by_part = {p.part: p for p in parts or ()}
    fwd, bwd = [], []
    for st in plan.stages:
        block = by_part.get("block")
        if block is None:
            units = max(st.num_layers, 1)
            f, b = units / 3, 2 * units / 3
        else:
            f = st.num_layers * (block.compute_fwd_s + block.comm_fwd_s)
            b = st.num_layers * (block.compute_bwd_s + block.comm_bwd_s)
        for part, on in (("pre", st.index == 0), ("post", st.index == last)):
            if on and part in by_part:
                f += by_part[part].compute_fwd_s + by_part[part].comm_fwd_s
                b += by_part[part].compute_bwd_s + by_part[part].comm_bwd_s
        fwd.append(f)
        bwd.append(b)
    return fwd, bwd


def busiest_rank_s(plan, fwd: list[float], bwd: list[float]) -> float:
    """The largest per-microbatch time of a pp rank, summed over the stages it runs."""
    per_rank = [0.0] * plan.mesh.pp
    for st, f, b in zip(plan.stages, fwd, bwd):
        per_rank[st.index % plan.mesh.pp] += f + b
    return max(per_rank)


def predicted_stage_s(plan) -> float:
    """The plan's per-microbatch time of the busiest pp rank: `Prediction.stage_time_s`; for a
    plan written before it, bubble x v / (pp - 1) when pp > 1 ([Note: step time] in
    cost_model/step_time.py), else (compute + communication) / microbatches (which then includes the
    exposed gradient sync and the optimizer step)."""
    pred, pp = plan.prediction, plan.mesh.pp
    if pred.stage_time_s > 0:
        return pred.stage_time_s
    if pp > 1 and pred.bubble_s > 0:
        return pred.bubble_s * plan.num_virtual_stages / (pp - 1)
    return (pred.compute_s + pred.comm_s) / max(plan.num_microbatches, 1)


def stage_times(plan, parts=None) -> tuple[list[float], list[float]]:
    """(forward, backward) seconds of one microbatch per stage for `simulate`: `stage_costs`
    scaled so that the busiest pp rank takes `predicted_stage_s`."""
    fwd, bwd = stage_costs(plan, parts)
    target, busiest = predicted_stage_s(plan), busiest_rank_s(plan, fwd, bwd)
    if busiest <= 0:
        n = len(plan.stages)
        return [target / n / 3] * n, [2 * target / n / 3] * n
    k = target / busiest
    return [f * k for f in fwd], [b * k for b in bwd]
