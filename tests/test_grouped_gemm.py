"""kernels/grouped_gemm.py: the grouped GEMM and the routed experts on it, the Triton paths run by
the Triton interpreter on CPU tensors against plain torch (per-row einsum, autograd of the
experts' eager math in float64) and against the references; and how the experts op dispatches.

Tiles of 16 (the smallest tl.dot takes) in place of the kernels' 64 x 64 x 32, so that tiny
shapes still cut a group into several m-tiles, the outputs into several n-tiles and the
reductions into several k-steps, each with a partial last tile. Tolerances: float32 to its
rounding (rtol 1e-5 of the result's scale); bfloat16 operands (float32 accumulation, the
reference rounding every intermediate to bfloat16, the interpreter's truncating casts, see
tests/test_kernels.py `_bf16_close`) to 2**-5 of the result's largest entry.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import: see below

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import kernels.grouped_gemm as gg  # noqa: E402
from autoplan.experts import (  # noqa: E402
    experts,
    experts_backward,
    experts_backward_reference,
    experts_reference,
)
from kernels._dispatch import device_allocations  # noqa: E402

# [Note: TRITON_INTERPRET and import order] in tests/test_kernels.py: when an earlier module
# imported triton first, these run in a fresh process (test_triton_paths_in_a_fresh_process).
INTERPRETED = all(isinstance(f, InterpretedFunction) for f in (gg._grouped_mm_kernel, tl.sum))
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="triton imported before "
                                       "TRITON_INTERPRET=1: run in a fresh process instead")


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    for name in ("_BLOCK_M", "_BLOCK_N", "_BLOCK_K"):
        monkeypatch.setattr(gg, name, 16)


def _close(got, want, dtype):
    """float32: to rounding; bfloat16: 2**-5 of the largest entry (module docstring)."""
    scale = want.abs().max().item() or 1.0
    tol = 1e-5 if dtype == torch.float32 else 2**-5
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


def _groups(offsets: list[int], num_rows: int) -> torch.Tensor:
    """(num_rows,) the group of each row, -1 past the last group."""
    group = torch.full((num_rows,), -1)
    for g in range(len(offsets) - 1):
        group[offsets[g]:offsets[g + 1]] = g
    return group


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_grouped_mm_triton_equals_per_row_matmuls(dtype):
    # 4 groups of 19, 0, 16, 5 rows (an empty group, one of exactly one tile, one of two tiles
    # with a partial second) and 6 rows past them; rows gathered from 9 source rows; b a
    # transposed view (F.linear's layout), float32 weights for bfloat16 rows.
    torch.manual_seed(0)
    offsets = [0, 19, 19, 35, 40]
    a = torch.randn(9, 40).to(dtype)                        # (T, K)
    a_rows = torch.randint(0, 9, (46,))                     # (M,)
    b = torch.randn(4, 24, 40).transpose(1, 2)              # (G, K, N), strided
    offsets_t = torch.tensor(offsets)
    got = gg.grouped_mm(a, b, offsets_t, a_rows, use_triton=True)
    group = _groups(offsets, 46)
    want = torch.einsum("rk,rkn->rn", a[a_rows].double(), b[group.clamp(min=0)].to(dtype).double())
    want[group < 0] = 0
    assert got.dtype == dtype and got.shape == (46, 24)
    assert torch.equal(got[40:], torch.zeros(6, 24, dtype=dtype))
    _close(got, want, dtype)
    _close(gg.grouped_mm_reference(a, b, offsets_t, a_rows), want, dtype)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_grouped_weight_grad_triton_equals_per_group_matmuls(dtype):
    torch.manual_seed(1)
    offsets = [0, 0, 21, 37]                               # an empty group first
    dy = torch.randn(40, 24).to(dtype)                     # (M, N_dy), 3 rows past the groups
    x = torch.randn(7, 20).to(dtype)                       # (T, N_x), read through x_rows
    x_rows = torch.randint(0, 7, (40,))
    got = gg.grouped_weight_grad(dy, x, torch.tensor(offsets), x_rows, dtype=torch.float32,
                                 use_triton=True)
    want = torch.stack([dy[lo:hi].double().t() @ x[x_rows[lo:hi]].double()
                        for lo, hi in zip(offsets, offsets[1:])])
    assert got.dtype == torch.float32 and got.shape == (3, 24, 20)
    assert torch.equal(got[0], torch.zeros(24, 20))
    _close(got, want, dtype)
    _close(gg.grouped_weight_grad_reference(dy, x, torch.tensor(offsets), x_rows, torch.float32),
           want, dtype)


def _experts_inputs(num_tokens, hidden, inter, num_experts, top_k, dtype, weight_dtype,
                    choices=None, seed=0):
    """(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj): each token's k distinct
    experts drawn from `choices` (global ids; default the E held)."""
    g = torch.Generator().manual_seed(seed)
    choices = torch.tensor(choices if choices is not None else range(num_experts))
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    idx = torch.stack([choices[torch.randperm(len(choices), generator=g)[:top_k]]
                       for _ in range(num_tokens)])
    w = torch.rand(num_tokens, top_k, generator=g)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5)
    down = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5)
    return x, idx, w, gate_up.to(weight_dtype), down.to(weight_dtype)


# (dtype of hidden, of the expert weights, T, H, I, E held, the experts chosen from, k, offset,
# act)
_EXPERTS_CASES = {
    # k = 2 over 4 experts, expert 2 given no token
    "float32": (torch.float32, torch.float32, 14, 40, 24, 4, [0, 1, 3], 2, 0, "silu"),
    # experts [3, 6) of 8: most choices outside, some tokens with none held
    "float32-offset-slice": (torch.float32, torch.float32, 10, 24, 20, 3, range(8), 3, 3,
                             "gelu_pytorch_tanh"),
    # a 16-bit expert-parallel plan: bf16 hidden, fp32 weights and routing weights
    "bfloat16-fp32-weights": (torch.bfloat16, torch.float32, 12, 40, 24, 4, None, 2, 0, "silu"),
}


@needs_interpreter
@pytest.mark.parametrize("case", list(_EXPERTS_CASES), ids=list(_EXPERTS_CASES))
def test_grouped_experts_triton_equals_reference(case):
    dtype, w_dtype, t, h, i, e, choices, k, offset, act = _EXPERTS_CASES[case]
    x, idx, w, gate_up, down = _experts_inputs(t, h, i, e, k, dtype, w_dtype, choices)
    held = (idx >= offset) & (idx < offset + e)
    if offset:  # the case is what it says: tokens with no held choice, and held choices
        assert (~held).all(dim=1).any() and held.any()
    args = (x, idx, w, gate_up, down, act, offset)
    got = gg.grouped_experts(*args, use_triton=True)
    assert got.dtype == dtype
    _close(got, experts_reference(*args), dtype)
    grad = torch.randn(t, h, generator=torch.Generator().manual_seed(2)).to(dtype)
    got_grads = gg.grouped_experts_backward(grad, *args, use_triton=True)
    want_grads = experts_backward_reference(grad, *args)
    for name, a, b, like in zip(("hidden", "top_k_weights", "gate_up_proj", "down_proj"),
                                got_grads, want_grads, (x, w, gate_up, down)):
        assert a.dtype == like.dtype and a.shape == like.shape, name
        _close(a, b, dtype)
    # a choice of no held expert has no routing-weight gradient; an expert of no token none
    assert torch.equal(got_grads[1][~held], torch.zeros(int((~held).sum())))
    if case == "float32":
        assert torch.equal(got_grads[2][2], torch.zeros_like(gate_up[2]))
        assert torch.equal(got_grads[3][2], torch.zeros_like(down[2]))


@needs_interpreter
def test_grouped_experts_triton_gradients_equal_autograd_in_float64():
    """Every gradient of the Triton path (float32) against autograd through the eager math in
    float64, with an expert slice and an unused expert: the chain rule, not the reference's
    own backward, is what it is held to."""
    # held [2, 5); the choices 0 and 1 outside, expert 3 unused
    x, idx, w, gate_up, down = _experts_inputs(11, 24, 20, 3, 2, torch.float32, torch.float32,
                                               choices=[0, 1, 2, 4], seed=3)
    leaves = [t.double().requires_grad_(True) for t in (x, w, gate_up, down)]
    out = experts_reference(leaves[0], idx, leaves[1], leaves[2], leaves[3], "silu", 2)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    want = torch.autograd.grad(out, leaves, grad)
    got = gg.grouped_experts_backward(grad.float(), x, idx, w, gate_up, down, "silu", 2,
                                      use_triton=True)
    for a, b in zip(got, want):
        _close(a.double(), b, torch.float32)
    _close(gg.grouped_experts(x, idx, w, gate_up, down, "silu", 2, use_triton=True).double(),
           out.detach(), torch.float32)


class _CountingLaunches:
    """A kernel's stand-in that counts its launches (`kernel[grid](...)`) and runs it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.fixture
