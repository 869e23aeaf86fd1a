"""The routed-experts op: `torch.ops.autoplan.experts`, what a mixture-of-experts layer's expert
computation is captured as.

[Note: experts op] A Hugging Face MoE block (Mixtral, Qwen3-MoE, DeepSeek-V3) routes each token to
its top-k experts; which tokens reach which expert depends on the data, so tracing the experts'
loop gives data-dependent shapes (`nonzero`, `where`, per-expert slices). Capture instead calls
this op (autoplan/capture/hf_experts.py swaps the HF experts' forward for it), whose inputs and
output have static shapes:

    experts(hidden (T, H), top_k_index (T, k) int64, top_k_weights (T, k),
            gate_up_proj (E, 2I, H), down_proj (E, H, I), act, expert_offset) -> (T, H)

    out[t] = sum_j  w[t, j] * down[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t])),  e = idx[t, j]

with gate[e] = gate_up_proj[e, :I] and up[e] = gate_up_proj[e, I:] (HF's concatenated layout,
`use_experts_implementation(is_concatenated=True, is_transposed=False)`). The E experts held are
the global experts [expert_offset, expert_offset + E); a token's choice outside that range adds
nothing, so a rank that holds a slice of the experts (tensor or expert parallelism) computes its
partial sum of `out` with the same op. Both kernels are dropless (every routed token is
computed; no capacity factor): on CUDA tensors the op runs a Triton grouped GEMM, one launch for
all the held experts (kernels/grouped_gemm.py `grouped_experts`); elsewhere (the CPU ranks) the
eager math below, a loop over the held experts as HF's eager experts do (`experts_reference`).

Backward is a second op, `autoplan.experts_backward`: per expert, the forward's matmuls again
and the chain rule through them (aten's activation backward), giving the gradients of hidden,
top_k_weights, gate_up_proj and down_proj (the indices have none); on CUDA the grouped GEMM's
(`grouped_experts_backward`). The ops need no rewrite to reach it (passes/kernels.py, [Note:
kernel fusion]): the impl picks, as kernels/_dispatch.py `pick_triton` does with use_triton
None, and inside its `device_allocations` (a dry run) takes the Triton path's allocations.

FLOPs (torch.utils.flop_counter): 2 x T x k x (2I x H + H x I) forward -- three matmuls per
routed token -- counted as if every choice were held (the whole op's work; the planner divides
it by the ranks that split it, the busiest rank doing `TrainingSpec.routing_skew` times its
share: [Note: expert parallelism] in cost_model/expert_parallel.py); the backward op 3x that
(`BACKWARD_FLOPS_FACTOR`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.flop_counter as flop_counter

__all__ = ["ACTIVATIONS", "ACTIVATION_BACKWARD", "BACKWARD_FLOPS_FACTOR", "check_experts_args",
           "experts", "experts_reference", "experts_backward_reference", "EXPERTS_OP",
           "EXPERTS_BACKWARD_OP", "EXPERTS_TARGET"]

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
"""The gate activations the op knows, by HF `config.hidden_act` name."""


def experts_reference(hidden: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                      down_proj: torch.Tensor, act: str, expert_offset: int) -> torch.Tensor:
    """The op's math in plain differentiable torch ops (the eager kernel; see [Note: experts op]).

    Shapes: hidden (T, H); top_k_index, top_k_weights (T, k); gate_up_proj (E, 2I, H);
    down_proj (E, H, I). Returns (T, H) in hidden's dtype. The matmuls run in hidden's dtype:
    weights held in another (the fp32 slices of a 16-bit expert-parallel plan, which FSDP2's
    mixed precision does not cast: runtime/expert_parallel.py) are cast one expert at a time,
    as the 16-bit recipe computes with its cast copies. Raises KeyError for an unknown act.
    """
    fn = ACTIVATIONS[act]
    out = torch.zeros_like(hidden)
    num_local = gate_up_proj.shape[0]
    local = top_k_index - expert_offset                         # (T, k) held-expert ids
    for e in range(num_local):
        token_idx, k_pos = torch.where(local == e)              # data-dependent: eager only
        if token_idx.numel() == 0:
            continue
        x = hidden[token_idx]                                   # (n, H)
        w_gate_up, w_down = gate_up_proj[e].to(x.dtype), down_proj[e].to(x.dtype)
        gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)      # (n, I) each
        y = F.linear(fn(gate) * up, w_down)                     # (n, H)
        y = y * top_k_weights[token_idx, k_pos, None]
        out = out.index_add(0, token_idx, y.to(out.dtype))
    return out


@torch.library.custom_op("autoplan::experts", mutates_args=())
def experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: str,
            expert_offset: int) -> torch.Tensor:
    """Routed experts, see [Note: experts op]. hidden (T, H) -> (T, H): the grouped GEMM on
    CUDA, `experts_reference` elsewhere."""
    from kernels.grouped_gemm import grouped_experts  # imports triton: at the first call

    with torch.no_grad():
        return grouped_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj,
                               act, expert_offset)


@experts.register_fake
def _experts_fake(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act,
                  expert_offset):
    check_experts_args(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act)
    return torch.empty_like(hidden)


def check_experts_args(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj,
                       act) -> None:
    """The op's argument checks: raises ValueError for an unknown act or shapes that are not
    hidden (T, H), top_k_index and top_k_weights (T, k), gate_up_proj (E, 2I, H), down_proj
    (E, H, I)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"autoplan.experts: activation {act!r} is not one of "
                         f"{', '.join(ACTIVATIONS)}")
    num_tokens, hidden_dim = hidden.shape
    ok = (top_k_index.shape == top_k_weights.shape and top_k_index.shape[0] == num_tokens
          and gate_up_proj.dim() == 3 and down_proj.dim() == 3
          and gate_up_proj.shape[0] == down_proj.shape[0]
          and gate_up_proj.shape[2] == hidden_dim and down_proj.shape[1] == hidden_dim
          and gate_up_proj.shape[1] == 2 * down_proj.shape[2])
    if not ok:
        raise ValueError(
            "autoplan.experts: expected hidden (T, H), top_k_index and top_k_weights (T, k), "
            "gate_up_proj (E, 2I, H), down_proj (E, H, I); got "
            f"{tuple(hidden.shape)}, {tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}, "
            f"{tuple(gate_up_proj.shape)}, {tuple(down_proj.shape)}")


