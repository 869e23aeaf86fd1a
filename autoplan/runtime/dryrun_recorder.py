"""The recorder of a dry run ([Note: dry run] in autoplan/runtime/dryrun.py): a
TorchDispatchMode that sees every local aten op of one rank under its FakeTensorMode and
records live fake storage bytes with their allocation site and moment, the collectives and
the FLOPs; with `record_ops`, the op sequence of the step too ([Note: whole-step export] in
autoplan/runtime/step_export.py). `follow_moments` and `optimizer_phases` tell it where the
rank's step is."""

from __future__ import annotations

import bisect
import contextlib
import weakref
from collections import defaultdict
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from autoplan import _torch_compat as tc
from autoplan.runtime.collective_log import COLLECTIVE_NAMESPACES as _COLLECTIVE_NAMESPACES
from autoplan.runtime.collective_log import Call, collective_call
from autoplan.runtime.live_bytes import patch_resize
from autoplan.runtime.step_ops import OpLog

__all__ = ["CATEGORIES", "DryRunRecorder", "follow_moments", "optimizer_phases"]

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries", "comm_buffers")

# a pipeline stage's methods that run (or post) one of torch's schedule actions, and the
# action's name in torch's IR (`_ComputationType`)
_STAGE_ACTIONS = {"forward_one_chunk": "F", "backward_one_chunk": "B",
                  "backward_weight_one_chunk": "W", "get_fwd_recv_ops": "RECV_F",
                  "get_fwd_send_ops": "SEND_F", "get_bwd_recv_ops": "RECV_B",
                  "get_bwd_send_ops": "SEND_B", "perform_reduce_grad": "REDUCE_GRAD"}


class _OpKind(NamedTuple):
    """What the recorder does with one op overload, worked out at its first call."""
    ignored: bool  # not a rank's op: a metadata query or a profiler marker
    view: bool  # its output is a view of its input
    formula: object  # torch.utils.flop_counter's FLOP formula, or None
    collective: bool  # in a namespace of collectives: `collective_call` decides


