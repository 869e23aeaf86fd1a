"""Mixture-of-experts: the `autoplan.experts` op, its capture from HF models, planning and
training under tp and ep against one process."""

from __future__ import annotations

import pytest
import torch

import _moe
from autoplan.capture import CaptureError, capture, materialize
from autoplan.experts import EXPERTS_OP, experts, experts_reference


def _op_inputs(num_tokens=6, hidden=4, inter=3, num_experts=4, top_k=2, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=g, dtype=dtype)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:top_k]
                       for _ in range(num_tokens)])
    w = torch.rand(num_tokens, top_k, generator=g, dtype=dtype)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g, dtype=dtype)
    down = torch.randn(num_experts, hidden, inter, generator=g, dtype=dtype)
    return x, idx, w, gate_up, down


def test_experts_op_gradients_are_exact():
    """The op's autograd formula (a backward op that recomputes the forward) against finite
    differences, for hidden, routing weights and both expert weights."""
    x, idx, w, gate_up, down = _op_inputs()
    args = [t.requires_grad_(True) for t in (x, w, gate_up, down)]
    torch.autograd.gradcheck(lambda a, b, c, d: experts(a, idx, b, c, d, "silu", 0), args)


def test_experts_offset_slices_sum_to_the_whole():
    """Each rank holding 2 of 4 experts (expert_offset 0 and 2) computes a partial sum; the two
    add up to the op over all experts, and a token routed to no held expert gets zeros."""
    x, idx, w, gate_up, down = _op_inputs(dtype=torch.float32)
    full = experts(x, idx, w, gate_up, down, "silu", 0)
    parts = [experts(x, idx, w, gate_up[o:o + 2], down[o:o + 2], "silu", o) for o in (0, 2)]
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-6, atol=1e-6)
    none_held = (idx >= 2).all(dim=1)
    assert torch.equal(parts[0][none_held], torch.zeros_like(parts[0][none_held]))
    assert not torch.equal(parts[0], full)


@pytest.mark.parametrize("family", _moe.FAMILIES)
def test_capture_matches_hf_forward_and_gradients(family):
    """The captured graph, one experts op per MoE layer and no data-dependent op, gives the HF
    model's logits and every parameter's gradient (fp32)."""
    model = _moe.factory(family)()
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    graph = capture(model, (x,), model_name=family)
    targets = [n.target for n in graph.gm.graph.nodes if n.op == "call_function"]
    moe_layers = sum(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    assert targets.count(EXPERTS_OP) == moe_layers >= 1
    assert not {str(t) for t in targets} & {"aten.nonzero.default", "aten.where.default",
                                            "aten.index_add.default"}
    assert "forward" not in vars(model.model.layers[-1].mlp.experts)  # restored after capture
    materialize(graph.gm, model)
    out = graph.gm(x)
    out = out[graph.main_output_index] if isinstance(out, tuple) else out
    ref = model(x, use_cache=False).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    out.square().mean().backward()
    ref.square().mean().backward()
    got = dict(graph.gm.named_parameters())
    for fqn, p in model.named_parameters():
        torch.testing.assert_close(got[fqn].grad, p.grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{fqn}: {m}")


def test_unsupported_experts_layout_is_named():
    """An experts module with biases (a layout the op does not compute) fails at capture with
    its FQN, not later with a data-dependent shape."""
    model = _moe.factory("mixtral")()
    model.model.layers[1].mlp.experts.has_bias = True
    with pytest.raises(CaptureError, match=r"model\.layers\.1\.mlp\.experts.*has_bias"):
        capture(model, (torch.zeros(2, 8, dtype=torch.long),))


def test_reference_matches_hf_eager_experts():
    """The op's eager kernel is HF's own eager experts loop (Mixtral's, experts_implementation
    "eager") to rounding."""
    model = _moe.factory("mixtral")()
    experts_module = model.model.layers[0].mlp.experts
    model.config._experts_implementation = "eager"
    x, idx, w, _, _ = _op_inputs(num_tokens=5, hidden=32, num_experts=4, dtype=torch.float32)
    want = experts_module(x, idx, w)
    got = experts_reference(x, idx, w, experts_module.gate_up_proj, experts_module.down_proj,
                            "silu", 0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
