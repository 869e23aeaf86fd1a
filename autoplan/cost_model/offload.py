"""CPU offload as a plan choice: optimizer states (and, under ZeRO-3, parameters) in host
memory, the optimizer step on the host.

[Note: offload] Sources: ZeRO-Offload (Ren et al., USENIX ATC 2021: fp32 optimizer states and
the update on the CPU, gradients down and updated parameters up over PCIe every step) and
ZeRO-Infinity (Rajbhandari et al., SC 2021: under ZeRO-3 the parameter shards on the host too,
brought to the device for each use). The choices, by ZeRO stage, are what the runtime runs:

- "optimizer" at ZeRO 0 and 1 (autoplan/runtime/offload.py, `HostOptimizer`): the rank keeps
  an fp32 host copy of each parameter it steps (all of them at ZeRO-0, the ones it owns at
  ZeRO-1) with its gradient and the optimizer states; a step copies the stepped gradients down
  to the host, runs the optimizer there and copies the updated parameters up. On the device:
  parameters and gradients, no optimizer states.
- "optimizer+params" at ZeRO-3 with dp > 1: FSDP2's `CPUOffloadPolicy` -- the sharded
  parameters, their gradients and so the optimizer states live on the host; each unit's shard
  goes up before its all-gather (forward and backward, every microbatch: the 2 m gathers of
  [Note: step time] in step_time.py) and its reduced gradient shard comes down after each
  reduce-scatter. On the device only the gathered units and unsharded gradients (temporaries).
- ZeRO-2 has no offload here (FSDP2's policy also offloads parameters, which ZeRO-2 keeps).

Bytes per stepped parameter E (fsdp2 recipe, memory.py: p = 4 fp32 master, g = 4, o = 8 for
AdamW) and per step, with B = host_bw_bytes_per_s per direction and H =
host_optimizer_bw_bytes_per_s / (ranks on the node):

    host memory   "optimizer": E (p + g + o)       "optimizer+params": W / dp (p + g + o)
    transfers     "optimizer": E g / B + E p / B   "optimizer+params": (a p + r g) W / dp / B
    host step     E OPTIMIZER_BYTES_PER_PARAM / H + stepped tensors x ops x optimizer_op_s

(E = W at ZeRO-0, W / dp at ZeRO-1; W the rank's parameters after tp and pp; a = 2 m
parameter all-gathers (m microbatches) and r gradient reductions per step, dp_sync.py.) Overlap: none. The runtime copies and steps after the
backward and the dp collectives, one after the other, and FSDP2 copies a unit's shard in the
order of its gathers and reductions, which step_time.py already counts exposed
(DP_SYNC_OVERLAP = 0) -- so the transfers and the host step add to the step time in full.
DeepSpeed overlaps the gradient copy with the backward and can delay the update by a step;
this runtime does neither. The host memory of a rank is checked against host_mem_bytes /
(ranks per node) x max_memory_fraction.

Search: the offload variants of a configuration are searched where no placement of the
configuration fits in device memory without offload (its memory lower bound is over the
budget; planner.py) and the host is memory of its own (not Topology.host_is_device_memory,
as on CPU ranks, where offload frees nothing; a plan may still fix it there): an offload variant keeps every device-side cost of its configuration and
adds the transfers and the host step, so it is never faster at the same placement. Stated gap:
where the device memory only binds (a slower placement fits without offload), a variant that
lets the faster placement fit is not searched.

Frozen parameters ([Note: frozen pricing] in cost_model/memory.py) have no gradient and no
optimizer state: "optimizer" steps, holds and moves the trainable ones only (E above counts
them); "optimizer+params" holds every sharded parameter on the host, a frozen one at its own
bytes (`frozen_param_bytes`), and moves it up for each gather, with no gradient down.
"""

from __future__ import annotations

from autoplan.cost_model.memory import model_state_bytes
from autoplan.spec import TrainingSpec
from autoplan.topology import Topology

__all__ = ["OFFLOADS", "offloads_for", "check_offload", "available", "device_states",
           "host_state_bytes", "host_budget_bytes", "offload_time_s"]

OFFLOADS = ("none", "optimizer", "optimizer+params")


def offloads_for(zero_stage: int, dp: int) -> tuple[str, ...]:
    """The offloads the runtime runs at `zero_stage` with `dp` data-parallel ranks, besides
    "none" ([Note: offload])."""
    if zero_stage in (0, 1):
        return ("optimizer",)
    if zero_stage == 3 and dp > 1:
        return ("optimizer+params",)
    return ()


