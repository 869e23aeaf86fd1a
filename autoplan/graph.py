"""The captured graph: an aten FX graph plus the per-node facts the planner needs.

Produced by `autoplan.capture.capture`; read by strategies, cost model, solver and passes.
Parameter and buffer FQNs are the model's own (`model.layers.3.mlp.up_proj.weight`) end to end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx
import torch.utils._pytree as pytree

__all__ = ["NodeInfo", "ParamInfo", "CapturedGraph"]


@dataclass(frozen=True)
class NodeInfo:
    """Facts about one `call_function` node of the captured graph (global shapes).

    Attributes:
        name: fx node name.
        target: the aten overload as text, e.g. "aten.addmm.default".
        shapes: shape of each tensor output (global, unsharded).
        dtypes: dtype name of each tensor output ("float32", ...).
        out_bytes: bytes of all tensor outputs.
        in_bytes: bytes of all tensor inputs.
        flops: forward FLOPs of the op (torch.utils.flop_counter; 0 for ops it does not count).
        module_path: FQN of the innermost nn.Module that issued the op ("" for the root).
        layer_id: index of the repeated block (transformer layer) the op belongs to, or None.
        fused_bytes: bytes the op moves when chains of memory-bound ops run as fused kernels
            (capture/fusion.py, [Note: pointwise fusion]); None for ops that do not fuse.
        backward_share: fraction of the op's backward that runs, in [0, 1] (dimensionless;
            [Note: backward share] in autoplan/capture/facts.py). A matmul-like op: (operand
            a needs a gradient + operand b needs one) / 2, so 0.5 for a matmul whose weight
            is a frozen parameter (only the input gradient). Any other op: 0.0 when all its
            tensor inputs derive from frozen parameters only, else 1.0. 1.0 everywhere in a
            model without frozen parameters.
        experts: (E, k, I) of an `autoplan.experts` node ([Note: experts op]: its E experts
            of intermediate size I, k choices per token), the per-expert GEMMs' shape the cost
            model prices it by ([Note: matmul efficiency curve] in cost_model/compute.py);
            None for every other op.
    """

    name: str
    target: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    out_bytes: int
    in_bytes: int
    flops: int
    module_path: str
    layer_id: int | None
    fused_bytes: int | None = None
    backward_share: float = 1.0
    experts: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class ParamInfo:
    """A parameter or buffer of the captured model.

    Attributes:
        fqn: canonical FQN (the first name the module registers it under).
        shape, dtype: global shape and dtype name.
        numel: element count.
        is_buffer: True for buffers (not trained, never ZeRO-sharded).
        layer_id: repeated-block index of the module that owns it, or None.
        aliases: other FQNs bound to the same tensor (tied weights), excluding `fqn`.
        trainable: the optimizer steps it (`requires_grad` of a parameter; False for a
            frozen parameter and for every buffer). A frozen parameter gets no gradient, no
            reduction and no optimizer state ([Note: frozen parameters] in
            autoplan/runtime/engine.py).
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    is_buffer: bool
    layer_id: int | None
    aliases: tuple[str, ...] = ()
    trainable: bool = True


