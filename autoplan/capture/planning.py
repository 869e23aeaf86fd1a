"""Capture for planning: a shallow copy of the model with a few of its repeated blocks.

[Note: shallow planning capture]
Planning cost must not grow with depth (docs/design.md, "Capture"): the planner prices one
representative block and scales it by the real depth (`CapturedGraph.total_layers`,
[Note: layer sharing] in autoplan/solver/problem.py). A model is made shallow here -- an
instance `@autoparallel` is given, and a preset or config.json, which `capture_preset` builds
at its full depth on meta first -- so that `@autoparallel(model)` and `autoplan plan --model
<its config.json>` capture the same graph and get the same plan. (A preset was once built
shallow from its config, its depth cut to 2: DeepSeek-V3's first 2 of 61 blocks are dense, so
`autoplan plan --model deepseek-v3` priced a 37B dense model for the 671B MoE -- 71 GB per
H100 at pp 8 x tp 4, ZeRO-0 -- without a word; tests/test_capture.py):

1. the container of repeated blocks is the one capture itself finds (`_find_layers`: the
   ModuleList / ModuleDict with most children of one class);
2. the blocks must be structurally identical, or the few captured would not stand for the
   others: same class, same parameter and buffer names, shapes and dtypes, same submodule
   classes, and the same plain attributes (ints, floats, strings: an HF layer's
   `attention_type` "sliding_attention" vs "full_attention" differs there) except those that
   hold the block's own index (`layer_idx`) -- all of them, or all after a few leading
   blocks that differ ([Note: leading blocks] in capture/stack.py: DeepSeek-V3's dense first
   blocks), which are then captured too, as ops outside the blocks. When they are not, the
   whole model is captured;
3. the copy shares every parameter, buffer and block with the user's module (nothing is
   allocated or copied, the user's module is not changed): the modules on the path from the
   root to the container are copied with `copy.copy` and given their own `_modules` dicts, and
   the container of the copy holds the leading blocks and the first `num_blocks` of the run;
4. it is captured with `capture(..., total_layers=<the run's real length>, first_layer=<the
   leading blocks>)`.

Hugging Face models run `self.layers[: config.num_hidden_layers]`, which stops at the blocks
the copy has. Only planning uses the shallow graph: the runtime captures every block (and
passes/expand.py restates the plan for it).

What else must agree for one plan (the causes issue 10 found, fixed where they were):
- the dtype: both entries capture with the parameters in the compute dtype, buffers as they
  are (`build_model(dtype=)` and api.meta_skeleton), the graph the runtime runs;
- the batch: both capture the global batch; pricing a microbatch from it scales FLOPs, bytes
  and the batch dim of the shapes together (cost_model.compute.at_tokens), so a matmul keeps
  its k and a weight is read once whatever batch was captured;
- the attention: presets build HF models with `attn_implementation="sdpa"`, and so does
  transformers for an instance built from a config (its default where torch has sdpa). An
  instance built with "eager" attention is another graph (the (B, heads, S, S) scores are
  tensors, their softmax an op) and is priced as such, on purpose: it is what would run.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from autoplan.capture import capture
from autoplan.capture.facts import _find_layers
from autoplan.capture.stack import blocks_differ, stack_layout
from autoplan.graph import CapturedGraph
from autoplan.progress import note

__all__ = ["PLANNING_BLOCKS", "capture_for_planning", "shallow_copy", "blocks_differ"]
# blocks_differ lives in capture/stack.py with the rest of a stack's layout; re-exported here

PLANNING_BLOCKS = 2
"""Blocks captured for planning (`autoplan plan --num-layers-capture`'s default too): two, so
that the block-to-block edge (the residual stream) is in the captured graph."""

def capture_for_planning(model: nn.Module, example_inputs: tuple[torch.Tensor, ...], *,
                         model_name: str = "model", num_blocks: int = PLANNING_BLOCKS,
                         example_kwargs: dict | None = None) -> CapturedGraph:
    """Capture `model` for planning: `num_blocks` of its repeated blocks when they are
    structurally identical, scaled to the real depth ([Note: shallow planning capture]);
    otherwise (different blocks, no repeated blocks, or no more than `num_blocks`) the whole
    model, as `capture` does.

    Args:
        model: the model, on the meta device to allocate nothing (real weights are shared,
            never copied).
        example_inputs: as `capture` takes them ((batch, seq) token ids, ...).
        model_name: name for reports and errors.
        num_blocks: blocks to capture (>= 1).
        example_kwargs: keyword inputs, as `capture` takes them (attention_mask, ...).

    Returns:
        CapturedGraph with `num_layers` = the blocks captured and `total_layers` = the model's.

    Raises:
        ValueError: num_blocks < 1; CaptureError and ValueError as `capture` raises them.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    prefix, size = _find_layers(model, None)
    kwargs = dict(model_name=model_name, example_kwargs=example_kwargs)
    first = stack_layout(model.get_submodule(prefix)) if size else 0
    depth = size - first  # the repeated run ([Note: leading blocks] in capture/stack.py)
    if depth <= num_blocks:
        return capture(model, example_inputs, **kwargs)
    differ = blocks_differ(model.get_submodule(prefix), first)
    if differ:
        note(f"{model_name}: capturing all {depth} blocks of {prefix!r} for planning: {differ}")
        return capture(model, example_inputs, **kwargs)
    shallow = shallow_copy(model, prefix, first + num_blocks)
    return capture(shallow, example_inputs, total_layers=depth, first_layer=first, **kwargs)


def shallow_copy(model: nn.Module, prefix: str, num_blocks: int) -> nn.Module:
    """A copy of `model` whose container `prefix` (a ModuleList or a ModuleDict with integer
    keys) holds its first `num_blocks` blocks. Parameters, buffers and the blocks themselves
    are shared with `model`; `model` is left unchanged ([Note: shallow planning capture])."""
    path = prefix.split(".")
    root = _detached(model)
    parent = root
    for name in path[:-1]:
        child = _detached(parent._modules[name])
        parent._modules[name] = child
        parent = child
    container = parent._modules[path[-1]]
    if isinstance(container, nn.ModuleList):
        kept = nn.ModuleList(list(container)[:num_blocks])
    else:
        kept = _detached(container)
        kept._modules = dict(list(container._modules.items())[:num_blocks])
    parent._modules[path[-1]] = kept
    return root


def _detached(module: nn.Module) -> nn.Module:
    """`copy.copy(module)` with its own dict of submodules (the original's stays as it is)."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    return out
