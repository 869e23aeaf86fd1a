"""The aten ops by class, named by base name (`op_name`), in one low module that capture, the
cost model, the solver, the passes and the report all read: views, matmuls (and their
operands), fused attention, ops without a gradient, and the ops whose outputs "selective"
checkpointing keeps ([Note: selective saved set]).
"""

from __future__ import annotations

__all__ = ["op_name", "VIEW_OPS", "MATMUL_OPS", "MATMUL_OPERANDS", "ATTENTION_OPS", "NO_GRAD_OPS",
           "SELECTIVE_SAVED_OPS", "selective_saves"]


def op_name(target: str) -> str:
    """Base name of an op from its text: "aten.addmm.default" -> "addmm",
    "<built-in function getitem>" / "operator.getitem" -> "getitem"."""
    text = target.strip("<>")
    if text.startswith("aten."):
        return text.split(".")[1]
    return text.replace(" ", ".").split(".")[-1]


# Op classes by aten base name (see `op_name`). Views alias their input: no kernel, no bytes.
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "view_as", "permute", "transpose", "t", "expand",
    "expand_as", "squeeze", "unsqueeze", "slice", "select", "split", "split_with_sizes",
    "chunk", "unbind", "getitem", "alias", "detach", "flatten", "unflatten", "narrow",
    "as_strided", "_reshape_alias", "lift_fresh_copy", "sym_size", "sym_numel", "sym_stride",
    "_assert_tensor_metadata", "_assert_async", "contiguous_view",
})
MATMUL_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm", "convolution",
    "experts",  # autoplan.experts: three matmuls per routed token ([Note: experts op])
})
MATMUL_OPERANDS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "mm": ((0,), (1,)), "bmm": ((0,), (1,)), "matmul": ((0,), (1,)),
    "addmm": ((1,), (2,)), "baddbmm": ((1,), (2,)), "addbmm": ((1,), (2,)),
    "linear": ((0,), (1,)), "_scaled_mm": ((0,), (1,)), "convolution": ((0,), (1,)),
    "experts": ((0,), (3, 4)),  # hidden; gate_up_proj and down_proj (autoplan.experts)
}
"""Positional args of each MATMUL_OPS op that are its two operands a and b (the ones whose
gradients the backward computes; a bias's is a reduction and is not counted), from the aten
schemas (native_functions.yaml: `addmm(self, mat1, mat2)`, `linear(input, weight, bias)`,
`convolution(input, weight, bias, ...)`) and `autoplan.experts.experts`. Read by capture for
`NodeInfo.backward_share` ([Note: backward share] in autoplan/capture/facts.py)."""
assert set(MATMUL_OPERANDS) == MATMUL_OPS, "every matmul-like op names its two operands"
ATTENTION_OPS = frozenset({
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
    "_efficient_attention_forward",
})
NO_GRAD_OPS = frozenset({
    "eq", "ne", "lt", "gt", "le", "ge", "logical_not", "logical_and", "logical_or",
    "ones_like", "zeros_like", "full_like", "empty_like", "full", "scalar_tensor", "arange",
    "zeros", "ones", "empty", "rand", "rand_like", "randn", "bernoulli", "argmax", "argmin",
    "new_ones", "new_zeros", "new_full", "new_empty", "__and__", "__or__", "__invert__",
    "bitwise_and", "bitwise_or", "bitwise_not",
})

# [Note: selective saved set]
# "selective" as the runtime runs it (torch's selective checkpoint contexts,
# autoplan/passes/checkpointing.py) and as the solver prices it (solver/checkpointing.py,
# Problem.kept_selective): a checkpointed block keeps the outputs of its matmuls and of fused
# attention -- the ops whose recomputation costs FLOPs -- and its input; every other op (norms,
# activation functions, rotary embedding, softmax, dropout, residual adds, casts) runs again in
# the backward from them. This is Korthikanti et al. 2022's selective recompute in spirit (keep
# what is expensive to recompute, recompute the cheap and large), and torchtitan's op-level SAC
# save list. One list, `SELECTIVE_SAVED_OPS`, by aten base name, serves both sides, and names
# every spelling of a matmul: the captured graph holds `linear` (and `matmul`), which run as
# `mm` / `addmm` / `bmm` when the runtime dispatches them, and a kept `linear` is its `mm`'s
# output (a view of it): the same bytes.

SELECTIVE_SAVED_OPS = MATMUL_OPS | ATTENTION_OPS
"""aten base names (op_classes.op_name) of the ops whose outputs "selective" checkpointing keeps
([Note: selective saved set]): every matmul spelling (linear, mm, addmm, bmm, baddbmm, addbmm,
matmul, _scaled_mm; convolution and the experts op, matmuls too) and every fused attention."""


def selective_saves(op) -> bool:
    """True when "selective" checkpointing keeps the outputs of `op` (an OpOverload, an fx
    node target or its text: "aten.mm.default", "aten.linear.default")."""
    return op_name(str(op)) in SELECTIVE_SAVED_OPS
