"""The real side of tests/test_dryrun_vs_real.py: one plan trained on every rank of a gloo
cluster as `dry_run` steps it on fake tensors (autoplan/runtime/dryrun.py `_dry_run_rank`),
with its live tensor bytes and its collectives measured."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

MAX_GRAD_NORM = 1.0  # dry_run's default; DistributedModel's is None


def measured_step(name: str, seq_len: int, plan_json: str, steps: int) -> dict:
    """On every rank: capture preset `name` at the plan's microbatch, build the rank's
    DistributedModel of `plan_json` (a plan already retargeted to that graph) from seeded CPU
    weights, and run `steps` steps on the zero batch `dry_run` uses (`InputSpec.example`),
    under `LiveTensorBytes` (from before construction; its peak reset before the last step)
    and a `CollectiveLog` (the last step's). Returns this rank's {"rank", "peak_bytes",
    "resident_bytes", "bytes_by_axis", "counts"}: bytes, and op counts by "op@axis", as
    `RankDryRun` has them."""
    from autoplan.capture import capture_preset
    from autoplan.inputs import InputSpec
    from autoplan.models import build_model
    from autoplan.plan import Plan
    from autoplan.runtime.collective_log import CollectiveLog, bytes_by_axis
    from autoplan.runtime.engine import DistributedModel
    from autoplan.runtime.live_bytes import LiveTensorBytes

    plan = Plan.from_json(plan_json)
    graph = capture_preset(name, batch=plan.microbatch_size, seq_len=seq_len)
    torch.manual_seed(0)
    weights = build_model(name, device="cpu")
    inputs = InputSpec.tokens(plan.global_batch, plan.seq_len)
    live, log = LiveTensorBytes(), CollectiveLog()
    with live, log:
        engine = DistributedModel(graph, plan, weights, seed=0, device="cpu", inputs=inputs,
                                  max_grad_norm=MAX_GRAD_NORM)
        leaves = inputs.example(plan.global_batch, "cpu")
        for _ in range(steps - 1):  # the first step creates the optimizer states
            engine.step_batch(leaves)
        gc.collect()  # construction's reference cycles are not the step's memory
        live.reset_peak()
        resident = live.current
        log.calls.clear()
        engine.step_batch(leaves)
    by_axis, counts = bytes_by_axis(log.collectives(engine))
    return {"rank": dist.get_rank(), "peak_bytes": live.peak, "resident_bytes": resident,
            "bytes_by_axis": by_axis, "counts": counts}
