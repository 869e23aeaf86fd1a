"""CPU offload of optimizer states at ZeRO 0 and 1 (ZeRO-Offload, Ren et al. 2021): the
optimizer states and an fp32 copy of each stepped parameter live in host memory, and the
optimizer steps there. ZeRO-3's offload is FSDP2's `CPUOffloadPolicy` (runtime/parallel.py,
`fully_shard`); the cost model of both is [Note: offload] in autoplan/cost_model/offload.py.

One step of `HostOptimizer`, in this order (nothing overlaps, as the cost model assumes):
1. every stepped parameter's gradient is copied device -> host into its host copy's `.grad`;
2. the user's optimizer (built by its factory over the host copies) steps on the host;
3. every updated host copy is copied host -> device into the parameter's local tensor.
The host copies start equal to the parameters and only the step changes either, so the
update is exactly the one the optimizer makes on the device (same dtype, same order).

On CPU ranks the "host" is the same memory as the "device": the copies are memcpys, and
what a test can check is the mechanics and the accounting (`bytes_to_host`,
`bytes_to_device`, `host_bytes`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["HostOptimizer"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class HostOptimizer:
    """The optimizer of `stepped` parameters on the host; see the module docstring.

    Args:
        named_params: every (FQN, parameter) of the rank, as the optimizer factory would get
            them on one process (groups built by name come out alike).
        make_optimizer: `named_params -> torch.optim.Optimizer`; it receives the host copies
            in place of the stepped parameters, and the parameters not stepped here are
            dropped from its groups afterwards (ZeRO-1: those another rank owns).
        stepped: ids of the parameters this rank steps (None: all).
        host: the host device (CPU).

    Attributes:
        inner: the torch optimizer over the host copies (what an LR scheduler drives).
        bytes_to_host, bytes_to_device: bytes copied so far, gradients down and parameters up.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], make_optimizer: Callable,
                 stepped: set[int] | None = None, host: torch.device = torch.device("cpu")):
        named_params = list(named_params)
        self.params = [p for _, p in named_params]
        self.host = host
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        given = []
        for fqn, p in named_params:
            if stepped is None or id(p) in stepped:
                # a copy even when host and device are one memory (CPU ranks)
                h = nn.Parameter(_local(p).detach().to(host, copy=True))
                self.pairs.append((p, h))
                given.append((fqn, h))
            else:
                given.append((fqn, p))
        self.inner = make_optimizer(given)
        mine = {id(h) for _, h in self.pairs}
        for group in self.inner.param_groups:
            keep = [i for i, p in enumerate(group["params"]) if id(p) in mine]
            group["params"] = [group["params"][i] for i in keep]
            if "param_names" in group:
                group["param_names"] = [group["param_names"][i] for i in keep]
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grads(self.params, set_to_none)
        for _, h in self.pairs:
            h.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Gradients down, the step on the host, parameters up (module docstring)."""
        for p, h in self.pairs:
            if p.grad is None:
                h.grad = None
                continue
            g = _local(p.grad)
            h.grad = g.detach().to(self.host, copy=True)
            self.bytes_to_host += g.numel() * g.element_size()
        self.inner.step()
        for p, h in self.pairs:
            if h.grad is None:
                continue
            t = _local(p)
            t.copy_(h)
            self.bytes_to_device += t.numel() * t.element_size()
            h.grad = None  # the host gradient lives only during the step

    def host_bytes(self) -> int:
        """Host bytes held for the step: the parameter copies, their gradients (the size of
        the copies: they exist during the step) and every optimizer state tensor."""
        copies = sum(h.numel() * h.element_size() for _, h in self.pairs)
        states = sum(v.numel() * v.element_size() for s in self.inner.state.values()
                     for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
        return 2 * copies + states

    def state_dict(self) -> dict:
        return self.inner.state_dict()


def zero_grads(params, set_to_none: bool = True) -> None:
    """Optimizer.zero_grad for `params`: gradients dropped (set_to_none) or zeroed in place."""
    for p in params:
        if set_to_none:
            p.grad = None
        elif p.grad is not None:
            p.grad.zero_()
