"""Activation checkpointing: wrap each repeated block of a stage graph in
`torch.utils.checkpoint`.

Run after `apply_placements` (so the redistributions a block's ops need are recomputed with
them). Each block's ops -- the nodes of `CapturedGraph.layer_nodes[k]` and the redistributions
inserted for them -- move into a sub-GraphModule that is called through
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`. Parameters stay outside the region
(get_attr nodes of the stage, passed in as arguments), so FSDP2's unsharded parameters and the
DTensor parameters the stage holds at call time are the ones used, in forward and recompute.

Policies (the plan's `checkpointing`):
- "full": keep only the block's inputs; recompute the whole block in backward.
- "core-attention": Megatron-LM's selective recompute (Korthikanti et al. 2022, section 5):
  each attention core of unfused attention -- the score matmul q @ k^T, scale, mask, softmax,
  dropout and the matmul with v, cost_model.activations.core_attention_regions -- moves into a
  sub-GraphModule run under plain checkpointing; the rest of the block saves what it saves
  without checkpointing ([Note: core attention] in autoplan/solver/checkpointing.py).
- "selective": torch's selective activation checkpointing at op level (the save-list policy
  of torchtitan's op SAC): the outputs of the matmuls, whatever their aten spelling, and of
  fused attention -- the ops whose recomputation would cost FLOPs -- are kept; every other op
  of the block (norms, activation functions, softmax, dropout, residual adds) runs again in the
  backward from them and the block's inputs. (Korthikanti et al. 2022, section 5, recompute
  only the attention core; with fused attention that core keeps nothing worth dropping, while
  the elementwise ops of the MLP keep the largest tensors.) The op list is
  autoplan.op_classes.SELECTIVE_SAVED_OPS ([Note: selective saved set]), which
  autoplan/solver/checkpointing.py prices.

Random ops (autoplan/passes/rng.py) read a mutable RandomState that enters a block as an
argument; the recompute runs with the state the forward saw (see `run_checkpointed`).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.fx
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from autoplan import op_classes
from autoplan.cost_model import activations
from autoplan.graph import CapturedGraph
from autoplan.passes.blocks import block_nodes, outline
from autoplan.passes.rng import RandomState

__all__ = ["wrap_checkpointing", "run_checkpointed", "selective_context", "POLICIES",
           "SELECTIVE_SAVED_OPS"]

POLICIES = ("none", "core-attention", "selective", "full")

SELECTIVE_SAVED_OPS = op_classes.SELECTIVE_SAVED_OPS
"""aten base names of the ops whose outputs "selective" keeps (every other op is recomputed):
the cost model's list, autoplan/op_classes.py [Note: selective saved set], the one definition the
solver prices (solver/checkpointing.py) and this policy runs."""


def _selective_policy(ctx, op, *args, **kwargs):
    # ops as dispatched: a captured aten.linear arrives here as its mm / addmm (and a view).
    # An op run without grad (inside an autograd.Function's forward: passes/rng.py's dropped
    # attention, which saves its own inputs and recomputes) records nothing for the backward:
    # keeping its output would hold what the Function chose not to (its scores). The FP8
    # linear's `_scaled_mm` also runs inside its Function's forward, and its output is the
    # linear's ([Note: float8 recipe]): kept, as a bf16 linear's mm is, so that only its casts
    # run again.
    if op is torch.ops.aten._scaled_mm.default:
        return CheckpointPolicy.MUST_SAVE
    return (CheckpointPolicy.MUST_SAVE if op_classes.selective_saves(op) and torch.is_grad_enabled()
            else CheckpointPolicy.PREFER_RECOMPUTE)


def selective_context():
    """The "selective" policy's (forward, recompute) contexts, without the random-state
    restore of `run_checkpointed`: the `context_fn` of a checkpoint that torch.compile traces
    (a module-level function, as dynamo requires; autoplan/runtime/compiled.py)."""
    return create_selective_checkpoint_contexts(_selective_policy)


class _Recompute:
    """The recompute context of `run_checkpointed`: `inner` (the policy's) entered with each
    random state at its forward snapshot, then put back where the engine has moved it.
    Entered once per recomputation: a zero-bubble schedule's backward recomputes a block
    twice, for its input gradient and for its weight gradient (torch keeps the graph, not
    the recomputed tensors, between them), so this is a class, not a generator context."""

    def __init__(self, inner, states: list[RandomState], snaps: list[tuple]):
        self.inner, self.states, self.snaps = inner, states, snaps
        self.now: list[list[tuple]] = []

    def __enter__(self):
        self.now.append([s.snapshot() for s in self.states])
        for s, snap in zip(self.states, self.snaps):
            s.restore(snap)
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc)
        finally:
            for s, snap in zip(self.states, self.now.pop()):
                s.restore(snap)


def run_checkpointed(block, policy: str, *args):
    """Call `block(*args)` (a module or its bound forward) under activation checkpointing
    with `policy`.

    A RandomState among `args` is snapshot now and restored around the recompute: by the time
    the backward runs, the engine has moved it on (to the next microbatch or step), and the
    recomputed random ops must draw the forward's values ([Note: RNG contract] in
    autoplan/passes/rng.py).
    """
    states = [a for a in args if isinstance(a, RandomState)]
    snaps = [s.snapshot() for s in states]

    def context_fn():
        forward, recompute = ((contextlib.nullcontext(), contextlib.nullcontext())
                              if policy == "full" else
                              create_selective_checkpoint_contexts(_selective_policy))
        return forward, _Recompute(recompute, states, snaps)

    return checkpoint(block, *args, use_reentrant=False, context_fn=context_fn)


def wrap_checkpointing(gm: torch.fx.GraphModule, graph: CapturedGraph, policy: str,
                       block_modules: list[str] = ()) -> int:
    """Wrap every block of `gm` (in place); returns the number of blocks wrapped.

    `block_modules`: paths of blocks that `passes.blocks.install_blocks` made modules: their
    forward runs under checkpointing inside the module, so FSDP2's hooks on the module gather
    the parameters once for forward and once for backward, and the recompute runs on them
    (torchtitan's order: FSDP outside, activation checkpointing inside). Blocks still flat in
    `gm` are moved into a checkpointed sub-GraphModule whose parameters stay outside.

    Raises ValueError for an unknown policy, or when a block's ops are interleaved with an op
    outside the block that both reads from and feeds the block (naming the node).
    """
    if policy not in POLICIES:
        raise ValueError(f"checkpointing policy {policy!r} is not one of {POLICIES}")
    if policy == "none":
        return 0
    if policy == "core-attention":
        return _wrap_cores(gm, graph, block_modules)
    for path in block_modules:
        block = gm.get_submodule(path)
        block.forward = functools.partial(run_checkpointed, block.forward, policy)
    blocks = block_nodes(gm, graph)  # those still flat
    for k, nodes in sorted(blocks.items()):
        _wrap_block(gm, k, nodes, policy)
    gm.graph.lint()
    gm.recompile()
    return len(blocks) + len(block_modules)


def _wrap_block(gm: torch.fx.GraphModule, k: int, nodes: list[torch.fx.Node],
                policy: str) -> None:
    """A flat block: its ops (parameters stay outside, as arguments) into a checkpointed
    sub-GraphModule `checkpointed_block_k`."""
    _outline_checkpointed(gm, nodes, f"checkpointed_block_{k}", policy, f"checkpointed block {k}")


def _outline_checkpointed(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], name: str,
                          policy: str, what: str) -> None:
    """`nodes` of `gm` into a sub-GraphModule `name`, called through run_checkpointed."""

    def install(sub: torch.fx.Graph) -> None:
        gm.add_submodule(name, torch.fx.GraphModule(torch.nn.Module(), sub,
                                                    class_name=name.title().replace("_", "")))

    def make_call(inputs: list[torch.fx.Node]) -> torch.fx.Node:
        handle = gm.graph.get_attr(name)
        with gm.graph.inserting_after(handle):
            return gm.graph.call_function(run_checkpointed, (handle, policy, *inputs))

    outline(gm, nodes, what, install, make_call)
    gm.graph.lint()
    gm.recompile()


def _wrap_cores(gm: torch.fx.GraphModule, graph: CapturedGraph, block_modules) -> int:
    """"core-attention": every attention core of `gm` and of its block modules into a
    sub-GraphModule `checkpointed_core_<k>` called through `run_checkpointed(..., "full")`.
    A core's members are its captured ops (by original name) and the redistributions inserted
    for them. Returns the number of cores wrapped.

    Raises ValueError when a block of this stage has a core that none of its graphs holds
    (the rewrite renamed its ops: the plan's recomputation would silently not happen)."""
    owners = [gm, *(gm.get_submodule(p) for p in block_modules)]
    present = {n.meta.get("orig_name", n.name) for o in owners for n in o.graph.nodes}
    count = 0
    for k, region in enumerate(activations.core_attention_regions(graph)):
        names = set(region)
        for owner in owners:
            nodes = [n for n in owner.graph.nodes if n.op == "call_function" and (
                n.meta.get("orig_name", n.name) in names
                or n.meta.get("redistribute_for") in names)]
            if nodes:
                _outline_checkpointed(owner, nodes, f"checkpointed_core_{k}", "full",
                                      f"attention core {k}")
                count += 1
                break
        else:
            before, after = _around(graph, region)
            if present & before and present & after:
                raise ValueError(f"core-attention checkpointing: block "
                                 f"{graph.nodes[region[0]].layer_id} of this stage has none "
                                 f"of its attention core's ops {list(region)}, though it holds "
                                 f"ops that feed the core ({sorted(present & before)}) and "
                                 f"ops that read it ({sorted(present & after)})")
    return count


def _around(graph: CapturedGraph, region: tuple[str, ...]) -> tuple[set[str], set[str]]:
    """The captured ops of the core's block that feed `region` and those that read it. A stage
    holding some of both holds the core too (a stage is a contiguous cut of the graph), so a
    core missing there was renamed; a stage cut before or after the core holds only one side."""
    fx_nodes = {n.name: n for n in graph.gm.graph.nodes}
    block = set(graph.layer_nodes.get(graph.nodes[region[0]].layer_id, ()))
    names = set(region)
    before = {a.name for r in region for a in fx_nodes[r].all_input_nodes
              if a.name in block and a.name not in names}
    after = {u.name for r in region for u in fx_nodes[r].users
             if u.name in block and u.name not in names}
    return before, after
