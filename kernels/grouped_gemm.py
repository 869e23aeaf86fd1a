"""A grouped GEMM in Triton, and the routed-experts op ([Note: experts op] in autoplan/experts.py)
built on it: one launch multiplies every expert's rows by that expert's weights.

Grouped GEMM. The rows of A are sorted by group; group g holds rows [offsets[g], offsets[g+1]):

    grouped_mm:           C[r] = A[r] @ B[g]           for r in group g   (A (M, K), B (G, K, N))
    grouped_weight_grad:  W[g] = DY[rows g]^T @ X[rows g]                   (W (G, N_dy, N_x))

`grouped_mm` runs one program per (m-tile, n-tile), m-tiles cut group by group: group g has
ceil(M_g / BLOCK_M) tiles, the tiles of all groups are numbered in order, and a program finds its
group by counting the groups' first tiles at or below its own (one vector compare over G + 1
offsets). The grid is sized for the worst case, ceil(M / BLOCK_M) + G m-tiles, so nothing is read
on the host: the surplus programs return at once. `grouped_weight_grad` (the weight gradient,
whose reduction runs over a group's rows) runs one program per (group, m-tile, n-tile), each
looping over its group's rows. Both accumulate in float32 and cast on the store. The two are
the dropless MoE's matmuls of MegaBlocks (Gale et al. 2023, "MegaBlocks: Efficient Sparse
Training with Mixture-of-Experts", MLSys: every routed token computed, none padded to a
capacity) in the grouped form of its grouped_gemm package (github.com/tgale96/grouped_gemm,
`gmm(a, b, batch_sizes, trans_a, trans_b)`, whose trans_a is the weight gradient), tiled as
Triton's grouped GEMM tutorial (python/tutorials/08-grouped-gemm.py) tiles its groups, with
the per-group tile offsets computed on the device in place of the tutorial's persistent loop
over the groups' sizes.

Routed experts (`grouped_experts`, `grouped_experts_backward`): the T k (token, choice) pairs
are sorted by their held expert (a stable sort; pairs whose expert is outside [expert_offset,
expert_offset + E) go into a last bin that no GEMM reads), the per-expert counts summed by
`index_add_` (`bincount` reads its maximum on the host to size its output) and cumulated into the
offsets; then

    gu = grouped_mm(hidden[token of pair], gate_up_proj^T)   (T k, 2I), the rows gathered in-kernel
    h  = act(gu[:, :I]) * gu[:, I:]                           (T k, I)
    y  = grouped_mm(h, down_proj^T)                           (T k, H)
    out[t] += w[t, j] * y[pair (t, j)]                        (T, H), index_add_ in float32

Backward: the forward again (it saves only its inputs, as the op does), then, with dy = w * grad
of the pair's token: d w = sum_H(grad * y), d down_proj[g] = dy_g^T h_g, dh = dy @ down_proj[g],
d gate / d up by the chain rule through act (aten's activation backward, as the reference),
d gate_up_proj[g] = [d gate, d up]_g^T x_g, d hidden = index_add_ of [d gate, d up] @
gate_up_proj[g]. No tensor's shape depends on the routing (the intermediates have T k rows,
the last bin's rows unused), so nothing is read on the host and fake tensors pass through.

The eager math (`experts_reference`, `experts_backward_reference` in autoplan/experts.py) is
what CPU runs; `use_triton` picks as kernels/_dispatch.py `pick_triton` does.

Not done: no autotuning (the block sizes are fixed: no GPU on the machine this was written on;
the kernels are compiled for sm_90 in tests/test_kernels.py, never timed); no persistent
kernel, no split-K for a group of many rows in `grouped_weight_grad` (one program reduces a
whole group: an imbalanced routing runs it long); the activation and the routing weight are
separate torch ops, not fused into the GEMMs' epilogues; the gather of the gradient rows and the
scatter back to tokens are torch ops; float64 runs the reference. When the experts are split
over ranks (expert_offset), the intermediates still have T k rows, the other ranks' rows unused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from autoplan.experts import (
    ACTIVATION_BACKWARD,
    ACTIVATIONS,
    check_experts_args,
    experts_backward_reference,
    experts_reference,
)
from kernels._dispatch import launches, pick_triton

__all__ = ["grouped_mm", "grouped_mm_reference", "grouped_weight_grad",
           "grouped_weight_grad_reference", "grouped_experts", "grouped_experts_backward",
           "TRITON_DTYPES"]

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The operand dtypes the Triton path computes in (tl.dot, float32 accumulation)."""