@dataclass
class CapturedGraph:
    """A model captured on meta/fake tensors.

    Attributes:
        gm: unlifted aten GraphModule: parameters and buffers are attributes at their FQNs
            (get_attr nodes), on the meta device; `gm(*inputs)` returns the model output's
            tensors: one tensor, or a flat tuple (`unflatten_output` rebuilds the output). Device kwargs inside the graph say "meta"; the passes retarget.
        nodes: NodeInfo per call_function node, in graph order.
        params: ParamInfo per parameter/buffer FQN (canonical FQNs only).
        input_names: placeholder names in call order.
        input_shapes: global shape of each input.
        input_dtypes: dtype name of each input.
        layer_prefix: FQN of the ModuleList holding the repeated blocks ("" if none).
        num_layers: number of repeated blocks.
        first_layer: the container's leading blocks outside the repeated run, whose ops are
            outside the blocks ([Note: leading blocks] in capture/stack.py): block k is the
            container's child first_layer + k (`block_path`). Usually 0.
        layer_nodes: node names per layer id, in graph order (identical blocks align by index).
        model_name: a name for reports.
        total_layers: blocks of the real model's repeated run when it was captured with
            fewer (planning a 126-layer model captures a few identical blocks and scales; see
            capture). Equal to num_layers for a full capture.
        output_names: path of each output tensor in the model's output ("logits", "loss",
            "0"; "output" for a bare tensor), in the graph's output order.
        output_treespec: pytree structure of the model's output (None: one bare tensor).
        output_constants: the output's non-tensor leaves, by leaf index.
        batch_size, seq_len: samples and tokens per sample of the capture, which cost scaling
            reads (default: dims 0 and 1 of the first input, as for token ids; seq_len 0: the
            training spec's, for a first input of one dim).
    """

    gm: torch.fx.GraphModule
    nodes: dict[str, NodeInfo]
    params: dict[str, ParamInfo]
    input_names: tuple[str, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    layer_prefix: str
    num_layers: int
    layer_nodes: dict[int, tuple[str, ...]] = field(default_factory=dict)
    model_name: str = "model"
    total_layers: int = 0
    output_names: tuple[str, ...] = ("output",)
    output_treespec: Any = None
    output_constants: dict[int, Any] = field(default_factory=dict)
    batch_size: int = 0
    seq_len: int = 0
    first_layer: int = 0

    def block_path(self, k: int) -> str:
        """Module FQN of repeated block k (layer id k): `{layer_prefix}.{first_layer + k}`."""
        return f"{self.layer_prefix}.{self.first_layer + k}"

    def __post_init__(self) -> None:
        if not self.total_layers:
            self.total_layers = self.num_layers
        shape = self.input_shapes[0] if self.input_shapes else ()
        if not self.batch_size:
            self.batch_size = shape[0] if shape else 1
        if not self.seq_len and len(shape) > 1:
            self.seq_len = shape[1]

    def unflatten_output(self, out) -> Any:
        """The model's output (a ModelOutput, tuple, dict, tensor) from what `gm` returns."""
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        if self.output_treespec is None:
            return flat[0] if len(flat) == 1 else tuple(flat)
        tensors = iter(flat)
        leaves = [self.output_constants[i] if i in self.output_constants else next(tensors)
                  for i in range(self.output_treespec.num_leaves)]
        return pytree.tree_unflatten(leaves, self.output_treespec)

    def output_index(self, name: str) -> int | None:
        """Index in the graph's output of the output tensor at path `name`, or None."""
        return self.output_names.index(name) if name in self.output_names else None

    @property
    def vocab_size(self) -> int | None:
        """The last dim of the main output (the vocabulary of a language model's logits, the
        classes of a classifier) when that output has at least 2 dims, else None. It is the one
        dim a plan may split unevenly ([Note: uneven vocabulary])."""
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        flat = [a for a in pytree.tree_leaves(out.args) if isinstance(a, torch.fx.Node)]
        i = self.main_output_index
        val = flat[i].meta.get("val") if i < len(flat) else None
        return int(val.shape[-1]) if getattr(val, "ndim", 0) >= 2 else None

    @property
    def main_output_index(self) -> int:
        """The output the default loss reads: `logits` when the output has it, else the
        first tensor that is not a `loss`."""
        if "logits" in self.output_names:
            return self.output_names.index("logits")
        rest = [i for i, n in enumerate(self.output_names) if n != "loss"]
        return rest[0] if rest else 0

    @property
    def num_params(self) -> int:
        """Parameter count, frozen ones included (tied weights counted once)."""
        return sum(p.numel for p in self.params.values() if not p.is_buffer)

    @property
    def num_trainable_params(self) -> int:
        """Count of the parameters the optimizer steps (`requires_grad`; tied weights
        counted once)."""
        return sum(p.numel for p in self.params.values() if p.trainable)
