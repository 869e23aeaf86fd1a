"""The capture cache: a model captured once is read back from disk ([Note: capture cache]).

    graph, how = cached_capture(model, (input_ids,), model_name="GPT", planning=True)
    # how: "hit", "miss" (captured and stored), or "off: <why>" (captured, nothing stored)

[Note: capture cache]
torch.export of a model takes a third of a second for a 4-block GPT and seconds for a large
one, and `@autoparallel` captures twice on every rank (for planning, then at the microbatch
size): on 4 ranks sharing 2 cores that was half of the construction-to-first-loss time of a
job whose plan came from the plan cache ([Note: plan cache] in autoplan/cache.py). The capture
is deterministic -- export traces fake tensors, never the weights -- so, as the plan cache
does for plans, a captured graph is stored under a key that names everything it depends on,
and a restarted job (or every rank after the first of one machine) reads it back instead of
tracing again. The key (`capture_key`) is `autoplan.cache.request_key` of

  - the model: `fingerprint.model_document` -- every submodule's class and state (plain
    attributes, configs, hooks, tensors that are not parameters with their values; parameters
    and buffers by name, shape, strides, dtype, device and tying, not values), the source
    files of the classes and functions it holds and of the user's modules they reach, with
    their module-level plain values, and torch's global switches (default dtype, grad mode,
    autocast);
  - the inputs: each flat tensor's shape, strides, dtype and device, and the pytree structure
    of (args, kwargs);
  - the capture: planning (a few blocks, `PLANNING_BLOCKS`) or the whole model, the name;
  - as in every plan-cache key: `code_digest()` of autoplan's sources, the versions of torch,
    transformers, ortools, sympy and Python, and CAPTURE_SCHEMA (bumped when an entry's layout
    changes).

A change to any of them is another key, so a stale graph is never served; a model whose state
cannot be written down exactly (`fingerprint.Unfingerprintable`), or that reads state outside
it (an environment variable in forward), is captured every time (`AUTOPLAN_CAPTURE_CACHE=0`
turns the cache off). The cached graph is checked the way a capture is by the tests: equal
code, facts and parameters (tests/test_capture_cache.py).

An entry is `captures/<key>.graph` under the plan cache's directory (or `<key>.graph` in
$AUTOPLAN_CAPTURE_CACHE_DIR when it is set: captures are a function of their key alone, so jobs
whose plan caches are kept apart may share one): one JSON header line
(schema, key, torch version) and the CapturedGraph pickled by torch's own graph pickler
(`autoplan._torch_fx_compat`; node metadata and fake tensors included, as torch's compile
caches store graphs). Because it is a pickle, the directory is made private (0700), entries
are written 0600, and an entry is read only when this user owns it and no one else may write
it. Writes are atomic (a temporary file, then `os.replace`): ranks that miss together each
capture and leave one whole entry. An entry that does not read back -- truncated, another
key's, written by another torch -- is a miss: the model is captured again and the entry
replaced. Nothing expires (an entry is ~0.2 MB for a 4-block GPT, about the graph's size
for others); `rm -r` the directory clears it.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch import nn

from autoplan.cache import cache_dir, request_key
from autoplan.graph import CapturedGraph
from autoplan.progress import detail

__all__ = ["CAPTURE_SCHEMA", "CaptureCache", "cached_capture", "capture_key"]

# Bump when the layout of an entry or of the key changes.
CAPTURE_SCHEMA = 2


def capture_key(model: nn.Module, example_inputs, example_kwargs: dict | None, *,
                model_name: str, planning: bool) -> str:
    """The cache key (SHA-256, hex) of capturing `model(*example_inputs, **example_kwargs)`
    ([Note: capture cache]). Raises fingerprint.Unfingerprintable when the model holds a
    value the key cannot write down exactly."""
    from autoplan.capture.fingerprint import model_document
    from autoplan.capture.planning import PLANNING_BLOCKS

    leaves, spec = pytree.tree_flatten((tuple(example_inputs), dict(example_kwargs or {})))
    inputs = [[list(t.shape), list(t.stride()), str(t.dtype), t.device.type]
              if isinstance(t, torch.Tensor) else repr(t) for t in leaves]
    return request_key({"capture_schema": CAPTURE_SCHEMA, "model": model_document(model),
                        "inputs": inputs, "structure": str(spec), "model_name": model_name,
                        "planning_blocks": PLANNING_BLOCKS if planning else None})


class CaptureCache:
    """Captured graphs on disk under `directory / "captures"`; by default under
    $AUTOPLAN_CAPTURE_CACHE_DIR itself when it is set, else under `cache_dir() / "captures"`.

    `get(key)` returns the CapturedGraph stored under `key` or None (with the reason in
    `last_miss`); `put(key, graph)` stores one, raising OSError when the directory cannot be
    written and any pickling error for a graph the pickler cannot hold."""

    def __init__(self, directory: str | os.PathLike | None = None):
        if directory is not None:
            self.directory = Path(directory) / "captures"
        elif os.environ.get("AUTOPLAN_CAPTURE_CACHE_DIR"):
            self.directory = Path(os.environ["AUTOPLAN_CAPTURE_CACHE_DIR"]).expanduser()
        else:
            self.directory = cache_dir() / "captures"
        self.last_miss = ""

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.graph"

    def get(self, key: str) -> CapturedGraph | None:
        from autoplan._torch_fx_compat import loads_graph

        path = self.path(key)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                    return self._miss(f"{path} is not this user's own (not read)")
                header = json.loads(f.readline())
                if header != self._header(key):
                    return self._miss(f"{path} is another key's or another torch's")
                graph = loads_graph(f.read())
        except FileNotFoundError:
            return self._miss("absent")
        except Exception as e:  # noqa: BLE001 - any unreadable entry is a miss, then replaced
            return self._miss(f"{path} unreadable ({type(e).__name__}: {e})")
        if not isinstance(graph, CapturedGraph):
            return self._miss(f"{path} holds a {type(graph).__name__}")
        return graph

    def put(self, key: str, graph: CapturedGraph) -> Path:
        """Store `graph` under `key`, atomically; returns the entry's path."""
        from autoplan._torch_fx_compat import dumps_graph

        data = json.dumps(self._header(key)).encode() + b"\n" + dumps_graph(graph)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.path(key)
        tmp = self.directory / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    @staticmethod
    def _header(key: str) -> dict:
        return {"capture_schema": CAPTURE_SCHEMA, "key": key, "torch": torch.__version__}

    def _miss(self, why: str) -> None:
        self.last_miss = why
        return None


