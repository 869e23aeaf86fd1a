"""The runtime's default optimizer: AdamW whose update is the fused kernel (`kernels.adamw`).

[Note: fused AdamW]
Without an `optimizer=` of the user's, the engine steps with `FusedAdamW` where the kernel pass is
on (`kernels=True`, the default) and the parameters it steps are float32 (`default_adamw`; the
fp32 masters of every mixed-precision recipe): per parameter, one `kernels.adamw_step` on the
rank's local shard -- ZeRO-1's rows of each parameter (`ShardedOptimizer`, runtime/zero1.py),
the local tensors of FSDP2's and tensor parallelism's DTensor parameters, plain tensors otherwise. On CUDA that is one
Triton kernel reading param, grad and both moments once and writing param and moments once (the
unfused update makes about ten passes); elsewhere the kernel's torch reference, which is the body
of torch.optim.AdamW's single-tensor path op for op, so a CPU run computes what torch's AdamW
computes (tests/test_fused_adamw.py: equal to one process with torch.optim.AdamW).

The state is torch.optim.AdamW's: per parameter "step" (a float32 scalar tensor), "exp_avg" and
"exp_avg_sq" (like the parameter: DTensors for DTensor parameters), so checkpoints (DCP, the
optimizer's state_dict) are interchangeable with torch's AdamW, and the param groups carry the
same hyperparameters (lr is read at every step: LR schedulers work unchanged).

The cost model prices the update as one fused pass on devices whose kernels fuse
(`DeviceSpec.fuses_pointwise`: the GPU presets), as the unfused ten passes otherwise
(cost_model/step_time.py, OPTIMIZER_BYTES_PER_PARAM).
"""

from __future__ import annotations

import torch

from autoplan._torch_compat import concrete_value

