"""`autoplan calibrate`: measure this machine's CPU ranks and write a `local-cpu` topology file.

Files: this package's __init__ (`measure`, `main`: the topology file it writes, [Note: calibration
fits]), local.py (what is measured in this process: matmul rates, memory bandwidth, the per-op
floor), ranks.py (what is measured on a `LocalCluster`: shared speed, stragglers, collectives,
DTensor and optimizer host costs), fits.py (the least-squares fits of the cost model's curves).

The `local-cpu` preset (autoplan/topology.py) reads the file this writes; every figure in it is
fitted by calibrate on this machine, `measured: true`, and `source` says what was measured, how,
and when. One rank is one process with one intra-op thread, as `LocalCluster` runs them
(autoplan/runtime/launcher.py), so compute figures are measured with `torch.set_num_threads(1)`.

[Note: calibration fits]
Each timing is the median of several repeats, each repeat long enough (`min_time_s`) for the
clock; the machine may be shared and noisy, so medians, never means or minima, and the repeats
of the sizes of one measurement are interleaved, so that a burst of load from other processes
cannot bend a fitted curve.

- Matmul: fp32 square matmuls `(d, d) @ (d, d)`, 2 d^3 FLOPs each. `peak_flops_per_s["float32"]`
  is the largest measured rate. compute.py's curve, rate(d) = peak * E * d / (d + H), is fitted
  with the call's floor (`torch.add` on 1 element, no autograd), t(d) = 2 d^3 / rate(d) + floor,
  to the measured
  times in relative least squares: for each half-dim H of a log grid (1..4096, 4 points per
  octave) 1 / E has a closed form (`fit_matmul_efficiency`); the (E, H) of least error are
  `matmul_efficiency` and `matmul_half_dim`. Only peak * E is determined by the data; we keep
  peak = the largest measured rate (so MFU stays "of measured peak"), which lets E exceed 1.
  `peak_flops_per_s["bfloat16"]`: the largest rate of bf16 matmuls of d = 256 and 512 (512
  skipped where bf16 is emulated and slow); `["float16"]` is not measured and takes the bf16
  figure (a CPU has no faster fp16 path).
- Memory bandwidth (`mem_bw_bytes_per_s`): what the roofline's byte term means for an eager
  graph's elementwise ops: a chain of out-of-place multiplies and adds on 2 MiB tensors (an
  activation's size), `mem_bytes` of them so that they do not stay in the caches; bytes in the
  roofline's counting (inputs plus output of each op) / time. Allocation of each output is part
  of it, as in training (a copy into a preallocated array runs ~30% faster).
- Transcendental ops (`elementwise_s_per_elem`): each op of compute.TRANSCENDENTAL_OPS on the
  same tensors, time per element (the roofline takes the larger of it and the byte term).
- Launch latency (`launch_latency_s`, the roofline's per-op floor): what one op of a training
  step costs beyond its FLOPs and bytes -- Python and dispatch, autograd's recording and its
  engine, allocation of the output. Fitted on a reference training graph (nanoGPT: 2 blocks of
  width 128, 4 heads, vocabulary 256; batch 8 x 64 tokens; its captured aten graph with real
  weights, forward + cross-entropy + backward, as the runtime runs a stage): the latency that
  makes compute.py's roofline sum over the graph equal the measured time
  (`fit_launch_latency`), and no less than one op of a 1-element autograd chain (100 multiplies
  from Python), the floor measured directly.
- Shared speed (`DeviceSpec.shared_speed`): ranks of one machine share its cores, caches and
  memory bandwidth. For n = 1..max_ranks, the first n ranks of a `LocalCluster(max_ranks)` run
  the reference training step (below) for a fixed window at the same time (the others wait in
  a barrier, asleep); each rank's throughput is steps done / window (a throughput, not a median
  of short calls: time slicing by the scheduler must count), and shared_speed[n] is the median
  rank's throughput times the model's one-rank time of that step (`reference_roofline_s`,
  equal to its measured time by the launch-latency fit). Median of `speed_rounds` rounds. A
  training step, not a matmul: n ranks on shared cores lose more on its elementwise ops
  (memory bandwidth, caches) than on matmuls (4 ranks on 2 cores: ~0.42 for a d=256 matmul
  loop, less for the step).
- Sync skew (`DeviceSpec.sync_skew_s`, `sync_skew_slope`, cost_model/comm.py [Note:
  stragglers]): for n = 2..max_ranks the first n ranks run rounds of [a compute chunk of
  (256, 256) matmuls, ~`skew_chunk_s` alone; a 4-byte all_reduce over the n ranks], each timing
  its own chunk; a round lasts as long as its slowest chunk, so the wait for stragglers per
  synchronisation is the slowest chunk minus the mean one: its median over `skew_iters` x
  `repeats` rounds (the ranks agree on it: all-gathered chunk times). Ranks sharing cores drift
  apart the longer they compute without meeting (4 ranks on 2 cores: ~2 ms after 5 ms chunks,
  ~7-10 ms after 50 ms, ~20 ms after 150 ms), so the test runs again with chunks of
  `skew_long_chunk_s` and the wait is fitted as intercept (`sync_skew_s`) + slope
  (`sync_skew_slope`) x the chunk's wall time, through the two points.
- Collectives (`LinkSpec.collectives`, [Note: measured collectives] in cost_model/comm.py): for
  every rank count N = 2..max_ranks and group size p dividing N, the first N ranks form g = N / p
  groups of p consecutive ranks and every group runs the collective at the same time (as SPMD runs
  every group of a mesh axis); per (kind, p, g, size) the slowest rank's median time of
  back-to-back calls. Kinds: all_reduce, all_gather (all_gather_into_tensor, n = output bytes),
  reduce_scatter (reduce_scatter_tensor, n = input bytes), broadcast, and send_recv (p = 2:
  half a ping-pong between the ranks of each pair). Each (kind, p, g) is fitted to comm.py's
  t = steps(p) * latency_s + n * factor(p) / bw_bytes_per_s by relative least squares (2x2
  normal equations; a negative latency is clamped to 0 and the bandwidth refitted).
  all_to_all: gloo has none for DTensor, which falls back to all_gather + chunk
  (torch/distributed/tensor/_redistribute.py), so it is priced as that all-gather of the p-times
  larger full tensor: the all_gather fit with busbw / p. The link's own latency_s and
  bw_bytes_per_s are the all_reduce fit over all samples (the fallback for unmeasured groups).
  One machine has no inter-node link: `inter_node` repeats the loopback figures, as `source`
  says.
- DTensor overhead (`dtensor_op_overhead_s`): the reference training step with its weights and
  input as Replicate DTensors over all max_ranks ranks, run as the engine runs a
  tensor-parallel stage (sdpa and view/reshape swapped as passes.sharding does, implicit
  replication; nothing communicates), minus the plain step, per DTensor dispatch as the cost
  model counts them (`compute.dtensor_dispatches`: forward, and backward for ops with a
  gradient); all ranks at once, times shared_speed[max_ranks] (a one-rank figure, as the
  others). A real graph's ops, not a few tiny ones: the backward runs several DTensor ops per
  node, and the fit carries that.
- DTensor redistribution overhead (`dtensor_redistribute_s`): per redistribution, a small
  (8, 8 p) Shard(1) -> Replicate (all-gather plus the local reassembly a non-leading dim needs)
  minus a raw all_gather_into_tensor of the same bytes, all ranks at once, times
  shared_speed[max_ranks].
- Optimizer ops (`optimizer_op_s`, `dtensor_optimizer_op_s`): one AdamW step over the reference
  model's parameters, plain and as replicated DTensors, less its memory-bound pass, per tensor
  and op (`fit_optimizer_op_s`), times shared_speed[max_ranks].
- `mem_bytes`: MemTotal of /proc/meminfo divided by max_ranks (the ranks share the RAM; the
  `local-cpu` preset rescales it to its own rank count).

Modules: `local` (what this process measures, and the reference training step), `ranks` (the
jobs on a LocalCluster of gloo ranks), `fits` (the least-squares and closing fits); this one
measures, assembles the topology and writes it.
"""

