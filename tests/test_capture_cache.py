"""The capture cache ([Note: capture cache] in autoplan/capture/cache.py): a capture made before
is read back equal to a fresh one, and never for a model, code or input that differs in anything
the graph depends on. Each test has an empty cache of its own (conftest.py,
AUTOPLAN_CACHE_DIR)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import _capture_jobs
from autoplan import cache as plan_cache_mod
from autoplan.capture import capture
from autoplan.capture.cache import CaptureCache, cached_capture, capture_key
from autoplan.capture.fingerprint import Unfingerprintable

_ROOT = Path(__file__).resolve().parent.parent
_X = (torch.zeros(4, 8, device="meta"),)

_MODEL = '''
import torch
from torch import nn

import {helpers} as helpers

USE_GELU = False


class Net(nn.Module):
    def __init__(self, width=8, scale=2.0):
        super().__init__()
        self.scale = scale
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = helpers.act(layer(x) * self.scale)
        if USE_GELU:
            x = torch.nn.functional.gelu(x)
        return {tail}
'''


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    """A model in a file of the user's (and a helper it imports from another), importable and
    editable: `write(tail=..., act=...)` rewrites and reloads them, returns the module."""
    name = f"capmodel_{tmp_path.name.replace('-', '_')}"
    helpers = f"{name}_helpers"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)

    def write(tail: str = "x", act: str = "torch.relu(x)"):
        (tmp_path / f"{helpers}.py").write_text(f"import torch\n\n\ndef act(x):\n    return {act}\n")
        (tmp_path / f"{name}.py").write_text(_MODEL.format(helpers=helpers, tail=tail))
        importlib.invalidate_caches()
        for mod in (helpers, name):
            if mod in sys.modules:
                importlib.reload(sys.modules[mod])
            else:
                importlib.import_module(mod)
        return sys.modules[name]

    yield write
    for mod in (helpers, name):
        sys.modules.pop(mod, None)


def _meta(cls, *args, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return cls(*args, **kwargs)


def _key(model, x=_X, planning=False) -> str:
    return capture_key(model, x, None, model_name="m", planning=planning)


def _targets(graph) -> list[str]:
    return [n.target for n in graph.nodes.values()]


def test_a_capture_made_before_is_read_back_equal(tmp_path):
    """Miss, then hit; the graph read back equals the captured one in everything the planner
    and the passes read (code, facts, parameters, blocks, outputs, node metadata) and runs."""
    from autoplan.models import build_model, example_inputs

    model = build_model("gpt2-tiny", device="meta")
    x = example_inputs("gpt2-tiny", batch=2, seq_len=8, device="meta")
    cache = CaptureCache(tmp_path)
    fresh, how = cached_capture(model, x, model_name="gpt2", planning=True, cache=cache)
    assert how == "miss" and len(list(cache.directory.glob("*.graph"))) == 1
    read, how = cached_capture(build_model("gpt2-tiny", device="meta"), x, model_name="gpt2",
                               planning=True, cache=cache)
    assert how == "hit" and read is not fresh
    assert read.gm.code == fresh.gm.code and read.nodes == fresh.nodes
    assert read.params == fresh.params
    for field in ("input_names", "input_shapes", "input_dtypes", "layer_prefix", "num_layers",
                  "total_layers", "layer_nodes", "output_names", "output_constants",
                  "model_name", "batch_size", "seq_len"):
        assert getattr(read, field) == getattr(fresh, field), field
    assert read.output_treespec == fresh.output_treespec and read.output_treespec is not None
    for a, b in zip(fresh.gm.graph.nodes, read.gm.graph.nodes):
        assert (a.name, a.op, str(a.target)) == (b.name, b.op, str(b.target))
        assert a.meta.get("nn_module_stack") == b.meta.get("nn_module_stack")
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor):
            assert (va.shape, va.dtype, va.stride(), va.device) == \
                (vb.shape, vb.dtype, vb.stride(), vb.device), a.name
    assert dict(read.gm.state_dict()).keys() == dict(fresh.gm.state_dict()).keys()
    out = read.gm(*[t.to("meta") for t in x])
    ref = fresh.gm(*[t.to("meta") for t in x])
    assert out.shape == ref.shape


def test_the_same_model_built_again_or_copied_has_the_same_key_in_another_process():
    """The positive control: what does not change the graph does not change the key (else the
    cache would never serve a restarted job)."""
    from autoplan.models import build_model, example_inputs
    from autoplan.runtime.construction import meta_skeleton

    x = example_inputs("llama-tiny", batch=2, seq_len=8, device="meta")
    key = _key(build_model("llama-tiny", device="meta"), x)
    assert _key(build_model("llama-tiny", device="meta"), x) == key
    assert _key(meta_skeleton(build_model("llama-tiny", device="meta")), x) == key  # a copy
    code = ("import sys; from autoplan.models import build_model, example_inputs;"
            "from autoplan.capture.cache import capture_key;"
            "x = example_inputs('llama-tiny', batch=2, seq_len=8, device='meta');"
            "print(capture_key(build_model('llama-tiny', device='meta'), x, None, "
            "model_name='m', planning=False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(_ROOT)}, check=True)
    assert out.stdout.strip() == key


def test_another_forward_source_misses(user_code, tmp_path):
    mod = user_code()
    cache = CaptureCache(tmp_path / "c")
    relu, how = cached_capture(_meta(mod.Net), _X, model_name="m", planning=False, cache=cache)
    assert how == "miss" and "aten.relu.default" in _targets(relu)
    mod = user_code(tail="torch.sigmoid(x)")  # the same class name, another forward
    again, how = cached_capture(_meta(mod.Net), _X, model_name="m", planning=False, cache=cache)
    assert how == "miss" and "aten.sigmoid.default" in _targets(again)
    assert cached_capture(_meta(mod.Net), _X, model_name="m", planning=False,
                          cache=cache)[1] == "hit"


def test_a_helper_in_another_file_of_the_users_misses(user_code, tmp_path):
    """The model's file imports its activation from another file: editing that file is another
    key (the user's modules reached from the model's are keyed, transitively)."""
    mod = user_code()
    cache = CaptureCache(tmp_path / "c")
    assert cached_capture(_meta(mod.Net), _X, model_name="m", planning=False,
                          cache=cache)[1] == "miss"
    mod = user_code(act="torch.nn.functional.silu(x)")
    graph, how = cached_capture(_meta(mod.Net), _X, model_name="m", planning=False,
                                cache=cache)
    assert how == "miss" and "aten.silu.default" in _targets(graph)
    assert "aten.relu.default" not in _targets(graph)


def test_a_config_value_a_flag_or_an_input_that_differs_misses(user_code, tmp_path):
    mod = user_code()
    cache = CaptureCache(tmp_path / "c")

    def run(model, x=_X):
        return cached_capture(model, x, model_name="m", planning=False, cache=cache)

    base, how = run(_meta(mod.Net))
    assert how == "miss" and run(_meta(mod.Net))[1] == "hit"
    scaled, how = run(_meta(mod.Net, scale=3.0))  # an attribute forward reads
    assert how == "miss" and scaled.gm.code != base.gm.code  # the constant 3.0
    mod.USE_GELU = True  # a module-level flag set at run time
    flagged, how = run(_meta(mod.Net))
    assert how == "miss" and "aten.gelu.default" in _targets(flagged)
    mod.USE_GELU = False
    wider, how = run(_meta(mod.Net), (torch.zeros(6, 8, device="meta"),))  # another shape
    assert how == "miss" and wider.input_shapes == ((6, 8),)
    assert run(_meta(mod.Net))[1] == "hit"


def test_every_part_of_the_key_changes_it(user_code, monkeypatch):
    """Key by key: state, parameters, tying, hooks, mode, inputs, capture kind, torch's
    switches, autoplan's code and the libraries' versions."""
    mod = user_code()
    key = _key(_meta(mod.Net))
    assert _key(_meta(mod.Net)) == key
    variants = {
        "training mode": _meta(mod.Net).eval(),
        "width": _meta(mod.Net, width=16),
        "dtype": _meta(mod.Net).to(torch.bfloat16),
        "requires_grad": _meta(mod.Net).requires_grad_(False),
        "a new attribute": _meta(mod.Net),
        "a forward hook": _meta(mod.Net),
        "tied weights": _meta(mod.Net),
    }
    variants["a new attribute"].layers[1].note = "x"
    variants["a forward hook"].layers[0].register_forward_hook(lambda m, a, o: o * 2)
    tied = variants["tied weights"]
    tied.layers[1].weight = tied.layers[0].weight
    keys = {name: _key(m, (torch.zeros(8, 8, device="meta"),) if name == "width" else _X)
            for name, m in variants.items()}
    keys["input dtype"] = _key(_meta(mod.Net), (torch.zeros(4, 8, dtype=torch.float64,
                                                            device="meta"),))
    keys["input on cpu"] = _key(_meta(mod.Net), (torch.zeros(4, 8),))
    keys["input as a kwarg"] = capture_key(_meta(mod.Net), (), {"x": _X[0]}, model_name="m",
                                           planning=False)
    keys["planning"] = _key(_meta(mod.Net), planning=True)
    keys["name"] = capture_key(_meta(mod.Net), _X, None, model_name="other", planning=False)
    with torch.autocast("cpu"):
        keys["autocast"] = _key(_meta(mod.Net))
    with torch.no_grad():
        keys["no_grad"] = _key(_meta(mod.Net))
    monkeypatch.setattr(plan_cache_mod, "code_digest", lambda: "edited")
    keys["autoplan's code"] = _key(_meta(mod.Net))
    monkeypatch.undo()
    monkeypatch.setattr(plan_cache_mod, "library_versions", lambda: {"torch": "9.9"})
    keys["torch's version"] = _key(_meta(mod.Net))
    monkeypatch.undo()
    assert _key(_meta(mod.Net)) == key  # and nothing else moved it
    same = [name for name, k in keys.items() if k == key]
    assert same == [] and len(set(keys.values())) == len(keys)


def test_a_model_the_key_cannot_hold_is_captured_every_time(tmp_path, monkeypatch):
    model = _meta(_capture_jobs.Stack)
    model.rng = torch.Generator()  # a C object: its state is not visible
    with pytest.raises(Unfingerprintable, match=r"<root>.rng: a torch._C.Generator"):
        _key(model)
    cache = CaptureCache(tmp_path)
    graph, how = cached_capture(model, _X, model_name="m", planning=False, cache=cache)
    assert how.startswith("off: <root>.rng") and graph.gm.code == \
        capture(_meta(_capture_jobs.Stack), _X).gm.code
    assert not cache.directory.exists()
    monkeypatch.setenv("AUTOPLAN_CAPTURE_CACHE", "0")
    graph, how = cached_capture(_meta(_capture_jobs.Stack), _X, model_name="m", planning=False,
                                cache=cache)
    assert how == "off: AUTOPLAN_CAPTURE_CACHE=0" and not cache.directory.exists()


@pytest.mark.parametrize("damage, why", [
    ("garbage", "unreadable"), ("truncated", "unreadable"), ("another key", "another key's"),
    ("writable by all", "is not this user's own"),
])
def test_a_damaged_entry_is_a_miss_and_is_replaced(tmp_path, damage, why):
    """No crash: the model is captured again and the entry replaced by a whole one (0600)."""
    cache = CaptureCache(tmp_path)
    model = _meta(_capture_jobs.Stack)
    fresh, how = cached_capture(model, _X, model_name="m", planning=False, cache=cache)
    (entry,) = cache.directory.glob("*.graph")
    data = entry.read_bytes()
    if damage == "garbage":
        entry.write_bytes(b"\x00not a graph")
    elif damage == "truncated":
        entry.write_bytes(data[:len(data) // 2])
    elif damage == "another key":
        entry.write_bytes(data.replace(entry.stem.encode(), b"0" * 64, 1))
    else:
        entry.chmod(0o666)
    graph, how = cached_capture(model, _X, model_name="m", planning=False, cache=cache)
    assert how == "miss" and graph.gm.code == fresh.gm.code
    assert why in cache.last_miss
    assert entry.stat().st_mode & 0o777 == 0o600
    read, how = cached_capture(model, _X, model_name="m", planning=False, cache=cache)
    assert how == "hit" and read.gm.code == fresh.gm.code
    assert [p.name for p in cache.directory.iterdir()] == [entry.name]  # no temporary left


def test_ranks_that_capture_together_leave_one_whole_entry(clusters, tmp_path):
    results = clusters.get(2).run(_capture_jobs.capture_together, str(tmp_path), timeout_s=300)
    assert {how for how, _ in results} <= {"miss", "hit"}
    assert len({code for _, code in results}) == 1
    assert [p.suffix for p in (tmp_path / "captures").iterdir()] == [".graph"]
    again = clusters.get(2).run(_capture_jobs.capture_together, str(tmp_path), timeout_s=300)
    assert [how for how, _ in again] == ["hit", "hit"]
    assert {code for _, code in again} == {results[0][1]}
