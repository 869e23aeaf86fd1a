"""kernels/: each Triton kernel (run by the Triton interpreter on CPU) against its torch reference
and against plain PyTorch, forward and backward, on tiny inputs with non-power-of-two sizes.

The references are checked with torch.autograd.gradcheck in float64, the Triton paths against
them (float64 tight, float32 to rounding, bfloat16 to a few ulps). Every kernel is also compiled
for an H100 (sm_90) down to a cubin, which needs no GPU, so a kernel that only the interpreter
accepts fails here and not on the first GPU run.

[Note: TRITON_INTERPRET and import order] triton.jit chooses between the interpreter and the
compiler when it decorates, and triton.language decorates its own helpers (tl.sum, tl.max,
tl.sigmoid, ...) when triton is first imported. So the variable must be set before anything imports
triton, and torch.export / torch._dynamo do. When an earlier test module got there first, the
Triton paths here are skipped and test_triton_paths_in_a_fresh_process reruns them in a new
process; the sm_90 compile check always runs in its own process, with the interpreter off.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

# setdefault: the compile check imports this module in a subprocess with TRITON_INTERPRET=0.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import kernels  # noqa: E402

# The package re-exports functions named like their modules (kernels.rms_norm is the function),
# so reach the modules through the import system.
adamw_mod, ce_mod, rms_mod, swiglu_mod, gemm_mod = (
    importlib.import_module(f"kernels.{name}")
    for name in ("adamw", "cross_entropy", "rms_norm", "swiglu", "grouped_gemm"))
REPO_ROOT = Path(__file__).resolve().parents[1]


@triton.jit
def _probe_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, mask=offs < n)


# Both ours and triton.language's own (tl.sum) must be interpreted; see the Note.
INTERPRETED = all(isinstance(f, InterpretedFunction) for f in (ce_mod._stats_kernel, tl.sum))


def _interpreter_problem() -> str | None:
    """Why the Triton paths cannot run in this process, or None when they can."""
    if not INTERPRETED:
        return ("triton was imported before TRITON_INTERPRET=1 was set (see [Note: "
                "TRITON_INTERPRET and import order]); test_triton_paths_in_a_fresh_process runs "
                "these instead")
    try:
        x, y = torch.arange(3.0), torch.empty(3)
        _probe_kernel[(1,)](x, y, 3, BLOCK=4)
    except Exception as e:  # noqa: BLE001 - the reason goes into the skip message
        return f"the Triton interpreter cannot run on this machine: {type(e).__name__}: {e}"
    assert torch.equal(y, 2 * x), "the Triton interpreter ran but computed a wrong result"
    return None


INTERPRETER_PROBLEM = _interpreter_problem()
needs_interpreter = pytest.mark.skipif(INTERPRETER_PROBLEM is not None,
                                       reason=str(INTERPRETER_PROBLEM))
BOTH = pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_interpreter)],
                               ids=["reference", "triton"])


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bf16_close(actual, expected):
    """Equal to 4 bfloat16 ulps (2**-5 relative). Eager PyTorch rounds every intermediate to
    bfloat16 where the kernels keep float32, and the Triton interpreter converts float32 to
    bfloat16 by truncation (compiled Triton rounds to nearest even, as ATen does)."""
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-5, atol=2**-5)


# ---------------------------------------------------------------------------------------------
# Cross-entropy
# ---------------------------------------------------------------------------------------------


@BOTH
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_equals_torch(use_triton, reduction):
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 37, dtype=torch.float64, requires_grad=True)  # (B, T, V)
    targets = torch.randint(0, 37, (2, 3))
    targets[0, 1] = -100  # ignored row
    loss = kernels.vocab_parallel_cross_entropy(logits, targets, reduction=reduction,
                                                use_triton=use_triton)
    expected = F.cross_entropy(logits.transpose(1, 2), targets, reduction=reduction)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    upstream = torch.randn_like(loss)
    grad, = torch.autograd.grad(loss, logits, upstream)
    expected_grad, = torch.autograd.grad(expected, logits, upstream)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    assert grad[0, 1].abs().max() == 0  # the ignored row gets no gradient


@BOTH
def test_cross_entropy_gradcheck(use_triton):
    torch.manual_seed(1)
    logits = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([3, 0])
    torch.autograd.gradcheck(lambda x: kernels.vocab_parallel_cross_entropy(
        x, targets, reduction="none", use_triton=use_triton), (logits,))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
def test_cross_entropy_triton_pieces_equal_reference(dtype):
    # V_local = 1300 > the kernel's 1024-element block: two loop iterations, the second partial;
    # a column slice of a wider tensor, so the row stride (1500) is not V_local.
    torch.manual_seed(2)
    logits = (3 * torch.randn(3, 1500)).to(dtype)[:, 100:1400]
    targets = torch.tensor([5, 1299 + 700, -100])  # in slice, in slice, outside it
    got = kernels.cross_entropy_stats(logits, targets, 700, use_triton=True)
    want = kernels.cross_entropy_stats_reference(logits, targets, 700)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    grad_loss = torch.randn(3)
    got = kernels.cross_entropy_grad(logits, targets, 700, want[0], want[1], grad_loss,
                                     use_triton=True)
    want = kernels.cross_entropy_grad_reference(logits, targets, 700, want[0], want[1], grad_loss)
    assert got.dtype == dtype
    if dtype == torch.bfloat16:
        _bf16_close(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@BOTH
def test_vocab_split_into_two_shards_combined_by_hand(use_triton):
    # Two tp ranks simulated in one process: [0, 19) and [19, 37), combined as the all-reduces do.
    torch.manual_seed(3)
    logits = torch.randn(6, 37, dtype=torch.float64)
    targets = torch.tensor([0, 18, 19, 36, 7, 25])
    shards = [(logits[:, :19], 0), (logits[:, 19:], 19)]
    stats = [kernels.cross_entropy_stats(x, targets, start, use_triton=use_triton)
             for x, start in shards]
    row_max = torch.maximum(stats[0][0], stats[1][0])  # all-reduce MAX
    sumexp = sum(s * torch.exp(m - row_max) for m, s, _ in stats)  # rescale, all-reduce SUM
    target_logit = stats[0][2] + stats[1][2]  # all-reduce SUM
    loss = kernels.cross_entropy_loss_from_stats(row_max, sumexp, target_logit)
    torch.testing.assert_close(loss, F.cross_entropy(logits, targets, reduction="none"),
                               rtol=1e-12, atol=1e-12)
    upstream = torch.randn(6, dtype=torch.float64)
    grad = torch.cat([kernels.cross_entropy_grad(x, targets, start, row_max, sumexp, upstream,
                                                 use_triton=use_triton) for x, start in shards], 1)
    full = logits.clone().requires_grad_()
    expected, = torch.autograd.grad(F.cross_entropy(full, targets, reduction="none"), full,
                                    upstream)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


def _vocab_parallel_job(logits, targets):
    """On each rank of the cluster: this rank's vocabulary shard, its loss and gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    bounds = [logits.shape[1] * r // world for r in range(world + 1)]
    local = logits[:, bounds[rank]:bounds[rank + 1]].clone().requires_grad_()
    # The reference path: the workers are shared with other tests and may have imported triton
    # without the interpreter; the pieces the all-reduces combine are tested above on both paths.
    loss = kernels.vocab_parallel_cross_entropy(local, targets, bounds[rank], dist.group.WORLD,
                                                use_triton=False)
    loss.backward()
    return loss.detach(), local.grad


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_on_gloo_ranks(clusters):
    # 4 tp ranks with uneven shards [0, 9), [9, 18), [18, 27), [27, 37) of a 37-token vocabulary.
    torch.manual_seed(4)
    logits = torch.randn(5, 37, dtype=torch.float64)
    targets = torch.tensor([0, 9, 17, 36, -100])
    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full, targets)
    expected_grad, = torch.autograd.grad(expected, full)
    results = clusters.get(4).run(_vocab_parallel_job, logits, targets, timeout_s=120)
    for loss, _ in results:  # every rank holds the full loss
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    grad = torch.cat([g for _, g in results], dim=1)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)


