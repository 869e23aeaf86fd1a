"""The `autoplan` command line, run in-process through `main([...])`."""

from __future__ import annotations

import sys
import types

import pytest
import yaml

from autoplan.cli import main
from autoplan.plan import Plan
from autoplan.topology import preset


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_the_subcommands(capsys):
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    for word in ("plan", "export", "demo", "calibrate", "--global-batch"):
        assert word in out
    code, out, _ = _run(capsys, "plan", "--help")
    assert code == 0 and "--num-layers-capture" in out and "--allow-tp-across-nodes" in out


def test_help_examples_are_valid(capsys, tmp_path):
    """Every example of `autoplan --help` parses; the fixed published-scale one plans (the
    solver is bypassed) and reports TFLOP/s and MFU."""
    import shlex

    from autoplan.cli import _EPILOG, build_parser

    commands = [shlex.split(c.replace("\\\n", " "))
                for c in _EPILOG.split("\n  autoplan ")[1:]]
    assert len(commands) == 4
    for argv in commands:
        build_parser().parse_args(argv)  # SystemExit on a bad example
    fixed = next(a for a in commands if "--tp" in a)
    fixed[fixed.index("-o") + 1] = str(tmp_path / "fixed")
    code, out, err = _run(capsys, *fixed)
    assert code == 0, err
    assert "TFLOP/s per device" in out and "MFU" in out


def test_plan_tiny_writes_the_report(capsys, tmp_path):
    out_dir = tmp_path / "tiny"
    code, out, err = _run(capsys, "plan", "--model", "gpt2-tiny", "--cluster", "local-cpu",
                          "--devices-per-node", "4", "--global-batch", "8", "--seq", "16",
                          "-o", str(out_dir))
    assert code == 0, err
    assert sorted(p.name for p in out_dir.iterdir()) == ["plan.json", "report.html",
                                                         "report.md"]
    plan = Plan.from_json((out_dir / "plan.json").read_text())
    assert plan.mesh.world_size == 4 and plan.global_batch == 8 and plan.seq_len == 16
    assert str(plan) in out
    assert "step time" in out and "per device" in out and "MFU" in out
    assert "## Predicted step" in (out_dir / "report.md").read_text()


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_plan_checkpointing_override(capsys, tmp_path, policy):
    out_dir = tmp_path / policy
    code, _out, err = _run(capsys, "plan", "--model", "gpt2-tiny", "--cluster", "local-cpu",
                           "--devices-per-node", "2", "--global-batch", "4", "--seq", "16",
                           "--checkpointing", policy, "-o", str(out_dir))
    assert code == 0, err
    assert Plan.from_json((out_dir / "plan.json").read_text()).checkpointing == policy


def test_plan_llama3_70b_on_8_dgx_h100_nodes(capsys, tmp_path):
    code, out, err = _run(capsys, "plan", "--model", "llama3-70b", "--cluster", "dgx-h100",
                          "--nodes", "8", "--global-batch", "512", "--seq", "4096",
                          "-o", str(tmp_path))
    assert code == 0, err
    plan = Plan.from_json((tmp_path / "plan.json").read_text())
    assert plan.mesh.world_size == 64
    assert plan.mesh.tp <= 8 and 8 % plan.mesh.tp == 0  # tp groups stay inside a node
    if plan.mesh.tp > 1:
        assert f"tp {plan.mesh.tp:>4}  {plan.mesh.tp} ranks inside one node over nvlink" in out
    assert "step time" in out
    assert "per device (peak rank) of 80 GB on H100-SXM-80GB" in out
    assert plan.prediction.memory_bytes <= 0.9 * 80e9


def test_unknown_preset(capsys, tmp_path):
    code, out, err = _run(capsys, "plan", "--model", "llama9-1t", "--cluster", "dgx-h100",
                          "--global-batch", "8", "--seq", "16", "-o", str(tmp_path / "o"))
    assert code == 2 and out == ""
    assert err.startswith("autoplan: error: unknown model 'llama9-1t'")
    assert "llama3-70b" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    code, _, err = _run(capsys, "plan", "--model", "gpt2-tiny", "--cluster", "dgx-z9000",
                        "--global-batch", "8", "--seq", "16")
    assert code == 2 and "unknown cluster 'dgx-z9000'" in err and "dgx-h100" in err


def test_topology_yaml_missing_a_field(capsys, tmp_path):
    data = preset("dgx-h100").to_dict()
    del data["device"]["mem_bytes"]
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    code, out, err = _run(capsys, "plan", "--model", "gpt2-tiny", "--cluster", str(path),
                          "--global-batch", "8", "--seq", "16", "-o", str(tmp_path / "o"))
    assert code == 2 and out == ""
    assert "autoplan: error:" in err and "'mem_bytes'" in err and "device" in err
    assert not (tmp_path / "o").exists()


def test_batch_not_divisible_by_the_overrides(capsys, tmp_path):
    code, out, err = _run(capsys, "plan", "--model", "gpt2-tiny", "--cluster", "local-cpu",
                          "--devices-per-node", "4", "--global-batch", "10", "--seq", "16",
                          "--dp", "4", "--microbatches", "2", "-o", str(tmp_path / "o"))
    assert code == 2 and out == ""
    assert err.startswith("autoplan: error:")
    for number in ("10", "4", "2"):
        assert number in err
    assert "divisible" in err
    assert not (tmp_path / "o").exists()


