"""Compiled stages: each rank's stage modules run through torch.compile (TorchInductor).

[Note: compiled stages]
With `compile=True` the engine compiles, per stage this rank holds, the forward of every block
module (`passes.blocks.install_blocks`: one per repeated block) -- torchtitan's practice
(`apply_compile` in torchtitan/models/llama3/infra/parallelize.py: one `torch.compile` per
transformer block, never the schedule, never the FSDP2 hooks). A stage without block modules
(a model without repeated blocks, or blocks left flat) has its whole graph compiled instead.
The order (steps 10-14 of [Note: pass order] in autoplan/passes/lowering.py), and why:
1. after tensor parallelism (`apply_placements`, DTensor parameters): the compiled region runs
   on DTensors and traces their sharding propagation and the plan's redistributions into the
   graph (functional collectives), so the per-op DTensor dispatch happens once, at compile
   time, not at every step;
2. with activation checkpointing: "selective" as torchtitan, the checkpointed forward is
   compiled (dynamo's checkpoint applies the save list inside the graph); "full" compiles the
   block's forward and checkpoints it from outside (eagerly: the recompute calls the compiled
   forward again), because dynamo's checkpoint takes no `context_fn` of its own making and
   ours restores the random state around the recompute ([Note: RNG contract]). Random ops
   under "selective" cannot be compiled (they run eagerly, and a checkpointed region cannot
   break its graph): the engine refuses that combination at build time;
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
run outside the compiled graph (`torch.compiler.disable`, passes/keyed_random.py
`random_ops_eager`), so a step counter never becomes a guard that recompiles every step.

Compile time: inductor generates and builds C++ (CPU) or Triton (CUDA) kernels on the first
step; `TORCHINDUCTOR_CACHE_DIR` keeps them between runs (torch's own cache, keyed by graph).

[Note: compile cache and process groups]
A compiled region that runs a collective names its process group by the group's *name*, and
c10d names groups by a counter of the groups a rank registered: ranks that are not members of a
group do not count it, so the two tp groups of dp2 x tp2 carry different names on ranks {0, 1}
and {2, 3}, and a process that created groups of its own first numbers them differently again.
Torch's on-disk caches (FX graph cache, AOTAutograd cache), which the ranks of one machine and
a restarted job share, do not key on what a name means: a rank could load kernels that another
rank compiled, naming a group that is absent on it ("Could not resolve the process group
registered under the name 7", its peers waiting in an all-gather) or, worse, one of other
ranks (tests/test_compile.py::test_compile_cache_is_keyed_by_what_group_names_mean). `pin_cache_to_groups` therefore adds the meaning of every group
of the engine's mesh (name -> global ranks) to `torch.compiler.config.cache_key_tag`, which both
caches include in their keys: a cached artifact is reused only where its group names mean the
same ranks. The tag is set process-wide, not around the compiled calls, because AOTAutograd
compiles a backward lazily, at the first backward, outside any forward's context; it keeps a
tag the user set (prefix) and accumulates the groups of every engine built in the process.
"""

from __future__ import annotations

import functools
import hashlib

import torch
import torch.fx
from torch.utils.checkpoint import checkpoint

__all__ = ["compile_stage", "compile_flat_stage", "pin_cache_to_groups", "COMPILE_BACKEND"]

COMPILE_BACKEND = "inductor"
"""torch.compile's backend for the stages (TorchInductor: C++/OpenMP on CPU, Triton on CUDA)."""


def compile_stage(gm: torch.fx.GraphModule, blocks: list[str], checkpointing: str) -> list[str]:
    """Compile the forward of each block module of stage `gm` at `blocks` (paths); in place.
    Returns the paths compiled. Run after `install_blocks` and before `wrap_checkpointing`.

    `checkpointing` (the plan's policy): "none" and "full" compile the block's forward, which
    `wrap_checkpointing` then runs under `torch.utils.checkpoint` eagerly (the recompute calls
    the compiled forward again). "selective" compiles the checkpointed forward instead
    (torchtitan's order: dynamo's checkpoint applies the save list inside the compiled graph;
    the save list cannot reach into a compiled region from outside): those blocks are then
    checkpointed already, and must not be given to `wrap_checkpointing` again. A stage
    without block modules:
    `compile_flat_stage`, after `wrap_checkpointing`. The compilation itself happens at the
    first call."""
    from autoplan.passes.checkpointing import selective_context

    for path in blocks:
        module = gm.get_submodule(path)
        if checkpointing == "selective":
            forward = module.forward
            module.forward = functools.partial(
                checkpoint, forward, use_reentrant=False, context_fn=selective_context)
        _compile_forward(module)
    return list(blocks)


def compile_flat_stage(gm: torch.fx.GraphModule) -> list[str]:
    """A stage without block modules: compile its checkpointed blocks (`wrap_checkpointing`'s
    `checkpointed_block_k` sub-GraphModules) when it has any, else its whole forward; in
    place. Returns the paths compiled ("" for the stage itself)."""
    paths = [name for name, _ in gm.named_children() if name.startswith("checkpointed_block_")]
    for path in paths:
        _compile_forward(gm.get_submodule(path))
    if not paths:
        _compile_forward(gm)
        paths = [""]
    return paths


_PINNED_GROUPS: set[tuple[str, tuple[int, ...]]] = set()
"""(group name, global ranks) of every mesh group `pin_cache_to_groups` saw in this process."""
_USER_TAG: list[str] = []
"""The cache_key_tag the process had before the first pin (kept as the tag's prefix)."""


def pin_cache_to_groups(mesh) -> str:
    """Key torch's compile caches on what the process-group names of `mesh` (a DeviceMesh)
    mean ([Note: compile cache and process groups]); call before the first compiled call.
    Returns the tag now in `torch.compiler.config.cache_key_tag`."""
    import torch.distributed as dist

    if not _USER_TAG:
        _USER_TAG.append(torch.compiler.config.cache_key_tag)
    _PINNED_GROUPS.update((g.group_name, tuple(dist.get_process_group_ranks(g)))
                          for g in mesh.get_all_groups())
    digest = hashlib.sha256(repr(sorted(_PINNED_GROUPS)).encode()).hexdigest()[:16]
    tag = f"autoplan-process-groups-{digest}"
    torch.compiler.config.cache_key_tag = f"{_USER_TAG[0]}|{tag}" if _USER_TAG[0] else tag
    return torch.compiler.config.cache_key_tag


def _compile_forward(module: torch.nn.Module) -> None:
    module.forward = torch.compile(module.forward, backend=COMPILE_BACKEND)
