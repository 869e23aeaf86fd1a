"""`autoplan calibrate`: the fits recover known figures, and one quick run on 2 gloo ranks writes
a measured topology that the `local-cpu` preset picks up."""

from __future__ import annotations

import dataclasses
import math

import pytest

from autoplan import calibrate
from autoplan.cost_model import comm, compute
from autoplan.topology import LinkSpec, load_topology, preset


def test_fit_all_reduce_recovers_alpha_and_busbw():
    latency_s, bw = 40e-6, 2.5e9
    samples = []
    for p in (2, 3, 4):
        factor, steps = calibrate.all_reduce_factor_steps(p)
        samples += [(p, n, steps * latency_s + n * factor / bw) for n in (4, 2**12, 2**20, 2**22)]
    fit_latency_s, fit_bw, rms = calibrate.fit_all_reduce(samples)
    assert fit_latency_s == pytest.approx(latency_s, rel=1e-9)
    assert fit_bw == pytest.approx(bw, rel=1e-9)
    assert rms < 1e-9


def test_fit_all_reduce_clamps_negative_latency_and_rejects_flat_times():
    # Pure bandwidth data with the smallest sample fast: latency would come out < 0.
    samples = [(2, 2**16, 0.8 * 2**16 / 1e9)] + [(2, n, n / 1e9) for n in (2**20, 2**22)]
    latency_s, bw, _ = calibrate.fit_all_reduce(samples)
    assert latency_s == 0.0 and bw == pytest.approx(1e9, rel=0.15)
    with pytest.raises(ValueError, match="do not grow with message size"):
        calibrate.fit_all_reduce([(2, 4, 2e-3), (2, 2**22, 1e-3)])
    with pytest.raises(ValueError, match="p >= 2"):
        calibrate.fit_all_reduce([(1, 4, 1e-3)])


def test_all_reduce_model_is_comms():
    """The fitted model is the one comm.py prices with: same factor and steps."""
    link = LinkSpec("x", bw_bytes_per_s=3e9, latency_s=7e-6)
    for p in (2, 3, 4):
        topo = dataclasses.replace(preset("local-cpu", devices_per_node=p), intra_node=link)
        factor, steps = calibrate.all_reduce_factor_steps(p)
        n = 3 * 2**20
        assert comm.collective_time_s("all_reduce", n, p, topo) == pytest.approx(
            steps * link.latency_s + n * factor / link.bw_bytes_per_s)


def test_fit_matmul_efficiency_recovers_computes_curve():
    peak, eff = 1e11, 0.7
    dims = [64, 128, 256, 512, 1024]
    rates = [peak * eff * d / (d + compute.MATMUL_HALF_DIM) for d in dims]
    fit_eff, rms = calibrate.fit_matmul_efficiency(dims, rates, peak)
    assert fit_eff == pytest.approx(eff) and rms < 1e-9
    # A CPU that saturates earlier: the best half-dim is found (32 is on the grid).
    rates = [peak * 0.9 * d / (d + 32) for d in dims]
    half_dim, rms = calibrate.best_half_dim(dims, rates, peak)
    assert half_dim == pytest.approx(32) and rms < 1e-9
    with pytest.raises(ValueError):
        calibrate.fit_matmul_efficiency(dims, [0.0] * len(dims), peak)


def test_fit_collective_uses_each_kinds_factor_and_steps():
    latency_s, bw = 2e-4, 8e8
    for kind in ("all_gather", "reduce_scatter", "broadcast", "send_recv"):
        samples = []
        for p in ((2,) if kind == "send_recv" else (2, 4)):
            factor, steps = comm.factor_steps(kind, p)
            samples += [(p, n, steps * latency_s + n * factor / bw) for n in (4, 2**16, 2**22)]
        fit_latency_s, fit_bw, rms = calibrate.fit_collective(kind, samples)
        assert (fit_latency_s, fit_bw) == (pytest.approx(latency_s), pytest.approx(bw)), kind


