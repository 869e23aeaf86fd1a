"""Capture of mixture-of-experts layers: HF experts modules run as `autoplan.experts`.

During `torch.export` every Hugging Face experts module (a class decorated with transformers'
`use_experts_implementation`: MixtralExperts, Qwen3MoeExperts, DeepseekV3Experts, ...) has its
forward replaced, on the instance and only while capture runs, by one call of the static-shape
op of [Note: experts op] (autoplan/experts.py). The router (a linear, softmax/sigmoid, top-k)
traces as ordinary aten ops with static shapes; the token dispatch -- which tokens each expert
computes -- happens inside the op, so nothing data-dependent reaches the graph. The captured
node reads the experts' parameters `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I) through
get_attr at their FQNs, like any weight.

Layouts the op does not compute (transposed or interleaved gate/up, biases, no gate, a post-
expert norm, a custom `_apply_gate`, an activation outside `ACTIVATIONS`) raise CaptureError
naming the module; so does an experts module that is not of this kind but holds the same
weights, rather than being traced into a graph with data-dependent shapes.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
from torch import nn

from autoplan.capture.errors import CaptureError
from autoplan.experts import ACTIVATIONS, experts

__all__ = ["experts_modules", "experts_as_op"]

# What `use_experts_implementation` sets on an instance, and the values the op computes.
_LAYOUT = {"has_gate": True, "has_bias": False, "has_post_expert_norm": False,
           "is_transposed": False, "is_concatenated": True}


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The HF experts modules of `model` by FQN: modules with 3-D `gate_up_proj` and
    `down_proj` parameters (stacked per expert)."""
    out = {}
    for name, module in model.named_modules():
        params = module._parameters
        if all(isinstance(params.get(p), torch.Tensor) and params[p].dim() == 3
               for p in ("gate_up_proj", "down_proj")):
            out[name] = module
    return out


def _activation(name: str, module: nn.Module) -> str:
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_act", None)
    if act not in ACTIVATIONS:
        raise CaptureError(f"experts module {name} ({type(module).__name__}): activation "
                           f"{act!r} is not one the autoplan.experts op computes "
                           f"({', '.join(ACTIVATIONS)})")
    return act


def _check_layout(name: str, module: nn.Module) -> None:
    if not hasattr(module, "is_concatenated"):
        raise CaptureError(
            f"experts module {name} ({type(module).__name__}) holds stacked expert weights but "
            "is not a transformers `use_experts_implementation` class; its routing loop has "
            "data-dependent shapes that autoplan cannot capture")
    wrong = {k: getattr(module, k) for k, v in _LAYOUT.items() if getattr(module, k) != v}
    from transformers.integrations.moe import _default_apply_gate

    if type(module)._apply_gate is not _default_apply_gate:
        wrong["_apply_gate"] = type(module)._apply_gate.__qualname__
    if wrong:
        raise CaptureError(f"experts module {name} ({type(module).__name__}): the "
                           f"autoplan.experts op computes {_LAYOUT} with the default gate; "
                           f"this module has {wrong}")


def _op_forward(act: str):
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj,
                       self.down_proj, act, 0)
    return forward


@contextlib.contextmanager
def experts_as_op(model: nn.Module) -> Iterator[dict[str, nn.Module]]:
    """While inside, every experts module of `model` runs `autoplan.experts` (see the module
    docstring); yields the modules by FQN. The instances' own forward is restored on exit.

    Raises CaptureError for an experts module whose layout the op does not compute."""
    found = experts_modules(model)
    for name, module in found.items():
        _check_layout(name, module)
    acts = {name: _activation(name, module) for name, module in found.items()}
    saved = {name: module.__dict__.get("forward") for name, module in found.items()}
    try:
        for name, module in found.items():
            module.forward = types.MethodType(_op_forward(acts[name]), module)
        yield found
    finally:
        for name, module in found.items():
            if saved[name] is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = saved[name]
