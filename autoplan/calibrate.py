"""`autoplan calibrate`: measure this machine's CPU ranks and write a `local-cpu` topology file.

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
  is the largest measured rate. `matmul_efficiency` E is fitted so that compute.py's curve,
  rate(d) = peak * efficiency(d) with efficiency(d) = E * g(d) (g(d) = d / (d + MATMUL_HALF_DIM)
  today; we call `compute.matmul_efficiency`, so the fit follows the curve if it changes), matches
  the measured rates r(d) in relative least squares: minimize sum_d (peak E g(d) / r(d) - 1)^2,
  closed form E = sum a / sum a^2 with a = peak g(d) / r(d). Only the product peak * E is
  determined by the data; we keep peak = the largest measured rate (so MFU stays "of measured
  peak"), which lets E exceed 1 when this CPU saturates at smaller d than the curve assumes. The
  fit's rms relative error and the half-dim that would fit best are reported in `source`.
  `peak_flops_per_s["bfloat16"]`: the largest rate of bf16 matmuls of d = 256 and 512 (512
  skipped where bf16 is emulated and slow).
- Memory bandwidth: tensor copy (reads n, writes n bytes) and add (reads 2n, writes n) on
  arrays far larger than the caches; bytes moved / time, in the roofline's counting (input plus
  output bytes, no write-allocate); `mem_bw_bytes_per_s` is the mean of the two.
- Launch latency: the time of `torch.add` on 1-element tensors from Python, the per-op floor of
  an eager or FX-interpreted graph.
- Collectives: gloo `all_reduce` of float32 buffers on subgroups of the first p = 2..max_ranks
  ranks of one `LocalCluster(max_ranks)`; per (p, n) the slowest rank's median time of
  back-to-back calls. Fit of comm.py's [Note: collective cost] for all-reduce,
  t = 2(p-1) * latency_s + n * 2(p-1)/p / bw_bytes_per_s (nccl-tests busbw factor), by relative
  least squares over all (p, n) samples (2x2 normal equations; a negative latency is clamped to 0
  and the bandwidth refitted). One machine has no inter-node link: `inter_node` repeats the
  loopback fit, and `source` says so.
- `mem_bytes`: MemTotal of /proc/meminfo divided by max_ranks (the ranks share the RAM).
"""

from __future__ import annotations

import functools
import math
import os
import platform
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Mapping, TypeVar

import torch

from autoplan.topology import DeviceSpec, LinkSpec, Topology, load_topology, save_topology

__all__ = [
    "main", "measure", "default_out_path", "fit_matmul_efficiency", "best_half_dim",
    "fit_all_reduce", "all_reduce_factor_steps", "median_call_times_s",
]

K = TypeVar("K")


@dataclass(frozen=True)
class _Settings:
    """How much to measure. `quick` trades precision for a run of a few seconds (tests)."""

    matmul_dims: tuple[int, ...]
    bf16_dims: tuple[int, ...]
    mem_bytes: int            # size of each array of the bandwidth test
    all_reduce_bytes: tuple[int, ...]
    repeats: int
    min_time_s: float         # shortest repeat; shorter calls are looped


_FULL = _Settings(matmul_dims=(64, 128, 256, 512, 1024), bf16_dims=(256, 512),
                  mem_bytes=64 * 2**20,
                  all_reduce_bytes=(4, 64, 2**10, 2**14, 2**16, 2**18, 2**20, 2**22),
                  repeats=7, min_time_s=0.01)
_QUICK = _Settings(matmul_dims=(64, 128, 256, 512), bf16_dims=(256,), mem_bytes=32 * 2**20,
                   all_reduce_bytes=(4, 2**12, 2**16, 2**18, 2**21), repeats=3, min_time_s=0.003)


def default_out_path() -> Path:
    """Where the `local-cpu` preset looks: $AUTOPLAN_CALIBRATION, else
    ~/.cache/autoplan/local-cpu.yaml (the same rule as topology._local_cpu)."""
    return Path(os.environ.get("AUTOPLAN_CALIBRATION",
                               Path.home() / ".cache" / "autoplan" / "local-cpu.yaml"))


# --- timing -----------------------------------------------------------------------------------

