"""The FP8 linear: what a linear layer of a `float8` plan computes, on one process and on tp ranks.

[Note: float8 recipe] torchao's float8 training (torchao/float8) with its recipe
"rowwise_with_gw_hp" (`Float8LinearConfig.from_recipe_name`; torchtitan's float8 converter
takes the same recipe names):

    forward   y  = x @ W^T        x (M, K) e4m3, one scale per row (token) over K;
                                  W (N, K) e4m3, one scale per row (output feature) over K
    backward  dx = dy @ W          dy (M, N) e4m3, one scale per row over N;
                                  W e4m3, one scale for the whole weight (tensorwise)
              dW = dy^T @ x        in the compute dtype (bf16): "gw_hp", the weight gradient in
                                   high precision

Each scale is a power of two, 2^floor(log2(fp8_max / amax)) (torchao's
`round_scales_to_power_of_2`, on by default for rowwise), so multiplying by it is exact and a
quantized value is the input rounded to the FP8 format, saturated at its largest finite value.
The two matmuls run as `torch._scaled_mm` (autoplan/_torch_compat/scaled_mm.py; FP8 operands,
fp32 accumulation, output in the compute dtype); the backward saves x and W in the compute
dtype, as the bf16 recipe does, so FP8 adds no activation memory: the FP8 copies are transient
and cast in the input's dtype, never through an fp32 copy (a dry run of llama3-8b at
pp2 x dp4 on dgx-h100, rank 0: peak 69.6 GB with 160 FP8 linears and in bf16, 70.3 GB
planned for both; 69.8 GB while the casts went through fp32).

Why rowwise with the weight gradient in bf16, not tensorwise. A plan changes where work
happens, never what is computed. A tensorwise scale is the amax of the whole activation, which
under data parallelism is the amax of one rank's share of the batch: dp ranks would quantize
with other scales than one process, so a dp plan would compute other numbers (up to one FP8
rounding step, 2^-3 relative for e4m3). A row's scale depends on that row only: splitting the
batch, the sequence or the microbatches leaves every quantized value as it is on one process.
For the same reason the weight gradient, a contraction over the tokens that dp splits, is kept
in the compute dtype. What remains is the contraction dim under tensor parallelism, which a
row's amax spans: where the plan shards it (the row-parallel forward, W Shard(1); the
column-parallel backward, W Shard(0)), the rank's amaxes are all-reduced (max) over the tp
group before scaling, and so is the tensorwise weight's wherever the weight is split -- small
fp32 all-reduces, one per operand, which the cost model prices -- so the quantized values
equal one process's. (The weight's scale does not depend on the batch: dp ranks hold the
whole weight when they multiply by it.) (With power-of-two scales a rank's
own amax would change only exponents, and so only the values that the whole row's scale makes
subnormal -- those below 2^-6 / 448 of the row's amax, for e4m3 -- but those it would change.)
A multi-rank run of the recipe then differs from one process only in the order fp32 and bf16
sums are taken, as the bf16 recipe does.

Which linears (`Plan.float8_linears`, chosen by the planner: cost_model/float8.py): the block
linears -- `nn.Linear` (captured as aten.linear) and HF's Conv1D (GPT-2: aten.addmm with the
weight (K, N), run as the linear of its transpose, `float8_addmm`) -- with both weight dims
divisible by 16, on each rank's shard too (`torch._scaled_mm`'s requirement on CUDA), not a
router's (its scores pick discrete routes) nor the LM head (torchtitan's default
`filter_fqns=["output"]`), whose planned placements this module runs on local shards
(`supported`): W Replicate with x Replicate or split on a token dim; W Shard(0) (column
parallel) with x Replicate; W Shard(1) (row parallel) with x Shard on its last dim and the
bias, if any, Partial.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autoplan._torch_compat import scaled_mm

__all__ = ["E4M3", "E5M2", "float8_linear", "float8_linear_local", "float8_addmm",
           "quantize_rows", "quantize_tensorwise", "supported", "as_linear", "LINEAR_TARGET",
           "ADDMM_TARGET"]

E4M3 = torch.float8_e4m3fn
"""The forward operands' and the weight's format (max 448)."""
E5M2 = torch.float8_e5m2
"""FP8's other format (max 57344), torchao's tensorwise recipe's for the output gradient; the
rowwise recipe here scales each row of the output gradient into e4m3 instead."""
_AMAX_FLOOR = 1e-12
"""An all-zero row's amax is raised to this (torchao's EPS), so its scale stays finite."""

LINEAR_TARGET = torch.ops.aten.linear.default
"""What a linear layer is captured as (capture keeps aten.linear whole)."""
ADDMM_TARGET = torch.ops.aten.addmm.default
"""What HF's Conv1D (GPT-2) is captured as: addmm(bias, x (M, K), weight (K, N))."""