# Tile sizes, fixed (no autotuning, see the module docstring); tl.dot needs each >= 16.
_BLOCK_M = 64
_BLOCK_N = 64
_BLOCK_K = 32


@triton.jit
def _dot(a, b, acc, INPUT_PRECISION: tl.constexpr, BF16_AS_FP32: tl.constexpr):
    """acc + a @ b. BF16_AS_FP32 (the interpreter only): bfloat16 operands widened first, since
    the interpreter's tl.dot multiplies bfloat16's bits as integers (it holds them as uint16);
    the products of two bfloat16 values are exact in float32, so the sum is the one the GPU's
    bfloat16 tl.dot accumulates in float32."""
    if BF16_AS_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _grouped_mm_kernel(a_ptr, a_rows_ptr, b_ptr, c_ptr, offsets_ptr, tile_offsets_ptr,
                       num_groups, N, K, stride_am, stride_ak, stride_bg, stride_bk, stride_bn,
                       stride_cm, stride_cn, GATHER_A: tl.constexpr, BLOCK_G: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       INPUT_PRECISION: tl.constexpr, BF16_AS_FP32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m >= tl.load(tile_offsets_ptr + num_groups):
        return  # a surplus program of the worst-case grid
    # the group of this m-tile: the last whose first tile is at or below it (an empty group's
    # first tile equals the next group's, so it is never the last)
    gs = tl.arange(0, BLOCK_G)
    firsts = tl.load(tile_offsets_ptr + gs, mask=gs <= num_groups, other=2147483647)
    g = tl.sum((firsts <= pid_m).to(tl.int32), axis=0) - 1
    row_end = tl.load(offsets_ptr + g + 1)
    rows = (tl.load(offsets_ptr + g) + (pid_m - tl.load(tile_offsets_ptr + g)) * BLOCK_M
            + tl.arange(0, BLOCK_M))
    row_mask = rows < row_end
    if GATHER_A:
        a_rows = tl.load(a_rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    b_group = b_ptr + g.to(tl.int64) * stride_bg
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)       # (BM, BK)
        b = tl.load(b_group + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)       # (BK, BN)
        # the weights in the rows' dtype, as the reference casts them (fp32 masters, bf16 rows)
        acc = _dot(a, b.to(a.dtype), acc, INPUT_PRECISION, BF16_AS_FP32)
    c = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_weight_grad_kernel(dy_ptr, x_ptr, x_rows_ptr, w_ptr, offsets_ptr, N_DY, N_X,
                                stride_dym, stride_dyn, stride_xm, stride_xn, stride_wg,
                                stride_wm, stride_wn, GATHER_X: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                                BF16_AS_FP32: tl.constexpr):
    g = tl.program_id(0)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)   # columns of dy
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)   # columns of x
    m_mask, n_mask = ms < N_DY, ns < N_X
    row_end = tl.load(offsets_ptr + g + 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(tl.load(offsets_ptr + g), row_end, BLOCK_K):
        rs = r0 + tl.arange(0, BLOCK_K)
        r_mask = rs < row_end
        dy_t = tl.load(dy_ptr + rs.to(tl.int64)[None, :] * stride_dym + ms[:, None] * stride_dyn,
                       mask=m_mask[:, None] & r_mask[None, :], other=0.0)      # (BM, BK)
        if GATHER_X:
            x_rows = tl.load(x_rows_ptr + rs, mask=r_mask, other=0).to(tl.int64)
        else:
            x_rows = rs.to(tl.int64)
        x = tl.load(x_ptr + x_rows[:, None] * stride_xm + ns[None, :] * stride_xn,
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)         # (BK, BN)
        acc = _dot(dy_t, x.to(dy_t.dtype), acc, INPUT_PRECISION, BF16_AS_FP32)
    w = w_ptr + g.to(tl.int64) * stride_wg + ms[:, None] * stride_wm + ns[None, :] * stride_wn
    tl.store(w, acc.to(w_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _input_precision(dtype: torch.dtype) -> str:
    """tl.dot's precision for float32 operands as torch's own matmuls take it
    (`torch.get_float32_matmul_precision`: "highest", the default, is IEEE float32, no TF32)."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def _bf16_as_fp32(dtype: torch.dtype) -> bool:
    """Widen bfloat16 operands before tl.dot: under the interpreter only (`_dot`)."""
    return dtype == torch.bfloat16 and isinstance(tl.sum, InterpretedFunction)


def _check_dtypes(fn: str, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        if t.dtype not in TRITON_DTYPES:
            dtypes = ", ".join(map(str, TRITON_DTYPES))
            raise ValueError(f"{fn}: the Triton path computes in {dtypes}; {name} is {t.dtype} "
                             "(pass use_triton=None or False: the reference)")


def _grouped_mm_triton(a, b, offsets, a_rows=None):
    num_groups, k, n = b.shape
    m = a.shape[0] if a_rows is None else a_rows.shape[0]
    out = a.new_zeros((m, n))  # rows past offsets[-1] (pairs of no held expert) stay zero
    if not launches() or m == 0 or n == 0 or num_groups == 0:
        return out
    offsets = offsets.to(device=a.device, dtype=torch.int32).contiguous()
    tiles = (offsets.diff() + _BLOCK_M - 1) // _BLOCK_M                         # (G,)
    tile_offsets = torch.cat([offsets.new_zeros(1), tiles.cumsum(0, dtype=torch.int32)])
    grid = (triton.cdiv(m, _BLOCK_M) + num_groups, triton.cdiv(n, _BLOCK_N))
    rows = a_rows.contiguous() if a_rows is not None else offsets  # a placeholder when unused
    _grouped_mm_kernel[grid](
        a, rows, b, out, offsets, tile_offsets, num_groups, n, k, a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        GATHER_A=a_rows is not None, BLOCK_G=triton.next_power_of_2(num_groups + 1),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        INPUT_PRECISION=_input_precision(a.dtype), BF16_AS_FP32=_bf16_as_fp32(a.dtype))
    return out


def _grouped_weight_grad_triton(dy, x, offsets, x_rows=None, dtype=None):
    num_groups = offsets.shape[0] - 1
    out = dy.new_empty((num_groups, dy.shape[1], x.shape[1]), dtype=dtype or dy.dtype)
    if not launches() or out.numel() == 0:
        return out
    offsets = offsets.to(device=dy.device, dtype=torch.int32).contiguous()
    grid = (num_groups, triton.cdiv(dy.shape[1], _BLOCK_M), triton.cdiv(x.shape[1], _BLOCK_N))
    rows = x_rows.contiguous() if x_rows is not None else offsets  # a placeholder when unused
    _grouped_weight_grad_kernel[grid](
        dy, x, rows, out, offsets, dy.shape[1], x.shape[1], dy.stride(0), dy.stride(1),
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), out.stride(2),
        GATHER_X=x_rows is not None, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
        INPUT_PRECISION=_input_precision(dy.dtype), BF16_AS_FP32=_bf16_as_fp32(dy.dtype))
    return out


def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                         a_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`grouped_mm`: one matmul per group, in a's dtype."""
    rows = a if a_rows is None else a[a_rows]
    out = rows.new_zeros((rows.shape[0], b.shape[2]))
    bounds = offsets.tolist()
    for g in range(b.shape[0]):
        if bounds[g + 1] > bounds[g]:
            out[bounds[g]:bounds[g + 1]] = rows[bounds[g]:bounds[g + 1]] @ b[g].to(rows.dtype)
    return out


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
               a_rows: torch.Tensor | None = None, use_triton: bool | None = None) -> torch.Tensor:
    """Grouped GEMM: C[r] = A[r] @ B[g] for every row r of group g (module docstring).

    Args:
        a: (M, K), or (T, K) read through `a_rows`; float16, bfloat16 or float32 on the
            Triton path. Any strides.
        b: (G, K, N), any strides (`w.transpose(1, 2)` of F.linear's (G, N, K) weights is a
            view); cast to a's dtype before the multiply, as the experts' reference does.
        offsets: (G + 1,) integer, nondecreasing from 0 to at most M: group g is rows
            [offsets[g], offsets[g + 1]) of the output. Not checked on the Triton path (that
            would read it on the host).
        a_rows: optional (M,) int64: output row r reads row a_rows[r] of a (a gather in the
            kernel's loads, no (M, K) copy).
        use_triton: None: Triton for CUDA tensors, the reference otherwise; True: Triton (CPU
            tensors only under TRITON_INTERPRET=1); False: the reference.

    Returns:
        (M, N) in a's dtype, accumulated in float32 on the Triton path; rows at and past
        offsets[-1] are zero.

    Raises:
        ValueError: wrong ranks or mismatched K, G; tensors on several devices; the Triton path
            asked for (use_triton=True) with a dtype outside TRITON_DTYPES or without a way to
            run it.
    """
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1] or \
            offsets.shape != (b.shape[0] + 1,):
        raise ValueError(f"grouped_mm: expected a (M, K), b (G, K, N), offsets (G + 1,); got "
                         f"{tuple(a.shape)}, {tuple(b.shape)}, {tuple(offsets.shape)}")
    tensors = [a, b, offsets] + ([a_rows] if a_rows is not None else [])
    if not _pick(use_triton, "grouped_mm", {"a": a, "b": b}, tensors):
        return grouped_mm_reference(a, b, offsets, a_rows)
    return _grouped_mm_triton(a, b, offsets, a_rows)


def grouped_weight_grad_reference(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
                                  x_rows: torch.Tensor | None = None,
                                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch reference of :func:`grouped_weight_grad`: one matmul per group, in dy's dtype."""
    xs = x if x_rows is None else x[x_rows]
    out = dy.new_zeros((offsets.shape[0] - 1, dy.shape[1], x.shape[1]), dtype=dtype or dy.dtype)
    bounds = offsets.tolist()
    for g in range(out.shape[0]):
        lo, hi = bounds[g], bounds[g + 1]
        out[g] = dy[lo:hi].t() @ xs[lo:hi].to(dy.dtype)
    return out


def grouped_weight_grad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
                        x_rows: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                        use_triton: bool | None = None) -> torch.Tensor:
    """Per-group weight gradient: W[g] = DY[rows g]^T @ X[rows g] (module docstring).

    Args:
        dy: (M, N_dy), rows grouped by `offsets` as :func:`grouped_mm`'s output rows.
        x: (M, N_x), or (T, N_x) read through `x_rows` (optional (M,) int64); cast to dy's
            dtype before the multiply.
        offsets: (G + 1,) integer, as :func:`grouped_mm`'s.
        dtype: the result's dtype (the weights', e.g. float32 masters of bfloat16 rows);
            default dy's.
        use_triton: as :func:`grouped_mm`.

    Returns:
        (G, N_dy, N_x), accumulated in float32 on the Triton path; a group of no rows gets
        zeros.

    Raises:
        ValueError: as :func:`grouped_mm`.
    """
    if dy.dim() != 2 or x.dim() != 2 or offsets.dim() != 1 or \
            (x_rows is None and x.shape[0] != dy.shape[0]):
        raise ValueError(f"grouped_weight_grad: expected dy (M, N_dy), x (M, N_x), offsets "
                         f"(G + 1,); got {tuple(dy.shape)}, {tuple(x.shape)}, "
                         f"{tuple(offsets.shape)}")
    tensors = [dy, x, offsets] + ([x_rows] if x_rows is not None else [])
    if not _pick(use_triton, "grouped_weight_grad", {"dy": dy, "x": x}, tensors):
        return grouped_weight_grad_reference(dy, x, offsets, x_rows, dtype)
    return _grouped_weight_grad_triton(dy, x, offsets, x_rows, dtype)


def _pick(use_triton: bool | None, fn: str, operands: dict[str, torch.Tensor],
          tensors: list[torch.Tensor]) -> bool:
    """Whether `fn` takes the Triton path: pick_triton's rule, except that with use_triton None
    operands outside TRITON_DTYPES (float64) run the reference on every device. Raises
    ValueError as pick_triton does, and first for such operands with use_triton=True."""
    if use_triton is None and launches() and \
            any(t.dtype not in TRITON_DTYPES for t in operands.values()):
        use_triton = False
    if use_triton:
        _check_dtypes(fn, operands)
    return pick_triton(use_triton, tensors, fn, _grouped_mm_kernel)


def _pick_experts(use_triton, fn, hidden, top_k_index, top_k_weights, gate_up_proj,
                  down_proj) -> bool:
    return _pick(use_triton, fn, {"hidden": hidden, "gate_up_proj": gate_up_proj,
                                  "down_proj": down_proj},
                 [hidden, top_k_index, top_k_weights, gate_up_proj, down_proj])


def _route(top_k_index: torch.Tensor, expert_offset: int, num_experts: int):
    """The (token, choice) pairs sorted by held expert, without reading anything on the host:
    (order (T k,): pair index of each sorted row, token_of (T k,): its token, offsets (E + 1,)
    int32: the rows of each held expert; the pairs of no held expert come last)."""
    top_k = top_k_index.shape[1]
    local = top_k_index.reshape(-1) - expert_offset                             # (T k,)
    group = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    order = torch.sort(group, stable=True).indices                              # (T k,)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=group.device)
    counts.index_add_(0, group, torch.ones_like(group))                         # (E + 1,)
    offsets = torch.cat([counts.new_zeros(1), counts[:num_experts].cumsum(0)]).to(torch.int32)
    return order, order // top_k, offsets


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _forward_rows(hidden, gate_up_proj, down_proj, fn, token_of, offsets):
    """(gu (T k, 2I), act(gate) (T k, I), h (T k, I), y (T k, H)) of the sorted pairs."""
    inter = down_proj.shape[2]
    gu = _grouped_mm_triton(hidden, gate_up_proj.transpose(1, 2), offsets, token_of)
    f_gate = fn(gu[:, :inter])
    h = f_gate * gu[:, inter:]
    y = _grouped_mm_triton(h, down_proj.transpose(1, 2), offsets)
    return gu, f_gate, h, y


def grouped_experts(hidden: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                    down_proj: torch.Tensor, act: str, expert_offset: int,
                    use_triton: bool | None = None) -> torch.Tensor:
    """The experts op's forward ([Note: experts op]) on the grouped GEMM (module docstring).

    Args:
        hidden: (T, H). top_k_index: (T, k) int64, global expert ids. top_k_weights: (T, k).
        gate_up_proj: (E, 2I, H), the experts [expert_offset, expert_offset + E).
        down_proj: (E, H, I). act: a name of autoplan.experts.ACTIVATIONS.
        use_triton: None: Triton for CUDA tensors (float16, bfloat16, float32) and
            `experts_reference` otherwise; True: Triton (CPU tensors only under
            TRITON_INTERPRET=1); False: the reference. Not differentiable: the op's autograd
            formula calls :func:`grouped_experts_backward`.

    Returns:
        (T, H) in hidden's dtype. The Triton path multiplies in hidden's dtype (the weights cast
        to it in the kernel), accumulates the GEMMs and the sum over choices in float32.

    Raises:
        ValueError: the op's shape and activation checks (autoplan.experts
            `check_experts_args`), a dtype outside TRITON_DTYPES with use_triton=True, tensors
            on several devices.
    """
    check_experts_args(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act)
    if not _pick_experts(use_triton, "grouped_experts", hidden, top_k_index, top_k_weights,
                         gate_up_proj, down_proj):
        return experts_reference(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                 act, expert_offset)
    order, token_of, offsets = _route(top_k_index, expert_offset, gate_up_proj.shape[0])
    *_, y = _forward_rows(hidden, gate_up_proj, down_proj, ACTIVATIONS[act], token_of, offsets)
    weighted = y * top_k_weights.reshape(-1)[order, None]                # (T k, H)
    acc = _accumulation(hidden.dtype)
    out = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
    return out.index_add_(0, token_of, weighted.to(acc)).to(hidden.dtype)


def grouped_experts_backward(grad: torch.Tensor, hidden: torch.Tensor,
                             top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                             gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: str,
                             expert_offset: int, use_triton: bool | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (d hidden (T, H), d top_k_weights (T, k), d gate_up_proj (E, 2I, H),
    d down_proj (E, H, I)) of :func:`grouped_experts` given `grad` (T, H), each in its input's
    dtype; the module docstring gives the formulas. A pair of no held expert gets a zero
    routing-weight gradient, an expert of no pairs zero weight gradients.

    Args and Raises: as :func:`grouped_experts` (the reference: `experts_backward_reference`).
    """
    check_experts_args(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act)
    if grad.shape != hidden.shape:
        raise ValueError(f"grouped_experts_backward: grad {tuple(grad.shape)} is not hidden's "
                         f"shape {tuple(hidden.shape)}")
    if not _pick_experts(use_triton, "grouped_experts_backward", hidden, top_k_index,
                         top_k_weights, gate_up_proj, down_proj):
        return experts_backward_reference(grad, hidden, top_k_index, top_k_weights,
                                          gate_up_proj, down_proj, act, expert_offset)
    fn, fn_backward = ACTIVATIONS[act], ACTIVATION_BACKWARD[act]
    inter = down_proj.shape[2]
    order, token_of, offsets = _route(top_k_index, expert_offset, gate_up_proj.shape[0])
    gu, f_gate, h, y = _forward_rows(hidden, gate_up_proj, down_proj, fn, token_of, offsets)
    # as autograd runs the forward's y * weight: in the promoted dtype, dy back in y's
    g = grad[token_of].to(torch.promote_types(y.dtype, top_k_weights.dtype))    # (T k, H)
    d_weights = torch.zeros_like(top_k_weights).reshape(-1)
    d_weights[order] = (g * y).sum(-1).to(d_weights.dtype)                     # zero: no expert
    dy = (g * top_k_weights.reshape(-1)[order, None]).to(y.dtype)              # (T k, H)
    del g, y
    d_down = _grouped_weight_grad_triton(dy, h, offsets, dtype=down_proj.dtype)  # (E, H, I)
    dh = _grouped_mm_triton(dy, down_proj, offsets)                            # (T k, I)
    d_gu = torch.cat([fn_backward(dh * gu[:, inter:], gu[:, :inter]), dh * f_gate], -1)
    del dh, gu, f_gate, h
    d_gate_up = _grouped_weight_grad_triton(d_gu, hidden, offsets, token_of,
                                            dtype=gate_up_proj.dtype)         # (E, 2I, H)
    dx = _grouped_mm_triton(d_gu, gate_up_proj, offsets)                       # (T k, H)
    acc = _accumulation(hidden.dtype)
    d_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
    d_hidden = d_hidden.index_add_(0, token_of, dx.to(acc)).to(hidden.dtype)
    return d_hidden, d_weights.view(top_k_weights.shape), d_gate_up, d_down