def median_call_times_s(fns: Mapping[K, Callable[[], object]], *, repeats: int,
                        min_time_s: float) -> dict[K, float]:
    """Median over `repeats` of the mean time of one call, seconds, for each of `fns`.

    Each fn gets one warm-up call and one call to size its loop (about `min_time_s` long).
    Repeats are interleaved over the fns (f1, f2, ..., f1, f2, ...), so that a burst of load
    from other processes on a shared machine hits all of them alike instead of one.
    """
    loops = {}
    for key, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        fn()
        loops[key] = max(1, math.ceil(min_time_s / max(time.perf_counter() - t0, 1e-9)))
    samples: dict[K, list[float]] = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            iters = loops[key]
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples[key].append((time.perf_counter() - t0) / iters)
    return {key: statistics.median(ts) for key, ts in samples.items()}


def _matmul_rates(dims: tuple[int, ...], dtype: torch.dtype, s: _Settings) -> dict[int, float]:
    """FLOP/s of (d, d) @ (d, d) matmuls on this thread: 2 d^3 / time, per d in `dims`."""
    ops = {}
    for d in dims:
        a, b = torch.randn(d, d).to(dtype), torch.randn(d, d).to(dtype)
        ops[d] = functools.partial(torch.mm, a, b, out=torch.empty(d, d, dtype=dtype))
    times = median_call_times_s(ops, repeats=s.repeats, min_time_s=s.min_time_s)
    return {d: 2.0 * d**3 / t for d, t in times.items()}


def _bf16_dims(s: _Settings, limit_s: float = 0.05) -> tuple[int, ...]:
    """The bf16 sizes whose one matmul should take under `limit_s` (bf16 is emulated, and slow,
    on CPUs without bf16 units), extrapolated as d^3 from the smallest."""
    d0 = s.bf16_dims[0]
    a = torch.randn(d0, d0).to(torch.bfloat16)
    torch.mm(a, a)
    t0 = time.perf_counter()
    torch.mm(a, a)
    t = time.perf_counter() - t0
    return tuple(d for d in s.bf16_dims if d == d0 or t * (d / d0) ** 3 < limit_s)


def _mem_bw(s: _Settings) -> tuple[float, float]:
    """(copy, add) bandwidth in B/s: bytes read plus written per second."""
    n = s.mem_bytes // 4
    a, b, c = torch.randn(n), torch.randn(n), torch.zeros(n)
    times = median_call_times_s({"copy": lambda: c.copy_(a),
                                 "add": lambda: torch.add(a, b, out=c)},
                                repeats=s.repeats, min_time_s=s.min_time_s)
    return 2 * a.nbytes / times["copy"], 3 * a.nbytes / times["add"]


def _launch_latency_s(s: _Settings) -> float:
    x, y = torch.ones(1), torch.ones(1)
    return median_call_times_s({"add": lambda: torch.add(x, y)}, repeats=s.repeats + 2,
                               min_time_s=s.min_time_s)["add"]


def _mem_total_bytes() -> float:
    """MemTotal of /proc/meminfo, bytes; ValueError where there is no /proc/meminfo."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError as e:
        raise ValueError(f"calibrate: cannot read /proc/meminfo for the RAM size: {e}") from None
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            value, unit = line.split()[1:3]
            return float(value) * {"kB": 1024}.get(unit, 1)
    raise ValueError("calibrate: /proc/meminfo has no MemTotal line")


# --- rank jobs (module-level: LocalCluster pickles them by name) --------------------------------

def _all_reduce_job(group_sizes: list[int], nbytes_list: list[int], repeats: int,
                    min_time_s: float) -> list[tuple[int, int, float]]:
    """On every rank: time all_reduce on the subgroups of the first p ranks, p in group_sizes.
    Returns this rank's (p, nbytes, median seconds) for the groups it belongs to."""
    import torch.distributed as dist

    rank = dist.get_rank()
    groups = {p: dist.new_group(ranks=list(range(p))) for p in group_sizes}  # all ranks call
    out = []
    for p in group_sizes:
        if rank < p:
            out += [(p, n, t) for n, t in _time_all_reduce_s(nbytes_list, groups[p], repeats,
                                                             min_time_s).items()]
        dist.barrier()  # the other ranks wait here; the next group starts together
    return out


