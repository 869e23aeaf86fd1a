"""The `autoplan` command line: plan, export, dryrun, demo, calibrate.

    autoplan plan --model llama3-70b --cluster dgx-h100 --nodes 8 --global-batch 512 --seq 4096
    autoplan plan --model llama3-70b --cluster dgx-h100 --global-batch 64 --seq 4096 \\
        --trainable lora:r=16
    autoplan plan --model gpt2-tiny --cluster local-cpu --devices-per-node 4 \\
        --global-batch 8 --seq 16 -o out/tiny
    autoplan export --model gpt2-tiny --cluster local-cpu --global-batch 8 --seq 16 -o out/x
    autoplan demo --steps 20 --world-size 4 -o out/demo
    autoplan calibrate -o ~/.cache/autoplan/local-cpu.yaml

User mistakes (unknown preset, a bad topology file, overrides that cannot work, a model that
fits nowhere, an output path that cannot be written) print `autoplan: error: <message>` on
stderr and exit with status 2, leaving no output directory behind; warnings about the plan print
`autoplan: warning: <message>`. Progress lines (one per phase: capture, planning, writing) go
to stderr too (-q silences them, -v adds details), so that with `--json` stdout holds one JSON
object and nothing else. Heavy modules (torch, the solver) are imported inside the subcommands:
`autoplan --help` imports no torch.

`autoplan dryrun` of a plan that does not fit (a rank's live tensors above the device's
memory) or whose runtime cannot run on fake tensors fails as the cluster would, in one
`autoplan: error:` line naming the rank, the moment and the category, with status 1 and no
output written ([Note: dry run] in autoplan/runtime/dryrun.py).

`autoplan plan` answers a request it has planned before from the plan cache
($AUTOPLAN_CACHE_DIR, else ~/.cache/autoplan; [Note: plan cache] in autoplan/cache.py) without
importing torch, and its progress line says so; `--no-cache` plans anew.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autoplan import __version__
from autoplan.collector import collector_paused, no_collection_at_exit
from autoplan.progress import detail, note, phase, set_verbosity, verbosity

if TYPE_CHECKING:  # torch comes in with these: imported by the subcommands that need them
    from autoplan.graph import CapturedGraph
    from autoplan.plan import Plan
    from autoplan.topology import Topology

__all__ = ["main", "build_parser", "plan_for_dry_run"]

_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")  # autoplan.plan.SCHEDULES, kept import-free
_EPILOG = """\
examples:
  autoplan plan --model llama3-70b --cluster dgx-h100 --nodes 8 --global-batch 512 --seq 4096
  autoplan plan --model llama3-70b --cluster dgx-h100 --nodes 1 --global-batch 64 --seq 4096 \\
      --trainable lora:r=16
  autoplan plan --model gpt3-175b --cluster dgx-a100 --nodes 128 --global-batch 1536 \\
      --seq 2048 --tp 8 --pp 8 --dp 16 --microbatches 96 --schedule interleaved-1f1b \\
      -o out/gpt3
  autoplan plan --model gpt2-tiny --cluster local-cpu --devices-per-node 4 --global-batch 8 \\
      --seq 16 -o out/tiny
  autoplan export --model gpt2-tiny --cluster local-cpu --global-batch 8 --seq 16 -o out/export
"""


# the flag of each `plan()` keyword an error may name (InvalidConfig.option)
_FLAGS = {"allow_tp_across_nodes": "--allow-tp-across-nodes"}


class _Failure(Exception):
    """A subcommand could not run for a reason that is not the user's input (exit 1)."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {value}")
    return value


