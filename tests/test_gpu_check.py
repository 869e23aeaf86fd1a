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
