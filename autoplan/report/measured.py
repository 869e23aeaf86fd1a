"""The facts of the report's "Dry run" section (markdown.py renders them): what dry runs of
some of the plan's ranks measured (`Plan.dry_run`, written by `autoplan dryrun -o`; [Note:
dry run] in autoplan/runtime/dryrun.py), held against the plan's prediction.

Per dry-run rank: its mesh coordinate; the step's measured peak memory, when it occurs, and
each category beside the plan's for that rank (its pipeline rank's entry of
`Prediction.memory_by_pp_rank`); collective bytes per mesh axis beside the plan's for its
pipeline rank (`Prediction.bytes_by_axis_by_pp_rank`, [Note: traffic per axis] in
autoplan/cost_model/traffic.py; `NOT_PRICED` for a plan written without them); FLOPs beside
the plan's for its pipeline rank (`Prediction.flops_by_pp_rank`).
Every error is `relative_error`: predicted / measured - 1, as the error bands count ([Note:
error bands] in autoplan/cost_model/fidelity.py). Where the peak's error is outside the plan's
memory band, the section names the category that differs most in bytes (`differs_most`);
where an axis's bytes are outside +-`TRAFFIC_BAND` (issue 26's bar), the axis that differs
most (`traffic_finding`).
"""

from __future__ import annotations

from autoplan.plan import DryRunRecord, Plan
from autoplan.report import facts as F
from autoplan.topology import Topology

__all__ = ["NOT_PRICED", "TRAFFIC_BAND", "relative_error", "axis_differs_most",
           "traffic_finding", "memory_band", "differs_most", "finding",
           "rank_rows", "axis_rows", "where_text", "intro_text"]

NOT_PRICED = ("not priced per axis: the plan was written before it recorded bytes per rank "
              "per mesh axis (Prediction.bytes_by_axis_by_pp_rank)")

TRAFFIC_BAND = 0.05
"""|priced / measured - 1| of a rank's collective bytes on each mesh axis that the dry run
holds the plan to (issue 26: "collective bytes per axis within +-5%")."""


def relative_error(predicted: float, measured: float) -> float | None:
    """predicted / measured - 1 (fractions: -0.1 is 10% under); None where nothing was
    measured (no band or bar holds then)."""
    return predicted / measured - 1 if measured else None


def memory_band(plan: Plan, topology: Topology | None) -> tuple[float, float] | None:
    """(low, high) of the plan's peak-memory error band: the one it records, else the band of
    its topology's devices ([Note: error bands]); None without either."""
    band = plan.prediction.error_bands.get("peak_memory")
    if band:
        return band["low"], band["high"]
    if topology is None:
        return None
    from autoplan.cost_model.fidelity import error_bands

    memory = error_bands(topology.device.name)[1]
    return memory.low, memory.high


def differs_most(record: DryRunRecord) -> tuple[str, int, float]:
    """(category, measured bytes, predicted bytes) of the memory category whose prediction is
    farthest from the measurement, in bytes."""
    kinds = [k for k in F.MEMORY_KINDS
             if k in record.peak_by_category or k in record.predicted_by_category]
    kind = max(kinds, key=lambda k: abs(record.predicted_by_category.get(k, 0.0)
                                        - record.peak_by_category.get(k, 0)))
    return kind, record.peak_by_category.get(kind, 0), record.predicted_by_category.get(kind, 0.0)


def _pct(error: float | None) -> str:
    return "n/a" if error is None else f"{error:+.1%}"


def finding(record: DryRunRecord, band: tuple[float, float] | None) -> str:
    """The sentence under a rank's table: the peak within the memory `band` ((low, high),
    `memory_band`), or outside it and the category that differs most (`differs_most`)."""
    error = relative_error(record.predicted_peak_bytes, record.peak_bytes)
    if band is None or error is None:
        return "No memory error band to hold the peak to."
    low, high = band
    text = f"the plan's memory band, {low * 100:+.0f}% to {high * 100:+.0f}%"
    if low <= error <= high:
        return f"The peak's error {_pct(error)} is within {text}."
    kind, measured, predicted = differs_most(record)
    return (f"The peak's error {_pct(error)} is outside {text}; the category that differs "
            f"most is **{kind}**: {F.fmt_bytes(measured)} measured, {F.fmt_bytes(predicted)} "
            f"predicted ({_pct(relative_error(predicted, measured))}).")


