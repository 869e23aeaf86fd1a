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
  is the largest measured rate. compute.py's curve, rate(d) = peak * E * d / (d + H), is fitted
  with the call's floor (`torch.add` on 1 element, no autograd), t(d) = 2 d^3 / rate(d) + floor,
  to the measured
  times in relative least squares: for each half-dim H of a log grid (1..4096, 4 points per
  octave) 1 / E has a closed form (`fit_matmul_efficiency`); the (E, H) of least error are
  `matmul_efficiency` and `matmul_half_dim`. Only peak * E is determined by the data; we keep
  peak = the largest measured rate (so MFU stays "of measured peak"), which lets E exceed 1.
  `peak_flops_per_s["bfloat16"]`: the largest rate of bf16 matmuls of d = 256 and 512 (512
  skipped where bf16 is emulated and slow).
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
- Sync skew (`DeviceSpec.sync_skew_s`, cost_model/comm.py [Note: stragglers]): for
  n = 2..max_ranks the first n ranks run rounds of [a compute chunk of (256, 256) matmuls,
  ~`skew_chunk_s` alone; a 4-byte all_reduce over the n ranks], each timing its own chunk; a
  round lasts as long as its slowest chunk, so the wait for stragglers per synchronisation is
  the slowest chunk minus the mean one: its median over `skew_iters` x `repeats` rounds (the
  ranks agree on it: all-gathered chunk times).
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
    "fit_collective", "fit_all_reduce", "all_reduce_factor_steps", "median_call_times_s",
    "shared_speed_job", "sync_skew_job", "reference_step", "reference_roofline_s",
    "fit_optimizer_op_s",
]

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


_FULL = _Settings(matmul_dims=(16, 32, 64, 128, 256, 512, 1024), bf16_dims=(256, 512),
                  mem_bytes=64 * 2**20,
                  collective_bytes=(4, 2**10, 2**14, 2**17, 2**20, 2**22, 2**24),
                  repeats=7, min_time_s=0.01, speed_window_s=0.3, speed_rounds=3,
                  skew_chunk_s=0.005, skew_iters=20)
_QUICK = _Settings(matmul_dims=(32, 64, 128, 256), bf16_dims=(256,), mem_bytes=16 * 2**20,
                   collective_bytes=(4, 2**14, 2**20), repeats=3, min_time_s=0.003,
                   speed_window_s=0.05, speed_rounds=1,
                   skew_chunk_s=0.002, skew_iters=5)


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
    from autoplan.solver.pipeline import OPTIMIZER_BYTES_PER_PARAM, OPTIMIZER_OPS_PER_TENSOR

    def per_op(key: str) -> float:
        return statistics.median(
            max(0.0, r[key] - r["elements"] * OPTIMIZER_BYTES_PER_PARAM["adamw"]
                / mem_bw_bytes_per_s) / (r["tensors"] * OPTIMIZER_OPS_PER_TENSOR["adamw"])
            for r in samples)

    return per_op("adamw_plain_s"), per_op("adamw_dtensor_s")


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

def _speed_windows(work: Callable[[], float], counts: list[int], window_s: float,
                   rounds: int) -> dict[int, list[float]]:
    """For each n in `counts` (rounds interleaved) the first n ranks call `work` (returning
    the work one call did) for `window_s` at once while the others wait in a barrier, asleep;
    returns this rank's work per second for every n it took part in: {n: [rate per round]}.
    A throughput over the window, not a median of calls: time slicing must count."""
    import torch.distributed as dist

    rank = dist.get_rank()
    rates: dict[int, list[float]] = {}
    for _ in range(rounds):
        for n in counts:
            dist.barrier()
            if rank < n:
                done, t0 = 0.0, time.perf_counter()
                while time.perf_counter() - t0 < window_s:
                    done += work()
                rates.setdefault(n, []).append(done / (time.perf_counter() - t0))
            dist.barrier()
    return rates


def shared_speed_job(counts: list[int], window_s: float, rounds: int) -> dict[int, list[float]]:
    """On every rank: reference training steps per second (`reference_step`) with the first
    n ranks stepping at once, for each n in `counts` ([Note: calibration fits], shared speed):
    {n: [steps/s per round]}."""
    torch.set_num_threads(1)
    step = reference_step()[0]
    step()  # warm-up: allocator, autograd caches

    def one_step() -> float:
        step()
        return 1.0

    return _speed_windows(one_step, counts, window_s, rounds)