ACTIVATION_BACKWARD = {
    "silu": lambda g, a: torch.ops.aten.silu_backward(g, a),
    "swish": lambda g, a: torch.ops.aten.silu_backward(g, a),
    "gelu": lambda g, a: torch.ops.aten.gelu_backward(g, a),
    "gelu_pytorch_tanh": lambda g, a: torch.ops.aten.gelu_backward(g, a, approximate="tanh"),
    "relu": lambda g, a: torch.ops.aten.threshold_backward(g, F.relu(a), 0),
}
"""d act(a) given the gradient g of act(a), by act name: aten's own backward of each of
ACTIVATIONS, (g, a) -> a's shape and dtype."""


def experts_backward_reference(grad, hidden, top_k_index, top_k_weights, gate_up_proj,
                               down_proj, act, expert_offset):
    """Gradients of (hidden, top_k_weights, gate_up_proj, down_proj) given the output's `grad`
    (T, H), written out per expert (the chain rule through the forward's three matmuls, with
    aten's own activation backward); the indices have none. Computed in hidden's dtype as the
    forward is (`experts_reference`), each gradient returned in its input's dtype."""
    fn, fn_backward = ACTIVATIONS[act], ACTIVATION_BACKWARD[act]
    d_hidden = torch.zeros_like(hidden)
    d_weights = torch.zeros_like(top_k_weights)
    d_gate_up = torch.zeros_like(gate_up_proj)
    d_down = torch.zeros_like(down_proj)
    inter = down_proj.shape[2]
    local = top_k_index - expert_offset
    for e in range(gate_up_proj.shape[0]):
        token_idx, k_pos = torch.where(local == e)
        if token_idx.numel() == 0:
            continue
        x = hidden[token_idx]                                    # (n, H)
        w_gate = gate_up_proj[e, :inter].to(x.dtype)
        w_up, w_down = gate_up_proj[e, inter:].to(x.dtype), down_proj[e].to(x.dtype)
        a, b = F.linear(x, w_gate), F.linear(x, w_up)            # (n, I) each
        h = fn(a) * b                                            # (n, I)
        y = F.linear(h, w_down)                                  # (n, H)
        # as autograd runs the forward's y * weight: in the promoted dtype (fp32 routing
        # weights of a 16-bit model), dy back in y's
        g = grad[token_idx].to(torch.promote_types(y.dtype, top_k_weights.dtype))  # (n, H)
        d_weights[token_idx, k_pos] = (g * y).sum(-1).to(d_weights.dtype)
        dy = (g * top_k_weights[token_idx, k_pos, None]).to(y.dtype)  # (n, H)
        d_down[e] = dy.t() @ h                                   # (H, I)
        dh = dy @ w_down                                         # (n, I)
        da, db = fn_backward(dh * b, a), dh * fn(a)              # (n, I) each
        d_gate_up[e, :inter] = da.t() @ x
        d_gate_up[e, inter:] = db.t() @ x
        d_hidden.index_add_(0, token_idx, da @ w_gate + db @ w_up)
    return d_hidden, d_weights, d_gate_up, d_down


