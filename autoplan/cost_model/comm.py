"""Communication time: alpha-beta per collective and per topology level.

[Note: collective cost]
A flat ring collective over p ranks on one link level takes (FORMULAS.md, "Collective costs";
nccl-tests PERFORMANCE.md for the bus-bandwidth factors):

    t = n * factor(p) / busbw + steps(p) * latency

| kind           | factor      | steps    |
|----------------|-------------|----------|
| all_reduce     | 2(p-1)/p    | 2(p-1)   |
| all_gather     | (p-1)/p     | p-1      |
| reduce_scatter | (p-1)/p     | p-1      |
| all_to_all     | (p-1)/p     | p-1      |
| broadcast      | 1           | p-1      |
| send_recv      | 1           | 1        |

`n` is the full buffer per rank as nccl-tests counts it: the all-gather's output, the
reduce-scatter's input, the all-reduce's buffer, the all-to-all's per-rank send buffer, the
broadcast's buffer (busbw factor 1, nccl-tests PERFORMANCE.md; a pipelined ring broadcast makes
p-1 hops).

[Note: measured collectives]
A link may carry fitted (latency, busbw) per kind, group size p and number g of groups running
at once (`LinkSpec.collectives`, written by `autoplan calibrate` for gloo on CPU ranks, whose
algorithms differ per kind and whose groups share the machine's cores). A flat collective on such
a link uses the entry's figures in the formula above; g defaults to the groups of the mesh axis
inside one node, devices_per_node / p, since SPMD runs all of them at once.

[Note: stragglers]
A collective starts when its last member arrives. Back-to-back timings (nccl-tests, calibrate's
fits) have the members in lock-step; in a training step each member arrives after its own
compute, and where devices share cores or run other processes (CPU ranks) the last one is late
by a random amount. `DeviceSpec.skew(n)` (`sync_skew_s`, fitted by `autoplan calibrate`; 0 for
the GPU presets) is that expected wait per blocking collective with n busy devices on the node
(all of them, under SPMD); `collective_time_s` adds it to every collective of a group. Pipeline
send/recv does not pay it: a stage waiting for its neighbour is the pipeline term's business.
The wait grows with the compute since the ranks last met (time slicing lets them drift apart):
`sync_skew_s` is the intercept of that line and `DeviceSpec.skew_slope(n)` its slope, which the
step-time model charges once per step on the step's compute (cost_model/step_time.py [Note: step
time], drift), since the compute between meetings sums to it.

[Note: group layout]
Ranks sit on the mesh row-major, axes ("pp", "dp", "cp", "tp") outermost first: mesh coordinate
(p, d, c, t) is global rank ((p dp + d) cp + c) tp + t (`MeshShape`, torch's init_device_mesh in
runtime/engine.py, `_rank` in passes/export.py), and global rank g is on node g // D, D =
`topology.devices_per_node` (torchrun numbers ranks node by node). So a group of the tp axis has
stride 1, of the cp axis stride tp, of the dp axis stride cp * tp (the dp x cp gradient group:
stride tp), of the pp axis stride tp * cp * dp, and the groups of an axis of stride s and size p
tile the ranks in aligned blocks of p * s. From p, s and D, `group_layout` gives k members per
node and N nodes spanned:
- s * p <= D (and dividing D): one node, k = p, N = 1 -> `intra_node` link, flat ring.
- s >= D: one member per node, k = 1, N = p -> `inter_node` link, flat ring.
- otherwise k = D / s members in each of N = p / k nodes -> hierarchical (below).
A layout whose groups straddle node boundaries unevenly (D not a multiple of s, or p not a
multiple of D / s) raises ValueError: pick degrees that divide the node size or are multiples of it.

[Note: pipeline hops]
A pipeline hop from pp rank a to pp rank b sends from global rank a R + i to b R + i, i < R, with
R = dp x cp x tp ranks per stage ([Note: group layout]). The size of a stage does not say whether
the hop crosses nodes: on 8-device nodes with R = 4, pp 4, hops 0 -> 1 and 2 -> 3 stay inside a
node while 1 -> 2 crosses. `hop_crosses_nodes` decides it from the ranks: some pair is on two
nodes when a node boundary (a multiple of D) lies in (lo, lo + |b - a| R + R - 1], lo = min(a, b) R.
The hops of a step are a -> a + 1 for a < pp - 1 and, with v > 1 virtual stages (interleaved
1F1B), the wrap-around pp - 1 -> 0 that carries chunk j to chunk j + 1; the schedule runs at the
pace of its slowest hop, so `pipeline_hop_time_s` prices a transfer at the level of the slowest
one: across nodes when any hop crosses, the min(R, D) pairs of the crossing boundary sharing the
node's NICs ([Note: inter-node bandwidth share]); inside a node otherwise.

[Note: inter-node bandwidth share]
`inter_node.bw_bytes_per_s` is the bus bandwidth of a collective whose group holds all D ranks of
each node (the measured multi-node busbw of FORMULAS.md's Hardware rows, i.e. the node's NIC
aggregate). Under SPMD every group of a mesh axis communicates at the same time, so the D / k
groups with members in one node share its NICs: each rank gets `inter bw / D` (one rail: 24 GB/s
on DGX A100 = one HDR NIC; 46 GB/s on DGX H100 = one NDR NIC). Pass `concurrent_groups` to
price a group that runs alone (e.g. 1: its k ranks share the node's NICs, each getting bw / k).
NVSwitch is non-blocking, so intra-node groups do not share bandwidth.

[Note: hierarchical collectives]
A group spanning N nodes with k > 1 members per node runs the two-level algorithm: intra-node
reduce-scatter, inter-node all-reduce on n/k bytes among the N ranks of equal local index, intra-
node all-gather (all-gather and reduce-scatter keep the matching halves; all-to-all sends
n(k-1)/p bytes inside the node and n(p-k)/p across). NCCL pipelines the phases in chunks, so the
two levels overlap: the bandwidth term is that of the slowest level -- the algorithm is never
cheaper than its slowest level, and no more -- while the latencies of all phases add:

    t = max(bytes_intra / bw_intra, bytes_inter / bw_inter_per_rank) + sum(steps * latency)

(Summing the bandwidth terms instead would predict a 16-node DGX A100 all-reduce busbw of
~115 GB/s against the ~192 GB/s that nccl-tests measures; the overlapped form predicts ~200.)
"""

