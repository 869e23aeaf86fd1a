"""The hardware a `Topology` (autoplan/topology.py) is made of: one accelerator or CPU rank
(`DeviceSpec`) and one level of the interconnect (`LinkSpec`). Units are SI and in the field
names: 1 GB/s = 1e9 B/s; bandwidths are nccl-tests bus bandwidths (autoplan/topology.py says
how a collective's time follows from them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DeviceSpec", "LinkSpec"]


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU rank).

    Attributes:
        name: e.g. "H100-SXM-80GB".
        peak_flops_per_s: dense peak FLOP/s per dtype name ("bfloat16", "float32", ...).
        mem_bytes: usable device memory in bytes.
        mem_bw_bytes_per_s: device memory bandwidth in B/s.
        matmul_efficiency: fraction of peak a large matmul reaches (1.0 if unknown).
        launch_latency_s: per-op floor (kernel launch / dispatch overhead), seconds.
        matmul_half_dim: smallest matmul dim at which a matmul reaches half of
            `matmul_efficiency` (cost_model/compute.py, [Note: matmul efficiency curve]). The
            GPU presets keep the default 128, an assumption (one tensor-core tile edge); for CPU
            ranks `autoplan calibrate` fits it (a one-thread CPU matmul saturates near 16-32).
        shared_speed: {n: fraction of its solo speed a device keeps while n devices of its node
            compute at once}. Empty for devices that share nothing they compute with (GPUs:
            every n gives 1.0). CPU ranks of one machine share its cores, caches and memory
            bandwidth: `autoplan calibrate` measures the throughput of n ranks at once for
            n = 1..devices_per_node (0.5 for 4 ranks on 2 free cores). See `speed`.
        elementwise_s_per_elem: {aten op name: seconds per output element} of the elementwise
            ops whose arithmetic rather than memory traffic can bound them (tanh, exp, erf, pow,
            ...; compute.TRANSCENDENTAL_OPS), fitted by `autoplan calibrate` for CPU ranks (a
            one-thread tanh takes ~2.5 ns per element, 7x a multiply's memory traffic). Empty for
            GPUs: their special-function units outpace memory, so the roofline's byte term bounds
            these ops (assumption, not measured).
        dtensor_op_overhead_s: host time an op costs more on DTensors (tensor parallelism:
            sharding propagation, placement checks, in Python) than on plain tensors, seconds per
            op and direction. Fitted by `autoplan calibrate` for CPU ranks, where the host also
            runs the kernels (~20-40 us). 0 for GPUs: the host runs ahead of the device, so this
            time overlaps kernels of the sizes planned there (assumption, not measured).
        sync_skew_s: {n: seconds a rank waits, at each blocking collective, for the slowest of
            its peers when n devices of its node compute between collectives} -- stragglers
            from time slicing and other processes, beyond the collective's own (lock-step)
            time. Fitted by `autoplan calibrate` for CPU ranks (a compute chunk, then a 4-byte
            all_reduce, vs the chunks alone). Empty for GPUs: kernels queue behind each other
            on the device, so host jitter does not reach the collective (assumption, not
            measured). See `skew`.
        sync_skew_slope: {n: seconds of that wait per second of compute (wall time, at n busy
            devices) since the previous synchronisation} -- on cores shared by time slicing,
            ranks drift apart in proportion to how long they compute without meeting, so a
            collective after a long compute waits longer than one after a short one. Fitted by
            `autoplan calibrate` for CPU ranks together with `sync_skew_s` (then the
            intercept), from the same test at two chunk lengths; empty for GPUs (as
            `sync_skew_s`). See `skew_slope`.
        optimizer_op_s: host time of one op of the optimizer step on one parameter tensor,
            beyond its memory traffic (dispatch of an in-place op without autograd), seconds;
            the step costs cost_model.step_time.OPTIMIZER_OPS_PER_TENSOR of them per tensor (torch's
            single-tensor AdamW on CPU). Fitted by `autoplan calibrate` for CPU ranks. 0 for
            GPUs: foreach / fused optimizers update all tensors in a few kernels and the host
            runs ahead (assumption, not measured).
        dtensor_optimizer_op_s: the same for DTensor parameters (tensor parallelism, FSDP2's
            ZeRO-0/2/3), whose every op also goes through DTensor dispatch. Fitted by
            `autoplan calibrate`; 0 for GPUs (as above).
        dtensor_redistribute_s: host time of one DTensor redistribution beyond its collective
            (the Redistribute autograd function, functional-collective wrappers, reassembling a
            non-leading shard dim), seconds. Fitted by `autoplan calibrate` for CPU ranks; 0
            for GPUs (the host runs ahead of the device; assumption, not measured).
        fuses_pointwise: chains of memory-bound ops run as fused kernels, each moving only
            what enters and leaves the chain (capture/fusion.py, [Note: pointwise fusion]).
            True for the GPU presets: the runs they are held to (bench/published.py:
            Megatron-LM, Megatron-DeepSpeed) fuse them, as Transformer Engine and
            torch.compile do. False for CPU ranks, which run one kernel per op as calibrated.
        all_to_all: the ranks' collective library has all-to-all, and DTensor turns a Shard(i) ->
            Shard(j) redistribution into one (`shard_dim_alltoall` in
            torch/distributed/tensor/_collective_utils.py: NCCL on a GPU mesh): each rank sends
            and receives its local tensor's bytes. False for CPU ranks (gloo has none):
            DTensor all-gathers the whole tensor and keeps its chunk. The cost model prices the
            one the ranks run (cost_model/comm.py `redistribute_time_s`, traffic_tp.py) and the
            dry run runs it ([Note: dry run] in runtime/dryrun.py). Default True: any device but
            the CPU ranks' (topology.py `_cpu_host` sets False).
        host_bw_bytes_per_s: host <-> device bandwidth of this device, per direction, B/s
            (its PCIe link: the transfers of CPU offload, cost_model/offload.py). 0: not given, and
            no plan offloads to the host. For CPU ranks the "host" is the same memory as the
            device, so a transfer is a memcpy: half the memory bandwidth (it reads and writes
            each byte).
    """

    name: str
    peak_flops_per_s: dict[str, float]
    mem_bytes: float
    mem_bw_bytes_per_s: float
    matmul_efficiency: float = 1.0
    launch_latency_s: float = 0.0
    matmul_half_dim: float = 128.0
    shared_speed: dict[int, float] = field(default_factory=dict)
    elementwise_s_per_elem: dict[str, float] = field(default_factory=dict)
    dtensor_op_overhead_s: float = 0.0
    sync_skew_s: dict[int, float] = field(default_factory=dict)
    sync_skew_slope: dict[int, float] = field(default_factory=dict)
    optimizer_op_s: float = 0.0
    dtensor_optimizer_op_s: float = 0.0
    dtensor_redistribute_s: float = 0.0
    fuses_pointwise: bool = False
    host_bw_bytes_per_s: float = 0.0
    all_to_all: bool = True

    def flops_per_s(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`; raises ValueError naming the dtypes this device lists."""
        if dtype not in self.peak_flops_per_s:
            raise ValueError(
                f"device {self.name!r} has no peak FLOP/s for dtype {dtype!r}; "
                f"known: {sorted(self.peak_flops_per_s)}")
        return self.peak_flops_per_s[dtype]

    def speed(self, busy_devices: int) -> float:
        """Fraction of its solo speed a device keeps while `busy_devices` devices of its node
        compute at once: the `shared_speed` entry; 1.0 without entries. A count beyond the
        measured ones takes the nearest measured count below it, scaled by measured / busy (a
        fixed total throughput shared by more devices)."""
        if busy_devices in self.shared_speed:
            return self.shared_speed[busy_devices]
        if busy_devices <= 1 or not self.shared_speed:
            return 1.0
        below = [n for n in self.shared_speed if n < busy_devices]
        if not below:
            return 1.0
        n = max(below)
        return self.shared_speed[n] * n / busy_devices

    def skew(self, busy_devices: int) -> float:
        """Expected wait for stragglers at one blocking collective while `busy_devices`
        devices of the node compute (`sync_skew_s`), seconds: the entry, else the nearest
        measured count below it; 0.0 without entries or for one device."""
        return _at_or_below(self.sync_skew_s, busy_devices)

    def skew_slope(self, busy_devices: int) -> float:
        """Straggler wait per second of compute between synchronisations while
        `busy_devices` devices of the node compute (`sync_skew_slope`), seconds per second: the
        entry, else the nearest measured count below it; 0.0 without entries or for one
        device."""
        return _at_or_below(self.sync_skew_slope, busy_devices)


def _at_or_below(by_count: dict[int, float], busy_devices: int) -> float:
    """The entry of `by_count` for `busy_devices`, else for the nearest count below it; 0.0
    without one or for a single device."""
    below = [n for n in by_count if n <= busy_devices]
    return by_count[max(below)] if below and busy_devices > 1 else 0.0


@dataclass(frozen=True)
class LinkSpec:
    """One level of the interconnect.

    Attributes:
        name: "nvlink", "infiniband", "gloo-loopback", ...
        bw_bytes_per_s: all-reduce bus bandwidth per device (nccl-tests busbw), B/s.
        latency_s: per-step latency (alpha) of a collective on this level, seconds.
        collectives: measured alpha-beta fits per collective, for links whose collectives are
            not the ring algorithm at one busbw (gloo on CPU ranks: other algorithms per kind,
            and cores shared by all groups at once): {kind: {group size p: {concurrent groups
            g: [latency_s, bw_bytes_per_s]}}}, where g groups of p ranks ran the collective at
            the same time, as SPMD runs every group of a mesh axis. Fitted by
            `autoplan calibrate`; comm.py uses an entry with the kind's bus-bandwidth factor and
            latency steps ([Note: collective cost] there) and falls back to
            bw_bytes_per_s / latency_s. Empty for the GPU presets.
    """

    name: str
    bw_bytes_per_s: float
    latency_s: float
    collectives: dict[str, dict[int, dict[int, list[float]]]] = field(default_factory=dict)

    def fit(self, kind: str, group_size: int,
            concurrent_groups: int) -> tuple[float, float]:
        """(latency_s, bw_bytes_per_s) of `kind` on `group_size` ranks with
        `concurrent_groups` groups at once: the measured entry, else the one of the nearest
        measured number of groups, else the link's own figures."""
        by_groups = self.collectives.get(kind, {}).get(group_size)
        if not by_groups:
            return self.latency_s, self.bw_bytes_per_s
        g = min(by_groups, key=lambda n: (abs(n - concurrent_groups), n))
        latency_s, bw = by_groups[g]
        return float(latency_s), float(bw)
