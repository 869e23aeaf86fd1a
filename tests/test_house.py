"""The house a newcomer reads (issue 25, docs/design.md "House rules"): the package's modules
import each other without a cycle, no source file is over 500 lines without saying why, and
every reference to a file of the repository names a file that is there."""

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


# -- files a reader can hold in mind -------------------------------------------------------------
MAX_LINES = 500
# The mark of a reason in a module docstring (docs/design.md, house rule 3).
REASON = "Long because:"


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def long_files(root: Path) -> list[str]:
    """`path: N lines` for every source file (autoplan/, kernels/) of over MAX_LINES lines
    whose module docstring has no line starting with REASON."""
    found = []
    for path in sorted(p for top in ("autoplan", "kernels") for p in (root / top).rglob("*.py")):
        source = path.read_text()
        lines = len(source.splitlines())
        if lines <= MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse(source)) or ""
        if not any(line.strip().startswith(REASON) for line in doc.splitlines()):
            found.append(f"{path.relative_to(root)}: {lines} lines")
    return found


def test_no_source_file_is_over_500_lines_without_saying_why():
    long = long_files(ROOT)
    assert not long, (f"split these along their seams, or say why in the module docstring "
                      f"({REASON!r} ...):\n" + "\n".join(long))


def test_a_long_file_is_found_unless_its_docstring_says_why(tmp_path):
    (tmp_path / "autoplan").mkdir()
    (tmp_path / "kernels").mkdir()
    body = "x = 1\n" * MAX_LINES
    (tmp_path / "autoplan" / "short.py").write_text('"""Short."""\n' + "x = 1\n" * 400)
    (tmp_path / "autoplan" / "long.py").write_text('"""Long."""\n' + body)
    (tmp_path / "kernels" / "why.py").write_text(
        f'"""A kernel.\n\n{REASON} one Triton program and its reference."""\n' + body)
    (tmp_path / "kernels" / "said_late.py").write_text(
        '"""A kernel."""\n' + body + f"# {REASON} a comment is not the docstring\n")
    assert long_files(tmp_path) == ["autoplan/long.py: 501 lines",
                                    "kernels/said_late.py: 502 lines"]


# -- one role per file name ----------------------------------------------------------------------
# House rule 18: a file is named for its role. A name several packages share is one concern,
# each package doing its step's part of it (file name -> the parts):
SHARED_NAMES = {
    "cache.py": "a cache on disk keyed by what its entries depend on: captures (capture/), "
                "plans (autoplan/)",
    "checkpointing.py": "activation checkpointing: priced (solver/), applied (passes/)",
    "facts.py": "what a step derives: of the captured graph (capture/), of the plan for the "
                "report (report/)",
    "context_parallel.py": "context parallelism: priced (cost_model/), lowered (passes/)",
    "expert_parallel.py": "expert parallelism: priced (cost_model/), run (runtime/)",
    "float8.py": "the FP8 linear: its numerics (autoplan/), priced (cost_model/), its placements "
                 "searched (solver/), lowered (passes/)",
    "offload.py": "CPU offload: priced (cost_model/), run (runtime/)",
}


def shared_names(root: Path) -> dict[str, list[str]]:
    """File name -> the source files (autoplan/, kernels/) of that name, for names held by
    more than one (a package's `__init__.py` aside)."""
    paths: dict[str, list[str]] = {}
    for top in ("autoplan", "kernels"):
        for path in sorted((root / top).rglob("*.py")):
            if path.name != "__init__.py":
                paths.setdefault(path.name, []).append(str(path.relative_to(root)))
    return {name: files for name, files in sorted(paths.items()) if len(files) > 1}


def test_one_role_per_file_name():
    shared = shared_names(ROOT)
    unexplained = {n: f for n, f in shared.items() if n not in SHARED_NAMES}
    assert not unexplained, ("files of one name in several packages: rename the one whose "
                             f"job differs, or list the concern in SHARED_NAMES: {unexplained}")
    stale = sorted(set(SHARED_NAMES) - set(shared))
    assert not stale, f"no longer shared, remove from the lists: {stale}"


# -- each package lists its files ---------------------------------------------------------------


def unlisted_files(root: Path) -> dict[str, list[str]]:
    """Package -> its files (and sub-packages, `name/`) that its `__init__` docstring does not
    name, for every package under autoplan/."""
    out = {}
    for init in sorted((root / "autoplan").rglob("__init__.py")):
        package = init.parent
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        parts = [p.name for p in package.glob("*.py") if p.name != "__init__.py"]
        parts += [p.name + "/" for p in package.iterdir() if (p / "__init__.py").is_file()]
        missing = sorted(name for name in parts if name not in doc)
        if missing:
            out[str(package.relative_to(root))] = missing
    return out


def test_each_package_docstring_lists_its_files():
    unlisted = unlisted_files(ROOT)
    assert not unlisted, f"files their package's __init__ docstring does not name: {unlisted}"


