"""Bytes of memory-bound ops when chains of them run as fused kernels.

[Note: pointwise fusion]
Production GPU training does not run a transformer's elementwise ops one kernel each: Megatron-LM
fuses bias + GeLU, bias + dropout + add, scale + mask + softmax and layer norm (Narayanan et al.
SC'21, section 4.2, "Operator fusion"; Korthikanti et al. 2022), Transformer Engine fuses norms,
activations and rotary embeddings, and torch.compile (TorchInductor) fuses any chain of pointwise
ops with the row reductions (softmax, norms) around them. A fused chain reads its inputs from
memory once and writes only what leaves it; the values between its ops stay in registers.

`fused_bytes` gives each memory-bound node the bytes it moves inside such kernels: the inputs it
reads that no fusible op produced (outputs of matmuls, attention, collectives, parameters, graph
inputs) plus its outputs when some consumer is not fusible (a matmul, the loss, a graph output).
A node whose inputs and outputs all stay inside fusible neighbours moves nothing and launches no
kernel of its own. View ops are looked through: they alias, a chain continues across them.
`FUSIBLE_OPS` are the ops such kernels take: elementwise arithmetic, activations, casts, masking,
and row reductions (softmax, log_softmax, norms, mean/sum). Matmuls, attention, embedding
lookups, indexing, concatenation, collectives and anything unknown end a chain, and so does
dropout: it runs as its own kernel (torch's fused dropout draws its Philox mask and applies it in
one pass; Megatron-LM's attention runs scale-mask-softmax and dropout as two kernels). This is
an assumption, not a measurement: Megatron-LM does fuse bias + dropout + add, TorchInductor
fuses dropout too. bench/published.py: 18 of 18 rows within 15% with dropout unfused, 16 with it
fused (the small models, whose attention-probability dropout is a larger share, go 19% fast).

What this leaves out: a fused kernel also writes the tensors its backward saves; with fusion the
backward recomputes cheap intermediates from the chain's input (as Megatron-LM's fused GeLU and
TorchInductor's min-cut partitioner do), so those writes are the chain's inputs, already counted
by their producers. The backward of a fused chain is priced as the forward's fused bytes times
compute.BACKWARD_BYTES_FACTOR.

The runtime runs two such chains as the kernels/ Triton kernels (RMSNorm, SwiGLU gating;
[Note: kernel fusion] in autoplan/passes/kernels.py says where their memory pass equals these
bytes and where it does not: a norm fused here with the residual add before it).

Which devices fuse is a device figure (`DeviceSpec.fuses_pointwise`: the GPU presets, whose
published runs all fuse; CPU ranks run autoplan's eager runtime, one kernel per op, as calibrated).
"""

from __future__ import annotations

import torch.fx

from autoplan.capture.facts import _nbytes
from autoplan.op_classes import VIEW_OPS, op_name

__all__ = ["FUSIBLE_OPS", "fused_bytes"]

FUSIBLE_OPS = frozenset({
    # elementwise arithmetic and comparisons
    "add", "sub", "mul", "div", "neg", "reciprocal", "pow", "sqrt", "rsqrt", "exp", "log",
    "abs", "clamp", "clamp_min", "clamp_max", "minimum", "maximum", "where", "masked_fill",
    "eq", "ne", "lt", "gt", "le", "ge", "logical_not", "logical_and", "logical_or",
    "bitwise_and", "bitwise_or", "bitwise_not", "__and__", "__or__", "__invert__", "sign",
    "rsub", "add_", "mul_", "div_", "sub_", "addcmul", "addcdiv", "lerp", "square",
    # activations
    "tanh", "sigmoid", "relu", "gelu", "silu", "erf", "sin", "cos", "softplus", "mish",
    "hardtanh", "leaky_relu", "elu",
    # casts, dropout, fills
    "to", "_to_copy", "type_as", "rand_like",
    "clone", "ones_like", "zeros_like", "full_like", "fill", "fill_",
    # row reductions and normalisation
    "softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax", "layer_norm",
    "native_layer_norm", "rms_norm", "_fused_rms_norm", "mean", "sum", "var", "var_mean",
    "amax", "logsumexp",
})


def _fusible(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and op_name(str(node.target)) in FUSIBLE_OPS


def _is_view(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and op_name(str(node.target)) in VIEW_OPS


def _source(node: torch.fx.Node) -> torch.fx.Node:
    """The node that computed `node`'s storage: views looked through to their base."""
    while _is_view(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The ops that read `node`'s value, through any chain of views of it."""
    out, todo = [], list(node.users)
    while todo:
        user = todo.pop()
        if _is_view(user):
            todo.extend(user.users)
        else:
            out.append(user)
    return out


def fused_bytes(gm: torch.fx.GraphModule) -> dict[str, int]:
    """{node name: bytes it moves when fusible chains run as one kernel} for every fusible
    `call_function` node of `gm` ([Note: pointwise fusion]); nodes that are not fusible are
    absent (their bytes are their own). Reads `node.meta["val"]` (fake or meta tensors)."""
    out: dict[str, int] = {}
    chain = _chains(gm)
    seen: set[tuple] = set()  # (chain, external input): read once by the chain's kernel
    for node in gm.graph.nodes:
        if not _fusible(node):
            continue
        read = 0
        for arg in node.all_input_nodes:
            key = (chain[node], _source(arg))
            if not _fusible(_source(arg)) and key not in seen:
                seen.add(key)
                read += _nbytes(arg.meta.get("val"))
        readers = _readers(node)
        written = (_nbytes(node.meta.get("val"))
                   if not readers or any(not _fusible(r) for r in readers) else 0)
        out[node.name] = read + written
    return out


def _chains(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each fusible node's chain, by a representative node: fusible nodes joined by an edge
    (through views) are one kernel, so an input from outside that several of them read --
    RMSNorm's x, read by its pow and its mul -- is read once."""
    parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for node in gm.graph.nodes:
        if _fusible(node):
            parent[node] = node
    for node in parent:
        for arg in node.all_input_nodes:
            src = _source(arg)
            if src in parent:
                parent[find(node)] = find(src)
    return {n: find(n) for n in parent}
