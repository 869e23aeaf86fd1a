"""Cluster topology: devices, nodes and the links between them.

A `Topology` is an explicit input to planning; it is never read from the machine that plans
(docs/design.md, "Topology"). Units are SI and in the field names: 1 GB/s = 1e9 B/s.

Bandwidths are *bus* bandwidths as nccl-tests defines them (busbw, see
docs/reference/FORMULAS.md, "Collective costs"): the time of a collective over `n` bytes is
`n * factor / busbw + latency` with factor 2(p-1)/p for all-reduce and (p-1)/p for all-gather,
reduce-scatter and all-to-all.

Presets cite their figures; the `local-cpu` preset is fitted by `autoplan calibrate` when a
calibration file exists and otherwise uses conservative defaults marked `measured=False`.

The device and link types are autoplan/hardware.py (re-exported here).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from autoplan.hardware import DeviceSpec, LinkSpec

__all__ = ["DeviceSpec", "LinkSpec", "Topology", "load_topology", "save_topology", "preset", "PRESETS"]


@dataclass(frozen=True)
class Topology:
    """A homogeneous cluster: `num_nodes` nodes of `devices_per_node` devices.

    Mesh axes are mapped innermost-first onto the levels: a group of consecutive ranks that fits
    in one node communicates over `intra_node`; a group that spans nodes is hierarchical.

    Attributes:
        name: preset name or file stem.
        num_nodes, devices_per_node: cluster shape; world size is their product.
        device: the accelerator of every rank.
        intra_node: link inside a node (NVLink/NVSwitch, shared memory for CPU ranks).
        inter_node: link across nodes (InfiniBand/RoCE).
        measured: True when the figures were fitted by `autoplan calibrate` on real hardware.
        source: where the figures come from (citation or calibration file).
        host_mem_bytes: host (CPU) memory of one node, bytes, which its devices share for
            offloaded states (cost_model/offload.py). 0: not given (no offload).
        host_optimizer_bw_bytes_per_s: bytes per second of one node's host running the
            memory-bound optimizer pass of offloaded states (cost_model/step_time.py
            OPTIMIZER_BYTES_PER_PARAM per parameter), shared by the ranks of the node that
            step at once, B/s. 0: not given (no offload). For CPU ranks: their memory
            bandwidth times the ranks of the node (each rank's own, shared cores priced by
            DeviceSpec.speed as for any compute).
        host_is_device_memory: the host memory is the devices' own (CPU ranks): offloading
            moves states within the same RAM and frees nothing, so the planner never chooses
            it to make a plan fit; a plan can still fix it (the mechanics run and are
            accounted alike).
    """

    name: str
    num_nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    measured: bool = False
    source: str = ""
    host_mem_bytes: float = 0.0
    host_optimizer_bw_bytes_per_s: float = 0.0
    host_is_device_memory: bool = False

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.devices_per_node < 1:
            raise ValueError(
                f"topology {self.name!r}: num_nodes={self.num_nodes} and "
                f"devices_per_node={self.devices_per_node} must both be >= 1")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    def with_nodes(self, num_nodes: int) -> "Topology":
        """The same cluster with another node count."""
        return dataclasses.replace(self, num_nodes=num_nodes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(data: dict, where: str = "topology") -> "Topology":
        """Build from a plain dict (YAML/JSON); raises ValueError naming a missing or bad field."""
        return _from_dict(Topology, data, where)


class TopologyWarning(UserWarning):
    """A topology value outside the range of any real device or link (a unit slip:
    `mem_bytes: 80` for 80 GB, `latency_s: 10` for 10 us): planned with as given."""


# [Note: plausible ranges] field -> (low, high, what): the range real hardware spans, wide
# enough for a CPU rank of `autoplan calibrate` and the largest GPU node; outside it a value
# is more likely a unit slip than a device (TopologyWarning). 0 stays allowed where the field
# means "not given" (the host figures).
_PLAUSIBLE = {
    "mem_bytes": (1e8, 1e13, "device memory, bytes (80 GB is 80e9)"),
    "mem_bw_bytes_per_s": (1e9, 1e14, "memory bandwidth, B/s (3.35 TB/s is 3.35e12)"),
    "peak_flops_per_s": (1e9, 1e17, "dense peak, FLOP/s (989 TFLOP/s is 989e12)"),
    "bw_bytes_per_s": (1e6, 1e13, "link bandwidth per device and direction, B/s (a 400 Gb/s "
                                  "NIC is 50e9)"),
    "latency_s": (0.0, 1e-2, "latency of one collective step, seconds (5 us is 5e-6)"),
    "launch_latency_s": (0.0, 1e-2, "floor per op, seconds (5 us is 5e-6)"),
    "matmul_efficiency": (0.0, 1.0, "fraction of the peak a large matmul reaches"),
    "host_mem_bytes": (1e8, 1e15, "host memory per node, bytes (2 TB is 2e12)"),
    "host_bw_bytes_per_s": (1e8, 1e13, "host <-> device bandwidth per direction, B/s"),
}


def _check_plausible(name: str, value: float, where: str) -> None:
    """Warn (TopologyWarning) naming the field, the value and the range when `value` of field
    `name` is outside [Note: plausible ranges]; 0 for an optional host figure is "not
    given"."""
    import warnings

    if name not in _PLAUSIBLE or (value == 0 and name in _OPTIONAL_HOST_FIELDS):
        return
    low, high, what = _PLAUSIBLE[name]
    if not low <= value <= high:
        warnings.warn(f"{where}: {value:g} is outside {low:g} .. {high:g}, the range of real "
                      f"hardware for {name} ({what}); planned with it as given -- check the "
                      "unit", TopologyWarning, stacklevel=4)