def _add_planning_args(p: argparse.ArgumentParser, *, capture_depth: bool,
                       trainable: bool = False) -> None:
    what = p.add_argument_group("model, cluster and training step")
    what.add_argument("--model", required=True, metavar="NAME|config.json",
                      help="model preset (e.g. llama3-70b, gpt2-tiny) or a Hugging Face "
                           "config.json of a gpt2/llama model")
    what.add_argument("--cluster", required=True, metavar="PRESET|topology.yaml",
                      help="cluster preset (dgx-a100, dgx-h100, h200-node, local-cpu) or a "
                           "topology YAML file (see examples/topology.yaml)")
    what.add_argument("--nodes", type=_positive_int, metavar="N",
                      help="number of nodes (default: the preset's 1, or the file's)")
    what.add_argument("--devices-per-node", type=_positive_int, metavar="N",
                      help="devices per node (default: the preset's or the file's)")
    what.add_argument("--global-batch", type=_positive_int, required=True, metavar="B",
                      help="samples per optimizer step, all ranks together")
    what.add_argument("--seq", type=_positive_int, required=True, metavar="S",
                      help="tokens per sample")
    what.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                      help="compute dtype; 16-bit means mixed precision with fp32 optimizer "
                           "states (default: %(default)s)")
    what.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"),
                      help="optimizer whose states are counted (default: %(default)s)")
    what.add_argument("--max-memory-fraction", type=_fraction, default=0.9, metavar="F",
                      help="fraction of device memory a plan may use (default: %(default)s)")
    if trainable:
        what.add_argument(
            "--trainable", default="full", metavar="SPEC|PATH",
            help="what trains: full (default: every parameter); lora:r=R[,alpha=A]"
                 "[,targets=M+M...]: LoRA adapters on a frozen base (alpha default 2 r, "
                 "targets default all-linear: every linear layer but the head), added to "
                 "the model with PEFT before capture; or the path of a PEFT LoRA "
                 "adapter_config.json or its directory. Planned as fine-tuning: gradients, "
                 "their reduction and optimizer states for the trainable parameters only; "
                 "the frozen base held in the compute dtype when the model's weights are "
                 "in it already (a bf16 checkpoint) or fp32 copies do not fit")
    fix = p.add_argument_group("overrides (fix a choice instead of searching it)")
    fix.add_argument("--tp", type=_positive_int, help="tensor-parallel degree")
    fix.add_argument("--pp", type=_positive_int, help="pipeline-parallel degree")
    fix.add_argument("--dp", type=_positive_int, help="data-parallel degree")
    fix.add_argument("--cp", type=_positive_int,
                     help="context-parallel degree: each sample's sequence split over cp ranks, "
                          "K/V all-gathered for attention (default: searched; the runtime "
                          "trains it with dp, tp, pp and ZeRO, eagerly)")
    fix.add_argument("--ep", type=_positive_int,
                     help="expert-parallel degree of a mixture-of-experts model (divides dp)")
    fix.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage")
    fix.add_argument("--microbatches", type=_positive_int, metavar="M",
                     help="microbatches per step per dp rank")
    fix.add_argument("--schedule", choices=_SCHEDULES, help="pipeline schedule")
    fix.add_argument("--virtual-stages", type=_positive_int, metavar="V",
                     help="model chunks per pp rank (interleaved-1f1b)")
    fix.add_argument("--checkpointing", choices=("none", "core-attention", "selective", "full"),
                     help="activation checkpointing of every block: core-attention recomputes "
                          "the unfused attention core (Megatron-LM's selective recompute), "
                          "selective keeps matmul and attention outputs, full keeps block inputs")
    fix.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                     help="Megatron-LM sequence parallelism: the norm, dropout and residual-add "
                          "regions split on the sequence dim across the tp group (reduce-scatter "
                          "/ all-gather instead of all-reduce); --no-sequence-parallel: those "
                          "regions replicated (plain tensor parallelism); "
                          "default: chosen per node by the solver")
    fix.add_argument("--offload", choices=("none", "optimizer", "optimizer+params"),
                     help="CPU offload: optimizer states in host memory and the optimizer "
                          "step on the host (ZeRO 0/1), or with ZeRO-3 the parameter shards "
                          "too; default: searched where nothing fits on the device")
    fix.add_argument("--allow-tp-across-nodes", action="store_true",
                     help="let tp groups span nodes (default: tp stays inside a node)")
    fix.add_argument("--compile", action="store_true",
                     help="price the stages as run through torch.compile, as "
                          "@autoparallel(compile=True) runs them: no DTensor host time per op, "
                          "pointwise chains fused (the plan says compiled)")
    solver = p.add_argument_group("planning")
    if capture_depth:
        # default: autoplan.capture.planning.PLANNING_BLOCKS (not imported: it imports torch)
        solver.add_argument("--num-layers-capture", type=_positive_int, default=2, metavar="K",
                            help="identical blocks to capture; costs are scaled to the real "
                                 "depth, so planning time does not grow with it "
                                 "(default: %(default)s, as @autoparallel captures a model)")
    solver.add_argument("--time-limit", type=float, default=10.0, metavar="SECONDS",
                        help="work limit of each ILP solve in CP-SAT's deterministic "
                             "seconds (about a second of one reference core; the same plan "
                             "at any machine load) (default: %(default)s)")
    solver.add_argument("--top-k", type=int, default=5, metavar="K",
                        help="runners-up kept for the report (default: %(default)s)")


