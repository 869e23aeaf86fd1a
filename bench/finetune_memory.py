"""Fine-tuning memory: a LoRA fine-tune of a 0.48B-parameter Llama on 4 gloo ranks holds no
gradient or optimizer state for its frozen base, and its peak memory is what the plan says
(issue 24, "Fine-tuning as people do it").

    python bench/finetune_memory.py            # -> bench/results/finetune_memory.json
    python bench/finetune_memory.py --quick    # a 30M-parameter model, to try the bench

The model is HF LlamaForCausalLM (hidden 1024, 32 layers, 16 heads, 8 key/value heads, FFN 2816,
vocab 50304, untied head: 0.48B parameters, 1.9 GB of fp32 weights) wrapped by PEFT
(`get_peft_model`, LoRA r=16 alpha=32 on every linear of the blocks: 9.5M trainable
parameters, 2%), decorated as a *factory*: `@autoparallel` records the construction on the meta
device and every rank replays it on its own shards. Each plan trains 3 AdamW steps (fp32,
global batch 4 x 64 tokens) in a fresh LocalCluster of 4 ranks.

Measured per rank, on the third step ([Note: measured peak memory] in bench/fidelity.py):
- `peak_bytes`: live tensor storage bytes (`LiveTensorBytes`) at their height during the step,
  against the plan's prediction for the rank's pipeline stage (`Prediction.memory_by_pp_rank`,
  autoplan.runtime.dryrun.predicted_rank_memory) -- the local band is +-10% (docs/design.md, "Bars");
- by kind, from the tensors themselves after the step: parameter bytes of trainable and frozen
  parameters (local shards), gradient bytes (`p.grad` of every parameter: frozen ones must have
  none) and optimizer state bytes (AdamW's exp_avg / exp_avg_sq / step: only for trainable
  parameters), against that prediction's breakdown;
- `rss_step_peak_bytes`: the resident set's high-water mark of the step (memory_stats), an upper
  bound that holds the interpreter and allocator slack too.
The full-training plan of the same model and cluster is planned (not run) for contrast.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _results.py
from _results import write_json  # noqa: E402

MODEL = dict(hidden_size=1024, num_hidden_layers=32, num_attention_heads=16,
             num_key_value_heads=8, intermediate_size=2816, vocab_size=50304,
             max_position_embeddings=256, tie_word_embeddings=False)
QUICK_MODEL = dict(MODEL, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=704, vocab_size=32000)
LORA = dict(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
# (dp4 ZeRO-0 holds the whole fp32 base on every rank: 4.04 GB, over local-cpu's 4 GB per rank)
CONFIGS = {
    "dp4 zero3": dict(dp=4, zero_stage=3),
    "tp4": dict(tp=4),
    "pp2xdp2 zero3": dict(pp=2, dp=2, zero_stage=3, num_microbatches=2),
}
GLOBAL_BATCH, SEQ, STEPS = 4, 64, 3
BAND = 0.10
GB = 1e9


def lora_llama(config: dict):
    """The PEFT LoRA model (on the device the caller's context gives)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**config))
    return get_peft_model(model, LoraConfig(**LORA))


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def run_config(config: dict, overrides: dict) -> dict:
    """On every rank: build from the recorded factory, 3 steps, the third one measured."""
    import torch
    import torch.distributed as dist

    from autoplan import autoparallel
    from autoplan.runtime.live_bytes import LiveTensorBytes
    from autoplan.runtime.dryrun import predicted_rank_memory

    make = autoparallel(functools.partial(lora_llama, config), global_batch=GLOBAL_BATCH,
                        seq_len=SEQ, **overrides)
    torch.manual_seed(0)
    model = make()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config["vocab_size"], (STEPS, GLOBAL_BATCH, SEQ + 1), generator=g)
    tracker = LiveTensorBytes()
    losses = []
    with tracker:
        for i in range(STEPS):
            if i == STEPS - 1:
                gc.collect()  # construction's reference cycles are not the plan's memory
                tracker.reset_peak()
            losses.append(model.step(tokens[i, :, :-1], tokens[i, :, 1:]))
    engine = model._engine
    params = engine._unique_named_params()
    opt = getattr(engine.optimizer, "inner", engine.optimizer)
    state_bytes = sum(_local_bytes(v) for s in opt.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor))
    frozen_with_state = [n for n, p in params if not p.requires_grad and opt.state.get(p)]
    plan = model.plan
    stats = model.memory_stats()
    return {
        "rank": dist.get_rank(), "plan": str(plan), "mesh": str(plan.mesh),
        "zero_stage": plan.zero_stage, "frozen_dtype": plan.frozen_dtype,
        "model_params": engine.graph.num_params,
        "trainable_params": engine.graph.num_trainable_params,
        "trainable_param_bytes": sum(_local_bytes(p) for _, p in params if p.requires_grad),
        "frozen_param_bytes": sum(_local_bytes(p) for _, p in params if not p.requires_grad),
        "grad_bytes": sum(_local_bytes(p.grad) for _, p in params if p.grad is not None),
        "frozen_grads": [n for n, p in params if not p.requires_grad and p.grad is not None],
        "optimizer_state_bytes": state_bytes, "frozen_with_state": frozen_with_state,
        "peak_bytes": tracker.peak,
        # this rank's pipeline stage's prediction (Prediction.memory_by_pp_rank)
        "predicted_peak_bytes": predicted_rank_memory(plan, dist.get_rank())["peak"],
        "predicted_breakdown": {k: v for k, v in predicted_rank_memory(plan, dist.get_rank()).items()
                                if k != "peak"},
        "rss_step_peak_bytes": stats.get("step_peak_bytes"),
        "rss_baseline_bytes": stats.get("baseline_bytes"),
        "losses": losses,
    }


