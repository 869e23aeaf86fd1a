"""The arguments of the `autoplan` command (autoplan/cli.py builds each subcommand's parser
from these): the planning arguments the planning subcommands share, `--json`, the cluster they
name, the check of an output path before any work, and a message in the flags' words. Imports
no torch (`autoplan --help` imports none).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

from autoplan.options import SearchOptions, add_search_args, option_flag

__all__ = ["EPILOG", "positive_int", "fraction", "add_planning_args",
           "add_json_arg", "cluster_topology", "check_out", "in_cli_words"]

EPILOG = """\
examples:
  autoplan plan --model llama3-70b --cluster dgx-h100 --nodes 8 --global-batch 512 --seq 4096
  autoplan plan --model llama3-70b --cluster dgx-h100 --nodes 1 --global-batch 64 --seq 4096 \\
      --trainable lora:r=16
  autoplan plan --model gpt3-175b --cluster dgx-a100 --nodes 128 --global-batch 1536 \\
      --seq 2048 --tp 8 --pp 8 --dp 16 --num-microbatches 96 --schedule interleaved-1f1b \\
      -o out/gpt3
  autoplan plan --model gpt2-tiny --cluster local-cpu --devices-per-node 4 --global-batch 8 \\
      --seq 16 -o out/tiny
  autoplan explain --model llama3-70b --cluster dgx-h100 --nodes 8 --global-batch 512 \\
      --seq 4096 --tp 8 --pp 4
  autoplan diff out/gpt3/plan.json out/tiny/plan.json
  autoplan export --model gpt2-tiny --cluster local-cpu --global-batch 8 --seq 16 -o out/export

environment:
  AUTOPLAN_VERBOSITY=0|1|2      progress lines on stderr, as -q / default / -v
  AUTOPLAN_CACHE_DIR=DIR        the plan and capture caches (default ~/.cache/autoplan)
  AUTOPLAN_PLAN_CACHE=0         plan anew instead of reading the plan cache (@autoparallel)
  AUTOPLAN_CAPTURE_CACHE=0      capture anew instead of reading the capture cache
  AUTOPLAN_CAPTURE_CACHE_DIR=DIR  the capture cache alone (default AUTOPLAN_CACHE_DIR/captures)
  AUTOPLAN_CALIBRATION=FILE     the local-cpu topology `autoplan calibrate` wrote
  AUTOPLAN_COLLECTIVE_TIMEOUT_S=S  seconds a rank waits in a collective before failing
"""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _stage_blocks(text: str) -> tuple[int, ...]:
    """--stages: "3,5,5,3" -> (3, 5, 5, 3), each >= 1."""
    return tuple(positive_int(part) for part in text.split(","))


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {value}")
    return value


def add_planning_args(p: argparse.ArgumentParser, *, capture_depth: bool,
                       trainable: bool = False) -> None:
    what = p.add_argument_group("model, cluster and training step")
    from autoplan.models import CAUSAL_LM_TYPES, PRESETS  # config files only: no torch

    what.add_argument("--model", required=True, metavar="NAME|config.json",
                      help=f"model preset ({', '.join(PRESETS)}) or a Hugging Face "
                           f"config.json of a causal LM (model_type "
                           f"{', '.join(CAUSAL_LM_TYPES)})")
    what.add_argument("--cluster", required=True, metavar="PRESET|topology.yaml",
                      help="cluster preset (dgx-a100, dgx-h100, h200-node, local-cpu) or a "
                           "topology YAML file (see examples/topology.yaml)")
    what.add_argument("--nodes", type=positive_int, metavar="N",
                      help="number of nodes (default: the preset's 1, or the file's)")
    what.add_argument("--devices-per-node", type=positive_int, metavar="N",
                      help="devices per node (default: the preset's or the file's)")
    what.add_argument("--global-batch", type=positive_int, required=True, metavar="B",
                      help="samples per optimizer step, all ranks together")
    what.add_argument("--seq", type=positive_int, required=True, metavar="S",
                      help="tokens per sample")
    what.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                      help="compute dtype; 16-bit means mixed precision with fp32 optimizer "
                           "states (default: %(default)s)")
    what.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"),
                      help="optimizer whose states are counted (default: %(default)s)")
    what.add_argument("--max-memory-fraction", type=fraction, default=0.9, metavar="F",
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
    # the planner's options: autoplan/options.py `SearchOptions`, one flag per field
    fix = p.add_argument_group("overrides (fix a choice instead of searching it)")
    add_search_args(fix, "overrides", positive_int, _stage_blocks)
    fix.add_argument("--compile", action="store_true",
                     help="price the stages as run through torch.compile, as "
                          "@autoparallel(compile=True) runs them: no DTensor host time per op, "
                          "pointwise chains fused (the plan says compiled)")
    solver = p.add_argument_group("planning")
    if capture_depth:
        # default: autoplan.capture.planning.PLANNING_BLOCKS (not imported: it imports torch)
        solver.add_argument("--num-layers-capture", type=positive_int, default=2, metavar="K",
                            help="identical blocks to capture; costs are scaled to the real "
                                 "depth, so planning time does not grow with it "
                                 "(default: %(default)s, as @autoparallel captures a model)")
    add_search_args(solver, "planning", positive_int, _stage_blocks)


def add_json_arg(p: argparse.ArgumentParser, what: str | None = None) -> None:
    """--json: print `what` (default: the plan's summary) as one JSON object on stdout."""
    what = what or ("the plan's summary (mesh, ZeRO stage, microbatches, schedule, "
                    "checkpointing, predicted step time in s, memory per device in bytes, MFU, "
                    "tokens/s, runners-up, files written, warnings)")
    p.add_argument("--json", action="store_true",
                   help=f"print {what} as one JSON object on stdout and nothing else; "
                        "progress and warnings go to stderr")


_SAID: set[str] = set()  # topology warnings printed by this process (each once)


def cluster_topology(args):
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
        import warnings

        from autoplan.topology import TopologyWarning

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", TopologyWarning)
            topo = load_topology(args.cluster)
        for w in caught:  # the file's implausible values, as the CLI says warnings, once
            if issubclass(w.category, TopologyWarning):
                if str(w.message) not in _SAID:
                    _SAID.add(str(w.message))
                    print(f"autoplan: warning: {w.message}", file=sys.stderr)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
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


def check_out(out: str | None, command: str, flag: str = "-o") -> None:
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


def in_cli_words(e: Exception) -> str:
    """The message of `e`, naming the command-line flag where the solver names a keyword
    argument of `plan()` (InvalidConfig.option)."""
    import re

    option = getattr(e, "option", None)
    if option in _FLAGS:
        return f"{e.reason}; pass {_FLAGS[option]} to allow it"
    return re.sub(r"\b(" + "|".join(_TERMS) + r")\b", lambda m: _TERMS[m.group(1)], str(e))


# the flag of each `plan()` keyword an error may name (InvalidConfig.option)
_FLAGS = {"allow_tp_across_nodes": option_flag("allow_tp_across_nodes")}


# plan()'s keyword names as the flags that set them, where a message names one: the
# options of more than one word, and the training step's
_TERMS = {**{f.name: option_flag(f.name) for f in dataclasses.fields(SearchOptions)
             if "_" in f.name},
          "global_batch": "--global-batch", "seq_len": "--seq"}
