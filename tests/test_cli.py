"""The `autoplan` command line, run in-process through `main([...])`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import yaml

from autoplan.cli import main
from autoplan.cli_output import Planned as _Planned
from autoplan.plan import Alternative, MeshShape, Plan, Prediction, Stage
from autoplan.topology import load_topology, preset

_REPO = Path(__file__).resolve().parents[1]
_TINY = ("--model", "gpt2-tiny", "--cluster", "local-cpu", "--global-batch", "8", "--seq", "16")


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_the_subcommands(capsys):
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    for word in ("plan", "explain", "diff", "export", "demo", "calibrate", "--global-batch",
                 "AUTOPLAN_VERBOSITY", "AUTOPLAN_COLLECTIVE_TIMEOUT_S"):
        assert word in out
    code, out, _ = _run(capsys, "plan", "--help")
    assert code == 0 and "--num-layers-capture" in out and "--allow-tp-across-nodes" in out


def test_help_examples_are_valid(capsys, tmp_path):
    """Every example of `autoplan --help` parses; the fixed published-scale one plans (the
    solver is bypassed) and reports TFLOP/s and MFU."""
    import shlex

    from autoplan.cli import build_parser
    from autoplan.cli_args import EPILOG as _EPILOG

    examples = _EPILOG.split("\n\nenvironment:")[0]
    commands = [shlex.split(c.replace("\\\n", " "))
                for c in examples.split("\n  autoplan ")[1:]]
    assert len(commands) == 7
    for argv in commands:
        build_parser().parse_args(argv)  # SystemExit on a bad example
    fixed = next(a for a in commands if "--tp" in a)
    fixed[fixed.index("-o") + 1] = str(tmp_path / "fixed")
    code, out, err = _run(capsys, *fixed)
    assert code == 0, err
    assert "FLOP/s per device" in out and "MFU" in out


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
    assert str(plan.mesh) in out
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
    last = err.strip().splitlines()[-1]  # after the progress lines of the capture
    assert last.startswith("autoplan: error:")
    for number in ("10", "4", "2"):
        assert number in last
    assert "divisible" in last
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


@pytest.mark.parametrize("field, value, message", [
    ("num_attention_heads", 5, "num_attention_heads 5 does not divide hidden_size 32 (the "
     "width splits into the heads); set num_attention_heads to a divisor of 32, e.g. 4 or 8"),
    ("hidden_size", -64, "hidden_size -64 must be a positive integer"),
    ("vocab_size", "abc", "vocab_size 'abc' must be a positive integer"),
    ("num_key_value_heads", 3, "num_key_value_heads 3 does not divide num_attention_heads 8"),
])
def test_bad_model_config_is_one_error_line(capsys, tmp_path, field, value, message):
    """A config.json whose sizes cannot build a model fails before capture (no traceback from
    transformers, no SDPA broadcast error), in one line naming the field and the fix."""
    config = json.loads((_REPO / "autoplan/models/configs/llama-tiny.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config, field: value}))
    code, out, err = _run(capsys, "plan", "--model", str(path), "--cluster", "local-cpu",
                          "--global-batch", "8", "--seq", "16", "--no-cache")
    assert code == 2 and out == "", err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"autoplan: error: model config {str(path)!r}: {message}"), err


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
        return _Planned("graph", preset("local-cpu"), _FakePlan())

    def fake_export(graph, plan, out_dir, planned):
        seen["export"] = (graph, plan, out_dir)
        return {"plan.json": out_dir / "plan.json"}

    monkeypatch.setattr("autoplan.cli._plan", fake_plan)
    monkeypatch.setattr("autoplan.report.render_summary",
                        lambda plan, topology, graph: "summary")
    # cli._export (not export_plan): with a process group in this process -- a single-process
    # build earlier in the session keeps its private one -- export_plan runs in a forked child
    monkeypatch.setattr("autoplan.cli._export", fake_export)
    code, out, err = _run(capsys, "export", "--model", "gpt2-tiny", "--cluster", "local-cpu",
                          "--global-batch", "8", "--seq", "16", "--tp", "2", "--zero", "3",
                          "--schedule", "gpipe", "-o", str(tmp_path / "x"))
    assert code == 0, err
    args = seen["args"]
    assert (args.tp, args.zero_stage, args.schedule, args.global_batch) == (2, 3, "gpipe", 8)
    assert seen["num_layers"] is None  # export captures the full depth
    assert seen["export"][0] == "graph" and str(seen["export"][2]) == str(tmp_path / "x")
    assert "summary" in out


def test_export_failure_leaves_no_directory(capsys, tmp_path, monkeypatch):
    def fake_export(graph, plan, out_dir, planned):
        out_dir.mkdir()
        (out_dir / "rank0_stage0.py").write_text("partial")
        raise ValueError("cannot export")

    monkeypatch.setattr("autoplan.cli._plan",
                        lambda args, n: _Planned("graph", preset("local-cpu"), _FakePlan()))
    monkeypatch.setattr("autoplan.cli._export", fake_export)  # see the test above
    code, _, err = _run(capsys, "export", "--model", "gpt2-tiny", "--cluster", "local-cpu",
                        "--global-batch", "8", "--seq", "16", "-o", str(tmp_path / "x"))
    assert code == 2 and "cannot export" in err
    assert not (tmp_path / "x").exists()


class _FakePlan:
    microbatch_size = 8  # the tests' --global-batch: planned at it, export captures nothing again
    mesh = MeshShape()  # cp 1: no capture at seq / cp either


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


# --- start-up, version, public names --------------------------------------------------------

def test_cli_imports_no_torch():
    """`import autoplan` and `import autoplan.cli` with its parser import no torch (what makes
    `autoplan --help` fast); the installed `autoplan --help` exits 0."""
    check = ("import sys, autoplan, autoplan.cli; autoplan.cli.build_parser(); "
             "autoplan.__version__; "
             "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    subprocess.run([sys.executable, "-c", check], check=True, cwd=_REPO, timeout=120)
    script = Path(sys.executable).parent / "autoplan"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "autoplan.cli"]
    done = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: autoplan")


def test_plan_imports_only_the_planning_path(tmp_path):
    """A cold `autoplan plan` (capture, solve, report) imports none of what training, export or
    a terminal needs: the runtime, the decorator's module, the export pass, the kernels, the
    calibration and demo commands, torch's pipelining, rich (stderr is no terminal here) -- each
    would add to the 8 s a cold plan may take (bench/plan_speed.py, cli-cold)."""
    unwanted = ("autoplan.runtime", "autoplan.api", "autoplan.passes.export", "autoplan.calibrate",
                "autoplan.demo", "kernels", "torch.distributed.pipelining", "rich")
    check = ("import sys; from autoplan.cli import main; "
             f"code = main(['plan', *{list(_TINY)!r}, '--no-cache', '-q', "
             f"'-o', {str(tmp_path / 'out')!r}]); "
             f"bad = sorted(m for m in sys.modules if m.startswith({unwanted!r})); "
             "assert code == 0 and not bad, (code, bad)")
    env = {**os.environ, "AUTOPLAN_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          cwd=_REPO, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_plan_command_ends_without_teardown_and_loses_nothing(tmp_path):
    """The `autoplan` entry point (`console`) ends `plan` with os._exit once everything is
    printed and written ([Note: exit without teardown] in autoplan/collector.py): no atexit
    handler runs (the marker below is never printed), yet the summary, the error line and the
    exit status are all there, and the files are whole; `main()` in a process returns."""
    marker = ("import atexit, sys; atexit.register(lambda: print('TEARDOWN', file=sys.stderr)); "
              "from autoplan.cli import console; sys.exit(console())")
    env = {**os.environ, "AUTOPLAN_CACHE_DIR": str(tmp_path / "cache")}

    def run(*argv):
        return subprocess.run([sys.executable, "-c", marker, *argv], capture_output=True,
                              text=True, cwd=_REPO, env=env, timeout=300)

    done = run("plan", *_TINY, "--no-cache", "-o", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TEARDOWN" not in done.stderr
    assert done.stdout.startswith("plan ") and "wrote " in done.stdout.splitlines()[-1]
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["mesh"] and (tmp_path / "out" / "report.html").read_text().endswith("</html>\n")
    bad = run("plan", "--model", "no-such-model", *_TINY[2:])
    assert bad.returncode == 2 and "TEARDOWN" not in bad.stderr
    assert bad.stderr.startswith("autoplan: error:") and "no-such-model" in bad.stderr
    other = run("--version")  # a command that did not ask for it exits the ordinary way
    assert other.returncode == 0 and "TEARDOWN" in other.stderr


def test_version(capsys):
    import importlib.metadata
    import tomllib

    import autoplan

    code, out, _ = _run(capsys, "--version")
    assert code == 0 and out == f"autoplan {autoplan.__version__}\n"
    # defined once: pyproject.toml reads autoplan.__version__
    project = tomllib.loads((_REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "autoplan.__version__"}
    installed = importlib.metadata.version("autoplan")
    assert installed == autoplan.__version__, "the installed metadata is stale: pip install -e ."


def test_public_names_load_on_first_use():
    import autoplan
    import autoplan.api
    import autoplan.spec
    import autoplan.topology
    from autoplan import (
        AutoParallel, Topology, TrainingSpec, autoparallel, from_pretrained, load_topology,
    )
    from autoplan import Plan as PlanName
    from autoplan import preset as preset_name

    assert (autoparallel, AutoParallel, from_pretrained) == (
        autoplan.api.autoparallel, autoplan.api.AutoParallel, autoplan.api.from_pretrained)
    assert (PlanName, TrainingSpec, Topology) == (Plan, autoplan.spec.TrainingSpec,
                                                  autoplan.topology.Topology)
    assert (load_topology, preset_name) == (autoplan.topology.load_topology, preset)
    assert set(autoplan.__all__) <= set(dir(autoplan))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        autoplan.no_such_name  # noqa: B018


# --- --json, progress -------------------------------------------------------------------------

def test_plan_json_is_all_of_stdout(capsys, tmp_path):
    out_dir = tmp_path / "j"
    code, out, err = _run(capsys, "plan", *_TINY, "--devices-per-node", "4", "--json", "-q",
                          "-o", str(out_dir))
    assert code == 0, err
    assert err == ""  # -q: no progress lines, and this plan has no warning
    summary = json.loads(out)
    plan = Plan.from_json((out_dir / "plan.json").read_text())
    assert summary["mesh"] == {"pp": plan.mesh.pp, "dp": plan.mesh.dp, "tp": plan.mesh.tp}
    assert summary["world_size"] == 4 and summary["model"] == "gpt2-tiny"
    for key in ("zero_stage", "num_microbatches", "microbatch_size", "schedule",
                "checkpointing", "global_batch", "seq_len"):
        assert summary[key] == getattr(plan, key), key
    prediction = summary["prediction"]
    # at 6 significant digits (float residue dropped)
    assert prediction["step_time_s"] == pytest.approx(plan.prediction.step_time_s, rel=1e-5)
    assert prediction["memory_bytes"] == pytest.approx(plan.prediction.memory_bytes, rel=1e-5)
    assert prediction["mfu"] == pytest.approx(plan.prediction.mfu, rel=1e-5)
    assert all(len(repr(v)) <= 13 for v in prediction.values() if isinstance(v, float))
    assert prediction["tokens_per_s"] == pytest.approx(8 * 16 / plan.prediction.step_time_s,
                                                       rel=1e-5)
    assert [a["mesh"] for a in summary["alternatives"]] == [
        a["mesh"] for a in plan.to_dict()["alternatives"]]
    assert sorted(Path(f).name for f in summary["files"]) == ["plan.json", "report.html",
                                                              "report.md"]
    assert all(Path(f).parent == out_dir for f in summary["files"])
    assert summary["warnings"] == []


def _hand_made_plan() -> Plan:
    return Plan(model="gpt2-tiny", topology="local-cpu", mesh=MeshShape(pp=1, dp=2, tp=2),
                zero_stage=1, global_batch=8, num_microbatches=2, microbatch_size=2, seq_len=16,
                schedule="1f1b", stages=(Stage(0, 0, 2),),
                prediction=Prediction(step_time_s=0.5, compute_s=0.4, comm_s=0.1, bubble_s=0.0,
                                      memory_bytes=3e6, mfu=0.25),
                alternatives=(Alternative(MeshShape(1, 4, 1), 0, 1, "1f1b", 0.75, 2e6,
                                          "communication: +250 ms per step"),))


def test_export_json(capsys, tmp_path, monkeypatch):
    """Wiring only: the planning and the export are fakes."""
    plan = _hand_made_plan()
    monkeypatch.setattr("autoplan.cli._plan", lambda args, n: _Planned(
        "graph", preset("local-cpu", devices_per_node=4), plan, ("a warning",)))
    monkeypatch.setattr("autoplan.passes.export.export_plan", lambda graph, plan, out, planned: {
        "plan.json": out / "plan.json", "rank0_stage0.py": out / "rank0_stage0.py"})
    out_dir = tmp_path / "x"
    code, out, err = _run(capsys, "export", *_TINY, "--json", "-o", str(out_dir))
    assert code == 0, err
    summary = json.loads(out)
    assert summary["files"] == [str(out_dir / "plan.json"), str(out_dir / "rank0_stage0.py")]
    assert summary["mesh"] == {"pp": 1, "dp": 2, "tp": 2} and summary["zero_stage"] == 1
    assert summary["prediction"]["step_time_s"] == 0.5
    assert summary["prediction"]["tokens_per_s"] == 8 * 16 / 0.5
    assert summary["alternatives"][0]["mesh"] == {"pp": 1, "dp": 4, "tp": 1}
    assert summary["alternatives"][0]["reason"] == "communication: +250 ms per step"
    assert summary["warnings"] == ["a warning"] and summary["device"] == "cpu-rank"


def test_progress_phases_and_verbosity(capsys, tmp_path, monkeypatch):
    """Capture, planning and writing each run in a progress phase; -q / -v set the verbosity
    for the run and restore it after."""
    import autoplan.progress

    phases, levels = [], []

    @contextlib.contextmanager
    def recorded(what, **_kwargs):
        phases.append(what)
        yield

    monkeypatch.setattr("autoplan.cli.phase", recorded)
    monkeypatch.setattr("autoplan.cli.set_verbosity", levels.append)
    before = autoplan.progress.verbosity()
    out_dir = tmp_path / "v"
    code, _, err = _run(capsys, "plan", *_TINY, "--devices-per-node", "2", "-v",
                        "-o", str(out_dir))
    assert code == 0, err
    assert levels == [2, before]
    assert [p.split(" ")[0] for p in phases] == ["capturing", "planning", "writing"]
    assert "gpt2-tiny" in phases[0] and "2 x cpu-rank" in phases[1]
    assert str(out_dir) in phases[2]
    assert main(["calibrate", "-q", "--max-ranks", "1", "-o", str(tmp_path / "c.yaml")]) == 2
    assert levels[2:] == [0, before]
    capsys.readouterr()


# --- errors in the command line's words ---------------------------------------------------------

def test_tp_across_nodes_names_the_flag(capsys):
    two_nodes = ("--nodes", "2", "--devices-per-node", "2", "--tp", "4")
    code, out, err = _run(capsys, "plan", *_TINY, *two_nodes)
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1] == ("autoplan: error: tp 4 spans nodes of 2 devices; "
                                            "pass --allow-tp-across-nodes to allow it")
    code, out, err = _run(capsys, "plan", *_TINY, *two_nodes, "--allow-tp-across-nodes", "-q")
    assert code == 0, err
    assert "pp 1 x dp 1 x tp 4" in out


def test_python_api_names_its_keyword():
    import autoplan
    from autoplan.models import build_model
    from autoplan.solver import InvalidConfig

    model = autoplan.autoparallel(build_model("gpt2-tiny"), global_batch=8, seq_len=16,
                                  cluster="dgx-h100", num_nodes=2, tp=16)
    with pytest.raises(InvalidConfig) as raised:
        model.plan  # noqa: B018
    assert str(raised.value) == ("tp 16 spans nodes of 8 devices; pass "
                                 "allow_tp_across_nodes=True to allow it")
    assert raised.value.option == "allow_tp_across_nodes"


def _no_planning(args, num_layers):
    raise AssertionError("planned before checking the output path")


@pytest.mark.skipif(os.geteuid() == 0, reason="root passes os.access checks and writes anyway")
def test_output_in_a_read_only_directory_fails_before_planning(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("autoplan.cli._plan", _no_planning)
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        code, out, err = _run(capsys, "plan", *_TINY, "-o", str(read_only / "out"))
        assert code == 2 and out == ""
        assert err == (f"autoplan: error: -o {read_only / 'out'}: cannot create out in "
                       f"{read_only}: permission denied\n")
        code, _, err = _run(capsys, "calibrate", "-o", str(read_only / "sub" / "c.yaml"))
        assert code == 2 and f"cannot create sub/c.yaml in {read_only}" in err
    finally:
        read_only.chmod(0o700)
    assert list(read_only.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs a Linux /proc")
def test_output_under_proc_fails_before_planning(capsys, monkeypatch):
    """/proc takes no new entries, not even from root (for whom os.access says yes)."""
    monkeypatch.setattr("autoplan.cli._plan", _no_planning)
    for out_dir in ("/proc/x", "/proc/x/y"):
        code, out, err = _run(capsys, "plan", *_TINY, "-o", out_dir)
        assert code == 2 and out == ""
        assert err.startswith(f"autoplan: error: -o {out_dir}: cannot create "
                              f"{out_dir.removeprefix('/proc/')} in /proc: ")
    assert not Path("/proc/x").exists()


# --- warnings of the plan ---------------------------------------------------------------------

def test_a_tp_that_splits_no_attention_head_warns(capsys):
    """gpt2-tiny has 4 attention heads: tp 8 splits no head, the attention weights stay
    replicated, and the CLI says so (stderr, and in the JSON summary)."""
    code, out, err = _run(capsys, "plan", *_TINY, "--devices-per-node", "8", "--tp", "8",
                          "--json", "-q")
    assert code == 0, err
    (line,) = [line for line in err.splitlines() if line.startswith("autoplan: warning: ")]
    assert line.startswith("autoplan: warning: tp 8 leaves ")
    assert "of every block of transformer.h replicated on the tp axis" in line
    assert "attn.c_proj.weight (32, 32)" in line  # the weight and its dims
    assert ("scaled_dot_product_attention in transformer.h.0.attn (output (8, 4, 16, 8)): "
            "no placement splits it over 8 ranks; tp 8 does not divide 4 (dim 1)") in line
    assert json.loads(out)["warnings"] == [line.removeprefix("autoplan: warning: ")]


@pytest.fixture(scope="module")
def mlp_tiny():
    from autoplan.capture import capture_preset

    return capture_preset("mlp-tiny", batch=1, seq_len=16, num_layers=2)


def test_weights_that_tp_cannot_split_warn(mlp_tiny):
    """Any model: mlp-tiny's (128, 32) and (32, 128) weights on tp 3, through plan()."""
    from autoplan.solver import plan
    from autoplan.solver.configurations import ReplicatedWeightsWarning
    from autoplan.spec import TrainingSpec

    spec = TrainingSpec(global_batch=3, seq_len=16)
    with pytest.warns(ReplicatedWeightsWarning) as caught:
        plan(mlp_tiny, preset("local-cpu", devices_per_node=3), spec, tp=3)
    (message,) = [str(w.message) for w in caught]
    assert message.startswith("tp 3 leaves 2 of the 2 weight matrices of every block of "
                              "blocks replicated on the tp axis")
    assert ("Cause: tp 3 divides none of the dims of fc1.weight (128, 32), "
            "fc2.weight (32, 128).") in message
    # tp 2 divides them: no warning, whatever the cost model chooses
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicatedWeightsWarning)
        plan(mlp_tiny, preset("local-cpu", devices_per_node=2),
             TrainingSpec(global_batch=2, seq_len=16), tp=2)


