"""The house a newcomer reads (issue 25, docs/design.md "House rules"): the package's modules
import each other without a cycle, and every reference to a file of the repository names a
file that is there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autoplan"


# -- no import cycles -----------------------------------------------------------------------
def module_name(path: Path, root: Path) -> str:
    """`root/autoplan/capture/__init__.py` -> "autoplan.capture", `root/autoplan/plan.py` ->
    "autoplan.plan"."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_imports(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` imports when it is imported: the import
    statements of its body, also under a module-level `if` or `try` (a `TYPE_CHECKING` block
    too, which errs on the safe side), not those inside functions or classes, which run later.
    `from A import x` is an import of the module A.x when x is one, else of A. Relative forms
    are resolved against `name` (its own package when `is_package`). An import of A.B also runs
    A's `__init__` first, but that is not an edge: A's `__init__` may import its parts as long
    as they do not import it back."""
    found: set[str] = set()
    statements = []
    for top in ast.parse(source).body:
        if isinstance(top, (ast.If, ast.Try)):
            statements += [n for n in ast.walk(top)
                           if isinstance(n, (ast.Import, ast.ImportFrom))]
        else:
            statements.append(top)
    for node in statements:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in known:
                    found.add(f"{target}.{alias.name}")
                elif target in known:
                    found.add(target)
    found.discard(name)
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports at import time, for every .py file
    under the directory `package`."""
    paths = {module_name(p, package.parent): p for p in sorted(package.rglob("*.py"))}
    known = set(paths)
    return {name: module_imports(name, path.read_text(), path.name == "__init__.py", known)
            for name, path in paths.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of `graph`: one list per strongly connected component of more than one
    module (or a module that imports itself), its modules sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_package_imports_without_a_cycle():
    cycles = import_cycles(import_graph(PACKAGE))
    assert not cycles, "import cycles (module-level imports):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_an_init_that_imports_its_parts_halfway_down_is_a_cycle(tmp_path):
    """The check finds the pattern it is for: a package whose part imports a name from the
    package's `__init__`, which imports the part below that name."""
    pkg = tmp_path / "autoplan" / "pkg"
    pkg.mkdir(parents=True)
    (tmp_path / "autoplan" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("class Shared:\n    pass\n\n\n"
                                     "from autoplan.pkg.part import helper  # noqa: E402\n")
    (pkg / "part.py").write_text("from autoplan.pkg import Shared\n\n\ndef helper():\n"
                                 "    from autoplan.pkg import other  # at call time: no edge\n")
    (pkg / "leaf.py").write_text("from . import part\nfrom .part import helper\n")
    graph = import_graph(tmp_path / "autoplan")
    assert graph["autoplan.pkg.leaf"] == {"autoplan.pkg.part"}
    assert import_cycles(graph) == [["autoplan.pkg", "autoplan.pkg.part"]]