def test_cross_entropy_errors(monkeypatch):
    logits, targets = torch.randn(4, 10), torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match=r"local_logits must be \(N, V_local\)"):
        kernels.cross_entropy_stats(torch.randn(4, 0), targets, 0)
    with pytest.raises(ValueError, match="targets must be int64 of shape"):
        kernels.cross_entropy_stats(logits, targets.int(), 0)
    with pytest.raises(ValueError, match="vocab_start=3 needs a group"):
        kernels.vocab_parallel_cross_entropy(logits, targets, 3)
    with pytest.raises(ValueError, match=r"target 10 is outside \[0, 10\)"):
        kernels.vocab_parallel_cross_entropy(logits, torch.tensor([1, 2, 10, 3]))
    with pytest.raises(ValueError, match="reduction must be"):
        kernels.vocab_parallel_cross_entropy(logits, targets, reduction="avg")
    with pytest.raises(ValueError, match=r"targets shape \(3,\)"):
        kernels.vocab_parallel_cross_entropy(logits, targets[:3])
    monkeypatch.setattr(ce_mod, "_stats_kernel", object())  # as if compiled, not interpreted
    with pytest.raises(ValueError, match="use_triton=True on cpu tensors needs the Triton interp"):
        kernels.cross_entropy_stats(logits, targets, 0, use_triton=True)


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------


