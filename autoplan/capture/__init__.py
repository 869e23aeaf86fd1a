"""Capture: nn.Module + example inputs -> `CapturedGraph` (an aten FX graph + per-node facts).

The steps, in order:
1. `torch.export.export(strict=False)` of a thin wrapper that calls the model with the
   example's positional and keyword inputs (any pytree of tensors; HF models with
   `use_cache=False`) and returns the tensors of its output (a tensor, a ModelOutput, a tuple or
   dict) as a flat tuple; the output's structure is kept to rebuild it (`unflatten_output`). Export runs on fake tensors, so a model on the meta device is captured without
   allocating it; a model on the meta device gets its example inputs moved to meta.
   The graph stays at the export training-IR level (aten.linear, aten.addmm, aten.view,
   aten.scaled_dot_product_attention, ...): no core-aten decomposition, because strategies and
   costs speak these ops.
2. Clean the unlifted graph (`ep.module()`) into a plain GraphModule: placeholders named after the
   model's forward arguments (`input_ids`), then one get_attr per parameter/buffer at its
   canonical FQN (tied weights: one node, see [Note: tied weights]), then the ops; the export
   guard module, `aten._assert_tensor_metadata` nodes (they pin the capture device) and the pytree
   codegen are dropped; the output is one tensor, or a flat tuple of the output's tensors.
3. Device constants (`aten.arange(..., device=...)`, `aten.to(..., device)`) are set to meta; the
   passes (or `materialize`) retarget them with `retarget_device`. `node.meta["val"]` keeps the
   export's fake tensors (global shapes, on the capture device).
4. Per call_function node: shapes, dtypes, bytes, forward FLOPs (torch.utils.flop_counter run on
   meta tensors, see `_node_flops`), innermost module FQN and layer id.
5. Repeated blocks: the nn.ModuleList / nn.ModuleDict (digit keys; not a parametrization's
   list, `conv.parametrizations.weight`) with the most children of one class holds the layers
   (`layer_prefix` overrides); ops under `{layer_prefix}.{first + k}` get layer id k, `first`
   the leading blocks unlike the rest ([Note: leading blocks] in stack.py; usually 0).

[Note: tied weights] Export may read a tied tensor under either name (GPT-2's embedding reads
`lm_head.weight`). Every name is mapped by tensor identity to its canonical FQN, the first name
`named_parameters(remove_duplicate=False)` yields (`transformer.wte.weight`); the others are
`ParamInfo.aliases` and are absent from the GraphModule.

What capture cannot do raises `CaptureError`, naming the module FQN, the source line and the
original error (data-dependent control flow such as `if x.sum() > 0:`, `.item()` used as a
shape or a condition, ops without a meta/fake kernel).

Files: this package's __init__ (the API: `capture`, `capture_preset`), errors.py
(`CaptureError`, which every step raises), trace.py
(step 1 and the mapping of trace failures to `CaptureError`; host_random.py refuses random
draws on the host, [Note: host random draws]), clean.py (step 2, [Note: tied
weights]), facts.py (steps 4 and 5: per-node facts, repeated blocks, parameters; with fusion.py, the
bytes of memory-bound ops run as fused chains, [Note: pointwise fusion]), hf_experts.py
(during step 1, mixture-of-experts layers run as one static-shape op, [Note: experts op]),
constants.py (constants the model's code creates while traced on meta), planning.py
(`capture_for_planning`: a few identical blocks scaled to the real depth, [Note: shallow
planning capture]; the plan is restated for the runtime's full graph by
autoplan/passes/expand.py), cache.py and fingerprint.py (`cached_capture`: a capture made before
read back from disk, keyed by everything the graph depends on, [Note: capture cache]).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.utils.flop_counter as flop_counter
from torch import nn

from autoplan.capture.clean import _clean_graph
from autoplan.capture.errors import CaptureError
from autoplan.capture.facts import (_backward_shares, _check_layers_align, _dtype_name,
                                    _find_layers, _node_info, _param_infos)
from autoplan.capture.fusion import fused_bytes
from autoplan.capture.hf_experts import experts_as_op
from autoplan.capture.stack import stack_layout
from autoplan.capture.trace import _check_inputs, _export, _input_names
from autoplan.graph import CapturedGraph, NodeInfo
# Re-exported: they live with the passes, which own graph rewriting.
from autoplan.passes.device import materialize, retarget_device

__all__ = ["CaptureError", "capture", "capture_preset", "materialize", "retarget_device"]


_POSITION_FIELDS = ("n_positions", "max_position_embeddings", "block_size")


def _check_positions(model: nn.Module, inputs, model_name: str) -> None:
    """A token sequence (dim 1 of the first input) no longer than the positions the model's
    config declares: a longer one traces on meta tensors and fails only when it runs (an
    embedding index out of range)."""
    config = getattr(model, "config", None)
    if config is None or not inputs or inputs[0].dim() != 2 or inputs[0].is_floating_point():
        return  # token ids are (batch, seq) integers
    seq = inputs[0].shape[1]
    for field in _POSITION_FIELDS:
        limit = getattr(config, field, None)
        if isinstance(limit, int) and seq > limit:
            raise ValueError(f"{model_name}: sequence length {seq} is longer than the model's "
                             f"{field} = {limit}")


def capture(model: nn.Module, example_inputs: tuple[torch.Tensor, ...], *,
            model_name: str = "model", layer_prefix: str | None = None,
            total_layers: int | None = None, first_layer: int | None = None,
            example_kwargs: dict | None = None) -> CapturedGraph:
    """Capture `model(*example_inputs, **example_kwargs)` as an aten FX graph with per-node
    facts.

    Args:
        model: any nn.Module; on the meta device to capture without allocating (recommended).
        example_inputs: positional inputs with their global shapes (e.g. input_ids
            (batch, seq) int64): tensors, or tuples/lists/dicts of them; moved to meta when
            the model is on meta.
        example_kwargs: keyword inputs, likewise (e.g. attention_mask, pixel_values); the
            graph's inputs are the flat tensors of (example_inputs, example_kwargs), named
            after forward's arguments and the keys.
        model_name: name for reports and error messages.
        layer_prefix: FQN of the ModuleList/ModuleDict of repeated blocks (default: detected,
            the container with most children of one class); "" for no layers.
        total_layers: blocks of the real model's repeated run when `model` is a shallow copy
            (default: the number of blocks captured).
        first_layer: leading blocks of the container outside its repeated run ([Note: leading
            blocks] in capture/stack.py; default: `stack_layout` of the container), given by
            a shallow copy whose own tail is too short to tell.

    Returns:
        CapturedGraph; `gm(*flat_inputs)` returns one tensor or a flat tuple of the output's
        tensors (`CapturedGraph.unflatten_output`). Parameters/buffers are meta attributes
        at canonical FQNs; use `materialize` to load real weights.

    Raises:
        CaptureError: the model does not trace (message: module FQN, source line, cause).
        ValueError: bad inputs, a sequence longer than the model's positions (its config's
            n_positions / max_position_embeddings / block_size), or a `layer_prefix` that
            names no module container.
    """
    inputs, in_spec = _check_inputs(model, example_inputs, example_kwargs)
    _check_positions(model, inputs, model_name)
    if total_layers is not None and total_layers < 1:
        raise ValueError(f"total_layers must be >= 1, got {total_layers}")
    with experts_as_op(model):  # MoE experts as one static-shape op (capture/hf_experts.py)
        ep, root = _export(model, inputs, in_spec, model_name)
    gm = _clean_graph(ep.module(), model, _input_names(model, in_spec))
    retarget_device(gm, torch.device("meta"))

    prefix, size = _find_layers(model, layer_prefix)
    if first_layer is None:
        first_layer = stack_layout(model.get_submodule(prefix)) if size else 0
    num_layers = size - first_layer
    module_names = {name for name, _ in model.named_modules()}
    nodes: dict[str, NodeInfo] = {}
    with flop_counter.FlopCounterMode(display=False) as counter:
        for node in gm.graph.nodes:
            if node.op == "call_function":
                nodes[node.name] = _node_info(node, counter, module_names, prefix, model_name,
                                              first_layer)
    for name, nbytes in fused_bytes(gm).items():
        nodes[name] = dataclasses.replace(nodes[name], fused_bytes=nbytes)
    params = _param_infos(model, prefix, first_layer)
    for name, share in _backward_shares(gm, params).items():
        if share != 1.0:  # frozen parameters only ([Note: backward share])
            nodes[name] = dataclasses.replace(nodes[name], backward_share=share)
    layer_nodes: dict[int, list[str]] = {k: [] for k in range(num_layers)}
    for info in nodes.values():
        if info.layer_id is not None:
            layer_nodes.setdefault(info.layer_id, []).append(info.name)
    _check_layers_align(nodes, layer_nodes, prefix, model_name)
    return CapturedGraph(
        gm=gm, nodes=nodes, params=params,
        input_names=tuple(n.name for n in gm.graph.find_nodes(op="placeholder")),
        input_shapes=tuple(tuple(t.shape) for t in inputs),
        input_dtypes=tuple(_dtype_name(t.dtype) for t in inputs),
        layer_prefix=prefix, num_layers=num_layers, first_layer=first_layer,
        layer_nodes={k: tuple(v) for k, v in sorted(layer_nodes.items())},
        model_name=model_name, total_layers=total_layers or num_layers,
        output_names=tuple(root.seen.names), output_treespec=root.seen.spec,
        output_constants=dict(root.seen.constants))


def capture_preset(name: str, *, batch: int, seq_len: int, num_layers: int | None = None,
                   dtype: torch.dtype | None = None, trainable=None) -> CapturedGraph:
    """Build preset `name` (or an HF config.json) on meta and capture it on (batch, seq_len)
    inputs. With `num_layers`, the planning capture `@autoparallel` makes of the same model
    (capture/planning.py `capture_for_planning`, [Note: shallow planning capture]): its first
    `num_layers` blocks scaled to the real depth when every block is structurally the same,
    else the whole model -- a stack whose blocks differ (DeepSeek-V3's three dense blocks
    before 58 MoE blocks, a Qwen3-MoE with `mlp_only_layers`) is never priced from its first
    blocks alone. The model is built at its full depth on meta to see its blocks (nothing is
    allocated). `trainable` (autoplan.models.trainable.Trainable): the adapters to add before
    capture, the base frozen (None: full training). Raises ValueError from Trainable.apply,
    and for num_layers < 1."""
    from autoplan.capture.planning import capture_for_planning
    from autoplan.models import build_model, example_inputs

    model = build_model(name, device="meta", dtype=dtype)
    if trainable is not None:
        model = trainable.apply(model)
    inputs = example_inputs(name, batch=batch, seq_len=seq_len, device="meta")
    if num_layers is None:
        return capture(model, inputs, model_name=name)
    return capture_for_planning(model, inputs, model_name=name, num_blocks=num_layers)