class DryRunRecorder(TorchDispatchMode):
    """Records, for the local ops of one rank under a FakeTensorMode (`fake_mode`): live fake
    storage bytes with their allocation site, the collectives and the FLOPs ([Note: dry run]).
    Use as a context manager, inside `fake_mode`. With `record_ops`, `ops` (an `OpLog`) gets
    every op outside construction, in order (the caller clears it before the step it keeps);
    otherwise `ops` is None."""

    def __init__(self, fake_mode, record_ops: bool = False):
        super().__init__()
        self.fake_mode = fake_mode
        self.ops: OpLog | None = OpLog() if record_ops else None
        # under pp, the schedule's actions as the rank runs them ("0F1", "0SEND_F1", ...)
        self.actions: list[str] = []
        self.current = 0
        self.live: dict[int, tuple[int, int, str]] = {}  # storage key -> (alloc id, bytes, site)
        self.events: list[tuple[int, int]] = []  # (alloc id, +-bytes) in order
        self.sites: dict[int, str] = {}  # alloc id -> allocation site
        self.op_of: dict[int, object] = {}  # alloc id -> the op that allocated it
        self._next_id = 0
        self.collectives: list[Call] = []  # collective_log.collective_call's, in order
        self.flops = 0
        self.phase = "construction"  # construction | step | optimizer (set by the caller)
        self._resize = None
        # when: the part of the step ("before the forward", "forward/backward", "after the
        # backward"), the microbatch (forward, chunk) the stages are at, and the moment of
        # each event from its index on ([Note: dry run]; set by `follow_moments`)
        self.part = "before the forward"
        self.optimizer_moment = "optimizer step"
        self.num_microbatches = 1
        self.forward_microbatch = 0
        self.chunk: tuple[str, int] | None = None  # a pipeline stage's ("backward", j)
        self.moments: list[tuple[int, str]] = [(0, "construction")]
        self._kinds: dict[object, _OpKind] = {}  # what the recorder does with an op, per op

    def action(self, text: str) -> None:
        """The pipeline schedule's action `text` ("0F1": stage 0's forward of microbatch 1,
        torch's `_Action` notation) starts now: appended to `actions`, and marked in `ops`."""
        self.actions.append(text)
        if self.ops is not None:
            self.ops.mark(text)

    def follow_actions(self, stage) -> None:
        """Call `action` as each schedule action of pipeline `stage` (torch's PipelineStage)
        starts: whichever schedule drives the stage (GPipe, 1F1B, the interleaved action
        runtime), these are the stage methods it calls (`_STAGE_ACTIONS`); a p2p action
        counts when it posts any op (the first stage receives no activations, the last
        sends none), and a backward of the input gradients only is torch's "I"."""
        for method_name, kind in _STAGE_ACTIONS.items():
            method = getattr(stage, method_name)

            def run(*args, method=method, kind=kind, **kwargs):
                if kind == "REDUCE_GRAD":
                    self.action(f"{stage.stage_index}REDUCE_GRAD")
                    return method(*args, **kwargs)
                j = args[0] if args else next(iter(kwargs.values()))
                if kind == "B" and not kwargs.get("full_backward", True):
                    kind = "I"
                if kind in ("F", "B", "W", "I"):
                    self.action(f"{stage.stage_index}{kind}{j}")
                    return method(*args, **kwargs)
                ops = method(*args, **kwargs)
                if ops:
                    self.action(f"{stage.stage_index}{kind}{j}")
                return ops

            setattr(stage, method_name, run)

    # -- memory ------------------------------------------------------------------------------
    def _storage(self, t):
        if isinstance(t, DTensor):
            t = t._local_tensor
        if not tc.is_fake(t) or t.is_meta:  # meta: shape inference (pipelining's), no memory
            return None
        return t.untyped_storage()

    def _site(self, func) -> str:
        if self.phase == "optimizer":
            return "optimizer"
        if self.phase == "construction":
            return "construction"
        return "temporaries" if tc.in_backward() else "activations"

    def moment(self) -> str:
        """When the rank is now: "construction", "forward of microbatch 1 of 4" (microbatches
        counted from 1; or its backward), "optimizer step", or the part of the step outside
        them."""
        if self.phase == "construction":
            return "construction"
        if self.phase == "optimizer":
            return self.optimizer_moment
        if self.part != "forward/backward":
            return self.part
        kind, j = self.chunk or ("backward" if tc.in_backward() else "forward",
                                 self.forward_microbatch)
        return f"{kind} of microbatch {j + 1} of {self.num_microbatches}"  # 1-based in words

    def _event(self, aid: int, delta: int) -> None:
        moment = self.moment()
        if moment != self.moments[-1][1]:
            self.moments.append((len(self.events), moment))
        self.events.append((aid, delta))

    def moment_at(self, end: int) -> str:
        """The moment of events[end - 1]: the event that brought the live bytes of
        events[:end] to what they are."""
        i = bisect.bisect_right(self.moments, max(end - 1, 0), key=lambda m: m[0]) - 1
        return self.moments[max(i, 0)][1]

    def _add(self, st, site: str, op=None) -> None:
        key, nbytes = st._cdata, st.nbytes()
        aid = self._next_id
        self._next_id += 1
        self.live[key] = (aid, nbytes, site)
        self.sites[aid] = site
        if op is not None:
            self.op_of[aid] = op
        self.current += nbytes
        self._event(aid, nbytes)
        weakref.finalize(st, self._free, key, aid)

    def _free(self, key: int, aid: int) -> None:
        entry = self.live.get(key)
        if entry is None or entry[0] != aid:
            return
        del self.live[key]
        self.current -= entry[1]
        self._event(aid, -entry[1])

    def _resized(self, st, site: str | None = None) -> None:
        entry = self.live.get(st._cdata)
        if entry is None:
            return
        aid, old, was = entry
        site = site or was
        self.sites[aid] = site
        new = st.nbytes()
        if new != old:
            self.live[st._cdata] = (aid, new, site)
            self.current += new - old
            self._event(aid, new - old)

    def _kind(self, func) -> _OpKind:
        kind = self._kinds.get(func)
        if kind is None:
            namespace = getattr(func, "namespace", "")
            packet = getattr(func, "overloadpacket", None)
            kind = self._kinds[func] = _OpKind(
                # prim: metadata queries (prim.device); profiler: record_function's markers
                ignored=namespace in ("prim", "profiler"),
                view=bool(getattr(func, "is_view", False)),
                formula=flop_registry.get(packet) or _EXTRA_FLOPS.get(packet),
                collective=namespace in _COLLECTIVE_NAMESPACES or namespace == "_dtensor")
        return kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor lowers to local ops, which come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = self._kind(func)
        # DTensor's sharding propagation runs ops on global shapes, in a fake mode of its own
        # or in the rank's: none of them is the rank's op
        if kind.ignored or tc.in_sharding_propagation() \
                or tc.active_fake_mode() is not self.fake_mode:
            return out
        site, inputs, outs = None, None, _tensors(out)
        # a view of fake tensors is its input's storage: nothing allocated, nothing resized (a
        # view of a real tensor -- lift_fresh of a constant -- makes a fake storage of it)
        view = kind.view and all(map(tc.is_fake, _tensors(args)))
        for leaf in () if view else outs:
            if (st := self._storage(leaf)) is not None:
                if st._cdata in self.live:
                    self._resized(st)
                    continue
                if inputs is None:  # a storage the recorder has not seen: one of the inputs'?
                    inputs = {s._cdata for t in _tensors((args, kwargs))
                              if (s := self._storage(t)) is not None}
                if st._cdata not in inputs:
                    site = site or self._site(func)
                    self._add(st, site, func)
        collective = kind.collective and self._record_collective(func, args, kwargs, out)
        if self.ops is not None and self.phase != "construction":
            moment = self.moment()
            if tc.in_recomputation():
                moment += " (recomputation)"
            self.ops.add(moment, func, args, kwargs, out,
                         len(self.collectives) - 1 if collective else None)
        # (pipelining's shape inference runs a stage on meta tensors: no FLOPs, no memory)
        if kind.formula is not None and self.phase != "construction" \
                and not any(t.is_meta for t in outs):
            self.flops += int(kind.formula(*args, **kwargs, out_val=out))
        return out

    def _record_collective(self, func, args, kwargs, out) -> bool:
        """Record `func` when it is a collective or p2p op; whether it was."""
        call = collective_call(func, args, kwargs, out)
        if call is None:
            return False
        self.collectives.append(call)
        name = call[0]
        # the buffer an in-place c10d op fills: a pipeline receive buffer, or a gathered /
        # reduce-scattered one (FSDP2's), counted as the plan counts them
        if func.namespace == "c10d" and args and name not in ("send", "allreduce_", "broadcast_"):
            for t in tree_leaves(args[0]):
                if isinstance(t, torch.Tensor) and (aid := self.alloc_id(t)) is not None:
                    self.sites[aid] = "comm_buffers" if name.startswith("recv") \
                        else "temporaries"
        return True

    def __enter__(self):
        # FSDP2's unsharded parameters, resized outside dispatch
        self._resize = patch_resize(lambda storage: self._resized(storage, "temporaries"))
        self._propagation = tc.marking_sharding_propagation()
        self._propagation.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._resize()
        self._propagation.__exit__(None, None, None)
        return super().__exit__(*exc)

    # -- results -----------------------------------------------------------------------------
    def peak(self, start: int, categories: dict[int, str],
             left_out: frozenset[str] = frozenset()) -> tuple[int, dict[str, int], int]:
        """The peak of live bytes over events[start:], its bytes by category
        (`live_by_category`) and `end`: the live bytes of events[:end] are the peak. The
        categories `left_out` (`category_of`: an offloaded plan's host-resident states) count
        in neither, their bytes by category 0."""
        def counted(aid: int) -> bool:
            return not left_out or self.category_of(aid, categories) not in left_out

        total = sum(delta for aid, delta in self.events[:start] if counted(aid))
        best, best_at = total, start
        for i in range(start, len(self.events)):
            aid, delta = self.events[i]
            if counted(aid):
                total += delta
                if total > best:
                    best, best_at = total, i + 1
        by = self.live_by_category(best_at, categories)
        return best, {k: (0 if k in left_out else v) for k, v in by.items()}, best_at

    def first_above(self, limit_bytes: float, categories: dict[int, str],
                    left_out: frozenset[str] = frozenset()) -> int | None:
        """`end` of the first event after which the live bytes, those of the categories
        `left_out` aside (`category_of`), exceed `limit_bytes` (the live bytes of
        events[:end] do); None when they never do."""
        total = 0
        for i, (aid, delta) in enumerate(self.events):
            if left_out and self.category_of(aid, categories) in left_out:
                continue
            total += delta
            if total > limit_bytes:
                return i + 1
        return None

    def category_of(self, aid: int, categories: dict[int, str]) -> str:
        """An allocation's category: `categories` (alloc id -> category) first, else its
        site; a construction-time storage that is none of them counts with the params."""
        cat = categories.get(aid) or self.sites[aid]
        return cat if cat in CATEGORIES else "params"

    def _live_at(self, end: int) -> dict[int, int]:
        """{alloc id: its live bytes} after events[:end] (0 for a freed one)."""
        live: dict[int, int] = defaultdict(int)
        for aid, delta in self.events[:end]:
            live[aid] += delta
        return live

    def live_by_category(self, end: int, categories: dict[int, str]) -> dict[str, int]:
        """The live bytes of events[:end] by `CATEGORIES` (`category_of`)."""
        live = self._live_at(end)
        by = dict.fromkeys(CATEGORIES, 0)
        for aid, nbytes in live.items():
            if nbytes:
                by[self.category_of(aid, categories)] += nbytes
        return by

    def live_by_op(self, end: int, categories: dict[int, str],
                   top: int = 8) -> dict[str, list[tuple[str, int, int]]]:
        """The live bytes of events[:end] by category and by the op that allocated them:
        {category: [(op, bytes, tensors), ...]}, the `top` largest ops of each category with
        any bytes, largest first (a storage a resize grew counts under the op that made it;
        one without a recorded op under "(no op)")."""
        live = self._live_at(end)
        by: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        for aid, nbytes in live.items():
            if nbytes:
                op = self.op_of.get(aid)
                name = "(no op)" if op is None else str(op).removeprefix("aten.")
                entry = by[self.category_of(aid, categories)][name]
                entry[0] += nbytes
                entry[1] += 1
        return {cat: sorted(((op, b, n) for op, (b, n) in ops.items()),
                            key=lambda x: (-x[1], x[0]))[:top]
                for cat, ops in by.items()}

    def alloc_id(self, t: torch.Tensor) -> int | None:
        st = self._storage(t)
        entry = self.live.get(st._cdata) if st is not None else None
        return entry[0] if entry is not None else None