@BOTH
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dtype_id)
def test_rms_norm_equals_hf_llama(use_triton, dtype):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    torch.manual_seed(5)
    hf = llama.LlamaRMSNorm(13, eps=1e-5).to(dtype)  # H = 13: not a power of two
    with torch.no_grad():
        hf.weight.copy_(1 + 0.1 * torch.randn(13))
    x = torch.randn(2, 3, 13, dtype=dtype, requires_grad=True)
    y = kernels.rms_norm(x, hf.weight, 1e-5, use_triton=use_triton)
    expected = hf(x)
    dy = torch.randn_like(y)
    got_grads = torch.autograd.grad(y, (x, hf.weight), dy)
    want_grads = torch.autograd.grad(expected, (x, hf.weight), dy)
    assert y.dtype == expected.dtype == dtype
    for got, want in [(y, expected), *zip(got_grads, want_grads)]:
        if dtype == torch.bfloat16:
            _bf16_close(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@BOTH
def test_rms_norm_gradcheck(use_triton):
    torch.manual_seed(6)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: kernels.rms_norm(a, b, 1e-6, use_triton=use_triton),
                             (x, w))


@needs_interpreter
def test_rms_norm_triton_several_rows_per_backward_program(monkeypatch):
    # 7 rows on 3 programs: rows 0,3,6 / 1,4 / 2,5, each program summing its weight gradient.
    monkeypatch.setattr(rms_mod, "_MAX_BWD_PROGRAMS", 3)
    torch.manual_seed(7)
    x = torch.randn(7, 24, dtype=torch.float64, requires_grad=True)
    w = torch.randn(24, dtype=torch.float64, requires_grad=True)
    y = kernels.rms_norm(x, w, use_triton=True)
    expected = kernels.rms_norm_reference(x, w)
    dy = torch.randn_like(y)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(torch.autograd.grad(y, (x, w), dy),
                         torch.autograd.grad(expected, (x, w), dy)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@BOTH
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=_dtype_id)
def test_rms_norm_backward_equals_autograd(use_triton, dtype):
    """rms_norm_backward (the graph op's backward, statistics recomputed) equals autograd of
    HF's spelling: the reference path op for op, the Triton path to rounding."""
    torch.manual_seed(11)
    x = torch.randn(2, 5, 13, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(13)).to(dtype).requires_grad_(True)
    y = kernels.rms_norm_reference(x, w, 1e-5)
    dy = torch.randn_like(y)
    want = torch.autograd.grad(y, (x, w), dy)
    got = rms_mod.rms_norm_backward(dy, x.detach(), w.detach(), 1e-5, use_triton=use_triton)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}
    for g, e in zip(got, want):
        assert g.dtype == e.dtype == dtype and g.shape == e.shape
        if dtype == torch.bfloat16:
            _bf16_close(g, e)
        else:
            torch.testing.assert_close(g, e, rtol=tol[dtype], atol=tol[dtype])