from __future__ import annotations

import os
import platform
import socket
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

from autoplan.calibrate.fits import (all_reduce_factor_steps, best_half_dim, fit_all_reduce,
                                     fit_collective, fit_launch_latency, fit_matmul_efficiency,
                                     fit_optimizer_op_s)
from autoplan.calibrate.local import (_CHUNK_BYTES, _FULL, _QUICK, _mem_total_bytes,
                                      _measure_rank_compute, _Settings, median_call_times_s,
                                      reference_roofline_s, reference_step)
from autoplan.calibrate.ranks import _measure_ranks, shared_speed_job, sync_skew_job
from autoplan.topology import DeviceSpec, LinkSpec, Topology, load_topology, save_topology

__all__ = [
    "main", "measure", "default_out_path", "fit_matmul_efficiency", "best_half_dim",
    "fit_collective", "fit_all_reduce", "all_reduce_factor_steps", "median_call_times_s",
    "shared_speed_job", "sync_skew_job", "reference_step", "reference_roofline_s",
    "fit_optimizer_op_s", "fit_launch_latency",
]


def default_out_path() -> Path:
    """Where the `local-cpu` preset looks: $AUTOPLAN_CALIBRATION, else
    ~/.cache/autoplan/local-cpu.yaml (the same rule as topology._local_cpu)."""
    return Path(os.environ.get("AUTOPLAN_CALIBRATION",
                               Path.home() / ".cache" / "autoplan" / "local-cpu.yaml"))


