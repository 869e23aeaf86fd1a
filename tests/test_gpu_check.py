"""bench/gpu_check.py refuses to run without CUDA: at once, with a message that says why and
what to do, a non-zero status, and nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_fails_fast_without_cuda(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",  # no GPU, whatever this machine has
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-X", "importtime",
                           str(ROOT / "bench" / "gpu_check.py"), "-o", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    message = "".join(line + "\n" for line in proc.stderr.splitlines()
                      if not line.startswith("import time:"))
    assert proc.returncode == 2, message
    assert message.startswith("gpu_check: error: this check trains on GPUs with NCCL and "
                              "bf16, and no CUDA device is visible"), message
    assert "CUDA_VISIBLE_DEVICES=" in message and "Traceback" not in message
    assert proc.stdout == "" and not out.exists()
    # "at once": it imports torch to ask, and nothing after (no model, no planner, no torchrun)
    assert "torch" in imported
    assert not imported & {"transformers", "autoplan.api", "autoplan.solver",
                           "torch.distributed.run"}, imported & {"transformers", "autoplan.api"}



def test_float8_timings_run_and_carry_the_predicted_ratio():
    """The FP8 part of the check runs (on the CPU here, tiny shapes: its times mean nothing)
    and records the cost model's FP8 / bf16 ratio for the preset: below 1 for Llama-3-8B's
    MLP linear on an H100 (twice the bf16 peak; the bf16 weight gradient keeps it above 1/2),
    above 1 for a small linear, whose casts cost more than FP8 saves."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    rows = gpu_check.float8_linears("dgx-h100", 1, device="cpu",
                                    shapes=(("tiny", 64, 32, 48),))
    assert rows[0]["float8_s"] > 0 and rows[0]["bfloat16_s"] > 0
    assert rows[0]["predicted_ratio"] > 1
    assert 0.5 < gpu_check.predicted_float8_ratio("dgx-h100", 8192, 14336, 4096) < 0.9