def test_rms_norm_errors():
    with pytest.raises(ValueError, match=r"weight must be \(H,\).*\(2, 4\).*\(5,\)"):
        kernels.rms_norm(torch.randn(2, 4), torch.ones(5))
    with pytest.raises(ValueError, match="must be floating point"):
        kernels.rms_norm(torch.ones(2, 4, dtype=torch.int64), torch.ones(4))
    with pytest.raises(ValueError, match="exceeds the fused kernel's single-block limit"):
        kernels.rms_norm(torch.randn(1, rms_mod.MAX_FUSED_HIDDEN + 1),
                         torch.ones(rms_mod.MAX_FUSED_HIDDEN + 1), use_triton=True)


# ---------------------------------------------------------------------------------------------
# SwiGLU
# ---------------------------------------------------------------------------------------------


@BOTH
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=_dtype_id)
def test_swiglu_equals_torch(use_triton, dtype):
    torch.manual_seed(8)
    # 3 * 700 = 2100 elements: three 1024-element programs, the last one partial.
    gate = torch.randn(3, 700, dtype=dtype, requires_grad=True)
    up = torch.randn(3, 700, dtype=dtype, requires_grad=True)
    y = kernels.swiglu(gate, up, use_triton=use_triton)
    expected = F.silu(gate) * up
    dy = torch.randn_like(y)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6}
    for got, want in [(y, expected), *zip(torch.autograd.grad(y, (gate, up), dy),
                                          torch.autograd.grad(expected, (gate, up), dy))]:
        assert got.dtype == dtype
        if dtype == torch.bfloat16:
            _bf16_close(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=tol[dtype], atol=tol[dtype])


@BOTH
def test_swiglu_gradcheck(use_triton):
    torch.manual_seed(9)
    gate = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    up = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda g, u: kernels.swiglu(g, u, use_triton=use_triton), (gate, up))


@BOTH
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=_dtype_id)
def test_swiglu_backward_equals_autograd(use_triton, dtype):
    torch.manual_seed(12)
    gate = torch.randn(3, 700, dtype=dtype, requires_grad=True)
    up = torch.randn(3, 700, dtype=dtype, requires_grad=True)
    y = F.silu(gate) * up
    dy = torch.randn_like(y)
    want = torch.autograd.grad(y, (gate, up), dy)
    got = swiglu_mod.swiglu_backward(dy, gate.detach(), up.detach(), use_triton=use_triton)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=tol, atol=tol)
    if not use_triton:  # the reference is autograd's own formula: equal to the bit
        assert all(torch.equal(g, e) for g, e in zip(got, want))


