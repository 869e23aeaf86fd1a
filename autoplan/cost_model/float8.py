"""The price of a linear layer run in FP8, and which linears a `float8` plan runs so.

[Note: float8 pricing] The runtime's FP8 linear is [Note: float8 recipe] (autoplan/float8.py).
On a rank holding an (M, K) x (N, K)^T linear (M tokens, the split of its placements applied:
tokens under a token split, N under W Shard(0), K under W Shard(1)):

    forward   = matmul(2 M N K FLOPs at the device's "float8" peak; M K + N K bytes in, 2 M N out)
                + quantize(M K) + quantize(N K) + amax all-reduces of (M,) and (N,) fp32 where K
                is split
    backward  = dx: matmul(2 M N K at the FP8 peak; M N + N K in, 2 M K out)
                    + quantize(M N) + quantize(N K) + the all-reduce of dy's (M,) amaxes where
                    N is split, and of the weight's one (tensorwise) where it is split
              + dW: matmul(2 M N K at the compute dtype's peak, 2-byte operands): the bf16 dW
    quantize(e elements) = 5 e bytes / memory bandwidth + 2 launches (the amax pass reads the
                2-byte values, the cast reads them again and writes 1 byte: unfused, as torchao
                runs it eagerly)

Each matmul is a roofline at the efficiency of its smallest dim ([Note: matmul efficiency
curve] in compute.py); the all-reduce is `collective_time_s` on the tp group. dx is skipped when
the linear's input needs no gradient (backward_share 0.5 of a trainable weight), dW when the
weight is frozen. The device's "float8" peak is its dense FP8 tensor-core rate (H100/H200 SXM
datasheet: 3,958 TFLOP/s with 2:4 sparsity, 1,979 dense); a device that lists none (A100, the
CPU presets) cannot plan FP8.

Which linears (`TrainingSpec.float8`): "off": none; "on": every eligible linear (`eligible`)
whose candidate placements the runtime runs in FP8 (autoplan/float8.py `supported`), priced so
whether it pays or not; "auto": those of them where FP8 is faster than the compute dtype,
forward plus backward. The placement ILP sees each candidate's time, so it may choose the
placements that let a linear run in FP8; the plan lists the linears its chosen candidates run
in FP8 (`Plan.float8_linears`), and the report prices the plan from that list.
"""

from __future__ import annotations

import dataclasses

import torch.fx

from autoplan.cost_model.comm import collective_time_s
from autoplan.cost_model.compute import backward_time_s, matmul_dims, matmul_efficiency, op_time_s
from autoplan.float8 import ADDMM_TARGET, LINEAR_TARGET, as_linear, supported
from autoplan.graph import CapturedGraph, NodeInfo
from autoplan.topology import Topology

__all__ = ["FLOAT8_MODES", "QUANTIZE_BYTES_PER_ELEM", "Float8Times", "eligible",
           "float8_times_s", "float8_choice", "runs_in_float8"]

FLOAT8_MODES = ("off", "on", "auto")
QUANTIZE_BYTES_PER_ELEM = 5
"""Bytes moved per element quantized from a 2-byte dtype: read for the amax, read and written
(1 byte) for the cast ([Note: float8 pricing])."""
_ROUTING_TARGETS = {"aten.topk.default", "aten.sort.default", "aten.argsort.default",
                    "aten.max.dim", "autoplan.experts.default"}


@dataclasses.dataclass(frozen=True)
class Float8Times:
    """A linear's times in FP8 on one rank, seconds ([Note: float8 pricing])."""

    forward_s: float
    backward_s: float


def _feeds_routing(node: torch.fx.Node, depth: int = 4) -> bool:
    """Whether `node`'s output reaches a top-k / sort / the experts op within `depth` ops: a
    router's scores, which pick discrete routes."""
    frontier = [node]
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users if u.op == "call_function"]
        if any(str(u.target) in _ROUTING_TARGETS for u in frontier):
            return True
    return False


def eligible(graph: CapturedGraph) -> dict[str, str]:
    """{linear node name: weight FQN} of the linears a float8 plan may run in FP8 ([Note:
    float8 recipe]): inside a repeated block, multiplying by a parameter with both dims
    divisible by 16, not a router's. The LM head and other linears outside the blocks stay in
    the compute dtype."""
    in_blocks = {n for names in graph.layer_nodes.values() for n in names}
    out = {}
    for node in graph.gm.graph.nodes:
        index = {LINEAR_TARGET: 1, ADDMM_TARGET: 2}.get(node.target)
        if (node.op != "call_function" or index is None or node.name not in in_blocks
                or len(node.args) <= index):
            continue
        w = node.args[index]
        info = graph.params.get(w.target) if isinstance(w, torch.fx.Node) and \
            w.op == "get_attr" else None
        if info is None or info.is_buffer or len(info.shape) != 2 or any(
                d % 16 for d in info.shape) or _feeds_routing(node):
            continue
        out[node.name] = w.target
    return out


def _local_dims(node: NodeInfo, x: str, w: str, shard_factor: float) -> tuple[float, ...]:
    """(M, N, K) of the rank's share of linear `node` under placements x, w."""
    _, m, n, k = matmul_dims(node)
    if w == "S(0)":
        return m, n / shard_factor, k
    if w == "S(1)":
        return m, n, k / shard_factor
    return m / shard_factor, n, k  # a token split (or none: shard_factor 1)


