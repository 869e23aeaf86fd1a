"""What `autoplan calibrate` measures on a `LocalCluster` of gloo ranks ([Note: calibration
fits] in autoplan/calibrate/__init__.py): shared speed, the wait for stragglers, collectives,
DTensor and optimizer host costs. The jobs are module-level functions: LocalCluster pickles
them by name."""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Callable

import torch

from autoplan.calibrate.fits import fit_collective
from autoplan.calibrate.local import _Settings, median_call_times_s, reference_step

__all__ = ["shared_speed_job", "sync_skew_job", "fit_sync_skew", "dtensor_overhead_job"]

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


def sync_skew_job(max_ranks: int, chunk_s: float, iters: int,
                  repeats: int) -> dict[int, tuple[float, float]]:
    """On every rank: for n = 2..max_ranks, the first n ranks run `iters` x `repeats` rounds of
    [compute chunk; 4-byte all_reduce over the n ranks], each rank timing its own chunk from the
    moment the previous all_reduce returned. A round lasts as long as its slowest chunk, so a
    synchronisation costs the slowest rank's chunk minus the mean one: the wait for stragglers
    ([Note: calibration fits], sync skew). A chunk is (256, 256) matmuls for ~`chunk_s` alone.
    Returns {n: (median over rounds of (max - mean) chunk time, median mean chunk time)},
    seconds: the wait and the wall time of the compute it followed."""
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
    skew: dict[int, tuple[float, float]] = {}
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
            skew[n] = (float((chunks.max(dim=0).values - chunks.mean(dim=0)).median()),
                       float(chunks.mean(dim=0).median()))
        dist.barrier()
    return skew


def fit_sync_skew(short: dict[int, tuple[float, float]],
                  long: dict[int, tuple[float, float]]) -> tuple[dict, dict]:
    """(sync_skew_s, sync_skew_slope) per rank count from `sync_skew_job` at a short and a
    long chunk ([Note: calibration fits], sync skew): the wait is intercept + slope x chunk
    wall time, through the two points; slope and intercept clamped at 0 (a longer chunk that
    waited less is noise, not a negative drift)."""
    intercept, slope = {}, {}
    for n, (s_short, w_short) in short.items():
        s_long, w_long = long[n]
        k = max(0.0, (s_long - s_short) / (w_long - w_short)) if w_long > w_short else 0.0
        slope[n], intercept[n] = k, max(0.0, s_short - k * w_short)
    return intercept, slope


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
    from autoplan.passes.sharding import swap_dtensor_op
    from autoplan.strategies import constant_like_nodes

    torch.set_num_threads(1)
    step, graph, gm, x = reference_step()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dgm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    done: dict[int, nn.Parameter] = {}
    for node in dgm.graph.nodes:
        swap_dtensor_op(node)  # as apply_placements does for the engine's stages
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


def _collective_samples(per_rank: list[list[tuple]]) -> list[tuple[str, int, int, int, float]]:
    """(kind, p, g, nbytes, seconds) of the slowest rank of each group, sorted."""
    slowest: dict[tuple, float] = {}
    for rows in per_rank:
        for kind, p, g, n, t in rows:
            slowest[(kind, p, g, n)] = max(t, slowest.get((kind, p, g, n), 0.0))
    return [(*k, t) for k, t in sorted(slowest.items())]


def _fastest(a: list[tuple], b: list[tuple]) -> list[tuple]:
    """Per (kind, p, g, nbytes) the smaller time of two measurements (a burst of other work
    only ever adds time), sorted."""
    best = {tuple(k): t for *k, t in a}
    for *k, t in b:
        best[tuple(k)] = min(t, best.get(tuple(k), t))
    return [(*k, t) for k, t in sorted(best.items())]


def _all_reduce_rows(samples: list[tuple]) -> list[tuple[int, int, float]]:
    return [(p, n, t) for kind, p, _g, n, t in samples if kind == "all_reduce"]


def _pooled_all_reduce(samples: list[tuple]) -> tuple[float, float, float]:
    """fit_collective("all_reduce") of every group size's samples; ValueError naming the load
    when the times still do not grow with the size (the fastest of two measurements each)."""
    try:
        return fit_collective("all_reduce", _all_reduce_rows(samples))
    except ValueError as e:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        raise ValueError(f"calibrate: other work on this machine (load average {load:.1f}) "
                         f"swamped the all_reduce timings twice; rerun when it is quieter "
                         f"({e})") from e


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
        skews_long = cluster.run(sync_skew_job, max_ranks, s.skew_long_chunk_s,
                                 s.skew_long_iters, s.repeats, timeout_s=300.0)
        samples = _collective_samples(cluster.run(
            _collectives_job, max_ranks, list(s.collective_bytes), s.repeats, s.min_time_s,
            timeout_s=600.0))
        try:
            pooled = fit_collective("all_reduce", _all_reduce_rows(samples))
        except ValueError:  # a burst of load swamped the sizes: measure once more
            again = _collective_samples(cluster.run(
                _collectives_job, max_ranks, list(s.collective_bytes), 2 * s.repeats,
                s.min_time_s, timeout_s=600.0))
            samples = _fastest(samples, again)
            pooled = _pooled_all_reduce(samples)
        dtensor = cluster.run(dtensor_overhead_job, s.repeats, s.min_time_s, timeout_s=300.0)
    shared = {}
    for n in counts:
        per_round = [statistics.median(r[n][i] for r in speeds if n in r)
                     for i in range(s.speed_rounds)]
        shared[n] = statistics.median(per_round) * solo_step_s
    # the ranks computed the same figures
    skew, skew_slope = fit_sync_skew({n: skews[0][n] for n in counts[1:]},
                                     {n: skews_long[0][n] for n in counts[1:]})
    table, errors = _fit_tables(samples)
    latency_s, bw, rms = pooled
    speed = shared[max_ranks]  # all ranks measured at once: one-rank figures below
    return dict(samples=samples, shared_speed=shared, sync_skew=skew,
                sync_skew_slope=skew_slope, collectives=table,
                fit_errors=errors, latency_s=latency_s, bw=bw, ar_rms=rms,
                dtensor_s=statistics.median(r["dispatch_s"] for r in dtensor) * speed,
                redistribute_s=statistics.median(r["redistribute_s"] for r in dtensor) * speed,
                adamw=[{k: r[k] * speed if k.endswith("_s") else r[k] for k in r}
                       for r in dtensor])
