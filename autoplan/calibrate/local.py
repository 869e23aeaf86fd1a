"""What `autoplan calibrate` measures in its own process, one rank = one thread ([Note:
calibration fits] in autoplan/calibrate/__init__.py): matmul rates, memory bandwidth,
transcendental ops, the dispatch floor, and the reference training step that the launch
latency, shared speed and DTensor figures are defined on."""

from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, TypeVar

import torch

from autoplan.calibrate.fits import best_half_dim, fit_launch_latency, fit_matmul_efficiency
from autoplan.topology import DeviceSpec

__all__ = ["median_call_times_s", "reference_step", "reference_roofline_s"]

K = TypeVar("K")


@dataclass(frozen=True)
class _Settings:
    """How much to measure. `quick` trades precision for a run of a few seconds (tests)."""

    matmul_dims: tuple[int, ...]
    bf16_dims: tuple[int, ...]
    mem_bytes: int            # size of each array of the bandwidth test
    collective_bytes: tuple[int, ...]
    repeats: int
    min_time_s: float         # shortest repeat; shorter calls are looped
    speed_window_s: float     # throughput window of the shared-speed measurement
    speed_rounds: int
    skew_chunk_s: float       # compute between two synchronisations of the sync-skew test
    skew_iters: int           # synchronisations per repeat of it
    skew_long_chunk_s: float  # the longer chunk that fits the skew's slope
    skew_long_iters: int      # synchronisations per repeat with it


_FULL = _Settings(matmul_dims=(16, 32, 64, 128, 256, 512, 1024), bf16_dims=(256, 512),
                  mem_bytes=64 * 2**20,
                  collective_bytes=(4, 2**10, 2**14, 2**17, 2**20, 2**22, 2**24),
                  repeats=7, min_time_s=0.01, speed_window_s=0.3, speed_rounds=3,
                  skew_chunk_s=0.005, skew_iters=20, skew_long_chunk_s=0.1,
                  skew_long_iters=4)


_QUICK = _Settings(matmul_dims=(32, 64, 128, 256), bf16_dims=(256,), mem_bytes=16 * 2**20,
                   collective_bytes=(4, 2**14, 2**20), repeats=3, min_time_s=0.003,
                   speed_window_s=0.05, speed_rounds=1,
                   skew_chunk_s=0.002, skew_iters=5, skew_long_chunk_s=0.01,
                   skew_long_iters=2)


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


_CHUNK_BYTES = 2 * 2**20
"""Size of one activation-like tensor of the elementwise measurements (2 MiB)."""


_TRANSCENDENTAL_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh, "exp": torch.exp, "erf": torch.erf, "sigmoid": torch.sigmoid,
    "log": torch.log, "pow": lambda x: torch.pow(x, 3.0), "sin": torch.sin, "cos": torch.cos,
    "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "_softmax": lambda x: torch.softmax(x.view(-1, 1024), -1),
    "_log_softmax": lambda x: torch.log_softmax(x.view(-1, 1024), -1),
}


