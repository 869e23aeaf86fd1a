"""Golden plans: a fixed set of models x clusters, planned and checked in as JSON.

    python -m tests.golden.regen            # rewrite every tests/golden/*.plan.json
    python -m tests.golden.regen llama3-8b  # only the named cases

tests/test_planner_scale.py re-plans every case and compares with the file, so any change to
the planner (or to the cost model it optimises) shows as a diff of these files. Regenerate them
when that change is intended, and read the diff.

What is compared ([Note: golden fields]): the whole Plan JSON except the cost model's figures,
which move with every calibration of a constant while the plan stays the same:
- `prediction` (step time, memory, MFU, breakdowns),
- `time_s` of each redistribution,
- `step_time_s`, `memory_bytes` and `reason` (which quotes figures) of each alternative.
Everything the planner decides stays: mesh, ZeRO stage, microbatching, schedule, stages,
checkpointing, every parameter placement and node strategy, every redistribution (which tensor,
from where to where, which collective, how many bytes) and which alternatives are kept.
Planning is deterministic (one CP-SAT worker with a fixed seed; ties broken by rank).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["CASES", "plan_case", "stable", "path_of", "main"]

HERE = Path(__file__).resolve().parent

# name: (model, cluster, nodes, devices_per_node or None, global_batch, seq_len, dtype)
CASES: dict[str, tuple] = {
    "gpt2-tiny_local-cpu-4": ("gpt2-tiny", "local-cpu", 1, 4, 8, 16, "float32"),
    "llama-tiny_local-cpu-4": ("llama-tiny", "local-cpu", 1, 4, 8, 16, "float32"),
    "llama3-8b_dgx-h100-1": ("llama3-8b", "dgx-h100", 1, None, 64, 8192, "bfloat16"),
    "llama3-70b_dgx-h100-8": ("llama3-70b", "dgx-h100", 8, None, 512, 4096, "bfloat16"),
    "gpt3-175b_dgx-a100-128": ("gpt3-175b", "dgx-a100", 128, None, 1536, 2048, "bfloat16"),
    "llama3-405b_dgx-h100-2048": ("llama3-405b", "dgx-h100", 2048, None, 2048, 8192,
                                  "bfloat16"),
}
CAPTURED_LAYERS = 1  # identical blocks captured; the planner scales to the real depth


def setup(name: str, graphs: dict | None = None):
    """(graph, topology, spec) of a case; `graphs` caches captures by (model, seq_len)."""
    from autoplan.capture import capture_preset
    from autoplan.spec import TrainingSpec
    from autoplan.topology import preset

    model, cluster, nodes, per_node, batch, seq, dtype = CASES[name]
    key = (model, seq)
    graphs = {} if graphs is None else graphs
    if key not in graphs:
        graphs[key] = capture_preset(model, batch=1, seq_len=seq, num_layers=CAPTURED_LAYERS)
    kwargs = {"devices_per_node": per_node} if per_node else {}
    topology = preset(cluster, num_nodes=nodes, **kwargs)
    return graphs[key], topology, TrainingSpec(global_batch=batch, seq_len=seq, dtype=dtype)


def plan_case(name: str, graphs: dict | None = None, **overrides):
    """The Plan of a case (with optional plan() overrides)."""
    from autoplan.solver import plan

    graph, topology, spec = setup(name, graphs)
    return plan(graph, topology, spec, **overrides)


def stable(plan_dict: dict) -> dict:
    """The Plan JSON without the cost model's figures ([Note: golden fields])."""
    out = {k: v for k, v in plan_dict.items() if k != "prediction"}
    out["redistributions"] = [{k: v for k, v in r.items() if k != "time_s"}
                              for r in plan_dict["redistributions"]]
    out["alternatives"] = [{k: v for k, v in a.items()
                            if k not in ("step_time_s", "memory_bytes", "reason")}
                           for a in plan_dict["alternatives"]]
    return out


def path_of(name: str) -> Path:
    return HERE / f"{name}.plan.json"


def render(plan) -> str:
    return json.dumps(stable(plan.to_dict()), indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown cases {unknown}; known: {list(CASES)}", file=sys.stderr)
        return 2
    graphs: dict = {}
    for name in names:
        plan = plan_case(name, graphs)
        path_of(name).write_text(render(plan))
        print(f"{path_of(name).relative_to(HERE.parent.parent)}: {plan}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