def sync_skew_job(max_ranks: int, chunk_s: float, iters: int, repeats: int) -> dict[int, float]:
    """On every rank: for n = 2..max_ranks, the first n ranks run `iters` x `repeats` rounds of
    [compute chunk; 4-byte all_reduce over the n ranks], each rank timing its own chunk from the
    moment the previous all_reduce returned. A round lasts as long as its slowest chunk, so a
    synchronisation costs the slowest rank's chunk minus the mean one: the wait for stragglers
    ([Note: calibration fits], sync skew). A chunk is (256, 256) matmuls for ~`chunk_s` alone.
    Returns {n: median over rounds of (max - mean) chunk time, seconds}."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank()
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    out_buf = torch.empty(256, 256)
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mm(a, b, out=out_buf)
    calls = torch.tensor([max(1, round(chunk_s / ((time.perf_counter() - t0) / 20)))])
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)  # every rank runs the same chunk
    k, flag, rounds = int(calls), torch.zeros(1), iters * repeats
    skew: dict[int, float] = {}
    for n in range(2, max_ranks + 1):
        group = dist.new_group(list(range(n)))  # collective: every rank creates it
        if rank < n:
            mine = torch.zeros(rounds, dtype=torch.float64)
            dist.barrier(group=group)
            for r in range(rounds):
                t0 = time.perf_counter()
                for _ in range(k):
                    torch.mm(a, b, out=out_buf)
                mine[r] = time.perf_counter() - t0
                dist.all_reduce(flag, group=group)
            every = torch.zeros(n * rounds, dtype=torch.float64)
            dist.all_gather_into_tensor(every, mine, group=group)
            chunks = every.view(n, rounds)
            skew[n] = float((chunks.max(dim=0).values - chunks.mean(dim=0)).median())
        dist.barrier()
    return skew


def dtensor_overhead_job(repeats: int, min_time_s: float) -> dict:
    """On every rank, the host-time figures of DTensor and of the optimizer step
    ([Note: calibration fits]), all ranks at once; nothing communicates (replicated values need
    no collective). Returns {"dispatch_s": seconds per DTensor dispatch (`compute.
    dtensor_dispatches` counting, constant-like nodes excluded as the solver does) that the
    reference training step costs more with its weights and input as Replicate DTensors over
    all ranks -- run as the engine runs a tensor-parallel stage, under implicit replication --
    than with plain tensors; "adamw_plain_s" / "adamw_dtensor_s": one AdamW step over the
    reference model's parameters as plain tensors / as those DTensors; "tensors", "elements":
    how many parameter tensors and elements that step updates; "redistribute_s":
    `_redistribute_overhead_s`}."""
    import copy

    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from autoplan._torch_compat import implicit_replication
    from autoplan.cost_model.compute import dtensor_dispatches
    from autoplan.passes.sharding import reshape, sdpa_local
    from autoplan.strategies import constant_like_nodes

    torch.set_num_threads(1)
    step, graph, gm, x = reference_step()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dgm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    aten = torch.ops.aten
    done: dict[int, nn.Parameter] = {}
    for node in dgm.graph.nodes:
        # the op swaps of passes.sharding.apply_placements, as the engine runs a stage
        if node.target is aten.scaled_dot_product_attention.default:
            node.target = sdpa_local
        elif node.target in (aten.view.default, aten.reshape.default):
            node.target = reshape
        if node.op != "get_attr":
            continue
        owner_path, _, leaf = node.target.rpartition(".")
        owner = dgm.get_submodule(owner_path) if owner_path else dgm
        p = owner._parameters.get(leaf)
        if p is not None:
            if id(p) not in done:
                done[id(p)] = nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()]))
            owner._parameters[leaf] = done[id(p)]
    dgm.recompile()

    def dtensor_step():
        with implicit_replication():
            out = dgm(DTensor.from_local(x, mesh, [Replicate()], run_check=False))
            F.cross_entropy(out.to_local().reshape(-1, 256), x.reshape(-1)).backward()

    step()
    dtensor_step()  # every parameter has a gradient now, for the optimizer steps
    plain = list(dict.fromkeys(gm.parameters()))
    distributed = list(done.values())
    adamw = {"adamw_plain_s": torch.optim.AdamW(plain, lr=1e-6),
             "adamw_dtensor_s": torch.optim.AdamW(distributed, lr=1e-6)}
    times = median_call_times_s({"plain": step, "dtensor": dtensor_step,
                                 **{k: opt.step for k, opt in adamw.items()}},
                                repeats=repeats, min_time_s=min_time_s)
    constants = constant_like_nodes(graph)
    count = sum(dtensor_dispatches(n) for name, n in graph.nodes.items()
                if name not in constants)
    return {"dispatch_s": max(0.0, times["dtensor"] - times["plain"]) / max(count, 1),
            "adamw_plain_s": times["adamw_plain_s"], "adamw_dtensor_s": times["adamw_dtensor_s"],
            "tensors": len(plain), "elements": sum(p.numel() for p in plain),
            "redistribute_s": _redistribute_overhead_s(mesh, repeats)}


def _redistribute_overhead_s(mesh, repeats: int, calls: int = 100) -> float:
    """Host time of one DTensor redistribution beyond its collective, seconds: a small
    activation-like tensor (8, 8 p) Shard(1) -> Replicate (all-gather, then the local
    reassembly a non-leading dim needs), minus a raw all_gather_into_tensor of the same bytes.
    Interleaved repeats of `calls` calls each, the same count on every rank (collectives)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    p = mesh.size()
    sharded = distribute_tensor(torch.randn(8, 8 * p), mesh, [Shard(1)])
    local, full = sharded.to_local().contiguous(), torch.empty(8 * p, 8)
    fns = {"dtensor": lambda: sharded.redistribute(mesh, [Replicate()]),
           "raw": lambda: dist.all_gather_into_tensor(full, local)}
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[key].append((time.perf_counter() - t0) / calls)
    return max(0.0, statistics.median(samples["dtensor"]) - statistics.median(samples["raw"]))