def measure(max_ranks: int = 4, quick: bool = False) -> tuple[Topology, dict]:
    """Measure this machine ([Note: calibration fits]); returns the `local-cpu` topology (one
    node of `max_ranks` ranks, `measured=True`) and the raw figures behind it.

    Raises ValueError for max_ranks < 2 (collectives need two ranks).
    """
    if not isinstance(max_ranks, int) or isinstance(max_ranks, bool) or max_ranks < 2:
        raise ValueError(f"calibrate: max_ranks={max_ranks!r} must be an integer >= 2 "
                         "(collectives are measured on 2..max_ranks ranks)")
    s = _QUICK if quick else _FULL
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank = one thread, as LocalCluster runs them
    try:
        fig = _measure_rank_compute(s)
    finally:
        torch.set_num_threads(threads)
    solo = DeviceSpec("fit", {"float32": fig["peak_fp32"]}, 1.0, fig["mem_bw"],
                      matmul_efficiency=fig["eff"], launch_latency_s=fig["launch_s"],
                      matmul_half_dim=fig["half_dim"], elementwise_s_per_elem=fig["elementwise"])
    fig["solo_step_s"] = reference_roofline_s(solo)
    fig.update(_measure_ranks(max_ranks, s, fig["solo_step_s"]))
    fig["optimizer_op_s"], fig["dtensor_optimizer_op_s"] = fit_optimizer_op_s(
        fig["adamw"], fig["mem_bw"])
    fig["mem_bytes"] = _mem_total_bytes() / max_ranks
    link = LinkSpec("gloo-loopback", bw_bytes_per_s=fig["bw"], latency_s=fig["latency_s"],
                    collectives=fig["collectives"])
    topo = Topology(
        name="local-cpu", num_nodes=1, devices_per_node=max_ranks,
        device=DeviceSpec(
            name=f"cpu-rank ({_cpu_model()}, 1 thread)",
            # fp16 is not measured: priced at the bf16 rate (a CPU has no faster fp16 path)
            peak_flops_per_s={"float32": fig["peak_fp32"], "bfloat16": fig["peak_bf16"],
                              "float16": fig["peak_bf16"]},
            mem_bytes=fig["mem_bytes"], mem_bw_bytes_per_s=fig["mem_bw"],
            matmul_efficiency=fig["eff"], launch_latency_s=fig["launch_s"],
            matmul_half_dim=fig["half_dim"], shared_speed=fig["shared_speed"],
            elementwise_s_per_elem=fig["elementwise"], dtensor_op_overhead_s=fig["dtensor_s"],
            sync_skew_s=fig["sync_skew"], sync_skew_slope=fig["sync_skew_slope"],
            optimizer_op_s=fig["optimizer_op_s"],
            dtensor_redistribute_s=fig["redistribute_s"],
            dtensor_optimizer_op_s=fig["dtensor_optimizer_op_s"],
            all_to_all=False),  # gloo has none (DeviceSpec.all_to_all)
        intra_node=link, inter_node=link, measured=True,
        source=_source(fig, s, max_ranks, quick))
    return topo, fig


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _source(fig: dict, s: _Settings, max_ranks: int, quick: bool) -> str:
    """What was measured, how and when ([Note: calibration fits]), for `Topology.source`."""
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    dims, sizes = s.matmul_dims, s.collective_bytes
    fitted = {k: v for k, v in fig["fit_errors"].items() if v == v}
    unfit = sorted(k for k, v in fig["fit_errors"].items() if v != v)
    worst = max(fitted.items(), key=lambda kv: kv[1]) if fitted else (None, 0.0)
    parts = [
        f"autoplan calibrate{' (quick)' if quick else ''} on {socket.gethostname()} at {when} "
        f"({_cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__}); all figures "
        f"fitted by calibrate, medians of {s.repeats} repeats",
        f"device = one rank = one thread: peak float32 = largest rate of square matmuls "
        f"d={dims[0]}..{dims[-1]}",
        f"matmul_efficiency and matmul_half_dim fitted together (rms rel. error "
        f"{fig['eff_rms']:.0%}; the GPU default half-dim 128 would fit to {fig['rms_128']:.0%})",
        f"bfloat16 peak from d={','.join(map(str, fig['bf16_dims']))}",
        f"mem_bw = bytes (roofline counting) / time of a chain of out-of-place multiplies and "
        f"adds on {_CHUNK_BYTES / 2**20:g} MiB tensors, {s.mem_bytes / 2**20:.0f} MiB of them",
        "elementwise_s_per_elem = time per element of each transcendental op on the same "
        "tensors",
        f"launch latency fitted on the reference training graph ({fig['reference_s'] * 1e3:.3g}"
        f" ms measured, {fig['reference_roofline_s'] * 1e3:.3g} ms roofline without launches; "
        f"floor: one op of a 1-element autograd chain, {fig['chain_launch_s'] * 1e6:.3g} us)",
        f"dtensor_op_overhead_s = extra time of the reference step on replicated DTensors over "
        f"{max_ranks} ranks vs plain tensors, per DTensor dispatch, times shared_speed",
        f"optimizer_op_s / dtensor_optimizer_op_s = AdamW step over the reference model's "
        f"{fig['adamw'][0]['tensors']} parameter tensors (plain / replicated DTensors) less its "
        "memory pass, per tensor and op, times shared_speed",
        "dtensor_redistribute_s = DTensor Shard(1) -> Replicate of an (8, 8p) tensor minus a "
        "raw all_gather of it, times shared_speed",
        "sync_skew_s + sync_skew_slope x chunk wall time = slowest minus mean chunk of rounds "
        f"[compute chunk of {s.skew_chunk_s * 1e3:g} ms and of {s.skew_long_chunk_s * 1e3:g} ms "
        "alone; 4-byte all_reduce], through the two points: " + ", ".join(
            f"n={n} {v * 1e3:.2f} ms + {fig['sync_skew_slope'][n]:.3f} x"
            for n, v in fig["sync_skew"].items()),
        f"mem_bytes = MemTotal / {max_ranks}",
        "shared_speed = per-rank reference-step throughput with n ranks at once times the "
        f"model's one-rank step time ({fig['solo_step_s'] * 1e3:.3g} ms), "
        f"{s.speed_window_s:g} s windows: " + ", ".join(
            f"n={n} {v:.2f}" for n, v in fig["shared_speed"].items()),
        f"links: gloo collectives on g concurrent groups of p ranks (N = p g = 2..{max_ranks}), "
        f"{sizes[0]} B...{sizes[-1] / 2**20:g} MiB, fitted per (kind, p, g) to comm.py's "
        f"alpha-beta formula (worst rms rel. error {worst[1]:.0%} for {worst[0]}"
        + (f"; not fittable, link figures used: {unfit}" if unfit else "") + "); all_to_all "
        "= gloo's all_gather fallback; the link's own figures = all_reduce over all samples "
        f"(rms rel. error {fig['ar_rms']:.0%})",
        "one machine has no inter-node link, so inter_node repeats the loopback fit",
    ]
    return "; ".join(parts) + "."