def cached_capture(model: nn.Module, example_inputs, *, model_name: str, planning: bool,
                   example_kwargs: dict | None = None,
                   cache: CaptureCache | None = None) -> tuple[CapturedGraph, str]:
    """`capture_for_planning` (planning) or `capture` of the model, read from the capture
    cache when it holds this capture ([Note: capture cache]), else captured and stored.

    Returns (graph, how): how is "hit", "miss" (captured, stored) or "off: <why>" (captured,
    not stored: AUTOPLAN_CAPTURE_CACHE=0, a model the key cannot hold, an unwritable cache).
    Raises what `capture` raises (CaptureError, ValueError) on a capture."""
    from autoplan.capture import capture
    from autoplan.capture.fingerprint import Unfingerprintable
    from autoplan.capture.planning import capture_for_planning

    def run() -> CapturedGraph:
        fn = capture_for_planning if planning else capture
        return fn(model, example_inputs, example_kwargs=example_kwargs, model_name=model_name)

    if os.environ.get("AUTOPLAN_CAPTURE_CACHE", "1") == "0":
        return run(), "off: AUTOPLAN_CAPTURE_CACHE=0"
    try:
        key = capture_key(model, example_inputs, example_kwargs, model_name=model_name,
                          planning=planning)
    except Unfingerprintable as e:
        detail(f"{model_name}: captured without the capture cache: {e}")
        return run(), f"off: {e}"
    cache = cache or CaptureCache()
    graph = cache.get(key)
    if graph is not None:
        return graph, "hit"
    if cache.last_miss != "absent":
        detail(f"{model_name}: capture cache entry not used: {cache.last_miss}")
    graph = run()
    try:
        cache.put(key, graph)
    except Exception as e:  # noqa: BLE001 - an unstored graph costs a capture next time only
        detail(f"{model_name}: capture cache not written: {type(e).__name__}: {e}")
        return graph, f"off: not stored ({type(e).__name__})"
    return graph, "miss"