# -- every reference resolves ---------------------------------------------------------------
SCANNED = ("autoplan", "bench", "tests", "docs", "examples")
# A path from the repository root: a top-level directory, then the file.
IN_REPO = re.compile(r"(?<![\w/.-])((?:autoplan|bench|tests|docs|examples|kernels)/[\w./-]*"
                     r"\.(?:md|py|json|yaml))\b")
# A path that leaves the repository: what a reader of a clone cannot open.
OUTSIDE = re.compile(r"(?<![\w/.-])((?:\.\./)+[\w./-]+\.(?:md|py|json|yaml))\b")
# A document named without its directory (`FORMULAS.md`): some file of the repository must
# have that name. Documents of other projects, named as theirs:
DOC_NAME = re.compile(r"(?<![\w/.-])([A-Z][A-Z_]+\.md)\b")
OTHER_PROJECTS_DOCS = {"PERFORMANCE.md"}  # nccl-tests' doc/PERFORMANCE.md (busbw)


# Files a bench writes when it runs: named before they exist (bench/gpu_check.py has not run).
BENCH_OUTPUTS = "bench/results/"


def scanned_files(root: Path) -> list[Path]:
    """README.md and the text files under SCANNED (not the JSON results: data, not prose), but
    this file, whose made-up references are the point of a test."""
    files = [root / "README.md"] if (root / "README.md").is_file() else []
    for top in SCANNED:
        files += sorted(p for p in (root / top).rglob("*")
                        if p.suffix in (".py", ".md", ".yaml") and p.is_file()
                        and p != Path(__file__).resolve())
    return files


def broken_references(root: Path) -> list[str]:
    """`file:line: reference` for every reference under `root` to a repository file that is
    not there, to a file outside the repository, or to a document name no file has."""
    names = {p.name for p in root.rglob("*") if p.is_file()}
    broken = []
    for path in scanned_files(root):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(root)}:{number}"
            broken += [f"{where}: {m} (not in the repository)" for m in IN_REPO.findall(line)
                       if not (root / m).exists() and not m.startswith(BENCH_OUTPUTS)]
            broken += [f"{where}: {m} (outside the repository)" for m in OUTSIDE.findall(line)]
            broken += [f"{where}: {m} (no file of that name)" for m in DOC_NAME.findall(line)
                       if m not in names and m not in OTHER_PROJECTS_DOCS]
    return broken


def test_every_reference_names_a_file_of_the_repository():
    broken = broken_references(ROOT)
    assert not broken, "references that do not resolve:\n" + "\n".join(broken)


def test_a_made_up_reference_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("See docs/design.md and NOTES.md.\n")
    (tmp_path / "autoplan").mkdir()
    (tmp_path / "autoplan" / "x.py").write_text(
        '"""As docs/design.md says; see docs/missing.md, ../shared/DESIGN.md, STYLE.md."""\n'
        "# a message, not a reference: [../gloo/transport/tcp/pair.cc:534]\n")
    assert broken_references(tmp_path) == [
        "autoplan/x.py:1: docs/missing.md (not in the repository)",
        "autoplan/x.py:1: ../shared/DESIGN.md (outside the repository)",
        "autoplan/x.py:1: STYLE.md (no file of that name)",
        "docs/design.md:1: NOTES.md (no file of that name)",
    ]


# -- the notes index ------------------------------------------------------------------------
NOTE = re.compile(r"\[Note: ([^\]\[]+?)\]")


def note_names(source: str) -> set[str]:
    """The names of the `[Note: ...]` of `source`, a name wrapped over lines (in a comment or
    in adjacent string literals) joined again."""
    names = set()
    for name in NOTE.findall(source):
        name = re.sub(r"\s*\n\s*(?:#\s*)?", " ", name)  # a comment's next line
        names.add(re.sub(r'"\s*f?"', "", name))  # "... " "..." string literals
    return names


def test_the_notes_index_lists_every_note_with_its_file():
    """docs/design.md's "Notes index" names every `[Note: ...]` of the source, each with a file
    that holds it."""
    text = (ROOT / "docs" / "design.md").read_text()
    index = text[text.index("## Notes index"):]
    rows = dict(re.findall(r"^\| ([^|]+?) \| `([^`]+)` \|$", index, flags=re.MULTILINE))
    source = [p for top in ("autoplan", "bench", "tests", "examples", "kernels")
              for p in (ROOT / top).rglob("*.py") if p != Path(__file__).resolve()]
    notes = {name for p in source for name in note_names(p.read_text())}
    assert sorted(notes - set(rows)) == [], "notes missing from docs/design.md's index"
    assert sorted(set(rows) - notes) == [], "index rows for notes the source no longer has"
    wrong = [f"{name}: {file}" for name, file in rows.items()
             if f"[Note: {name}]" not in (ROOT / file).read_text()]
    assert not wrong, wrong


# -- the runtime rewrites no graph ------------------------------------------------------------
# Issue 25: the lowering from plan to rank graphs has one owner, passes/lowering.py ([Note: pass
# order]); a graph rewrite under autoplan/runtime/ is one the lowering does not order.
FX_MUTATING_CALLS = {"erase_node", "inserting_before", "inserting_after", "create_node",
                     "node_copy", "graph_copy", "replace_all_uses_with", "replace_input_with",
                     "update_arg", "update_kwarg", "insert_arg", "eliminate_dead_code",
                     "recompile"}
