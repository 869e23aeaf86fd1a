"""The facts of the report's "Dry run" section (markdown.py renders them): what dry runs of
some of the plan's ranks measured (`Plan.dry_run`, written by `autoplan dryrun -o`; [Note:
dry run] in autoplan/runtime/dryrun.py), held against the plan's prediction.

Per dry-run rank: its mesh coordinate; the step's measured peak memory, when it occurs, and
each category beside the plan's for that rank (its pipeline rank's entry of
`Prediction.memory_by_pp_rank`); collective bytes per mesh axis (measured only: the plan
prices no bytes per rank per axis, `NOT_PRICED`); FLOPs beside the plan's per-rank share.
Every error is `relative_error`: predicted / measured - 1, as the error bands count ([Note:
error bands] in autoplan/cost_model/fidelity.py). Where the peak's error is outside the plan's
memory band, the section names the category that differs most in bytes (`differs_most`).
"""

from __future__ import annotations

from autoplan.plan import DryRunRecord, Plan
from autoplan.report import facts as F
from autoplan.topology import Topology

__all__ = ["NOT_PRICED", "relative_error", "memory_band", "differs_most", "finding",
           "rank_rows", "axis_rows", "where_text", "intro_text"]

NOT_PRICED = ("not priced per axis: the plan records the tp redistributions' global bytes and "
              "the step's communication time, not bytes per rank per mesh axis")


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


def axis_rows(record: DryRunRecord) -> list[list[str]]:
    """[mesh axis, measured bytes, priced] per axis the rank's collectives used."""
    return [[f"`{axis}`", F.fmt_bytes(nbytes), "not priced"]
            for axis, nbytes in sorted(record.bytes_by_axis.items())]


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
            "the rank's pipeline stage ([Note: memory per rank] in solver/pipeline.py). "
            "FLOPs: matmuls and attention, recomputation included, against the plan's model "
            "FLOPs per rank (without). Error: predicted / measured - 1. Collective bytes per "
            f"mesh axis are {NOT_PRICED}.")