def _add_json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print the plan's summary as one JSON object on stdout (mesh, ZeRO "
                        "stage, microbatches, schedule, checkpointing, predicted step time "
                        "in s, memory per device in bytes, MFU, tokens/s, runners-up, files "
                        "written, warnings) and nothing else; progress and warnings go to "
                        "stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoplan", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Automatic parallelism planner for PyTorch training: finds tensor, "
                    "pipeline and data parallelism, the ZeRO stage and microbatching for a "
                    "model on a cluster, predicts step time and memory, and writes reports.",
        epilog=_EPILOG)
    parser.add_argument("--version", action="version", version=f"autoplan {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # every subcommand: how much progress it shows on stderr
    talk = argparse.ArgumentParser(add_help=False)
    level = talk.add_argument_group("progress").add_mutually_exclusive_group()
    level.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=0,
                       help="print no progress lines on stderr (errors and warnings still)")
    level.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=2,
                       help="print progress lines and details on stderr")

    p = sub.add_parser("plan", parents=[talk],
                       help="plan a model on a cluster; print a summary, write reports",
                       description="Capture the model on the meta device (nothing is "
                                   "allocated), solve for the fastest plan that fits, print a "
                                   "summary; with -o write plan.json, report.md, report.html. "
                                   "The same request again is answered from the plan cache "
                                   "(--no-cache plans anew).")
    _add_planning_args(p, capture_depth=True, trainable=True)
    p.add_argument("-o", "--out", metavar="DIR",
                   help="write plan.json, report.md and report.html into DIR")
    p.add_argument("--no-cache", action="store_true",
                   help="plan anew even when the plan cache holds this request's plan "
                        "(the cache: $AUTOPLAN_CACHE_DIR, else ~/.cache/autoplan; a plan is "
                        "served only for the same model config, cluster, training step, "
                        "flags, autoplan source and library versions)")
    _add_json_arg(p)
    p.set_defaults(run=_cmd_plan)

    p = sub.add_parser("export", parents=[talk],
                       help="plan, then write the per-rank graphs as Python, Graphviz and JSON",
                       description="Plan as `autoplan plan` does (capturing the full depth, "
                                   "since every rank's graph is written), then write per-rank "
                                   "graph code and plan.json into DIR.")
    _add_planning_args(p, capture_depth=False)
    p.add_argument("-o", "--out", metavar="DIR", required=True, help="output directory")
    _add_json_arg(p)
    p.set_defaults(run=_cmd_export)

    p = sub.add_parser("dryrun", parents=[talk],
                       help="plan, then run one training step of chosen ranks on fake tensors "
                            "and a fake process group of the plan's size; measured vs planned",
                       description="Plan as `autoplan plan` does, then for each rank of "
                                   "--ranks build the real runtime of that rank in this "
                                   "process on torch's fake process group of the plan's world "
                                   "size and run whole training steps on fake tensors (nothing "
                                   "allocated): print its measured peak memory by category, "
                                   "collective bytes per mesh axis and FLOPs beside the plan's "
                                   "prediction ([Note: dry run] in autoplan/runtime/dryrun.py); "
                                   "with -o write the report with a Dry run section; with "
                                   "--export each rank's whole step (every op and collective, "
                                   "the pipeline actions) as Python, Graphviz and JSON "
                                   "([Note: whole-step export] in "
                                   "autoplan/runtime/step_export.py). A rank "
                                   "whose live tensors exceed the device's memory fails, as on "
                                   "the cluster, naming the moment and the category.")
    _add_planning_args(p, capture_depth=True)
    p.add_argument("--ranks", default="0", metavar="R,R,...",
                   help="global ranks to dry-run (default: %(default)s)")
    p.add_argument("--steps", type=_positive_int, default=2, metavar="N",
                   help="training steps per rank, the last measured (default: %(default)s: "
                        "the first creates the optimizer states)")
    p.add_argument("-o", "--out", metavar="DIR",
                   help="write plan.json (with the dry run), report.md and report.html (with "
                        "a Dry run section) into DIR")
    p.add_argument("--export", metavar="DIR",
                   help="write each rank's whole measured step into DIR: rankR_step.py (every "
                        "aten op and collective in order, local shapes, dtypes, moment; "
                        "collectives with mesh axis, dtype and bytes; the pipeline actions), "
                        ".dot, .json, and traffic.md (bytes and count per mesh axis and op)")
    _add_json_arg(p)
    p.set_defaults(run=_cmd_dryrun)

    p = sub.add_parser("demo", parents=[talk],
                       help="plan, compile and train a small GPT on local CPU ranks and "
                            "compare with one process")
    p.add_argument("--steps", type=_positive_int, metavar="N",
                   help="training steps (default: the demo's)")
    p.add_argument("--world-size", type=_positive_int, default=4, metavar="N",
                   help="local gloo ranks (default: %(default)s)")
    p.add_argument("-o", "--out", metavar="DIR", help="output directory (default: the demo's)")
    p.set_defaults(run=_cmd_demo)

    p = sub.add_parser("calibrate", parents=[talk],
                       help="measure this machine's CPU ranks and write a local-cpu topology "
                            "file")
    p.add_argument("-o", "--out", metavar="FILE",
                   help="topology YAML to write (default: ~/.cache/autoplan/local-cpu.yaml)")
    p.add_argument("--max-ranks", type=_positive_int, metavar="N",
                   help="largest number of ranks to measure")
    p.set_defaults(run=_cmd_calibrate)
    return parser


