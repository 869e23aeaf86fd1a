"""What differs between two plans: `autoplan diff A/plan.json B/plan.json`, and `autoplan
explain`'s comparison of the user's configuration with the chosen plan.

    plan_diff(a, b)            -> dict   (the JSON of `--json`)
    render_diff(diff, a=, b=)  -> str    (the terminal text)

Every number is one the plans recorded (`Plan.prediction`): nothing is priced here. The terms
are the step time's parts (compute, communication -- of which context parallelism's K/V
traffic, the pipeline transfers and the host offload --, bubble), the peak memory by category
of the most loaded rank, and the bytes each mesh axis moves per step on the busiest pipeline
rank (`Prediction.bytes_by_axis_by_pp_rank`). Parameter placements that differ are grouped by
role: the FQN with its block index replaced by `*` (`model.layers.*.mlp.up_proj.weight`), one
line per (role, placement in A, placement in B) with the number of parameters.
"""

from __future__ import annotations

import re

from autoplan.plan import Plan
from autoplan.units import fmt_bytes, fmt_time

__all__ = ["plan_diff", "render_diff", "CONFIG_FIELDS", "TIME_TERMS"]

# the configuration a plan is made of, in the order the text shows it
CONFIG_FIELDS = ("mesh", "zero_stage", "num_microbatches", "microbatch_size", "schedule",
                 "num_virtual_stages", "checkpointing", "offload", "dtype", "compiled")
# Prediction fields that are parts of the step time, seconds
TIME_TERMS = ("step_time_s", "compute_s", "comm_s", "cp_comm_s", "p2p_s", "offload_s",
              "bubble_s")
_BLOCK_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


def _role(fqn: str) -> str:
    """`fqn` with its block indices replaced by `*`."""
    return _BLOCK_INDEX.sub("*", fqn)


def _config(plan: Plan) -> dict:
    out = {}
    for f in CONFIG_FIELDS:
        value = getattr(plan, f)
        out[f] = str(value) if f == "mesh" else value
    out["float8_linears"] = len(plan.float8_linears)  # [Note: float8 recipe]: how many
    return out


def _stages(plan: Plan) -> list[list[int]]:
    return [[s.layer_start, s.layer_end] for s in plan.stages]


def _busiest_bytes(plan: Plan) -> dict[str, float]:
    """Bytes per mesh axis of the pipeline rank that moves the most in all ({} when the plan
    did not record them)."""
    ranks = plan.prediction.bytes_by_axis_by_pp_rank
    return dict(max(ranks, key=lambda r: sum(r.values()))) if ranks else {}


def plan_diff(a: Plan, b: Plan) -> dict:
    """The differences of plan `b` from plan `a`, as a JSON-able dict:

    - "same_request": whether both plan the same model, topology, global batch and seq_len
      (a diff across requests is allowed, and says so);
    - "config": {field: [a, b]} for each of CONFIG_FIELDS that differs, and
      "float8_linears" (the number of FP8 linears) when it does; "stages":
      [a's [layer_start, layer_end] per stage, b's] when they differ;
    - "time_s": {term: [a, b, b - a]} for TIME_TERMS (seconds per step);
    - "memory_bytes": {"peak" | category: [a, b, b - a]} for the most loaded rank;
    - "bytes_by_axis": {axis: [a, b, b - a]} on each plan's busiest pipeline rank;
    - "placements": [{"role", "a", "b", "params"}] for parameters whose tp placement differs,
      grouped by role, and "params_only_in": {"a": n, "b": n} for FQNs one plan lacks;
    - "strategies_differ": how many graph nodes have another placement.
    """
    pa, pb = a.prediction, b.prediction
    same = (a.model, a.topology, a.global_batch, a.seq_len) == \
        (b.model, b.topology, b.global_batch, b.seq_len)
    ca, cb = _config(a), _config(b)
    out: dict = {
        "a": str(a), "b": str(b), "same_request": same,
        "config": {f: [ca[f], cb[f]] for f in ca if ca[f] != cb[f]},
    }
    if _stages(a) != _stages(b):
        out["stages"] = [_stages(a), _stages(b)]
    out["time_s"] = {t: [getattr(pa, t), getattr(pb, t), getattr(pb, t) - getattr(pa, t)]
                     for t in TIME_TERMS}
    memory = {"peak": [pa.memory_bytes, pb.memory_bytes, pb.memory_bytes - pa.memory_bytes]}
    for c in sorted(set(pa.memory_breakdown) | set(pb.memory_breakdown)):
        x, y = pa.memory_breakdown.get(c, 0.0), pb.memory_breakdown.get(c, 0.0)
        memory[c] = [x, y, y - x]
    out["memory_bytes"] = memory
    ba, bb = _busiest_bytes(a), _busiest_bytes(b)
    out["bytes_by_axis"] = {ax: [ba.get(ax, 0.0), bb.get(ax, 0.0),
                                 bb.get(ax, 0.0) - ba.get(ax, 0.0)]
                            for ax in sorted(set(ba) | set(bb))}
    place_a, place_b = dict(a.param_placements), dict(b.param_placements)
    groups: dict[tuple[str, str, str], int] = {}
    for fqn in sorted(set(place_a) & set(place_b)):
        if place_a[fqn] != place_b[fqn]:
            key = (_role(fqn), place_a[fqn], place_b[fqn])
            groups[key] = groups.get(key, 0) + 1
    out["placements"] = [{"role": r, "a": x, "b": y, "params": n}
                         for (r, x, y), n in groups.items()]
    out["params_only_in"] = {"a": len(set(place_a) - set(place_b)),
                             "b": len(set(place_b) - set(place_a))}
    sa = {s.node: (s.inputs, s.outputs) for s in a.strategies}
    sb = {s.node: (s.inputs, s.outputs) for s in b.strategies}
    out["strategies_differ"] = sum(1 for n in set(sa) & set(sb) if sa[n] != sb[n])
    return out


