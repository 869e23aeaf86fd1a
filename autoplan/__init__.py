"""autoplan: automatic parallelism planning and compilation for PyTorch training.

The public names are imported on first use (PEP 562 module `__getattr__`), so that
`import autoplan` -- and the command line, `autoplan --help` -- import no torch: torch comes in
with the first name that needs it (`autoplan.autoparallel`, `autoplan.Plan`, ...).
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
    "Plan": "autoplan.plan",
    "TrainingSpec": "autoplan.spec",
    "Topology": "autoplan.topology",
    "load_topology": "autoplan.topology",
    "preset": "autoplan.topology",
}

__all__ = ["autoparallel", "AutoParallel", "from_pretrained", "Plan", "TrainingSpec", "Topology",
           "load_topology", "preset", "__version__"]


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
