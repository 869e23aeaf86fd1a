"""Whole-step export: each dry-run rank's whole training step as Python, Graphviz and JSON,
beside a table of its traffic per mesh axis.

[Note: whole-step export] `autoplan export` traces each rank's forward graph
(autoplan/passes/export.py); what the rank runs around it -- the backward with its
recomputation, FSDP2's all-gathers and gradient reduce-scatters in the policy's dtypes, the
pipeline schedule's sends and receives, clipping, the optimizer step -- happens in the
runtime, not in a graph. The dry run ([Note: dry run] in runtime/dryrun.py) runs all of it
for one rank on fake tensors, and its recorder sees every local aten op: with `record_ops`
it keeps the measured step's op sequence (runtime/step_ops.py: the moment, the op, its
local input and output shapes and dtypes, and for a collective or p2p its entry in
`RankDryRun.collectives`: op, mesh axis, dtype, bytes), an op of activation checkpointing's
recomputation marked "(recomputation)" in its moment, and each pipeline action as the rank
runs it (`RankDryRun.actions`, in the notation of torch's schedule IR: "0F1", "0SEND_F1",
"1RECV_B0", "0REDUCE_GRAD").

`export_step` writes, per rank r, `rankR_step.py` (one line per op in issue order: the op
called on its local tensors, its outputs and, for a collective, axis, dtype and bytes in a
comment; a comment line where the moment changes and where a pipeline action starts; the
header holds the traffic table and the actions), `rankR_step.dot` (the ops in order, one
cluster per moment, collectives filled) and `rankR_step.json` (all of it as data), and
`traffic.md` (per rank: count and bytes per mesh axis and op) and `plan.json`. The listing
is a sequence, not a data-flow graph: the recorder keeps shapes, not which op's output feeds
which. Ops are listed up to `step_ops.MAX_OPS` per rank; the files say how many more ran.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from autoplan.graph import CapturedGraph
from autoplan.plan import Plan
from autoplan.runtime.dryrun import RankDryRun, dry_run
from autoplan.units import fmt_bytes, plural

__all__ = ["export_step", "step_files", "traffic_rows", "write_step_files"]

_STEP_FILE = re.compile(r"rank\d+_step\.(py|dot|json)")


def export_step(graph: CapturedGraph, plan: Plan, out_dir: str | os.PathLike,
                ranks: Sequence[int] | None = None, **dry_run_args) -> dict[str, Path]:
    """Dry-run `ranks` of `plan` (default rank 0) with their op sequence recorded and write
    each one's whole step into `out_dir` ([Note: whole-step export]): `rankR_step.py`,
    `.dot`, `.json`, `traffic.md` and `plan.json`; files of an earlier step export there
    for ranks not exported now are removed. `dry_run_args`: `dry_run`'s keywords
    (`planned_graph`, `steps`, `device_mem_bytes`, ...). Returns {file name: path}.

    Raises what `dry_run` raises (ValueError for a rank outside the plan, DryRunError,
    DryRunOutOfMemory), before anything is written; OSError when `out_dir` cannot be
    written.
    """
    rows = dry_run(graph, plan, ranks, record_ops=True, **dry_run_args)
    return write_step_files(step_files(rows, plan), out_dir)


def write_step_files(files: dict[str, str], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write `files` (`step_files`) into `out_dir`, all or nothing, and remove the rank
    files of an earlier step export there that `files` does not have."""
    from autoplan.report.write import write_files

    written = write_files(files, out_dir)
    for old in Path(out_dir).glob("rank*_step.*"):
        if old.name not in files and _STEP_FILE.fullmatch(old.name):
            old.unlink()
    return written


def step_files(rows: Sequence[RankDryRun], plan: Plan) -> dict[str, str]:
    """{file name: text} of the whole-step export of `rows` (dry runs made with
    `record_ops=True`) of `plan`; its `plan.json` holds the plan with these dry runs
    (`Plan.dry_run`). Raises ValueError for a row without its op sequence."""
    import dataclasses

    recorded = dataclasses.replace(plan, dry_run=tuple(r.record() for r in rows))
    files = {"plan.json": recorded.to_json() + "\n"}
    for row in rows:
        if row.ops is None:
            raise ValueError(f"rank {row.rank}: its dry run kept no op sequence; run "
                             "dry_run(..., record_ops=True)")
        stem = f"rank{row.rank}_step"
        files[f"{stem}.py"] = _python(row, plan)
        files[f"{stem}.dot"] = _dot(row)
        files[f"{stem}.json"] = json.dumps(_json(row, plan), indent=1) + "\n"
    files["traffic.md"] = _traffic_markdown(rows, plan)
    return files


def traffic_rows(row: RankDryRun) -> list[dict]:
    """The rank's traffic per mesh axis and op, axis by axis: [{"axis", "op", "count",
    "bytes"}], bytes as `Collective.bytes` counts them (each op's largest buffer)."""
    count: dict[tuple[str, str], int] = defaultdict(int)
    nbytes: dict[tuple[str, str], int] = defaultdict(int)
    for c in row.collectives:
        count[c.axis, c.op] += 1
        nbytes[c.axis, c.op] += c.bytes
    return [{"axis": axis, "op": op, "count": count[axis, op], "bytes": nbytes[axis, op]}
            for axis, op in sorted(count)]


def _where(row: RankDryRun) -> str:
    return " ".join(f"{k}{v}" for k, v in row.coordinates.items())


def _title(row: RankDryRun, plan: Plan) -> str:
    return (f"rank {row.rank} ({_where(row)}) of {plan.model} on {plan.topology}, mesh "
            f"{plan.mesh} (axes {', '.join(plan.mesh.axis_names)}), ZeRO-{plan.zero_stage}, "
            f"{plural(plan.num_microbatches, 'microbatch')}, schedule {plan.schedule}")


