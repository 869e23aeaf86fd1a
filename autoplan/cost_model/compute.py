"""Compute time of aten ops: a roofline per op with a matmul efficiency curve.

[Note: roofline]
An op's forward time on one device is

    t = max(flops / (peak_flops(dtype) * efficiency), bytes / mem_bw) + launch_latency

(Williams, Waterman & Patterson, "Roofline", CACM 2009). `flops` are the forward FLOPs that
`torch.utils.flop_counter` reports for the node (0 for ops it does not count, which makes those
ops memory-bound, as elementwise ops are); `bytes` are the node's input plus output bytes. Only
matmul-like ops and fused attention use the efficiency factor; memory-bound ops are assumed to
reach the device's memory bandwidth (a fused elementwise kernel does, to within ~10%).

Elementwise ops whose arithmetic can outlast their memory traffic (transcendentals: tanh, exp,
erf, pow, ...; TRANSCENDENTAL_OPS) have a third term, elements x device.elementwise_s_per_elem[op]
(measured per op by `autoplan calibrate` for CPU ranks; empty for GPUs, where the byte term
bounds them): t = max(compute, bytes, elements) + launch. In the backward the ops whose gradient
evaluates a transcendental again (BACKWARD_TRANSCENDENTAL: pow -> pow, erf -> exp, gelu -> tanh or
erf, silu -> sigmoid; torch/csrc/autograd/derivatives.yaml) pay it again; tanh, exp, sigmoid,
log and softmax reuse their output or divide.

Work sharding: with `shard_factor = f` each rank does `flops / f` and moves `bytes / f` (a tensor
split over f ranks); collectives are priced separately by `comm`.

[Note: matmul efficiency curve]
A large matmul reaches `device.matmul_efficiency` of peak (fitted by `autoplan calibrate`; the
presets use 0.8). Small and skinny matmuls do worse because tiles are partly empty and there are
too few of them to fill the machine. We model this as saturating in the smallest of (m, n, k):

    efficiency(d) = device.matmul_efficiency * d / (d + device.matmul_half_dim),  d = min(m, n, k)

The half-dim is a device figure. For the GPU presets it is MATMUL_HALF_DIM = 128, an assumption
(not derived, not fitted): half of the large-matmul efficiency at d = 128 (one tensor-core tile
edge), 89% of it at d = 1024 and 97% at d = 4096. A one-thread CPU matmul has no tiles to fill
a machine with and saturates much earlier: `autoplan calibrate` fits the half-dim together with
the efficiency (16-32 on an AVX-512 core). Very skinny matmuls (m = 1, decoding) become
memory-bound through the roofline's byte term anyway.

The routed experts ([Note: experts op] in autoplan/experts.py) are not one matmul: each expert
runs its own GEMMs on the rows routed to it, m = T k / E of them under balanced routing (T
tokens, k choices, E experts), against its (H, 2I) and (I, H) weights, whether as a loop
(the eager kernel) or as one grouped GEMM (a tile never straddles two experts). Their
efficiency is the same curve at d = min(m, I, H) (`expert_gemm_dims`), with no constant of
its own: DeepSeek-V3's 256 experts of I = 2048 at top-8 put a 4096-token microbatch at m =
128, half the large-matmul efficiency on the GPU presets. Splitting the experts over tp ranks
keeps every expert's rows (each rank holds whole experts); expert parallelism gathers ep ranks'
tokens onto each expert, m = ep T k / E (cost_model/expert_parallel.py prices the change).

Backward: a matmul-like op does two matmuls of the forward's size (input gradient and weight
gradient), so 2x forward FLOPs: forward + backward = 3x forward (Narayanan et al., SC'21,
appendix "Floating-point operations": the backward pass needs gradients with respect to both the
input and the weight). Fused attention's backward is 2.5x its forward FLOPs (FlashAttention-2,
Dao 2023, section 4.1: five matmuls against two in the forward, recomputation included). The
routed experts' backward op recomputes the forward's matmuls and runs both gradients of each:
3x its forward (autoplan/experts.py BACKWARD_FLOPS_FACTOR), whatever is frozen. A
memory-bound op's backward reads the output gradient and the saved tensor and writes the input
gradient: about 1.5x the forward's bytes (three tensors against two; assumption,
BACKWARD_BYTES_FACTOR). View-like ops are free both ways; creation and comparison
ops have no backward.

Frozen parameters (fine-tuning) scale the backward by `NodeInfo.backward_share` ([Note:
backward share] in autoplan/capture/facts.py): a matmul whose weight is frozen computes only
the input gradient (2 x share = 1x forward), and an op whose inputs derive from frozen
parameters only (a cast or transpose of a frozen weight) has no backward. Model FLOPs (MFU's
3x forward convention) do not change; only the time does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

import torch
import torch.fx

from autoplan.experts import BACKWARD_FLOPS_FACTOR as EXPERTS_BACKWARD_FACTOR
from autoplan.experts import EXPERTS_TARGET
from autoplan.graph import NodeInfo
from autoplan.op_classes import ATTENTION_OPS, MATMUL_OPS, NO_GRAD_OPS, VIEW_OPS, op_name
from autoplan.topology import DeviceSpec

__all__ = [
    "MATMUL_HALF_DIM", "BACKWARD_BYTES_FACTOR", "TRANSCENDENTAL_OPS", "BACKWARD_TRANSCENDENTAL",
    "DTYPE_BYTES", "is_noop_cast", "matmul_dims", "expert_gemm_dims", "matmul_efficiency",
    "at_tokens",
    "module_input_bytes", "op_time_s",
    "backward_time_s", "graph_forward_time_s", "graph_backward_time_s", "dtensor_dispatches",
    "compiled_device",
]

MATMUL_HALF_DIM = 128.0
"""Smallest matmul dim at which efficiency is half of `matmul_efficiency`: the GPU presets'
`DeviceSpec.matmul_half_dim` (its default; assumption, see [Note: matmul efficiency curve])."""

BACKWARD_BYTES_FACTOR = 1.5
"""Backward bytes / forward bytes of a memory-bound op (assumption, see module docstring)."""

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "tf32": 4, "bfloat16": 2, "float16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int64": 8, "int32": 4, "int8": 1, "uint8": 1,
    "bool": 1,
}
_FLOAT_DTYPES = {"float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"}

TRANSCENDENTAL_OPS = frozenset({
    "tanh", "exp", "erf", "sigmoid", "log", "pow", "sin", "cos", "gelu", "silu", "sqrt",
    "rsqrt", "softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax",
})
BACKWARD_TRANSCENDENTAL = frozenset({"pow", "erf", "gelu", "silu"})




def is_noop_cast(node: NodeInfo) -> bool:
    """An `aten.to` that changes nothing (same dtype, device and layout: as many bytes out as
    in) returns its input itself -- no kernel, no bytes (torch/_tensor_docs.py, Tensor.to: "If
    self already has the correct dtype and device, self is returned"); an HF model's
    `softmax(...).to(value.dtype)` is one. `_to_copy` always copies and is priced."""
    return op_name(node.target) == "to" and node.in_bytes == node.out_bytes


def matmul_dims(node: NodeInfo) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a matmul-like node, from its first output's shape (..., m, n) and
    its FLOPs (2 * batch * m * n * k). A linear's leading dims fold into m (batch = 1).

    Raises ValueError when the node has no output shape or FLOPs (capture must count them).
    """
    if not node.shapes or len(node.shapes[0]) < 1 or node.flops <= 0:
        raise ValueError(
            f"node {node.name!r} ({node.target}): a matmul needs an output shape and FLOPs > 0 "
            f"to size it; got shapes={node.shapes}, flops={node.flops}")
    shape = node.shapes[0]
    n = shape[-1]
    if op_name(node.target) in ("linear", "mm", "addmm", "_scaled_mm") or len(shape) < 3:
        batch, m = 1, math.prod(shape[:-1])
    else:
        batch, m = math.prod(shape[:-2]), shape[-2]
    k = max(1, round(node.flops / (2 * batch * m * n)))
    return batch, m, n, k


def expert_gemm_dims(node: NodeInfo, group: int = 1) -> tuple[float, int, int]:
    """(m, I, H) of one expert's GEMMs in an `autoplan.experts` node (NodeInfo.experts =
    (E, k, I), output (T, H)): m = group x T k / E rows per expert under balanced routing,
    `group` ranks' tokens reaching each expert (expert parallelism: ep; 1 when a rank
    computes its own tokens, whole or with its experts split over tp, which keeps every
    expert's rows). gate_up is an (m, H) x (H, 2I) GEMM and down an (m, I) x (I, H) one
    ([Note: experts op]); their smallest dim is min(m, I, H).

    Raises ValueError for a node that is not the experts op."""
    if node.experts is None or not node.shapes:
        raise ValueError(f"node {node.name!r} ({node.target}) is not an autoplan.experts node "
                         "with its (E, k, I) recorded (NodeInfo.experts)")
    num_experts, top_k, inter = node.experts
    tokens, hidden = node.shapes[0][0], node.shapes[0][-1]
    return group * tokens * top_k / num_experts, inter, hidden


def matmul_efficiency(min_dim: float, device: DeviceSpec) -> float:
    """Fraction of peak reached by a matmul whose smallest dim is `min_dim`
    (see [Note: matmul efficiency curve]); in (0, device.matmul_efficiency]."""
    return device.matmul_efficiency * min_dim / (min_dim + device.matmul_half_dim)


def _bytes_scale(node: NodeInfo, dtype: str) -> float:
    """Captured bytes -> bytes at the compute dtype (a graph captured in fp32 trains in bf16)."""
    if not node.dtypes or node.dtypes[0] not in _FLOAT_DTYPES or dtype not in DTYPE_BYTES:
        return 1.0
    return DTYPE_BYTES[dtype] / DTYPE_BYTES[node.dtypes[0]]


def _roofline_s(flops: float, nbytes: float, efficiency: float, device: DeviceSpec,
                dtype: str, elementwise_s: float = 0.0) -> float:
    compute_s = flops / (device.flops_per_s(dtype) * efficiency) if flops > 0 else 0.0
    return (max(compute_s, nbytes / device.mem_bw_bytes_per_s, elementwise_s)
            + device.launch_latency_s)


def _elementwise_s(node: NodeInfo, device: DeviceSpec, shard_factor: float) -> float:
    """elements x the device's measured cost of a transcendental op ([Note: roofline]). The
    elements are the output bytes over the output's element width, not the captured shape, so
    that a node rescaled to another microbatch (solver/costs.py scales bytes and FLOPs by the
    token count) is priced at its own size."""
    cost = device.elementwise_s_per_elem.get(op_name(node.target))
    if not cost or not node.shapes:
        return 0.0
    width = DTYPE_BYTES.get(node.dtypes[0], 4) if node.dtypes else 4
    return node.out_bytes / width / shard_factor * cost


def _efficiency(node: NodeInfo, device: DeviceSpec, shard_factor: float) -> float:
    # the routed experts' per-expert GEMMs ([Note: matmul efficiency curve]); their target
    # "autoplan.experts.default" has no aten base name for op_name to find
    if node.experts is not None:
        return matmul_efficiency(min(expert_gemm_dims(node)), device)
    name = op_name(node.target)
    if name in ATTENTION_OPS or name == "convolution":
        return device.matmul_efficiency  # large fused kernels (assumption)
    if name not in MATMUL_OPS:
        return 1.0
    _, m, n, k = matmul_dims(node)
    # The split falls on one dim; we take the largest (the usual tensor-parallel split of the
    # hidden or ffn dim), which keeps the smallest dim -- the one the curve looks at -- intact
    # unless sharding makes the largest one the smallest.
    dims = sorted((m, n, k))
    dims[-1] = dims[-1] / shard_factor
    return matmul_efficiency(min(dims), device)


def at_tokens(node: NodeInfo, scale: float, fixed_in_bytes: int = 0) -> NodeInfo:
    """`node` as it runs on `scale` times its captured tokens (a microbatch of another size:
    solver/costs.py `token_scale`): FLOPs, output bytes, the input bytes but `fixed_in_bytes`
    and the leading (batch) dim of every output shape scale by `scale`.

    `fixed_in_bytes` are inputs that do not grow with the tokens: the parameters and buffers
    the op reads (`module_input_bytes`); a linear reads its weight once whatever the batch.
    The shapes scale with the FLOPs so that `matmul_dims` sizes the real matmul: it reads
    (batch, m, n) from the output shape and k = flops / (2 batch m n), so FLOPs scaled without
    the shape would put the token count into k (a graph captured at batch 64 and priced at a
    microbatch of 2 would see k / 32, a matmul far down the efficiency curve; one captured at
    batch 1 would see k x b). With both scaled, k is the model's and m the microbatch's
    tokens, whatever batch the graph was captured at. Leading dims round to an integer >= 1
    (an op whose output does not grow with the batch -- rotary tables -- keeps dim 0 = 1).
    """
    shapes = tuple((max(1, round(s[0] * scale)), *s[1:]) if s else s for s in node.shapes)
    fixed = min(fixed_in_bytes, node.in_bytes)
    fused = None if node.fused_bytes is None else int(node.fused_bytes * scale)
    return dataclasses.replace(node, shapes=shapes, flops=int(node.flops * scale),
                               in_bytes=int(fixed + (node.in_bytes - fixed) * scale),
                               out_bytes=int(node.out_bytes * scale), fused_bytes=fused)


def module_input_bytes(node: torch.fx.Node) -> int:
    """Bytes of the parameters and buffers (get_attr inputs, each once) that `node` reads, at
    their captured dtype: the part of `NodeInfo.in_bytes` that does not grow with the tokens."""
    total = 0
    for arg in node.all_input_nodes:
        val = arg.meta.get("val") if arg.op == "get_attr" else None
        if isinstance(val, torch.Tensor):
            total += val.numel() * val.element_size()
    return total


def _moved_bytes(node: NodeInfo, device: DeviceSpec) -> int:
    """Bytes the op moves: in + out, or its bytes inside fused kernels on a device that fuses
    chains of memory-bound ops ([Note: pointwise fusion] in capture/fusion.py)."""
    if device.fuses_pointwise and node.fused_bytes is not None:
        return node.fused_bytes
    return node.in_bytes + node.out_bytes


def _check_shard(node: NodeInfo, shard_factor: float) -> None:
    if not shard_factor >= 1.0:
        raise ValueError(f"node {node.name!r}: shard_factor={shard_factor} must be >= 1")


def op_time_s(node: NodeInfo, device: DeviceSpec, dtype: str, *,
              shard_factor: float = 1.0, routing_skew: float = 1.0) -> float:
    """Forward time of one op on one rank, seconds ([Note: roofline]).

    Args:
        node: the captured op (global shapes, forward FLOPs, bytes in and out).
        device: the accelerator.
        dtype: compute dtype ("bfloat16", ...): selects the peak FLOP/s; floating bytes are
            rescaled from the captured dtype to it.
        shard_factor: the op's work is split over this many ranks (>= 1).
        routing_skew: the busiest rank's routed (token, choice) pairs over the mean
            (TrainingSpec.routing_skew): the routed experts split over ranks (shard_factor >
            1) run at the pace of the busiest, which does `routing_skew` times the mean share
            of the op's work ([Note: expert parallelism] in cost_model/expert_parallel.py).
            Other ops and an unsplit experts op ignore it.

    Raises ValueError for an unknown dtype on `device`, a shard factor < 1, or a matmul
    without FLOPs.
    """
    _check_shard(node, shard_factor)
    if op_name(node.target) in VIEW_OPS or is_noop_cast(node):
        return 0.0
    moved = _moved_bytes(node, device)
    if moved == 0 and node.fused_bytes is not None and device.fuses_pointwise:
        return 0.0  # inside a fused kernel: no kernel of its own
    busiest = _busiest_share(node, shard_factor, routing_skew)
    nbytes = moved * _bytes_scale(node, dtype) / shard_factor * busiest
    flops = node.flops / shard_factor * busiest
    return _roofline_s(flops, nbytes, _efficiency(node, device, shard_factor), device, dtype,
                       _elementwise_s(node, device, shard_factor))


def _busiest_share(node: NodeInfo, shard_factor: float, routing_skew: float) -> float:
    """The busiest rank's work over the mean rank's (`op_time_s`' routing_skew): the skew for
    the routed experts split over ranks, else 1."""
    return routing_skew if node.target == EXPERTS_TARGET and shard_factor > 1 else 1.0


def backward_time_s(node: NodeInfo, device: DeviceSpec, dtype: str, *,
                    shard_factor: float = 1.0, routing_skew: float = 1.0) -> float:
    """Backward time of one op on one rank, seconds (module docstring, "Backward").

    Matmul-like: 2 x `node.backward_share` x the forward (two kernels of the forward's FLOPs
    and bytes, one of which a frozen operand skips); the routed experts: 3x the forward
    (EXPERTS_BACKWARD_FACTOR). Fused attention: 2.5x forward FLOPs.
    Memory-bound: BACKWARD_BYTES_FACTOR x forward bytes. Views, ops without a gradient and ops
    whose inputs derive from frozen parameters only (backward_share 0): 0.
    Same arguments (`routing_skew` included) and errors as `op_time_s`.
    """
    _check_shard(node, shard_factor)
    name = op_name(node.target)
    if (name in VIEW_OPS or name in NO_GRAD_OPS or is_noop_cast(node)
            or node.backward_share == 0.0):
        return 0.0
    moved = _moved_bytes(node, device)
    if moved == 0 and node.fused_bytes is not None and device.fuses_pointwise:
        return 0.0
    busiest = _busiest_share(node, shard_factor, routing_skew)
    nbytes = moved * _bytes_scale(node, dtype) / shard_factor * busiest
    flops = node.flops / shard_factor * busiest
    efficiency = _efficiency(node, device, shard_factor)
    if node.target == EXPERTS_TARGET:  # the forward again and both gradients (experts.py)
        return EXPERTS_BACKWARD_FACTOR * _roofline_s(flops, nbytes, efficiency, device, dtype)
    if name in MATMUL_OPS:
        return 2.0 * node.backward_share * _roofline_s(flops, nbytes, efficiency, device, dtype)
    if name in ATTENTION_OPS:
        return _roofline_s(2.5 * flops, 2.0 * nbytes, efficiency, device, dtype)
    again = _elementwise_s(node, device, shard_factor) if name in BACKWARD_TRANSCENDENTAL else 0.0
    return _roofline_s(flops, BACKWARD_BYTES_FACTOR * nbytes, efficiency, device, dtype, again)


def graph_forward_time_s(nodes: Iterable[NodeInfo], device: DeviceSpec, dtype: str, *,
                         shard_factor: Mapping[str, float] | None = None) -> float:
    """Sum of `op_time_s` over `nodes` (ops run one after another on a stream), seconds.
    `shard_factor` maps node name -> factor; nodes it does not list are unsharded."""
    factors = shard_factor or {}
    return sum(op_time_s(n, device, dtype, shard_factor=factors.get(n.name, 1.0))
               for n in nodes)


def graph_backward_time_s(nodes: Iterable[NodeInfo], device: DeviceSpec, dtype: str, *,
                          shard_factor: Mapping[str, float] | None = None) -> float:
    """Sum of `backward_time_s` over `nodes`, seconds; as `graph_forward_time_s`."""
    factors = shard_factor or {}
    return sum(backward_time_s(n, device, dtype, shard_factor=factors.get(n.name, 1.0))
               for n in nodes)


def dtensor_dispatches(node: NodeInfo) -> int:
    """Times the host pays `DeviceSpec.dtensor_op_overhead_s` for `node` on a tensor-parallel
    stage: once in the forward and once in the backward (none for ops without a gradient).
    The count the overhead is defined against: `autoplan calibrate` fits the overhead per
    dispatch so counted on a reference graph, whose backward runs more DTensor ops than one per
    node (a matmul's backward is two matmuls and transposes)."""
    return 1 if op_name(node.target) in NO_GRAD_OPS else 2


def compiled_device(device: DeviceSpec) -> DeviceSpec:
    """`device` as it runs compiled stages ([Note: compiled execution]): pointwise chains fused
    (`fuses_pointwise`), no DTensor host time per op or per redistribution
    (`dtensor_op_overhead_s`, `dtensor_redistribute_s` 0). Everything else -- peak rates, the
    matmul curve, launch latency per kernel, the optimizer's per-tensor host time -- as given.

    [Note: compiled execution]
    A plan made with `compiled=True` (Plan.compiled) is priced for stages whose blocks run
    through torch.compile (TorchInductor; [Note: compiled stages] in
    autoplan/runtime/compiled.py). What changes, and the assumption behind each:
    - DTensor dispatch: inductor traces DTensor's sharding propagation once at compile time
      and runs the local ops it produced (Ansel et al., "PyTorch 2", ASPLOS 2024, section 4:
      tensor subclasses are desugared by AOTAutograd), so a tensor-parallel op costs no host
      time beyond its kernel: `dtensor_op_overhead_s` = 0. The same holds for the Python work of
      a redistribution, which is traced into functional collectives:
      `dtensor_redistribute_s` = 0; the collective itself is priced by cost_model.comm as
      before.
    - Fusion: inductor fuses chains of pointwise ops and the reductions around them into one
      kernel each, which is what [Note: pointwise fusion] in capture/fusion.py prices:
      `fuses_pointwise` = True (each chain moves only what enters and leaves it and launches
      once).
    - Unchanged: `launch_latency_s` per kernel that still runs (a matmul is an extern call in
      inductor's code too), the optimizer step (not compiled: `optimizer_op_s`,
      `dtensor_optimizer_op_s`) and FSDP2's / pipelining's collectives (outside the compiled
      region).
    - Left out: the ops outside the block modules (embedding, final norm, head, loss) run
      eagerly at run time but are priced compiled here: 2 of L + 2 regions of an L-block model
      (assumption: small next to the blocks for the models planned; it under-prices the host
      time of a shallow model). Compile time itself (the first step) is not in the step time.
    Measured on CPU ranks by bench/compile.py (bench/results/compile.json).
    """
    return dataclasses.replace(device, fuses_pointwise=True, dtensor_op_overhead_s=0.0,
                               dtensor_redistribute_s=0.0)
