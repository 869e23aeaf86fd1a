"""autoplan: automatic parallelism planning and compilation for PyTorch training.

The public names are imported on first use (PEP 562 module `__getattr__`), so that
`import autoplan` -- and the command line, `autoplan --help` -- import no torch: torch comes in
with the first name that needs it (`autoplan.autoparallel`, `autoplan.Plan`, ...).

The compiler's steps are packages, in the order a plan is made (docs/design.md, "Data flow"):
capture/ (model -> `CapturedGraph`), strategies/ (candidate placements per node), cost_model/
(compute, communication, memory), solver/ (the search and the placement ILP -> `Plan`),
passes/ (plan -> per-rank graphs), runtime/ (torch.distributed training), report/ (Markdown
and HTML), calibrate/ (`autoplan calibrate`), models/ (presets). The files at this level:
- api.py: `@autoparallel` and `from_pretrained`; auto_parallel.py: `AutoParallel`, the model
  they return (build, step, save, report, export); session.py: its planning half (cluster,
  capture, cp trial, plan cache, solve, broadcast; its `audit` and `solve` are `autoplan
  plan`'s too); options.py: the planner's options, written once (`SearchOptions`: plan(),
  the decorator's keywords, the command line's flags) and `PlanOptions`; cli.py: the
  `autoplan` command (its parser and subcommands), cli_args.py: its arguments, cli_output.py:
  what it prints and caches, cli_compare.py: `autoplan explain` and `autoplan diff`; demo.py:
  `autoplan demo`.
- plan.py: the `Plan` (frozen dataclasses, versioned JSON); spec.py: `TrainingSpec`;
  topology.py: `Topology` and the cluster presets; hardware.py: `DeviceSpec`, `LinkSpec`;
  graph.py: `CapturedGraph`; inputs.py: a step's batch as a pytree, its batch dims; experts.py:
  the routed-experts op; float8.py: the FP8 linear of the float8 recipe ([Note: float8
  recipe]); batch_coupling.py: the ops whose numbers depend on how the batch is
  cut, and the plan choices held for them ([Note: batch coupling]); op_classes.py: the aten
  ops by class (views, matmuls, attention, no-gradient, what "selective" checkpointing keeps).
- cache.py: the plan cache ([Note: plan cache]); collector.py: the garbage collector paused
  around planning; progress.py: phase lines on stderr; units.py: the one number format.
- testing.py: the correctness contract as code (one process against N ranks).
- _torch_compat/ (one module per concern), _torch_fx_compat.py: every use of torch's private
  APIs.
"""

from __future__ import annotations

import importlib

# The one definition of the version: pyproject.toml reads it ([tool.setuptools.dynamic]).
__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "autoparallel": "autoplan.api",
    "AutoParallel": "autoplan.api",
    "from_pretrained": "autoplan.api",
    "SearchOptions": "autoplan.options",
    "Plan": "autoplan.plan",
    "TrainingSpec": "autoplan.spec",
    "Topology": "autoplan.topology",
    "load_topology": "autoplan.topology",
    "preset": "autoplan.topology",
}

__all__ = ["autoparallel", "AutoParallel", "from_pretrained", "SearchOptions", "Plan",
           "TrainingSpec", "Topology", "load_topology", "preset", "__version__"]


def __getattr__(name: str):
    """Import a public name's module on first use and cache the name here; AttributeError for
    any other name (which lets `from autoplan import <submodule>` import the submodule)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'autoplan' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
