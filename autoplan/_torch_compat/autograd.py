"""Autograd and dispatch-mode state (torch's private `_C` hooks): whether a backward or a
checkpoint's recomputation is running, and the causal attention bias made outside any active
dispatch mode.
"""

from __future__ import annotations

import torch

__all__ = ["in_backward", "in_recomputation", "causal_lower_right_bias"]


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread now (torch's private
    `_current_graph_task_id`)."""
    return torch._C._current_graph_task_id() != -1


def in_recomputation() -> bool:
    """Whether torch.utils.checkpoint is recomputing a checkpointed region on this thread now:
    its private `_recomputation_hook` is the innermost saved-tensors hook (torch 2.13's
    `_top_saved_tensors_default_hooks`)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return hooks is not None and \
        getattr(hooks[1], "__qualname__", "").startswith("_recomputation_hook.")


def causal_lower_right_bias(q_len: int, kv_len: int):
    """torch.nn.attention.bias.causal_lower_right(q_len, kv_len): the causal mask of q_len
    queries that are the last of kv_len positions, as an attention bias the fused kernels
    take without a materialised mask. Created outside any active TorchDispatchMode
    (`_disable_current_modes`, private in torch 2.13): it is a Tensor subclass over an empty
    tensor, which selective activation checkpointing's mode would otherwise record and then
    refuse to rewrap ("the raw Tensor object is already associated to a python object")."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return causal_lower_right(q_len, kv_len)
