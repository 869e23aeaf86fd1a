"""`autoplan demo`: the main job end to end on this machine.

A GPT-2-style HF model (preset `gpt2-demo`, ~10.8M parameters, byte-level vocabulary) is planned
for 4 gloo ranks, compiled, and trained on real text available offline -- the bytes of the Python
standard library's own source files. Every step's loss is printed next to a single-process run of
the same model on the same batches (the correctness contract), and the plan report (Markdown and
HTML) and the exported per-rank graphs are written.

The demo asks for tp=2 so that tensor parallelism is on show; the planner chooses the rest (dp or
pp, ZeRO stage, microbatches, per-op placements) with its cost model.
"""

from __future__ import annotations

import glob
import os
import sys
import time
from pathlib import Path

import torch

__all__ = ["main", "corpus", "batches"]

MODEL = "gpt2-demo"


def corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """Byte tokens (int64) of the standard library's .py files, sorted by path, concatenated."""
    root = os.path.dirname(os.__file__)
    out = bytearray()
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            out += f.read()
        if len(out) >= max_bytes:
            break
    if len(out) < 100_000:
        raise RuntimeError(f"standard library sources under {root} are too small for the demo")
    return torch.frombuffer(out[:max_bytes], dtype=torch.uint8).long()  # a writable buffer


def batches(tokens: torch.Tensor, steps: int, batch: int, seq_len: int, seed: int = 0):
    """`steps` (input_ids, labels) pairs of shape (batch, seq_len): random windows, shifted."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (steps, batch), generator=g)
    windows = torch.stack([torch.stack([tokens[s:s + seq_len + 1] for s in row]) for row in starts])
    return windows[..., :-1], windows[..., 1:]


def build(seed: int = 0):
    from autoplan.models import build_model

    torch.manual_seed(seed)
    return build_model(MODEL, device="cpu")


def _options(world_size: int, batch: int, seq_len: int) -> dict:
    return dict(global_batch=batch, seq_len=seq_len, cluster="local-cpu", world_size=world_size,
                tp=2, optimizer=_adamw)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _worker(world_size: int, steps: int, batch: int, seq_len: int) -> list[float]:
    from autoplan.api import autoparallel

    model = autoparallel(build(), **_options(world_size, batch, seq_len))
    x, y = batches(corpus(), steps, batch, seq_len)
    return [model.step(x[i], y[i]) for i in range(steps)]


def _reference(steps: int, batch: int, seq_len: int) -> list[float]:
    from autoplan.runtime.engine import cross_entropy_loss

    model = build()
    opt = _adamw(model.parameters())
    x, y = batches(corpus(), steps, batch, seq_len)
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = cross_entropy_loss(model(x[i], use_cache=False).logits, y[i])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(steps: int = 20, world_size: int = 4, out_dir: str = "out/demo", batch: int = 8,
         seq_len: int = 128) -> int:
    """Plan, report, export, train on `world_size` gloo ranks and compare with one process."""
    from autoplan.api import autoparallel
    from autoplan.runtime.launcher import LocalCluster

    start = time.perf_counter()
    out = Path(out_dir)
    model = build()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {MODEL}: {n_params / 1e6:.1f}M parameters; corpus: Python stdlib sources "
          f"({len(corpus()) / 1e6:.1f} MB of byte tokens)")
    planner = autoparallel(model, **_options(world_size, batch, seq_len))
    plan = planner.plan
    print(f"plan: {plan}")
    planner.report(out)
    planner.export(out / "graphs")
    print(f"wrote {out / 'report.md'}, {out / 'report.html'} and {out / 'graphs'}/")
    print(f"training {steps} steps on {world_size} gloo ranks ...", flush=True)
    with LocalCluster(world_size) as cluster:
        dist_losses = cluster.run(_worker, world_size, steps, batch, seq_len,
                                  timeout_s=600)[0]
    ref_losses = _reference(steps, batch, seq_len)
    print(f"{'step':>4}  {'autoplan (' + str(plan.mesh) + ')':>24}  {'single process':>15}  "
          f"{'|diff|':>9}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(dist_losses, ref_losses)):
        worst = max(worst, abs(a - b))
        print(f"{i:>4}  {a:>24.6f}  {b:>15.6f}  {abs(a - b):>9.2e}")
    ok = all(abs(a - b) <= 1e-4 * abs(b) + 1e-5 for a, b in zip(dist_losses, ref_losses))
    print(f"max |diff| {worst:.2e}: {'MATCH' if ok else 'MISMATCH'}; "
          f"{time.perf_counter() - start:.0f} s in all")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
