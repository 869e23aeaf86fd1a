"""Write docs/reference.md from the source: `@autoparallel`'s and `plan()`'s docstrings, the
planner's options (autoplan/options.py `SearchOptions`, each field's doc, type, default and
flag), every command's `--help` (at 100 columns) and the dataclasses of autoplan/plan.py.

    python docs/gen_reference.py            # rewrite docs/reference.md
    python docs/gen_reference.py --check    # exit 1 when docs/reference.md is not current

tests/test_reference_doc.py checks that the file equals what this writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import os
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent / "reference.md"
sys.path.insert(0, str(DOC.parents[1]))  # this checkout's autoplan, wherever it runs from
COMMANDS = ((), ("plan",), ("explain",), ("diff",), ("export",), ("dryrun",), ("demo",),
            ("calibrate",))

HEAD = """\
# autoplan reference

Every option of `@autoparallel` and of `autoplan.solver.plan`, every flag of the `autoplan`
commands and every field of `plan.json`, as the source states them (the docstrings of
`autoplan/api.py` `autoparallel`, `autoplan/solver/planner.py` `plan`, the fields of
`autoplan/options.py` `SearchOptions`, the commands' `--help` of `autoplan/cli.py`, and the
dataclasses of `autoplan/plan.py`). Written by docs/gen_reference.py: edit the source, then run
it. How to use them: docs/guide.md.
"""

AUTOPARALLEL = """\
## `@autoparallel(...)` / `autoplan.autoparallel`

The decorator's keyword arguments (`PlanOptions` in `autoplan/options.py` holds them; the
planner's options such as `tp=` are the fields of `SearchOptions`, below).
"""

OPTIONS = """\
## The planner's options: `autoplan.options.SearchOptions`

One frozen dataclass, the one place each option is written: `plan(graph, topology, spec,
SearchOptions(...))` or `plan(..., tp=2)`, `@autoparallel(tp=2, ...)`, and the command line's
flag (`--` and the name, dashes for underscores; the flags it had before, such as `--zero`,
`--microbatches`, `--virtual-stages`, `--place` and `--time-limit`, are still accepted). A
value of the wrong type or outside its choices raises `OptionError` (a ValueError) naming the
option and the value; `plan()` raises it as `InvalidConfig`. None: searched.
"""

PLAN = """\
## `autoplan.solver.plan(graph, topology, spec, ...)`

The planner called directly on a captured graph (`autoplan.capture.capture`), a `Topology`
(`autoplan.topology.preset` / `load_topology`) and a `TrainingSpec` (`autoplan/spec.py`).
"""

CLI = """\
## The command line

`autoplan --help` and `autoplan COMMAND --help` print these.
"""

PLAN_JSON = """\
## `plan.json`

A `Plan` written as JSON (`Plan.to_json`, read back by `Plan.from_json`; the schema
version is its `version` field). Its classes, as `autoplan/plan.py` documents them:
"""


def _args_of(func) -> str:
    """A function's docstring from its "Args:" on."""
    doc = inspect.getdoc(func)
    return doc[doc.index("Args:"):]


def _options() -> str:
    from autoplan import options as o

    literals = {"ZeroStage": o.ZERO_STAGES, "Schedule": o.SCHEDULES,
                "Checkpointing": o.CHECKPOINTINGS, "Offload": o.OFFLOADS}
    rows = []
    for f in dataclasses.fields(o.SearchOptions):
        kind, _, rest = f.type.partition(" ")
        if kind in literals:  # the choices, as the Literal spells them
            kind = " | ".join(repr(c) for c in literals[kind])
        aliases = "".join(f", `{a}`" for a in f.metadata["aliases"])
        rows.append(f"- `{f.name}: {' '.join((kind, rest)).strip()}` = {f.default!r} "
                    f"(`{o.option_flag(f.name)}`{aliases}): {f.metadata['doc']}.")
    return "\n".join(rows) + "\n"


def _help(*argv: str) -> str:
    from autoplan.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([*argv, "--help"])
    return out.getvalue().rstrip("\n")


def _plan_json() -> str:
    import typing

    from autoplan import plan as p

    parts = []
    for cls in (p.MeshShape, p.NodeStrategy, p.Redistribution, p.Stage, p.Prediction,
                p.Alternative, p.Plan):
        typing.get_type_hints(cls)  # every annotation resolves
        fields = "\n".join(f"{f.name}: {str(f.type).replace('typing.', '')}"
                           for f in dataclasses.fields(cls))
        parts.append(f"### `{cls.__name__}`\n\n{inspect.getdoc(cls)}\n\n```\n{fields}\n```\n")
    return "\n".join(parts)


def reference() -> str:
    """The text of docs/reference.md."""
    from autoplan.api import autoparallel
    from autoplan.solver.planner import plan

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps --help at the terminal's width
    try:
        commands = "\n".join(f"### `{' '.join(('autoplan', *c))}`\n\n```\n{_help(*c)}\n```\n"
                             for c in COMMANDS)
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return "\n".join([
        HEAD, AUTOPARALLEL, f"```\n{_args_of(autoparallel)}\n```\n", OPTIONS, _options(),
        PLAN, f"```\n{_args_of(plan)}\n```\n", CLI, commands, PLAN_JSON, _plan_json()])


def main(argv: list[str]) -> int:
    text = reference()
    if "--check" in argv:
        if DOC.read_text() != text:
            print(f"{DOC} is not what docs/gen_reference.py writes: run it", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
