"""The dry-run bench (bench/dryrun.py, issue 26): its --quick run writes the JSON schema with
the bars computed from the numbers, its default ranks are one per kind of rank, and its case
list is the issue's (runnable flags). The full bench plans 405B models; these
are its pieces, in seconds."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from autoplan.plan import MeshShape
from autoplan.runtime.dryrun import CATEGORIES, rank_coordinates

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    from _helpers import load_bench

    return load_bench("dryrun")


def test_quick_run_writes_every_rank_with_its_bars(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "dryrun.json"
    status = bench.main(["--quick", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert status == (0 if doc["all_within_bars"] else 1)
    assert doc["quick"] and set(doc["bars"]) == {"peak", "flops", "collective_bytes", "time"}
    assert set(doc["cases"]) == set(bench.QUICK_CASES)
    kinds = {name: [r["kind"] for r in case["ranks"]] for name, case in doc["cases"].items()}
    assert kinds == {"gpt2-tiny-pp2": ["first", "last"],
                     "gpt2-demo-pp3": ["first", "middle", "last"]}
    ok = True
    for case in doc["cases"].values():
        pp = case["mesh"]["pp"]
        assert case["status"] == "run" and case["world_size"] == \
            pp * case["mesh"]["dp"] * case["mesh"].get("cp", 1) * case["mesh"]["tp"]
        for r in case["ranks"]:
            assert "error" not in r, r["error"]
            stage = {"first": 0, "middle": pp // 2, "last": pp - 1}[r["kind"]]
            assert r["coordinates"] == {"pp": stage, "dp": 0, "cp": 0, "tp": 0}
            assert set(r["peak_by_category"]) == set(CATEGORIES)
            assert sum(r["peak_by_category"].values()) == r["peak_bytes"] > 0
            assert r["predicted_peak_bytes"] > 0 and r["flops"] > 0
            assert {"dp", "pp", "tp"} <= set(r["bytes_by_axis"])
            # priced per axis; the bar is the numbers' (priced / measured - 1 on each axis)
            priced, measured = r["priced_bytes_by_axis"], r["bytes_by_axis"]
            assert {"dp", "pp", "tp"} <= set(priced)
            errors = {a: priced.get(a, 0) / b - 1 for a, b in measured.items()}
            assert r["collective_bytes_ok"] == (set(priced) <= set(measured) and all(
                abs(e) <= 0.05 for e in errors.values()))
            # the bars are the numbers' (predicted / measured - 1 within the bands)
            peak_error = r["predicted_peak_bytes"] / r["peak_bytes"] - 1
            flops_error = r["predicted_flops"] / r["flops"] - 1
            assert r["peak_error"] == pytest.approx(peak_error)
            assert r["peak_ok"] == (abs(peak_error) <= 0.05)
            assert r["flops_ok"] == (abs(flops_error) <= 0.02)
            assert r["time_ok"] == (r["wall_s"] <= 300) and r["step_s"] < r["wall_s"]
            assert r["ok"] == (r["peak_ok"] and r["flops_ok"] and r["collective_bytes_ok"]
                               and r["time_ok"])
            ok = ok and r["ok"]
    assert doc["all_within_bars"] == ok
    lines = capsys.readouterr().out.splitlines()
    assert sum(" rank " in line for line in lines) == 5  # one line per rank as it finishes
    within = sum(r["ok"] for case in doc["cases"].values() for r in case["ranks"])
    assert lines[-1].startswith(f"{within} of 5 ranks within the bars")
    # the docs/benchmarks.md table: a header, a rule and a row per rank
    assert bench.main(["--markdown", "--out", str(out)]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert table[0].startswith("| case | rank | measured peak | predicted | error |")
    assert len(table) == 2 + 5 and "gpt2-demo-pp3 (pp3xdp2xtp2)" in table[-1]


def test_bars_are_computed_from_the_numbers():
    check = _bench().check
    row = dict(peak_bytes=100, predicted_peak_bytes=107, flops=1000, predicted_flops=1000,
               wall_s=10.0, bytes_by_axis={"dp": 1000, "tp": 100},
               priced_bytes_by_axis={"dp": 1000.0, "tp": 104.0})
    result = check(row)
    assert result["peak_error"] == pytest.approx(0.07)
    assert not result["peak_ok"] and result["flops_ok"] and not result["ok"]
    assert check({**row, "predicted_peak_bytes": 96})["ok"]  # -4 %: within 5 %
    assert not check({**row, "predicted_peak_bytes": 100, "predicted_flops": 1030})["flops_ok"]
    assert not check({**row, "predicted_peak_bytes": 100, "wall_s": 301.0})["ok"]
    # bytes per axis: each within 5 %; the farthest axis is named, an unpriced plan fails
    assert result["collective_bytes_ok"] and result["axis_differs_most"] is None
    off = check({**row, "priced_bytes_by_axis": {"dp": 1000.0, "tp": 90.0, "pp": 8.0}})
    assert not off["collective_bytes_ok"] and off["axis_differs_most"] == "pp"
    assert off["axis_errors"]["tp"] == pytest.approx(-0.1)
    assert not check({**row, "priced_bytes_by_axis": {}})["collective_bytes_ok"]
    nothing = check({**row, "peak_bytes": 0})  # nothing measured: no error, no bar holds
    assert nothing["peak_error"] is None and not nothing["peak_ok"]


def test_default_ranks_are_one_per_pipeline_stage_kind():
    bench = _bench()
    for mesh, expected in [
        (MeshShape(pp=1, dp=8, tp=1), {0: "only"}),
        (MeshShape(pp=2, dp=2, tp=2), {0: "first", 4: "last"}),
        (MeshShape(pp=4, dp=2, tp=2), {0: "first", 8: "middle", 12: "last"}),
        (MeshShape(pp=32, dp=16, cp=8, tp=4), {0: "first", 16 * 512: "middle",
                                               31 * 512: "last"}),
    ]:
        plan = SimpleNamespace(mesh=mesh)
        assert bench.default_ranks(plan) == expected
        for rank in (0, mesh.world_size // 3, mesh.world_size - 1):  # the inverse
            assert bench.rank_at(plan, rank_coordinates(plan, rank)) == rank


def test_the_issue_s_cases_are_runnable_flags(tmp_path):
    from autoplan.cli import build_parser
    from autoplan.models import PRESETS

    bench = _bench()
    assert set(bench.CASES) == {"llama3-8b", "llama3-70b", "llama3-405b", "llama3.1-405b-128k",
                                "gpt3-175b", "gpt-1t", "mixtral-8x7b-ep8",
                                "llama3-8b-offload-h200"}
    for flags in [*bench.CASES.values(), *bench.QUICK_CASES.values()]:
        args = build_parser().parse_args(["dryrun", *flags])
        assert args.model in PRESETS
    for name in bench.GOLDEN_OF.values():  # the golden plan each case is compared with
        assert (ROOT / "tests" / "golden" / f"{name}.plan.json").is_file()
    # the SC'21 recipe, fixed; the MoE with expert parallelism, at the balanced routing a
    # dry run has ([Note: dry run routing])
    assert bench.CASES["gpt-1t"][-6:] == ["--tp", "8", "--pp", "64", "--dp", "6"]
    assert bench.CASES["mixtral-8x7b-ep8"][-4:] == ["--ep", "8", "--routing-skew", "1"]
    out = tmp_path / "dryrun.json"
    assert bench.main(["--cases", "nope", "--out", str(out)]) == 2