def _write_atomically(topo: Topology, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        save_topology(topo, tmp)
        load_topology(tmp)  # what we wrote must read back
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _print_table(topo: Topology, fig: dict, out: Path) -> None:
    dev, link = topo.device, topo.intra_node
    rows = [
        ("peak float32 per rank", f"{dev.peak_flops_per_s['float32']:.3g} FLOP/s"),
        ("peak bfloat16 per rank", f"{dev.peak_flops_per_s['bfloat16']:.3g} FLOP/s"),
        ("matmul_efficiency", f"{dev.matmul_efficiency:.3g}, half-dim "
                              f"{dev.matmul_half_dim:.3g} (rms rel. error {fig['eff_rms']:.0%})"),
        ("mem_bw", f"{dev.mem_bw_bytes_per_s:.3g} B/s"),
        ("launch_latency", f"{dev.launch_latency_s:.3g} s"),
        ("DTensor overhead per op", f"{dev.dtensor_op_overhead_s:.3g} s"),
        ("DTensor redistribution overhead", f"{dev.dtensor_redistribute_s:.3g} s"),
        ("optimizer op per tensor", f"{dev.optimizer_op_s:.3g} s plain, "
                                    f"{dev.dtensor_optimizer_op_s:.3g} s DTensor"),
        ("mem per rank", f"{dev.mem_bytes:.3g} B"),
        ("shared speed (n ranks at once)",
         ", ".join(f"{n}: {v:.2f}" for n, v in dev.shared_speed.items())),
        ("sync skew (n ranks at once)",
         ", ".join(f"{n}: {v:.3g} s + {dev.skew_slope(n):.3f} x compute"
                   for n, v in dev.sync_skew_s.items())),
        ("all_reduce busbw", f"{link.bw_bytes_per_s:.3g} B/s"),
        ("all_reduce latency per step", f"{link.latency_s:.3g} s (rms rel. error "
                                        f"{fig['ar_rms']:.0%})"),
    ]
    for kind, by_p in link.collectives.items():
        for p, by_g in by_p.items():
            for g, (lat, bw) in by_g.items():
                rows.append((f"{kind} p={p} g={g}", f"{lat:.3g} s/step, {bw:.3g} B/s"))
    width = max(len(k) for k, _ in rows)
    print(f"autoplan calibrate: wrote {out}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def main(out_path: str | None = None, max_ranks: int = 4, quick: bool = False) -> int:
    """Measure this machine, write the `local-cpu` topology YAML and print the fitted figures.

    Args:
        out_path: file to write (atomically: temporary file + os.replace; directories are
            created); default `default_out_path()`, where the `local-cpu` preset looks.
        max_ranks: collectives and shared speed are measured on up to max_ranks gloo ranks;
            mem_bytes = RAM / it.
        quick: fewer sizes and repeats (a few seconds; for tests).

    Returns 0. Raises ValueError for max_ranks < 2 or unusable measurements.
    """
    out = Path(out_path).expanduser() if out_path is not None else default_out_path()
    topo, fig = measure(max_ranks=max_ranks, quick=quick)
    _write_atomically(topo, out)
    _print_table(topo, fig, out)
    return 0