def _from_dict(cls, data, where: str):
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    kwargs = {}
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; expected {sorted(known)}")
    nested = {"device": DeviceSpec, "intra_node": LinkSpec, "inter_node": LinkSpec}
    for name, f in known.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{where}: missing required field {name!r}")
            continue
        value = data[name]
        if name in nested:
            value = _from_dict(nested[name], value, f"{where}.{name}")
        elif name == "peak_flops_per_s":
            if not isinstance(value, dict) or not value:
                raise ValueError(f"{where}.{name}: expected a mapping dtype -> FLOP/s")
            value = {str(k): _positive(v, f"{where}.{name}[{k}]") for k, v in value.items()}
            for k, v in value.items():
                _check_plausible(name, v, f"{where}.{name}[{k}]")
        elif name == "shared_speed":
            value = _int_keyed(value, f"{where}.{name}", lambda v, w: _positive(v, w))
        elif name in ("sync_skew_s", "sync_skew_slope"):
            value = _int_keyed(value, f"{where}.{name}", _non_negative)
        elif name == "elementwise_s_per_elem":
            if not isinstance(value, dict):
                raise ValueError(f"{where}.{name}: expected a mapping op -> seconds")
            value = {str(k): _positive(v, f"{where}.{name}[{k}]") for k, v in value.items()}
        elif name == "collectives":
            value = _collectives(value, f"{where}.{name}")
        elif f.type in ("float", float):
            # times (latencies, overheads) may be 0, and the host figures (0: not given);
            # sizes, rates and fractions must be > 0
            check = _non_negative if (name.endswith("_s") and not name.endswith("_per_s")) \
                or name in _OPTIONAL_HOST_FIELDS else _positive
            value = check(value, f"{where}.{name}")
            _check_plausible(name, value, f"{where}.{name}")
        elif f.type in ("bool", bool):
            if not isinstance(value, bool):
                raise ValueError(f"{where}.{name}: expected true or false, got {value!r}")
        elif f.type in ("int", int):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}.{name}: expected an integer >= 1, got {value!r}")
        kwargs[name] = value
    return cls(**kwargs)


_OPTIONAL_HOST_FIELDS = frozenset({"host_bw_bytes_per_s", "host_optimizer_bw_bytes_per_s",
                                   "host_mem_bytes"})