# --- planning ---------------------------------------------------------------------------------

def _topology(args):
    """The cluster of --cluster, with --nodes / --devices-per-node applied."""
    import dataclasses

    from autoplan.topology import PRESETS, load_topology, preset

    if args.cluster == "local-cpu" and args.devices_per_node:
        # the ranks share the machine's RAM: the preset divides it by its rank count
        topo = preset(args.cluster, num_nodes=args.nodes or 1,
                      devices_per_node=args.devices_per_node)
    elif args.cluster in PRESETS:
        topo = preset(args.cluster, num_nodes=args.nodes or 1)
    elif Path(args.cluster).is_file():
        topo = load_topology(args.cluster)
    elif args.cluster.endswith((".yaml", ".yml", ".json")):
        raise ValueError(f"topology file {args.cluster!r} not found")
    else:
        raise ValueError(f"unknown cluster {args.cluster!r}: not a preset "
                         f"({', '.join(sorted(PRESETS))}) and not a topology YAML file")
    if args.nodes:
        topo = topo.with_nodes(args.nodes)
    if args.devices_per_node:
        topo = dataclasses.replace(topo, devices_per_node=args.devices_per_node)
    return topo


@dataclass(frozen=True)
class _Planned:
    """What `_plan` made: the captured graph, the cluster, the plan and the solver's warnings
    (messages, already printed on stderr)."""

    graph: CapturedGraph
    topology: Topology
    plan: Plan
    warnings: tuple[str, ...] = ()


def _depth(config: dict) -> int:
    """Repeated blocks of an HF config (llama's num_hidden_layers, gpt2's n_layer)."""
    return int(config.get("num_hidden_layers") or config.get("n_layer") or 0)