"""Method names only FX's Graph, Node and GraphModule have: a call of one is a rewrite."""
FX_GRAPH_BUILDERS = {"call_function", "call_method", "call_module", "get_attr", "placeholder",
                     "output", "prepend", "append"}
"""Graph and Node methods whose names other objects share (a list's append): a rewrite when
called on something named like a graph or node (`graph`, `g`, `gm`, `node`, `n`, `*_node`)."""
FX_NODE_FIELDS = {"args", "kwargs", "target", "op", "graph"}
"""A node's fields: assigning one (other than on `self`) rewrites the graph."""


def graph_rewrites(path: Path) -> list[str]:
    """`line: what` for each FX graph mutation in the source at `path`: a call of a method
    that edits a graph (FX_MUTATING_CALLS; FX_GRAPH_BUILDERS on a graph- or node-named
    receiver), or an assignment to a node's field (`node.target = f`)."""
    tree = ast.parse(path.read_text())
    out = []

    def fx_like(expr: ast.expr) -> bool:
        name = expr.attr if isinstance(expr, ast.Attribute) else \
            expr.id if isinstance(expr, ast.Name) else ""
        return bool(re.fullmatch(r"(\w*_)?(graph|g|gm|node|n)(_\w*)?", name))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                node.func.attr in FX_MUTATING_CALLS
                or node.func.attr in FX_GRAPH_BUILDERS and fx_like(node.func.value)):
            out.append(f"{node.lineno}: {ast.unparse(node.func)}(...)")
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for leaf in ast.walk(t):  # `a.args = b.args = ...`, `(n.args, n.kwargs) = ...`
                if isinstance(leaf, ast.Attribute) and leaf.attr in FX_NODE_FIELDS \
                        and isinstance(leaf.ctx, ast.Store) \
                        and not (isinstance(leaf.value, ast.Name)
                                 and leaf.value.id in ("self", "cls")):
                    out.append(f"{node.lineno}: {ast.unparse(leaf)} = ...")
    return sorted(out, key=lambda line: int(line.split(":")[0]))


def test_no_module_under_runtime_rewrites_a_graph():
    found = {str(p.relative_to(ROOT)): graph_rewrites(p)
             for p in sorted((PACKAGE / "runtime").rglob("*.py"))}
    found = {p: lines for p, lines in found.items() if lines}
    assert not found, ("FX graph rewrites under autoplan/runtime/: move them to a pass and "
                       f"call it from passes/lowering.py ([Note: pass order]): {found}")


def test_a_graph_rewrite_is_found(tmp_path):
    path = tmp_path / "x.py"
    path.write_text(
        "def f(gm, node, out, sg):\n"
        "    with gm.graph.inserting_before(node):\n"
        "        new = gm.graph.call_function(g, (node,))\n"
        "    node.replace_all_uses_with(new)\n"
        "    gm.graph.erase_node(node)\n"
        "    node.args = (new,)\n"
        "    node.target = g\n"
        "    sg.gm.recompile()\n"
        "    out.append(node)\n"                       # a list: not a graph
        "    self.target = 3\n"                        # not a node
        "    sg.gm.forward = g\n"                      # a module's forward: not its graph
        "    [n.name for n in gm.graph.nodes]\n")      # reading: not a rewrite
    assert graph_rewrites(path) == [
        "2: gm.graph.inserting_before(...)", "3: gm.graph.call_function(...)",
        "4: node.replace_all_uses_with(...)", "5: gm.graph.erase_node(...)",
        "6: node.args = ...", "7: node.target = ...", "8: sg.gm.recompile(...)"]


# -- the benchmark tables -------------------------------------------------------------------
@pytest.mark.parametrize("bench, render", [
    ("coverage", lambda m, doc: m.markdown(doc)),
    ("dryrun", lambda m, doc: m.markdown(doc)),
    ("fidelity", lambda m, doc: m.table(doc["plans"])),
    ("published", lambda m, doc: m.docs_table(doc["results"])),
    ("runtime_vs_native", lambda m, doc: m.table(doc["rows"]) + "\n" + m.phase_table(doc["rows"])),
    ("torchrun_exit", lambda m, doc: m.markdown(doc)),
])
def test_docs_benchmarks_holds_each_benchs_table_of_its_results(bench, render):
    """docs/benchmarks.md shows what each bench renders from its checked-in
    bench/results/<bench>.json (rerun a bench with --docs, or paste its --markdown, with its
    results)."""
    import json

    from _helpers import load_bench

    module = load_bench(bench)
    doc = json.loads((ROOT / "bench" / "results" / f"{bench}.json").read_text())
    tables = render(module, doc).split("\n")
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for table in "\n".join(tables).split("\n\n"):
        assert table.split("\n", 2)[0] in text and all(
            line in text for line in table.split("\n")), (bench, table[:300])