@torch.library.custom_op("autoplan::experts_backward", mutates_args=())
def experts_backward(grad: torch.Tensor, hidden: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                     down_proj: torch.Tensor, act: str, expert_offset: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`experts_backward_reference` (the grouped GEMM's backward on CUDA) as an op of its own,
    so that autograd and tracers never look into the data-dependent loop."""
    from kernels.grouped_gemm import grouped_experts_backward  # imports triton: at the first call

    return grouped_experts_backward(grad, hidden, top_k_index, top_k_weights, gate_up_proj,
                                    down_proj, act, expert_offset)


@experts_backward.register_fake
def _experts_backward_fake(grad, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj,
                           act, expert_offset):
    return (torch.empty_like(hidden), torch.empty_like(top_k_weights),
            torch.empty_like(gate_up_proj), torch.empty_like(down_proj))


def _setup_context(ctx, inputs, output) -> None:
    hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act, offset = inputs
    ctx.save_for_backward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    ctx.act, ctx.offset = act, offset


def _backward(ctx, grad):
    hidden, top_k_index, top_k_weights, gate_up_proj, down_proj = ctx.saved_tensors
    d_hidden, d_weights, d_gate_up, d_down = experts_backward(
        grad.contiguous(), hidden, top_k_index, top_k_weights, gate_up_proj, down_proj,
        ctx.act, ctx.offset)
    return d_hidden, None, d_weights, d_gate_up, d_down, None, None


experts.register_autograd(_backward, setup_context=_setup_context)

EXPERTS_OP = torch.ops.autoplan.experts.default
EXPERTS_BACKWARD_OP = torch.ops.autoplan.experts_backward.default
EXPERTS_TARGET = str(EXPERTS_OP)
"""The op as a captured node's `NodeInfo.target` spells it ("autoplan.experts.default")."""


BACKWARD_FLOPS_FACTOR = 3
"""The experts backward's FLOPs over the forward's: `experts_backward_reference` runs the
forward's three matmuls again (the op saves only its inputs, not the (T k, 2I) intermediates)
and the two gradient matmuls of each (input and weight) -- 1 + 2 forwards, whatever the
operands' `requires_grad` (every gradient is computed). Where the cost model prices the
experts' backward (cost_model/compute.py backward_time_s, solver/assemble.py [Note: FLOPs per
rank]) and what the flop counter counts for it (`_experts_backward_flops`)."""


@flop_counter.register_flop_formula(torch.ops.autoplan.experts)
def _experts_flops(hidden_shape, index_shape, weights_shape, gate_up_shape, down_shape, *args,
                   out_shape=None, **kwargs) -> int:
    """2 x T x k x (2I x H + H x I): the three matmuls of every routed token (dropless)."""
    num_tokens, top_k = index_shape
    _, two_i, hidden_dim = gate_up_shape
    return 2 * num_tokens * top_k * (two_i * hidden_dim + hidden_dim * (two_i // 2))


@flop_counter.register_flop_formula(torch.ops.autoplan.experts_backward)
def _experts_backward_flops(grad_shape, hidden_shape, index_shape, weights_shape, gate_up_shape,
                            down_shape, *args, out_shape=None, **kwargs) -> int:
    """Twice the forward's matmuls (input and weight gradients) plus the recomputed forward."""
    return BACKWARD_FLOPS_FACTOR * _experts_flops(hidden_shape, index_shape, weights_shape,
                                                  gate_up_shape, down_shape)