def _number(value, where: str, *, zero_ok: bool) -> float:
    """`value` as a float > 0 (>= 0 with zero_ok); ValueError naming `where` otherwise."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected a number, got {value!r}") from None
    if not (out >= 0 if zero_ok else out > 0):
        raise ValueError(f"{where}: expected a number {'>=' if zero_ok else '>'} 0, "
                         f"got {value!r}")
    return out


def _positive(value, where: str) -> float:
    return _number(value, where, zero_ok=False)


def _non_negative(value, where: str) -> float:
    return _number(value, where, zero_ok=True)




def _int_keyed(value, where: str, convert) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(value).__name__}")
    out = {}
    for k, v in value.items():
        try:
            key = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected integer keys, got {k!r}") from None
        out[key] = convert(v, f"{where}[{key}]")
    return out


def _collectives(value, where: str) -> dict:
    """{kind: {group size: {concurrent groups: [latency_s, bw_bytes_per_s]}}} (LinkSpec)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping kind -> fits, got {type(value).__name__}")

    def pair(v, w):
        if not isinstance(v, (list, tuple)) or len(v) != 2:
            raise ValueError(f"{w}: expected [latency_s, bw_bytes_per_s], got {v!r}")
        latency = float(v[0])
        if latency < 0:
            raise ValueError(f"{w}: latency_s {latency} must be >= 0")
        return [latency, _positive(v[1], w)]

    return {str(kind): _int_keyed(fits, f"{where}.{kind}",
                                  lambda g, w: _int_keyed(g, w, pair))
            for kind, fits in value.items()}


def load_topology(path: str | os.PathLike) -> Topology:
    """Read a topology YAML (or JSON) file (examples/topology.yaml shows every field with its
    unit); raises ValueError naming the file and the field at fault."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read topology file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"topology file {path} is not valid YAML: {e}") from None
    return Topology.from_dict(data, where=str(path))


def save_topology(topo: Topology, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(topo.to_dict(), sort_keys=False))


# --- presets ---------------------------------------------------------------------------------
# Figures: docs/reference/FORMULAS.md, "Hardware" (vendor datasheets; nccl-tests busbw).
# Latencies: NVLink ~ 5 us and InfiniBand ~ 10 us per collective step are typical nccl-tests
# small-message figures; they are approximate and marked as such.
#
# Host figures (CPU offload, cost_model/offload.py):
# - host_bw_bytes_per_s: the GPU's PCIe x16 link per direction from its datasheet (A100: PCIe
#   Gen4 64 GB/s, H100 / H200 SXM: PCIe Gen5 128 GB/s, both bidirectional: 32 and 64 GB/s per
#   direction) times PCIE_EFFICIENCY.
# - host_mem_bytes: system memory per node from NVIDIA's datasheets: DGX A100 640GB 2 TB (the
#   320GB model has 1 TB), DGX H100 2 TB, DGX H200 2 TB.
# - host_optimizer_bw_bytes_per_s: the node's theoretical DRAM bandwidth (two sockets x 8
#   channels: DGX A100's AMD EPYC 7742 DDR4-3200, 8 x 25.6 GB/s = 204.8 GB/s per socket; DGX
#   H100 / H200's Intel Xeon Platinum 8480C DDR5-4800, 8 x 38.4 = 307.2 GB/s per socket) times
#   HOST_MEM_EFFICIENCY, shared by the GPUs of the node that step at once.

PCIE_EFFICIENCY = 0.8
"""Fraction of the raw PCIe rate a pinned host <-> device copy reaches. Assumption, not
measured here: 128b/130b encoding and TLP headers leave ~80% of the raw Gen4/Gen5 rate for
DMA payload (cudaMemcpy bandwidthTest figures of ~25 GB/s on Gen4 and ~50-55 GB/s on Gen5 x16
are of that order)."""

HOST_MEM_EFFICIENCY = 0.5
"""Fraction of the host's theoretical DRAM bandwidth its AdamW pass reaches. Assumption, not
measured: STREAM on two-socket servers reaches ~60-80% of theoretical, and the offloaded
optimizer shares the host memory with the PCIe transfers landing in it."""


def _pcie(raw_bidir_bytes_per_s: float) -> float:
    """host_bw_bytes_per_s from a datasheet's bidirectional PCIe rate (see above)."""
    return PCIE_EFFICIENCY * raw_bidir_bytes_per_s / 2