def quantize_rows(t: torch.Tensor, dim: int, fp8: torch.dtype,
                  group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` (2-D) in `fp8` with one power-of-two scale per slice along `dim` ([Note: float8
    recipe]): dim=-1 scales each row over its columns, dim=0 each column over its rows.
    `group`: the ranks that hold the other parts of `dim` (their amax is all-reduced, max).
    Returns (the FP8 tensor, t's shape; the dequantizing scales 1 / scale, fp32, shaped to
    broadcast: (rows, 1) for dim=-1, (1, cols) for dim=0)."""
    return _quantize(t, fp8, group, dim)


def quantize_tensorwise(t: torch.Tensor, fp8: torch.dtype,
                        group: dist.ProcessGroup | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` in `fp8` with one power-of-two scale for the whole tensor (the weight of the input
    gradient, [Note: float8 recipe]); `group`: the ranks that hold the tensor's other shards.
    Returns (the FP8 tensor, the dequantizing scale, fp32, 0-d)."""
    return _quantize(t, fp8, group, None)


def _quantize(t: torch.Tensor, fp8: torch.dtype, group, dim: int | None):
    lo, hi = t.detach().aminmax() if dim is None else t.detach().aminmax(dim=dim, keepdim=True)
    amax = torch.maximum(-lo, hi).float()
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    fmax = torch.finfo(fp8).max
    scale = torch.exp2(torch.floor(torch.log2(fmax / amax.clamp(min=_AMAX_FLOOR))))
    # in t's own dtype: a power of two changes only the exponent (bf16 has fp32's range), so
    # the product is exact and no fp32 copy of t is made; fmax is exact in bf16 too
    q = (t.detach() * scale.to(t.dtype)).clamp(-fmax, fmax).to(fp8)
    return q, scale.reciprocal()


class _Float8Matmul(torch.autograd.Function):
    """x (M, K) @ weight (N, K)^T in FP8, backward as [Note: float8 recipe]; `k_group` /
    `n_group`: the tp group when K / N is split over it, `w_group` when the weight is (None:
    whole on this rank)."""

    @staticmethod
    def forward(ctx, x, weight, k_group, n_group, w_group):
        xq, x_inv = quantize_rows(x, -1, E4M3, k_group)            # (M, K), (M, 1)
        wq, w_inv = quantize_rows(weight, -1, E4M3, k_group)       # (N, K), (N, 1)
        ctx.save_for_backward(x, weight)
        ctx.n_group, ctx.w_group = n_group, w_group
        return scaled_mm(xq, wq.t(), x_inv, w_inv.t(), x.dtype)   # (M, N)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dyq, dy_inv = quantize_rows(dy, -1, E4M3, ctx.n_group)  # (M, N), (M, 1)
            wq, w_inv = quantize_tensorwise(weight, E4M3, ctx.w_group)  # (N, K), ()
            # _scaled_mm takes its second operand column-major, and a rowwise first operand's
            # scale beside a per-column one: the tensorwise scale repeated
            w_inv = w_inv.expand(1, weight.shape[1]).contiguous()   # (1, K)
            dx = scaled_mm(dyq, wq.t().contiguous().t(), dy_inv, w_inv, dy.dtype)  # (M, K)
        if ctx.needs_input_grad[1]:
            dw = (dy.t() @ x.to(dy.dtype)).to(weight.dtype)         # (N, K), high precision
        return dx, dw, None, None, None


def float8_linear_local(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        *, k_group: dist.ProcessGroup | None = None,
                        n_group: dist.ProcessGroup | None = None,
                        w_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) in FP8 on local tensors: x (..., K), weight (N, K), bias (N,)
    -> (..., N) in x's dtype. `k_group`, `n_group`, `w_group` as `_Float8Matmul`. Raises
    ValueError for a weight that is not 2-D or whose K is not x's last dim."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"float8 linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         "are not (..., K) and (N, K)")
    y = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight.to(x.dtype), k_group, n_group,
                            w_group)
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


def _last(p, ndim: int) -> bool:
    return p.is_shard() and p.dim % ndim == ndim - 1


def supported(x_placement: str, weight_placement: str, x_ndim: int,
              bias_placement: str | None = None) -> bool:
    """Whether the FP8 linear runs on local shards for these tp placements of x (x_ndim dims),
    the (N, K) weight and the bias (None: no bias), as the plan writes them ("R", "S(d)", "P";
    [Note: float8 recipe]): W R with x R or split on a token dim (bias R); W Shard(0), column
    parallel, with x R (bias Shard(0)); W Shard(1), row parallel, with x split on its last dim
    (bias Partial: the plan's R -> P, added on each rank's partial sum as DTensor adds it)."""
    def dim(p: str) -> int | None:
        return int(p[2:-1]) % x_ndim if p.startswith("S(") else None
    if weight_placement == "R":
        return bias_placement in (None, "R") and (x_placement == "R" or (
            dim(x_placement) is not None and dim(x_placement) != x_ndim - 1))
    if weight_placement == "S(0)":
        return bias_placement in (None, "S(0)") and x_placement == "R"
    if weight_placement == "S(1)":
        return bias_placement in (None, "P") and dim(x_placement) == x_ndim - 1
    return False


def as_linear(target, placements: tuple[str, ...]) -> tuple[str, str, str | None] | None:
    """The (x, weight, bias) placements of a linear-like node's candidate in F.linear's
    convention (weight (N, K); bias None when absent): `aten.linear` (x, weight[, bias]) as
    it is; `aten.addmm` (bias, x, weight (K, N)) -- GPT-2's Conv1D -- with the weight's
    placement transposed. None for another op."""
    if target is LINEAR_TARGET:
        return placements[0], placements[1], placements[2] if len(placements) > 2 else None
    if target is ADDMM_TARGET:
        flip = {"S(0)": "S(1)", "S(1)": "S(0)", "S(-1)": "S(0)", "S(-2)": "S(1)"}
        return placements[1], flip.get(placements[2], placements[2]), placements[0]
    return None


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """What a `float8` plan's linear node calls (passes/float8.py): x (..., K), weight (N, K),
    bias (N,) or None -> (..., N). Local tensors run `float8_linear_local`; DTensors on a 1-D
    tp mesh run it on their local shards, with the tp group where the contraction is split
    ([Note: float8 recipe]). Raises ValueError for placements `supported` does not run (the
    planner never picks them: a plan that does is not this runtime's)."""
    if not isinstance(x, DTensor) and not isinstance(weight, DTensor):
        return float8_linear_local(x, weight, bias)
    if not (isinstance(x, DTensor) and isinstance(weight, DTensor)
            and x.device_mesh.ndim == 1 and x.device_mesh == weight.device_mesh):
        raise ValueError("float8 linear: x and weight must both be DTensors on one 1-D tp mesh "
                         f"(got {type(x).__name__}, {type(weight).__name__})")
    mesh, xp, wp = x.device_mesh, x.placements[0], weight.placements[0]
    bp = bias.placements[0] if isinstance(bias, DTensor) else Replicate()
    # the plan's R -> P of a row-parallel bias is left to the op (passes/sharding.py): the bias
    # arrives Replicate and is partitioned here as DTensor partitions it, bias / tp per rank
    bias_p = "P" if wp == Shard(1) and bp == Replicate() else _short(bp)
    if not supported(_short(xp), _short(wp), x.ndim, None if bias is None else bias_p):
        raise ValueError(f"float8 linear: placements x {xp}, weight {wp}, bias {bp} are not "
                         "ones the FP8 linear runs on local shards ([Note: float8 recipe])")
    group = mesh.get_group()
    token_split = xp.is_shard() and not _last(xp, x.ndim)
    if wp == Shard(0):    # column parallel: dx sums over the split N
        out, x_grad, w_grad, k_group, n_group = Shard(x.ndim - 1), Partial(), wp, None, group
    elif wp == Shard(1):  # row parallel: y sums over the split K
        out, x_grad, w_grad, k_group, n_group = Partial(), xp, wp, group, None
    else:
        out, x_grad, k_group, n_group = xp, xp, None, None
        w_grad = Partial() if token_split else Replicate()
    bias_local = None
    if bias is not None and wp == Shard(1):  # each rank's partial sum takes bias / tp
        bias_local = bias.to_local(grad_placements=[Partial()]) / mesh.size() \
            if bp == Replicate() else bias.to_local(grad_placements=[Replicate()])
    elif bias is not None:
        bias_grad = Partial() if token_split else bp
        bias_local = (bias.to_local(grad_placements=[bias_grad]) if isinstance(bias, DTensor)
                      else bias)
    y = float8_linear_local(x.to_local(grad_placements=[x_grad]),
                            weight.to_local(grad_placements=[w_grad]), bias_local,
                            k_group=k_group, n_group=n_group,
                            w_group=group if wp.is_shard() else None)
    shape = (*x.shape[:-1], weight.shape[0])
    return DTensor.from_local(y, mesh, [out], run_check=False, shape=torch.Size(shape),
                              stride=torch._prims_common.make_contiguous_strides_for(shape))


def float8_addmm(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`aten.addmm(bias, x, weight)` of a Conv1D (GPT-2: x (M, K), weight (K, N), bias (N,))
    as the FP8 linear: `float8_linear(x, weight.t(), bias)` -> (M, N); a DTensor weight's
    transpose is a view with its placement transposed."""
    return float8_linear(x, weight.t(), bias)


def _short(p) -> str:
    """A placement as the plan writes it: "R", "S(d)", "P"."""
    if p.is_shard():
        return f"S({p.dim})"
    return "P" if p.is_partial() else "R"
