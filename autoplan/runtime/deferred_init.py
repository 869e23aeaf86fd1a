"""Deferred initialisation: record a model's construction and init on the meta device, then
replay it one tensor at a time, so that each rank materialises only its own shards.

[Note: RNG contract for initialisation] A model built by `record(factory)` and materialised by
`replay` gets exactly the values that `torch.set_rng_state(s); model = factory()` gives on one
process, where `s` is the CPU generator state when `record` was called (rank 0's, for every rank:
runtime/weights.py broadcasts it): the replay runs the
same aten ops, in the same order, on full-size tensors of the same shapes and dtypes, so every
random op draws the same numbers from the same stream. The same holds for an init function
run on a model that is already on meta (`record(lambda: init(model))`), e.g. HF
`init_weights()` or nanoGPT's `apply(_init_weights)`. The caller's generator is left as it
was: the replay restores the state it found.

Memory: each recorded op runs on real tensors only while its value can still reach the model.
An op that overwrites a whole tensor without reading it (`normal_`, `uniform_`, `fill_`,
`zero_`, a full `copy_`) starts a new *segment* of that tensor's storage; every segment but the
last is dead (its value is overwritten before anyone reads it) and runs on a scratch tensor
freed at the segment's end -- still drawing its random numbers, so the stream stays aligned.
The last segment of a parameter or buffer ends at its last op, where `replay` hands the full
tensor to the caller (who keeps its shard) and drops it. A constructor that initialises each
layer and a `post_init()` that re-initialises them all therefore holds about one full tensor at
a time, never the model. (torchdistx's `deferred_init` records and replays the same way; it is
not maintained for current torch.)

[Note: init functions that skip meta] torch.nn.init's `trunc_normal_`, `orthogonal_`,
`sparse_` and `dirac_` return a meta tensor untouched (torch 2.13: "Meta tensors have no
storage, so sampling is a no-op"; `trunc_normal_` is a rejection sampler whose number of draws
depends on the values drawn, which meta cannot know). Recorded as aten ops they would leave no
trace, and the tensor would keep the value its constructor gave it (ViT's `cls_token` kept
`torch.randn`, std 1, instead of HF `_init_weights`' `trunc_normal_`, std 0.02). While recording,
each of them is replaced, under every name HF and torch call it by (`torch.nn.init`, the
`torch.nn.modules` that import it, transformers' `TORCH_INIT_FUNCTIONS`), by a function that
records the call itself as one op (`_InitCall`) on a meta tensor and runs it as it is on a real
one. The replay calls the real function on the full-size tensor at the same place in the
stream, so it draws what one process draws, rejections included. Each such call overwrites
its tensor whole (a segment start) and, but for `dirac_`, is random.

Limits: an init that reads tensor *values* on the host (`.item()`, `.tolist()`, Python
branches on values) cannot be recorded on meta and raises `DeferredInitError`; ops on real
(non-meta) tensors during recording are run, not recorded (their results become constants).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["DeferredInitError", "InitTrace", "record", "replay", "storage_key", "module_tensors",
           "module_views"]

aten = torch.ops.aten

# In-place ops that overwrite every element of `self` without reading it.
_OVERWRITE_OPS = frozenset({
    aten.normal_.default, aten.uniform_.default, aten.fill_.Scalar, aten.fill_.Tensor,
    aten.zero_.default, aten.bernoulli_.float, aten.random_.default, getattr(aten.random_, "from"),
    aten.random_.to, aten.exponential_.default, aten.cauchy_.default,
    aten.log_normal_.default, aten.geometric_.default, aten.copy_.default,
})


_HF_MODULE = "transformers.modeling_utils"
_HF_INIT = "transformers.initialization"

# [Note: init functions that skip meta]: name -> whether it draws random numbers.
_META_SKIPPING_INITS = {"trunc_normal_": True, "orthogonal_": True, "sparse_": True,
                        "dirac_": False}


class DeferredInitError(RuntimeError):
    """The model's construction or init cannot be recorded on meta (the message says why)."""


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (views share it)."""
    return t.untyped_storage()._cdata


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A recorded tensor: `index` into the trace's tensor table."""

    index: int


