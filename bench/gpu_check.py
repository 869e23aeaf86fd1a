"""GPU check (issue 12, build 5): train a ~1B-parameter GPT on every visible GPU under the
planned configuration and compare what ran with what the plan predicted.

    python bench/gpu_check.py                      # -> bench/results/gpu_check.json
    python bench/gpu_check.py --steps 20 --cluster h200-node --global-batch 32

Needs CUDA (NCCL, bf16): without it the script exits at once with status 2 and a message on
stderr, before it imports anything heavy or writes anything. CI never runs it; run it when a GPU
machine is lent (docs/benchmarks.md, "GPU check").

What runs. The model is a GPT-2-style HF GPT2LMHeadModel (width 2048, 18 layers, 16 heads,
vocabulary 50304, learned positions at the sequence length: 1.01 B parameters; 12 L d^2 + (V +
S) d, Kaplan et al. 2020, Table 1) built by an `@autoparallel` factory in bf16 mixed precision
(fp32 master weights and AdamW states), planned for the job: the topology preset of the GPU
(`--cluster`, default from the device name: H200 -> h200-node, H100 -> dgx-h100, A100 ->
dgx-a100) with one node of as many devices as are visible. Each variant is its own
`torchrun --standalone --nproc_per_node N` job (this script with `--worker`), so each pays its
own capture, plan and build. The data are random token ids from a seeded generator, the same
global batch on every rank, as `model.step` requires.

Variants: `eager` (compile and kernels off), `compile` (torch.compile of each rank's stage
modules), `kernels` (the fused kernels in the rewritten graphs: Triton on CUDA) and both. The
script reads `autoparallel`'s signature: an option it has is set on or off as the variant says
(`kernels=` is on by default, so `eager` turns it off); a variant that needs an option an
installation lacks is recorded as `skipped` with the reason, and printed (`compile=` exists
since the compiled stages of autoplan/runtime/compiled.py).

Measured, per variant (after `--warmup` steps, over the next `--steps`): the median step time
(`model.metrics.step_time_s`, wall time of `step` on rank 0) against the plan's predicted step
time; MFU as the runtime measures it (StepMetrics.mfu: the plan's model FLOPs per step over
step time x ranks x the preset's dense bf16 peak) against the predicted MFU; and the peak of
`torch.cuda.max_memory_allocated()` over the measured steps (reset after the warm-up; the
largest of all ranks, all-reduced with MAX) against the plan's predicted peak per device. Also
the build time (construction to the first loss), the losses, and the plan. Results:
bench/results/gpu_check.json (`--out`), with the GPU's name and count, torch's and CUDA's
versions. The script exits 1 when a variant that exists failed.

FP8 (`float8` in the JSON, before the variants; `--no-float8` skips it): the FP8 linear of the
float8 recipe ([Note: float8 recipe] in autoplan/float8.py) against F.linear in bf16, forward
plus backward, on one GPU, for the linears of a Llama-3-8B block at 8,192 tokens
(`FLOAT8_SHAPES`): the median of `--steps` timed calls each (CUDA events, after 3 warm-ups),
the measured FP8/bf16 ratio, and the ratio the cost model predicts on the preset ([Note:
float8 pricing] in autoplan/cost_model/float8.py: `float8_times_s` over `op_time_s` +
`backward_time_s`), so a run says how far the pricing of FP8 is from the GPU.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _results.py
from _results import write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "gpu_check.json"

# GPT-2 style, ~1B parameters (module docstring)
MODEL = dict(n_embd=2048, n_layer=18, n_head=16, vocab_size=50304)
# device name fragment -> topology preset (autoplan/topology.py)
PRESET_OF_DEVICE = (("H200", "h200-node"), ("H100", "dgx-h100"), ("A100", "dgx-a100"))
# variant -> the autoparallel keywords it sets; a keyword autoparallel lacks is left out where
# False (its absence means off) and makes the variant `skipped` where True
VARIANTS = {"eager": {"compile": False, "kernels": False},
            "compile": {"compile": True, "kernels": False},
            "kernels": {"compile": False, "kernels": True},
            "compile+kernels": {"compile": True, "kernels": True}}
EXIT_NO_CUDA = 2
# (name, tokens M, out features N, in features K): Llama-3-8B's block linears at 8,192 tokens
FLOAT8_SHAPES = (("q_proj", 8192, 4096, 4096), ("k_proj", 8192, 1024, 4096),
                 ("gate_proj", 8192, 14336, 4096), ("down_proj", 8192, 4096, 14336))


def float8_linears(preset_name: str, steps: int, device: str = "cuda",
                   shapes=FLOAT8_SHAPES) -> list[dict]:
    """Per shape of `shapes`: the measured median seconds of an FP8 and a bf16 linear, forward
    plus backward, on `device`, their ratio, and the ratio the cost model predicts on preset
    `preset_name` (module docstring, "FP8"). On a CPU `device` the times are wall-clock (for
    tests; the figures mean nothing there)."""
    import torch
    import torch.nn.functional as F

    from autoplan.float8 import float8_linear_local

    out = []
    for name, m, n, k in shapes:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        times = {}
        for recipe, fn in (("float8", float8_linear_local), ("bfloat16", F.linear)):
            samples = []
            for i in range(3 + steps):
                start = time.perf_counter()
                if device == "cuda":
                    begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    begin.record()
                fn(x, w).backward(dy)
                if device == "cuda":
                    end.record()
                    torch.cuda.synchronize()
                    took = begin.elapsed_time(end) / 1e3
                else:
                    took = time.perf_counter() - start
                if i >= 3:
                    samples.append(took)
            times[recipe] = statistics.median(samples)
        out.append({"linear": name, "m": m, "n": n, "k": k,
                    "float8_s": times["float8"], "bfloat16_s": times["bfloat16"],
                    "measured_ratio": times["float8"] / times["bfloat16"],
                    "predicted_ratio": predicted_float8_ratio(preset_name, m, n, k)})
    return out


def predicted_float8_ratio(preset_name: str, m: int, n: int, k: int) -> float:
    """The cost model's FP8 / bf16 time of an (m, k) x (n, k)^T linear, forward plus backward,
    on one device of preset `preset_name` ([Note: float8 pricing])."""
    from autoplan.cost_model.compute import backward_time_s, op_time_s
    from autoplan.cost_model.float8 import float8_times_s
    from autoplan.graph import NodeInfo
    from autoplan.topology import preset

    topo = preset(preset_name)
    node = NodeInfo(name="linear", target="aten.linear.default", shapes=((m, n),),
                    dtypes=("bfloat16",), out_bytes=2 * m * n, in_bytes=2 * (m * k + n * k),
                    flops=2 * m * n * k, module_path="", layer_id=0)
    fp8 = float8_times_s(node, "R", "R", shard_factor=1, tp=1, topology=topo,
                         dtype="bfloat16", weight_trainable=True)
    high = op_time_s(node, topo.device, "bfloat16") + backward_time_s(node, topo.device,
                                                                      "bfloat16")
    return (fp8.forward_s + fp8.backward_s) / high


def _fail_without_cuda() -> None:
    """Exit with EXIT_NO_CUDA and a message when this machine cannot run the check: no CUDA
    device visible to torch, no NCCL in this torch build, or no bf16 on the device."""
    import torch
    import torch.distributed as dist

    reason = None
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + (" (a CPU-only build)"
                                                if torch.version.cuda is None else "")
        reason = f"no CUDA device is visible ({build}; CUDA_VISIBLE_DEVICES=" \
                 f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
    elif not dist.is_nccl_available():
        reason = f"torch {torch.__version__} was built without NCCL"
    elif not torch.cuda.is_bf16_supported():
        reason = f"{torch.cuda.get_device_name(0)} has no bf16"
    if reason:
        print(f"gpu_check: error: this check trains on GPUs with NCCL and bf16, and {reason}. "
              "Run it on a GPU machine (docs/benchmarks.md, \"GPU check\"); nothing was written.",
              file=sys.stderr)
        sys.exit(EXIT_NO_CUDA)


def _options(variant: str) -> tuple[dict, str | None]:
    """(the autoparallel keywords of `variant`, None), or ({}, why it cannot run here) when
    it needs an option `autoparallel` does not have (VARIANTS)."""
    from autoplan.api import autoparallel

    known = inspect.signature(autoparallel).parameters
    wanted = VARIANTS[variant]
    missing = [k for k, on in wanted.items() if on and k not in known]
    if missing:
        return {}, (f"autoparallel has no {', '.join(f'{k}=' for k in missing)} option yet "
                    "(issue 12, builds 3 and 4)")
    return {k: on for k, on in wanted.items() if k in known}, None


def _cluster_yaml(name: str, num_devices: int, directory: Path) -> Path:
    """The preset `name` as one node of `num_devices` devices, written as a topology YAML (a
    preset node has 8; a job on fewer GPUs must be planned for what it has)."""
    import dataclasses

    from autoplan.topology import preset, save_topology

    topo = dataclasses.replace(preset(name, num_nodes=1), devices_per_node=num_devices)
    path = directory / f"{name}-{num_devices}.yaml"
    save_topology(topo, path)
    return path


def _default_cluster() -> str:
    import torch

    name = torch.cuda.get_device_name(0)
    for fragment, preset_name in PRESET_OF_DEVICE:
        if fragment in name:
            return preset_name
    raise SystemExit(f"gpu_check: error: no topology preset for {name!r}; pass --cluster "
                     "(a preset or a topology YAML)")


def worker(args) -> int:
    """One variant under torchrun: build, warm up, measure; rank 0 writes the JSON."""
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    from autoplan import autoparallel

    config = GPT2Config(n_positions=args.seq, bos_token_id=0, eos_token_id=0, **MODEL)
    options, _ = _options(args.worker)

    @autoparallel(global_batch=args.global_batch, seq_len=args.seq, cluster=args.cluster,
                  dtype="bfloat16", seed=0, **options)
    def make_model():
        return GPT2LMHeadModel(config)

    torch.manual_seed(0)
    model = make_model()
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    metrics, losses = [], []
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, MODEL["vocab_size"], (args.global_batch, args.seq + 1),
                          generator=g)
        losses.append(float(model.step(x[:, :-1], x[:, 1:])))
        if step == 0:
            first_loss_s = time.perf_counter() - start
        if step == args.warmup - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if step >= args.warmup:
            metrics.append(model.metrics)
    torch.cuda.synchronize()
    peak = torch.tensor([torch.cuda.max_memory_allocated()], dtype=torch.float64,
                        device=torch.cuda.current_device())
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        plan = model.plan
        step_s = statistics.median(m.step_time_s for m in metrics)
        result = {
            "status": "ok", "plan": str(plan), "world_size": dist.get_world_size(),
            "num_params": model.graph.num_params,
            "first_loss_s": first_loss_s, "losses": losses,
            "step_time_s": step_s, "predicted_step_time_s": plan.prediction.step_time_s,
            "step_time_measured_over_predicted": step_s / plan.prediction.step_time_s,
            "mfu": statistics.median(m.mfu for m in metrics),
            "predicted_mfu": plan.prediction.mfu,
            "peak_memory_bytes": float(peak.item()),
            "predicted_peak_memory_bytes": plan.prediction.memory_bytes,
            "peak_memory_measured_over_predicted": float(peak.item())
            / plan.prediction.memory_bytes,
            "tokens_per_s": statistics.median(m.tokens_per_s for m in metrics),
        }
        write_json(Path(args.result), result)
    return 0


def _run_variant(name: str, args, cluster: str, num_gpus: int, tmp: Path) -> dict:
    options, reason = _options(name)
    if reason:
        print(f"gpu_check: {name}: skipped: {reason}", file=sys.stderr)
        return {"status": "skipped", "reason": reason}
    result = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={num_gpus}", __file__, "--worker", name, "--result", str(result),
           "--cluster", cluster, "--global-batch", str(args.global_batch), "--seq",
           str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"timed out after {args.timeout_s} s"}
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not result.exists():
        tail = (proc.stderr or proc.stdout)[-3000:]
        print(f"gpu_check: {name}: failed (exit {proc.returncode}):\n{tail}", file=sys.stderr)
        return {"status": "failed", "reason": f"exit {proc.returncode}", "stderr_tail": tail}
    out = json.loads(result.read_text())
    out["job_s"], out["options"] = wall, options
    print(f"gpu_check: {name}: step {out['step_time_s'] * 1e3:.1f} ms (predicted "
          f"{out['predicted_step_time_s'] * 1e3:.1f} ms), MFU {out['mfu']:.1%} (predicted "
          f"{out['predicted_mfu']:.1%}), peak {out['peak_memory_bytes'] / 1e9:.1f} GB "
          f"(predicted {out['predicted_peak_memory_bytes'] / 1e9:.1f} GB); {out['plan']}",
          file=sys.stderr)
    return out


def _peaks(preset_name: str) -> dict:
    """The dense peaks of the preset's device (a topology file's too), by dtype."""
    from autoplan.topology import load_topology, preset

    topo = load_topology(preset_name) if Path(preset_name).is_file() else preset(preset_name)
    return topo.device.peak_flops_per_s


def _nccl_version() -> str:
    import torch

    version = torch.cuda.nccl.version()  # (major, minor, patch); an int in old releases
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", help="topology preset of one node of these GPUs "
                                          "(default: from the device name)")
    parser.add_argument("--global-batch", type=int, help="samples per step (default: 8 per GPU)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sample")
    parser.add_argument("--steps", type=int, default=10, help="measured steps")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring (>= 1)")
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS),
                        help="run only this variant (repeatable; default: all)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per variant")
    parser.add_argument("--no-float8", action="store_true",
                        help="skip the FP8 linear timings (module docstring, \"FP8\")")
    parser.add_argument("-o", "--out", type=Path, default=RESULT)
    parser.add_argument("--worker", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first step builds the model)")
    _fail_without_cuda()
    if args.worker:
        return worker(args)

    import torch

    num_gpus = torch.cuda.device_count()
    args.global_batch = args.global_batch or 8 * num_gpus
    preset_name = args.cluster or _default_cluster()
    float8 = None if args.no_float8 or "float8" not in _peaks(preset_name) else \
        float8_linears(preset_name, args.steps)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp_name:
        tmp = Path(tmp_name)
        cluster = (args.cluster if args.cluster and Path(args.cluster).is_file()
                   else str(_cluster_yaml(preset_name, num_gpus, tmp)))
        variants = {name: _run_variant(name, args, cluster, num_gpus, tmp)
                    for name in (args.variant or VARIANTS)}
    report = {
        "machine": {"gpu": torch.cuda.get_device_name(0), "num_gpus": num_gpus,
                    "torch": torch.__version__, "cuda": torch.version.cuda,
                    "nccl": _nccl_version(),
                    "platform": platform.platform()},
        "config": {"model": {"kind": "GPT2LMHeadModel", **MODEL, "n_positions": args.seq},
                   "cluster": preset_name, "devices_per_node": num_gpus,
                   "global_batch": args.global_batch, "seq_len": args.seq, "dtype": "bfloat16",
                   "warmup_steps": args.warmup, "measured_steps": args.steps},
        "variants": variants,
        "float8": float8,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, report)
    print(f"gpu_check: wrote {args.out}", file=sys.stderr)
    return 1 if any(v["status"] == "failed" for v in variants.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
