"""The runtime's fused AdamW ([Note: fused AdamW] in autoplan/runtime/optim.py): torch's AdamW
update, state and checkpoints; the engine's default where kernels are on; on gloo ranks, over
ZeRO-1's row shards and FSDP2/tp DTensor shards, equal to one process with torch.optim.AdamW."""

from __future__ import annotations

import copy

import pytest
import torch

import _jobs
from autoplan import autoparallel
from autoplan.runtime.optim import FusedAdamW
from autoplan.testing import assert_params_close

STEPS, BATCH = 3, 4
pytestmark = pytest.mark.usefixtures("no_private_group")  # one-process builds


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # a matrix, a vector, and a transposed (non-contiguous) view's worth of shapes
    return [torch.randn(8, 5, generator=g), torch.randn(7, generator=g),
            torch.randn(5, 6, generator=g).t()]


def _run(make, steps: int = 5, lr_at: dict | None = None):
    params = [p.clone().requires_grad_(True) for p in _params()]
    opt = make([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}])
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        for group in opt.param_groups:
            group["lr"] = (lr_at or {}).get(i, group["lr"])
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


def test_fused_adamw_computes_torch_adamw():
    """Same hyperparameters, groups, a learning rate changed mid-run, a non-contiguous
    parameter: parameters and state equal torch.optim.AdamW's (its single-tensor CPU path,
    which the kernel's reference follows op for op)."""
    kw = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)
    ours, fused = _run(lambda ps: FusedAdamW(ps, **kw), lr_at={3: 5e-3})
    theirs, ref = _run(lambda ps: torch.optim.AdamW(ps, foreach=False, **kw), lr_at={3: 5e-3})
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    for a, b in zip(fused.state.values(), ref.state.values()):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=0)


def test_fused_adamw_checkpoint_is_torch_adamws():
    """Its state_dict loads into torch.optim.AdamW and training goes on alike."""
    ours, fused = _run(lambda ps: FusedAdamW(ps, lr=1e-2), steps=2)
    params = [p.detach().clone().requires_grad_(True) for p in ours]
    ref = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:],
                             "weight_decay": 0.0}], lr=1e-2, foreach=False)
    ref.load_state_dict(copy.deepcopy(fused.state_dict()))  # state_dict() aliases the state
    g = torch.Generator().manual_seed(7)
    for p, q in zip(ours, params):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = p.grad.clone()
    fused.step()
    ref.step()
    for p, q in zip(ours, params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=0)


def test_fused_adamw_refuses_what_it_cannot_step():
    with pytest.raises(ValueError, match="invalid learning rate"):
        FusedAdamW([torch.zeros(2, requires_grad=True)], lr=-1.0)
    p = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        FusedAdamW([p]).step()


def test_default_optimizer_is_fused_where_kernels_are_on():
    """The engine's default optimizer: FusedAdamW with kernels, torch.optim.AdamW without."""
    factory = _jobs.preset("gpt2-tiny")
    on = autoparallel(factory(), global_batch=BATCH, seq_len=_jobs.SEQ, world_size=1)
    off = autoparallel(factory(), global_batch=BATCH, seq_len=_jobs.SEQ, world_size=1,
                       kernels=False)
    x, y = _jobs.batches(_jobs.vocab_of(factory()), 1, BATCH, _jobs.SEQ)
    on.step(x[0], y[0])
    off.step(x[0], y[0])
    assert type(on._engine.optimizer) is FusedAdamW
    assert type(off._engine.optimizer) is torch.optim.AdamW
    for (n, a), (_, b) in zip(on.state_dict().items(), off.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=lambda m: f"{n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [dict(dp=2, zero_stage=1), dict(dp=2, tp=2, zero_stage=3)],
                         ids=["dp2-zero1-row-shards", "dp2xtp2-zero3-dtensor-shards"])
def test_fused_adamw_on_ranks_matches_one_process(clusters, overrides):
    """The fused update on ZeRO-1's row shards and on FSDP2/tp DTensors' local shards: 3 steps
    on 4 gloo ranks equal one process with torch.optim.AdamW (fp32, rtol 1e-5 / atol 1e-6)."""
    factory = _jobs.preset("llama-tiny")
    results = clusters.get(4).run(_jobs.train, factory, STEPS, BATCH, overrides,
                                  optimizer=_jobs.fused_adamw, timeout_s=600)
    ref = _jobs.reference(factory, STEPS, BATCH)
    for losses, params, *_ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]),
                                   rtol=1e-5, atol=1e-6)
        assert_params_close(params, ref[1], ref[3])  # [Note: AdamW rounding allowance]


def test_fused_adamw_refuses_variants_it_does_not_implement():
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.ones(3)
    opt = FusedAdamW([p])
    opt.param_groups[0]["amsgrad"] = True  # as a loaded torch AdamW state_dict may say
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()


def test_default_adamw_takes_torchs_for_16_bit_parameters():
    """Parameters the optimizer steps in bf16 (a model captured in bf16 without a precision
    recipe): torch.optim.AdamW, which steps any dtype; fp32 ones (named or not): the fused one."""
    from autoplan.runtime.optim import default_adamw

    half = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    full = torch.zeros(3, requires_grad=True)
    assert type(default_adamw([("w", half)], fused=True)) is torch.optim.AdamW
    assert type(default_adamw([("w", full)], fused=True)) is FusedAdamW
    assert type(default_adamw([full], fused=False)) is torch.optim.AdamW


def test_cost_model_prices_the_update_the_runtime_runs():
    """Where the runtime's default AdamW runs the fused kernel (devices that fuse: the GPU
    presets), the cost model prices one pass of 28 bytes per parameter and 2 ops per tensor;
    on the CPU, where it runs the kernel's reference (torch's ten passes), torch's figures."""
    from autoplan.cost_model.step_time import (OPTIMIZER_BYTES_PER_PARAM, OPTIMIZER_OPS_PER_TENSOR,
                                          optimizer_pass)
    from autoplan.spec import TrainingSpec
    from autoplan.topology import preset

    spec = TrainingSpec(global_batch=8, seq_len=128)
    assert spec.optimizer == "adamw"
    gpu, cpu = preset("dgx-h100", num_nodes=1).device, preset("local-cpu").device
    assert gpu.fuses_pointwise and not cpu.fuses_pointwise
    assert optimizer_pass(spec, gpu) == (28.0, 2)
    assert optimizer_pass(spec, cpu) == (OPTIMIZER_BYTES_PER_PARAM["adamw"],
                                         OPTIMIZER_OPS_PER_TENSOR["adamw"])
