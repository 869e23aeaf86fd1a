"""Dry run at the scale of the plan: the issue's plans, each rank kind run for a whole training
step on fake tensors and a fake process group of the plan's size, measured against the plan
(issue 26).

    python bench/dryrun.py                         # every case -> bench/results/dryrun.json
    python bench/dryrun.py --cases llama3-8b,gpt3-175b   # these cases, merged into the file
    python bench/dryrun.py --quick                 # tiny models on local-cpu, seconds
    python bench/dryrun.py --markdown              # print the file's docs/benchmarks.md table;
                                                   # run nothing (--readme: the same)

Each case is a set of `autoplan plan` flags (`CASES`). It is planned and captured exactly as
`autoplan dryrun` does (autoplan/cli.py `plan_for_dry_run`: plan on a 2-block capture, then
the whole model at the plan's microbatch, seq_len / cp tokens per sample), then each of its
default ranks (`default_ranks`: one per kind of rank -- the first rank of the first and of the
last pipeline stage, and of the middle stage when pp > 2) runs `--steps` training steps in this
process, one rank after the other ([Note: dry run] in autoplan/runtime/dryrun.py), after its
optimizer states are created as a first step leaves them; the last step is measured. A line is printed per rank as it finishes, and the JSON is written after
every rank (a long run that is stopped keeps what it measured).

Cases (`CASES`, `autoplan plan` flags, bf16): the golden plans of tests/golden/regen.py --
llama3-8b on 1 dgx-h100 node (batch 64, seq 8192), llama3-70b on 8 (512, 4096), llama3-405b
on 2,048 (2048, 8192; golden: cp 8), gpt3-175b on 128 dgx-a100 nodes (1536, 2048) -- planned by
the CLI (from 2 captured blocks; `golden_mesh` beside the plan says whether it is the golden
one); llama3.1-405b at 131,072 tokens on 2,048 dgx-h100 nodes (16,384 H100, batch 128, as
docs/guide.md's long-context example: a cp plan there); llama3-8b on one H200 (h200-node, 1
device, batch 8 x 4096 tokens) with `--offload optimizer`.

Recorded per rank: mesh coordinates, the step's peak of live tensor bytes and its categories
(and, in `peak_by_op`, by the ops that allocated them: the 8 largest of each category),
the plan's predicted peak and categories, `peak_error` = predicted / measured - 1, collective
bytes per mesh axis (and op counts), FLOPs measured beside the plan's per-rank share
(`flops_error` = predicted / measured - 1), build, step and wall seconds.

Bars (each rank; `all_within_bars` is their conjunction, the exit status 1 when it fails):
- peak memory: |peak_error| <= 5 %, against the plan's figure for the rank's pipeline rank
  (`Prediction.memory_by_pp_rank`);
- FLOPs: |flops_error| <= 2 %, against the plan's FLOPs for the rank's pipeline rank
  (`Prediction.flops_by_pp_rank`: its own stages, recomputation included, [Note: FLOPs per
  rank] in autoplan/solver/assemble.py); matmuls and attention only;
- collective bytes per axis: |priced / measured - 1| <= 5 % on every mesh axis
  (`axis_errors`; an axis measured at 0 but priced fails). Priced: the plan's bytes per mesh
  axis for the rank's pipeline rank (`priced_bytes_by_axis`, Prediction.
  bytes_by_axis_by_pp_rank, [Note: traffic per axis] in autoplan/cost_model/traffic.py);
  `axis_differs_most` names the farthest axis when the bar fails;
- time: wall seconds per rank (build and all steps) <= 300 s on the machine of the run.

GPT 1T runs the SC'21 recipe fixed (tp8 x pp64 x dp6 on 384 dgx-a100 nodes, the `gpt-1t`
preset of its Table 1); Mixtral 8x7B (`mixtral-8x7b`) runs with its 8 experts over 8 dp ranks
(ep 8), the rest planned, at routing skew 1: a dry run routes balanced ([Note: dry run
routing] in autoplan/runtime/expert_parallel.py), so the plan it is measured against is priced
for the routing it runs ([Note: expert parallelism] in autoplan/cost_model/expert_parallel.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _results.py
from _results import table_head, table_row, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "dryrun.json"
GOLDEN = ROOT / "tests" / "golden"

PEAK_BAND = 0.05  # |predicted / measured - 1| of the peak (issue 26)
FLOPS_BAND = 0.02  # |predicted / measured - 1| of the FLOPs (issue 26)
RANK_LIMIT_S = 300.0  # wall seconds per rank (issue 26: <= 5 min per rank)

# name: `autoplan plan` flags. The golden cases are tests/golden/regen.py CASES' arguments
# (the planner's own choice, no overrides); bf16 is the CLI's default dtype.
CASES: dict[str, list[str]] = {
    "llama3-8b": ["--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
                  "--global-batch", "64", "--seq", "8192"],
    "llama3-70b": ["--model", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "8",
                   "--global-batch", "512", "--seq", "4096"],
    "llama3-405b": ["--model", "llama3-405b", "--cluster", "dgx-h100", "--nodes", "2048",
                    "--global-batch", "2048", "--seq", "8192"],
    # 128K tokens: 2,048 dgx-h100 nodes (16,384 H100), 128 sequences, as docs/guide.md's
    # long-context example and bench/plan_speed.py's llama3.1-405b-128k (a cp > 1 plan)
    "llama3.1-405b-128k": ["--model", "llama3.1-405b", "--cluster", "dgx-h100", "--nodes",
                           "2048", "--global-batch", "128", "--seq", "131072"],
    "gpt3-175b": ["--model", "gpt3-175b", "--cluster", "dgx-a100", "--nodes", "128",
                  "--global-batch", "1536", "--seq", "2048"],
    # Narayanan et al., SC'21 (Megatron-LM), Table 1: the 1T-parameter GPT at tp8 x pp64 x
    # dp6 on 384 dgx-a100 nodes (3,072 A100), batch 3072, seq 2048
    "gpt-1t": ["--model", "gpt-1t", "--cluster", "dgx-a100", "--nodes", "384",
               "--global-batch", "3072", "--seq", "2048", "--tp", "8", "--pp", "64",
               "--dp", "6"],
    # a Mixtral-class mixture of experts with expert parallelism: Mixtral 8x7B on 8 dgx-h100
    # nodes, its 8 experts over the 8 dp ranks of a node (ep 8); planned at routing skew 1,
    # the balanced routing a dry run's fake tensors get ([Note: dry run routing])
    "mixtral-8x7b-ep8": ["--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--nodes", "8",
                         "--global-batch", "256", "--seq", "4096", "--dp", "8", "--ep", "8",
                         "--routing-skew", "1"],
    # issue 13's case (docs/guide.md, CPU offload): 16 bytes per parameter do not fit one H200
    "llama3-8b-offload-h200": ["--model", "llama3-8b", "--cluster", "h200-node", "--nodes", "1",
                               "--devices-per-node", "1", "--global-batch", "8", "--seq", "4096",
                               "--offload", "optimizer"],
}
GOLDEN_OF = {"llama3-8b": "llama3-8b_dgx-h100-1", "llama3-70b": "llama3-70b_dgx-h100-8",
             "llama3-405b": "llama3-405b_dgx-h100-2048", "gpt3-175b": "gpt3-175b_dgx-a100-128"}

# --quick: tiny models on local-cpu ranks; gpt2-demo has 6 blocks, so pp3 has a middle stage
QUICK_CASES: dict[str, list[str]] = {
    "gpt2-tiny-pp2": ["--model", "gpt2-tiny", "--cluster", "local-cpu", "--devices-per-node",
                      "8", "--global-batch", "8", "--seq", "16", "--pp", "2", "--dp", "2",
                      "--tp", "2", "--zero-stage", "3"],
    "gpt2-demo-pp3": ["--model", "gpt2-demo", "--cluster", "local-cpu", "--devices-per-node",
                      "12", "--global-batch", "12", "--seq", "32", "--pp", "3", "--dp", "2",
                      "--tp", "2", "--num-microbatches", "3"],
}


# --- ranks -------------------------------------------------------------------------------------

def rank_at(plan, coordinates: dict[str, int]) -> int:
    """The global rank at mesh coordinate `coordinates` by axis (an axis not given: 0), the
    inverse of `rank_coordinates` (last axis innermost, as `init_device_mesh` lays it out)."""
    from autoplan.runtime.dryrun import rank_coordinates

    rank = 0
    for name, size in zip(plan.mesh.axis_names, plan.mesh.shape):
        rank = rank * size + coordinates.get(name, 0)
    got = rank_coordinates(plan, rank)
    assert all(got[k] == v for k, v in coordinates.items()), (coordinates, rank, got)
    return rank


def default_ranks(plan) -> dict[int, str]:
    """One rank per kind of rank, {global rank: kind}: the first rank of pipeline stage 0
    ("first"), of the middle stage pp // 2 when pp > 2 ("middle") and of the last ("last");
    "only" without pp. Ranks of one stage differ only by their dp / cp / tp coordinate,
    which gives them the same shapes."""
    pp = plan.mesh.pp
    if pp == 1:
        return {0: "only"}
    stages = {0: "first", **({pp // 2: "middle"} if pp > 2 else {}), pp - 1: "last"}
    return {rank_at(plan, {"pp": s}): kind for s, kind in stages.items()}


# --- one rank ----------------------------------------------------------------------------------

def _pct(error: float | None) -> str:
    return "n/a" if error is None else f"{error:+.1%}"


def _within(error: float | None, band: float) -> bool:
    return error is not None and abs(error) <= band


def check(row: dict) -> dict:
    """The bars of a rank's row, computed from its numbers (module docstring)."""
    from autoplan.report.measured import TRAFFIC_BAND, relative_error

    peak_error = relative_error(row["predicted_peak_bytes"], row["peak_bytes"])
    flops_error = relative_error(row["predicted_flops"], row["flops"])
    priced, measured = row.get("priced_bytes_by_axis") or {}, row["bytes_by_axis"]
    axis_errors = {axis: relative_error(priced.get(axis, 0.0), measured.get(axis, 0))
                   for axis in sorted(set(priced) | set(measured))}
    out = {"peak_error": peak_error, "peak_ok": _within(peak_error, PEAK_BAND),
           "flops_error": flops_error, "flops_ok": _within(flops_error, FLOPS_BAND),
           "axis_errors": axis_errors,
           # a rank that moves nothing (one device) holds it by pricing nothing
           "collective_bytes_ok": (bool(priced) or not measured) and all(
               _within(e, TRAFFIC_BAND) for e in axis_errors.values()),
           "time_ok": row["wall_s"] <= RANK_LIMIT_S}
    far = [a for a, e in axis_errors.items() if not _within(e, TRAFFIC_BAND)]
    out["axis_differs_most"] = max(
        far, key=lambda a: float("inf") if axis_errors[a] is None else abs(axis_errors[a]),
        default=None)
    out["ok"] = out["peak_ok"] and out["flops_ok"] and out["collective_bytes_ok"] and \
        out["time_ok"]
    return out


