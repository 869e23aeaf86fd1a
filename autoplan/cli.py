"""The `autoplan` command line: plan, explain, diff, export, dryrun, demo, calibrate.

    autoplan plan --model llama3-70b --cluster dgx-h100 --nodes 8 --global-batch 512 --seq 4096
    autoplan plan --model llama3-70b --cluster dgx-h100 --global-batch 64 --seq 4096 \\
        --trainable lora:r=16
    autoplan plan --model gpt2-tiny --cluster local-cpu --devices-per-node 4 \\
        --global-batch 8 --seq 16 -o out/tiny
    autoplan explain --model llama3-70b --cluster dgx-h100 --nodes 8 --global-batch 512 \\
        --seq 4096 --tp 4 --pp 8
    autoplan diff out/a/plan.json out/b/plan.json
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
import shutil
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from autoplan import __version__, cli_compare
from autoplan.cli_args import (EPILOG, add_json_arg, add_planning_args, check_out,
                               cluster_topology, in_cli_words, positive_int)
from autoplan.cli_output import (Planned, cache_entry, cache_request, dry_row, json_summary,
                                 print_json, render, store, with_files)
from autoplan.collector import (collector_paused, exit_now, exit_without_teardown,
                                no_collection_at_exit)
from autoplan.progress import note, phase, set_verbosity, verbosity

if TYPE_CHECKING:  # torch comes in with this: imported by the subcommands that need it
    from autoplan.graph import CapturedGraph

__all__ = ["main", "build_parser", "plan_for_dry_run"]


class _Failure(Exception):
    """A subcommand could not run for a reason that is not the user's input (exit 1)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoplan", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Automatic parallelism planner for PyTorch training: finds tensor, "
                    "pipeline and data parallelism, the ZeRO stage and microbatching for a "
                    "model on a cluster, predicts step time and memory, and writes reports.",
        epilog=EPILOG)
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
    add_planning_args(p, capture_depth=True, trainable=True)
    p.add_argument("-o", "--out", metavar="DIR",
                   help="write plan.json, report.md and report.html into DIR")
    p.add_argument("--no-cache", action="store_true",
                   help="plan anew even when the plan cache holds this request's plan "
                        "(the cache: $AUTOPLAN_CACHE_DIR, else ~/.cache/autoplan; a plan is "
                        "served only for the same model config, cluster, training step, "
                        "flags, autoplan source and library versions)")
    add_json_arg(p)
    p.set_defaults(run=_cmd_plan)

    cli_compare.add_parsers(sub, talk, _plan)

    p = sub.add_parser("export", parents=[talk],
                       help="plan, then write the per-rank graphs as Python, Graphviz and JSON",
                       description="Plan as `autoplan plan` does (capturing the full depth, "
                                   "since every rank's graph is written), then write per-rank "
                                   "graph code and plan.json into DIR.")
    add_planning_args(p, capture_depth=False)
    p.add_argument("-o", "--out", metavar="DIR", required=True, help="output directory")
    add_json_arg(p)
    p.set_defaults(run=_cmd_export)

    p = sub.add_parser("dryrun", parents=[talk],
                       help="plan, then run one training step of chosen ranks on fake tensors "
                            "and a fake process group of the plan's size; measured vs planned",
                       description="Plan as `autoplan plan` does, then for each rank of "
                                   "--ranks build the real runtime of that rank in this "
                                   "process on torch's fake process group of the plan's world "
                                   "size and run whole training steps on fake tensors (nothing "
                                   "allocated): print its measured peak memory by category "
                                   "(with -v, by the ops that allocated it), "
                                   "collective bytes per mesh axis and FLOPs beside the plan's "
                                   "prediction ([Note: dry run] in autoplan/runtime/dryrun.py); "
                                   "with -o write the report with a Dry run section; with "
                                   "--export each rank's whole step (every op and collective, "
                                   "the pipeline actions) as Python, Graphviz and JSON "
                                   "([Note: whole-step export] in "
                                   "autoplan/runtime/step_export.py). A rank "
                                   "whose live tensors exceed the device's memory fails, as on "
                                   "the cluster, naming the moment and the category.")
    add_planning_args(p, capture_depth=True)
    p.add_argument("--ranks", default="0", metavar="R,R,...",
                   help="global ranks to dry-run (default: %(default)s)")
    p.add_argument("--steps", type=positive_int, default=1, metavar="N",
                   help="training steps per rank, the last measured (default: %(default)s); "
                        "the optimizer states are created before the first, as a first step "
                        "leaves them")
    p.add_argument("-o", "--out", metavar="DIR",
                   help="write plan.json (with the dry run), report.md and report.html (with "
                        "a Dry run section) into DIR")
    p.add_argument("--export", metavar="DIR",
                   help="write each rank's whole measured step into DIR: rankR_step.py (every "
                        "aten op and collective in order, local shapes, dtypes, moment; "
                        "collectives with mesh axis, dtype and bytes; the pipeline actions), "
                        ".dot, .json, and traffic.md (bytes and count per mesh axis and op)")
    add_json_arg(p)
    p.set_defaults(run=_cmd_dryrun)

    p = sub.add_parser("demo", parents=[talk],
                       help="plan, compile and train a small GPT on local CPU ranks and "
                            "compare with one process",
                       description="Plan a 10.8M-parameter GPT-2-style model for --world-size "
                                   "local gloo ranks, train it there for --steps steps and "
                                   "beside it in one process, print both loss curves and "
                                   "write the report (about a minute on 2 cores).")
    p.add_argument("--steps", type=positive_int, metavar="N",
                   help="training steps (default: the demo's)")
    p.add_argument("--world-size", type=positive_int, default=4, metavar="N",
                   help="local gloo ranks (default: %(default)s)")
    p.add_argument("-o", "--out", metavar="DIR", help="output directory (default: the demo's)")
    p.set_defaults(run=_cmd_demo)

    p = sub.add_parser("calibrate", parents=[talk],
                       help="measure this machine's CPU ranks and write a local-cpu topology "
                            "file",
                       description="Measure this machine for the local-cpu preset -- matmul "
                                   "throughput by shape, memory bandwidth, the per-op and "
                                   "DTensor overheads, gloo collectives on 2 to --max-ranks "
                                   "ranks -- and write the topology YAML that `--cluster "
                                   "local-cpu` then reads (about 80 s on 2 cores).")
    p.add_argument("-o", "--out", metavar="FILE",
                   help="topology YAML to write (default: ~/.cache/autoplan/local-cpu.yaml)")
    p.add_argument("--max-ranks", type=positive_int, metavar="N",
                   help="largest number of ranks to measure")
    p.set_defaults(run=_cmd_calibrate)
    return parser


