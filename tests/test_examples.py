"""Examples are tests (docs/design.md, house rule 11): every script in examples/ runs here in a
CPU-sized mode -- its own flags made small, the code path the same -- and must do what its
docstring promises."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent
SMALL = ["--steps", "2", "--batch", "4", "--seq", "16"]

pytest.importorskip("transformers")


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", AUTOPLAN_VERBOSITY="0")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run(args: list[str], cwd: Path, timeout_s: float = 600) -> subprocess.CompletedProcess:
    run = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True,
                         timeout=timeout_s)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return run


TESTED = {"any_batch.py", "finetune_hf.py", "own_module.py", "plan_cluster.py",
          "torchrun_train.py"}


def test_every_example_is_run_here_and_says_how_to_run_it():
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == TESTED, f"examples without a test here: {sorted(scripts - TESTED)}"
    for name in scripts:
        doc = (EXAMPLES / name).read_text().split('"""')[1]
        assert f"examples/{name}" in doc, f"{name}'s docstring does not say how to run it"


@pytest.mark.slow
def test_finetune_hf_writes_trains_and_saves_a_checkpoint_transformers_loads(tmp_path):
    run = _run([sys.executable, str(EXAMPLES / "finetune_hf.py"), "--out", str(tmp_path),
                "--ranks", "2", *SMALL], cwd=tmp_path)
    assert (tmp_path / "initial" / "config.json").is_file()
    assert (tmp_path / "finetuned" / "model.safetensors").is_file()
    losses = re.search(r"^losses: (.*)$", run.stdout, flags=re.M).group(1).split()
    assert len(losses) == 2 and all(float(x) > 0 for x in losses)
    assert "loads with transformers: logits (1, 16, 256)" in run.stdout


@pytest.mark.slow
def test_own_module_with_own_loss_equals_one_process(tmp_path):
    run = _run([sys.executable, str(EXAMPLES / "own_module.py"), "--ranks", "2",
                "--overrides", "tp=2", *SMALL], cwd=tmp_path)
    assert len(re.findall(r"^step \d: 2 ranks", run.stdout, flags=re.M)) == 2
    assert ": equal (fp32 contract" in run.stdout


@pytest.mark.slow
def test_plan_cluster_writes_the_report(tmp_path):
    run = _run([sys.executable, str(EXAMPLES / "plan_cluster.py"), "--model", "llama3-8b",
                "--nodes", "1", "--global-batch", "16", "--seq", "1024", "--what-if", "2",
                "-o", str(tmp_path / "plan")], cwd=tmp_path)
    assert (tmp_path / "plan" / "report.md").is_file()
    assert (tmp_path / "plan" / "report.html").is_file()
    assert re.search(r"^llama3-8b on 1 x dgx-h100: pp\d+xdp\d+xtp\d+", run.stdout, flags=re.M)
    assert "  on 2 nodes: " in run.stdout


@pytest.mark.slow
def test_torchrun_train_under_torchrun_two_ranks(tmp_path):
    out = tmp_path / "out"
    run = _run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2",
                str(EXAMPLES / "torchrun_train.py"), "--steps", "2", "--global-batch", "4",
                "--seq", "16", "--save-every", "2", "--out", str(out)], cwd=tmp_path)
    assert len(re.findall(r"rank 0 of 2: step \d", run.stdout)) == 2  # records, not lines
    assert (out / "report.html").is_file() and (out / "step-2" / ".metadata").is_file()
    assert list((out / "graphs").glob("rank*_stage*.py"))


@pytest.mark.slow
def test_any_batch_trains_t5_and_vit_from_dicts_as_one_process(tmp_path):
    run = _run([sys.executable, str(EXAMPLES / "any_batch.py"), "--ranks", "2",
                "--overrides", "tp=2", "--steps", "2", "--batch", "4"], cwd=tmp_path)
    assert len(re.findall(r"^(t5|vit) step \d: 2 ranks", run.stdout, flags=re.M)) == 4
    assert re.search(r"^t5 eval_step: loss [0-9.]+, logits \(4, 8, 128\)", run.stdout, re.M)
    assert re.search(r"^vit eval_step: loss [0-9.]+, logits \(4, 10\)", run.stdout, re.M)
    assert "equal to one process (fp32 contract" in run.stdout
