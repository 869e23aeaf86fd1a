"""Topology presets against FORMULAS.md "Hardware", and the YAML file format."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from autoplan.topology import PRESETS, Topology, load_topology, preset, save_topology

# FORMULAS.md, Hardware: (dense bf16 FLOP/s, HBM bytes, HBM B/s, intra-node all-reduce busbw)
HARDWARE = {
    "dgx-a100": ("A100-SXM-80GB", 312e12, 80e9, 2.04e12, 235e9),
    "dgx-h100": ("H100-SXM-80GB", 989e12, 80e9, 3.35e12, 370e9),
    "h200-node": ("H200-SXM-141GB", 989e12, 141e9, 4.8e12, 367e9),
}


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_preset_figures_match_formulas_md(name):
    device_name, bf16, mem, mem_bw, intra_bw = HARDWARE[name]
    topo = preset(name, num_nodes=4)
    assert topo.device.name == device_name
    assert topo.device.flops_per_s("bfloat16") == bf16
    assert topo.device.mem_bytes == mem
    assert topo.device.mem_bw_bytes_per_s == mem_bw
    assert topo.intra_node.bw_bytes_per_s == intra_bw
    assert (topo.num_nodes, topo.devices_per_node, topo.world_size) == (4, 8, 32)
    assert topo.source  # every preset cites its figures


def test_inter_node_figures():
    # DGX A100: ~192 GB/s all-reduce busbw across nodes (8 x 200 Gb/s HDR = 200 GB/s raw)
    assert preset("dgx-a100").inter_node.bw_bytes_per_s == 192e9
    # DGX H100 / H200: 8 NDR NICs at 46-48 GB/s measured each
    for name in ("dgx-h100", "h200-node"):
        bw = preset(name).inter_node.bw_bytes_per_s
        assert 8 * 46e9 <= bw <= 8 * 48e9


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_yaml_round_trip(name, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPLAN_CALIBRATION", str(tmp_path / "absent.yaml"))
    topo = preset(name, num_nodes=2)
    path = tmp_path / f"{name}.yaml"
    save_topology(topo, path)
    assert load_topology(path) == topo
    assert Topology.from_dict(topo.to_dict()) == topo


def _saved(tmp_path, data):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_missing_field_is_named(tmp_path):
    data = preset("dgx-h100").to_dict()
    del data["device"]["mem_bw_bytes_per_s"]
    with pytest.raises(ValueError, match="device.*'mem_bw_bytes_per_s'"):
        load_topology(_saved(tmp_path, data))
    data = preset("dgx-h100").to_dict()
    del data["num_nodes"]
    with pytest.raises(ValueError, match="'num_nodes'"):
        load_topology(_saved(tmp_path, data))


def test_bad_fields_are_named(tmp_path):
    data = preset("dgx-h100").to_dict()
    data["intra_node"]["bw_bytes_per_s"] = "fast"
    with pytest.raises(ValueError, match="intra_node.bw_bytes_per_s"):
        load_topology(_saved(tmp_path, data))
    data = preset("dgx-h100").to_dict()
    data["gpus"] = 8
    with pytest.raises(ValueError, match="unknown field.*'gpus'"):
        load_topology(_saved(tmp_path, data))
    with pytest.raises(ValueError, match="cannot read topology file"):
        load_topology(tmp_path / "nowhere.yaml")
    with pytest.raises(ValueError, match="num_nodes=0"):
        dataclasses.replace(preset("dgx-h100"), num_nodes=0)
    # numbers out of range are named, not priced (a negative bandwidth made negative steps)
    for path, value, want in ((("intra_node", "bw_bytes_per_s"), -3.7e11, "> 0"),
                              (("inter_node", "latency_s"), -1e-6, ">= 0"),
                              (("device", "peak_flops_per_s", "bfloat16"), -1, "> 0"),
                              (("device", "mem_bytes"), 0, "> 0"),
                              (("devices_per_node",), 0, ">= 1")):
        data = preset("dgx-h100").to_dict()
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(ValueError, match=rf"{path[-1]}.*{want}"):
            load_topology(_saved(tmp_path, data))


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="'dgx-b200'.*dgx-a100.*dgx-h100.*local-cpu"):
        preset("dgx-b200")


def test_unknown_dtype_lists_known():
    with pytest.raises(ValueError, match="'float8'.*bfloat16"):
        preset("dgx-a100").device.flops_per_s("float8")
    assert preset("dgx-h100").device.flops_per_s("float8") == 2 * preset(
        "dgx-h100").device.flops_per_s("bfloat16") + 1e12  # 1,979 dense vs 989 TFLOP/s

def test_local_cpu_uses_calibration_when_present(tmp_path, monkeypatch):
    cal = tmp_path / "local-cpu.yaml"
    monkeypatch.setenv("AUTOPLAN_CALIBRATION", str(cal))
    default = preset("local-cpu")
    assert not default.measured and default.devices_per_node == 4
    fitted = dataclasses.replace(default, measured=True, source="fitted by calibrate",
                                 num_nodes=1, devices_per_node=2)
    save_topology(fitted, cal)
    topo = preset("local-cpu", num_nodes=2, devices_per_node=8)
    assert topo.measured and topo.source == "fitted by calibrate"
    assert (topo.num_nodes, topo.devices_per_node) == (2, 8)


def test_with_nodes():
    topo = preset("dgx-h100").with_nodes(2048)
    assert topo.world_size == 16384 and topo.device == preset("dgx-h100").device


def test_measured_fields_round_trip_and_speed(tmp_path):
    """The fields `autoplan calibrate` fits for CPU ranks survive YAML, and DeviceSpec.speed
    scales a fixed total throughput beyond the measured rank counts."""
    base = preset("dgx-h100")
    device = dataclasses.replace(base.device, matmul_half_dim=24.0,
                                 shared_speed={1: 1.0, 2: 0.98, 4: 0.5},
                                 elementwise_s_per_elem={"tanh": 2.5e-9},
                                 dtensor_op_overhead_s=3e-5, sync_skew_s={2: 4e-4, 4: 2e-3},
                                 sync_skew_slope={2: 0.02, 4: 0.07})
    link = dataclasses.replace(base.intra_node, collectives={
        "all_reduce": {2: {1: [1e-4, 1e9], 2: [2e-4, 7e8]}}})
    topo = dataclasses.replace(base, device=device, intra_node=link)
    path = tmp_path / "t.yaml"
    save_topology(topo, path)
    assert load_topology(path) == topo
    assert [device.speed(n) for n in (1, 2, 4)] == [1.0, 0.98, 0.5]
    assert device.speed(8) == pytest.approx(0.25) and device.speed(3) == pytest.approx(0.98 * 2 / 3)
    assert base.device.speed(8) == 1.0  # GPUs share nothing
    assert [device.skew(n) for n in (1, 2, 3, 4, 8)] == [0.0, 4e-4, 4e-4, 2e-3, 2e-3]
    assert base.device.skew(8) == 0.0
    assert [device.skew_slope(n) for n in (1, 2, 3, 4, 8)] == [0.0, 0.02, 0.02, 0.07, 0.07]
    assert base.device.skew_slope(8) == 0.0
    assert link.fit("all_reduce", 2, 2) == (2e-4, 7e8)
    assert link.fit("all_reduce", 2, 3) == (2e-4, 7e8)  # nearest measured group count
    assert link.fit("all_gather", 2, 1) == (base.intra_node.latency_s, base.intra_node.bw_bytes_per_s)
    data = topo.to_dict()
    data["device"]["sync_skew_s"] = {2: -1e-3}
    with pytest.raises(ValueError, match=r"device\.sync_skew_s.*>= 0"):
        load_topology(_saved(tmp_path, data))
    data = topo.to_dict()
    data["device"]["sync_skew_slope"] = {4: -0.1}
    with pytest.raises(ValueError, match=r"device\.sync_skew_slope.*>= 0"):
        load_topology(_saved(tmp_path, data))
    data = topo.to_dict()
    data["intra_node"]["collectives"]["all_reduce"][2][1] = [1e-4]
    with pytest.raises(ValueError, match=r"collectives.*latency_s, bw_bytes_per_s"):
        load_topology(_saved(tmp_path, data))


def test_local_cpu_memory_follows_the_rank_count(tmp_path, monkeypatch):
    cal = tmp_path / "local-cpu.yaml"
    monkeypatch.setenv("AUTOPLAN_CALIBRATION", str(cal))
    default = preset("local-cpu", devices_per_node=4)
    save_topology(dataclasses.replace(default, measured=True, devices_per_node=4), cal)
    two = preset("local-cpu", devices_per_node=2)
    assert two.device.mem_bytes == pytest.approx(2 * default.device.mem_bytes)
