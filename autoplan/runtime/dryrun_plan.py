"""What a plan says of one of its ranks, which the dry run holds the rank against: its mesh
coordinates (`rank_coordinates`), predicted memory (`predicted_rank_memory`) and priced bytes
per mesh axis (`priced_rank_traffic`). Re-exported by dryrun.py.
"""

from __future__ import annotations

from autoplan.graph import CapturedGraph
from autoplan.plan import Plan

__all__ = ["predicted_rank_memory", "priced_rank_traffic", "rank_coordinates"]


def predicted_rank_memory(plan: Plan, rank: int) -> dict[str, float]:
    """The plan's predicted memory of global `rank`, bytes by category and "peak": its
    pipeline rank's entry of `Prediction.memory_by_pp_rank` (every rank of a pipeline stage
    holds the same), or the most loaded rank's figures for a plan written without it."""
    by_rank = plan.prediction.memory_by_pp_rank
    if by_rank:
        return dict(by_rank[rank_coordinates(plan, rank)["pp"]])
    return {**plan.prediction.memory_breakdown, "peak": plan.prediction.memory_bytes}


def priced_rank_traffic(plan: Plan, rank: int, graph: CapturedGraph, *,
                        all_to_all: bool = False) -> dict[str, float]:
    """The plan's bytes per mesh axis for global `rank`, one step: its pipeline rank's entry
    of `Prediction.bytes_by_axis_by_pp_rank` ([Note: traffic per axis] in
    autoplan/cost_model/traffic.py), or, for a plan written without it, priced here on
    `graph` (the graph the plan names), with all-to-all where the ranks have it."""
    from autoplan.cost_model.traffic import rank_traffic

    pp = rank_coordinates(plan, rank)["pp"]
    by_rank = plan.prediction.bytes_by_axis_by_pp_rank
    if by_rank:
        return dict(by_rank[pp])
    return dict(rank_traffic(plan, graph, all_to_all=all_to_all)[pp].bytes_by_axis)


def rank_coordinates(plan: Plan, rank: int) -> dict[str, int]:
    """Mesh coordinate of global `rank` by axis name ({"pp", "dp", "cp", "tp"}), the last axis
    innermost as `init_device_mesh` lays it out. Raises ValueError for a rank outside."""
    shape, names = plan.mesh.shape, plan.mesh.axis_names
    if not 0 <= rank < plan.mesh.world_size:
        raise ValueError(f"rank {rank} is not in the plan's {plan.mesh.world_size} ranks "
                         f"({plan.mesh})")
    out, rest = {}, rank
    for name, size in zip(reversed(names), reversed(shape)):
        out[name] = rest % size
        rest //= size
    return {"pp": out["pp"], "dp": out["dp"], "cp": out.get("cp", 0), "tp": out["tp"]}