# --- the example topology ---------------------------------------------------------------------

def test_example_topology_plans(capsys):
    path = _REPO / "examples" / "topology.yaml"
    topo = load_topology(path)
    assert (topo.num_nodes, topo.devices_per_node) == (2, 8)
    assert (topo.intra_node.name, topo.inter_node.name) == ("nvlink", "infiniband")
    code, out, err = _run(capsys, "plan", "--model", "gpt2-tiny", "--cluster", str(path),
                          "--global-batch", "16", "--seq", "16", "--json", "-q")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["topology"] == "example-2x8-h100" and summary["world_size"] == 16
    assert summary["device"] == "H100-SXM-80GB"


def test_diff_of_two_plans(capsys, tmp_path):
    """`autoplan diff`: the configuration, stages, time and memory terms and the placements
    that differ between two plans of gpt2-tiny on 4 local ranks (dp4 against tp2 x pp2), as
    text and as JSON whose numbers are the plans' own."""
    dirs = {}
    for name, flags in (("dp", ["--dp", "4"]), ("tp", ["--tp", "2", "--pp", "2"])):
        dirs[name] = tmp_path / name
        code, _, err = _run(capsys, "plan", *_TINY, "--devices-per-node", "4", *flags,
                            "-o", str(dirs[name]))
        assert code == 0, err
    a, b = (Plan.from_json((dirs[n] / "plan.json").read_text()) for n in ("dp", "tp"))
    code, out, err = _run(capsys, "diff", str(dirs["dp"]), str(dirs["tp"] / "plan.json"))
    assert code == 0, err
    assert re.search(rf"mesh +{a.mesh} -> {b.mesh}\n", out), out
    assert "step time" in out and "stages (blocks)" in out
    code, out, err = _run(capsys, "diff", "--json", str(dirs["dp"]), str(dirs["tp"]))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["same_request"] and doc["config"]["mesh"] == [str(a.mesh), str(b.mesh)]
    step = doc["time_s"]["step_time_s"]
    assert step[:2] == pytest.approx([a.prediction.step_time_s, b.prediction.step_time_s],
                                     rel=1e-5)
    assert doc["memory_bytes"]["peak"][1] == pytest.approx(b.prediction.memory_bytes, rel=1e-5)
    split = {fqn for fqn, p in b.param_placements if p != "R"}
    assert sum(g["params"] for g in doc["placements"]) == len(split)  # a: all R at tp 1
    assert all("*" in g["role"] for g in doc["placements"] if ".h." in g["role"])
    text = a.explain(b)  # the same comparison from Python
    assert text.startswith(f"this: {a}\nother: {b}\n")
    assert re.search(rf"mesh +{a.mesh} -> {b.mesh}\n", text)
    code, _, err = _run(capsys, "diff", str(tmp_path / "none"), str(dirs["tp"]))
    assert code == 2 and "autoplan: error: diff:" in err and "does not exist" in err


