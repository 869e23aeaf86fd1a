"""Jobs for tests/test_rng.py that run on every rank of a gloo cluster: the keyed random ops on
DTensors of a 1-D tp mesh, next to the plain full-batch result each rank computes itself."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from autoplan.passes.rng import RandomState, keyed_dropout, keyed_sdpa

__all__ = ["keyed_ops_on_tp_mesh"]


def _run(fn, tensors, weight, mesh=None, placement=None):
    """fn(*inputs) and d(sum(out * weight))/d inputs, all as full plain tensors."""
    if mesh is None:
        inputs = [t.clone().requires_grad_() for t in tensors]
    else:
        inputs = [distribute_tensor(t, mesh, [placement]).requires_grad_() for t in tensors]
    out = fn(*inputs)
    if mesh is not None:
        assert tuple(out.placements) == (placement,), (out.placements, placement)
        out = out.full_tensor()
    (out * weight).sum().backward()
    grads = [i.grad.full_tensor() if mesh is not None else i.grad for i in inputs]
    return out.detach(), grads


def keyed_ops_on_tp_mesh(seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(label, got, want) triples: outputs and input gradients of keyed_dropout (on (B, ...)
    and on flattened (B*T, C) rows) and keyed_sdpa on DTensors at each supported placement
    (`got`, gathered) and on plain tensors (`want`)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = RandomState(seed, step=5, sample_offset=6)
    g = torch.Generator().manual_seed(seed)
    out: list = []

    x = torch.randn(5, 6, 8, generator=g)  # 5 rows and 5 heads: uneven shards on 2 ranks
    w = torch.randn(5, 6, 8, generator=g)
    drop = lambda t: keyed_dropout(state, t, 0.3, True, 4)  # noqa: E731
    want, (want_grad,) = _run(drop, [x], w)
    for pl in (Shard(0), Shard(1), Shard(2), Replicate()):
        got, (grad,) = _run(drop, [x], w, mesh, pl)
        out += [(f"dropout {pl}", got, want), (f"dropout {pl} grad", grad, want_grad)]

    # a flattened (B*T, C) input, 3 rows per sample: 15 rows shard unevenly on 2 ranks
    flat, w = torch.randn(5 * 3, 8, generator=g), torch.randn(5 * 3, 8, generator=g)
    drop = lambda t: keyed_dropout(state, t, 0.3, True, 4, rows_per_sample=3)  # noqa: E731
    want, (want_grad,) = _run(drop, [flat], w)
    for pl in (Shard(0), Shard(1), Replicate()):
        got, (grad,) = _run(drop, [flat], w, mesh, pl)
        out += [(f"flat dropout {pl}", got, want), (f"flat dropout {pl} grad", grad, want_grad)]

    q, k, v = (torch.randn(4, 4, 6, 8, generator=g) for _ in range(3))
    w = torch.randn(4, 4, 6, 8, generator=g)
    mask = torch.rand(4, 1, 6, 6, generator=g) > 0.3
    mask |= torch.eye(6, dtype=torch.bool)  # no fully masked row
    cases = {"causal": dict(is_causal=True), "bool mask": dict(attn_mask=mask),
             "additive mask": dict(attn_mask=torch.randn(6, 6, generator=g))}
    for name, kwargs in cases.items():
        sdpa = lambda a, b, c: keyed_sdpa(  # noqa: E731
            state, a, b, c, kwargs.get("attn_mask"), 0.25, kwargs.get("is_causal", False), 2)
        want, want_grads = _run(sdpa, [q, k, v], w)
        for pl in (Shard(0), Shard(1), Replicate()):
            got, grads = _run(sdpa, [q, k, v], w, mesh, pl)
            out.append((f"sdpa {name} {pl}", got, want))
            out += [(f"sdpa {name} {pl} grad {i}", a, b)
                    for i, (a, b) in enumerate(zip(grads, want_grads))]
    return out