@dataclasses.dataclass(frozen=True)
class _InitCall:
    """A torch.nn.init function recorded as one op ([Note: init functions that skip meta]):
    replayed by calling `fn` on the real tensor. `tags` as aten ops have them, so that the
    schedule keeps a random one in the stream."""

    name: str
    fn: Callable
    random: bool

    @property
    def tags(self) -> tuple:
        return (torch.Tag.nondeterministic_seeded,) if self.random else ()

    def __call__(self, tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.fn(tensor, *args, **kwargs)


@dataclasses.dataclass(frozen=True)
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    outputs: Any  # pytree of _Ref (or constants)


@dataclasses.dataclass
class InitTrace:
    """The recorded ops and the meta tensors they made or touched.

    Attributes:
        ops: in execution order.
        tensors: the meta tensor of every _Ref (kept alive so ids are never reused).
        rng_state: the CPU generator state when recording began.
    """

    ops: list[_Op]
    tensors: list[torch.Tensor]
    rng_state: torch.Tensor

    def __len__(self) -> int:
        return len(self.ops)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[_Op] = []
        self.tensors: list[torch.Tensor] = []
        self.index: dict[int, int] = {}  # id(meta tensor) -> index
        self.recording_calls = False  # [Note: init functions that skip meta]

    def ref(self, t: torch.Tensor) -> _Ref:
        i = self.index.get(id(t))
        if i is None:
            i = self.index[id(t)] = len(self.tensors)
            self.tensors.append(t)
        return _Ref(i)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        meta_in = any(isinstance(a, torch.Tensor) and a.is_meta for a in flat)
        meta_device = any(isinstance(a, torch.device) and a.type == "meta" for a in flat)
        out = func(*args, **kwargs)
        if func is aten._local_scalar_dense.default:
            raise DeferredInitError(
                "the model's init reads a tensor value on the host (.item(), .tolist() or a "
                "Python branch on a tensor), which cannot be recorded on the meta device: "
                "give the model with real weights instead, or an init that only writes")
        out_flat, _ = tree_flatten(out)
        meta_out = any(isinstance(o, torch.Tensor) and o.is_meta for o in out_flat)
        if not (meta_in or meta_device or meta_out):
            return out
        rec_args, rec_kwargs = tree_map(self._arg, (args, kwargs))
        outputs = tree_map(lambda o: self.ref(o) if isinstance(o, torch.Tensor) else o, out)
        self.ops.append(_Op(func, rec_args, rec_kwargs, outputs))
        return out

    def _arg(self, a):
        if isinstance(a, torch.Tensor):
            return self.ref(a) if a.is_meta else a.detach().clone()
        return a

    def record_call(self, call: _InitCall, tensor: torch.Tensor, args: tuple,
                    kwargs: dict) -> None:
        """`call(tensor, *args, **kwargs)` on a meta tensor, as one op writing `tensor`."""
        rec_args, rec_kwargs = tree_map(self._arg, (args, kwargs))
        self.ops.append(_Op(call, (self.ref(tensor), *rec_args), rec_kwargs, self.ref(tensor)))


def record(fn: Callable[[], Any]) -> tuple[Any, InitTrace]:
    """Run `fn()` with the meta device as the default device, recording every aten op on meta
    tensors. Returns (fn's result, the trace). Raises DeferredInitError when `fn` reads tensor
    values on the host."""
    state = torch.get_rng_state()
    hf_before = _HF_MODULE in sys.modules
    result, recorder = _record_once(fn)
    if not hf_before and _HF_MODULE in sys.modules:
        # transformers was first imported by `fn` itself, too late for the patch that lets its
        # init run on meta: record again, now that it can be patched.
        result, recorder = _record_once(fn)
    return result, InitTrace(recorder.ops, recorder.tensors, state)


def _record_once(fn: Callable[[], Any]):
    recorder = _Recorder()
    try:
        with torch.device("meta"), _hf_init_runs_on_meta(), \
                _init_functions_recorded(recorder), recorder:
            result = fn()
    except DeferredInitError:
        raise
    except Exception as e:  # noqa: BLE001 - what meta cannot do, named
        if "meta" in str(e) and ("item" in str(e) or "data" in str(e)):
            raise DeferredInitError(
                f"cannot record the model's init on meta: {e} (an init that reads tensor values "
                "cannot be deferred: give the model with real weights instead, or an init that "
                "only writes)") from e
        raise
    return result, recorder


@contextlib.contextmanager
def _hf_init_runs_on_meta():
    """Hugging Face transformers skips `init_weights` when the default device is meta (it
    expects a checkpoint to follow); recording needs the init to run, so the check is told the
    device is the CPU while recording. No-op when transformers is not imported."""
    mu = sys.modules.get(_HF_MODULE)
    name = "get_torch_context_manager_or_global_device"
    if mu is None or not hasattr(mu, name):
        yield
        return
    original = getattr(mu, name)
    setattr(mu, name, lambda: torch.device("cpu"))
    try:
        yield
    finally:
        setattr(mu, name, original)


@contextlib.contextmanager
def _init_functions_recorded(recorder: _Recorder):
    """[Note: init functions that skip meta]: while recording, the torch.nn.init functions
    that skip meta tensors record their call instead, wherever torch and transformers hold
    them; every name is restored on exit. A module that copies one of them during the recording
    (transformers, imported by the factory itself) keeps a wrapper that runs the original once
    the recording is over; transformers' table gets the original back."""
    hf = sys.modules.get(_HF_INIT)
    holders = {id(m): m for m in [torch.nn.init] + [
        sys.modules[m] for m in getattr(hf, "TORCH_MODULES_TO_PATCH", ()) if m in sys.modules]}
    restore: list[Callable[[], None]] = []
    for name, random in _META_SKIPPING_INITS.items():
        original = _unwrapped(getattr(torch.nn.init, name, None))
        if original is None:
            continue
        wrapper = _recording(recorder, _InitCall(name, original, random))
        for holder in holders.values():
            if _unwrapped(getattr(holder, name, None)) is original:
                restore.append(functools.partial(setattr, holder, name, getattr(holder, name)))
                setattr(holder, name, wrapper)
        table = getattr(hf, "TORCH_INIT_FUNCTIONS", None)
        if isinstance(table, dict) and _unwrapped(table.get(name)) is original:
            table[name] = wrapper
    recorder.recording_calls = True
    try:
        yield
    finally:
        recorder.recording_calls = False
        for undo in restore:
            undo()
        table = getattr(sys.modules.get(_HF_INIT), "TORCH_INIT_FUNCTIONS", None)
        if isinstance(table, dict):
            for name, fn in list(table.items()):
                table[name] = _unwrapped(fn)


def _unwrapped(fn):
    """The torch.nn.init function a recording wrapper wraps; any other value as it is."""
    call = getattr(fn, "__autoplan_init_call__", None)
    return call.fn if call is not None else fn


def _recording(recorder: _Recorder, call: _InitCall) -> Callable:
    """`call.fn`, except that on a meta tensor while `recorder` records it records the call."""
    @functools.wraps(call.fn)
    def wrapper(tensor, *args, **kwargs):
        if recorder.recording_calls and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            recorder.record_call(call, tensor, args, kwargs)
            return tensor
        return call.fn(tensor, *args, **kwargs)  # real tensors run, as the recorder's ops do
    wrapper.__autoplan_init_call__ = call
    return wrapper


def _refs(tree) -> list[_Ref]:
    flat, _ = tree_flatten(tree)
    return [a for a in flat if isinstance(a, _Ref)]


def _overwrites(op: _Op, trace: InitTrace) -> int | None:
    """The storage key that `op` overwrites whole without reading, if any."""
    overwrite = op.func in _OVERWRITE_OPS or isinstance(op.func, _InitCall)
    if not overwrite or not op.args or not isinstance(op.args[0], _Ref):
        return None
    t = trace.tensors[op.args[0].index]
    whole = (t.storage_offset() == 0 and t.is_contiguous()
             and t.numel() * t.element_size() == t.untyped_storage().nbytes())
    if op.func is aten.copy_.default and isinstance(op.args[1], _Ref) and storage_key(
            trace.tensors[op.args[1].index]) == storage_key(t):
        return None
    return storage_key(t) if whole else None


@dataclasses.dataclass
class _Schedule:
    """Which ops run, and the storages dropped / handed over after each op."""

    run: list[bool]
    free_after: dict[int, list[int]]     # op index -> storage keys whose value is dead
    ready_after: dict[int, list[int]]    # op index -> wanted storage keys now final


def _schedule(trace: InitTrace, wanted: set[int]) -> _Schedule:
    """Segments and liveness of every storage, and the ops the wanted values need.

    Storage k's ops u_0 < ... < u_n split into segments at u_0 and at every op that overwrites
    k whole; a segment's value is dropped after its last op. A wanted storage is ready after
    u_n. An op runs when a storage it outputs (in-place ops output `self`) feeds a wanted value,
    and every random op before the last random op that runs runs too (the stream stays aligned).
    """
    key_of = [storage_key(t) for t in trace.tensors]
    uses: dict[int, list[int]] = defaultdict(list)
    for i, op in enumerate(trace.ops):
        for r in _refs((op.args, op.kwargs, op.outputs)):
            k = key_of[r.index]
            if not uses[k] or uses[k][-1] != i:
                uses[k].append(i)
    starts = {(i, k) for i, op in enumerate(trace.ops) if (k := _overwrites(op, trace))}
    free_after: dict[int, list[int]] = defaultdict(list)
    ready_after: dict[int, list[int]] = defaultdict(list)
    for k, ops in uses.items():
        for j, nxt in zip(ops, ops[1:]):
            if (nxt, k) in starts:
                free_after[j].append(k)
        (ready_after if k in wanted else free_after)[ops[-1]].append(k)
    needed = set(wanted)
    run = [False] * len(trace.ops)
    for i in reversed(range(len(trace.ops))):
        op = trace.ops[i]
        if any(key_of[r.index] in needed for r in _refs(op.outputs)):
            run[i] = True
            needed |= {key_of[r.index] for r in _refs((op.args, op.kwargs))}
    random = [torch.Tag.nondeterministic_seeded in getattr(op.func, "tags", ())
              for op in trace.ops]
    last = max((i for i in range(len(run)) if run[i] and random[i]), default=-1)
    for i in range(last):
        run[i] = run[i] or random[i]
    return _Schedule(run, free_after, ready_after)


def replay(trace: InitTrace, wanted: Mapping[int, Iterable[str]],
           consume: Callable[[str, torch.Tensor], None], *,
           device: str | torch.device = "cpu",
           views: Mapping[str, tuple] | None = None) -> int:
    """Replay `trace` on `device`, calling `consume(name, full_tensor)` once per wanted name as
    soon as its storage holds its final value; returns the peak bytes of real tensors the
    replay held at once (full tensors and scratch; what `consume` keeps is the caller's).

    Args:
        wanted: storage key (`storage_key` of the module's meta parameter or buffer) -> the
            names (FQNs) it is known by; every name is consumed with the same tensor.
        consume: receives a full tensor on `device`; it must not keep it beyond its shard
            (buffers may be kept whole).
        views: name -> (shape, stride, storage offset) of the view of its storage the module
            holds (`module_views`): the trace may know several views of one storage, and the
            one it made last need not be the module's (weight_norm's `original0` is made as
            a norm of shape (C,) and kept as (1, 1, C)). None: a whole contiguous view.

    Ops that feed no wanted value are skipped (random ones still run while a later random op
    feeds one). The CPU generator is set to the recorded state for the replay and restored
    afterwards. Raises DeferredInitError when a wanted storage is untouched by the trace.
    """
    device = torch.device(device)
    wanted = {k: list(v) for k, v in wanted.items()}
    key_of = [storage_key(t) for t in trace.tensors]
    never = [n for k, names in wanted.items() if k not in set(key_of) for n in names]
    if never:
        raise DeferredInitError(f"{len(never)} tensors are neither made nor initialised by "
                                f"the recorded init: {never[:8]}")
    sched = _schedule(trace, set(wanted))
    real: dict[int, torch.Tensor] = {}          # tensor index -> real tensor
    by_storage: dict[int, list[int]] = defaultdict(list)
    held: dict[int, int] = {}                   # storage key -> bytes
    peak = 0

    def bind(i: int, t: torch.Tensor) -> None:
        nonlocal peak
        real[i] = t
        k = key_of[i]
        by_storage[k].append(i)
        if k not in held:
            held[k] = t.untyped_storage().nbytes()
            peak = max(peak, sum(held.values()))

    def fetch(r: _Ref) -> torch.Tensor:
        t = real.get(r.index)
        if t is not None:
            return t
        meta = trace.tensors[r.index]
        k = key_of[r.index]
        if by_storage.get(k):  # a view made earlier of a storage that is live again
            base = real[by_storage[k][0]]
        else:  # a tensor made before recording, or a segment starting: value undefined
            numel = meta.untyped_storage().nbytes() // meta.element_size()
            base = torch.empty(numel, dtype=meta.dtype, device=device)
        t = base.as_strided(meta.shape, meta.stride(), meta.storage_offset())
        bind(r.index, t)
        return t

    def drop(k: int) -> None:
        for i in by_storage.pop(k, []):
            real.pop(i, None)
        held.pop(k, None)

    saved = torch.get_rng_state()
    torch.set_rng_state(trace.rng_state)
    try:
        with torch.no_grad():
            for i, op in enumerate(trace.ops):
                if sched.run[i]:
                    _run(op, fetch, bind, real, device)
                for k in sched.ready_after.get(i, ()):
                    full = fetch(_Ref(_whole_index(by_storage.get(k, []), trace, k, key_of)))
                    for name in wanted[k]:
                        consume(name, _viewed(full, (views or {}).get(name)))
                    del full  # the replay's last reference: the storage goes now
                    drop(k)
                for k in sched.free_after.get(i, ()):
                    drop(k)
    finally:
        torch.set_rng_state(saved)
    return peak


def _run(op: _Op, fetch, bind, real, device) -> None:
    args, kwargs = tree_map(
        lambda a: fetch(a) if isinstance(a, _Ref) else (device if isinstance(
            a, torch.device) else a), (op.args, op.kwargs))
    out = op.func(*args, **kwargs)
    out_flat, _ = tree_flatten(out)
    ref_flat, _ = tree_flatten(op.outputs)
    for o, r in zip(out_flat, ref_flat):
        if isinstance(r, _Ref) and isinstance(o, torch.Tensor) and r.index not in real:
            bind(r.index, o)


def _viewed(full: torch.Tensor, view: tuple | None) -> torch.Tensor:
    """The view (shape, stride, storage offset) of `full`'s storage; `full` when None."""
    if view is None:
        return full
    shape, stride, offset = view
    if (tuple(full.shape), tuple(full.stride()), full.storage_offset()) == view:
        return full
    return full.as_strided(shape, stride, offset)


def _whole_index(indices: list[int], trace: InitTrace, k: int, key_of: list[int]) -> int:
    """Index of a tensor viewing storage k whole (contiguous from offset 0)."""
    candidates = indices or [i for i, key in enumerate(key_of) if key == k]
    for i in candidates:
        meta = trace.tensors[i]
        if meta.storage_offset() == 0 and meta.is_contiguous() and \
                meta.numel() * meta.element_size() == meta.untyped_storage().nbytes():
            return i
    return candidates[0]


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False))


def module_tensors(module: nn.Module) -> dict[int, list[str]]:
    """Storage key -> the FQNs (parameters and buffers, tied names included) of `module`."""
    out: dict[int, list[str]] = defaultdict(list)
    for name, t in _named_tensors(module):
        out[storage_key(t)].append(name)
    return dict(out)


def module_views(module: nn.Module) -> dict[str, tuple]:
    """FQN -> (shape, stride, storage offset) of every parameter and buffer of `module` (tied
    names included): how each views its storage."""
    return {name: (tuple(t.shape), tuple(t.stride()), t.storage_offset())
            for name, t in _named_tensors(module)}
