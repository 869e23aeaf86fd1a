"""The float8 recipe ([Note: float8 recipe] in autoplan/float8.py, [Note: float8 pricing] in
autoplan/cost_model/float8.py): the FP8 linear's numerics, its pricing and the planner's
choice, and gloo runs at dp2 x tp2 and pp2 x dp2 against one process running the same recipe.

Tolerance of the gloo runs. The quantized operands are those of one process (rowwise
power-of-two scales, amax all-reduced where tp splits the contraction), so the recipe adds no
difference of its own beyond what the bf16 recipe has: dp shards and tp partial sums round at
other places (tests/test_train_as_planned.py `test_bf16_runs_the_planned_recipe`). Those bf16
differences then reach the FP8 casts, where a value on a rounding boundary of e4m3 (3 mantissa
bits) can go the other way. Measured, the logits before training, relative (Frobenius) to one
process's FP8 run: llama-tiny at dp2 x tp2 with Megatron's column/row-parallel layout 0.50%
(the bf16 recipe's own runs differ from one process by 0.28% there), at pp2 x dp2 0 (bit for
bit); gpt2-tiny (Conv1D, biases) at dp2 x tp2 0.68%; FP8 differs from the bf16 recipe by
1.6-1.7%. So the forward is held to 1.2% of one process's FP8 logits and to 0.6 of their
distance from the bf16 recipe's -- a run without the FP8 linears fails that -- and the losses
of 3 steps to atol 1e-3, as the bf16 recipe's (measured: 9.9e-5 and 2.0e-4 at dp2 x tp2,
1.3e-4 at pp2 x dp2). Gradient scales, which AdamW's first steps divide out, are checked on
their own (`test_tp_placements_give_one_process_gradients`).
"""

from __future__ import annotations

import json

import pytest
import torch

import _float8_jobs
from autoplan.float8 import (ADDMM_TARGET, E4M3, E5M2, LINEAR_TARGET, as_linear,
                             float8_linear_local, quantize_rows, quantize_tensorwise,
                             supported)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# -- the FP8 linear on one process ---------------------------------------------------------------
def test_rowwise_quantization_is_the_value_rounded_to_fp8_under_a_power_of_two_scale():
    torch.manual_seed(0)
    t = torch.randn(6, 32, dtype=torch.bfloat16) * torch.logspace(-3, 3, 6).to(
        torch.bfloat16)[:, None]
    t[2] = 0  # an all-zero row keeps a finite scale
    for dim, fp8 in ((-1, E4M3), (0, E5M2)):
        q, inv = quantize_rows(t, dim, fp8)
        assert q.dtype == fp8 and inv.dtype == torch.float32
        assert inv.shape == ((6, 1) if dim == -1 else (1, 32))
        assert torch.equal(torch.log2(inv), torch.round(torch.log2(inv)))  # powers of two
        scaled = t.float() / inv
        assert scaled.abs().max() <= torch.finfo(fp8).max
        assert torch.equal(q, scaled.to(fp8))  # exact scaling, one rounding
        # each slice uses its range: its largest value is within a factor 2 of the format's max
        amax = scaled.abs().amax(dim=dim)
        assert torch.all((amax == 0) | (amax > torch.finfo(fp8).max / 2))


