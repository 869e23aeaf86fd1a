"""autoplan's runtime against the same configuration written by hand with torch-native APIs.

    python bench/runtime_vs_native.py            # 4 configurations -> bench/results/runtime_vs_native.json
    python bench/runtime_vs_native.py --only "dp4 ZeRO-3" --pairs 3 --first-pairs 1
                                                 # --only: the file's other rows are kept
    python bench/runtime_vs_native.py --docs   # also rewrite the table in docs/benchmarks.md
    python bench/runtime_vs_native.py --docs-only   # the table from the results file

What runs. One `LocalCluster` of 4 gloo ranks. For every configuration of `CONFIGS`, each rank
builds the same GPT (`GPT`: nn.Linear blocks, separate q/k/v projections so that Megatron-style
column sharding of them keeps whole heads) twice:
- *autoplan*: `@autoparallel` on the model class with the configuration forced by overrides
  (tp, pp, dp, ZeRO stage, microbatches, schedule, sequence parallelism, no checkpointing), as
  bench/fidelity.py forces its plans;
- *hand-written*: torchtitan's recipe (models/llama3/parallelize.py): `parallelize_module` with
  ColwiseParallel on wq/wk/wv/w1 and RowwiseParallel on wo/w2 (plus SequenceParallel on the
  norms and PrepareModuleInput/Output at the block edges for the sequence-parallel row), FSDP2
  `fully_shard` per block then the root, and for pp a manual split into two stage modules with
  `torch.distributed.pipelining.PipelineStage` + `Schedule1F1B`.
The two compiled rows run autoplan with `compile=True` (inductor on each rank's stage modules)
against the hand-written recipe with torchtitan's apply_compile (`block.compile(fullgraph=True)`
on every block before FSDP2); they are held to the step-time bar only, their first step being
inductor's compilation on both sides.
The dp axis is ZeRO-3 (FSDP2 `fully_shard` per block, then the root) on both sides in every row,
as torchtitan composes it with tp and pp: torch's DDP does not take DTensor parameters, and the
other torch-native DDP (`replicate`) is a private API.
Both start from `torch.manual_seed(0); GPT(CONFIG)` (autoplan replays the recorded construction
on its shards under its RNG contract), train with AdamW(lr=1e-3) on the same seeded batch, and
their losses are checked equal step by step (`LOSS_RTOL`).

[Note: runtime vs native measurement]
- *First-step latency*, per rank: wall time from constructing the model (decorated call / the
  eager module) to the first loss returned by a step, imports excluded (done before). Measured in
  `--first-pairs` interleaved pairs (autoplan, then hand-written, then the next pair), each
  configuration in a fresh `LocalCluster`: pair 1 is autoplan in a cold process (its first
  export, solve and DTensor dispatch; the hand-written set-up after it finds torch's lazy
  state warm, in its favour). autoplan's plan and capture caches (`AUTOPLAN_CACHE_DIR`) are a
  fresh empty directory for the run, so pair 1 captures and solves, and later pairs read the
  plan and both captures from the caches, as a restarted job does; both are recorded. The ratio is autoplan's slowest rank over the
  hand-written's slowest rank, median over pairs (pair 1 also on its own: "cold").
- *Step time*: after 2 warm-up steps each, `--pairs` interleaved pairs of one autoplan step and
  one hand-written step (a barrier before each); a step's wall time is its slowest rank's and its
  CPU time the sum of the ranks' `time.process_time` (on 2 shared cores 4 ranks time-slice, so
  CPU time summed over ranks is the steadier figure). The ratio is the median over pairs of
  autoplan / hand-written, for wall and CPU time; the bar (<= 1.10, issue 12) is read on CPU
  time, wall time is recorded beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _results.py
from _results import (BENCHMARKS, machine_facts, replace_section, table_head,  # noqa: E402
                      table_row, write_json)

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "runtime_vs_native.json"
SCHEMA_VERSION = 1
WORLD = 4
CONFIG = dict(vocab_size=256, block_size=64, n_layer=4, n_embd=128, n_head=4)
GLOBAL_BATCH, SEQ_LEN = 8, 64
WARMUP_STEPS = 2
LOSS_RTOL = 1e-5  # fp32, the correctness contract's tolerance
STEP_BAR, FIRST_STEP_BAR = 1.10, 3.0

# (name, overrides of @autoparallel, the hand-written recipe's arguments)
CONFIGS: list[tuple[str, dict, dict]] = [
    ("dp2 x tp2", dict(pp=1, dp=2, tp=2, zero_stage=3, sequence_parallel=False),
     dict(pp=1, dp=2, tp=2, sp=False)),
    ("dp2 x tp2 + sequence-parallel norms",
     dict(pp=1, dp=2, tp=2, zero_stage=3, sequence_parallel=True),
     dict(pp=1, dp=2, tp=2, sp=True)),
    ("dp4 ZeRO-3", dict(pp=1, dp=4, tp=1, zero_stage=3), dict(pp=1, dp=4, tp=1, sp=False)),
    ("pp2 x dp2 1F1B m4", dict(pp=2, dp=2, tp=1, zero_stage=3, num_microbatches=4,
                               schedule="1f1b"),
     dict(pp=2, dp=2, tp=1, sp=False, num_microbatches=4)),
    # Compiled: autoplan's compile=True (inductor on each rank's stage modules) against
    # torchtitan's apply_compile (torch.compile of every block, before FSDP2).
    ("dp2 x tp2 compiled", dict(pp=1, dp=2, tp=2, zero_stage=3, sequence_parallel=False,
                                compile=True),
     dict(pp=1, dp=2, tp=2, sp=False, compile=True)),
    ("pp2 x dp2 1F1B m4 compiled", dict(pp=2, dp=2, tp=1, zero_stage=3, num_microbatches=4,
                                        schedule="1f1b", compile=True),
     dict(pp=2, dp=2, tp=1, sp=False, num_microbatches=4, compile=True)),
]
COMPILED = {name for name, overrides, _ in CONFIGS if overrides.get("compile")}
"""Rows held to the step-time bar only: their first step is inductor's compilation on both
sides (the first-step bar is the four eager configurations')."""


# --- the model -----------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.head_dim = dim // n_head
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim) for _ in range(3))
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # (B, T, C); under tp the projections hold nh / tp heads
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), Attention(dim, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 layout, untied head. forward(idx (B, T) int64) -> logits (B, T, V). Blocks live in a
    ModuleDict keyed "0".."L-1" so that a pipeline stage can drop the others and keep the FQNs
    (torchtitan's manual split); a stage without the embeddings takes hidden states instead."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_embd: int,
                 n_head: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleDict({str(i): Block(n_embd, n_head) for i in range(n_layer)})
        self.ln_f, self.lm_head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = idx
        if self.wte is not None:
            h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h.values():
            h = block(h)
        if self.ln_f is not None:
            h = self.lm_head(self.ln_f(h))
        return h


def _batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG["vocab_size"], (GLOBAL_BATCH, SEQ_LEN + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# --- the hand-written configuration --------------------------------------------------------------

class Native:
    """The configuration written with torch-native APIs (torchtitan's recipe); `step(x, y)`
    returns the global mean loss."""

    def __init__(self, pp: int, dp: int, tp: int, sp: bool, num_microbatches: int = 1,
                 compile: bool = False):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = GPT(**CONFIG)
        self.mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        self.dp, self.dp_rank = dp, self.mesh["dp"].get_local_rank()
        self.pp, self.pp_rank = pp, self.mesh["pp"].get_local_rank()
        if pp > 1:
            model = _stage_module(model, self.pp_rank, pp)
        if tp > 1:
            _apply_tp(model, self.mesh["tp"], sp)
        if compile:  # torchtitan's apply_compile: each block, before FSDP2 wraps it
            for block in model.h.values():
                block.compile(fullgraph=True)
        for block in model.h.values():
            fully_shard(block, mesh=self.mesh["dp"])
        fully_shard(model, mesh=self.mesh["dp"])
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self._dist = dist
        if pp > 1:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B

            stage = PipelineStage(model, self.pp_rank, pp, torch.device("cpu"),
                                  group=self.mesh["pp"].get_group())
            self.schedule = Schedule1F1B(stage, num_microbatches, loss_fn=_loss)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        dist = self._dist
        n = GLOBAL_BATCH // self.dp
        x, y = x[self.dp_rank * n:(self.dp_rank + 1) * n], y[self.dp_rank * n:(self.dp_rank + 1) * n]
        self.optimizer.zero_grad(set_to_none=True)
        if self.pp > 1:
            losses: list[torch.Tensor] = []
            last = self.pp_rank == self.pp - 1
            if self.pp_rank == 0:
                self.schedule.step(x)
            else:
                self.schedule.step(target=y, losses=losses)
            loss = torch.stack(losses).mean().detach() if last else torch.zeros(())
            dist.all_reduce(loss, group=self.mesh["pp"].get_group())
        else:
            loss = _loss(self.model(x), y)
            loss.backward()
            loss = loss.detach()
        self.optimizer.step()
        dist.all_reduce(loss, group=self.mesh["dp"].get_group())
        return float(loss) / self.dp


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def _stage_module(model: GPT, stage: int, num_stages: int) -> GPT:
    """torchtitan's manual split: stage `stage` keeps its share of the blocks (embeddings on the
    first, final norm and head on the last), the other modules set to None."""
    keys = list(model.h.keys())
    per = len(keys) // num_stages
    mine = set(keys[stage * per:(stage + 1) * per])
    for k in keys:
        if k not in mine:
            del model.h[k]
    if stage != 0:
        model.wte = model.wpe = None
    if stage != num_stages - 1:
        model.ln_f = model.lm_head = None
    return model


def _apply_tp(model: GPT, tp_mesh, sp: bool) -> None:
    """Megatron-style tp with parallelize_module (torchtitan apply_tp): column-parallel
    q/k/v and w1, row-parallel wo and w2; with `sp`, the norms and residuals sharded on the
    sequence dim (Shard(1)) between the blocks' matmuls."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    keys = list(model.h.keys())
    for k, block in model.h.items():
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(), "mlp.w1": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
                "mlp.w2": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())}
        if sp:
            to_full = PrepareModuleInput(input_layouts=(Shard(1),),
                                         desired_input_layouts=(Replicate(),),
                                         use_local_output=True)
            plan.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
                         "attn": to_full, "mlp": to_full})
            if k == keys[0]:  # the residual stream enters sequence-sharded
                plan[""] = PrepareModuleInput(input_layouts=(Replicate(),),
                                              desired_input_layouts=(Shard(1),),
                                              use_local_output=True)
            if k == keys[-1]:  # and leaves whole for the final norm and head
                plan[""] = PrepareModuleOutput(output_layouts=Shard(1),
                                               desired_output_layouts=Replicate())
        parallelize_module(block, tp_mesh, {name: style for name, style in plan.items() if name})
        if "" in plan:
            parallelize_module(block, tp_mesh, plan[""])


# --- the job on every rank -----------------------------------------------------------------------

def _autoplan(overrides: dict):
    from autoplan.api import autoparallel

    torch.manual_seed(0)
    return autoparallel(GPT, global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, checkpointing="none",
                        **overrides)(**CONFIG)


def _first_step(build, x, y) -> tuple[object, float, float]:
    """(model, seconds from construction to the first loss, that loss) on this rank."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    model = build()
    loss = model.step(x, y)
    return model, time.perf_counter() - t0, loss


def pair_job(overrides: dict, native: dict, first_pairs: int, pairs: int) -> dict:
    """On every rank: `first_pairs` interleaved (autoplan, hand-written) constructions timed to
    the first loss, then `pairs` interleaved steps of the last pair's models ([Note: runtime vs
    native measurement]). Returns this rank's times, both losses per step and autoplan's build
    stats and plan."""
    import importlib

    import torch.distributed as dist

    for name in ("autoplan.api", "torch.distributed.pipelining",
                 "torch.distributed.tensor.parallel"):  # imports are not part of the first step
        importlib.import_module(name)
    x, y = _batch()
    out = {k: {"autoplan": [], "native": []}
           for k in ("first_step_s", "losses", "step_wall_s", "step_cpu_s")}
    for _ in range(first_pairs):
        ap, took_ap, loss_ap = _first_step(lambda: _autoplan(overrides), x, y)
        nat, took_nat, loss_nat = _first_step(lambda: Native(**native), x, y)
        out["first_step_s"]["autoplan"].append(took_ap)
        out["first_step_s"]["native"].append(took_nat)
        out.setdefault("build_stats", []).append(ap.build_stats())
    out["losses"]["autoplan"].append(loss_ap)
    out["losses"]["native"].append(loss_nat)
    out["plan"] = str(ap.plan.mesh)
    out["placements"] = dict(ap.plan.param_placements)  # on the tp axis, by FQN
    out["fsdp_units"] = {"autoplan": _fsdp_units(m for _, m in ap._engine.stages),
                         "native": _fsdp_units([nat.model])}
    out["stages"] = [str(s) for s in ap.plan.stages]
    for i in range(WARMUP_STEPS + pairs):
        for name, model in (("autoplan", ap), ("native", nat)):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = model.step(x, y)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            out["losses"][name].append(loss)
            if i >= WARMUP_STEPS:
                out["step_wall_s"][name].append(wall)
                out["step_cpu_s"][name].append(cpu)
    return out


def _fsdp_units(roots) -> int:
    """FSDP2 units (modules that `fully_shard` wrapped) under `roots`: ZeRO-3 gathers one unit
    at a time, so one per block is what keeps the gather transient at a block's weights."""
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for root in roots for m in root.modules())


# --- parent --------------------------------------------------------------------------------------

def _row(name: str, overrides: dict, per_rank: list[dict]) -> dict:
    r0 = per_rank[0]
    row = {"name": name, "overrides": overrides, "mesh": r0["plan"], "stages": r0["stages"],
           "tp_placements": r0["placements"], "fsdp_units_rank0": r0["fsdp_units"],
           "autoplan_build_stats_rank0": r0["build_stats"]}  # per pair, seconds
    first = {k: [max(ts) for ts in zip(*(r["first_step_s"][k] for r in per_rank))]
             for k in ("autoplan", "native")}
    row["first_step_s"] = first
    row["first_step_s_per_rank"] = {k: [r["first_step_s"][k] for r in per_rank] for k in first}
    ratios = [a / n for a, n in zip(first["autoplan"], first["native"])]
    row["first_step_ratio_per_pair"] = ratios
    row["first_step_ratio_cold"] = ratios[0]
    row["first_step_ratio"] = statistics.median(ratios)
    wall = {k: [max(ts) for ts in zip(*(r["step_wall_s"][k] for r in per_rank))]
            for k in ("autoplan", "native")}
    cpu = {k: [sum(ts) for ts in zip(*(r["step_cpu_s"][k] for r in per_rank))]
           for k in ("autoplan", "native")}
    row["step_wall_s"], row["step_cpu_s"] = wall, cpu
    row["step_ratio_wall"] = statistics.median(a / n for a, n in zip(wall["autoplan"], wall["native"]))
    row["step_ratio_cpu"] = statistics.median(a / n for a, n in zip(cpu["autoplan"], cpu["native"]))
    row["median_step_cpu_s"] = {k: statistics.median(v) for k, v in cpu.items()}
    row["median_step_wall_s"] = {k: statistics.median(v) for k, v in wall.items()}
    la, ln = r0["losses"]["autoplan"], r0["losses"]["native"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(la, ln))
    row["losses"] = {"autoplan": la, "native": ln, "max_rel_diff": rel,
                     "equal": rel <= LOSS_RTOL,
                     "ranks_agree": all(r["losses"] == r0["losses"] for r in per_rank)}
    row["pairs"], row["first_pairs"] = len(wall["autoplan"]), len(ratios)
    return row


def table(rows: list[dict]) -> str:
    lines = table_head(["configuration", "step time autoplan / hand-written (CPU, wall)",
                        "first step autoplan vs hand-written (slowest rank; cold / median)",
                        "ratio", "losses"])
    for r in rows:
        if "error" in r:
            lines.append(table_row([r["name"], f"failed: {r['error']}", "", "", ""]))
            continue
        fa, fn = r["first_step_s"]["autoplan"], r["first_step_s"]["native"]
        lines.append(table_row([
            r["name"], f"{r['step_ratio_cpu']:.2f}, {r['step_ratio_wall']:.2f}",
            f"{fa[0]:.1f} s / {statistics.median(fa):.1f} s vs {fn[0]:.1f} s / "
            f"{statistics.median(fn):.1f} s",
            f"{r['first_step_ratio_cold']:.1f}x / {r['first_step_ratio']:.1f}x",
            f"{'equal' if r['losses']['equal'] else 'DIFFER'} "
            f"(max rel. {r['losses']['max_rel_diff']:.1e})"]))
    return "\n".join(lines)


PHASES = ("record_s", "capture_for_planning_s", "plan_s", "capture_runtime_s", "build_s",
          "first_step_s", "total_s")


def phase_table(rows: list[dict]) -> str:
    """autoplan's build phases on rank 0 (model.build_stats()), median over the pairs that read
    the plan from the cache, and the cold pair's total."""
    lines = table_head(["configuration", *(p[:-2].replace("_", " ") for p in PHASES),
                        "cold total"])
    for r in rows:
        stats = r.get("autoplan_build_stats_rank0") or []
        warm = [s for s in stats if s.get("plan_from_cache")] or stats
        if not warm:
            continue
        cells = [f"{statistics.median(s.get(p, 0.0) for s in warm):.2f}" for p in PHASES]
        lines.append(table_row([r["name"], *cells, f"{stats[0]['total_s']:.1f}"]))
    return "\n".join(lines)


def verdict(rows: list[dict]) -> str:
    """The bars, met or not, in words, from the rows."""
    ok = [r for r in rows if "error" not in r]
    eager = [r for r in ok if r["name"] not in COMPILED]
    step = [r["name"] for r in ok if r["step_ratio_cpu"] <= STEP_BAR]
    first = [r["name"] for r in eager if r["first_step_ratio"] <= FIRST_STEP_BAR]
    units = {r["name"]: r.get("fsdp_units_rank0") for r in ok}
    captures = [statistics.median(s["capture_for_planning_s"] + s["capture_runtime_s"]
                                  for s in r["autoplan_build_stats_rank0"][1:] or
                                  r["autoplan_build_stats_rank0"]) for r in eager]
    totals = [statistics.median(s["total_s"] for s in r["autoplan_build_stats_rank0"][1:] or
                                r["autoplan_build_stats_rank0"]) for r in eager]
    if not eager:  # only compiled rows ran: no capture share to state
        captures, totals = [0.0], [1.0]
    return (f"Step time: {len(step)} of {len(ok)} configurations within {STEP_BAR} "
            f"(CPU time; compiled rows against the hand-written recipe compiled per block, "
            f"torchtitan's apply_compile); losses equal in "
            f"{sum(r['losses']['equal'] for r in ok)} of {len(ok)} "
            f"(rtol {LOSS_RTOL:g}). FSDP2 units on rank 0, autoplan / hand-written: "
            + ", ".join(f"{n} {u['autoplan']} / {u['native']}" for n, u in units.items() if u)
            + f". First step (eager rows; a compiled row's is inductor's compilation on both "
            f"sides): {len(first)} of {len(eager)} within {FIRST_STEP_BAR:g}x "
            f"(**{'met' if len(first) == len(eager) else 'not met'}**): after pair 1 both "
            "captures (for planning, then at the microbatch size) are read from the capture "
            "cache ([Note: capture cache] in autoplan/capture/cache.py) and take "
            f"{min(c / t for c, t in zip(captures, totals)):.0%}-"
            f"{max(c / t for c, t in zip(captures, totals)):.0%} of autoplan's warm first step; "
            "the rest is the build (graph passes, shards, FSDP2, weights), the first step "
            "itself and the plan-cache read, against a hand-written set-up that captures "
            "nothing; a cold first pair adds the two torch.export captures, the solve and the "
            "process's first DTensor dispatch.")


def update_docs(rows: list[dict], result: dict, path: Path = BENCHMARKS) -> None:
    """Replace the section '## Runtime vs hand-written' of docs/benchmarks.md (added at the end
    when missing)."""
    head = "## Runtime vs hand-written"
    body = (f"{head}\n\n`python bench/runtime_vs_native.py` (see its docstring, [Note: runtime vs "
            f"native measurement]): the same GPT ({result['num_params'] / 1e6:.1f}M parameters, "
            f"{CONFIG['n_layer']} blocks of nn.Linear, width {CONFIG['n_embd']}, global batch "
            f"{GLOBAL_BATCH} x {SEQ_LEN} tokens, fp32, AdamW) on 4 gloo ranks, built by "
            "`@autoparallel` with the configuration forced and by hand with torch-native APIs "
            "(parallelize_module, FSDP2 per block, pipelining's Schedule1F1B), same weights, "
            "losses checked equal step by step; step time: medians of "
            f"{rows[0].get('pairs', '?')} interleaved pairs (CPU time summed over ranks, then "
            "wall time of the slowest rank); first step: construction to first loss, slowest "
            "rank, pair 1 a cold process with an empty plan cache, median over "
            f"{rows[0].get('first_pairs', '?')} pairs. Bars: step <= {STEP_BAR}, first step <= "
            f"{FIRST_STEP_BAR:g}x. Results: `bench/results/runtime_vs_native.json` "
            f"({result['date']}, load average {result['machine']['loadavg']}; rows run by "
            "`--only` keep the others, each row has its own date and load average).\n\n"
            f"{table(rows)}\n\nautoplan's first step by phase (`model.build_stats()`, rank 0, "
            "seconds; median over the pairs whose plan came from the cache):\n\n"
            f"{phase_table(rows)}\n\n{verdict(rows)}\n")
    replace_section(head, body, until="\n## ", path=path)


def main(argv: list[str] | None = None) -> int:
    from autoplan.runtime.launcher import LocalCluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", help="configuration name (repeatable)")
    ap.add_argument("--pairs", type=int, default=9, help="interleaved step pairs (>= 7 for the bar)")
    ap.add_argument("--first-pairs", type=int, default=7, help="interleaved first-step pairs")
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--docs", "--readme", action="store_true", dest="docs",
                    help="also rewrite the table in docs/benchmarks.md")
    ap.add_argument("--docs-only", "--readme-only", action="store_true", dest="docs_only",
                    help="rewrite the table in docs/benchmarks.md from the results file; "
                         "run nothing")
    args = ap.parse_args(argv)
    if args.docs_only:
        result = json.loads(args.out.read_text())
        update_docs(result["rows"], result)
        return 0
    configs = [c for c in CONFIGS if not args.only or c[0] in args.only]
    if not configs:
        raise SystemExit(f"--only {args.only}: no such configuration; "
                         f"known: {[c[0] for c in CONFIGS]}")
    os.environ["AUTOPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="autoplan-rvn-cache-")
    rows = []
    for name, overrides, native in configs:  # a fresh cluster each: pair 1 is a cold process
        print(f"runtime_vs_native: {name}", file=sys.stderr, flush=True)
        with LocalCluster(WORLD, pg_timeout_s=300) as cluster:
            per_rank = cluster.run(pair_job, overrides, native, args.first_pairs, args.pairs,
                                   timeout_s=3600)
        rows.append(_row(name, overrides, per_rank))
        rows[-1]["loadavg"] = os.getloadavg()[0]
        rows[-1]["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        print(table(rows[-1:]), file=sys.stderr, flush=True)
    result = {"schema_version": SCHEMA_VERSION,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_facts(),
              "model": dict(CONFIG), "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN,
              "num_params": sum(p.numel() for p in GPT(**CONFIG).parameters()),
              "world_size": WORLD, "rows": rows,
              "bars": {"step_ratio": STEP_BAR, "first_step_ratio": FIRST_STEP_BAR}}
    if args.only and args.out.exists():  # keep the other configurations' rows of the file
        ran = {r["name"] for r in rows}
        kept = {r["name"]: r for r in json.loads(args.out.read_text())["rows"]
                if r["name"] not in ran}
        by_name = {**kept, **{r["name"]: r for r in rows}}
        rows = [by_name[c[0]] for c in CONFIGS if c[0] in by_name]
        result["rows"] = rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    print(f"{table(rows)}\n{phase_table(rows)}")
    if args.docs:
        update_docs(rows, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