def test_no_plan_fits(capsys, tmp_path):
    code, out, err = _run(capsys, "plan", "--model", "llama3-70b", "--cluster", "local-cpu",
                          "--devices-per-node", "1", "--global-batch", "8", "--seq", "64",
                          "-o", str(tmp_path / "o"))
    assert code == 2 and out == ""
    assert "smallest per-device memory any plan needs" in err
    assert "4 GB" in err  # what the device has
    assert "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_usage_errors_exit_2(capsys):
    code, _, err = _run(capsys, "plan", "--model", "gpt2-tiny", "--cluster", "local-cpu",
                        "--global-batch", "0", "--seq", "16")
    assert code == 2 and "expected an integer >= 1" in err
    code, _, err = _run(capsys, "plan", "--model", "gpt2-tiny")
    assert code == 2 and "required" in err


def test_export_arguments_reach_export_plan(capsys, tmp_path, monkeypatch):
    """Parsing and wiring only: the planning and the export are replaced by fakes."""
    seen = {}

    def fake_plan(args, num_layers):
        seen["args"], seen["num_layers"] = args, num_layers
        return "graph", preset("local-cpu"), _FakePlan()

    def fake_export(graph, plan, out_dir):
        seen["export"] = (graph, plan, out_dir)
        return {"plan.json": out_dir / "plan.json"}

    monkeypatch.setattr("autoplan.cli._plan", fake_plan)
    monkeypatch.setattr("autoplan.report.render_summary", lambda plan, topology: "summary")
    monkeypatch.setattr("autoplan.passes.export.export_plan", fake_export)
    code, out, err = _run(capsys, "export", "--model", "gpt2-tiny", "--cluster", "local-cpu",
                          "--global-batch", "8", "--seq", "16", "--tp", "2", "--zero", "3",
                          "--schedule", "gpipe", "-o", str(tmp_path / "x"))
    assert code == 0, err
    args = seen["args"]
    assert (args.tp, args.zero, args.schedule, args.global_batch) == (2, 3, "gpipe", 8)
    assert seen["num_layers"] is None  # export captures the full depth
    assert seen["export"][0] == "graph" and str(seen["export"][2]) == str(tmp_path / "x")
    assert "summary" in out


def test_export_failure_leaves_no_directory(capsys, tmp_path, monkeypatch):
    def fake_export(graph, plan, out_dir):
        out_dir.mkdir()
        (out_dir / "rank0_stage0.py").write_text("partial")
        raise ValueError("cannot export")

    monkeypatch.setattr("autoplan.cli._plan",
                        lambda args, n: ("graph", preset("local-cpu"), _FakePlan()))
    monkeypatch.setattr("autoplan.passes.export.export_plan", fake_export)
    code, _, err = _run(capsys, "export", "--model", "gpt2-tiny", "--cluster", "local-cpu",
                        "--global-batch", "8", "--seq", "16", "-o", str(tmp_path / "x"))
    assert code == 2 and "cannot export" in err
    assert not (tmp_path / "x").exists()


class _FakePlan:
    pass


def test_demo_and_calibrate_are_wired(monkeypatch):
    calls = []

    def fake_main(name):
        def run(**kwargs):
            calls.append((name, kwargs))
            return 0
        return run

    for name in ("demo", "calibrate"):
        module = types.ModuleType(f"autoplan.{name}")
        module.main = fake_main(name)
        monkeypatch.setitem(sys.modules, f"autoplan.{name}", module)
    assert main(["demo", "--steps", "3", "--world-size", "2", "-o", "d"]) == 0
    assert main(["demo"]) == 0  # the demo's own defaults, except --world-size's 4
    assert main(["calibrate", "-o", "c.yaml", "--max-ranks", "8"]) == 0
    assert calls == [("demo", {"steps": 3, "world_size": 2, "out_dir": "d"}),
                     ("demo", {"world_size": 4}),
                     ("calibrate", {"out_path": "c.yaml", "max_ranks": 8})]


def test_missing_optional_command_is_a_clear_failure(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "autoplan.calibrate", None)  # import raises
    code, _, err = _run(capsys, "calibrate")
    assert code == 1 and "autoplan calibrate" in err and "not available" in err


def test_output_path_that_is_a_file_fails_before_planning(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("keep")
    for out in (blocker, blocker / "sub"):
        code, out_text, err = _run(capsys, "plan", "--model", "gpt2-tiny", "--cluster",
                                   "local-cpu", "--global-batch", "4", "--seq", "16",
                                   "-o", str(out))
        assert code == 2 and f"{blocker} is a file" in err and "step time" not in out_text
    code, _, err = _run(capsys, "calibrate", "-o", str(tmp_path))
    assert code == 2 and "is a directory" in err
    assert blocker.read_text() == "keep"


def test_local_cpu_memory_follows_devices_per_node(capsys, tmp_path, monkeypatch):
    """The local-cpu ranks share the machine's RAM: --devices-per-node 2 gives each twice
    what 4 ranks get."""
    monkeypatch.setenv("AUTOPLAN_CALIBRATION", str(tmp_path / "absent.yaml"))
    per_rank = {}
    for n in (2, 4):
        code, _, err = _run(capsys, "plan", "--model", "gpt2-tiny", "--cluster", "local-cpu",
                            "--devices-per-node", str(n), "--global-batch", "4", "--seq", "16",
                            "-o", str(tmp_path / str(n)))
        assert code == 0, err
        per_rank[n] = preset("local-cpu", devices_per_node=n).device.mem_bytes
        report = (tmp_path / str(n) / "report.md").read_text()
        assert f"{per_rank[n] / 1e9:.3g} GB" in report, report
    assert per_rank[2] == 2 * per_rank[4]
