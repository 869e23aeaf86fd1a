"""Gathered inputs held for the backward as their shards, and all-gathered again there.

[Note: gathered inputs saved sharded]
Under sequence parallelism ([Note: sequence parallelism] in autoplan/solver/sequence.py) the
input of a column-parallel matmul is all-gathered from its sequence shards (S(s) -> R). Autograd
would keep the gathered (B, S, H) value for the matmul's weight gradient: tp times the bytes of
the shard every rank already has. Megatron-LM does not keep it: with `sequence_parallel` its
`LinearWithGradAccumulationAndAsyncCommunication` saves the shard and all-gathers it again in the
backward, issued before the input-gradient matmul and waited for by the weight-gradient one
(Korthikanti et al. 2022, section 4.2.2; Table 2 divides every activation term by t). autoplan
does the same for every all-gather of an activation (a `redistribute` from Shard to Replicate on
the tp axis), whatever op saves the gathered value (linear, mm, addmm, bmm, matmul: their aten
decompositions save the value or a flattening view of it):

1. `redistribute` (passes/sharding.py) tags its gathered output with a `Regather` that knows the
   shard and the target placements (an attribute on the output tensor: no global registry; the
   tag dies with the tensor).
2. `held_sharded()` is a `torch.autograd.graph.saved_tensors_hooks` pair, entered by the runtime
   around each tensor-parallel stage forward (runtime/parallel.py, `tp_stage_forward`): its pack
   hook replaces a saved tensor that is a tagged gathered value, or a contiguous view of one
   covering all of it (linear's (B S, H) flatten), by (its Regather, the view's shape); unpack
   all-gathers the shard again under no_grad and re-applies the view.
3. The backward all-gather is issued asynchronously (`redistribute(async_op=True)`): the matmul's
   backward computes its input gradient first (it needs only the weight) and waits for the
   gather when it computes the weight gradient -- Megatron's overlap. Consumers that share one
   gathered value (separate q, k, v projections) share one backward gather: the first unpack
   issues it and the last one releases it.

Every rank of the tp group runs the same graph, so the same saved tensors are unpacked in the
same order by autograd: the backward gathers are issued identically on every rank.

Composition: activation checkpointing (passes/checkpointing.py) runs torch's checkpoint, whose
own saved-tensor hooks are innermost inside a checkpointed region, so what a checkpointed block
or attention core saves is left to the checkpoint (recomputed, gather included) and these hooks
see only what is saved outside it. Inside torch.compile'd blocks nothing is tagged (the compiled
graph's partitioner decides what it saves; Known limit: the cost model prices the shard there
too).

The cost model prices what this does: the saved matmul operand belongs to the root of its view
chain (the gather's source when gathered; problem.py `_saved`), and the backward all-gather's
exposed time, max(0, all-gather - input-gradient matmul), is added to the backward of the
gathering edge (solver/costs.py, [Note: regather priced]).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from autoplan._torch_compat import view_base

__all__ = ["Regather", "tag_gathered", "held_sharded"]

_TAG = "_autoplan_regather"


class Regather:
    """The recipe for a gathered DTensor: its shard `source` and the target `placements`.
    `packs` counts the saved copies waiting for it; the value gathered in the backward is
    kept until the last of them is unpacked."""

    __slots__ = ("source", "placements", "packs", "unpacked", "value")

    def __init__(self, source: DTensor, placements: tuple):
        self.source, self.placements = source, placements
        self.packs = self.unpacked = 0
        self.value = None

    def get(self) -> DTensor:
        """The gathered value again (one asynchronous all-gather per round of unpacks)."""
        if self.value is None:
            with torch.no_grad():
                self.value = self.source.redistribute(self.source.device_mesh, self.placements,
                                                      async_op=True)
        value = self.value
        self.unpacked += 1
        if self.unpacked >= self.packs:  # the last saved copy: release it
            self.value, self.unpacked = None, 0
        return value


def tag_gathered(source, out) -> None:
    """Tag `out`, the all-gather of DTensor `source` (Shard -> Replicate on every mesh axis
    that moved), so that `held_sharded` saves `source` for it. Only tensors that need a
    gradient are tagged, never inside torch.compile."""
    if (isinstance(source, DTensor) and isinstance(out, DTensor) and out.requires_grad
            and not torch.compiler.is_compiling()
            and any(p.is_shard() for p in source.placements)
            and all(p.is_replicate() for p in out.placements)):
        setattr(out, _TAG, Regather(source, tuple(out.placements)))


class _Packed:
    __slots__ = ("regather", "shape")

    def __init__(self, regather: Regather, shape):
        self.regather, self.shape = regather, shape


def _tag_of(t) -> tuple[Regather, tuple | None] | None:
    if not isinstance(t, DTensor):
        return None
    tag = getattr(t, _TAG, None)
    if tag is not None:
        return tag, None
    base = view_base(t)
    tag = getattr(base, _TAG, None) if base is not None else None
    if (tag is not None and t.numel() == base.numel() and t.is_contiguous()
            and base.is_contiguous()):
        return tag, tuple(t.shape)
    return None


def _pack(t):
    found = _tag_of(t)
    if found is None:
        return t
    found[0].packs += 1
    return _Packed(*found)


def _unpack(packed):
    if not isinstance(packed, _Packed):
        return packed
    value = packed.regather.get()
    return value if packed.shape is None else value.view(packed.shape)


def held_sharded():
    """The saved-tensor hooks of [Note: gathered inputs saved sharded] (a context manager)."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
