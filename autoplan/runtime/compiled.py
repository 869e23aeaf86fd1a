"""Compiled stages: each rank's stage modules run through torch.compile (TorchInductor).

[Note: compiled stages]
With `compile=True` the engine compiles, per stage this rank holds, the forward of every block
module (`passes.blocks.install_blocks`: one per repeated block) -- torchtitan's practice
(`apply_compile` in torchtitan/models/llama3/infra/parallelize.py: one `torch.compile` per
transformer block, never the schedule, never the FSDP2 hooks). A stage without block modules
(a model without repeated blocks, or blocks left flat) has its whole graph compiled instead.
The order, and why:
1. after tensor parallelism (`apply_placements`, DTensor parameters): the compiled region runs
   on DTensors and traces their sharding propagation and the plan's redistributions into the
   graph (functional collectives), so the per-op DTensor dispatch happens once, at compile
   time, not at every step;
2. after activation checkpointing (`wrap_checkpointing` sets the block's forward): the
   checkpointed forward is what gets compiled, as torchtitan compiles the AC-wrapped block;
3. before the tp stage wrapper (`tp_stage_forward`: local tensors in, DTensor inside) and
   before FSDP2 (`replicate` / `fully_shard` on the block modules): FSDP2's all-gathers and
   reduce-scatters run in its module hooks, outside the compiled forward, and pipelining's
   send/recv outside the stage module.
The compiled function replaces the module's `forward` attribute (not the module: an
`OptimizedModule` wrapper would rename every parameter `..._orig_mod...`, and FQNs are the
checkpoint keys and the optimizer factory's names).

What a graph break costs: the rest of the region runs eagerly, with the same ops, so results
do not change (tests/test_compile.py trains with compile=True against one process). Random ops
of [Note: RNG contract] draw per-row CPU generators keyed by a mutable RandomState; they are
run outside the compiled graph (`torch.compiler.disable`), so a step counter never becomes a
guard that recompiles every step.

Compile time: inductor generates and builds C++ (CPU) or Triton (CUDA) kernels on the first
step; `TORCHINDUCTOR_CACHE_DIR` keeps them between runs (torch's own cache, keyed by graph).
"""

from __future__ import annotations

import torch
import torch.fx

__all__ = ["compile_stage", "COMPILE_BACKEND"]

COMPILE_BACKEND = "inductor"
"""torch.compile's backend for the stages (TorchInductor: C++/OpenMP on CPU, Triton on CUDA)."""


def compile_stage(gm: torch.fx.GraphModule, blocks: list[str]) -> list[str]:
    """Compile the forward of each block module of stage `gm` at `blocks` (paths), or of the
    whole stage when `blocks` is empty ([Note: compiled stages]); in place. Returns the paths
    compiled ("" for the stage itself). The compilation itself happens at the first call."""
    paths = list(blocks) or [""]
    for path in paths:
        module = gm.get_submodule(path) if path else gm
        module.forward = torch.compile(module.forward, backend=COMPILE_BACKEND)
    return paths