def _time_all_reduce_s(nbytes_list: list[int], group, repeats: int,
                       min_time_s: float) -> dict[int, float]:
    """Median seconds of one all_reduce per message size on `group`. Repeats are interleaved
    over the sizes, so that a burst of load from other processes hits all sizes alike."""
    import torch.distributed as dist

    loops = {}
    for n in nbytes_list:
        buf = torch.zeros(max(1, n // 4))
        dist.all_reduce(buf, group=group)  # warm-up (connections, buffers)
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        # Members must agree on the loop count, or one would wait for a call that never comes.
        once = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(once, op=dist.ReduceOp.MAX, group=group)
        loops[n] = (buf, max(1, math.ceil(min_time_s / max(float(once), 1e-9))))
    samples: dict[int, list[float]] = {n: [] for n in nbytes_list}
    for _ in range(repeats):
        for n, (buf, iters) in loops.items():
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(buf, group=group)
            samples[n].append((time.perf_counter() - t0) / iters)
    return {n: statistics.median(ts) for n, ts in samples.items()}


def _concurrent_matmul_job(dim: int, repeats: int, min_time_s: float) -> float:
    """On every rank at once: fp32 matmul FLOP/s of this rank while all ranks compute."""
    import torch.distributed as dist

    dist.barrier()
    s = _Settings((dim,), (), 0, (), repeats, min_time_s)
    rate = _matmul_rates((dim,), torch.float32, s)[dim]
    dist.barrier()
    return rate


# --- fits -------------------------------------------------------------------------------------

def fit_matmul_efficiency(dims: list[float], rates_flops_per_s: list[float],
                          peak_flops_per_s: float,
                          half_dim: float | None = None) -> tuple[float, float]:
    """Fit `matmul_efficiency` E to measured square-matmul rates ([Note: calibration fits]).

    Args:
        dims: matmul edge d of each measurement.
        rates_flops_per_s: measured FLOP/s at each d.
        peak_flops_per_s: the device peak the curve multiplies.
        half_dim: use d / (d + half_dim) as the curve; None: compute.py's curve as it is.

    Returns (E, rms relative error of the fitted rates). Raises ValueError for empty or
    non-positive input.
    """
    from autoplan.cost_model.compute import matmul_efficiency

    if not dims or len(dims) != len(rates_flops_per_s) or peak_flops_per_s <= 0 \
            or min(rates_flops_per_s) <= 0:
        raise ValueError(f"fit_matmul_efficiency: need matching positive dims and rates and a "
                         f"positive peak; got {dims}, {rates_flops_per_s}, {peak_flops_per_s}")
    unit = DeviceSpec("fit", {"float32": 1.0}, 1.0, 1.0, matmul_efficiency=1.0)
    a = [peak_flops_per_s * (d / (d + half_dim) if half_dim is not None
                             else matmul_efficiency(d, unit)) / r
         for d, r in zip(dims, rates_flops_per_s)]
    e = sum(a) / sum(x * x for x in a)
    rms = math.sqrt(sum((e * x - 1) ** 2 for x in a) / len(a))
    return e, rms


def best_half_dim(dims: list[float], rates_flops_per_s: list[float],
                  peak_flops_per_s: float) -> tuple[float, float]:
    """The half-dim H of d / (d + H) that fits the rates best (log grid 1..4096), and its rms
    relative error. Informative only: compute.py's MATMUL_HALF_DIM is not a topology field."""
    grid = [2 ** (k / 4) for k in range(49)]
    fits = [(fit_matmul_efficiency(dims, rates_flops_per_s, peak_flops_per_s, h)[1], h)
            for h in grid]
    rms, h = min(fits)
    return h, rms


def all_reduce_factor_steps(group_size: int) -> tuple[float, int]:
    """(bandwidth factor, latency steps) of a ring all-reduce on p ranks: (2(p-1)/p, 2(p-1)),
    as comm.py's [Note: collective cost] (nccl-tests PERFORMANCE.md)."""
    p = group_size
    return 2 * (p - 1) / p, 2 * (p - 1)


def fit_all_reduce(samples: list[tuple[int, float, float]]) -> tuple[float, float, float]:
    """Fit t = steps(p) * latency_s + nbytes * factor(p) / bw_bytes_per_s to all-reduce samples.

    Args:
        samples: (group size p, nbytes, seconds) triples.

    Relative least squares (each sample's error divided by its time, so 4-byte and 4-MB
    messages weigh alike); a negative latency is clamped to 0 and the bandwidth refitted.

    Returns (latency_s, bw_bytes_per_s, rms relative error). Raises ValueError when the samples
    cannot determine a positive bandwidth (all messages tiny, or times that fall with size).
    """
    if not samples or any(t <= 0 or p < 2 for p, _, t in samples):
        raise ValueError(f"fit_all_reduce: need samples (p >= 2, nbytes, seconds > 0); "
                         f"got {samples}")
    rows = []
    for p, n, t in samples:
        factor, steps = all_reduce_factor_steps(p)
        rows.append((steps / t, n * factor / t))  # model / t = alpha * u + inv_bw * v; target 1
    suu = sum(u * u for u, _ in rows)
    suv = sum(u * v for u, v in rows)
    svv = sum(v * v for _, v in rows)
    su, sv = sum(u for u, _ in rows), sum(v for _, v in rows)
    det = suu * svv - suv * suv
    if det > 0:  # 2x2 normal equations of the relative least squares
        alpha, inv_bw = (svv * su - suv * sv) / det, (suu * sv - suv * su) / det
    if det <= 0 or alpha < 0:  # one size only, or a negative latency: bandwidth alone
        alpha, inv_bw = 0.0, sv / svv if svv > 0 else 0.0
    if inv_bw <= 0:
        raise ValueError(
            "calibrate: all_reduce times do not grow with message size, so no bandwidth can be "
            f"fitted; samples (p, bytes, s): {samples}")
    rms = math.sqrt(sum((alpha * u + inv_bw * v - 1) ** 2 for u, v in rows) / len(rows))
    return alpha, 1.0 / inv_bw, rms


# --- measure and write --------------------------------------------------------------------------

def _measure_rank_compute(s: _Settings) -> dict:
    """Single-thread compute figures of one rank, measured in this process."""
    rates = _matmul_rates(s.matmul_dims, torch.float32, s)
    peak = max(rates.values())
    eff, eff_rms = fit_matmul_efficiency(list(rates), list(rates.values()), peak)
    half_dim, half_rms = best_half_dim(list(rates), list(rates.values()), peak)
    bf16 = _matmul_rates(_bf16_dims(s), torch.bfloat16, s)
    copy_bw, add_bw = _mem_bw(s)
    return dict(matmul_rates=rates, peak_fp32=peak, eff=eff, eff_rms=eff_rms,
                half_dim=half_dim, half_rms=half_rms, peak_bf16=max(bf16.values()),
                bf16_dims=tuple(bf16),
                copy_bw=copy_bw, add_bw=add_bw, mem_bw=(copy_bw + add_bw) / 2,
                launch_s=_launch_latency_s(s))


def _measure_ranks(max_ranks: int, s: _Settings) -> dict:
    """all_reduce samples on 2..max_ranks gloo ranks and the fp32 matmul rate per rank when all
    max_ranks ranks compute at once (for `source`: the cost of sharing the cores)."""
    from autoplan.runtime.launcher import LocalCluster

    group_sizes = list(range(2, max_ranks + 1))
    with LocalCluster(max_ranks) as cluster:
        per_rank = cluster.run(_all_reduce_job, group_sizes, list(s.all_reduce_bytes),
                               s.repeats, s.min_time_s, timeout_s=300.0)
        concurrent = cluster.run(_concurrent_matmul_job, 256, s.repeats, s.min_time_s,
                                 timeout_s=120.0)
    slowest: dict[tuple[int, int], float] = {}
    for rows in per_rank:
        for p, n, t in rows:
            slowest[(p, n)] = max(t, slowest.get((p, n), 0.0))
    samples = [(p, n, t) for (p, n), t in sorted(slowest.items())]
    latency_s, bw, rms = fit_all_reduce(samples)
    per_p = {}
    for p in group_sizes:  # informative: cores are shared once p exceeds them
        try:
            per_p[p] = fit_all_reduce([x for x in samples if x[0] == p])[:2]
        except ValueError:
            pass
    return dict(samples=samples, latency_s=latency_s, bw=bw, ar_rms=rms, per_p=per_p,
                concurrent_fp32=statistics.median(concurrent))


def measure(max_ranks: int = 4, quick: bool = False) -> tuple[Topology, dict]:
    """Measure this machine ([Note: calibration fits]); returns the `local-cpu` topology (one
    node of `max_ranks` ranks, `measured=True`) and the raw figures behind it.

    Raises ValueError for max_ranks < 2 (collectives need two ranks).
    """
    if not isinstance(max_ranks, int) or isinstance(max_ranks, bool) or max_ranks < 2:
        raise ValueError(f"calibrate: max_ranks={max_ranks!r} must be an integer >= 2 "
                         "(all_reduce is measured on 2..max_ranks ranks)")
    s = _QUICK if quick else _FULL
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank = one thread, as LocalCluster runs them
    try:
        fig = _measure_rank_compute(s)
    finally:
        torch.set_num_threads(threads)
    fig.update(_measure_ranks(max_ranks, s))
    fig["mem_bytes"] = _mem_total_bytes() / max_ranks
    link = LinkSpec("gloo-loopback", bw_bytes_per_s=fig["bw"], latency_s=fig["latency_s"])
    topo = Topology(
        name="local-cpu", num_nodes=1, devices_per_node=max_ranks,
        device=DeviceSpec(
            name=f"cpu-rank ({_cpu_model()}, 1 thread)",
            peak_flops_per_s={"float32": fig["peak_fp32"], "bfloat16": fig["peak_bf16"]},
            mem_bytes=fig["mem_bytes"], mem_bw_bytes_per_s=fig["mem_bw"],
            matmul_efficiency=fig["eff"], launch_latency_s=fig["launch_s"]),
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
    dims, sizes = s.matmul_dims, s.all_reduce_bytes
    per_p = ", ".join(f"p={p} {lat:.2g}/{bw:.2g}" for p, (lat, bw) in fig["per_p"].items())
    parts = [
        f"autoplan calibrate{' (quick)' if quick else ''} on {socket.gethostname()} at {when} "
        f"({_cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__}); all figures "
        f"fitted by calibrate, medians of {s.repeats} repeats",
        f"device = one rank = one thread: peak float32 = largest rate of square matmuls "
        f"d={dims[0]}..{dims[-1]}",
        f"matmul_efficiency fitted to compute.py's curve (rms rel. error {fig['eff_rms']:.0%}; "
        f"a half-dim of {fig['half_dim']:.0f} would fit to {fig['half_rms']:.0%})",
        f"bfloat16 peak from d={','.join(map(str, fig['bf16_dims']))}",
        f"mem_bw = mean of copy {fig['copy_bw']:.3g} and add {fig['add_bw']:.3g} B/s on "
        f"{s.mem_bytes / 2**20:.0f} MiB arrays",
        "launch latency = torch.add on 1 element",
        f"mem_bytes = MemTotal / {max_ranks}",
        f"with all {max_ranks} ranks computing at once a 256 matmul runs at "
        f"{fig['concurrent_fp32']:.3g} FLOP/s per rank "
        f"({fig['concurrent_fp32'] / fig['peak_fp32']:.0%} of peak)",
        f"links: gloo all_reduce on 2..{max_ranks} local ranks, {sizes[0]} B..."
        f"{sizes[-1] / 2**20:g} MiB, fit t = 2(p-1) latency + n 2(p-1)/p / busbw (rms rel. "
        f"error {fig['ar_rms']:.0%}; fitted per p, latency_s/busbw: {per_p})",
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
        ("matmul_efficiency", f"{dev.matmul_efficiency:.3g} (rms rel. error "
                              f"{fig['eff_rms']:.0%})"),
        ("mem_bw", f"{dev.mem_bw_bytes_per_s:.3g} B/s"),
        ("launch_latency", f"{dev.launch_latency_s:.3g} s"),
        ("mem per rank", f"{dev.mem_bytes:.3g} B"),
        ("all_reduce busbw", f"{link.bw_bytes_per_s:.3g} B/s"),
        ("all_reduce latency per step", f"{link.latency_s:.3g} s (rms rel. error "
                                        f"{fig['ar_rms']:.0%})"),
        (f"float32 per rank, {topo.devices_per_node} at once", f"{fig['concurrent_fp32']:.3g} "
                                                              "FLOP/s"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"autoplan calibrate: wrote {out}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def main(out_path: str | None = None, max_ranks: int = 4, quick: bool = False) -> int:
    """Measure this machine, write the `local-cpu` topology YAML and print the fitted figures.

    Args:
        out_path: file to write (atomically: temporary file + os.replace; directories are
            created); default `default_out_path()`, where the `local-cpu` preset looks.
        max_ranks: all_reduce is measured on 2..max_ranks gloo ranks; mem_bytes = RAM / it.
        quick: fewer sizes and repeats (a few seconds; for tests).

    Returns 0. Raises ValueError for max_ranks < 2 or unusable measurements.
    """
    out = Path(out_path).expanduser() if out_path is not None else default_out_path()
    topo, fig = measure(max_ranks=max_ranks, quick=quick)
    _write_atomically(topo, out)
    _print_table(topo, fig, out)
    return 0