def _dgx_a100(num_nodes: int = 1) -> Topology:
    return Topology(
        name="dgx-a100", num_nodes=num_nodes, devices_per_node=8,
        device=DeviceSpec(
            name="A100-SXM-80GB",
            peak_flops_per_s={"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12,
                              "tf32": 156e12},
            mem_bytes=80e9, mem_bw_bytes_per_s=2.04e12, matmul_efficiency=0.8,
            launch_latency_s=5e-6, fuses_pointwise=True,
            host_bw_bytes_per_s=_pcie(64e9)),
        # measured all-reduce busbw in one 8-GPU node ~235 GB/s (FORMULAS.md, Hardware)
        intra_node=LinkSpec("nvlink", bw_bytes_per_s=235e9, latency_s=5e-6),
        # 8 x 200 Gb/s HDR IB per node; ~192 GB/s all-reduce busbw across nodes (FORMULAS.md)
        inter_node=LinkSpec("infiniband", bw_bytes_per_s=192e9, latency_s=10e-6),
        source="FORMULAS.md Hardware: A100 SXM datasheet, DGX A100, nccl-tests busbw",
        host_mem_bytes=2e12,
        host_optimizer_bw_bytes_per_s=HOST_MEM_EFFICIENCY * 2 * 8 * 25.6e9)


def _dgx_h100(num_nodes: int = 1) -> Topology:
    return Topology(
        name="dgx-h100", num_nodes=num_nodes, devices_per_node=8,
        device=DeviceSpec(
            name="H100-SXM-80GB",
            # float8: dense FP8 tensor cores (the datasheet's 3,958 TFLOP/s is with sparsity)
            peak_flops_per_s={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12,
                              "tf32": 494e12, "float8": 1979e12},
            mem_bytes=80e9, mem_bw_bytes_per_s=3.35e12, matmul_efficiency=0.8,
            launch_latency_s=5e-6, fuses_pointwise=True,
            host_bw_bytes_per_s=_pcie(128e9)),
        # measured ring all-reduce busbw in one 8-GPU node ~370 GB/s (FORMULAS.md, Hardware)
        intra_node=LinkSpec("nvlink", bw_bytes_per_s=370e9, latency_s=5e-6),
        # 8 x 400 Gb/s NDR per node, 46-48 GB/s measured per NIC (FORMULAS.md, Hardware). NCCL
        # drives all 8 rails at once, so the cross-node busbw is the node's NIC aggregate,
        # 8 * 46e9 B/s -- as the DGX A100 row shows (8 x 25 GB/s HDR -> ~192 GB/s busbw).
        inter_node=LinkSpec("infiniband", bw_bytes_per_s=8 * 46e9, latency_s=10e-6),
        source="FORMULAS.md Hardware: H100 SXM datasheet, DGX H100, nccl-tests busbw",
        host_mem_bytes=2e12,
        host_optimizer_bw_bytes_per_s=HOST_MEM_EFFICIENCY * 2 * 8 * 38.4e9)


def _h200_node(num_nodes: int = 1) -> Topology:
    return Topology(
        name="h200-node", num_nodes=num_nodes, devices_per_node=8,
        device=DeviceSpec(
            name="H200-SXM-141GB",
            peak_flops_per_s={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12,
                              "tf32": 494e12, "float8": 1979e12},
            mem_bytes=141e9, mem_bw_bytes_per_s=4.8e12, matmul_efficiency=0.8,
            launch_latency_s=5e-6, fuses_pointwise=True,
            host_bw_bytes_per_s=_pcie(128e9)),
        # ~367 GB/s ring all-reduce busbw in one node (FORMULAS.md, Hardware)
        intra_node=LinkSpec("nvlink", bw_bytes_per_s=367e9, latency_s=5e-6),
        inter_node=LinkSpec("infiniband", bw_bytes_per_s=8 * 46e9, latency_s=10e-6),
        source="FORMULAS.md Hardware: H200 SXM datasheet, nccl-tests busbw",
        host_mem_bytes=2e12,
        host_optimizer_bw_bytes_per_s=HOST_MEM_EFFICIENCY * 2 * 8 * 38.4e9)