def test_fit_launch_latency_closes_the_roofline_on_a_graph():
    """The per-op floor is what the measured graph takes beyond the roofline, per launch."""
    import dataclasses as dc

    from autoplan.graph import NodeInfo

    dev = dc.replace(preset("local-cpu").device, launch_latency_s=0.0)
    mm = NodeInfo("mm", "aten.mm.default", ((64, 64),), ("float32",), 64 * 64 * 4,
                  2 * 64 * 64 * 4, 2 * 64**3, "", None)
    add = NodeInfo("add", "aten.add.Tensor", ((64, 64),), ("float32",), 64 * 64 * 4,
                   2 * 64 * 64 * 4, 0, "", None)
    view = NodeInfo("view", "aten.view.default", ((64, 64),), ("float32",), 0, 0, 0, "", None)
    graph = type("G", (), {"nodes": {"mm": mm, "add": add, "view": view}})()
    floor, roofline = calibrate.fit_launch_latency(dev, graph, 1.0)
    # launches: mm forward 1 + backward 2, add 1 + 1, the view none
    assert floor == pytest.approx((1.0 - roofline) / 5)
    assert calibrate.fit_launch_latency(dev, graph, 0.0, floor_s=1e-6)[0] == 1e-6


def test_max_ranks_below_two_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="max_ranks=1"):
        calibrate.main(out_path=str(tmp_path / "t.yaml"), max_ranks=1)
    assert not (tmp_path / "t.yaml").exists()


def test_cli_reports_a_bad_max_ranks(tmp_path, capsys):
    from autoplan import cli

    assert cli.main(["calibrate", "-o", str(tmp_path / "t.yaml"), "--max-ranks", "1"]) == 2
    assert "max_ranks=1" in capsys.readouterr().err


