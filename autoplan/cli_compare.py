"""`autoplan explain` and `autoplan diff` (autoplan/cli.py builds their parsers): the user's
configuration planned beside the chosen plan, and two plan.json files compared, both printed
by autoplan/report/diff.py. Torch is imported only where a plan is read or made."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Callable

from autoplan.cli_args import add_json_arg, add_planning_args, in_cli_words
from autoplan.cli_output import print_json
from autoplan.options import SearchOptions, option_flag

__all__ = ["OVERRIDES", "add_parsers", "explain", "diff"]

def add_parsers(sub, talk, plan_fn: Callable) -> None:
    """The `explain` and `diff` subcommands on `sub` (argparse subparsers; `talk`: the
    progress flags' parent parser); `plan_fn`: cli.py's `_plan`."""
    p = sub.add_parser("explain", parents=[talk],
                       help="why not this configuration? plan it beside the chosen plan and "
                            "print the difference term by term",
                       description="Plan the request twice: as `autoplan plan` does with no "
                                   "overrides (the chosen plan), and with the overrides given "
                                   "(your configuration: any of " + ", ".join(
                                       option_flag(k) for k in OVERRIDES) + "). Print both "
                                   "and what differs, term by "
                                   "term (as `autoplan diff`): "
                                   "step time by part, memory by category, bytes per mesh "
                                   "axis, placements; or, where your configuration cannot be "
                                   "planned, the constraint that refuses it. --float8 alone is "
                                   "what is explained (the plan with FP8 linears beside the "
                                   "one without); beside other overrides it is kept for both "
                                   "plans, which are then compared within the recipe.")
    add_planning_args(p, capture_depth=True, trainable=True)
    add_json_arg(p, "both plans and their difference (seconds, bytes; `diff`: as `autoplan "
                    "diff --json`), or the reason yours is refused (`refused`)")
    p.set_defaults(run=lambda a: explain(a, plan_fn))

    p = sub.add_parser("diff", parents=[talk],
                       help="what differs between two plan.json files",
                       description="Compare two plans (plan.json files, or directories holding "
                                   "one, as `autoplan plan -o` writes them): mesh, ZeRO stage, "
                                   "schedule, microbatches, stages, the tp placements that "
                                   "differ (grouped by module role), the predicted step time "
                                   "by part, memory by category and bytes per mesh axis. "
                                   "Every number is one the plans recorded.")
    p.add_argument("a", metavar="A", help="the first plan: plan.json or its directory")
    p.add_argument("b", metavar="B", help="the second plan: plan.json or its directory")
    add_json_arg(p, "the difference (config, stages, time_s, memory_bytes and bytes_by_axis "
                    "as [A, B, B - A], placements grouped by role)")
    p.set_defaults(run=diff)


# the planning options that fix a choice (SearchOptions fields, the flags' dests), as
# `autoplan explain` takes them; the switches of the search apply to both plans
OVERRIDES = tuple(f.name for f in dataclasses.fields(SearchOptions)
                  if f.metadata["group"] == "overrides"
                  and f.name not in ("allow_tp_across_nodes", "uneven_stages"))


def explain(args, plan_fn: Callable) -> int:
    """Plan with no overrides (the chosen plan) and with the given ones (the user's
    configuration) by `plan_fn(args, num_layers) -> Planned` (cli.py's `_plan`); print the
    difference (`report.diff`), or the reason the user's configuration cannot be planned.
    Raises ValueError when no override is given, or when the request itself cannot be
    planned (the chosen plan fails)."""
    from autoplan.report.diff import plan_diff, render_diff

    defaults = {f.name: f.default for f in dataclasses.fields(SearchOptions)}
    given = {k: getattr(args, k) for k in OVERRIDES
             if getattr(args, k) is not None and getattr(args, k) != defaults[k]}
    if not given:
        raise ValueError("explain: give the configuration to explain, e.g. --tp 4 --pp 8 "
                         "(any of " + ", ".join(option_flag(k) for k in OVERRIDES) + ")")
    # the float8 recipe is what is explained when given alone, else kept for both plans
    recipe_only = set(given) == {"float8"}
    free = copy.copy(args)
    for k in OVERRIDES:
        if k != "float8" or recipe_only:
            setattr(free, k, None)
    kept = "" if recipe_only or "float8" not in given else \
        f"; both plans with --float8 {given.pop('float8')}"
    chosen = plan_fn(free, args.num_layers_capture).plan
    words = " ".join(f"{option_flag(k)} {w}" for k, v in given.items()
                     for w in (v if isinstance(v, list) else [v])) + kept
    try:
        yours = plan_fn(args, args.num_layers_capture).plan
    except ValueError as e:
        if args.json:
            print_json({"chosen": str(chosen), "yours": None, "overrides": given,
                        "refused": in_cli_words(e)})
        else:
            print(f"chosen: {chosen}")
            print(f"yours ({words}): cannot be planned: {in_cli_words(e)}")
        return 0
    found = plan_diff(chosen, yours)
    if args.json:
        print_json({"chosen": str(chosen), "yours": str(yours), "overrides": given,
                    "diff": found})
        return 0
    print(render_diff(found, a="chosen", b="yours"))
    ratio = yours.prediction.step_time_s / chosen.prediction.step_time_s
    if not found["config"] and "stages" not in found and not found["placements"]:
        print(f"\nyours ({words}) is the chosen plan")
    elif ratio >= 1:
        print(f"\nyours ({words}) is {ratio - 1:.1%} slower per step than the chosen plan")
    elif recipe_only:  # a recipe the chosen plan does not run, not a missed plan
        print(f"\nyours ({words}) is {1 - ratio:.1%} faster per step than the chosen plan: its "
              "FP8 linears, a recipe the search uses only when asked (float8 is 'off' unless "
              "given)")
    else:  # the search keeps the fastest plan that fits; a faster one means a limit
        print(f"\nyours ({words}) is faster per step than the chosen plan: the search did not "
              "reach it (its time limit, --time-limit-s) or ranked it by another bar")
    return 0


def _read_plan(path: str):
    """The Plan in `path` (plan.json, or a directory holding one). Raises ValueError naming
    the file when it is missing or not a plan."""
    from autoplan.plan import Plan

    p = Path(path)
    if p.is_dir():
        p = p / "plan.json"
    try:
        return Plan.from_json(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"diff: {p} does not exist; give a plan.json or the directory "
                         "`autoplan plan -o` wrote") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"diff: {p} is not a plan.json autoplan can read: {e}") from None


def diff(args) -> int:
    from autoplan.report.diff import plan_diff, render_diff

    a, b = _read_plan(args.a), _read_plan(args.b)
    found = plan_diff(a, b)
    if args.json:
        print_json({"a_path": args.a, "b_path": args.b, **found})
    else:
        print(render_diff(found, a="A", b="B"))
    return 0
