"""Live tensor storage bytes of one process: the measured side of the memory model.

`LiveTensorBytes` is a TorchDispatchMode that counts every storage an aten op allocates under it
from its allocation until it is freed (a weakref finalizer on the storage), storages resized in
place (FSDP2 frees and re-allocates unsharded parameters with `UntypedStorage.resize_`) at their
new size, and DTensors through their local tensors (the mode returns NotImplemented for them, as
torch's MemTracker does, so their local ops come back through it). That is parameters, gradients,
optimizer states, activations saved for backward (also those selective checkpointing caches),
temporaries, gathered parameters and the output buffers of collectives -- what
`cost_model.memory.peak_memory_bytes` predicts. Not counted: tensors allocated before the mode,
memory that kernels or gloo allocate below the dispatcher (scratch buffers inside one kernel,
transport buffers), and the Python heap.

(torch.distributed._tools.mem_tracker.MemTracker attributes memory to modules and optimizer
states for CUDA; this counts plain CPU storages, including those of checkpointing caches, which
is what the bench and the tests compare with the cost model.)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveTensorBytes", "patch_resize"]


class LiveTensorBytes(TorchDispatchMode):
    """Live (`current`) and peak (`peak`) tensor storage bytes allocated by aten ops under
    the mode, bytes (module docstring). `reset_peak` starts a new peak from the current
    bytes. Use as a context manager; nesting two is not supported (both patch resize_)."""

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}  # StorageImpl address -> bytes
        self.current = 0
        self.peak = 0
        self._resize = None

    def reset_peak(self) -> None:
        self.peak = self.current

    def _free(self, key: int) -> None:
        self.current -= self.sizes.pop(key, 0)

    @staticmethod
    def _storage(t):
        """The storage of a plain CPU tensor (a DTensor's local one), else None."""
        if isinstance(t, DTensor):
            t = t._local_tensor
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return None  # fake tensors (sharding propagation), other subclasses
        return t.untyped_storage() if t.device.type == "cpu" else None

    def _track(self, st, inputs: set[int]) -> None:
        key, nbytes = st._cdata, st.nbytes()
        old = self.sizes.get(key)
        if old is None and key in inputs:
            return  # a view of, or in-place op on, a storage allocated before the mode
        if old is None:
            self.sizes[key] = nbytes
            weakref.finalize(st, self._free, key)
            self.current += nbytes
        elif old != nbytes:
            self.sizes[key] = nbytes
            self.current += nbytes - old
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower to local ops, which come back here
        inputs = {st._cdata for leaf in tree_leaves((args, kwargs))
                  if isinstance(leaf, torch.Tensor) and (st := self._storage(leaf)) is not None}
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and (st := self._storage(leaf)) is not None:
                self._track(st, inputs)
        return out

    def _resized(self, storage) -> None:
        key = storage._cdata
        if key in self.sizes:
            self.current += storage.nbytes() - self.sizes[key]
            self.sizes[key] = storage.nbytes()
            self.peak = max(self.peak, self.current)

    def __enter__(self):
        self._resize = patch_resize(self._resized)
        return super().__enter__()

    def __exit__(self, *exc):
        self._resize()
        return super().__exit__(*exc)


def patch_resize(callback) -> Callable[[], None]:
    """Make `torch.UntypedStorage.resize_` call `callback(storage)` after each resize (a
    dispatch mode does not see it; FSDP2 frees and re-allocates unsharded parameters with it);
    returns the function that restores the original."""
    original = torch.UntypedStorage.resize_

    def resize_(storage, size):
        out = original(storage, size)
        callback(storage)
        return out

    torch.UntypedStorage.resize_ = resize_

    def restore() -> None:
        torch.UntypedStorage.resize_ = original
    return restore