def full_training_plan(config: dict, overrides: dict) -> dict:
    """The plan of the same model trained in full (every parameter), not run."""
    from autoplan import autoparallel
    from autoplan.runtime.construction import on_meta  # noqa: F401 - the meta device below

    import torch
    with torch.device("meta"):
        model = lora_llama(config).get_base_model()
    model.requires_grad_(True)
    plan = autoparallel(model, global_batch=GLOBAL_BATCH, seq_len=SEQ, world_size=4,
                        **overrides).plan
    return {"plan": str(plan), "predicted_peak_bytes": plan.prediction.memory_bytes,
            "predicted_breakdown": plan.prediction.memory_breakdown}


def check(row: dict) -> dict:
    error = row["predicted_peak_bytes"] / row["peak_bytes"] - 1
    return {
        "peak_error": error, "peak_ok": abs(error) <= BAND,
        "frozen_hold_nothing": not row["frozen_grads"] and not row["frozen_with_state"],
        "grads_are_trainable_only": row["grad_bytes"] <= row["trainable_param_bytes"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 30M-parameter model")
    parser.add_argument("--configs", nargs="*", choices=list(CONFIGS),
                        help="configurations to run (default: all); merged into --out's runs")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "finetune_memory.json")
    args = parser.parse_args(argv)
    from autoplan.runtime import LocalCluster

    config = QUICK_MODEL if args.quick else MODEL
    runs, full = {}, {}
    for name in args.configs or list(CONFIGS):
        overrides = CONFIGS[name]
        with LocalCluster(4, pg_timeout_s=1800) as cluster:
            rows = cluster.run(run_config, config, overrides, timeout_s=3000)
        for row in rows:
            row.update(check(row))
        runs[name] = rows
        full[name] = full_training_plan(config, overrides)
        for row in rows:
            print(f"{name:14s} rank {row['rank']}: peak {row['peak_bytes'] / GB:.3f} GB, "
                  f"predicted {row['predicted_peak_bytes'] / GB:.3f} GB "
                  f"({row['peak_error']:+.1%}); grads {row['grad_bytes'] / 1e6:.1f} MB, "
                  f"optimizer {row['optimizer_state_bytes'] / 1e6:.1f} MB, trainable params "
                  f"{row['trainable_param_bytes'] / 1e6:.1f} MB, frozen "
                  f"{row['frozen_param_bytes'] / 1e6:.1f} MB; full training predicted "
                  f"{full[name]['predicted_peak_bytes'] / GB:.3f} GB", flush=True)
    if args.configs and args.out.is_file():  # the other configurations' rows as they were
        previous = json.loads(args.out.read_text())
        runs = {**previous.get("runs", {}), **runs}
        full = {**previous.get("full_training_plans", {}), **full}
    ok = all(r["peak_ok"] and r["frozen_hold_nothing"] and r["grads_are_trainable_only"]
             for rows in runs.values() for r in rows)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average": os.getloadavg(), "quick": args.quick, "model": config, "lora": LORA,
        "global_batch": GLOBAL_BATCH, "seq_len": SEQ, "steps": STEPS, "ranks": 4,
        "measure": "live tensor storage bytes of the third step (LiveTensorBytes)",
        "band": BAND, "all_ok": ok, "runs": runs, "full_training_plans": full,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    print(f"{'all' if ok else 'NOT all'} ranks within the band, frozen base without gradients "
          f"or states -> {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