# --- planning ---------------------------------------------------------------------------------


def _depth(config: dict) -> int:
    """Repeated blocks of an HF config (llama's num_hidden_layers, gpt2's n_layer)."""
    return int(config.get("num_hidden_layers") or config.get("n_layer") or 0)


def _plan(args, num_layers: int | None) -> Planned:
    """Capture and plan for the planning arguments. The graph is the one `@autoparallel`
    plans on for the same model ([Note: shallow planning capture] in
    autoplan/capture/planning.py): parameters in the compute dtype (a 16-bit graph has the
    model's own upcasts as nodes, [Note: precision recipe]), the global batch at the planned
    sequence length (the cost model scales it to each microbatch, solver/costs.py
    token_scale; attention is exact at the planned length), `num_layers` blocks scaled to the
    real depth. Planned as `@autoparallel` plans (autoplan/session.py `audit` and `solve`: the
    random ops and batch couplings checked, the choices they need held). Warnings of the solver
    print as `autoplan: warning: ...` on stderr."""
    import torch

    from autoplan.capture import capture_preset
    from autoplan.models import model_config
    from autoplan.models.trainable import Trainable
    from autoplan.options import search_options_of
    from autoplan.session import audit, solve
    from autoplan.solver.configurations import Float8Warning, ReplicatedWeightsWarning
    from autoplan.spec import TrainingSpec

    config = model_config(args.model)  # an unknown preset fails here, before the cluster
    topology = cluster_topology(args)
    spec = TrainingSpec(global_batch=args.global_batch, seq_len=args.seq, dtype=args.dtype,
                        optimizer=args.optimizer, max_memory_fraction=args.max_memory_fraction)
    trainable = Trainable.parse(getattr(args, "trainable", "full"))
    # the whole model when its blocks differ (capture/planning.py: a note then says why)
    depth = (f" ({num_layers} of its {_depth(config)} blocks when they are alike; costs scaled "
             "to the full depth)" if num_layers and num_layers < _depth(config) else "")
    adapters = "" if trainable.kind == "full" else f" with {trainable.describe()}"
    with phase(f"capturing {args.model}{adapters}{depth}"):
        graph = capture_preset(args.model, batch=args.global_batch, seq_len=args.seq,
                               num_layers=num_layers, dtype=getattr(torch, args.dtype),
                               trainable=None if trainable.kind == "full" else trainable)
    options = search_options_of(args)
    with phase(f"planning {args.model} for {topology.world_size} x {topology.device.name}"):
        # the session @autoparallel plans in: the batch audit, the solve, its warnings
        couplings, search = audit(graph, options, args.model)
        result, caught = solve(graph, topology, spec, search, given=options,
                               couplings=couplings, name=args.model, compiled=args.compile,
                               frozen_weights_dtype=_weights_dtype(config))
    said = []
    for w in caught:
        if issubclass(w.category, (ReplicatedWeightsWarning, Float8Warning)):  # for the user
            said.append(str(w.message))
            print(f"autoplan: warning: {w.message}", file=sys.stderr)
        else:  # a library's: shown as Python shows it
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return Planned(graph, topology, result, tuple(said))


