"""Vocab-parallel cross-entropy: per-shard statistics, their combination, and the gradient.

With tensor parallelism the LM head's output is sharded along the vocabulary: tp rank r holds the
logits for token ids [vocab_start, vocab_end) only. Gathering the full (N, V) logits would cost
N * V elements per rank; instead each rank reduces its shard to three numbers per row and only
those are all-reduced (Megatron-LM's vocab-parallel cross-entropy, Shoeybi et al. 2019, sec. 3,
``megatron/core/tensor_parallel/cross_entropy.py``):

    m_r = max_j x[i, j]                          (local max)
    s_r = sum_j exp(x[i, j] - m_r)               (local sum of exponentials)
    t_r = x[i, target_i - vocab_start] if target_i in [vocab_start, vocab_end) else 0

    m = max_r m_r          s = sum_r s_r * exp(m_r - m)          t = sum_r t_r
    loss_i = log(s) + m - t                      (= logsumexp(x[i, :]) - x[i, target_i])

and the gradient never leaves the rank, (softmax - onehot) on the local slice:

    d loss_i / d x[i, j] = exp(x[i, j] - m) / s - [j == target_i]

Megatron all-reduces the max first and then the shifted sum; the online rescaling above reads
the logits once instead of twice and is the same math.

Each piece has a Triton kernel (one program per row, looping over the vocabulary in blocks) and a
torch reference. All statistics are computed in float32 (float64 for float64 logits).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels._dispatch import launches, pick_triton

__all__ = [
    "cross_entropy_stats",
    "cross_entropy_stats_reference",
    "cross_entropy_loss_from_stats",
    "cross_entropy_grad",
    "cross_entropy_grad_reference",
    "vocab_parallel_cross_entropy",
]

_BLOCK_V = 1024  # vocabulary elements per loop iteration of a program


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _stats_kernel(
    logits_ptr, targets_ptr, max_ptr, sumexp_ptr, target_logit_ptr,
    stride_row, vocab_local, vocab_start,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    acc_ty = max_ptr.dtype.element_ty
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    # Online softmax normalizer (Milakov & Gimelshein 2018): rescale the running sum when the
    # running max grows, so the logits are read once.
    row_max = tl.full((), float("-inf"), acc_ty)
    row_sum = tl.zeros((), acc_ty)
    for start in range(0, vocab_local, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < vocab_local, other=float("-inf")).to(acc_ty)
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        row_max = new_max
    local_target = tl.load(targets_ptr + row) - vocab_start
    in_slice = (local_target >= 0) & (local_target < vocab_local)
    target_logit = tl.load(row_ptr + local_target, mask=in_slice, other=0.0).to(acc_ty)
    tl.store(max_ptr + row, row_max)
    tl.store(sumexp_ptr + row, row_sum)
    tl.store(target_logit_ptr + row, target_logit)


@triton.jit
def _grad_kernel(
    logits_ptr, targets_ptr, max_ptr, sumexp_ptr, grad_loss_ptr, grad_logits_ptr,
    stride_row, stride_grad_row, vocab_local, vocab_start,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    acc_ty = max_ptr.dtype.element_ty
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    grad_row_ptr = grad_logits_ptr + row.to(tl.int64) * stride_grad_row
    row_max = tl.load(max_ptr + row)
    row_sum = tl.load(sumexp_ptr + row)
    grad_loss = tl.load(grad_loss_ptr + row).to(acc_ty)
    local_target = tl.load(targets_ptr + row) - vocab_start
    for start in range(0, vocab_local, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab_local
        x = tl.load(row_ptr + offs, mask=mask, other=0.0).to(acc_ty)
        grad = tl.exp(x - row_max) / row_sum
        grad = tl.where(offs == local_target, grad - 1.0, grad) * grad_loss
        tl.store(grad_row_ptr + offs, grad.to(grad_logits_ptr.dtype.element_ty), mask=mask)


def _pick_triton(use_triton: bool | None, tensors: list[torch.Tensor], fn: str) -> bool:
    return pick_triton(use_triton, tensors, fn, _stats_kernel)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_logits(local_logits: torch.Tensor, targets: torch.Tensor, fn: str) -> None:
    if local_logits.dim() != 2 or local_logits.shape[1] == 0:
        raise ValueError(f"{fn}: local_logits must be (N, V_local) with V_local > 0, "
                         f"got shape {tuple(local_logits.shape)}")
    if not local_logits.is_floating_point():
        raise ValueError(f"{fn}: local_logits must be floating point, got {local_logits.dtype}")
    if targets.shape != local_logits.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(f"{fn}: targets must be int64 of shape ({local_logits.shape[0]},), "
                         f"got {targets.dtype} of shape {tuple(targets.shape)}")


# ---------------------------------------------------------------------------------------------
# The pieces: statistics, loss from combined statistics, gradient
# ---------------------------------------------------------------------------------------------


def cross_entropy_stats_reference(local_logits: torch.Tensor, targets: torch.Tensor,
                                  vocab_start: int) -> tuple[torch.Tensor, ...]:
    """Torch reference of :func:`cross_entropy_stats` (same arguments, same results)."""
    _check_logits(local_logits, targets, "cross_entropy_stats_reference")
    x = local_logits.to(_acc_dtype(local_logits.dtype))  # (N, V_local)
    row_max = x.amax(dim=1)  # (N,)
    sumexp = torch.exp(x - row_max[:, None]).sum(dim=1)  # (N,)
    local_target = targets - vocab_start
    in_slice = (local_target >= 0) & (local_target < x.shape[1])
    picked = x.gather(1, torch.where(in_slice, local_target, 0)[:, None]).squeeze(1)
    return row_max, sumexp, torch.where(in_slice, picked, torch.zeros_like(picked))


def cross_entropy_stats(local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                        use_triton: bool | None = None) -> tuple[torch.Tensor, ...]:
    """Per-row statistics of one vocabulary shard, to be combined across tp ranks.

    Args:
        local_logits: (N, V_local), float16/bfloat16/float32/float64; the logits of token ids
            [vocab_start, vocab_start + V_local).
        targets: (N,) int64, global token ids (any value outside the slice, e.g. -100, is allowed).
        vocab_start: first global token id of this shard.
        use_triton: None picks the Triton kernel for CUDA tensors and the reference otherwise;
            True forces Triton (on CPU only under TRITON_INTERPRET=1); False forces the reference.

    Returns:
        (row_max, sumexp, target_logit), each (N,) float32 (float64 for float64 logits):
        max_j x[i, j], sum_j exp(x[i, j] - row_max[i]), and x[i, targets[i] - vocab_start] when
        the target lies in this shard, else 0 (Shoeybi et al. 2019, sec. 3).

    Raises:
        ValueError: if local_logits is not a non-empty-vocabulary 2-D float tensor, if targets is
            not int64 of shape (N,), if the tensors are on different devices, or if use_triton=True
            cannot run.
    """
    _check_logits(local_logits, targets, "cross_entropy_stats")
    if not _pick_triton(use_triton, [local_logits, targets], "cross_entropy_stats"):
        return cross_entropy_stats_reference(local_logits, targets, vocab_start)
    num_rows, vocab_local = local_logits.shape
    logits = local_logits if local_logits.stride(1) == 1 else local_logits.contiguous()
    acc = _acc_dtype(logits.dtype)
    row_max, sumexp, target_logit = (torch.empty(num_rows, dtype=acc, device=logits.device)
                                     for _ in range(3))
    if num_rows and launches():
        block_v = min(_BLOCK_V, triton.next_power_of_2(vocab_local))
        _stats_kernel[(num_rows,)](logits, targets.contiguous(), row_max, sumexp, target_logit,
                                   logits.stride(0), vocab_local, vocab_start, BLOCK_V=block_v)
    return row_max, sumexp, target_logit


def cross_entropy_loss_from_stats(row_max: torch.Tensor, sumexp: torch.Tensor,
                                  target_logit: torch.Tensor) -> torch.Tensor:
    """loss_i = log(sumexp_i) + row_max_i - target_logit_i, from statistics already combined over
    all vocabulary shards. All arguments and the result are (N,) float tensors."""
    return torch.log(sumexp) + row_max - target_logit


def cross_entropy_grad_reference(local_logits: torch.Tensor, targets: torch.Tensor,
                                 vocab_start: int, row_max: torch.Tensor, sumexp: torch.Tensor,
                                 grad_loss: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`cross_entropy_grad` (same arguments, same result)."""
    _check_logits(local_logits, targets, "cross_entropy_grad_reference")
    x = local_logits.to(row_max.dtype)  # (N, V_local)
    grad = torch.exp(x - row_max[:, None]) / sumexp[:, None]  # softmax, local slice
    local_target = targets - vocab_start
    cols = torch.arange(x.shape[1], device=x.device)
    grad = torch.where(cols[None, :] == local_target[:, None], grad - 1.0, grad)
    return (grad * grad_loss.to(grad.dtype)[:, None]).to(local_logits.dtype)