def test_fp8_linear_forward_and_gradients():
    """y and dx are the FP8 matmuls of the dequantized operands (dx: dy rowwise, the weight
    tensorwise, both e4m3, as torchao's rowwise_with_gw_hp); dW is the bf16 matmul itself; a
    row's output does not depend on the other rows (a dp or microbatch split)."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 32, dtype=torch.bfloat16, requires_grad=True)
    y = float8_linear_local(x, w)
    xq, x_inv = quantize_rows(x.detach().reshape(16, 32), -1, E4M3)
    wq, w_inv = quantize_rows(w.detach(), -1, E4M3)
    want = ((xq.float() * x_inv) @ (wq.float() * w_inv).t()).to(torch.bfloat16)
    torch.testing.assert_close(y.reshape(16, 48), want, rtol=1e-2, atol=1e-2)
    assert 0.005 < _rel(y, torch.nn.functional.linear(x, w)) < 0.1  # FP8, not bf16
    assert torch.equal(float8_linear_local(x[:1].detach(), w.detach()), y[:1].detach())
    dy = torch.randn(2, 8, 48, dtype=torch.bfloat16)
    y.backward(dy)
    assert torch.equal(w.grad, dy.reshape(16, 48).t() @ x.detach().reshape(16, 32))
    dyq, dy_inv = quantize_rows(dy.reshape(16, 48), -1, E4M3)
    wq, w_inv = quantize_tensorwise(w.detach(), E4M3)
    assert w_inv.dim() == 0
    want_dx = ((dyq.float() * dy_inv) @ (wq.float() * w_inv)).to(torch.bfloat16)
    torch.testing.assert_close(x.grad.reshape(16, 32), want_dx, rtol=1e-2, atol=1e-2)


def test_supported_placements():
    assert supported("R", "R", 3, "R") and supported("S(0)", "R", 3, "R")
    assert supported("S(1)", "R", 3)              # a sequence split
    assert supported("R", "S(0)", 3, "S(0)")      # column parallel
    assert supported("S(2)", "S(1)", 3)           # row parallel
    assert supported("S(-1)", "S(1)", 3, "P")     # its bias added to one partial sum
    assert not supported("S(2)", "S(1)", 3, "R")
    assert not supported("R", "S(0)", 3, "R")
    assert not supported("S(2)", "R", 3)
    assert not supported("P", "R", 3) and not supported("R", "P", 3)
    # GPT-2's Conv1D, addmm(bias, x (M, K), weight (K, N)): the weight's placement transposed
    assert as_linear(ADDMM_TARGET, ("S(0)", "R", "S(1)")) == ("R", "S(0)", "S(0)")
    assert as_linear(ADDMM_TARGET, ("P", "S(1)", "S(0)")) == ("S(1)", "S(1)", "P")
    assert as_linear(LINEAR_TARGET, ("S(2)", "S(1)")) == ("S(2)", "S(1)", None)
    with pytest.raises(ValueError, match="are not"):
        float8_linear_local(torch.ones(2, 4), torch.ones(3, 5))


# -- pricing and the planner's choice -------------------------------------------------------------
def _plan(cluster: str, **kw):
    return _plan_of("llama-tiny", cluster=cluster, **kw)


def _plan_of(name: str, config: dict | None = None, **kw):
    from autoplan.api import autoparallel
    from autoplan.models import build_model

    return autoparallel(build_model(name, device="meta", **(config or {})), global_batch=8,
                        seq_len=16, **kw).plan


def test_float8_on_lists_every_eligible_linear_and_names_the_recipe():
    from autoplan.spec import precision_recipe

    plan = _plan("local-cpu", world_size=2, dp=2, float8="on")
    # llama-tiny: q, o, gate, up, down of each block (k and v are (8, 32): 8 is not a multiple
    # of 16); the LM head is outside the blocks
    assert plan.dtype == "bfloat16"
    assert len(plan.float8_linears) == 10
    assert all(".layers." in f and "k_proj" not in f for f in plan.float8_linears)
    assert "10 linears in FP8" in precision_recipe(plan.dtype, "", len(plan.float8_linears))
    from autoplan.plan import Plan

    assert Plan.from_json(plan.to_json()) == plan
    assert "float8_linears" not in json.loads(_plan("local-cpu", world_size=2, dp=2,
                                                    dtype="bfloat16").to_json())


def test_float8_auto_pays_on_h100_and_is_priced_faster():
    """On an H100 the FP8 peak is twice bf16's: "auto" runs the linears whose matmuls are large
    enough to gain more than their scaling passes cost, and the predicted step is faster than
    the bf16 recipe's and than "on"'s (every eligible linear). Measured: compute 18.8 -> 16.8
    ms per step (the weight gradients stay in bf16)."""
    from autoplan.api import autoparallel
    from autoplan.models import build_model
    from autoplan.solver import reprice

    def planned(**kw):
        return autoparallel(build_model("llama-tiny", device="meta", hidden_size=4096,
                                        intermediate_size=14336, num_attention_heads=32,
                                        num_key_value_heads=8, num_hidden_layers=2,
                                        head_dim=128, max_position_embeddings=4096),
                            global_batch=8, seq_len=4096, cluster="dgx-h100", num_nodes=1,
                            dtype="bfloat16", dp=8, **kw)
    bf16, on = planned().plan, planned(float8="on").plan
    ap = planned(float8="auto")
    auto = ap.plan
    # q, o, gate, up, down; k and v ((1024, 4096): N = 1024) gain less than their casts cost
    assert len(auto.float8_linears) == 10, auto.float8_linears
    assert not any("k_proj" in f or "v_proj" in f for f in auto.float8_linears)
    assert len(on.float8_linears) == 14
    assert auto.prediction.compute_s < 0.92 * bf16.prediction.compute_s
    assert auto.prediction.step_time_s < bf16.prediction.step_time_s
    assert auto.prediction.step_time_s < on.prediction.step_time_s
    # the report's first runner-up says what FP8 buys: the same plan with its linears in bf16
    off = auto.alternatives[0]
    assert off.reason.startswith("every linear in bfloat16 (float8 'auto' runs 10 in FP8): "
                                 "compute: +"), off.reason
    assert (off.mesh, off.num_microbatches) == (auto.mesh, auto.num_microbatches)
    assert off.step_time_s - auto.prediction.step_time_s == pytest.approx(
        bf16.prediction.compute_s - auto.prediction.compute_s, rel=1e-6)
    # repriced as it runs: its own FP8 linears, not every one "on" would run
    again = reprice(ap.graph, auto, ap.topology, ap.spec)
    assert again.float8_linears == auto.float8_linears
    assert again.prediction.step_time_s == pytest.approx(auto.prediction.step_time_s, rel=1e-9)


def test_a_shard_whose_dims_cuda_cannot_multiply_stays_in_bf16():
    """CUDA's `_scaled_mm` needs each rank's K and N to be multiples of 16: an MLP of 144
    (9 x 16) pinned split 8 ways (18 per rank) keeps gate in bf16 under float8="on", which
    runs it in FP8 unsplit; up, not pinned, is held whole to run in FP8."""
    from autoplan.api import autoparallel
    from autoplan.models import build_model

    def planned(tp):
        model = build_model("llama-tiny", device="meta", hidden_size=128,
                            intermediate_size=144, num_attention_heads=8,
                            num_key_value_heads=8, head_dim=16)
        pins = {"model.layers.*.mlp.gate_proj.weight": "S(0)"} if tp > 1 else {}
        return autoparallel(model, global_batch=8, seq_len=16, cluster="dgx-h100",
                            dtype="bfloat16", tp=tp, float8="on", placements=pins).plan
    whole = {f.split(".")[-2] for f in planned(1).float8_linears}
    tp8 = planned(8)
    split = {f.split(".")[-2] for f in tp8.float8_linears}
    assert {"gate_proj", "up_proj", "down_proj"} <= whole
    assert "gate_proj" not in split and "up_proj" in split, split
    assert tp8.placement_of("model.layers.0.mlp.up_proj.weight") == "R"


def test_float8_that_runs_nothing_says_why():
    from autoplan.solver.configurations import Float8Warning

    with pytest.warns(Float8Warning, match="runs no linear in FP8: FP8 is not faster"):
        _plan("local-cpu", world_size=2, dp=2, float8="auto")  # CPU: FP8 peak = bf16's
    with pytest.warns(Float8Warning, match="no linear of the repeated blocks"):
        _plan_of("llama-tiny", world_size=2, dp=2, float8="on", config=dict(
            hidden_size=40, intermediate_size=72, num_attention_heads=4,
            num_key_value_heads=2, head_dim=10))  # no weight dim a multiple of 16


@pytest.mark.parametrize("cluster, kw, match", [
    ("dgx-a100", dict(dtype="bfloat16"), "lists no FP8 peak"),
    ("local-cpu", dict(dtype="float32"), "runs its other ops in bfloat16"),
    ("local-cpu", dict(dtype="bfloat16", compile=True), "not run compiled"),
])
def test_float8_refusals_are_named(cluster, kw, match):
    from autoplan.solver.configurations import InvalidConfig

    with pytest.raises(InvalidConfig, match=match):
        _plan(cluster, float8="on", world_size=2 if cluster == "local-cpu" else None, **kw)


# -- gloo ranks against one process --------------------------------------------------------------
# Megatron's layout: q, gate, up (llama) and c_attn, c_fc (GPT-2, Conv1D: weight (K, N))
# column parallel, o, down and c_proj row parallel
MEGATRON = {"llama-tiny": dict.fromkeys(
    [f"model.layers.*.{m}.weight" for m in ("self_attn.q_proj", "mlp.gate_proj",
                                            "mlp.up_proj")], "S(0)") | dict.fromkeys(
    [f"model.layers.*.{m}.weight" for m in ("self_attn.o_proj", "mlp.down_proj")], "S(1)"),
    "gpt2-tiny": dict.fromkeys([f"transformer.h.*.{m}.weight" for m in (
        "attn.c_attn", "mlp.c_fc")], "S(1)") | dict.fromkeys(
    [f"transformer.h.*.{m}.weight" for m in ("attn.c_proj", "mlp.c_proj")], "S(0)")}
# FP8 linears: llama-tiny's q, o, gate, up, down per block (k, v: (8, 32), 8 not a multiple
# of 16); GPT-2's c_attn, c_proj, c_fc, c_proj per block
NUM_FP8 = {"llama-tiny": 10, "gpt2-tiny": 8}


@pytest.mark.slow
@pytest.mark.parametrize("name, mesh", [
    ("llama-tiny", dict(dp=2, tp=2)), ("llama-tiny", dict(pp=2, dp=2, num_microbatches=2)),
    ("gpt2-tiny", dict(dp=2, tp=2))], ids=["dp2xtp2", "pp2xdp2", "gpt2-dp2xtp2"])
def test_float8_plan_trains_as_one_process_running_the_recipe(clusters, name, mesh):
    if "tp" in mesh:
        mesh = dict(mesh, placements=MEGATRON[name])
    results = clusters.get(4).run(_float8_jobs.train_float8, 3, 4, mesh, model=name,
                                  timeout_s=300)
    plan = json.loads(results[0][2])
    fp8 = plan["float8_linears"]
    assert len(fp8) == NUM_FP8[name], fp8
    if "tp" in mesh:  # the split weights run on their local shards, the tp amax all-reduced
        placed = dict(plan["param_placements"])
        assert {placed.get(f, "R") for f in fp8} == {"S(0)", "S(1)"}, placed
    out8, losses8 = _float8_jobs.reference_float8(fp8, 3, 4, name)
    out16, _ = _float8_jobs.reference_float8([], 3, 4, name)
    held = set()
    for out, losses, _plan_json, built, calls in results:
        assert calls == len(built) and set(built) <= set(fp8)
        held |= set(built)
        assert _rel(out, out8) < 0.012 and _rel(out, out8) < 0.6 * _rel(out, out16), (
            _rel(out, out8), _rel(out, out16))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses8), rtol=0,
                                   atol=1e-3)
    assert held == set(fp8)  # every FP8 linear of the plan runs on some rank


@pytest.mark.slow
def test_a_built_model_with_other_fp8_linears_than_its_plan_is_refused(clusters):
    messages = clusters.get(2).run(_float8_jobs.tampered_plan_is_named, 4, dict(dp=2),
                                   timeout_s=300)
    for message in messages:
        assert message is not None and "FP8 linear calls built" in message, message


def test_export_shows_the_fp8_linears(tmp_path):
    """Each rank's exported code runs `_scaled_mm` under the module comment of every FP8
    linear of the plan, and nowhere else."""
    from autoplan.api import autoparallel
    from autoplan.models import build_model

    ap = autoparallel(build_model("llama-tiny", device="meta"), global_batch=8, seq_len=16,
                      world_size=2, dp=2, float8="on")
    ap.export(tmp_path)
    want = {f.removesuffix(".weight") for f in ap.plan.float8_linears}
    for path in sorted(tmp_path.glob("rank*_stage*.py")):
        module, scaled = None, set()
        for line in path.read_text().splitlines():
            if line.startswith("    # "):
                module = line.removeprefix("    # ").strip()
            elif "aten._scaled_mm" in line:
                scaled.add(module)
        assert scaled == want, (path.name, sorted(scaled ^ want))


@pytest.mark.slow
def test_a_split_contraction_takes_the_amax_of_the_whole_row(clusters):
    """Power-of-two scales change only exponents, so a rank's own amax gives the same FP8
    values except where the whole row's scale makes them subnormal: the all-reduce is what
    keeps those equal to one process's (a row's small half, 2^-24 of its large one, here)."""
    results = clusters.get(2).run(_float8_jobs.amax_over_the_split_dim, timeout_s=120)
    for rank, (grouped, alone, groups) in enumerate(results):
        assert grouped and alone == (rank == 0)  # rank 0 holds each row's amax
        assert groups == {"S(1)": (True, False, True), "S(0)": (False, True, True)}


@pytest.mark.slow
def test_tp_placements_give_one_process_gradients(clusters):
    """Each placement the planner runs the FP8 linear with gives one process's output and
    input, weight and bias gradients (fp32 operands: differences are summation order; a
    gradient with a wrong placement -- a Partial counted twice, a bias on every partial sum
    -- is 0.5 or more). The training tests cannot see a gradient's scale: AdamW's first steps
    divide it out."""
    for worst in clusters.get(2).run(_float8_jobs.tp_gradients_as_one_process, timeout_s=120):
        assert all(v < 1e-5 for v in worst.values()), worst


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing, per_linear", [("none", 2), ("selective", 2),
                                                       ("full", 3)])
def test_selective_checkpointing_keeps_the_fp8_matmuls(clusters, checkpointing, per_linear):
    """A linear's forward and input-gradient FP8 matmuls: "selective" keeps the forward's
    output, as it keeps a bf16 matmul's and as the cost model prices it (no FP8 GEMM runs
    again); "full" runs the forward again."""
    results = clusters.get(2).run(_float8_jobs.scaled_mm_per_step, 4,
                                  dict(dp=2, checkpointing=checkpointing), timeout_s=120)
    for calls, linears in results:
        assert calls == per_linear * linears, (calls, linears)
