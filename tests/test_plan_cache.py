"""The plan cache ([Note: plan cache] in autoplan/cache.py): the same `autoplan plan` request is
answered from disk with the same output, never for a request that differs in anything the plan
depends on. Each test has an empty cache of its own (conftest.py, AUTOPLAN_CACHE_DIR)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autoplan import cache as cache_mod
from autoplan.cache import PlanCache, code_digest, graph_fingerprint, request_key
from autoplan.cli import main

_TINY = ("--model", "gpt2-tiny", "--cluster", "local-cpu", "--devices-per-node", "2",
         "--global-batch", "8", "--seq", "16")
_ROOT = Path(__file__).resolve().parent.parent


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _entries() -> list[Path]:
    return sorted((Path(os.environ["AUTOPLAN_CACHE_DIR"]) / "plans").glob("*.json"))


def test_the_same_request_is_answered_from_the_cache_with_the_same_output(capsys, tmp_path,
                                                                         monkeypatch):
    code, out_cold, err = _run(capsys, "plan", *_TINY, "-o", str(tmp_path / "cold"))
    assert code == 0, err
    assert "read from the plan cache" not in err and len(_entries()) == 1
    code, out_warm, err = _run(capsys, "plan", *_TINY, "-o", str(tmp_path / "warm"))
    assert code == 0, err
    assert "read from the plan cache" in err and "--no-cache plans anew" in err
    assert out_warm.replace("warm", "cold") == out_cold
    for name in ("plan.json", "report.md", "report.html"):
        assert (tmp_path / "warm" / name).read_text() == (tmp_path / "cold" / name).read_text()
    # --json from the same entry: the files are this run's
    code, out, err = _run(capsys, "plan", *_TINY, "--json", "-o", str(tmp_path / "j"))
    summary = json.loads(out)
    assert "read from the plan cache" in err
    assert summary["files"] == [str(tmp_path / "j" / n)
                                for n in ("plan.json", "report.md", "report.html")]
    assert summary["mesh"] == json.loads((tmp_path / "cold" / "plan.json").read_text())["mesh"]
    # --no-cache plans anew (and -q says nothing about the cache)
    import autoplan.cli

    planned = []
    real_plan = autoplan.cli._plan
    monkeypatch.setattr(autoplan.cli, "_plan",
                        lambda args, n: planned.append(n) or real_plan(args, n))
    code, out, err = _run(capsys, "plan", *_TINY, "--no-cache")
    assert code == 0 and planned == [2] and "plan cache" not in err
    assert out == out_cold.split("wrote ")[0]  # the same summary, no files
    code, _, err = _run(capsys, "plan", *_TINY, "-q")
    assert code == 0 and err == "" and planned == [2]


def test_a_request_that_differs_is_planned_anew(capsys, tmp_path):
    """Another flag, or the same topology file with another figure, is another key."""
    topo = tmp_path / "cluster.yaml"
    subprocess.run([sys.executable, "-c", "from autoplan.topology import preset, save_topology;"
                    f"save_topology(preset('local-cpu', devices_per_node=2), {str(topo)!r})"],
                   check=True, env={**os.environ, "PYTHONPATH": str(_ROOT)})
    args = [str(topo) if a == "local-cpu" else a for a in _TINY]
    assert _run(capsys, "plan", *args, "-q")[0] == 0
    assert _run(capsys, "plan", *args, "-q", "--zero", "0")[0] == 0
    assert len(_entries()) == 2
    data = yaml.safe_load(topo.read_text())
    data["intra_node"]["latency_s"] *= 2  # the same name, another figure
    topo.write_text(yaml.safe_dump(data))
    code, _, err = _run(capsys, "plan", *args)
    assert code == 0 and "read from the plan cache" not in err
    assert len(_entries()) == 3


def test_an_unreadable_entry_is_a_miss_and_is_replaced(capsys):
    assert _run(capsys, "plan", *_TINY, "-q")[0] == 0
    (entry,) = _entries()
    good = entry.read_text()
    entry.write_text(good[: len(good) // 2])  # half-written by something else
    code, _, err = _run(capsys, "plan", *_TINY)
    assert code == 0 and "read from the plan cache" not in err
    assert json.loads(entry.read_text())["entry"] == json.loads(good)["entry"]


def test_the_key_covers_the_code_the_libraries_and_the_request(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    (package / "cost_model").mkdir(parents=True)
    (package / "cost_model" / "comm.py").write_text("ALPHA_S = 5e-06\n")
    before = code_digest(package)
    (package / "cost_model" / "comm.py").write_text("ALPHA_S = 6e-06\n")
    assert code_digest(package) != before
    request = {"model": "m", "spec": {"global_batch": 8}}
    key = request_key(request)
    assert request_key({"model": "m", "spec": {"global_batch": 16}}) != key
    monkeypatch.setattr(cache_mod, "code_digest", lambda: "edited")
    assert request_key(request) != key
    monkeypatch.undo()
    monkeypatch.setattr(cache_mod, "library_versions", lambda: {"torch": "9.9"})
    assert request_key(request) != key
    monkeypatch.undo()
    assert request_key(request) == key
    with pytest.raises(TypeError):
        request_key({"model": object()})  # never keyed by repr()


def test_a_stored_request_that_differs_from_the_asked_one_is_a_miss(tmp_path, monkeypatch):
    """The whole keyed document is compared, not only its hash."""
    cache = PlanCache(tmp_path)
    cache.put({"a": 1}, {"plan": "x"})
    assert cache.get({"a": 1}) == {"plan": "x"}
    monkeypatch.setattr(cache_mod, "_hash", lambda keyed: "same-for-all")
    cache.put({"a": 1}, {"plan": "x"})
    assert cache.get({"a": 2}) is None and cache.get({"a": 1}) == {"plan": "x"}


def test_a_cached_plan_imports_no_torch(capsys, tmp_path):
    """What makes the warm path fast: reading the entry and writing the files import neither
    torch nor the solver."""
    assert _run(capsys, "plan", *_TINY, "-q")[0] == 0
    script = ("import sys; from autoplan.cli import main; "
              f"code = main({['plan', *_TINY, '-o', str(tmp_path / 'w')]!r}); "
              "print(code, 'torch' in sys.modules, 'ortools' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(_ROOT)}, timeout=120)
    assert "read from the plan cache" in proc.stderr, proc.stderr
    assert proc.stdout.splitlines()[-1] == "0 False False"
    assert (tmp_path / "w" / "report.html").is_file()


def test_graph_fingerprint_follows_what_the_planner_reads():
    from autoplan.capture import capture_preset

    one = capture_preset("mlp-tiny", batch=4, seq_len=8)
    assert graph_fingerprint(one) == graph_fingerprint(capture_preset("mlp-tiny", batch=4,
                                                                      seq_len=8))
    assert graph_fingerprint(one) != graph_fingerprint(capture_preset("mlp-tiny", batch=4,
                                                                      seq_len=16))
    one.total_layers = 64  # planned at another depth
    assert graph_fingerprint(one) != graph_fingerprint(capture_preset("mlp-tiny", batch=4,
                                                                      seq_len=8))


def test_autoparallel_reads_a_plan_it_made_before(capsys, monkeypatch):
    """A restarted job captures again and reads its plan from the cache instead of solving;
    AUTOPLAN_PLAN_CACHE=0 solves."""
    import autoplan
    from autoplan.models import build_model

    def planned():
        model = autoplan.autoparallel(build_model("gpt2-tiny"), global_batch=8, seq_len=16,
                                      cluster="dgx-h100")
        plan = model.plan
        return plan, capsys.readouterr().err

    first, err = planned()
    assert "plan cache" not in err and len(_entries()) == 1
    again, err = planned()
    assert "read from the plan cache" in err
    assert again == first and again.to_json() == first.to_json()
    monkeypatch.setenv("AUTOPLAN_PLAN_CACHE", "0")
    fresh, err = planned()
    assert "plan cache" not in err and fresh == first