def _collective_fns(kind: str, nbytes: int, group, ranks: list[int]):
    """A zero-argument call of `kind` on `group` moving `nbytes` ([Note: collective cost])."""
    import torch.distributed as dist

    p, me = len(ranks), dist.get_rank()
    numel = max(p, nbytes // 4 // p * p)  # divisible by p for the sharded kinds
    buf = torch.zeros(numel)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(buf, group=group)
    if kind == "all_gather":
        shard = torch.zeros(numel // p)
        return lambda: dist.all_gather_into_tensor(buf, shard, group=group)
    if kind == "reduce_scatter":
        shard = torch.zeros(numel // p)
        return lambda: dist.reduce_scatter_tensor(shard, buf, group=group)
    if kind == "broadcast":
        return lambda: dist.broadcast(buf, src=ranks[0], group=group)
    peer = ranks[1] if me == ranks[0] else ranks[0]  # send_recv: half a ping-pong

    def ping_pong():
        if me == ranks[0]:
            dist.send(buf, peer, group=group)
            dist.recv(buf, peer, group=group)
        else:
            dist.recv(buf, peer, group=group)
            dist.send(buf, peer, group=group)
    return ping_pong


def _time_group_s(kind: str, nbytes_list: list[int], group, ranks: list[int], repeats: int,
                  min_time_s: float) -> dict[int, float]:
    """Median seconds of one `kind` per message size on `group`. Repeats are interleaved over
    the sizes, so that a burst of load from other processes hits all sizes alike."""
    import torch.distributed as dist

    loops = {}
    for n in nbytes_list:
        fn = _collective_fns(kind, n, group, ranks)
        fn()  # warm-up (connections, buffers)
        t0 = time.perf_counter()
        fn()
        # Members must agree on the loop count, or one would wait for a call that never comes.
        once = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(once, op=dist.ReduceOp.MAX, group=group)
        loops[n] = (fn, max(1, math.ceil(min_time_s / max(float(once), 1e-9))))
    samples: dict[int, list[float]] = {n: [] for n in nbytes_list}
    for _ in range(repeats):
        for n, (fn, iters) in loops.items():
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            per_call = (time.perf_counter() - t0) / iters
            samples[n].append(per_call / 2 if kind == "send_recv" else per_call)
    return {n: statistics.median(ts) for n, ts in samples.items()}


def _collectives_job(max_ranks: int, nbytes_list: list[int], repeats: int,
                     min_time_s: float) -> list[tuple[str, int, int, int, float]]:
    """On every rank: for N = 2..max_ranks and p | N, g = N / p concurrent groups of p
    consecutive ranks among the first N time every kind ([Note: calibration fits]).
    Returns this rank's (kind, p, g, nbytes, median seconds)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = []
    for total in range(2, max_ranks + 1):
        for p in (d for d in range(2, total + 1) if total % d == 0):
            g = total // p
            layouts = [list(range(i * p, (i + 1) * p)) for i in range(g)]
            groups = [dist.new_group(ranks=r) for r in layouts]  # every rank creates every group
            mine = next((i for i, r in enumerate(layouts) if rank in r), None)
            kinds = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
            kinds += ["send_recv"] if p == 2 else []
            for kind in kinds:
                if mine is not None:
                    times = _time_group_s(kind, nbytes_list, groups[mine], layouts[mine],
                                          repeats, min_time_s)
                    out += [(kind, p, g, n, t) for n, t in times.items()]
                dist.barrier()  # the idle ranks wait here; the next kind starts together
    return out


# --- fits -------------------------------------------------------------------------------------

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


# --- measure and write --------------------------------------------------------------------------

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


def _fit_tables(samples: list[tuple[str, int, int, int, float]]) -> tuple[dict, dict]:
    """LinkSpec.collectives {kind: {p: {g: [latency_s, bw]}}} and their rms errors."""
    by_key: dict[tuple[str, int, int], list] = {}
    for kind, p, g, n, t in samples:
        by_key.setdefault((kind, p, g), []).append((p, n, t))
    table: dict = {}
    errors: dict = {}
    for (kind, p, g), rows in sorted(by_key.items()):
        try:
            latency_s, bw, rms = fit_collective(kind, rows)
        except ValueError:  # noise swamped the sizes: the link's own figures stand in
            errors[(kind, p, g)] = float("nan")
            continue
        table.setdefault(kind, {}).setdefault(p, {})[g] = [latency_s, bw]
        errors[(kind, p, g)] = rms
    for p, by_g in table.get("all_gather", {}).items():  # gloo's all_to_all for DTensor
        table.setdefault("all_to_all", {})[p] = {g: [lat, bw / p] for g, (lat, bw) in
                                                 by_g.items()}
    return table, errors


def _measure_ranks(max_ranks: int, s: _Settings, solo_step_s: float) -> dict:
    """Shared speed, sync skew, collective fits and DTensor overhead on a
    LocalCluster(max_ranks) ([Note: calibration fits]); `solo_step_s`: compute.py's time of the
    reference training step on one rank alone (`reference_roofline_s`)."""
    from autoplan.runtime.launcher import LocalCluster

    counts = list(range(1, max_ranks + 1))
    with LocalCluster(max_ranks) as cluster:
        speeds = cluster.run(shared_speed_job, counts, s.speed_window_s, s.speed_rounds,
                             timeout_s=300.0)
        skews = cluster.run(sync_skew_job, max_ranks, s.skew_chunk_s, s.skew_iters, s.repeats,
                            timeout_s=300.0)
        per_rank = cluster.run(_collectives_job, max_ranks, list(s.collective_bytes),
                               s.repeats, s.min_time_s, timeout_s=600.0)
        dtensor = cluster.run(dtensor_overhead_job, s.repeats, s.min_time_s, timeout_s=300.0)
    shared = {}
    for n in counts:
        per_round = [statistics.median(r[n][i] for r in speeds if n in r)
                     for i in range(s.speed_rounds)]
        shared[n] = statistics.median(per_round) * solo_step_s
    skew = {n: skews[0][n] for n in counts[1:]}  # the ranks computed the same figure
    slowest: dict[tuple, float] = {}
    for rows in per_rank:
        for kind, p, g, n, t in rows:
            slowest[(kind, p, g, n)] = max(t, slowest.get((kind, p, g, n), 0.0))
    samples = [(*k, t) for k, t in sorted(slowest.items())]
    table, errors = _fit_tables(samples)
    latency_s, bw, rms = fit_collective(
        "all_reduce", [(p, n, t) for kind, p, _g, n, t in samples if kind == "all_reduce"])
    speed = shared[max_ranks]  # all ranks measured at once: one-rank figures below
    return dict(samples=samples, shared_speed=shared, sync_skew=skew, collectives=table,
                fit_errors=errors, latency_s=latency_s, bw=bw, ar_rms=rms,
                dtensor_s=statistics.median(r["dispatch_s"] for r in dtensor) * speed,
                redistribute_s=statistics.median(r["redistribute_s"] for r in dtensor) * speed,
                adamw=[{k: r[k] * speed if k.endswith("_s") else r[k] for k in r}
                       for r in dtensor])


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
            peak_flops_per_s={"float32": fig["peak_fp32"], "bfloat16": fig["peak_bf16"]},
            mem_bytes=fig["mem_bytes"], mem_bw_bytes_per_s=fig["mem_bw"],
            matmul_efficiency=fig["eff"], launch_latency_s=fig["launch_s"],
            matmul_half_dim=fig["half_dim"], shared_speed=fig["shared_speed"],
            elementwise_s_per_elem=fig["elementwise"], dtensor_op_overhead_s=fig["dtensor_s"],
            sync_skew_s=fig["sync_skew"], optimizer_op_s=fig["optimizer_op_s"],
            dtensor_redistribute_s=fig["redistribute_s"],
            dtensor_optimizer_op_s=fig["dtensor_optimizer_op_s"]),
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
        "sync_skew_s = slowest minus mean chunk of rounds [compute chunk of "
        f"{s.skew_chunk_s * 1e3:g} ms; 4-byte all_reduce]: "
        + ", ".join(f"n={n} {v * 1e3:.2f} ms" for n, v in fig["sync_skew"].items()),
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
         ", ".join(f"{n}: {v:.3g} s" for n, v in dev.sync_skew_s.items())),
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
