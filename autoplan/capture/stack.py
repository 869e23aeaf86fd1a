"""The layout of a stack of blocks: which of its blocks are the repeated ones.

[Note: leading blocks] A stack may open with a few blocks unlike the rest: DeepSeek-V3's first 3
of 61 blocks have a dense FFN and the other 58 routed experts (`first_k_dense_replace`; Kimi K2
and GLM-4.5 alike). Such a stack's repeated run is the uniform tail, blocks [first, n); the
leading blocks before it are ops outside the blocks, as the embedding is: captured once each,
priced node by node (their own ILP variables), run on the first pipeline stage (passes/stages.py
puts every ancestor of block 0 there) and counted in the first stage's end weight ([Note:
uneven stages] in solver/configurations.py). So planning captures the leading blocks and two of
the tail and scales the tail to its real length ([Note: shallow planning capture] in
capture/planning.py), and planning time does not grow with depth: DeepSeek-V3's 7B class of the
coverage bench (1 dense + 31 MoE blocks) was planned from all 32 blocks, their ops unshared.

The runtime's capture of the full model finds the same layout (`stack_layout` on the full
container, in `capture`), so the layer ids of the plan's graph and of the graph that runs agree
(block k is container child first + k, `CapturedGraph.block_path`). What a leading block does
not get, since it is not a block: its own FSDP2 unit (under ZeRO-3 it is gathered with the first
stage's other weights outside the blocks, passes/blocks.py) and activation checkpointing (which
wraps blocks); the planner prices it so -- its parameters among the first stage's outside-block
weights, its saved activations kept -- so what runs is what was planned.

A head of more than MAX_LEADING_BLOCKS blocks, a tail of fewer than 2, or a stack whose tail is
not uniform (blocks that alternate kinds, blocks that differ at the end) keeps the layout of
before: every block is a block, and planning captures them all (solver/problem.py shares the
blocks' variables only when they align op by op).
"""

from __future__ import annotations

from torch import nn

__all__ = ["MAX_LEADING_BLOCKS", "stack_layout", "blocks_differ"]

MAX_LEADING_BLOCKS = 4
"""The most leading blocks a stack may have outside its repeated run ([Note: leading blocks]):
each is captured and priced op by op, so planning time grows with them. DeepSeek-V3 has 3
(`first_k_dense_replace`), DeepSeek-V2 and Kimi K2 1, GLM-4.5 3."""

_PLAIN = (bool, int, float, str, type(None))
# attributes that hold a block's own position, not its structure (HF: layer_idx; others: idx)
_INDEX_NAMES = ("layer_idx", "layer_id", "layer_index", "block_idx", "idx", "index")


def stack_layout(container: nn.Module) -> int:
    """How many leading blocks of `container` (a ModuleList / ModuleDict of blocks) lie outside
    its repeated run ([Note: leading blocks]): the head before a uniform tail of >= 2 blocks,
    when it is 1 .. MAX_LEADING_BLOCKS blocks long; else 0 (the whole container is the run)."""
    blocks = list(container.children())
    shapes = [_structure(block, k) for k, block in enumerate(blocks)]
    first = len(blocks) - 1
    while first > 0 and shapes[first - 1] == shapes[-1]:
        first -= 1
    if 1 <= first <= MAX_LEADING_BLOCKS and len(blocks) - first >= 2:
        return first
    return 0


def blocks_differ(container: nn.Module, first: int = 0) -> str | None:
    """Why the blocks of `container` from `first` on are not structurally identical (the first
    difference, in words), or None when they are ([Note: shallow planning capture], step 2)."""
    blocks = list(container.named_children())[first:]
    first_name, head = blocks[0]
    reference = _structure(head, first)
    for k, (name, block) in enumerate(blocks[1:], start=first + 1):
        other = _structure(block, k)
        if other != reference:
            what = next(key for key in ("class", "params", "buffers", "modules", "attributes")
                        if other[key] != reference[key])
            return f"block {name} differs from block {first_name} in its {what}"
    return None


def _structure(block: nn.Module, index: int) -> dict:
    """What must be equal between two blocks for one to stand for the other."""
    attributes = {}
    for path, module in block.named_modules():
        for key, value in vars(module).items():
            if key.startswith("_") or not isinstance(value, _PLAIN):
                continue
            if key in _INDEX_NAMES and value == index:
                continue  # the block's own position
            attributes[f"{path}.{key}"] = value
    return {
        "class": type(block),
        "params": [(n, tuple(p.shape), p.dtype, p.requires_grad)
                   for n, p in block.named_parameters(remove_duplicate=False)],
        "buffers": [(n, tuple(b.shape), b.dtype)
                    for n, b in block.named_buffers(remove_duplicate=False)],
        "modules": [(n, type(m)) for n, m in block.named_modules()],
        "attributes": attributes,
    }
