"""The plan's parameter placements and redistributions, grouped per block role, as the report
shows them (autoplan/report/facts.py re-exports these).

[Note: block roles]
A repeated block appears `total_layers` times in the real model but only `num_layers` times in
the captured graph (often 2), and a plan lists parameters and redistributions per captured node.
The report groups them per *role*: a parameter `model.layers.3.mlp.up_proj.weight` has role
`model.layers.*.mlp.up_proj.weight`; a redistribution has the role of its consumer, which is the
consumer's position in its block's op sequence (blocks align by position, see
`CapturedGraph.layer_nodes`). A role present in every captured block occurs `total_layers` times.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from autoplan.cost_model.part_costs import node_parts
from autoplan.graph import CapturedGraph
from autoplan.op_classes import op_name
from autoplan.plan import Plan

__all__ = ["ParamGroup", "RedistributionGroup", "param_groups", "sharded_params",
           "redistribution_groups"]


def _block_role(fqn: str, prefix: str, first: int = 0) -> tuple[str, int | None]:
    """("model.layers.*.mlp.up_proj.weight", 3) for "model.layers.3.mlp.up_proj.weight": the
    role and the layer id (the block's index less the `first` leading blocks, which keep their
    own names: [Note: leading blocks] in capture/stack.py)."""
    if prefix:
        m = re.match(re.escape(prefix) + r"\.(\d+)(\.|$)", fqn)
        if m and int(m.group(1)) >= first:
            return f"{prefix}.*{fqn[m.end(1):]}", int(m.group(1)) - first
        return fqn, None
    m = re.search(r"\.(\d+)\.", fqn)  # no graph: the first numbered component is the block
    if m:
        return f"{fqn[:m.start(1)]}*{fqn[m.end(1):]}", int(m.group(1))
    return fqn, None


def _occurrences(layers: set[int], num_layers: int, total_layers: int) -> int:
    """How often a role seen in captured blocks `layers` occurs in the real model."""
    if not num_layers or len(layers) >= num_layers:
        return total_layers or len(layers)
    if layers == {0}:
        return 1  # fed from outside the blocks: the first block only
    if 0 not in layers and len(layers) == num_layers - 1:
        return total_layers - 1  # fed by the previous block
    return round(len(layers) * total_layers / num_layers)


@dataclass(frozen=True)
class ParamGroup:
    """Parameters with one role and one placement on the tp axis.

    Attributes:
        role: FQN with the block index replaced by "*" (the FQN itself outside the blocks).
        placement: "R" | "S(d)".
        shape: global shape (empty when no graph was given).
        count: how many such parameters the real model has.
        tied_to: the canonical FQN when this is another name of a tied weight, else "".
        is_buffer: a registered buffer (e.g. rotary inv_freq), not a trainable parameter
            (False without a graph, which alone knows).
    """

    role: str
    placement: str
    shape: tuple[int, ...]
    count: int
    tied_to: str = ""
    is_buffer: bool = False


def param_groups(plan: Plan, graph: CapturedGraph | None = None) -> list[ParamGroup]:
    """Plan.param_placements grouped per block role ([Note: block roles]), in FQN order of each
    role's first parameter."""
    prefix = graph.layer_prefix if graph is not None else ""
    first = graph.first_layer if graph is not None else 0
    num_layers = graph.num_layers if graph is not None else 0
    total = graph.total_layers if graph is not None else 0
    groups: dict[tuple[str, str, str], tuple[tuple, set[int], int]] = {}
    buffers = set()
    canonical = {}  # any FQN (tied aliases too) -> its ParamInfo
    for info in (graph.params.values() if graph is not None else ()):
        canonical.update({name: info for name in (info.fqn, *info.aliases)})
    for fqn, placement in plan.param_placements:
        role, layer = _block_role(fqn, prefix, first)
        info = canonical.get(fqn)
        shape = info.shape if info is not None else ()
        tied = _block_role(info.fqn, prefix, first)[0] if info is not None and info.fqn != fqn else ""
        key = (role, placement, tied)
        if info is not None and info.is_buffer:
            buffers.add(key)
        old_shape, layers, n = groups.get(key, (shape, set(), 0))
        if layer is not None:
            layers.add(layer)
        groups[key] = (old_shape, layers, n + 1)
    result = []
    for (role, placement, tied), (shape, layers, n) in groups.items():
        count = _occurrences(layers, num_layers, total) if layers and graph is not None else n
        result.append(ParamGroup(role, placement, tuple(shape), count, tied,
                                 (role, placement, tied) in buffers))
    return result


