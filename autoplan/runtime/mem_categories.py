"""Tensor memory of one training step by category and phase, with torch's memory tracker.

`StepMemory` is torch.distributed._tools.mem_tracker.MemTracker (a private torch API: this module
is its one home) made to follow autoplan's runtime step after step:

- MemTracker refuses a root module called a second time ("multiple iterative calls"); a
  training step calls each stage once per microbatch, and every step again. Here a second
  top-level call starts the module's statistics afresh, which is what MemTracker's
  `reset_mod_stats` would do between iterations; the tensors it tracks stay tracked.
- `reset_peak()` starts a new peak from what is live now (the measured step after the first,
  whose construction and lazy state are not the plan's steady state).
- `peak_phase` says when the peak occurred: "forward", "backward" or "optimizer".
- Frozen parameters (requires_grad False) get no gradient hook (MemTracker would register
  one and torch refuses it), and fake or meta tensors are not memory.

Categories, as MemTracker assigns them (by where a storage was first seen):
`params` (module parameters when their module first runs: local shards of DTensors, FSDP2's
sharded parameters), `buffers`, `grads` (tensors reaching a parameter's grad hooks),
`optimizer` (optimizer states, and every storage the optimizer step allocates: its
temporaries), `activations` (storages allocated in forward: saved activations, forward
temporaries, FSDP2's gathered parameters and pipeline receive buffers of the forward),
`temporaries` (storages allocated in backward that are not gradients: activation gradients,
recomputation, gathered parameters first allocated there) and `other`. Counted like
`LiveTensorBytes`: storages allocated under the tracker (so enter it before the runtime is
built), resized storages at their new size; gloo's transport buffers and the Python heap are
not tensors and not counted.
"""

from __future__ import annotations

import copy

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._tools.mem_tracker import MemTracker

__all__ = ["StepMemory", "CATEGORIES"]

# MemTracker's reference kinds (str enums; their values are these names) -> ours
_KINDS = {"Parameter": "params", "Buffer": "buffers", "Gradient": "grads",
          "Optstate": "optimizer", "Activation": "activations", "Temp": "temporaries",
          "Other": "other"}
CATEGORIES = tuple(_KINDS.values())


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def _counted(t: torch.Tensor) -> bool:
    """Whether `t` holds memory: not a fake tensor (capture and sharding propagation run
    modules on fake tensors that report a real device) and not on the meta device."""
    return not is_fake(t) and t.device.type != "meta"


class StepMemory(MemTracker):
    """Peak tensor bytes of this process with its breakdown by category (module docstring).

    Use as a context manager around the runtime's construction and steps; `reset_peak()`
    before the step to measure. `peak_bytes` (int) and `peak_by_category` ({category: bytes},
    CATEGORIES) describe the peak of the device `device` (default: the one with the most
    bytes); `peak_phase` is the phase it occurred in."""

    def __init__(self):
        super().__init__()
        self.peak_phase = "forward"

    def _track(self, reftype, t: torch.Tensor) -> None:
        if not _counted(t):
            return
        super()._track(reftype, t)

    def _update_and_maybe_create_winfos(self, t: torch.Tensor, reftype,
                                        update_existing: bool = False) -> set:
        if not _counted(t):
            return set()
        return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        # MemTracker hooks every parameter's gradient, which torch refuses for a frozen one
        # (no gradient to hook): mark those as hooked already
        for p in module.parameters():
            if not p.requires_grad:
                self._param_to_grad_hook_handles.setdefault(p, (_NO_HOOK, _NO_HOOK))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_fw_hook(self, module, inputs) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        if (module in self.memory_tracking and not self._mod_tracker.is_bw
                and set(self._mod_tracker.parents) - {name} == {"Global"}):
            del self.memory_tracking[module]  # the next microbatch / step of a root module
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state) -> None:
        before = dict(self._peak_mem)
        super()._update_peak_stats(peak_state)
        if self._peak_mem != before:
            self.peak_phase = "optimizer" if self._in_opt else \
                "backward" if self._mod_tracker.is_bw else "forward"

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        snap = self.get_tracker_snapshot()
        self._peak_mem_snap = copy.deepcopy(snap)
        self._peak_mem = {dev: s["Total"] for dev, s in snap.items()}
        self.peak_phase = "forward"

    def _device(self, device) -> torch.device | None:
        if device is not None:
            return torch.device(device)
        if not self._peak_mem:
            return None
        return max(self._peak_mem, key=self._peak_mem.get)

    def peak_bytes(self, device=None) -> int:
        dev = self._device(device)
        return int(self._peak_mem.get(dev, 0)) if dev is not None else 0

    def peak_by_category(self, device=None) -> dict[str, int]:
        dev = self._device(device)
        snap = self._peak_mem_snap.get(dev, {}) if dev is not None else {}
        out = dict.fromkeys(CATEGORIES, 0)
        for kind, nbytes in snap.items():
            name = _KINDS.get(getattr(kind, "value", kind))
            if name is not None:
                out[name] += int(nbytes)
        return out
