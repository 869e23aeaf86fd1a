"""The plan cache: the same planning request answered from disk ([Note: plan cache]).

    cache = PlanCache()                      # $AUTOPLAN_CACHE_DIR or ~/.cache/autoplan
    entry = cache.get(request)               # a dict, or None (a miss)
    cache.put(request, {"plan": plan.to_dict(), ...})

[Note: plan cache]
Planning is deterministic: capture runs on meta tensors, and CP-SAT solves under a
deterministic work limit (`--time-limit-s` is in its deterministic seconds), so the same inputs
give the same plan at any machine load (tests/test_solver.py checks a plan twice). A plan can
therefore be stored under a key that names everything it depends on and served when the same
request comes again. The key (`request_key`) is the SHA-256 of a canonical JSON document of

  - the request, given by the caller: the model (the content of its config for a preset or a
    config.json, or `graph_fingerprint` of the captured graph for a model instance), the
    training spec, the topology as resolved (a YAML file or a calibration file is read first,
    so its figures are in the key, not its name), the overrides and the solver settings;
  - the code: `code_digest()`, the SHA-256 of every source and data file of the autoplan
    package (the cost model's formulas and constants, the strategies, the solver, the model
    presets), and CACHE_SCHEMA, bumped when an entry's layout changes;
  - the libraries the capture and the solve run on: the installed versions of torch,
    transformers, ortools and sympy, and Python's.

A change to any of them makes another key, so a stale plan is never served: editing one
constant of the cost model changes `code_digest()`. Entries are JSON files (no pickles) named
by their key under `plans/`, written atomically (a temporary file, then `os.replace`), so
concurrent writers of one key leave one whole entry; an entry that does not parse, or whose
stored request differs from the one asked (a hash collision), is a miss. Nothing expires:
entries are small (a plan and its reports, ~0.5 MB for Llama-3-405B) and `rm -r` the
directory clears it.

Importing this module imports no torch: the command line answers a cached request without it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import sys
from pathlib import Path

__all__ = ["CACHE_SCHEMA", "PlanCache", "cache_dir", "code_digest", "graph_fingerprint",
           "library_versions", "request_key"]

# Bump when the layout of an entry or of a request changes (every key changes with it).
CACHE_SCHEMA = 1

_PACKAGE_DIR = Path(__file__).resolve().parent
_SOURCE_SUFFIXES = (".py", ".json", ".yaml", ".yml")
_LIBRARIES = ("torch", "transformers", "ortools", "sympy")


def cache_dir() -> Path:
    """Where entries live: $AUTOPLAN_CACHE_DIR, else $XDG_CACHE_HOME/autoplan, else
    ~/.cache/autoplan (the directory `autoplan calibrate` writes its topology into)."""
    if os.environ.get("AUTOPLAN_CACHE_DIR"):
        return Path(os.environ["AUTOPLAN_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "autoplan"


def code_digest(package_dir: Path = _PACKAGE_DIR) -> str:
    """SHA-256 (hex) over the relative path and bytes of every .py/.json/.yaml file of the
    autoplan package, in sorted path order (about 190 files, ~10 ms to read). autoplan's own
    is read once per process (`_own_code_digest`): the code a process plans with is the code
    it imported, and a rank of a pool that runs many jobs keys every one of them."""
    if package_dir == _PACKAGE_DIR:
        return _own_code_digest()
    return _digest_of(package_dir)


@functools.cache
def _own_code_digest() -> str:
    return _digest_of(_PACKAGE_DIR)


def _digest_of(package_dir: Path) -> str:
    h = hashlib.sha256()
    files = sorted(p for p in package_dir.rglob("*")
                   if p.suffix in _SOURCE_SUFFIXES and "__pycache__" not in p.parts)
    for path in files:
        h.update(str(path.relative_to(package_dir)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def library_versions() -> dict[str, str | None]:
    """Installed versions of the libraries a plan depends on (None: not installed), and
    Python's; read from package metadata, so nothing is imported. Read once per process (as
    `code_digest`: the libraries a process runs are those it imported)."""
    return dict(_library_versions())


@functools.cache
def _library_versions() -> dict[str, str | None]:
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in _LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = ".".join(map(str, sys.version_info[:3]))
    return versions


def _canonical(document) -> str:
    """JSON with sorted keys and no whitespace; raises TypeError for a value JSON cannot hold
    (a key must never depend on repr())."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False)


def request_key(request: dict) -> str:
    """The cache key of `request` (a JSON-able dict): SHA-256 (hex, 64 characters) of the
    request with CACHE_SCHEMA, `code_digest()` and `library_versions()` ([Note: plan cache]).
    Raises TypeError when the request holds a value JSON cannot represent."""
    return _hash(_keyed(request))


def _hash(keyed: dict) -> str:
    return hashlib.sha256(_canonical(keyed).encode()).hexdigest()


def _keyed(request: dict) -> dict:
    return {"schema": CACHE_SCHEMA, "code": code_digest(), "libraries": library_versions(),
            "request": request}


def graph_fingerprint(graph) -> str:
    """SHA-256 (hex) of what the planner reads from an autoplan.graph.CapturedGraph: the graph's
    code (ops, their arguments and order), the facts of every node and parameter (global
    shapes, dtypes, bytes, FLOPs, module paths, layer ids), the inputs, outputs, the repeated
    blocks and the sizes the costs scale by. Two graphs with one fingerprint plan alike."""
    import dataclasses

    document = {
        "code": graph.gm.code,
        "nodes": [dataclasses.astuple(n) for n in graph.nodes.values()],
        "params": [dataclasses.astuple(p) for p in graph.params.values()],
        "inputs": [list(graph.input_names), [list(s) for s in graph.input_shapes],
                   list(graph.input_dtypes)],
        "layers": [graph.layer_prefix, graph.num_layers, graph.total_layers,
                   sorted((k, list(v)) for k, v in graph.layer_nodes.items())]
        + ([graph.first_layer] if graph.first_layer else []),  # keys of before kept
        "outputs": [list(graph.output_names), str(graph.output_treespec)],
        "sizes": [graph.model_name, graph.batch_size, graph.seq_len],
    }
    return hashlib.sha256(_canonical(document).encode()).hexdigest()


class PlanCache:
    """Entries on disk under `directory / "plans"` (default: `cache_dir()`).

    `get` returns the entry (a dict) stored for a request, or None; `put` stores one. Both
    raise TypeError for a request JSON cannot represent; `put` raises OSError when the
    directory cannot be written (the caller decides whether that matters).
    """

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory) if directory is not None else cache_dir()

    def path(self, request: dict) -> Path:
        """The file that holds (or would hold) the entry of `request`."""
        return self._path(_hash(_keyed(request)))

    def _path(self, key: str) -> Path:
        return self.directory / "plans" / f"{key}.json"

    def get(self, request: dict) -> dict | None:
        keyed = _keyed(request)
        try:
            stored = json.loads(self._path(_hash(keyed)).read_text(encoding="utf-8"))
        except (OSError, ValueError):  # absent, unreadable or half-written by another tool
            return None
        # the whole keyed document must match, not only its hash (as JSON reads it back)
        if not isinstance(stored, dict) or stored.get("key") != json.loads(_canonical(keyed)):
            return None
        entry = stored.get("entry")
        return entry if isinstance(entry, dict) else None

    def put(self, request: dict, entry: dict) -> Path:
        """Store `entry` (a JSON-able dict) for `request`, atomically; returns its path."""
        keyed = _keyed(request)
        path = self._path(_hash(keyed))
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"key": keyed, "entry": entry})  # the entry keeps its order
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path