def _delta_time(x: float, y: float) -> str:
    d = y - x
    rel = f" ({d / x:+.0%})" if x > 0 else ""
    return f"{fmt_time(x):>10s} {fmt_time(y):>10s} {('+' if d >= 0 else '-') + fmt_time(abs(d)):>11s}{rel}"


def _delta_bytes(x: float, y: float) -> str:
    d = y - x
    rel = f" ({d / x:+.0%})" if x > 0 else ""
    return f"{fmt_bytes(x):>10s} {fmt_bytes(y):>10s} {('+' if d >= 0 else '-') + fmt_bytes(abs(d)):>11s}{rel}"


_TERM_NAMES = {"step_time_s": "step time", "compute_s": "compute", "comm_s": "communication",
               "cp_comm_s": "  of which cp K/V", "p2p_s": "  of which pipeline p2p",
               "offload_s": "  of which offload", "bubble_s": "bubble"}


def render_diff(diff: dict, *, a: str = "A", b: str = "B") -> str:
    """The terminal text of `plan_diff`'s dict, the two plans named `a` and `b`."""
    lines = [f"{a}: {diff['a']}", f"{b}: {diff['b']}"]
    if not diff["same_request"]:
        lines.append("note: the plans answer different requests (model, cluster, global batch "
                     "or sequence length differ)")
    lines.append("")
    if diff["config"]:
        lines.append("configuration:")
        for f, (x, y) in diff["config"].items():
            lines.append(f"  {f:20s} {str(x):>20s} -> {y}")
    else:
        lines.append("configuration: the same")
    if "stages" in diff:
        sa, sb = diff["stages"]
        lines.append("  stages (blocks)      " + " ".join(f"[{s}, {e})" for s, e in sa))
        lines.append("                    -> " + " ".join(f"[{s}, {e})" for s, e in sb))
    lines += ["", f"{'per step':24s} {a:>10s} {b:>10s} {b + ' - ' + a:>11s}"]
    for t, (x, y, _) in diff["time_s"].items():
        if t in ("cp_comm_s", "p2p_s", "offload_s") and x == y == 0:
            continue
        lines.append(f"{_TERM_NAMES[t]:24s} {_delta_time(x, y)}")
    lines += ["", f"{'memory (most loaded rank)':24s} {a:>10s} {b:>10s} {b + ' - ' + a:>11s}"]
    for c, (x, y, _) in diff["memory_bytes"].items():
        lines.append(f"{c:24s} {_delta_bytes(x, y)}")
    if diff["bytes_by_axis"]:
        lines += ["", f"{'bytes moved per step':24s} {a:>10s} {b:>10s} {b + ' - ' + a:>11s}"]
        for ax, (x, y, _) in diff["bytes_by_axis"].items():
            lines.append(f"{'  on ' + ax:24s} {_delta_bytes(x, y)}")
    lines.append("")
    if diff["placements"]:
        lines.append("tp placements that differ (parameters by role):")
        for g in diff["placements"]:
            lines.append(f"  {g['role']}: {g['a']} -> {g['b']} ({g['params']} "
                         f"parameter{'s' if g['params'] != 1 else ''})")
    else:
        lines.append("tp placements: the same for every parameter both plans hold")
    only = diff["params_only_in"]
    if only["a"] or only["b"]:
        lines.append(f"  parameters only in {a}: {only['a']}, only in {b}: {only['b']}")
    if diff["strategies_differ"]:
        lines.append(f"graph nodes placed differently: {diff['strategies_differ']}")
    return "\n".join(lines)