def run_rank(graph, planned, rank: int, kind: str, steps: int) -> dict:
    """Dry-run one rank; its row with the bars. A rank that cannot run (DryRunError, or any
    other failure of the runtime) is a row with `error` and ok False, and the bench goes on."""
    from autoplan.runtime.dryrun import dry_run, rank_coordinates

    start_s = time.perf_counter()
    try:
        (r,) = dry_run(graph, planned.plan, [rank], planned_graph=planned.graph, steps=steps,
                       device_kernels=planned.topology.device.fuses_pointwise,
                       device_all_to_all=planned.topology.device.all_to_all)
    except Exception as e:  # noqa: BLE001 - a bench reports every failure and goes on
        return {"rank": rank, "kind": kind,
                "coordinates": rank_coordinates(planned.plan, rank),
                "error": _first_line(e), "wall_s": time.perf_counter() - start_s, "ok": False}
    row = {  # what the plan records of the rank (autoplan dryrun -o's plan.json), and more
        **dataclasses.asdict(r.record()), "kind": kind,
        "resident_bytes": r.resident_bytes, "local_param_bytes": r.local_param_bytes,
        "collective_counts": r.counts,
        "peak_by_op": {c: [list(x) for x in ops] for c, ops in r.peak_by_op.items()},
        "build_s": r.build_s, "step_s": r.step_s, "wall_s": time.perf_counter() - start_s,
    }
    row.update(check(row))
    return row