__all__ = ["FusedAdamW", "default_adamw", "whole_tensor_reason"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own elements of `t` (a DTensor's local shard, else `t`)."""
    return t.to_local() if hasattr(t, "to_local") else t


def default_adamw(params, *, fused: bool, lr: float = 1e-3) -> torch.optim.Optimizer:
    """The engine's default optimizer, AdamW(lr): `FusedAdamW` when `fused` (the kernels are
    on) and every parameter is float32 (the kernel's dtype), else torch.optim.AdamW.
    `params`: tensors or (name, tensor) pairs, as torch optimizers take them."""
    params = list(params)
    tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    if fused and all(t.dtype == torch.float32 for t in tensors):
        return FusedAdamW(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr)


# [Note: elementwise optimizer]
# ZeRO-1 (runtime/zero1.py) hands the optimizer a rank's rows of each parameter, and the host
# offload at ZeRO 0/1 (runtime/offload.py) a tp rank's local shard, as plain tensors. The update
# is then the one on whole tensors only when the optimizer is elementwise (AdamW, Adam, SGD,
# Adagrad, RMSprop, ...). One that reads a whole tensor -- a per-tensor norm (LAMB, LARS), the
# factored moments of Adafactor, Muon's orthogonalised matrix -- or a whole group (a norm over
# all its parameters) would compute a different update on the pieces, with no error. FSDP2's
# ZeRO-2/3 and tensor parallelism without offload hand it DTensors, whose norms and means are
# the whole tensor's, so they do not depend on this.
#
# `whole_tensor_reason` tells the two apart by running the user's optimizer factory: each
# parameter's name with a probe of its ndim (4 rows of 3), stepped twice with fixed random
# gradients whole and, in a second and third optimizer, as its top and bottom halves. An
# elementwise update gives the same numbers on the halves (up to the rounding of vectorised
# tails, PROBE_RTOL); LAMB's trust ratio, Adafactor's column means and Muon's Newton-Schulz
# iteration differ by far more. The planner leaves out what hands such an optimizer pieces
# (search.Overrides.elementwise_optimizer), and the engine refuses such a plan at build.
PROBE_ROWS, PROBE_COLS, PROBE_RTOL = 4, 3, 1e-5


def whole_tensor_reason(make_optimizer, named_params) -> str | None:
    """None when the optimizer `make_optimizer` builds steps each element of a parameter on
    its own ([Note: elementwise optimizer]); else why not, naming the optimizer and the first
    parameter whose update differed (or the error the probe raised).

    Args:
        make_optimizer: `[(fqn, nn.Parameter)] -> torch.optim.Optimizer`, the `optimizer=` a
            user gives `@autoparallel`.
        named_params: the model's (fqn, parameter) pairs: their names and ndims are probed
            (meta parameters do); frozen ones are left out as the engine leaves them out.
    """
    import torch.nn as nn

    from autoplan._torch_compat import outside_fake_mode

    named = [(n, p) for n, p in named_params if p.requires_grad and p.dim() > 0]
    if not named:
        return None
    with outside_fake_mode():  # a dry run's engine: the probe is real numbers
        return _probe(make_optimizer, named)


def _probe(make_optimizer, named) -> str | None:
    import torch.nn as nn

    gen = torch.Generator().manual_seed(0)

    def shape(p):
        return (PROBE_ROWS,) + (PROBE_COLS,) * (p.dim() - 1)

    start = {n: torch.randn(shape(p), generator=gen) for n, p in named}
    grads = [{n: torch.randn(shape(p), generator=gen) for n, p in named} for _ in range(2)]
    half = PROBE_ROWS // 2
    pieces = {"whole": (0, PROBE_ROWS), "top": (0, half), "bottom": (half, PROBE_ROWS)}
    after, name = {}, None
    try:
        for key, (a, b) in pieces.items():
            params = {n: nn.Parameter(t[a:b].clone()) for n, t in start.items()}
            opt = make_optimizer(list(params.items()))
            name = type(opt).__name__
            for g in grads:
                for n, prm in params.items():
                    prm.grad = g[n][a:b].clone()
                opt.step()
            after[key] = {n: prm.detach() for n, prm in params.items()}
    except Exception as e:  # noqa: BLE001 -- any failure means it cannot be vouched for
        return (f"the optimizer could not be probed on pieces of its parameters "
                f"({type(e).__name__}: {e})")
    for n, _ in named:
        whole = after["whole"][n] - start[n]
        split = torch.cat([after["top"][n], after["bottom"][n]]) - start[n]
        scale = whole.abs().max().item()
        err = (whole - split).abs().max().item()
        if err > PROBE_RTOL * scale + 1e-12:
            return (f"{name}'s update of {n!r} stepped as two halves of its rows differs from "
                    f"its update of the whole tensor (by {err / max(scale, 1e-30):.2g} of "
                    f"the update): it reads whole tensors (a per-tensor norm, factored "
                    f"moments or an orthogonalised matrix), so it must not be handed pieces")
    return None


_TORCH_ADAMW_FLAGS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False,
                          differentiable=False, fused=None, decoupled_weight_decay=True)


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter 2019, Algorithm 2; torch.optim.AdamW's defaults) stepping
    each parameter's local shard with `kernels.adamw_step` ([Note: fused AdamW]).

    Args: as torch.optim.AdamW: params (tensors or groups), lr, betas, eps, weight_decay.
    Raises ValueError for a hyperparameter torch.optim.AdamW would refuse; at `step`, for a
    param group asking for amsgrad, maximize, capturable, differentiable or coupled weight
    decay (a state_dict of torch's AdamW with them loaded), for a parameter or gradient that is
    not float32 (the kernel's dtype: under mixed precision the
    optimizer steps the float32 master weights) or a sparse gradient.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"FusedAdamW: invalid learning rate {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"FusedAdamW: invalid epsilon {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"FusedAdamW: invalid betas {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"FusedAdamW: invalid weight_decay {weight_decay}")
        # torch.optim.AdamW's group keys, the variants the kernel does not implement off: a
        # state_dict of either loads into the other (torch's Adam reads a missing
        # decoupled_weight_decay as False, an L2 penalty)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, **_TORCH_ADAMW_FLAGS))

    @torch.no_grad()
    def step(self, closure=None):
        from kernels.adamw import adamw_step

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            off = [k for k in ("amsgrad", "maximize", "capturable", "differentiable")
                   if group.get(k)] + ([] if group.get("decoupled_weight_decay", True)
                                       else ["decoupled_weight_decay=False"])
            if off:
                raise ValueError(f"FusedAdamW: a param group asks for {', '.join(off)}, which "
                                 "the fused update does not implement (torch.optim.AdamW does)")
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("FusedAdamW: sparse gradients are not supported")
                if p.dtype != torch.float32 or p.grad.dtype != torch.float32:
                    raise ValueError(f"FusedAdamW: parameter of {p.dtype} with a {p.grad.dtype}"
                                     " gradient; the fused update takes float32 (master) weights")
                state = self.state[p]
                if not state:  # torch.optim.AdamW's state layout
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format)
                state["step"] += 1
                tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                flat = [t.contiguous().view(-1) for t in tensors]  # a copy only if strided
                # a dry run's fake step count has no value: its one step is the first
                count = int(concrete_value(state["step"], 1))
                adamw_step(*flat, step=count, lr=group["lr"],
                           betas=group["betas"], eps=group["eps"],
                           weight_decay=group["weight_decay"])
                for t, f in zip(tensors, flat):  # non-contiguous shards were updated in copies
                    if not t.is_contiguous() and t is not tensors[1]:
                        t.copy_(f.view(t.shape))
        return loss