def rank_rows(record: DryRunRecord) -> list[list[str]]:
    """The rows of a rank's table: the peak (with its moment), each memory category and the
    FLOPs, each as [what, measured, predicted, error]."""
    rows = [[f"**peak** ({record.peak_moment or 'moment not recorded'})",
             f"**{F.fmt_bytes(record.peak_bytes)}**",
             f"**{F.fmt_bytes(record.predicted_peak_bytes)}**",
             _pct(relative_error(record.predicted_peak_bytes, record.peak_bytes))]]
    for k in F.MEMORY_KINDS:
        measured = record.peak_by_category.get(k, 0)
        predicted = record.predicted_by_category.get(k, 0.0)
        rows.append([k, F.fmt_bytes(measured), F.fmt_bytes(predicted),
                     _pct(relative_error(predicted, measured))])
    rows.append(["FLOPs", F.fmt_flops(record.flops), F.fmt_flops(record.predicted_flops),
                 _pct(relative_error(record.predicted_flops, record.flops))])
    return rows


def _axes(record: DryRunRecord) -> list[str]:
    return sorted(set(record.bytes_by_axis) | set(record.priced_bytes_by_axis))


def axis_rows(record: DryRunRecord) -> list[list[str]]:
    """[mesh axis, measured bytes, priced bytes, error] per axis the rank's collectives used
    or the plan priced ("not priced" for a plan without bytes per axis)."""
    if not record.priced_bytes_by_axis:
        return [[f"`{axis}`", F.fmt_bytes(nbytes), "not priced", "n/a"]
                for axis, nbytes in sorted(record.bytes_by_axis.items())]
    rows = []
    for axis in _axes(record):
        measured = record.bytes_by_axis.get(axis, 0)
        priced = record.priced_bytes_by_axis.get(axis, 0.0)
        rows.append([f"`{axis}`", F.fmt_bytes(measured), F.fmt_bytes(priced),
                     _pct(relative_error(priced, measured))])
    return rows


def axis_differs_most(record: DryRunRecord) -> tuple[str, int, float] | None:
    """(axis, measured bytes, priced bytes) of the mesh axis whose priced bytes are
    farthest from the measured ones in relative terms (an axis measured at 0 but priced
    counts as farthest); None when the plan prices no axis or every axis is within
    +-`TRAFFIC_BAND`."""
    if not record.priced_bytes_by_axis:
        return None

    def off(axis: str) -> float:
        error = relative_error(record.priced_bytes_by_axis.get(axis, 0.0),
                               record.bytes_by_axis.get(axis, 0))
        return float("inf") if error is None else abs(error)

    axis = max(_axes(record), key=off, default=None)
    if axis is None or off(axis) <= TRAFFIC_BAND:
        return None
    return axis, record.bytes_by_axis.get(axis, 0), record.priced_bytes_by_axis.get(axis, 0.0)


def traffic_finding(record: DryRunRecord) -> str:
    """The sentence under a rank's axis table: every axis within +-`TRAFFIC_BAND`, or the
    axis that differs most (`axis_differs_most`)."""
    if not record.priced_bytes_by_axis:
        return f"Collective bytes are {NOT_PRICED}."
    worst = axis_differs_most(record)
    if worst is None:
        return (f"Every axis's collective bytes are within +-{TRAFFIC_BAND:.0%} of the "
                "plan's.")
    axis, measured, priced = worst
    return (f"Collective bytes differ beyond +-{TRAFFIC_BAND:.0%}; the axis that differs most "
            f"is **{axis}**: {F.fmt_bytes(measured)} measured, {F.fmt_bytes(priced)} priced "
            f"({_pct(relative_error(priced, measured))}).")


def where_text(record: DryRunRecord) -> str:
    """"pp1 dp0 cp0 tp1": the rank's mesh coordinate."""
    return " ".join(f"{k}{v}" for k, v in record.coordinates.items())


def intro_text(plan: Plan) -> str:
    """The paragraph that says what was run and measured, and against what."""
    return (f"{F.plural(len(plan.dry_run), 'rank')} of the plan's {plan.mesh.world_size}, "
            "each built by the training runtime and run for whole training steps in one "
            "process, on fake tensors and torch's fake process group of the plan's world size "
            "([Note: dry run] in autoplan/runtime/dryrun.py); the last step measured. Memory "
            "is the peak of live tensor storage by category; predicted is the plan's figure for "
            "the rank's pipeline stage ([Note: memory per rank] in cost_model/rank_memory.py). "
            "FLOPs: matmuls and attention, recomputation included, against the plan's for "
            "the rank's pipeline stage ([Note: FLOPs per rank] in solver/assemble.py). Error: predicted / measured - 1. Collective bytes per "
            "mesh axis (each op's largest buffer, summed) against the plan's for the rank's "
            "pipeline stage ([Note: traffic per axis] in autoplan/cost_model/traffic.py).")