def _plan(args, num_layers: int | None) -> _Planned:
    """Capture and plan for the planning arguments. The graph is the one `@autoparallel`
    plans on for the same model ([Note: shallow planning capture] in
    autoplan/capture/planning.py): parameters in the compute dtype (a 16-bit graph has the
    model's own upcasts as nodes, [Note: precision recipe]), the global batch at the planned
    sequence length (the cost model scales it to each microbatch, solver/costs.py
    token_scale; attention is exact at the planned length), `num_layers` blocks scaled to the
    real depth. Warnings of the solver print as `autoplan: warning: ...` on stderr."""
    import torch

    from autoplan.capture import capture_preset
    from autoplan.models import model_config
    from autoplan.models.trainable import Trainable
    from autoplan.solver import plan
    from autoplan.solver.search import ReplicatedWeightsWarning
    from autoplan.spec import TrainingSpec

    config = model_config(args.model)  # an unknown preset fails here, before the cluster
    topology = _topology(args)
    spec = TrainingSpec(global_batch=args.global_batch, seq_len=args.seq, dtype=args.dtype,
                        optimizer=args.optimizer, max_memory_fraction=args.max_memory_fraction)
    trainable = Trainable.parse(getattr(args, "trainable", "full"))
    depth = (f" ({num_layers} blocks; costs scaled to the full depth)"
             if num_layers and num_layers < _depth(config) else "")
    adapters = "" if trainable.kind == "full" else f" with {trainable.describe()}"
    with phase(f"capturing {args.model}{adapters}{depth}"):
        graph = capture_preset(args.model, batch=args.global_batch, seq_len=args.seq,
                               num_layers=num_layers, dtype=getattr(torch, args.dtype),
                               trainable=None if trainable.kind == "full" else trainable)
    with phase(f"planning {args.model} for {topology.world_size} x {topology.device.name}"), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ReplicatedWeightsWarning)  # each run says its own
        result = plan(graph, topology, spec, tp=args.tp, pp=args.pp, dp=args.dp, ep=args.ep,
                      zero_stage=args.zero, num_microbatches=args.microbatches,
                      schedule=args.schedule, num_virtual_stages=args.virtual_stages,
                      checkpointing=args.checkpointing, sequence_parallel=args.sequence_parallel,
                      cp=args.cp,
                      allow_tp_across_nodes=args.allow_tp_across_nodes,
                      time_limit_s=args.time_limit, top_k=args.top_k, offload=args.offload,
                      compiled=args.compile, frozen_weights_dtype=_weights_dtype(config))
    said = []
    for w in caught:
        if issubclass(w.category, ReplicatedWeightsWarning):  # about the plan: for the user
            said.append(str(w.message))
            print(f"autoplan: warning: {w.message}", file=sys.stderr)
        else:  # a library's: shown as Python shows it
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return _Planned(graph, topology, result, tuple(said))


def _weights_dtype(config: dict) -> str | None:
    """The dtype of the model's weights as its checkpoint holds them, when its config says:
    an HF config.json's `torch_dtype` (`dtype` in newer ones), a preset's `_weights_dtype`
    note (the published checkpoint's); None when not known ([Note: frozen dtype] in
    autoplan/solver/frozen.py)."""
    return config.get("torch_dtype") or config.get("dtype") or config.get("_weights_dtype")


def _summary(planned: _Planned, files) -> dict:
    """The JSON summary of `--json`: the plan's configuration, its prediction (seconds, bytes,
    tokens/s, MFU as a fraction), runners-up, the files written and the warnings."""
    import dataclasses

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


def _print_json(summary: dict) -> None:
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


def _cmd_plan(args) -> int:
    """Plan, or read the plan from the cache ([Note: plan cache] in autoplan/cache.py), then
    print the summary and write the files. A plan made here is stored with its report files
    rendered, so that a later `-o` is served from the cache too. The cyclic garbage collector
    is paused throughout, the imports of torch and transformers included ([Note: collector
    paused] in autoplan/collector.py): about 15 % of a cold run otherwise; and the process's
    exit skips one of its full collections (0.5 s of CPU after a cold plan)."""
    no_collection_at_exit()
    with collector_paused():
        return _plan_or_read(args)


def _plan_or_read(args) -> int:
    from autoplan.report.write import write_files

    cache, request = _cache_request(args)
    entry = cache.get(request) if cache is not None else None
    planned = None
    if entry is not None:
        note(f"plan of {args.model} for {entry['world_size']} x {entry['device']} read from "
             f"the plan cache ({cache.path(request)}); --no-cache plans anew")
        for message in entry["warnings"]:
            print(f"autoplan: warning: {message}", file=sys.stderr)
    else:
        planned = _plan(args, args.num_layers_capture)
        entry = _entry(planned)
    if not args.json:
        print(entry["summary_text"])
    paths = {}
    if args.out:
        with phase(f"writing the report into {args.out}"):
            if planned is not None:
                entry["files"] = _render(planned)
            paths = write_files(entry["files"], args.out)
    if planned is not None and cache is not None:
        if "files" not in entry:  # no -o this time: rendered for a later one
            entry["files"] = _render(planned)
        _store(cache, request, entry)
    if args.json:
        _print_json(_with_files(entry["summary"], paths.values()))
    elif paths:
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _entry(planned: _Planned) -> dict:
    """What the plan cache stores of a plan (all but the report files): the summary as text
    and as `--json` prints it (without the files written), the warnings, the cluster's size."""
    from autoplan.report import render_summary

    summary = _summary(planned, ())
    del summary["files"]
    return {"summary_text": render_summary(planned.plan, topology=planned.topology,
                                           graph=planned.graph),
            "summary": summary, "warnings": list(planned.warnings),
            "world_size": planned.topology.world_size, "device": planned.topology.device.name}


