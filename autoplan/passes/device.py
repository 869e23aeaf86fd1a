"""Retarget a captured graph from the meta device to a real one.

Capture runs on meta tensors, so factory ops (`arange`, `new_ones`, `to(device=...)`) carry
`device=meta` in their arguments; this pass rewrites every such device to the target device.
"""

from __future__ import annotations

import torch
import torch.fx

__all__ = ["retarget_device"]


def _swap(value, device: torch.device):
    if isinstance(value, torch.device) and value.type == "meta":
        return device
    if isinstance(value, (list, tuple)):
        return type(value)(_swap(v, device) for v in value)
    return value


def retarget_device(gm: torch.fx.GraphModule, device: torch.device | str) -> torch.fx.GraphModule:
    """Rewrite meta-device arguments of every node of `gm` (in place) to `device`; returns gm.

    Also drops `aten._assert_tensor_metadata` nodes, which assert the capture device.
    """
    device = torch.device(device)
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
            continue
        node.args = _swap(node.args, device)
        node.kwargs = {k: _swap(v, device) for k, v in node.kwargs.items()}
    gm.recompile()
    return gm