def _tensors(tree, out: list | None = None) -> list[torch.Tensor]:
    """The tensors of an op's arguments or outputs (tensors, lists, tuples and dicts of them),
    in order: pytree's `tree_leaves` and a filter, at a fraction of its cost per op."""
    out = [] if out is None else out
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            _tensors(x, out)
    elif isinstance(tree, dict):
        for x in tree.values():
            _tensors(x, out)
    return out


def follow_moments(recorder: DryRunRecorder, engine) -> None:
    """Tell the recorder where the step is ([Note: dry run]): the forward/backward part of
    each step (`engine._forward_backward`, whose start resets the microbatch count), the
    forward microbatch (a pre-hook on each stage: microbatch j in increasing order, as
    engine.py counts them), and under pp the chunk a stage runs (torch's
    `forward_one_chunk` / `backward_one_chunk` of each pipeline stage) and the schedule's
    actions (`DryRunRecorder.follow_actions`). The hooks live as long as the engine."""
    recorder.num_microbatches = engine.plan.num_microbatches
    inner = engine._forward_backward

    def forward_backward(local):
        recorder.part, recorder.forward_microbatch = "forward/backward", 0
        count.clear()
        try:
            return inner(local)
        finally:
            recorder.part = "after the backward (gradient reduction, clipping)"

    engine._forward_backward = forward_backward
    count: dict[int, int] = {}
    for idx, module in engine.stages:
        def pre(_module, args, idx=idx):
            if not any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
                recorder.forward_microbatch = count.get(idx, 0)
                count[idx] = recorder.forward_microbatch + 1

        module.register_forward_pre_hook(pre)
    for stage in tc.pipeline_stages(engine._schedule):
        for kind in ("forward", "backward"):
            method = getattr(stage, f"{kind}_one_chunk")

            def chunk(j, *args, method=method, kind=kind, **kwargs):
                recorder.chunk = (kind, j)
                try:
                    return method(j, *args, **kwargs)
                finally:
                    recorder.chunk = None

            setattr(stage, f"{kind}_one_chunk", chunk)
        recorder.follow_actions(stage)


@contextlib.contextmanager
def optimizer_phases(recorder: DryRunRecorder):
    """Tells the recorder where the step is: "optimizer" inside any optimizer's step (torch's
    global step hooks: ZeRO-1's inner optimizer too); the recorder tells forward from backward
    itself."""
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    outer = {}

    def pre(optimizer, args, kwargs):
        outer[id(optimizer)] = recorder.phase
        recorder.phase = "optimizer"

    def post(optimizer, args, kwargs):
        recorder.phase = outer.pop(id(optimizer), "step")

    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _sdpa_cpu_flop(query, key, value, *args, out_val=None, **kwargs):
    from torch.utils.flop_counter import sdpa_flop

    return sdpa_flop(query, key, value, out_val=out_val)


def _sdpa_cpu_backward_flop(grad_out, query, key, value, *args, out_val=None, **kwargs):
    from torch.utils.flop_counter import sdpa_backward_flop

    return sdpa_backward_flop(grad_out, query, key, value, out_val=out_val)


# torch's formulas cover the CUDA attention kernels; a dry run on the CPU device picks these
_EXTRA_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flop,
}
