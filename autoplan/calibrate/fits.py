"""The fits of `autoplan calibrate` ([Note: calibration fits] in
autoplan/calibrate/__init__.py): closed-form least squares of the cost model's curves (matmul
efficiency, alpha-beta collectives) and the per-op figures that close compute.py's roofline on
a measured step."""

from __future__ import annotations

import math
import statistics

from autoplan.topology import DeviceSpec

__all__ = ["fit_matmul_efficiency", "best_half_dim", "all_reduce_factor_steps", "fit_collective",
           "fit_all_reduce", "fit_launch_latency", "fit_optimizer_op_s"]


def _curve(d: float, half_dim: float | None) -> float:
    from autoplan.cost_model.compute import matmul_efficiency

    unit = DeviceSpec("fit", {"float32": 1.0}, 1.0, 1.0, matmul_efficiency=1.0,
                      matmul_half_dim=half_dim if half_dim is not None else 128.0)
    return matmul_efficiency(d, unit)


def fit_matmul_efficiency(dims: list[float], rates_flops_per_s: list[float],
                          peak_flops_per_s: float, half_dim: float | None = None, *,
                          launch_latency_s: float = 0.0) -> tuple[float, float]:
    """Fit `matmul_efficiency` E to measured square-matmul rates for a given half-dim
    ([Note: calibration fits]).

    The model is compute.py's roofline for a (d, d) @ (d, d) matmul,
    t(d) = 2 d^3 / (peak E g(d)) + launch_latency_s, g(d) = d / (d + half_dim), fitted to the
    measured times 2 d^3 / rate in relative least squares; x = 1 / E has the closed form
    x = sum_d c_d (1 - L / t_d) / sum_d c_d^2 with c_d = 2 d^3 / (peak g(d) t_d).

    Args:
        dims: matmul edge d of each measurement.
        rates_flops_per_s: measured FLOP/s at each d.
        peak_flops_per_s: the device peak the curve multiplies.
        half_dim: the curve's half-dim; None: the GPU presets' default (compute.MATMUL_HALF_DIM).
        launch_latency_s: the per-op floor the roofline adds (0: rates are pure compute).

    Returns (E, rms relative error of the fitted times). Raises ValueError for empty or
    non-positive input.
    """
    if not dims or len(dims) != len(rates_flops_per_s) or peak_flops_per_s <= 0 \
            or min(rates_flops_per_s) <= 0:
        raise ValueError(f"fit_matmul_efficiency: need matching positive dims and rates and a "
                         f"positive peak; got {dims}, {rates_flops_per_s}, {peak_flops_per_s}")
    # sizes whose time the launch floor all but explains carry no information on compute
    measured = [(d, 2.0 * d**3 / r) for d, r in zip(dims, rates_flops_per_s)]
    kept = [(d, t) for d, t in measured if t > 1.5 * launch_latency_s] or measured[-1:]
    times = [t for _, t in kept]
    c = [2.0 * d**3 / (peak_flops_per_s * _curve(d, half_dim) * t) for d, t in kept]
    x = sum(ci * (1 - launch_latency_s / t) for ci, t in zip(c, times)) / sum(ci * ci for ci in c)
    if x <= 0:
        raise ValueError(f"fit_matmul_efficiency: the launch latency {launch_latency_s} s "
                         f"explains all of the measured times {times}")
    rms = math.sqrt(sum((ci * x + launch_latency_s / t - 1) ** 2 for ci, t in zip(c, times))
                    / len(c))
    return 1.0 / x, rms


def best_half_dim(dims: list[float], rates_flops_per_s: list[float],
                  peak_flops_per_s: float, *,
                  launch_latency_s: float = 0.0) -> tuple[float, float]:
    """The half-dim H of d / (d + H) that fits the rates best (log grid 1..4096, 4 points per
    octave, with E fitted for each, `fit_matmul_efficiency`) and its rms relative error."""
    grid = [2 ** (k / 4) for k in range(49)]
    fits = [(fit_matmul_efficiency(dims, rates_flops_per_s, peak_flops_per_s, h,
                                   launch_latency_s=launch_latency_s)[1], h) for h in grid]
    rms, h = min(fits)
    return h, rms


