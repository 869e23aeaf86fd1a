"""Cluster topology: devices, nodes and the links between them.

A `Topology` is an explicit input to planning; it is never read from the machine that plans
(../shared/DESIGN.md, "Topology"). Units are SI and in the field names: 1 GB/s = 1e9 B/s.

Bandwidths are *bus* bandwidths as nccl-tests defines them (busbw, see
../shared/reference/FORMULAS.md, "Collective costs"): the time of a collective over `n` bytes is
`n * factor / busbw + latency` with factor 2(p-1)/p for all-reduce and (p-1)/p for all-gather,
reduce-scatter and all-to-all.

Presets cite their figures; the `local-cpu` preset is fitted by `autoplan calibrate` when a
calibration file exists and otherwise uses conservative defaults marked `measured=False`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

__all__ = ["DeviceSpec", "LinkSpec", "Topology", "load_topology", "save_topology", "preset", "PRESETS"]


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
    """

    name: str
    peak_flops_per_s: dict[str, float]
    mem_bytes: float
    mem_bw_bytes_per_s: float
    matmul_efficiency: float = 1.0
    launch_latency_s: float = 0.0

    def flops_per_s(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`; raises ValueError naming the dtypes this device lists."""
        if dtype not in self.peak_flops_per_s:
            raise ValueError(
                f"device {self.name!r} has no peak FLOP/s for dtype {dtype!r}; "
                f"known: {sorted(self.peak_flops_per_s)}")
        return self.peak_flops_per_s[dtype]


@dataclass(frozen=True)
class LinkSpec:
    """One level of the interconnect.

    Attributes:
        name: "nvlink", "infiniband", "gloo-loopback", ...
        bw_bytes_per_s: all-reduce bus bandwidth per device (nccl-tests busbw), B/s.
        latency_s: per-step latency (alpha) of a collective on this level, seconds.
    """

    name: str
    bw_bytes_per_s: float
    latency_s: float


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
    """

    name: str
    num_nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    measured: bool = False
    source: str = ""

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
            value = {str(k): float(v) for k, v in value.items()}
        elif f.type in ("float", float):
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"{where}.{name}: expected a number, got {value!r}") from None
        elif f.type in ("int", int):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{where}.{name}: expected an integer, got {value!r}")
        kwargs[name] = value
    return cls(**kwargs)


def load_topology(path: str | os.PathLike) -> Topology:
    """Read a topology YAML (or JSON) file; errors name the file and the field at fault."""
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
# Figures: ../shared/reference/FORMULAS.md, "Hardware" (vendor datasheets; nccl-tests busbw).
# Latencies: NVLink ~ 5 us and InfiniBand ~ 10 us per collective step are typical nccl-tests
# small-message figures; they are approximate and marked as such.

def _dgx_a100(num_nodes: int = 1) -> Topology:
    return Topology(
        name="dgx-a100", num_nodes=num_nodes, devices_per_node=8,
        device=DeviceSpec(
            name="A100-SXM-80GB",
            peak_flops_per_s={"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12,
                              "tf32": 156e12},
            mem_bytes=80e9, mem_bw_bytes_per_s=2.04e12, matmul_efficiency=0.8,
            launch_latency_s=5e-6),
        # measured all-reduce busbw in one 8-GPU node ~235 GB/s (FORMULAS.md, Hardware)
        intra_node=LinkSpec("nvlink", bw_bytes_per_s=235e9, latency_s=5e-6),
        # 8 x 200 Gb/s HDR IB per node; ~192 GB/s all-reduce busbw across nodes (FORMULAS.md)
        inter_node=LinkSpec("infiniband", bw_bytes_per_s=192e9, latency_s=10e-6),
        source="FORMULAS.md Hardware: A100 SXM datasheet, DGX A100, nccl-tests busbw")


def _dgx_h100(num_nodes: int = 1) -> Topology:
    return Topology(
        name="dgx-h100", num_nodes=num_nodes, devices_per_node=8,
        device=DeviceSpec(
            name="H100-SXM-80GB",
            peak_flops_per_s={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12,
                              "tf32": 494e12},
            mem_bytes=80e9, mem_bw_bytes_per_s=3.35e12, matmul_efficiency=0.8,
            launch_latency_s=5e-6),
        # measured ring all-reduce busbw in one 8-GPU node ~370 GB/s (FORMULAS.md, Hardware)
        intra_node=LinkSpec("nvlink", bw_bytes_per_s=370e9, latency_s=5e-6),
        # 8 x 400 Gb/s NDR per node, 46-48 GB/s measured per NIC (FORMULAS.md, Hardware). NCCL
        # drives all 8 rails at once, so the cross-node busbw is the node's NIC aggregate,
        # 8 * 46e9 B/s -- as the DGX A100 row shows (8 x 25 GB/s HDR -> ~192 GB/s busbw).
        inter_node=LinkSpec("infiniband", bw_bytes_per_s=8 * 46e9, latency_s=10e-6),
        source="FORMULAS.md Hardware: H100 SXM datasheet, DGX H100, nccl-tests busbw")


def _h200_node(num_nodes: int = 1) -> Topology:
    return Topology(
        name="h200-node", num_nodes=num_nodes, devices_per_node=8,
        device=DeviceSpec(
            name="H200-SXM-141GB",
            peak_flops_per_s={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12,
                              "tf32": 494e12},
            mem_bytes=141e9, mem_bw_bytes_per_s=4.8e12, matmul_efficiency=0.8,
            launch_latency_s=5e-6),
        # ~367 GB/s ring all-reduce busbw in one node (FORMULAS.md, Hardware)
        intra_node=LinkSpec("nvlink", bw_bytes_per_s=367e9, latency_s=5e-6),
        inter_node=LinkSpec("infiniband", bw_bytes_per_s=8 * 46e9, latency_s=10e-6),
        source="FORMULAS.md Hardware: H200 SXM datasheet, nccl-tests busbw")


def _local_cpu(num_nodes: int = 1, devices_per_node: int = 4) -> Topology:
    """N gloo ranks on this machine. Uses `~/.cache/autoplan/local-cpu.yaml` (written by
    `autoplan calibrate`) when present; otherwise conservative defaults, `measured=False`."""
    cal = Path(os.environ.get("AUTOPLAN_CALIBRATION",
                              Path.home() / ".cache" / "autoplan" / "local-cpu.yaml"))
    if cal.is_file():
        topo = load_topology(cal)
        return dataclasses.replace(topo, num_nodes=num_nodes, devices_per_node=devices_per_node)
    return Topology(
        name="local-cpu", num_nodes=num_nodes, devices_per_node=devices_per_node,
        device=DeviceSpec(
            name="cpu-rank", peak_flops_per_s={"float32": 50e9, "bfloat16": 20e9},
            mem_bytes=4e9, mem_bw_bytes_per_s=10e9, matmul_efficiency=0.5,
            launch_latency_s=10e-6),
        intra_node=LinkSpec("gloo-loopback", bw_bytes_per_s=1e9, latency_s=50e-6),
        inter_node=LinkSpec("gloo-tcp", bw_bytes_per_s=1e9, latency_s=100e-6),
        measured=False,
        source="uncalibrated defaults (run `autoplan calibrate` to fit them)")


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