def test_explain_a_configuration(capsys):
    """`autoplan explain`: the user's configuration planned beside the chosen plan, the
    difference printed term by term; one that cannot be planned names the reason; no
    override at all is a usage error."""
    code, out, err = _run(capsys, "explain", "-q", *_TINY, "--devices-per-node", "4",
                          "--tp", "4", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["overrides"] == {"tp": 4} and "tp4" in doc["yours"]
    assert doc["diff"]["time_s"]["step_time_s"][2] >= 0  # the chosen plan is the fastest
    code, out, err = _run(capsys, "explain", "-q", *_TINY, "--devices-per-node", "4",
                          "--tp", "4")
    assert code == 0, err
    assert out.startswith("chosen: Plan(") and "\nyours: Plan(" in out and "step time" in out
    code, out, err = _run(capsys, "explain", "-q", *_TINY, "--devices-per-node", "4",
                          "--tp", "3")
    assert code == 0, err
    assert "yours (--tp 3): cannot be planned:" in out
    code, _, err = _run(capsys, "explain", "-q", *_TINY)
    assert code == 2 and "give the configuration to explain" in err


def test_an_override_that_cannot_work_names_only_the_users_overrides(capsys):
    """3 devices per node, --tp 2: no mesh places; the error names the override given and the
    constraint that binds, not the planner's own switches (elementwise_optimizer)."""
    code, _, err = _run(capsys, "plan", "-q", "--model", "llama3-8b", "--cluster", "dgx-h100",
                        "--nodes", "2", "--devices-per-node", "3", "--global-batch", "48",
                        "--seq", "2048", "--tp", "2")
    assert code == 2
    assert "satisfies the overrides {'tp': 2} " in err and "elementwise" not in err
    assert "straddles the 3-device nodes unevenly" in err


def test_an_hf_config_of_any_covered_causal_lm_plans(capsys, tmp_path):
    """The CLI builds any causal LM of the coverage bench from its config.json (a Mistral
    here, refused before as "autoplan builds gpt2, llama, mixtral ..."); the list the CLI
    takes is the coverage bench's causal LMs."""
    from autoplan.models import CAUSAL_LM_TYPES
    from autoplan.models.architectures import ARCHITECTURES

    assert set(CAUSAL_LM_TYPES) == {a for a, arch in ARCHITECTURES.items()
                                    if arch.task == "causal-lm"}
    config = {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 128, "max_position_embeddings": 64, "sliding_window": 32}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, err = _run(capsys, "plan", "-q", "--model", str(path), "--cluster", "local-cpu",
                          "--devices-per-node", "2", "--global-batch", "4", "--seq", "16")
    assert code == 0, err
    assert "pp1x" in out
    code, out, _ = _run(capsys, "plan", "--help")  # the presets and types are listed there
    assert code == 0 and "mistral" in out and "llama3.1-405b" in out


def test_ctrl_c_is_one_line(capsys, monkeypatch):
    """Ctrl-C during a command: `autoplan: interrupted` and status 130, no traceback."""
    import autoplan.cli as cli

    def interrupted(args, num_layers):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_plan", interrupted)
    code, out, err = _run(capsys, "plan", "-q", "--no-cache", *_TINY)
    assert code == 130 and err == "autoplan: interrupted\n" and out == ""


def test_implausible_topology_values_warn_with_the_field_and_the_range(capsys, tmp_path):
    """`mem_bytes: 80` (80 B, meant 80 GB) and `latency_s: 10` (10 s, meant 10 us) in a
    topology file: one `autoplan: warning:` line each, naming the field and the range of real
    hardware; the example file itself gives none."""
    text = (_REPO / "examples" / "topology.yaml").read_text()
    code, _, err = _run(capsys, "plan", "-q", "--model", "gpt2-tiny", "--cluster",
                        str(_REPO / "examples" / "topology.yaml"), "--global-batch", "16",
                        "--seq", "16")
    assert code == 0 and "warning" not in err
    bad = tmp_path / "t.yaml"
    bad.write_text(text.replace("mem_bytes: 80.0e+9 ", "mem_bytes: 80 ")
                   .replace("latency_s: 10.0e-6 ", "latency_s: 10 "))
    code, _, err = _run(capsys, "plan", "-q", "--model", "gpt2-tiny", "--cluster", str(bad),
                        "--global-batch", "16", "--seq", "16")
    lines = [ln for ln in err.splitlines() if ln.startswith("autoplan: warning:")]
    assert len(lines) == 2, err
    assert "device.mem_bytes: 80 is outside 1e+08 .. 1e+13" in lines[0]
    assert "inter_node.latency_s: 10 is outside 0 .. 0.01" in lines[1]


def test_explain_the_float8_recipe(capsys, tmp_path):
    """`autoplan explain --float8 auto` on an H100: the configuration diff is the number of
    FP8 linears, and the closing line says the gain is the recipe's, not a plan the search
    missed."""
    config = tmp_path / "wide.json"
    config.write_text(json.dumps({**json.loads((Path(__file__).parent.parent / "autoplan" /
                                                "models" / "configs" / "llama-tiny.json")
                                               .read_text()),
                                  "hidden_size": 2048, "intermediate_size": 8192,
                                  "num_attention_heads": 16, "num_key_value_heads": 4,
                                  "head_dim": 128, "max_position_embeddings": 2048}))
    code, out, err = _run(capsys, "explain", "-q", "--model", str(config), "--cluster",
                          "dgx-h100", "--global-batch", "16", "--seq", "2048", "--dtype",
                          "bfloat16", "--float8", "auto")
    assert code == 0, err
    assert "float8_linears                          0 -> " in out, out
    assert "faster per step than the chosen plan: its FP8 linears" in out, out
    # beside another override the recipe is kept for both plans: tp explained within it
    code, out, err = _run(capsys, "explain", "-q", "--model", str(config), "--cluster",
                          "dgx-h100", "--global-batch", "16", "--seq", "2048", "--dtype",
                          "bfloat16", "--float8", "auto", "--tp", "2")
    assert code == 0, err
    assert "(--tp 2; both plans with --float8 auto)" in out and "FP8 linears, a recipe" \
        not in out, out