def _with_files(summary: dict, files) -> dict:
    """The cached summary with this run's files, where `_summary` puts them (before the
    warnings)."""
    out = {k: v for k, v in summary.items() if k != "warnings"}
    out["files"] = [str(p) for p in files]
    out["warnings"] = summary["warnings"]
    return out


def _render(planned: _Planned) -> dict[str, str]:
    from autoplan.report import render_report

    return render_report(planned.plan, graph=planned.graph, topology=planned.topology)


def _cache_request(args):
    """(PlanCache, request) for `autoplan plan`, or (None, None) with --no-cache. The request
    holds everything the plan, its summary and its reports depend on besides the code and the
    libraries, which autoplan.cache adds: the model config's content, the topology as resolved
    (a calibration or YAML file read), the training spec and every planning flag. Raises
    ValueError for an unknown model or cluster (before any work, as planning would)."""
    if args.no_cache:
        return None, None
    import dataclasses

    from autoplan.cache import PlanCache
    from autoplan.models import model_config
    from autoplan.models.trainable import Trainable
    from autoplan.spec import TrainingSpec

    # in `_plan`'s order, so that the first mistake is the one named: model, cluster, spec,
    # what trains
    config, topology = model_config(args.model), _topology(args)
    spec = TrainingSpec(global_batch=args.global_batch, seq_len=args.seq, dtype=args.dtype,
                        optimizer=args.optimizer, max_memory_fraction=args.max_memory_fraction)
    trainable = Trainable.parse(args.trainable)
    request = {
        "command": "plan", "model": args.model, "model_config": config,
        "topology": topology.to_dict(), "spec": dataclasses.asdict(spec),
        "flags": {name: getattr(args, name) for name in _PLAN_FLAGS},
    }
    if trainable.kind != "full":  # a full-training request keeps its key
        request["trainable"] = trainable.to_dict()
    return PlanCache(), request


# the `plan` flags a plan depends on besides the model, cluster and training spec
_PLAN_FLAGS = ("tp", "pp", "dp", "cp", "ep", "zero", "microbatches", "schedule", "virtual_stages",
               "checkpointing", "sequence_parallel", "allow_tp_across_nodes", "offload",
               "compile",
               "num_layers_capture", "time_limit", "top_k")


def _store(cache, request: dict, entry: dict) -> None:
    """Store an entry; a cache that cannot be written costs the next run a plan, not this one
    its answer (the reason is a detail line, -v)."""
    try:
        cache.put(request, entry)
    except OSError as e:
        detail(f"plan cache not written ({cache.directory}): {e}")


def _cmd_export(args) -> int:
    from autoplan.report import render_summary

    no_collection_at_exit()  # [Note: collector paused] in autoplan/collector.py
    planned = _plan(args, None)  # every rank's graph: the full depth
    try:
        import autoplan.passes.export  # noqa: F401 - an installation without it fails here
    except ImportError as e:
        raise _Failure(f"export is not available in this installation: {e}") from None
    out = Path(args.out)
    existed = out.exists()
    graph, mb, cp = planned.graph, planned.plan.microbatch_size, planned.plan.mesh.cp
    if mb != args.global_batch or cp > 1:  # what a rank runs: a microbatch of seq / cp tokens
        import torch

        from autoplan.capture import capture_preset

        tokens = f", {args.seq // cp} tokens per cp rank" if cp > 1 else ""
        with phase(f"capturing {args.model} at microbatch {mb}{tokens}"):
            graph = capture_preset(args.model, batch=mb, seq_len=args.seq // cp,
                                   dtype=getattr(torch, args.dtype))
    try:
        with phase(f"exporting the per-rank graphs into {out}"):
            paths = _export(graph, planned.plan, out, planned.graph)
    except BaseException:
        if not existed:
            shutil.rmtree(out, ignore_errors=True)  # no partial output directory
        raise
    if args.json:
        _print_json(_summary(planned, paths.values()))
        return 0
    print(render_summary(planned.plan, topology=planned.topology, graph=planned.graph))
    print(f"wrote {len(paths)} files into {out}")
    return 0