def _local_cpu(num_nodes: int = 1, devices_per_node: int = 4) -> Topology:
    """N gloo ranks on this machine. Uses `~/.cache/autoplan/local-cpu.yaml` (written by
    `autoplan calibrate`) when present; otherwise conservative defaults, `measured=False`
    (assumptions, not measured: a 16 GB machine whose RAM the ranks share, 50 GFLOP/s fp32 per
    rank, 10 GB/s memory, 1 GB/s gloo). The ranks share the RAM, so mem_bytes follows the rank
    count either way.

    The host of CPU offload is the same RAM ([Note: offload] in cost_model/offload.py): a file
    without host figures gets them from its own -- transfers are memcpy at half the memory
    bandwidth (each byte read and written), the host optimizer pass at the memory bandwidth,
    host memory the node's RAM."""
    cal = Path(os.environ.get("AUTOPLAN_CALIBRATION",
                              Path.home() / ".cache" / "autoplan" / "local-cpu.yaml"))
    if cal.is_file():
        topo = load_topology(cal)
        # The ranks share the machine's RAM: the file's per-rank figure is for its own rank
        # count; the node total divided by this one is the derived figure.
        mem_bytes = topo.device.mem_bytes * topo.devices_per_node / devices_per_node
        return _cpu_host(dataclasses.replace(
            topo, num_nodes=num_nodes, devices_per_node=devices_per_node,
            device=dataclasses.replace(topo.device, mem_bytes=mem_bytes)))
    return _cpu_host(Topology(
        name="local-cpu", num_nodes=num_nodes, devices_per_node=devices_per_node,
        device=DeviceSpec(
            name="cpu-rank", peak_flops_per_s={"float32": 50e9, "bfloat16": 20e9,
                                               "float16": 20e9},
            mem_bytes=16e9 / devices_per_node, mem_bw_bytes_per_s=10e9, matmul_efficiency=0.5,
            launch_latency_s=10e-6),
        intra_node=LinkSpec("gloo-loopback", bw_bytes_per_s=1e9, latency_s=50e-6),
        inter_node=LinkSpec("gloo-tcp", bw_bytes_per_s=1e9, latency_s=100e-6),
        measured=False,
        source="uncalibrated defaults (run `autoplan calibrate` to fit them)"))


def _cpu_host(topo: Topology) -> Topology:
    """CPU ranks' host figures where not given: the host is their own RAM (see _local_cpu); their
    collectives are gloo's, which has no all-to-all (`DeviceSpec.all_to_all`). An FP8 peak
    where none is given: the bf16 one -- the CPU's `torch._scaled_mm` widens its FP8 operands
    and runs a float GEMM (an assumption, not measured; `autoplan calibrate` fits none)."""
    d, n = topo.device, topo.devices_per_node
    if "float8" not in d.peak_flops_per_s and "bfloat16" in d.peak_flops_per_s:
        d = dataclasses.replace(d, peak_flops_per_s={**d.peak_flops_per_s,
                                                     "float8": d.peak_flops_per_s["bfloat16"]})
    return dataclasses.replace(
        topo, host_is_device_memory=True,
        host_mem_bytes=topo.host_mem_bytes or d.mem_bytes * n,
        host_optimizer_bw_bytes_per_s=topo.host_optimizer_bw_bytes_per_s
        or d.mem_bw_bytes_per_s * n,
        device=dataclasses.replace(
            d, host_bw_bytes_per_s=d.host_bw_bytes_per_s or d.mem_bw_bytes_per_s / 2,
            all_to_all=False))


PRESETS = {
    "dgx-a100": _dgx_a100,
    "dgx-h100": _dgx_h100,
    "h200-node": _h200_node,
    "local-cpu": _local_cpu,
}


def preset(name: str, num_nodes: int = 1, **kwargs) -> Topology:
    """A named preset with `num_nodes` nodes; raises ValueError listing the known names."""
    if name not in PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name](num_nodes=num_nodes, **kwargs)