def _traffic_lines(row: RankDryRun) -> list[str]:
    lines = ["| axis | op | count | bytes |", "|---|---|---:|---:|"]
    for t in traffic_rows(row):
        lines.append(f"| {t['axis']} | {t['op']} | {t['count']} | {t['bytes']} "
                     f"({fmt_bytes(t['bytes'])}) |")
    for axis, total in sorted(row.bytes_by_axis.items()):
        lines.append(f"| **{axis}** | all | "
                     f"{sum(1 for c in row.collectives if c.axis == axis)} | {total} "
                     f"({fmt_bytes(total)}) |")
    return lines


def _python_tensor(text: str) -> str:
    """A `tensor_text` as a Python expression (a 0-d tensor's `[]` is not one)."""
    return text.replace("[]", "[()]")


def _python(row: RankDryRun, plan: Plan) -> str:
    ops = row.ops
    head = [f"# autoplan whole-step export: {_title(row, plan)}",
            "# one measured training step of its dry run (autoplan/runtime/dryrun.py), in "
            "issue order: every",
            "# local aten op and collective on its local tensors (dtype[shape]), the outputs "
            "after '->'; no values",
            f"# ops: {len(ops)} listed" + (f", {ops.num_dropped} more not listed"
                                           if ops.num_dropped else ""),
            "#", "# traffic by mesh axis (each op's largest buffer, nccl-tests' size):"]
    head += [f"#   {line}" for line in _traffic_lines(row)]
    if row.actions:
        head += ["#", "# pipeline actions, in the order this rank ran them (torch's schedule "
                 "IR notation):", f"#   {' '.join(row.actions)}"]
    body, moment = ["", "", "def step():"], None
    marks = dict(_marks_by_index(ops.marks))
    for op in ops:
        if op.moment != moment:
            moment = op.moment
            body.append(f"    # -- {moment}")
        for action in marks.get(op.index, ()):
            body.append(f"    # action {action}")
        call = f"    torch.ops.{op.op}({', '.join(_python_tensor(t) for t in op.inputs)})"
        note = " -> " + ", ".join(op.outputs) if op.outputs else ""
        if op.collective is not None:
            c = row.collectives[op.collective]
            note += f" | {c.op} over {c.axis} ({c.group_size} ranks), {c.dtype}, {c.bytes} B"
        body.append(call + (f"  #{note}" if note else ""))
    if len(body) == 3:
        body.append("    pass")
    return "\n".join(head + ["", "import torch"] + body) + "\n"


def _marks_by_index(marks) -> dict[int, list[str]]:
    out: dict[int, list[str]] = defaultdict(list)
    for index, action in marks:
        out[index].append(action)
    return out


def _dot(row: RankDryRun) -> str:
    lines = [f'digraph "rank{row.rank}_step" {{',
             "  rankdir=TB; node [shape=box, fontsize=10];"]
    marks = _marks_by_index(row.ops.marks)
    previous, moment, cluster = None, None, 0
    for op in row.ops:
        if op.moment != moment:
            if moment is not None:
                lines.append("  }")
            moment, cluster = op.moment, cluster + 1
            lines.append(f'  subgraph "cluster_{cluster}" {{ label="{moment}";')
        for action in marks.get(op.index, ()):
            name = f"a{op.index}_{action}"
            lines.append(f'    "{name}" [label="{action}", shape=cds];')
            if previous is not None:
                lines.append(f'    "{previous}" -> "{name}";')
            previous = name
        label = f"{op.op}\\n{', '.join(op.inputs)}\\n-> {', '.join(op.outputs)}"
        style = ""
        if op.collective is not None:
            c = row.collectives[op.collective]
            label += f"\\n{c.axis} {c.dtype} {c.bytes} B"
            style = ', style=filled, fillcolor="#ffd27f"'
        lines.append(f'    "op{op.index}" [label="{label}"{style}];')
        if previous is not None:
            lines.append(f'    "{previous}" -> "op{op.index}";')
        previous = f"op{op.index}"
    if moment is not None:
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _json(row: RankDryRun, plan: Plan) -> dict:
    return {
        "rank": row.rank, "coordinates": dict(row.coordinates), "plan": str(plan),
        "num_ops": row.ops.num_ops, "num_ops_not_listed": row.ops.num_dropped,
        "actions": list(row.actions),
        "traffic": traffic_rows(row), "bytes_by_axis": dict(row.bytes_by_axis),
        "collectives": [{"op": c.op, "axis": c.axis, "group_size": c.group_size,
                         "dtype": c.dtype, "bytes": c.bytes} for c in row.collectives],
        "action_marks": [{"before_op": i, "action": a} for i, a in row.ops.marks],
        "ops": [{"index": op.index, "moment": op.moment, "op": op.op,
                 "inputs": list(op.inputs), "outputs": list(op.outputs),
                 "collective": op.collective} for op in row.ops],
    }


def _traffic_markdown(rows: Sequence[RankDryRun], plan: Plan) -> str:
    lines = [f"# Traffic per rank: {plan}", "",
             "Every collective and p2p op of one measured training step of each rank's dry "
             "run, by mesh axis and op; bytes are each op's largest buffer (nccl-tests' "
             "size), as `RankDryRun.collectives` counts them. The ops in order: "
             "`rankR_step.py`."]
    for row in rows:
        lines += ["", f"## Rank {row.rank} ({_where(row)})", ""] + _traffic_lines(row)
        if row.actions:
            lines += ["", f"Pipeline actions: `{' '.join(row.actions)}`"]
    return "\n".join(lines) + "\n"