def plan_for_dry_run(args) -> tuple[_Planned, CapturedGraph]:
    """Plan for the `autoplan dryrun` arguments `args` (`build_parser().parse_args(["dryrun",
    ...])`) as `autoplan plan` does, then capture the graph a rank runs: the whole model at
    the plan's microbatch, seq_len / cp tokens per sample, in the compute dtype. Returns
    (planned, graph) for `dry_run(graph, planned.plan, ranks, planned_graph=planned.graph)`;
    bench/dryrun.py calls it too. Raises ValueError as `_plan` does."""
    import torch

    from autoplan.capture import capture_preset

    planned = _plan(args, args.num_layers_capture)
    mb, cp = planned.plan.microbatch_size, planned.plan.mesh.cp
    with phase(f"capturing {args.model} at microbatch {mb}, {args.seq // cp} tokens per sample"):
        graph = capture_preset(args.model, batch=mb, seq_len=args.seq // cp,
                               dtype=getattr(torch, args.dtype))
    return planned, graph


def _cmd_dryrun(args) -> int:
    """Plan, dry-run the ranks of --ranks against the device's memory, print each rank's
    measured beside planned (or --json), with -o write the report of the plan with its
    dry run (`Plan.dry_run`), with --export each rank's whole step ([Note: whole-step
    export] in autoplan/runtime/step_export.py). Nothing is written when a rank fails
    (DryRunOutOfMemory)."""
    import dataclasses

    from autoplan.report.measured import relative_error
    from autoplan.runtime.dryrun import DryRunError, dry_run

    try:
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        raise ValueError(f"--ranks {args.ranks!r}: give global ranks separated by commas, "
                         "e.g. 0,7") from None
    planned, graph = plan_for_dry_run(args)
    plan = planned.plan
    with phase(f"dry-running rank(s) {ranks} of {plan.mesh} ({plan.mesh.world_size} ranks)"):
        try:
            rows = dry_run(graph, plan, ranks, planned_graph=planned.graph, steps=args.steps,
                           device_mem_bytes=planned.topology.device.mem_bytes,
                           record_ops=bool(args.export))
        except DryRunError as e:  # out of memory, or a value read: as the cluster would fail
            raise _Failure(str(e)) from None
    paths, exported = {}, {}
    if args.export:
        from autoplan.runtime.step_export import step_files, write_step_files

        with phase(f"writing each rank's whole step into {args.export}"):
            exported = write_step_files(step_files(rows, plan), args.export)
    if args.out:
        from autoplan.report import render_report
        from autoplan.report.write import write_files

        with phase(f"writing the report into {args.out}"):
            paths = write_files(render_report(
                dataclasses.replace(plan, dry_run=tuple(r.record() for r in rows)),
                graph=planned.graph, topology=planned.topology), args.out)
    if args.json:
        _print_json({"plan": str(plan), "ranks": [_dry_row(r) for r in rows],
                     **({"files": [str(p) for p in [*exported.values(), *paths.values()]]}
                        if paths or exported else {})})
        return 0
    from autoplan.units import fmt_bytes, fmt_flops, fmt_time

    print(str(plan))
    for r in rows:
        error = relative_error(r.predicted_peak_bytes, r.peak_bytes)
        error = float("nan") if error is None else error
        print(f"rank {r.rank} {r.coordinates}: peak {fmt_bytes(r.peak_bytes)} measured, "
              f"{fmt_bytes(r.predicted_peak_bytes)} planned ({error:+.1%}); build "
              f"{fmt_time(r.build_s)}, step {fmt_time(r.step_s)}")
        for c in sorted(set(r.peak_by_category) | set(r.predicted_by_category)):
            print(f"  {c:13s} {fmt_bytes(r.peak_by_category.get(c, 0)):>10s} measured "
                  f"{fmt_bytes(r.predicted_by_category.get(c, 0)):>10s} planned")
        axes = ", ".join(f"{a} {fmt_bytes(b)}" for a, b in sorted(r.bytes_by_axis.items()))
        print(f"  collective bytes by axis: {axes or 'none'}")
        print(f"  FLOPs {fmt_flops(r.flops)} measured (recomputation included), "
              f"{fmt_flops(r.predicted_flops)} planned per rank (without)")
    if exported:
        print(f"wrote each rank's whole step ({len(exported)} files) into {args.export}")
    if paths:
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _dry_row(r) -> dict:
    """A rank's row of `autoplan dryrun --json`: what the plan records of it (`record`), with
    the build and step seconds."""
    import dataclasses

    return {**dataclasses.asdict(r.record()), "build_s": r.build_s, "step_s": r.step_s}