def counted(monkeypatch):
    kernels = [_CountingLaunches(gg._grouped_mm_kernel),
               _CountingLaunches(gg._grouped_weight_grad_kernel)]
    monkeypatch.setattr(gg, "_grouped_mm_kernel", kernels[0])
    monkeypatch.setattr(gg, "_grouped_weight_grad_kernel", kernels[1])
    return lambda: sum(k.launches for k in kernels)


def test_the_experts_op_runs_the_reference_on_cpu(counted):
    args = _experts_inputs(6, 16, 16, 3, 2, torch.float32, torch.float32)
    args = (*args, "silu", 0)
    grad = torch.randn(6, 16)
    assert torch.equal(experts(*args), experts_reference(*args))
    for a, b in zip(experts_backward(grad, *args), experts_backward_reference(grad, *args)):
        assert torch.equal(a, b)
    assert counted() == 0


@needs_interpreter
def test_the_experts_op_runs_the_grouped_gemm_where_pick_triton_says_triton(monkeypatch,
                                                                            counted):
    """pick_triton's rule for CUDA tensors (use_triton None -> Triton), applied to these CPU
    tensors: the op and its backward op launch the kernels and agree with the reference; a
    float64 op runs the reference on every device."""
    monkeypatch.setattr(gg, "pick_triton", lambda use_triton, tensors, fn, kernel:
                        use_triton is not False)
    args = (*_experts_inputs(6, 16, 16, 3, 2, torch.float32, torch.float32), "silu", 0)
    grad = torch.randn(6, 16)
    _close(experts(*args), experts_reference(*args), torch.float32)
    assert counted() == 2                                  # gate_up, down
    for a, b in zip(experts_backward(grad, *args), experts_backward_reference(grad, *args)):
        _close(a, b, torch.float32)
    assert counted() == 2 + 6                              # 2 recomputed, 4 for the gradients
    double = tuple(t.double() if t.is_floating_point() else t for t in args[:5])
    assert torch.equal(experts(*double, "silu", 0), experts_reference(*double, "silu", 0))
    assert counted() == 8


