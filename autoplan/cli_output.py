"""What the `autoplan` commands print and keep (autoplan/cli.py): the plan a command made
(`Planned`), the JSON summary of `--json` with floats rounded, a rank's row of `autoplan dryrun
--json`, the rendered report files, and the plan cache's request and entry for `autoplan plan`.
Imports no torch at import time.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autoplan.cli_args import cluster_topology
from autoplan.options import SearchOptions
from autoplan.progress import detail

if TYPE_CHECKING:  # torch comes in with these
    from autoplan.graph import CapturedGraph
    from autoplan.plan import Plan
    from autoplan.topology import Topology

__all__ = ["Planned", "json_summary", "print_json", "dry_row", "render", "cache_request",
           "PLAN_FLAGS", "cache_entry", "with_files", "store"]


@dataclass(frozen=True)
class Planned:
    """What `_plan` made: the captured graph, the cluster, the plan and the solver's warnings
    (messages, already printed on stderr)."""

    graph: CapturedGraph
    topology: Topology
    plan: Plan
    warnings: tuple[str, ...] = ()


def json_summary(planned: Planned, files) -> dict:
    """The JSON summary of `--json`: the plan's configuration, its prediction (seconds, bytes,
    tokens/s, MFU as a fraction), runners-up, the files written and the warnings."""
    from autoplan.report.facts import tokens_per_s

    plan, topology = planned.plan, planned.topology
    as_json = plan.to_dict()  # meshes as plan.json writes them (no `ep` at 1)
    prediction = dataclasses.asdict(plan.prediction)
    prediction["tokens_per_s"] = tokens_per_s(plan)
    return {
        "model": plan.model, "topology": plan.topology, "device": topology.device.name,
        "device_mem_bytes": topology.device.mem_bytes, "world_size": plan.mesh.world_size,
        "mesh": as_json["mesh"], "zero_stage": plan.zero_stage,
        "global_batch": plan.global_batch, "seq_len": plan.seq_len,
        "num_microbatches": plan.num_microbatches, "microbatch_size": plan.microbatch_size,
        "schedule": plan.schedule, "num_virtual_stages": plan.num_virtual_stages,
        "checkpointing": plan.checkpointing, "dtype": plan.dtype, "offload": plan.offload,
        **({"frozen_dtype": plan.frozen_dtype} if plan.frozen_dtype else {}),
        **({"pinned": as_json["pinned"]} if plan.pinned else {}),
        **({"stage_blocks": [st.num_layers for st in plan.stages], "pinned_stages": True}
           if plan.pinned_stages else {}),
        **_trainable_counts(planned.graph),
        "prediction": prediction,
        "alternatives": as_json["alternatives"],
        "files": [str(p) for p in files],
        "warnings": list(planned.warnings),
    }


def _trainable_counts(graph: CapturedGraph) -> dict:
    """{"num_params", "num_trainable_params"} of a model with frozen parameters (real depth),
    {} when every parameter trains (the summary as before)."""
    from autoplan.graph import CapturedGraph
    from autoplan.report.facts import model_num_params
    from autoplan.solver.frozen import has_frozen

    if not isinstance(graph, CapturedGraph) or not has_frozen(graph):
        return {}
    return {"num_params": model_num_params(graph),
            "num_trainable_params": model_num_params(graph, trainable_only=True)}


def print_json(summary: dict) -> None:
    print(json.dumps(_rounded(summary), indent=1))


def _rounded(value):
    """Floats at 6 significant digits (0.0062653728, not 0.006265372799999999): predictions
    carry no more, and the float residue of a sum is noise."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def cache_entry(planned: Planned) -> dict:
    """What the plan cache stores of a plan (all but the report files): the summary as text
    and as `--json` prints it (without the files written), the warnings, the cluster's size."""
    from autoplan.report import render_summary

    summary = json_summary(planned, ())
    del summary["files"]
    return {"summary_text": render_summary(planned.plan, topology=planned.topology,
                                           graph=planned.graph),
            "summary": summary, "warnings": list(planned.warnings),
            "world_size": planned.topology.world_size, "device": planned.topology.device.name}


def with_files(summary: dict, files) -> dict:
    """The cached summary with this run's files, where `json_summary` puts them (before the
    warnings)."""
    out = {k: v for k, v in summary.items() if k != "warnings"}
    out["files"] = [str(p) for p in files]
    out["warnings"] = summary["warnings"]
    return out


def render(planned: Planned) -> dict[str, str]:
    from autoplan.report import render_report

    return render_report(planned.plan, graph=planned.graph, topology=planned.topology)


def dry_row(r) -> dict:
    """A rank's row of `autoplan dryrun --json`: what the plan records of it (`record`), with
    the build and step seconds and what is live at the peak by op (`peak_by_op`: {category:
    [[op, bytes, tensors], ...]})."""
    return {**dataclasses.asdict(r.record()), "build_s": r.build_s, "step_s": r.step_s,
            "peak_by_op": {c: [list(x) for x in ops] for c, ops in r.peak_by_op.items()}}


def cache_request(args):
    """(PlanCache, request) for `autoplan plan`, or (None, None) with --no-cache. The request
    holds everything the plan, its summary and its reports depend on besides the code and the
    libraries, which autoplan.cache adds: the model config's content, the topology as resolved
    (a calibration or YAML file read), the training spec and every planning flag. Raises
    ValueError for an unknown model or cluster (before any work, as planning would)."""
    if args.no_cache:
        return None, None
    from autoplan.cache import PlanCache
    from autoplan.models import model_config
    from autoplan.models.trainable import Trainable
    from autoplan.spec import TrainingSpec

    # in `_plan`'s order, so that the first mistake is the one named: model, cluster, spec,
    # what trains
    config, topology = model_config(args.model), cluster_topology(args)
    spec = TrainingSpec(global_batch=args.global_batch, seq_len=args.seq, dtype=args.dtype,
                        optimizer=args.optimizer, max_memory_fraction=args.max_memory_fraction)
    trainable = Trainable.parse(args.trainable)
    request = {
        "command": "plan", "model": args.model, "model_config": config,
        "topology": topology.to_dict(), "spec": dataclasses.asdict(spec),
        "flags": {name: getattr(args, name) for name in PLAN_FLAGS},
    }
    if trainable.kind != "full":  # a full-training request keeps its key
        request["trainable"] = trainable.to_dict()
    return PlanCache(), request


# the `plan` flags a plan depends on besides the model, cluster and training spec (dests):
# the planner's options (SearchOptions), --compile and --num-layers-capture
PLAN_FLAGS = (*(f.name for f in dataclasses.fields(SearchOptions)), "compile",
              "num_layers_capture")


def store(cache, request: dict, entry: dict) -> None:
    """Store an entry; a cache that cannot be written costs the next run a plan, not this one
    its answer (the reason is a detail line, -v)."""
    try:
        cache.put(request, entry)
    except OSError as e:
        detail(f"plan cache not written ({cache.directory}): {e}")