def _export(graph, plan, out: Path, planned) -> dict:
    """export_plan here, or in a forked child when this process already has a process group
    (`main` called from a training job): export traces on a fake group of its own.
    `planned`: the graph the plan was made on (the whole sequence; cp's position check)."""
    import torch.distributed as dist

    from autoplan.passes.export import export_plan

    if not dist.is_initialized():
        return export_plan(graph, plan, out, planned=planned)
    from autoplan.runtime.job import run_isolated

    return run_isolated(export_plan, graph, plan, out, True, planned)


def _optional(module: str, command: str):
    import importlib

    try:
        return importlib.import_module(module).main
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise _Failure(f"`autoplan {command}` is not available in this installation "
                       f"({module} is missing)") from None


def _given(**kwargs) -> dict:
    return {k: v for k, v in kwargs.items() if v is not None}


def _cmd_demo(args) -> int:
    run = _optional("autoplan.demo", "demo")
    return run(**_given(steps=args.steps, world_size=args.world_size, out_dir=args.out)) or 0


def _cmd_calibrate(args) -> int:
    run = _optional("autoplan.calibrate", "calibrate")
    return run(**_given(out_path=args.out, max_ranks=args.max_ranks)) or 0


def _check_out(out: str | None, command: str, flag: str = "-o") -> None:
    """Refuse an output path that cannot be written, before any work: for `calibrate` a file
    (its directory may be missing), for the others a directory. The nearest existing
    directory on the path must let this process create entries (os.access, then a probe that
    creates and removes a directory there: access() says yes to root even where nothing can be
    created, as in /proc). Raises ValueError naming `flag` and the path at fault."""
    if not out:
        return
    path = Path(out).expanduser().absolute()
    if command == "calibrate" and path.is_dir():
        raise ValueError(f"{flag} {out}: is a directory; calibrate writes a topology YAML file")
    # what must be directories: the parents, and the path itself except for calibrate's file
    dirs = [*path.parents] if command == "calibrate" else [path, *path.parents]
    blocked = next((p for p in dirs if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ValueError(f"{flag} {out}: {blocked} is a file, not a directory")
    anchor = next(p for p in dirs if p.exists())  # the root at the latest
    reason = None
    if not os.access(anchor, os.W_OK | os.X_OK):
        reason = "permission denied"
    else:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".autoplan-probe-", dir=anchor))
        except OSError as e:
            reason = e.strerror or str(e)
    if reason is not None:
        what = "" if anchor == path else f"{path.relative_to(anchor)} "
        raise ValueError(f"{flag} {out}: cannot create {what}in {anchor}: {reason}")


def _in_cli_words(e: Exception) -> str:
    """The message of `e`, naming the command-line flag where the solver names a keyword
    argument of `plan()` (InvalidConfig.option)."""
    import re

    option = getattr(e, "option", None)
    if option in _FLAGS:
        return f"{e.reason}; pass {_FLAGS[option]} to allow it"
    return re.sub(r"\b(" + "|".join(_TERMS) + r")\b", lambda m: _TERMS[m.group(1)], str(e))


# plan()'s keyword names as the flags that set them, where a message names one
_TERMS = {"zero_stage": "--zero", "num_microbatches": "--microbatches",
          "num_virtual_stages": "--virtual-stages", "global_batch": "--global-batch",
          "seq_len": "--seq", "allow_tp_across_nodes": "--allow-tp-across-nodes"}


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 failure, 2 user error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version (0) or a usage error (2), printed by argparse
        return e.code if isinstance(e.code, int) else 2
    before = verbosity()
    if args.verbosity is not None:
        set_verbosity(args.verbosity)
    try:
        _check_out(getattr(args, "out", None), args.command)
        _check_out(getattr(args, "export", None), args.command, flag="--export")
        return int(args.run(args))
    except ValueError as e:  # user mistakes from every layer: NoFeasiblePlan, InvalidConfig, ...
        print(f"autoplan: error: {_in_cli_words(e)}", file=sys.stderr)
        return 2
    except _Failure as e:
        print(f"autoplan: error: {e}", file=sys.stderr)
        return 1

    except BrokenPipeError:  # `autoplan plan --json | head`: the reader left; say nothing
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:
        print(f"autoplan: error: {e}", file=sys.stderr)
        return 1
    finally:
        if args.verbosity is not None:
            set_verbosity(before)  # main() may run again in this process (tests)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