def test_graph_ops_opcheck():
    """torch.ops.autoplan.* (kernels/ops.py): schema, fake impls and autograd registration
    (torch.library.opcheck), and gradients equal to the references'."""
    import kernels.ops  # noqa: F401 - registers the ops

    torch.manual_seed(13)
    x = torch.randn(2, 3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    g, u = torch.randn(2, 3, 8, requires_grad=True), torch.randn(2, 3, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.autoplan.rms_norm.default, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.autoplan.swiglu.default, (g, u))
    for op, ref, args in [(torch.ops.autoplan.rms_norm, kernels.rms_norm_reference, (x, w)),
                          (torch.ops.autoplan.swiglu, kernels.swiglu_reference, (g, u))]:
        extra = (1e-6,) if ref is kernels.rms_norm_reference else ()
        y, want = op(*args, *extra), ref(*args, *extra)
        dy = torch.randn_like(y)
        torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-7)
        for a, b in zip(torch.autograd.grad(y, args, dy), torch.autograd.grad(want, args, dy)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_swiglu_errors():
    with pytest.raises(ValueError, match=r"one shape and dtype.*\(2, 3\).*\(2, 4\)"):
        kernels.swiglu(torch.randn(2, 3), torch.randn(2, 4))
    with pytest.raises(ValueError, match="one shape and dtype"):
        kernels.swiglu(torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# AdamW
# ---------------------------------------------------------------------------------------------


@BOTH
@pytest.mark.parametrize("betas, weight_decay", [((0.9, 0.999), 0.01), ((0.3, 0.95), 0.0)],
                         ids=["default", "large-lerp-weight-no-decay"])
def test_adamw_equals_torch_optim(use_triton, betas, weight_decay):
    # 2500 elements: three 1024-element programs; beta1 = 0.3 takes ATen's other lerp branch.
    torch.manual_seed(10)
    lr, eps, numel = 1e-2, 1e-8, 2500
    torch_param = torch.nn.Parameter(torch.randn(numel))
    opt = torch.optim.AdamW([torch_param], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            foreach=False)
    param = torch_param.detach().clone()
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    for step in range(1, 4):
        grad = torch.randn(numel)
        torch_param.grad = grad.clone()
        opt.step()
        kernels.adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay,
                           use_triton=use_triton)
    state = opt.state[torch_param]
    # The reference is torch's code op for op: bit for bit. The kernel's sqrt is correctly
    # rounded and ATen's vectorized one is not always (kernels/adamw.py): rtol 1e-6.
    tol = dict(rtol=1e-6, atol=1e-9) if use_triton else dict(rtol=0, atol=0)
    for got, want in [(param, torch_param.detach()), (exp_avg, state["exp_avg"]),
                      (exp_avg_sq, state["exp_avg_sq"])]:
        torch.testing.assert_close(got, want, **tol)


def test_adamw_errors():
    p = torch.zeros(8)
    with pytest.raises(ValueError, match=r"grad must be a flat contiguous float32 shard, got "
                                         r"torch.float64 of shape \(8,\)"):
        kernels.adamw_step(p, p.double(), p.clone(), p.clone(), 1, 1e-3)
    with pytest.raises(ValueError, match=r"exp_avg has shape \(7,\), param \(8,\)"):
        kernels.adamw_step(p, p.clone(), torch.zeros(7), p.clone(), 1, 1e-3)
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        kernels.adamw_step(p, p.clone(), p.clone(), p.clone(), 0, 1e-3)
    with pytest.raises(ValueError, match="flat contiguous float32 shard.*\\(2, 4\\)"):
        kernels.adamw_step(p.view(2, 4), p.view(2, 4), p.view(2, 4), p.view(2, 4), 1, 1e-3)


# ---------------------------------------------------------------------------------------------
# The kernels compile for a real GPU
# ---------------------------------------------------------------------------------------------

# (module, kernel name, argument types in order with {dt} the data dtype, constexprs, options)
_COMPILED = [
    (ce_mod, "_stats_kernel", ["*{dt}", "*i64", "*fp32", "*fp32", "*fp32", "i32", "i32", "i32"],
     {"BLOCK_V": 1024}, {}),
    (ce_mod, "_grad_kernel", ["*{dt}", "*i64", "*fp32", "*fp32", "*fp32", "*{dt}", "i32", "i32",
                              "i32", "i32"], {"BLOCK_V": 1024}, {}),
    (rms_mod, "_fwd_kernel", ["*{dt}", "*{dt}", "*{dt}", "*fp32", "i32", "i32", "i32", "fp32"],
     {"BLOCK_H": 4096}, {}),
    (rms_mod, "_bwd_kernel", ["*{dt}", "*{dt}", "*{dt}", "*fp32", "*{dt}", "*fp32", "i32", "i32",
                              "i32", "i32", "i32"], {"BLOCK_H": 4096}, {}),
    (swiglu_mod, "_fwd_kernel", ["*{dt}", "*{dt}", "*{dt}", "i32"], {"BLOCK": 1024}, {}),
    (swiglu_mod, "_bwd_kernel", ["*{dt}"] * 5 + ["i32"], {"BLOCK": 1024}, {}),
    (adamw_mod, "_adamw_kernel", ["*fp32"] * 4 + ["i32"] + ["fp32"] * 7,
     {"SMALL_LERP_WEIGHT": True, "BLOCK": 1024}, {"enable_fp_fusion": False}),
    (gemm_mod, "_grouped_mm_kernel", ["*{dt}", "*i64", "*{dt}", "*{dt}", "*i32", "*i32"]
     + ["i32"] * 10, {"GATHER_A": True, "BLOCK_G": 256, "BLOCK_M": 64, "BLOCK_N": 64,
                      "BLOCK_K": 32, "INPUT_PRECISION": "ieee", "BF16_AS_FP32": False}, {}),
    (gemm_mod, "_grouped_weight_grad_kernel", ["*{dt}", "*{dt}", "*i64", "*{dt}", "*i32"]
     + ["i32"] * 9, {"GATHER_X": True, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32,
                     "INPUT_PRECISION": "ieee", "BF16_AS_FP32": False}, {}),
]


def _compile_all_for_sm90() -> None:
    """Compile every kernel for sm_90 in float32 and bfloat16 (run with TRITON_INTERPRET=0)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    for dt in ("fp32", "bf16"):
        for module, name, types, constexprs, options in _COMPILED:
            kernel = getattr(module, name)
            assert isinstance(kernel, JITFunction), f"{name} is {type(kernel).__name__}"
            names = [p.name for p in kernel.params if not p.is_constexpr]
            signature = {n: t.format(dt=dt) for n, t in zip(names, types, strict=True)}
            signature.update({n: "constexpr" for n in constexprs})
            compiled = triton.compile(ASTSource(kernel, signature, constexprs),
                                      target=GPUTarget("cuda", 90, 32), options=options)
            assert compiled.asm["cubin"], f"{module.__name__}.{name} ({dt}) produced no cubin"
            if name == "_adamw_kernel":  # promises torch's roundings: no approximate instructions
                approx = set(re.findall(r"\b\w+\.(?:approx|full)\.f32", compiled.asm["ptx"]))
                assert not approx, f"_adamw_kernel uses {sorted(approx)}"


def _run_python(code: str, env: dict[str, str], timeout_s: float) -> str:
    """Run `code` in a new interpreter at the repo root, with tests/ importable; its stdout, or a
    failure with its output if it fails."""
    env = {**os.environ, **env,
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "tests"), str(REPO_ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def test_kernels_compile_for_sm90(tmp_path):
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton build has no NVIDIA backend to compile with")
    # Its own process: in this one triton.language may be in interpreter mode (see the Note).
    _run_python("import test_kernels; test_kernels._compile_all_for_sm90()",
                {"TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path),
                 "TRITON_DEFAULT_FP_FUSION": "1"}, timeout_s=300)


@pytest.mark.skipif(INTERPRETED or INTERPRETER_PROBLEM is None,
                    reason="the Triton paths ran in this process under the interpreter")
def test_triton_paths_in_a_fresh_process():
    # Every test whose name or id says triton, in a process where the interpreter is set first.
    out = _run_python("import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
                      f"{__file__!r}, '-m', 'not slow', '-k', 'triton and not fresh_process']))",
                      {"TRITON_INTERPRET": "1"}, timeout_s=300)
    summary = out.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, out[-6000:]


def test_device_allocations_are_the_triton_paths():
    """kernels/_dispatch.py device_allocations (a dry run of a GPU plan): the loss and AdamW
    allocate what their Triton path allocates -- the loss's three fp32 statistics per row
    and the logits' gradient at their dtype, AdamW nothing -- and launch nothing; outside
    it, the CPU reference allocates its fp32 upcast and temporaries on top."""
    from autoplan.runtime.live_bytes import LiveTensorBytes
    from kernels._dispatch import device_allocations

    n, v = 64, 1000
    logits = torch.randn(n, v, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    param, grad, m1, m2 = (torch.zeros(4096) for _ in range(4))

    def peak(fn):
        with LiveTensorBytes() as live:
            fn()
        return live.peak

    def step():
        loss = kernels.vocab_parallel_cross_entropy(logits, targets, reduction="sum")
        loss.backward()
        logits.grad = None
        kernels.adamw_step(param, grad, m1, m2, step=1, lr=1e-3)

    reference = peak(step)
    with device_allocations():
        device = peak(step)
        before = param.clone()
        kernels.adamw_step(param, torch.ones(4096), m1, m2, step=1, lr=1e-3)
        assert torch.equal(param, before)  # launched nothing
    stats, grad_bytes = 3 * n * 4, n * v * 2
    assert stats + grad_bytes <= device <= stats + grad_bytes + 64 * n  # + per-row scalars
    assert reference > device + n * v * 4  # the reference's fp32 upcast at least