def test_default_out_path_is_where_the_preset_looks(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPLAN_CALIBRATION", str(tmp_path / "c.yaml"))
    assert calibrate.default_out_path() == tmp_path / "c.yaml"
    monkeypatch.delenv("AUTOPLAN_CALIBRATION")
    assert calibrate.default_out_path().parts[-3:] == (".cache", "autoplan", "local-cpu.yaml")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "sub" / "local-cpu.yaml"  # directory is created
    assert calibrate.main(out_path=str(out), max_ranks=2, quick=True) == 0
    return out


def test_quick_run_writes_a_measured_plausible_topology(calibrated):
    topo = load_topology(calibrated)
    assert topo.measured and "calibrate" in topo.source and "inter_node" in topo.source
    assert [p.name for p in calibrated.parent.iterdir()] == ["local-cpu.yaml"]  # no temp left
    dev = topo.device
    assert 1e8 < dev.peak_flops_per_s["float32"] < 1e13
    assert 1e6 < dev.peak_flops_per_s["bfloat16"] < 1e13
    assert 0 < dev.matmul_efficiency < 10
    assert 1e8 < dev.mem_bw_bytes_per_s < 1e12
    assert 1e-8 < dev.launch_latency_s < 1e-2
    assert 1e8 < dev.mem_bytes < 1e13
    for link in (topo.intra_node, topo.inter_node):
        assert 1e6 < link.bw_bytes_per_s < 1e12
        assert 0 <= link.latency_s < 0.1
        assert all(math.isfinite(x) for x in (link.bw_bytes_per_s, link.latency_s))
    # the figures of issue 3's CPU findings: half-dim, shared cores, per-kind gloo fits
    assert 1 <= dev.matmul_half_dim <= 4096
    assert set(dev.shared_speed) == {1, 2} and all(0 < v < 3 for v in dev.shared_speed.values())
    assert {"tanh", "exp"} <= set(dev.elementwise_s_per_elem)
    assert 0 <= dev.dtensor_op_overhead_s < 0.1
    assert set(dev.sync_skew_s) == {2} and 0 <= dev.sync_skew_s[2] < 0.1
    assert set(dev.sync_skew_slope) == {2} and 0 <= dev.sync_skew_slope[2] < 1
    fits = topo.intra_node.collectives
    # all_to_all is gloo's all_gather + chunk (from its fit); a fit that noise swamped on this
    # shared machine is left out for the link's figures, and all_to_all with it
    assert set(fits.get("all_to_all", {2: {1: None}})[2]) == {1}  # 2 ranks: one group of 2
    assert ("all_to_all" in fits) == ("all_gather" in fits)
    for kind, by_p in fits.items():
        assert kind in comm.COLLECTIVES and set(by_p) == {2}, kind


def test_preset_local_cpu_reads_the_calibration(calibrated, monkeypatch):
    monkeypatch.setenv("AUTOPLAN_CALIBRATION", str(calibrated))
    topo = preset("local-cpu", devices_per_node=2)
    written = load_topology(calibrated)
    assert topo.measured and topo.devices_per_node == 2
    # the file has no host figures: the preset's CPU host is the ranks' own memory (memcpy)
    assert topo.device.host_bw_bytes_per_s == written.device.mem_bw_bytes_per_s / 2
    # CPU ranks' FP8 peak is their bf16 one where none is given (topology.py _cpu_host)
    peaks = dict(topo.device.peak_flops_per_s)
    assert peaks.pop("float8") == peaks["bfloat16"]
    assert dataclasses.replace(topo.device, host_bw_bytes_per_s=0.0,
                               peak_flops_per_s=peaks) == written.device
    assert topo.intra_node == written.intra_node and topo.inter_node == written.inter_node


def test_noisy_collective_timings_are_measured_again_then_refused_clearly():
    """A burst of load can make a larger all_reduce look faster than a smaller one: the
    calibration keeps the fastest of two measurements per size (load only adds time), and when
    even those do not grow with the size it says so, naming the load, instead of fitting a
    negative bandwidth."""
    from autoplan.calibrate import ranks

    noisy = [("all_reduce", 2, 1, 4, 1.1e-3), ("all_reduce", 2, 1, 16384, 2.8e-3),
             ("all_reduce", 2, 1, 1 << 20, 1.0e-3)]
    quiet = [("all_reduce", 2, 1, 4, 1.0e-3), ("all_reduce", 2, 1, 16384, 1.2e-3),
             ("all_reduce", 2, 1, 1 << 20, 9.0e-3)]
    merged = ranks._fastest(noisy, quiet)
    assert [t for *_k, t in merged] == [1.0e-3, 1.2e-3, 1.0e-3]
    with pytest.raises(ValueError, match="load average .* swamped the all_reduce timings"):
        ranks._pooled_all_reduce(merged)
    latency_s, bw, _rms = ranks._pooled_all_reduce(quiet)
    assert latency_s > 0 and bw > 0


def test_fit_sync_skew_draws_the_line_through_both_chunk_lengths():
    """[Note: calibration fits], sync skew: the wait is intercept + slope x the chunk's wall
    time through the short and the long chunk; a long chunk that waited less is noise, so the
    slope is 0 and the short chunk's wait the intercept."""
    from autoplan.calibrate.ranks import fit_sync_skew

    short = {2: (0.3e-3, 10e-3), 4: (2.0e-3, 20e-3), 3: (1.0e-3, 10e-3)}
    long = {2: (2.3e-3, 110e-3), 4: (16.0e-3, 220e-3), 3: (0.5e-3, 100e-3)}
    intercept, slope = fit_sync_skew(short, long)
    assert slope[2] == pytest.approx(0.02) and intercept[2] == pytest.approx(0.1e-3)
    assert slope[4] == pytest.approx(0.07) and intercept[4] == pytest.approx(0.6e-3)
    assert slope[3] == 0.0 and intercept[3] == pytest.approx(1.0e-3)
    # a steep line through a small short-chunk wait would cross below zero: clamped at 0
    intercept, slope = fit_sync_skew({2: (0.1e-3, 10e-3)}, {2: (10.1e-3, 60e-3)})
    assert slope[2] == pytest.approx(0.2) and intercept[2] == 0.0