def test_inside_device_allocations_the_triton_path_allocates_and_launches_nothing(
        monkeypatch, counted):
    def no_reference(*args):
        raise AssertionError("the reference ran inside device_allocations")

    monkeypatch.setattr(gg, "experts_reference", no_reference)
    monkeypatch.setattr(gg, "experts_backward_reference", no_reference)
    x, idx, w, gate_up, down = _experts_inputs(6, 16, 8, 3, 2, torch.bfloat16, torch.float32)
    with device_allocations():
        out = experts(x, idx, w, gate_up, down, "silu", 1)
        grads = experts_backward(torch.ones_like(x), x, idx, w, gate_up, down, "silu", 1)
    assert counted() == 0
    assert (out.shape, out.dtype) == (x.shape, x.dtype)
    for g, like in zip(grads, (x, w, gate_up, down)):
        assert (g.shape, g.dtype) == (like.shape, like.dtype)


def test_errors():
    x, idx, w, gate_up, down = _experts_inputs(4, 8, 4, 2, 2, torch.float64, torch.float64)
    with pytest.raises(ValueError, match="Triton path computes in .*hidden is torch.float64"):
        gg.grouped_experts(x, idx, w, gate_up, down, "silu", 0, use_triton=True)
    with pytest.raises(ValueError, match="activation 'tanh' is not one of"):
        gg.grouped_experts(x, idx, w, gate_up, down, "tanh", 0)
    with pytest.raises(ValueError, match=r"grad \(4, 7\) is not hidden's shape \(4, 8\)"):
        gg.grouped_experts_backward(x[:, :7], x, idx, w, gate_up, down, "silu", 0)
    with pytest.raises(ValueError, match=r"grouped_mm: expected a \(M, K\).*\(3, 5\), \(2, 4, 6\)"):
        gg.grouped_mm(torch.randn(3, 5), torch.randn(2, 4, 6), torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match=r"grouped_weight_grad: expected.*\(3, 5\), \(2, 4\)"):
        gg.grouped_weight_grad(torch.randn(3, 5), torch.randn(2, 4), torch.tensor([0, 3]))


@pytest.mark.skipif(INTERPRETED, reason="the Triton paths ran in this process")
def test_triton_paths_in_a_fresh_process():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(root / "tests"), str(root),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           __file__, "-k", "not fresh_process"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "skipped" not in proc.stdout, proc.stdout[-6000:]