def check_offload(offload: str, zero_stage: int, dp: int) -> None:
    """ValueError naming the offload and the ZeRO stage when the runtime cannot run them."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload {offload!r} is not one of {OFFLOADS}")
    if offload != "none" and offload not in offloads_for(zero_stage, dp):
        raise ValueError(
            f"offload {offload!r} does not run at ZeRO-{zero_stage} with dp {dp}: 'optimizer' "
            f"runs at ZeRO 0 and 1, 'optimizer+params' at ZeRO 3 with dp > 1")


def available(topology: Topology) -> bool:
    """True when the topology gives the host figures offload is priced with."""
    d = topology.device
    return (topology.host_mem_bytes > 0 and d.host_bw_bytes_per_s > 0
            and topology.host_optimizer_bw_bytes_per_s > 0)


def _stepped(elems: float, zero_stage: int, dp: int, offload: str) -> float:
    """Parameters whose optimizer step this rank runs on the host."""
    if offload == "none":
        return 0.0
    return elems / dp if zero_stage >= 1 else elems


def device_states(states: dict[str, float], offload: str) -> dict[str, float]:
    """`states` ({"params", "grads", "optimizer"}, bytes per rank) less what `offload` keeps
    on the host."""
    if offload == "none":
        return states
    if offload == "optimizer":
        return {**states, "optimizer": 0.0}
    return {k: 0.0 for k in states}


def host_state_bytes(elems: float, zero_stage: int, dp: int, offload: str,
                     spec: TrainingSpec, *, frozen: float = 0.0,
                     frozen_param_bytes: float | None = None) -> float:
    """Host bytes of one rank holding `elems` parameters (after tp and pp), `frozen` of them
    frozen (held at `frozen_param_bytes` each, None: as a trainable one): [Note: offload]."""
    if offload == "optimizer":  # the host copies of the trainable ones it steps
        elems, frozen = elems - frozen, 0.0
    stepped = _stepped(elems, zero_stage, dp, offload)
    s = model_state_bytes(stepped, 0, 1, mixed_precision=spec.mixed_precision,
                          optimizer=spec.optimizer, recipe="fsdp2",
                          frozen_params=_stepped(frozen, zero_stage, dp, offload),
                          frozen_param_bytes=frozen_param_bytes)
    return s["params"] + s["grads"] + s["optimizer"]


def host_budget_bytes(topology: Topology, spec: TrainingSpec, ranks_on_node: int) -> float:
    """Host memory one rank may use: its node's, shared by the ranks on it, at
    max_memory_fraction."""
    return spec.max_memory_fraction * topology.host_mem_bytes / max(1, ranks_on_node)


def offload_time_s(*, offload: str, zero_stage: int, dp: int, elems: float, tensors: float,
                   gathers: int, reductions: int, spec: TrainingSpec,
                   topology: Topology, optimizer_bytes_per_param: float,
                   optimizer_ops_per_tensor: int, speed: float,
                   ranks_on_node: int, frozen: float = 0.0,
                   frozen_param_bytes: float | None = None) -> tuple[float, float]:
    """(transfers, host optimizer step) of one rank per step, seconds ([Note: offload]);
    `tensors`: parameter tensors the rank holds; `gathers`, `reductions`: the FSDP2 parameter
    all-gathers and gradient reductions per step (dp_sync.py); `speed`: DeviceSpec.speed of the busy ranks
    (CPU ranks share cores; 1 for GPUs); `ranks_on_node`: the ranks sharing the node's host
    optimizer bandwidth; `frozen` of the `elems` are frozen (`host_state_bytes`). (0, 0)
    without offload."""
    if offload == "none":
        return 0.0, 0.0
    d = topology.device
    s = model_state_bytes(1.0, 0, 1, mixed_precision=spec.mixed_precision,
                          optimizer=spec.optimizer, recipe="fsdp2")
    p, g = s["params"], s["grads"]
    p_frozen = p if frozen_param_bytes is None else frozen_param_bytes
    stepped = _stepped(elems - frozen, zero_stage, dp, offload)  # trainable: stepped
    if offload == "optimizer":
        moved = stepped * (g + p)
    else:
        moved = stepped * (gathers * p + reductions * g) + _stepped(
            frozen, zero_stage, dp, offload) * gathers * p_frozen
    # ZeRO-1 (its rows of every tensor, runtime/zero1.py) and FSDP2 step a shard of each one
    stepped_tensors = tensors
    host_bw = topology.host_optimizer_bw_bytes_per_s / max(1, ranks_on_node)
    host = (stepped * optimizer_bytes_per_param / host_bw
            + stepped_tensors * optimizer_ops_per_tensor * d.optimizer_op_s)
    return moved / d.host_bw_bytes_per_s / speed, host / speed
