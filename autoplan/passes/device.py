"""Retarget a captured graph to a real device and give it real weights.

Capture runs on meta tensors, so factory ops (`arange`, `new_ones`, `to(device=...)`) carry a
device constant in their arguments; `retarget_device` rewrites every such constant, and
`materialize` binds real parameters and buffers at their FQNs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx
from torch import nn

__all__ = ["materialize", "retarget_device"]


def retarget_device(gm: torch.fx.GraphModule, device: str | torch.device) -> torch.fx.GraphModule:
    """Replace every torch.device constant in the graph's args/kwargs with `device`
    (in place; recompiles). `node.meta["val"]` is left as captured."""
    device = torch.device(device)

    def swap(x: object) -> object:
        return device if isinstance(x, torch.device) else x

    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.args = torch.fx.node.map_aggregate(node.args, swap)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
    gm.recompile()
    return gm


def _lifted(fqn: str) -> bool:
    """A constant torch.export lifted out of the model's code (`lifted_tensor_k` under any
    module), as opposed to a parameter or buffer of the model."""
    return fqn.rpartition(".")[2].startswith("lifted_tensor")


def materialize(gm: torch.fx.GraphModule, source: nn.Module | Mapping[str, torch.Tensor],
                device: str | torch.device = "cpu") -> torch.fx.GraphModule:
    """Give a captured gm real weights: copy each parameter/buffer from `source` onto `device`
    (cast to the captured dtype), then retarget the graph's device constants. In place.

    Args:
        source: a module with the same FQNs (its parameters and all buffers, non-persistent ones
            such as Llama's `rotary_emb.inv_freq` included) or a state dict (which lacks
            non-persistent buffers unless the caller adds them).

    Raises:
        ValueError: FQNs missing from `source` (listed) or shapes that differ.
    """
    if isinstance(source, nn.Module):
        tensors = dict(source.named_parameters(remove_duplicate=False))
        tensors.update(source.named_buffers(remove_duplicate=False))
    else:
        tensors = dict(source)
    targets = [(n, t, True) for n, t in gm.named_parameters()]
    targets += [(n, t, False) for n, t in gm.named_buffers()]
    # Constants that torch.export lifted out of the code (e.g. the index list of
    # `t[..., [-2], :]`) are the graph's own: they keep their captured value, at the top of
    # the graph or inside a block (Falcon: `transformer.h.0.self_attention.lifted_tensor_0`).
    targets = [(n, t, p) for n, t, p in targets
               if n in tensors or not (_lifted(n) and not t.is_meta)]
    own = [(n, t) for n, t in gm.named_buffers() if n not in tensors and _lifted(n)
           and not t.is_meta]
    for fqn, t in own:
        owner_name, _, leaf = fqn.rpartition(".")
        gm.get_submodule(owner_name).register_buffer(leaf, t.to(device))
    missing = [n for n, _, _ in targets if n not in tensors]
    if missing:
        raise ValueError(f"materialize: {len(missing)} FQNs missing from the source: {missing[:8]}"
                         " (pass the module itself to include non-persistent buffers)")
    for fqn, old, is_param in targets:
        src = tensors[fqn]
        if tuple(src.shape) != tuple(old.shape):
            raise ValueError(f"materialize: {fqn} has shape {tuple(src.shape)} in the source, "
                             f"{tuple(old.shape)} in the graph")
        new = src.detach().to(device=device, dtype=old.dtype, copy=True)
        owner_name, _, leaf = fqn.rpartition(".")
        owner = gm.get_submodule(owner_name)
        if is_param:
            setattr(owner, leaf, nn.Parameter(new, requires_grad=old.requires_grad))
        else:
            owner.register_buffer(leaf, new,
                                  persistent=leaf not in owner._non_persistent_buffers_set)
    return retarget_device(gm, device)