def sharded_params(plan: Plan, graph: CapturedGraph | None = None) -> tuple[int, int]:
    """(parameters sharded on the tp axis, parameters) of the real model: `param_groups`
    counts, a tied weight once, buffers left out. Without a graph these are the plan's
    `param_placements` entries: names of the captured blocks only, a tied weight under each
    of its names (the plan alone cannot tell)."""
    own = [g for g in param_groups(plan, graph) if not g.tied_to and not g.is_buffer]
    return sum(g.count for g in own if g.placement != "R"), sum(g.count for g in own)


@dataclass(frozen=True)
class RedistributionGroup:
    """Redistributions with one consumer role, argument, placement change and collective.

    Attributes:
        where: the consumer's module path (block index as "*") and op, e.g.
            "model.layers.*.self_attn.o_proj: linear"; "graph output" for the output.
        producer, consumer, arg_index: the edge of the first occurrence (fx node names).
        src, dst, collective: the placement change on the tp axis and its collective.
        bytes: bytes of the tensor moved by one occurrence.
        time_s: predicted forward time of one occurrence, seconds.
        count: occurrences in the real model per microbatch.
        part: "pre" | "block" | "post": where the consumer is ("?" without a graph).
    """

    where: str
    producer: str
    consumer: str
    arg_index: int
    src: str
    dst: str
    collective: str
    bytes: float
    time_s: float
    count: int
    part: str

    @property
    def edge(self) -> str:
        return f"{self.producer} -> {self.consumer}[{self.arg_index}]"


def redistribution_groups(plan: Plan,
                          graph: CapturedGraph | None = None) -> list[RedistributionGroup]:
    """Plan.redistributions grouped per consumer role ([Note: block roles]); without a graph,
    one group per redistribution."""
    if graph is None:
        return [RedistributionGroup(r.consumer, r.producer, r.consumer, r.arg_index, r.src,
                                    r.dst, r.collective, r.bytes, r.time_s, 1, "?")
                for r in plan.redistributions]
    position = {n: i for names in graph.layer_nodes.values() for i, n in enumerate(names)}
    parts = node_parts(graph)
    groups: dict[tuple, tuple[RedistributionGroup, set[int], list[int]]] = {}
    for r in plan.redistributions:
        info = graph.nodes.get(r.consumer)  # None: the graph output
        layer = info.layer_id if info is not None else None
        role = ("block", position[r.consumer]) if layer is not None else ("node", r.consumer)
        key = (*role, r.arg_index, r.src, r.dst, r.collective)
        if key not in groups:
            if info is None:
                where, part = "graph output", "post"
            else:
                path = _block_role(info.module_path, graph.layer_prefix,
                                   graph.first_layer)[0] or "<root>"
                where, part = f"{path}: {op_name(info.target)}", parts[r.consumer]
            first = RedistributionGroup(where, r.producer, r.consumer, r.arg_index, r.src,
                                        r.dst, r.collective, r.bytes, r.time_s, 0, part)
            groups[key] = (first, set(), [0])
        _, layers, seen = groups[key]
        seen[0] += 1
        if layer is not None:
            layers.add(layer)
    return [dataclasses.replace(
        first, count=_occurrences(layers, graph.num_layers, graph.total_layers) if layers
        else seen[0]) for first, layers, seen in groups.values()]