from __future__ import annotations

from autoplan.plan import parse_placement
from autoplan.topology import LinkSpec, Topology

__all__ = [
    "COLLECTIVES", "factor_steps", "collective_time_s", "group_layout", "hop_crosses_nodes",
    "p2p_time_s", "pipeline_hops", "pipeline_hop_time_s", "redistribute_time_s",
    "backward_redistribution",
]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
               "send_recv")

_FACTOR_STEPS = {
    # kind: (bandwidth factor(p), latency steps(p)); [Note: collective cost]
    "all_reduce": (lambda p: 2 * (p - 1) / p, lambda p: 2 * (p - 1)),
    "all_gather": (lambda p: (p - 1) / p, lambda p: p - 1),
    "reduce_scatter": (lambda p: (p - 1) / p, lambda p: p - 1),
    "all_to_all": (lambda p: (p - 1) / p, lambda p: p - 1),
    "broadcast": (lambda p: 1.0, lambda p: p - 1),
    "send_recv": (lambda p: 1.0, lambda p: 1),
}


def factor_steps(kind: str, group_size: int) -> tuple[float, int]:
    """(bus-bandwidth factor, latency steps) of `kind` on `group_size` ranks
    ([Note: collective cost]); ValueError for an unknown kind."""
    if kind not in _FACTOR_STEPS:
        raise ValueError(f"unknown collective {kind!r}; known: {list(COLLECTIVES)}")
    factor, steps = _FACTOR_STEPS[kind]
    return factor(group_size), steps(group_size)