def _first_line(e: BaseException, limit: int = 400) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _rank_line(name: str, row: dict) -> str:
    from autoplan.units import fmt_bytes, fmt_flops

    where = " ".join(f"{k}{v}" for k, v in row["coordinates"].items())
    if "error" in row:
        return f"{name} rank {row['rank']} ({row['kind']}: {where}): FAILED {row['error']}"
    return (f"{name} rank {row['rank']} ({row['kind']}: {where}): peak "
            f"{fmt_bytes(row['peak_bytes'])} measured, {fmt_bytes(row['predicted_peak_bytes'])} "
            f"planned ({_pct(row['peak_error'])}); FLOPs {fmt_flops(row['flops'])} measured, "
            f"{fmt_flops(row['predicted_flops'])} planned ({_pct(row['flops_error'])}); build "
            f"{row['build_s']:.1f} s, step {row['step_s']:.1f} s, wall {row['wall_s']:.0f} s"
            f" -- {'within the bars' if row['ok'] else 'NOT within the bars'}")


# --- one case ----------------------------------------------------------------------------------

def plan_case(flags: list[str]):
    """(planned, graph) of `autoplan dryrun` flags, as the command plans and captures
    them (autoplan/cli.py plan_for_dry_run); the command's progress lines go to stderr."""
    from autoplan.cli import build_parser, plan_for_dry_run

    args = build_parser().parse_args(["dryrun", *flags])
    return plan_for_dry_run(args)


