"""The op sequence of a dry-run rank's step ([Note: whole-step export] in
autoplan/runtime/step_export.py): every local aten op and collective, in issue order, with
its local shapes, dtypes and moment, kept compactly.

A step of a large plan issues hundreds of thousands of ops, most of them repeats (each
microbatch runs the same ops on the same shapes): the log keeps three small integers per op
(its moment, its signature, its collective) in arrays and each distinct moment and signature
once, so that a million ops take about 12 MB; past `max_ops` it counts the ops and lists no
more (`OpLog.num_dropped`)."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["MAX_OPS", "OpLog", "StepOp", "tensor_text"]

# ops listed per rank before the log only counts them
MAX_OPS = 2_000_000


@dataclass(frozen=True)
class StepOp:
    """One op a rank issued in its measured step, in issue order.

    Attributes:
        index: its position in the step, from 0.
        moment: when (`DryRunRecorder.moment`: "forward of microbatch 1 of 4", "optimizer
            step", ...), with " (recomputation)" for an op of activation checkpointing's
            recomputation in the backward.
        op: the op (`aten.mm.default`, `c10d._reduce_scatter_base_.default`).
        inputs, outputs: its tensor arguments and results, local (this rank's shards), each
            as `tensor_text` writes it (`bfloat16[4, 16, 32]`).
        collective: for a collective or p2p op, its index in `RankDryRun.collectives`
            (axis, dtype, bytes); None for the other ops.
    """

    index: int
    moment: str
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    collective: int | None


def tensor_text(t: torch.Tensor) -> str:
    """`bfloat16[4, 16, 32]`: a tensor's dtype and local shape."""
    return f"{str(t.dtype).removeprefix('torch.')}[{', '.join(str(s) for s in t.shape)}]"


class OpLog:
    """The ops of one rank's step, appended by the dry run's recorder (`add`) and read back
    as `StepOp`s (iteration). `max_ops`: ops listed; later ones are only counted."""

    def __init__(self, max_ops: int = MAX_OPS):
        if max_ops < 0:
            raise ValueError(f"OpLog: max_ops={max_ops}; give a count >= 0")
        self.max_ops = max_ops
        self.num_ops = 0  # every op added, listed or not
        self._moment, self._signature, self._collective = array("i"), array("i"), array("i")
        self._moments: dict[str, int] = {}
        self._signatures: dict[tuple, int] = {}
        self._texts: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = []
        self.marks: list[tuple[int, str]] = []  # (index of the next op, pipeline action)

    def add(self, moment: str, func, args, kwargs, out, collective: int | None) -> None:
        """Append op `func` called with (`args`, `kwargs`) that gave `out`, at `moment`;
        `collective`: its index among the step's collectives, or None."""
        self.num_ops += 1
        if len(self._moment) >= self.max_ops:
            return
        ins = _tensors((args, kwargs))
        outs = _tensors(out)
        key = (func, tuple((t.dtype, tuple(t.shape)) for t in ins),
               tuple((t.dtype, tuple(t.shape)) for t in outs))
        sid = self._signatures.get(key)
        if sid is None:
            sid = self._signatures[key] = len(self._texts)
            name = f"{getattr(func, 'namespace', 'aten')}.{func.overloadpacket.__name__}." \
                   f"{func._overloadname}"
            self._texts.append((name, tuple(tensor_text(t) for t in ins),
                                tuple(tensor_text(t) for t in outs)))
        self._moment.append(self._moments.setdefault(moment, len(self._moments)))
        self._signature.append(sid)
        self._collective.append(-1 if collective is None else collective)

    def mark(self, action: str) -> None:
        """The pipeline action `action` ("0F1") starts with the next op (`marks`)."""
        if len(self._moment) < self.max_ops:
            self.marks.append((len(self._moment), action))

    def clear(self) -> None:
        """Forget the ops and marks added so far (the signatures stay: the next step repeats
        them)."""
        self.num_ops = 0
        del self._moment[:], self._signature[:], self._collective[:], self.marks[:]

    @property
    def num_dropped(self) -> int:
        """Ops added beyond `max_ops`: counted, not listed."""
        return self.num_ops - len(self)

    def __len__(self) -> int:
        return len(self._moment)

    def __iter__(self) -> Iterator[StepOp]:
        moments = list(self._moments)
        for i, (m, s, c) in enumerate(zip(self._moment, self._signature, self._collective)):
            name, ins, outs = self._texts[s]
            yield StepOp(i, moments[m], name, ins, outs, None if c < 0 else c)


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