def _elementwise(s: _Settings) -> tuple[float, dict[str, float]]:
    """(bandwidth B/s, {op: seconds per element}) of out-of-place elementwise ops on
    activation-like tensors that do not stay in the caches ([Note: calibration fits])."""
    n = _CHUNK_BYTES // 4
    count = max(4, s.mem_bytes // _CHUNK_BYTES)
    xs = [torch.rand(n) + 0.5 for _ in range(count)]  # positive: log, sqrt, rsqrt are defined

    def chain():  # the bytes roofline counts: 2 n per unary op, 3 n per binary one, x 4 bytes
        for x in xs:
            a = x * 0.5
            b = a + x
            c = b * a
            (c + 1.0) * x

    def unary(fn):
        return lambda: [fn(x) for x in xs]

    fns = {"chain": chain, **{op: unary(fn) for op, fn in _TRANSCENDENTAL_FNS.items()}}
    times = median_call_times_s(fns, repeats=s.repeats, min_time_s=s.min_time_s)
    chain_bytes = count * n * 4 * (2 + 3 + 3 + 2 + 3)
    per_elem = {op: times[op] / (count * n) for op in _TRANSCENDENTAL_FNS}
    return chain_bytes / times["chain"], per_elem


def _dispatch_s(s: _Settings) -> float:
    """Time of `torch.add` on 1-element tensors without autograd: the floor of the
    microbenchmarks' calls (the matmul fit's launch term)."""
    x, y = torch.ones(1), torch.ones(1)
    return median_call_times_s({"add": lambda: torch.add(x, y)}, repeats=s.repeats + 2,
                               min_time_s=s.min_time_s)["add"]


def _launch_latency_s(s: _Settings, chain: int = 100) -> float:
    """Forward time of one op of a training graph on a 1-element tensor: dispatch plus
    autograd's recording of the op (the floor every op of a training step pays)."""
    w = torch.ones(1, requires_grad=True)

    def forward():
        x = w
        for _ in range(chain):
            x = x * 1.0001
        return x

    return median_call_times_s({"fwd": forward}, repeats=s.repeats + 2,
                               min_time_s=s.min_time_s)["fwd"] / chain


@functools.lru_cache(maxsize=1)
def reference_step():
    """(step fn, captured graph, materialized graph module, input) of the reference training
    graph of [Note: calibration fits]: nanoGPT, 2 blocks of width 128, 4 heads, vocabulary
    256, batch 8 x 64 tokens, run as the runtime runs a stage: the captured aten graph with real
    weights, forward, cross-entropy and backward. Built once per process (capture takes ~1 s)."""
    import copy

    import torch.nn.functional as F

    from autoplan.capture import capture
    from autoplan.models.nanogpt import GPT, GPTConfig
    from autoplan.passes.device import materialize

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=128))
    x = torch.randint(0, 256, (8, 64))
    graph = capture(model, (x,), model_name="calibrate-reference")
    gm = torch.fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph))
    materialize(gm, model, "cpu")

    def step():
        F.cross_entropy(gm(x).reshape(-1, 256), x.reshape(-1)).backward()

    return step, graph, gm, x


def reference_roofline_s(device: DeviceSpec, graph=None) -> float:
    """compute.py's time of the reference training graph on one rank alone (forward +
    backward of every node; `fit_launch_latency` makes it equal the measured step), seconds.
    `graph`: the reference graph (default: built by `reference_step`)."""
    from autoplan.cost_model.compute import backward_time_s, op_time_s

    graph = graph if graph is not None else reference_step()[1]
    return sum(op_time_s(n, device, "float32") + backward_time_s(n, device, "float32")
               for n in graph.nodes.values())


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


def _measure_rank_compute(s: _Settings) -> dict:
    """Single-thread compute figures of one rank, measured in this process."""
    launch_s, dispatch_s = _launch_latency_s(s), _dispatch_s(s)
    rates = _matmul_rates(s.matmul_dims, torch.float32, s)
    peak = max(rates.values())
    dims, values = list(rates), list(rates.values())
    half_dim, rms = best_half_dim(dims, values, peak, launch_latency_s=dispatch_s)
    eff, _ = fit_matmul_efficiency(dims, values, peak, half_dim, launch_latency_s=dispatch_s)
    _, rms_128 = fit_matmul_efficiency(dims, values, peak, 128.0, launch_latency_s=dispatch_s)
    bf16 = _matmul_rates(_bf16_dims(s), torch.bfloat16, s)
    mem_bw, per_elem = _elementwise(s)
    device = DeviceSpec("fit", {"float32": peak}, 1.0, mem_bw, matmul_efficiency=eff,
                        matmul_half_dim=half_dim, elementwise_s_per_elem=per_elem)
    step, graph, _gm, _x = reference_step()
    measured = median_call_times_s({"step": step}, repeats=s.repeats, min_time_s=s.min_time_s)
    floor_s, roofline = fit_launch_latency(device, graph, measured["step"], floor_s=launch_s)
    return dict(matmul_rates=rates, peak_fp32=peak, eff=eff, half_dim=half_dim, eff_rms=rms,
                rms_128=rms_128, peak_bf16=max(bf16.values()), bf16_dims=tuple(bf16),
                mem_bw=mem_bw, elementwise=per_elem, launch_s=floor_s, chain_launch_s=launch_s,
                reference_s=measured["step"], reference_roofline_s=roofline)