def _case_header(name: str, flags: list[str], planned, plan_capture_s: float) -> dict:
    plan = planned.plan
    out = {
        "status": "run", "flags": flags, "plan": str(plan), "mesh": plan.to_dict()["mesh"],
        "mesh_name": str(plan.mesh),
        "world_size": plan.mesh.world_size, "device": planned.topology.device.name,
        "zero_stage": plan.zero_stage, "num_microbatches": plan.num_microbatches,
        "microbatch_size": plan.microbatch_size, "schedule": plan.schedule,
        "num_virtual_stages": plan.num_virtual_stages, "checkpointing": plan.checkpointing,
        "offload": plan.offload, "predicted_step_time_s": plan.prediction.step_time_s,
        "warnings": list(planned.warnings), "plan_capture_s": plan_capture_s,
        "ranks": [],
    }
    if name in GOLDEN_OF:  # the checked-in plan (planned from 1 block; the CLI plans from 2)
        path = GOLDEN / f"{GOLDEN_OF[name]}.plan.json"
        out["golden"] = str(path.relative_to(ROOT))
        out["golden_mesh"] = json.loads(path.read_text())["mesh"]
    return out


def run_case(name: str, flags: list[str], steps: int, write) -> dict:
    """Plan the case, then dry-run its default ranks one after the other; `write(case)` after
    each rank. A case that cannot be planned is recorded with its error."""
    start_s = time.perf_counter()
    try:
        planned, graph = plan_case(flags)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - recorded, the next case runs
        case = {"status": "error", "flags": flags, "error": _first_line(e),
                "plan_capture_s": time.perf_counter() - start_s, "ranks": []}
        print(f"{name}: FAILED to plan: {case['error']}", flush=True)
        write(case)
        return case
    case = _case_header(name, flags, planned, time.perf_counter() - start_s)
    print(f"{name}: {case['plan']} ({case['world_size']} x {case['device']}), planned in "
          f"{case['plan_capture_s']:.0f} s (with the runtime graph's capture)", flush=True)
    for rank, kind in default_ranks(planned.plan).items():
        row = run_rank(graph, planned, rank, kind, steps)
        case["ranks"].append(row)
        print(_rank_line(name, row), flush=True)
        write(case)
    return case


# --- the results file --------------------------------------------------------------------------

def _ok(case: dict) -> bool:
    """A case holds its bars: it was run and every rank is within them."""
    return case["status"] == "run" and all(r["ok"] for r in case["ranks"])