def _matmul_s(flops: float, nbytes: float, min_dim: float, peak: float, device) -> float:
    return max(flops / (peak * matmul_efficiency(min_dim, device)),
               nbytes / device.mem_bw_bytes_per_s) + device.launch_latency_s


def _quantize_s(elems: float, device) -> float:
    return QUANTIZE_BYTES_PER_ELEM * elems / device.mem_bw_bytes_per_s \
        + 2 * device.launch_latency_s


def _amax_s(elems: float, tp: int, topology: Topology) -> float:
    """One all-reduce (max) of `elems` fp32 amaxes over the tp group."""
    return collective_time_s("all_reduce", 4 * elems, tp, topology)


def float8_times_s(node: NodeInfo, x: str, w: str, *, shard_factor: float, tp: int,
                   topology: Topology, dtype: str, weight_trainable: bool) -> Float8Times:
    """Forward and backward seconds of linear `node` (at the microbatch's tokens) in FP8 on
    one rank, its input x and weight w placed as the plan writes them ([Note: float8
    pricing]). Raises ValueError when the device lists no "float8" peak."""
    device = topology.device
    fp8, hp = device.flops_per_s("float8"), device.flops_per_s(dtype)
    m, n, k = _local_dims(node, x, w, shard_factor)
    flops, small = 2 * m * n * k, min(m, n, k)
    fwd = (_matmul_s(flops, m * k + n * k + 2 * m * n, small, fp8, device)
           + _quantize_s(m * k, device) + _quantize_s(n * k, device))
    if w == "S(1)" and tp > 1:
        fwd += _amax_s(m, tp, topology) + _amax_s(n, tp, topology)
    bwd = 0.0
    if node.backward_share == 0.0:
        return Float8Times(fwd, bwd)
    if node.backward_share >= 1.0 or not weight_trainable:  # dx
        bwd += (_matmul_s(flops, m * n + n * k + 2 * m * k, small, fp8, device)
                + _quantize_s(m * n, device) + _quantize_s(n * k, device))
        if w == "S(0)" and tp > 1:
            bwd += _amax_s(m, tp, topology)
        if w in ("S(0)", "S(1)") and tp > 1:
            bwd += _amax_s(1, tp, topology)
    if weight_trainable:  # dW in the compute dtype
        bwd += _matmul_s(flops, 2 * (m * n + m * k + n * k), small, hp, device)
    return Float8Times(fwd, bwd)


def runs_in_float8(fx_node: torch.fx.Node, inputs: tuple[str, ...], tp: int) -> bool:
    """Whether the FP8 linear runs linear-like node `fx_node` (aten.linear, Conv1D's
    aten.addmm) on local shards under a candidate with input placements `inputs` at `tp`
    (autoplan/float8.py `supported`, in F.linear's convention: `as_linear`), each rank's
    share of the weight having both dims multiples of 16 (CUDA `_scaled_mm`'s requirement;
    a split dim divides by tp evenly)."""
    placed = as_linear(fx_node.target, inputs)
    addmm = fx_node.target is ADDMM_TARGET
    x_arg, w_arg = fx_node.args[1 if addmm else 0], fx_node.args[2 if addmm else 1]
    val = x_arg.meta.get("val") if isinstance(x_arg, torch.fx.Node) else None
    w_val = w_arg.meta.get("val") if isinstance(w_arg, torch.fx.Node) else None
    if placed is None or val is None or w_val is None:
        return False
    x, w, bias = placed
    n, k = reversed(w_val.shape) if addmm else w_val.shape  # the (N, K) of F.linear
    n_local = n / tp if w == "S(0)" else n
    k_local = k / tp if w == "S(1)" else k
    if n_local % 16 or k_local % 16:
        return False
    has_bias = (fx_node.args[0] if fx_node.target is ADDMM_TARGET else
                fx_node.args[2] if len(fx_node.args) > 2 else None) is not None
    return supported(x, w, val.ndim, (bias or "R") if has_bias else None)


def float8_choice(mode: str, node: NodeInfo, fx_node: torch.fx.Node, inputs: tuple[str, ...],
                  *, shard_factor: float, tp: int, topology: Topology, dtype: str,
                  weight_trainable: bool, routing_skew: float = 1.0, weight_fqn: str = "",
                  only: tuple[str, ...] = ()) -> Float8Times | None:
    """The FP8 times of eligible linear `node` (`fx_node` its captured node, `weight_fqn` its
    weight) under a candidate with input placements `inputs`, when `mode` runs it in FP8 there
    ([Note: float8 pricing]), else None (it runs in the compute dtype). `only`: the linears
    that may (TrainingSpec.float8_only; () for all)."""
    if mode == "off" or (only and weight_fqn not in only) or not runs_in_float8(
            fx_node, inputs, tp):
        return None
    x, w, _bias = as_linear(fx_node.target, inputs)
    times = float8_times_s(node, x, w, shard_factor=shard_factor, tp=tp,
                           topology=topology, dtype=dtype, weight_trainable=weight_trainable)
    if mode == "auto":
        device = topology.device
        high = (op_time_s(node, device, dtype, shard_factor=shard_factor,
                          routing_skew=routing_skew)
                + backward_time_s(node, device, dtype, shard_factor=shard_factor,
                                  routing_skew=routing_skew))
        if times.forward_s + times.backward_s >= high:
            return None
    return times