def all_reduce_factor_steps(group_size: int) -> tuple[float, int]:
    """(bandwidth factor, latency steps) of a ring all-reduce on p ranks: (2(p-1)/p, 2(p-1)),
    as comm.py's [Note: collective cost] (nccl-tests PERFORMANCE.md)."""
    from autoplan.cost_model.comm import factor_steps

    return factor_steps("all_reduce", group_size)


def fit_collective(kind: str,
                   samples: list[tuple[int, float, float]]) -> tuple[float, float, float]:
    """Fit t = steps(p) * latency_s + nbytes * factor(p) / bw_bytes_per_s (comm.py's formula
    for `kind`) to samples.

    Args:
        kind: a collective of comm.COLLECTIVES.
        samples: (group size p, nbytes, seconds) triples.

    Relative least squares (each sample's error divided by its time, so 4-byte and 4-MB
    messages weigh alike); a negative latency is clamped to 0 and the bandwidth refitted.

    Returns (latency_s, bw_bytes_per_s, rms relative error). Raises ValueError when the samples
    cannot determine a positive bandwidth (all messages tiny, or times that fall with size).
    """
    from autoplan.cost_model.comm import factor_steps

    if not samples or any(t <= 0 or p < 2 for p, _, t in samples):
        raise ValueError(f"fit_collective({kind!r}): need samples (p >= 2, nbytes, seconds > 0);"
                         f" got {samples}")
    rows = []
    for p, n, t in samples:
        factor, steps = factor_steps(kind, p)
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
            f"calibrate: {kind} times do not grow with message size, so no bandwidth can be "
            f"fitted; samples (p, bytes, s): {samples}")
    rms = math.sqrt(sum((alpha * u + inv_bw * v - 1) ** 2 for u, v in rows) / len(rows))
    return alpha, 1.0 / inv_bw, rms


def fit_all_reduce(samples: list[tuple[int, float, float]]) -> tuple[float, float, float]:
    """`fit_collective("all_reduce", samples)`: (latency_s, bw_bytes_per_s, rms)."""
    return fit_collective("all_reduce", samples)


def fit_launch_latency(device: DeviceSpec, graph, measured_s: float, *,
                       floor_s: float = 0.0) -> tuple[float, float]:
    """The launch latency that makes compute.py's roofline (forward + backward of every node of
    `graph`) equal `measured_s`: (measured - roofline without launches) / launches counted, no
    less than `floor_s`. Returns (latency_s, roofline without launches, seconds)."""
    import dataclasses

    from autoplan.cost_model.compute import backward_time_s, op_time_s

    bare = dataclasses.replace(device, launch_latency_s=0.0)
    unit = dataclasses.replace(device, launch_latency_s=1.0)
    nodes = list(graph.nodes.values())
    roofline = sum(op_time_s(n, bare, "float32") + backward_time_s(n, bare, "float32")
                   for n in nodes)
    launches = sum(op_time_s(n, unit, "float32") + backward_time_s(n, unit, "float32")
                   for n in nodes) - roofline
    return max(floor_s, (measured_s - roofline) / max(launches, 1.0)), roofline


def fit_optimizer_op_s(samples: list[dict], mem_bw_bytes_per_s: float) -> tuple[float, float]:
    """(optimizer_op_s, dtensor_optimizer_op_s): per parameter tensor and op, the host time of
    an AdamW step beyond its memory-bound pass (pipeline.OPTIMIZER_BYTES_PER_PARAM bytes per
    element over `mem_bw_bytes_per_s`), divided by pipeline.OPTIMIZER_OPS_PER_TENSOR["adamw"];
    the median over `samples` ({"adamw_plain_s", "adamw_dtensor_s", "tensors", "elements"}, one
    per rank, from `dtensor_overhead_job`), no less than 0."""
    from autoplan.cost_model.step_time import OPTIMIZER_BYTES_PER_PARAM, OPTIMIZER_OPS_PER_TENSOR

    def per_op(key: str) -> float:
        return statistics.median(
            max(0.0, r[key] - r["elements"] * OPTIMIZER_BYTES_PER_PARAM["adamw"]
                / mem_bw_bytes_per_s) / (r["tensors"] * OPTIMIZER_OPS_PER_TENSOR["adamw"])
            for r in samples)

    return per_op("adamw_plain_s"), per_op("adamw_dtensor_s")