def group_layout(group_size: int, stride: int, topology: Topology) -> tuple[int, int]:
    """(members per node k, nodes spanned N) of a group ([Note: group layout]).

    Raises ValueError when the group does not fit in the cluster or straddles node boundaries
    unevenly, naming the numbers.
    """
    p, s, d = group_size, stride, topology.devices_per_node
    if p < 1 or s < 1:
        raise ValueError(f"group_size={p} and stride={s} must both be >= 1")
    if p * s > topology.world_size:
        raise ValueError(
            f"a group of {p} ranks with stride {s} spans {p * s} ranks, more than the "
            f"{topology.world_size} of topology {topology.name!r}")
    if p == 1 or s >= d:
        return 1, p
    if d % s == 0 and (d % (p * s) == 0 or p % (d // s) == 0):
        k = min(p, d // s)
        return k, p // k
    raise ValueError(
        f"a group of {p} ranks with stride {s} straddles node boundaries unevenly on "
        f"{d}-device nodes; use mesh degrees that divide devices_per_node={d} or are "
        "multiples of it")


def hop_crosses_nodes(src: int, dst: int, stage_ranks: int, topology: Topology) -> bool:
    """Whether the pipeline hop from pp rank `src` to pp rank `dst` (stages of `stage_ranks` =
    dp x cp x tp ranks each) sends across a node boundary for some of its pairs ([Note:
    pipeline hops]). Raises ValueError for a pp rank < 0 or stage_ranks < 1."""
    if src < 0 or dst < 0 or stage_ranks < 1:
        raise ValueError(f"hop {src} -> {dst} with stage_ranks={stage_ranks}: pp ranks must be "
                         ">= 0 and stage_ranks >= 1")
    d = topology.devices_per_node
    lo = min(src, dst) * stage_ranks
    hi = lo + abs(dst - src) * stage_ranks + stage_ranks - 1  # the last pair's receiver
    return src != dst and hi // d > lo // d


def pipeline_hops(pp: int, num_virtual_stages: int) -> list[tuple[int, int]]:
    """(src, dst) pp ranks of every hop ([Note: pipeline hops]): a -> a + 1, and pp - 1 -> 0
    when the virtual stages wrap around."""
    hops = [(a, a + 1) for a in range(pp - 1)]
    return hops + [(pp - 1, 0)] if num_virtual_stages > 1 and pp > 1 else hops


def pipeline_hop_time_s(nbytes: float, topology: Topology, *, pp: int, stage_ranks: int,
                        num_virtual_stages: int = 1) -> float:
    """One message of the slowest pipeline hop, seconds ([Note: pipeline hops]): `p2p_time_s`
    across nodes, min(stage_ranks, D) pairs sharing the node's NICs, when any hop of the pp
    ranks crosses a node boundary; inside a node otherwise, `stage_ranks` pairs at once
    ([Note: measured collectives]). 0 for pp 1.

    Args:
        nbytes: what one rank sends (a microbatch's stage boundary on a tp rank), bytes.
        topology: the cluster.
        pp: pipeline ranks; stage_ranks: dp x cp x tp ranks of one stage.
        num_virtual_stages: model chunks per pp rank (v > 1 adds the wrap-around hop).

    Raises ValueError (pp > 1) for negative bytes or a bad stage size.
    """
    if pp == 1:
        return 0.0
    _check("send_recv", nbytes)
    crosses = any(hop_crosses_nodes(a, b, stage_ranks, topology)
                  for a, b in pipeline_hops(pp, num_virtual_stages))
    pairs = min(stage_ranks, topology.devices_per_node) if crosses else stage_ranks
    return p2p_time_s(nbytes, topology, crosses_nodes=crosses, concurrent_pairs=pairs)


def _flat_s(kind: str, nbytes: float, p: int, bw_bytes_per_s: float, latency_s: float) -> float:
    factor, steps = _FACTOR_STEPS[kind]
    return nbytes * factor(p) / bw_bytes_per_s + steps(p) * latency_s


def _inter_bw_per_rank(topology: Topology, k: int, concurrent_groups: int | None) -> float:
    """Per-rank share of the node's NICs ([Note: inter-node bandwidth share])."""
    groups = topology.devices_per_node // k if concurrent_groups is None else concurrent_groups
    if groups < 1:
        raise ValueError(f"concurrent_groups={concurrent_groups} must be >= 1")
    return topology.inter_node.bw_bytes_per_s / (k * groups)


def _hierarchical_s(kind: str, n: float, k: int, num_nodes: int, intra: LinkSpec,
                    inter_bw: float, inter_latency_s: float) -> float:
    """[Note: hierarchical collectives]; k > 1 members in each of num_nodes > 1 nodes."""
    p = k * num_nodes
    if kind == "all_reduce":
        intra_bytes, inter_bytes = 2 * n * (k - 1) / k, 2 * (n / k) * (num_nodes - 1) / num_nodes
        latency = 2 * (k - 1) * intra.latency_s + 2 * (num_nodes - 1) * inter_latency_s
    elif kind in ("all_gather", "reduce_scatter"):
        intra_bytes, inter_bytes = n * (k - 1) / k, (n / k) * (num_nodes - 1) / num_nodes
        latency = (k - 1) * intra.latency_s + (num_nodes - 1) * inter_latency_s
    else:  # all_to_all
        intra_bytes, inter_bytes = n * (k - 1) / p, n * (p - k) / p
        latency = (k - 1) * intra.latency_s + (p - k) * inter_latency_s
    return max(intra_bytes / intra.bw_bytes_per_s, inter_bytes / inter_bw) + latency


def _check(kind: str, nbytes: float) -> None:
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; known: {list(COLLECTIVES)}")
    if not nbytes >= 0:
        raise ValueError(f"{kind}: nbytes={nbytes} must be >= 0")


def collective_time_s(kind: str, nbytes: float, group_size: int, topology: Topology, *,
                      stride: int = 1, concurrent_groups: int | None = None) -> float:
    """Time of one collective on a group of the device mesh, seconds.

    Args:
        kind: one of COLLECTIVES.
        nbytes: full buffer per rank as nccl-tests counts it ([Note: collective cost]), bytes.
        group_size: ranks in the group (1 -> 0 s).
        topology: the cluster.
        stride: rank distance between consecutive members ([Note: group layout]).
        concurrent_groups: groups running at once: across nodes, those sharing one node's NICs
            (default: all groups of the axis, devices_per_node / k, [Note: inter-node bandwidth
            share]); inside a node, the entry of a measured link to use (default
            devices_per_node / group_size, [Note: measured collectives]).

    send_recv prices one message between consecutive members (a pipeline hop, the group being
    the pp ranks with stride dp x cp x tp) at the level of the slowest such hop: across nodes
    when any hop crosses a node boundary ([Note: pipeline hops]).

    Raises ValueError for an unknown kind, negative bytes, or a bad group layout.
    """
    _check(kind, nbytes)
    k, num_nodes = group_layout(group_size, stride, topology)
    if group_size == 1:
        return 0.0
    if kind == "send_recv":
        crosses = any(hop_crosses_nodes(a, b, stride, topology)
                      for a, b in pipeline_hops(group_size, 1))
        return p2p_time_s(nbytes, topology, crosses_nodes=crosses,
                          concurrent_pairs=concurrent_groups)
    skew = topology.device.skew(topology.devices_per_node)  # [Note: stragglers]
    if num_nodes == 1:
        groups = concurrent_groups or max(1, topology.devices_per_node // group_size)
        latency_s, bw = topology.intra_node.fit(kind, group_size, groups)
        return _flat_s(kind, nbytes, group_size, bw, latency_s) + skew
    inter_bw = _inter_bw_per_rank(topology, k, concurrent_groups)
    if k == 1:
        return _flat_s(kind, nbytes, group_size, inter_bw, topology.inter_node.latency_s) + skew
    return _hierarchical_s(kind, nbytes, k, num_nodes, topology.intra_node, inter_bw,
                           topology.inter_node.latency_s) + skew


def p2p_time_s(nbytes: float, topology: Topology, *, crosses_nodes: bool,
               concurrent_pairs: int | None = None) -> float:
    """One point-to-point message (pipeline send/recv), seconds: latency + nbytes / bw.

    Inside a node: `intra_node` bandwidth and latency (a measured "send_recv" entry for
    `concurrent_pairs` pairs when the link has one, default devices_per_node / 2, [Note:
    measured collectives]). Across nodes: every rank of a node sends at once at a pipeline stage
    boundary, so each gets one rail, `inter bw / devices_per_node`, unless `concurrent_pairs`
    says how many pairs share the node's NICs ([Note: inter-node bandwidth share]). Raises
    ValueError for negative bytes.
    """
    _check("send_recv", nbytes)
    if not crosses_nodes:
        pairs = concurrent_pairs or max(1, topology.devices_per_node // 2)
        latency_s, bw = topology.intra_node.fit("send_recv", 2, pairs)
        return nbytes / bw + latency_s
    pairs = topology.devices_per_node if concurrent_pairs is None else concurrent_pairs
    if pairs < 1:
        raise ValueError(f"concurrent_pairs={concurrent_pairs} must be >= 1")
    inter = topology.inter_node
    return nbytes / (inter.bw_bytes_per_s / pairs) + inter.latency_s


# --- redistribution between placements on one mesh axis ---------------------------------------

def _kind(text: str) -> str:
    """"R" | "P" | "S" for a plan placement; ValueError (from parse_placement) otherwise."""
    parse_placement(text)
    return text[0]


def redistribute_time_s(src: str, dst: str, nbytes: float, group_size: int, topology: Topology,
                        *, stride: int = 1,
                        concurrent_groups: int | None = None) -> tuple[str, float]:
    """The collective that changes placement `src` into `dst` on one mesh axis, and its time.

    Mirrors torch.distributed.tensor's redistribute_local_tensor
    (torch/distributed/tensor/_redistribute.py):

    | src -> dst       | collective        | note                                    |
    |------------------|-------------------|-----------------------------------------|
    | same             | "none", 0         |                                         |
    | R -> S(d)        | "slice", 0        | local chunk                             |
    | R -> P           | "none", 0         | local divide (Partial._partition_value) |
    | S(d) -> R        | all_gather        |                                         |
    | P -> R           | all_reduce        |                                         |
    | P -> S(d)        | reduce_scatter    |                                         |
    | S(i) -> S(j)     | all_to_all        | per-rank buffer nbytes / group_size     |
    |   (CPU ranks)    | all_gather        | gloo has no all-to-all: DTensor gathers |
    |                  |                   | the whole tensor, keeps its chunk       |
    | S(d) -> P        | ValueError        | DTensor: "not supported"                |

    A group of one rank needs nothing ("none", 0), as in DTensor.

    Args:
        src, dst: placements in plan spelling ("R", "P", "S(d)").
        nbytes: bytes of the tensor as this axis sees it (the global tensor, or its local part
            on the other mesh axes).
        group_size, topology, stride, concurrent_groups: as `collective_time_s`.

    The time is the collective's plus `DeviceSpec.dtensor_redistribute_s` (DTensor's host
    work around it; 0 for the GPU presets).

    Returns (collective name, seconds). Raises ValueError for a bad placement or S -> P.
    """
    a, b = _kind(src), _kind(dst)
    if a == "S" and b == "P":
        raise ValueError(
            f"redistribute {src} -> {dst} is not supported (DTensor cannot turn a Shard into a "
            "Partial); go through R")
    if src == dst or group_size == 1 or b == "P":
        return "none", 0.0
    if a == "R":
        return "slice", 0.0
    if a == "P":
        kind = "all_reduce" if b == "R" else "reduce_scatter"
        n = nbytes
    elif b == "R" or not topology.device.all_to_all:  # (DeviceSpec.all_to_all)
        kind, n = "all_gather", nbytes
    else:
        kind, n = "all_to_all", nbytes / group_size
    # DTensor's own host work around the collective (DeviceSpec.dtensor_redistribute_s)
    return kind, collective_time_s(kind, n, group_size, topology, stride=stride,
                                   concurrent_groups=concurrent_groups) + \
        topology.device.dtensor_redistribute_s


def backward_redistribution(src: str, dst: str, *,
                            grad_placement: str | None = None) -> tuple[str, str]:
    """The placements the gradient goes through in backward when the forward redistributes
    `src` -> `dst`: returns (grad placement at dst, grad placement at src), ready for
    `redistribute_time_s(*backward_redistribution(src, dst), ...)`.

    The gradient of a redistribution is the dual redistribution (Megatron-LM's conjugate f/g
    operators, Shoeybi et al. 2019, section 3: f is identity forward / all-reduce backward, g
    all-reduce forward / identity backward), in DTensor's form (Redistribute.backward ->
    _redistribute_backward): the gradient goes back to `src`, except that a Partial target is
    replaced by Replicate, since a Replicate or Shard gradient is never turned back into a
    Partial (that would only postpone a reduction).

    `grad_placement` is how the gradient arrives at `dst`; it is set by the consumer's backward.
    Default: like the forward value, except that a Partial value's gradient is Replicate
    (DTensor's rule). Pass "P" when the consumer is e.g. a column-parallel matmul whose input
    gradient is a partial sum.

    Examples: S->R has backward R->S (slice) by default and P->S (reduce-scatter) with
    grad_placement="P"; R->S(d) has S(d)->R (all-gather); P->R has R->R (nothing); P->S(d) has
    S(d)->R (all-gather); R->R with grad_placement="P" has P->R (Megatron's f: all-reduce).

    Raises ValueError for a bad placement.
    """
    _kind(src)
    _kind(dst)
    grad_at_dst = grad_placement if grad_placement is not None else ("R" if dst == "P" else dst)
    _kind(grad_at_dst)
    grad_at_src = src
    if src == "P" and grad_at_dst != "P":
        grad_at_src = "R"
    return grad_at_dst, grad_at_src