def cross_entropy_grad(local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                       row_max: torch.Tensor, sumexp: torch.Tensor, grad_loss: torch.Tensor,
                       use_triton: bool | None = None) -> torch.Tensor:
    """Gradient of the per-row loss with respect to this shard's logits.

    grad[i, j] = grad_loss[i] * (exp(x[i, j] - row_max[i]) / sumexp[i]
                                 - [j == targets[i] - vocab_start])

    i.e. (softmax - onehot) restricted to the local slice (Shoeybi et al. 2019, sec. 3).

    Args:
        local_logits, targets, vocab_start, use_triton: as in :func:`cross_entropy_stats`.
        row_max, sumexp: (N,) statistics combined over all shards (global max, global sum).
        grad_loss: (N,) upstream gradient of each row's loss.

    Returns:
        (N, V_local) tensor of local_logits' dtype.

    Raises:
        ValueError: as :func:`cross_entropy_stats`, or if row_max/sumexp/grad_loss are not (N,).
    """
    _check_logits(local_logits, targets, "cross_entropy_grad")
    for name, t in (("row_max", row_max), ("sumexp", sumexp), ("grad_loss", grad_loss)):
        if t.shape != targets.shape:
            raise ValueError(f"cross_entropy_grad: {name} must have shape ({targets.shape[0]},), "
                             f"got {tuple(t.shape)}")
    tensors = [local_logits, targets, row_max, sumexp, grad_loss]
    if not _pick_triton(use_triton, tensors, "cross_entropy_grad"):
        return cross_entropy_grad_reference(local_logits, targets, vocab_start, row_max, sumexp,
                                            grad_loss)
    num_rows, vocab_local = local_logits.shape
    logits = local_logits if local_logits.stride(1) == 1 else local_logits.contiguous()
    grad_logits = torch.empty_like(logits)
    if num_rows and launches():
        acc = _acc_dtype(logits.dtype)
        _grad_kernel[(num_rows,)](
            logits, targets.contiguous(), row_max.to(acc).contiguous(), sumexp.to(acc).contiguous(),
            grad_loss.contiguous(), grad_logits, logits.stride(0), grad_logits.stride(0),
            vocab_local, vocab_start, BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(vocab_local)))
    return grad_logits