def _document(cases: dict, args, previous: dict | None) -> dict:
    from autoplan.report.measured import TRAFFIC_BAND

    merged = dict(previous["cases"]) if previous else {}
    merged.update(cases)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average": os.getloadavg(), "quick": args.quick, "steps": args.steps,
        "measure": "one rank at a time in this process on fake tensors and torch's fake "
                   "process group of the plan's world size (autoplan/runtime/dryrun.py); the "
                   "last of `steps` training steps measured (the optimizer states created before the "
                   "first, as a first step leaves them): peak of live tensor storage by "
                   "category, collective bytes per mesh axis, FLOPs (matmuls and attention)",
        "bars": {
            "peak": f"|predicted / measured - 1| <= {PEAK_BAND:.0%} (predicted: the plan's "
                    "figure for the rank's pipeline rank)",
            "flops": f"|predicted / measured - 1| <= {FLOPS_BAND:.0%} (predicted: the plan's "
                     "FLOPs for the rank's pipeline rank; both with recomputation)",
            "collective_bytes": f"|priced / measured - 1| <= {TRAFFIC_BAND:.0%} on every mesh "
                                "axis (priced: the plan's bytes per axis for the rank's "
                                "pipeline rank)",
            "time": f"wall seconds per rank <= {RANK_LIMIT_S:.0f}"},
        "all_within_bars": all(_ok(c) for c in merged.values()),
        "cases": merged,
    }


def _previous(path: Path, quick: bool) -> dict | None:
    """The results file to merge a `--cases` subset into: the same mode's only."""
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return doc if doc.get("quick") == quick else None


# --- docs/benchmarks.md table ------------------------------------------------------------------

def markdown(doc: dict) -> str:
    """The docs/benchmarks.md table of a results document ("Dry run at the scale of the
    plan"): a row per rank, a row per case not run."""
    from autoplan.units import fmt_bytes

    lines = table_head(["case", "rank", "measured peak", "predicted", "error", "FLOPs error",
                        "step"])
    for name, case in doc["cases"].items():
        if case["status"] != "run":
            reason = case.get("reason") or case.get("error", "")
            lines.append(table_row([name, f"{case['status']}: {reason}", "", "", "", "", ""]))
            continue
        for r in case["ranks"]:
            where = f"{r['rank']} ({r['kind']}, pp{r['coordinates']['pp']})"
            if "error" in r:
                lines.append(table_row([name, where, f"failed: {r['error']}", "", "", "", ""]))
                continue
            lines.append(table_row([
                f"{name} ({case['mesh_name']})", where, fmt_bytes(r["peak_bytes"]),
                fmt_bytes(r["predicted_peak_bytes"]), _pct(r["peak_error"]),
                _pct(r["flops_error"]), f"{r['step_s']:.1f} s"]))
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------

def _selected(args) -> dict[str, list[str] | None]:
    """The cases to run by name. Raises SystemExit 2 for an unknown name."""
    known = QUICK_CASES if args.quick else CASES
    names = args.cases.split(",") if args.cases else list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"unknown cases {unknown}; known{' (--quick)' if args.quick else ''}: "
              f"{', '.join(known)}", file=sys.stderr)
        raise SystemExit(2)
    return {n: known[n] for n in names}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", metavar="NAME,...",
                        help="cases to run (default: all); merged into an existing --out")
    parser.add_argument("--quick", action="store_true",
                        help="tiny models on local-cpu ranks (seconds)")
    parser.add_argument("--steps", type=_positive_int, default=1,
                        help="training steps per rank, the last measured, after the optimizer "
                             "states are created as a first step leaves them (default: "
                             "%(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results JSON")
    parser.add_argument("--markdown", "--readme", action="store_true", dest="markdown",
                        help="print the docs/benchmarks.md table of --out and run nothing")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(args.out.read_text())))
        return 0
    try:
        selected = _selected(args)
    except SystemExit as e:
        return int(e.code)
    previous = _previous(args.out, args.quick)
    cases: dict[str, dict] = {}

    def write(case: dict | None = None, name: str | None = None) -> None:
        if case is not None:
            cases[name] = case
        write_json(args.out, _document(cases, args, previous))

    for name, flags in selected.items():
        run_case(name, flags, args.steps, lambda case, n=name: write(case, n))
    doc = _document(cases, args, previous)
    rows = [r for case in doc["cases"].values() for r in case["ranks"]]
    print(f"{sum(r['ok'] for r in rows)} of {len(rows)} ranks within the bars -> {args.out}")
    return 0 if doc["all_within_bars"] else 1


if __name__ == "__main__":
    sys.exit(main())
