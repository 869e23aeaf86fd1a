"""Compiled stages against eager: the step-time ratio of `compile=True` on 4 gloo ranks
(issue 12, item 4; [Note: compiled stages] in autoplan/runtime/compiled.py).

    python bench/compile.py            # -> bench/results/compile.json
    python bench/compile.py --quick    # fewer pairs, a smaller model, to try the bench

For each configuration (dp2 x tp2 ZeRO-0 under a memory budget that makes the plan split the
weights on the tp axis, see `split_weights_budget`, and pp2 x dp2 1F1B with 4 microbatches:
the configurations of tests/test_compile.py at a bench size), every rank builds the same model
twice from the same seed -- once eager, once with compile=True (plans identical but for
`Plan.compiled` and its prediction) -- runs WARMUP steps of each (the compiled model's first
step compiles), then PAIRS interleaved pairs of steps on the same batches (eager then compiled,
alternating which goes first), so both see the same machine load. A step's time is the slowest
rank's wall time of `model.step` (an all-reduce of the times, MAX). Reported: the median of the
per-pair ratios compiled / eager, the medians of each, the first step of each (the compile),
the plans' predicted step times (the cost model's ratio, [Note: compiled execution] in
autoplan/cost_model/compute.py), torch.compile's counters, and the largest relative difference
of the two models' losses (they train on the same batches from the same weights).

The model: GPT-2 style (HF GPT2LMHeadModel), width 256, 4 layers, 4 heads, vocab 2048,
sequence 64, global batch 8, fp32; `--quick`: width 64, 2 layers.
Measured on this 2-core machine, shared: the load average goes into the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _results.py
from _results import write_json  # noqa: E402

CONFIGS = {
    "dp2xtp2 split weights": dict(dp=2, tp=2, zero_stage=0, num_microbatches=1),
    "pp2xdp2 1f1b m4": dict(pp=2, dp=2, zero_stage=0, num_microbatches=4, schedule="1f1b"),
}
MODEL = dict(n_embd=256, n_layer=4, n_head=4, vocab_size=2048, n_positions=64)
QUICK_MODEL = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64)
GLOBAL_BATCH, SEQ, WARMUP = 8, 64, 2


def _build(config: dict, overrides: dict, compile: bool, **options):
    from autoplan import autoparallel
    from autoplan.models import build_model

    torch.manual_seed(0)
    model = build_model("gpt2", device="cpu", **config)
    return autoparallel(model, global_batch=GLOBAL_BATCH, seq_len=SEQ, compile=compile,
                        **options, **overrides)


def split_weights_budget(config: dict, overrides: dict) -> float | None:
    """With tp: 0.9 of the memory the plan needs with ample memory, so that the planner splits
    the weights on the tp axis (Megatron-style) instead of replicating them, as
    tests/test_compile.py does. Compiling a tp plan that shards the batch dim of attention on
    the tp axis fails at compile time (a strided gradient reaching a traced reshape,
    autoplan/passes/sharding.py `reshape`), so the bench measures the split-weights plan."""
    if overrides.get("tp", 1) == 1:
        return None
    return _build(config, overrides, False, world_size=4).plan.prediction.memory_bytes * 0.9


def _timed_step(model, x, y) -> tuple[float, float]:
    """(loss, the slowest rank's wall time of the step, s)."""
    dist.barrier()
    start = time.perf_counter()
    loss = model.step(x, y)
    took = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return loss, float(took)


def run_config(config: dict, overrides: dict, pairs: int, cache_dir: str,
               budget: float | None) -> dict:
    """On every rank: the eager and the compiled model, WARMUP steps each, then `pairs`
    interleaved pairs of steps."""
    from autoplan._torch_compat import compile_counters

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    models = {"eager": _build(config, overrides, False, device_memory_bytes=budget),
              "compiled": _build(config, overrides, True, device_memory_bytes=budget)}
    g = torch.Generator().manual_seed(1)
    steps = WARMUP + pairs
    tokens = torch.randint(0, config["vocab_size"], (steps, GLOBAL_BATCH, SEQ + 1),
                           generator=g)
    times = {k: [] for k in models}
    losses = {k: [] for k in models}
    first = {}
    before = compile_counters()
    for i in range(steps):
        x, y = tokens[i, :, :-1], tokens[i, :, 1:]
        order = ["eager", "compiled"] if i % 2 == 0 else ["compiled", "eager"]
        for name in order:
            loss, took = _timed_step(models[name], x, y)
            losses[name].append(loss)
            if i == 0:
                first[name] = took
            if i >= WARMUP:
                times[name].append(took)
    after = compile_counters()
    ratios = [c / e for c, e in zip(times["compiled"], times["eager"])]
    loss_diff = max(abs(c - e) / abs(e) for c, e in zip(losses["compiled"], losses["eager"]))
    plans = {k: m.plan for k, m in models.items()}
    return {
        "rank": dist.get_rank(), "plan": str(plans["eager"].mesh),
        "median_ratio_compiled_over_eager": statistics.median(ratios),
        "ratios": ratios,
        "median_step_s": {k: statistics.median(v) for k, v in times.items()},
        "step_s": times, "first_step_s": first,
        "predicted_step_s": {k: p.prediction.step_time_s for k, p in plans.items()},
        "predicted_ratio": (plans["compiled"].prediction.step_time_s
                            / plans["eager"].prediction.step_time_s),
        "compile_counters": {k: after[k] - before[k] for k in after},
        "max_loss_rel_diff": loss_diff, "losses": losses, "device_memory_bytes": budget,
        "param_placements": dict(plans["compiled"].param_placements),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, 3 pairs")
    parser.add_argument("--pairs", type=int, default=None, help="interleaved pairs (default 9)")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "compile.json")
    args = parser.parse_args(argv)
    from autoplan.runtime import LocalCluster
    from autoplan.runtime.launcher import RankError

    config = QUICK_MODEL if args.quick else MODEL
    pairs = args.pairs or (3 if args.quick else 9)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache_dir:
        for name, overrides in CONFIGS.items():
            budget = split_weights_budget(config, overrides)
            try:
                with LocalCluster(4, pg_timeout_s=1800) as cluster:
                    rows = cluster.run(run_config, config, overrides, pairs, cache_dir,
                                       budget, timeout_s=3000)
            except RankError as e:  # recorded, not hidden: the other configurations still run
                runs[name] = {"error": str(e).splitlines()[0][:500]}
                print(f"{name:16s} failed: {runs[name]['error']}", flush=True)
                continue
            row = rows[0]  # the times are every rank's maximum: the same on each
            runs[name] = row
            print(f"{name:16s} {row['plan']}: compiled / eager step time "
                  f"{row['median_ratio_compiled_over_eager']:.3f} (median of {pairs} pairs; "
                  f"eager {row['median_step_s']['eager'] * 1e3:.1f} ms, compiled "
                  f"{row['median_step_s']['compiled'] * 1e3:.1f} ms; predicted ratio "
                  f"{row['predicted_ratio']:.3f}); first step eager "
                  f"{row['first_step_s']['eager']:.1f} s, compiled "
                  f"{row['first_step_s']['compiled']:.1f} s; losses within "
                  f"{row['max_loss_rel_diff']:.1e}", flush=True)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average": os.getloadavg(), "quick": args.quick, "model": config,
        "global_batch": GLOBAL_BATCH, "seq_len": SEQ, "ranks": 4, "warmup_steps": WARMUP,
        "pairs": pairs, "torch": torch.__version__,
        "measure": "wall time of model.step, slowest rank (all_reduce MAX), interleaved pairs "
                   "eager/compiled alternating first; ratio = median over pairs of "
                   "compiled / eager",
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