# ---------------------------------------------------------------------------------------------
# The autograd-aware loss
# ---------------------------------------------------------------------------------------------


def _all_reduce_stats(row_max, sumexp, target_logit, group):
    """Combine the shards' statistics over `group` (Megatron-LM: max, then one sum)."""
    global_max = row_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    # Rescale this shard's sum to the global max before summing; pack both sums in one all-reduce.
    packed = torch.stack([sumexp * torch.exp(row_max - global_max), target_logit])  # (2, N)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return global_max, packed[0], packed[1]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits, targets, vocab_start, ignore_index, group, use_triton):
        row_max, sumexp, target_logit = cross_entropy_stats(local_logits, targets, vocab_start,
                                                            use_triton)
        if group is not None:
            row_max, sumexp, target_logit = _all_reduce_stats(row_max, sumexp, target_logit, group)
        valid = targets != ignore_index
        loss = torch.where(valid, cross_entropy_loss_from_stats(row_max, sumexp, target_logit), 0.0)
        ctx.save_for_backward(local_logits, targets, row_max, sumexp, valid)
        ctx.vocab_start, ctx.use_triton = vocab_start, use_triton
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        local_logits, targets, row_max, sumexp, valid = ctx.saved_tensors
        grad_loss = torch.where(valid, grad_loss, 0.0)  # ignored rows get no gradient
        grad = cross_entropy_grad(local_logits, targets, ctx.vocab_start, row_max, sumexp,
                                  grad_loss, ctx.use_triton)
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor,
                                 vocab_start: int = 0, group: dist.ProcessGroup | None = None,
                                 *, ignore_index: int = -100, reduction: str = "mean",
                                 use_triton: bool | None = None) -> torch.Tensor:
    """Cross-entropy over logits sharded along the vocabulary (Shoeybi et al. 2019, sec. 3).

    Every rank of `group` calls this with its shard; the per-row max and sums are all-reduced over
    `group` with torch.distributed (not autograd-aware: the backward needs no communication, the
    gradient is (softmax - onehot) on the local slice). With group=None and vocab_start=0 the
    shard is the whole vocabulary and the result equals ``F.cross_entropy(local_logits, targets,
    ignore_index=ignore_index, reduction=reduction)``.

    Args:
        local_logits: (..., V_local) float logits of token ids [vocab_start, vocab_start + V_local).
        targets: (...) int64 global token ids; rows equal to ignore_index contribute no loss.
        vocab_start: first global token id of this rank's shard; must be 0 when group is None.
        group: the tp process group the vocabulary is sharded over, or None for no sharding.
        ignore_index: target value that marks a row to skip, as in F.cross_entropy.
        reduction: "mean" (over non-ignored rows), "sum" or "none" (shape (...)).
        use_triton: see :func:`cross_entropy_stats`.

    Returns:
        The loss, float32 (float64 for float64 logits); identical on every rank of `group`.

    Raises:
        ValueError: if shapes or dtypes do not match (see :func:`cross_entropy_stats`), if
            reduction is unknown, if group is None and vocab_start != 0, or if group is None and a
            target is outside [0, V_local) and not ignore_index. With a group, out-of-range targets
            are not checked (that would need one more collective) and count as a target logit of 0.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError("vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or "
                         f"'none', got {reduction!r}")
    if local_logits.dim() < 1 or targets.shape != local_logits.shape[:-1]:
        raise ValueError(f"vocab_parallel_cross_entropy: targets shape {tuple(targets.shape)} "
                         f"must be local_logits shape {tuple(local_logits.shape)} without its "
                         "last dim")
    batch_shape = targets.shape
    logits_2d = local_logits.reshape(-1, local_logits.shape[-1])  # (N, V_local)
    targets_1d = targets.reshape(-1)  # (N,)
    if group is None:
        if vocab_start != 0:
            raise ValueError(f"vocab_parallel_cross_entropy: vocab_start={vocab_start} needs a "
                             "group; without one the shard is the whole vocabulary, from 0")
        bad = (targets_1d != ignore_index) & ((targets_1d < 0) | (targets_1d >= logits_2d.shape[1]))
        if bool(bad.any()):
            raise ValueError(f"vocab_parallel_cross_entropy: target {int(targets_1d[bad][0])} is "
                             f"outside [0, {logits_2d.shape[1]}) and is not "
                             f"ignore_index={ignore_index}")
    loss = _VocabParallelCrossEntropy.apply(logits_2d, targets_1d, vocab_start, ignore_index,
                                            group, use_triton)  # (N,)
    if reduction == "none":
        return loss.reshape(batch_shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (targets_1d != ignore_index).sum()