def _weights_dtype(config: dict) -> str | None:
    """The dtype of the model's weights as its checkpoint holds them, when its config says:
    an HF config.json's `torch_dtype` (`dtype` in newer ones), a preset's `_weights_dtype`
    note (the published checkpoint's); None when not known ([Note: frozen dtype] in
    autoplan/solver/frozen.py)."""
    return config.get("torch_dtype") or config.get("dtype") or config.get("_weights_dtype")


def _cmd_plan(args) -> int:
    """Plan, or read the plan from the cache ([Note: plan cache] in autoplan/cache.py), then
    print the summary and write the files. A plan made here is stored with its report files
    rendered, so that a later `-o` is served from the cache too. The cyclic garbage collector
    is paused throughout, the imports of torch and transformers included ([Note: collector
    paused] in autoplan/collector.py): about 15 % of a cold run otherwise; and the process's
    exit skips the interpreter's teardown ([Note: exit without teardown]: 1.2-1.9 s after a
    cold plan)."""
    exit_without_teardown()
    with collector_paused():
        return _plan_or_read(args)


def _plan_or_read(args) -> int:
    from autoplan.report.write import write_files

    cache, request = cache_request(args)
    entry = cache.get(request) if cache is not None else None
    planned = None
    if entry is not None:
        note(f"plan of {args.model} for {entry['world_size']} x {entry['device']} read from "
             f"the plan cache ({cache.path(request)}); --no-cache plans anew")
        for message in entry["warnings"]:
            print(f"autoplan: warning: {message}", file=sys.stderr)
    else:
        planned = _plan(args, args.num_layers_capture)
        entry = cache_entry(planned)
    if not args.json:
        print(entry["summary_text"])
    paths = {}
    if args.out:
        with phase(f"writing the report into {args.out}"):
            if planned is not None:
                entry["files"] = render(planned)
            paths = write_files(entry["files"], args.out)
    if planned is not None and cache is not None:
        if "files" not in entry:  # no -o this time: rendered for a later one
            entry["files"] = render(planned)
        store(cache, request, entry)
    if args.json:
        print_json(with_files(entry["summary"], paths.values()))
    elif paths:
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


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
        print_json(json_summary(planned, paths.values()))
        return 0
    print(render_summary(planned.plan, topology=planned.topology, graph=planned.graph))
    print(f"wrote {len(paths)} files into {out}")
    return 0


def plan_for_dry_run(args) -> tuple[Planned, CapturedGraph]:
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
                           record_ops=bool(args.export),
                           device_kernels=planned.topology.device.fuses_pointwise,
                           device_all_to_all=planned.topology.device.all_to_all)
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
        print_json({"plan": str(plan), "ranks": [dry_row(r) for r in rows],
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
            if verbosity() >= 2:  # -v: the ops whose outputs make the category at the peak
                for op, nbytes, n in r.peak_by_op.get(c, ()):
                    print(f"      {fmt_bytes(nbytes):>10s} in {n:>4d} x {op}")
        axes = ", ".join(f"{a} {fmt_bytes(b)}" for a, b in sorted(r.bytes_by_axis.items()))
        print(f"  collective bytes by axis: {axes or 'none'}")
        print(f"  FLOPs {fmt_flops(r.flops)} measured (recomputation included), "
              f"{fmt_flops(r.predicted_flops)} planned")
    if exported:
        print(f"wrote each rank's whole step ({len(exported)} files) into {args.export}")
    if paths:
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


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


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 failure, 2 user error)."""
    with collector_paused():  # the parser imports the preset list ([Note: collector paused])
        parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version (0) or a usage error (2), printed by argparse
        return e.code if isinstance(e.code, int) else 2
    before = verbosity()
    if args.verbosity is not None:
        set_verbosity(args.verbosity)
    try:
        check_out(getattr(args, "out", None), args.command)
        check_out(getattr(args, "export", None), args.command, flag="--export")
        return int(args.run(args))
    except ValueError as e:  # user mistakes from every layer: NoFeasiblePlan, InvalidConfig, ...
        print(f"autoplan: error: {in_cli_words(e)}", file=sys.stderr)
        return 2
    except _Failure as e:
        print(f"autoplan: error: {e}", file=sys.stderr)
        return 1

    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback, nothing half-written
        print("autoplan: interrupted", file=sys.stderr)
        return 130
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



def console() -> int:
    """The `autoplan` command (pyproject's console script): `main()`, then the exit without
    the interpreter's teardown where the command allows it ([Note: exit without teardown] in
    autoplan/collector.py)."""
    return exit_now(main())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(console())
