"""Split a captured graph into pipeline stages.

Every call_function node is assigned to a stage:
- nodes of repeated block `k` go to the stage whose [layer_start, layer_end) holds k;
- nodes outside the blocks that some block depends on (embedding, ...) go to stage 0;
- the remaining nodes outside the blocks (final norm, head) go to the last stage;
- *constant-like* nodes -- those that depend on no graph input and no trainable parameter, such
  as position ids, causal masks and rotary cos/sin computed from a buffer -- are recomputed in
  every stage that uses them instead of being sent between stages (so each stage holds its own
  copy of the buffers they read: case C5). Not an op that writes its argument in place
  (`num_batches_tracked.add_(1)`, a counter): recomputed per stage it would run once per
  stage that reads it, and not at all where nothing reads it; it runs once, in a stage, as
  any other op ([Note: batch coupling] in autoplan/batch_coupling.py).

A value produced in stage i and used in stage j > i travels through every stage in between: the
stage outputs are exactly the values live across its right boundary, in graph order.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn as nn

from autoplan.graph import CapturedGraph
from autoplan.plan import Stage

__all__ = ["assign_stages", "constant_like_nodes", "split_stages", "StageGraph",
           "untie_across_stages"]


def constant_like_nodes(gm: torch.fx.GraphModule, buffer_fqns: set[str]) -> set[str]:
    """Names of nodes that depend on no placeholder and no trainable parameter, and write
    nothing in place (and of none that depends on such a write)."""
    variable: set[str] = set()
    out: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            variable.add(node.name)
        elif node.op == "get_attr":
            if node.target not in buffer_fqns:
                variable.add(node.name)
            else:
                out.add(node.name)
        elif node.op == "call_function":
            if any(a.name in variable for a in node.all_input_nodes) or \
                    _writes_buffer(node, buffer_fqns):
                variable.add(node.name)
            else:
                out.add(node.name)
    return out


def _writes_buffer(node: torch.fx.Node, buffer_fqns: set[str]) -> bool:
    """Whether `node`'s op writes a buffer in place: its first argument, when that is the
    buffer, a view of it or what an in-place op on it returned. A mask built in place
    (`full(...).triu_(1)`) is no buffer: recomputed per stage as before."""
    if not _writes_first(node):
        return False
    value = node.args[0]
    while value.op == "call_function" and (value.target in _VIEWS or _writes_first(value)):
        value = value.args[0]
    return value.op == "get_attr" and value.target in buffer_fqns


def _writes_first(node: torch.fx.Node) -> bool:
    """Whether `node`'s op writes its first argument, a node, in place (add_, copy_)."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.arguments and node.args
                and isinstance(node.args[0], torch.fx.Node)
                and schema.arguments[0].alias_info is not None
                and schema.arguments[0].alias_info.is_write)


_VIEWS = frozenset({torch.ops.aten.slice.Tensor, torch.ops.aten.select.int,
                    torch.ops.aten.view.default, torch.ops.aten.alias.default,
                    torch.ops.aten.narrow.default, torch.ops.aten.as_strided.default})


def _layer_of(graph: CapturedGraph) -> dict[str, int]:
    return {name: k for k, names in graph.layer_nodes.items() for name in names}


def assign_stages(gm: torch.fx.GraphModule, graph: CapturedGraph,
                  stages: tuple[Stage, ...]) -> tuple[dict[str, int], set[str]]:
    """Stage index per non-constant call_function node, and the set of constant-like nodes.

    Raises ValueError when the stages do not cover the layers exactly once or when a node would
    run before one of its inputs (naming the node and both stages).
    """
    num_stages = len(stages)
    covered = [k for s in stages for k in range(s.layer_start, s.layer_end)]
    if sorted(covered) != list(range(graph.num_layers)):
        raise ValueError(
            f"pipeline stages {[(s.layer_start, s.layer_end) for s in stages]} do not cover "
            f"layers 0..{graph.num_layers - 1} exactly once")
    stage_of_layer = {k: s.index for s in stages for k in range(s.layer_start, s.layer_end)}
    layer_of = _layer_of(graph)
    buffers = {fqn for fqn, p in graph.params.items() if p.is_buffer}
    constants = constant_like_nodes(gm, buffers)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.name not in constants]
    # pre-block nodes: ancestors of any block node
    in_layers = {n.name for n in nodes if n.name in layer_of}
    feeds_layers: set[str] = set()
    for node in reversed(nodes):
        if node.name in in_layers or node.name in feeds_layers:
            for a in node.all_input_nodes:
                feeds_layers.add(a.name)
    # the ops of a leading block ([Note: leading blocks] in capture/stack.py) run on the first
    # stage with it, the in-place writes that feed its later ops by mutation included
    leading = tuple(f"{graph.layer_prefix}.{i}" for i in range(graph.first_layer))
    stage: dict[str, int] = {}
    for node in nodes:
        path = graph.nodes[node.name].module_path if node.name in graph.nodes else ""
        if node.name in layer_of:
            s = stage_of_layer[layer_of[node.name]]
        elif node.name in feeds_layers or any(path == p or path.startswith(p + ".")
                                              for p in leading):
            s = 0
        else:
            s = num_stages - 1
        for a in node.all_input_nodes:
            if a.name in stage and stage[a.name] > s:
                raise ValueError(
                    f"node {node.name} ({node.target}) was assigned to stage {s} but reads "
                    f"{a.name} from the later stage {stage[a.name]}")
        stage[node.name] = s
    return stage, constants


class StageGraph:
    """One stage: its GraphModule and the names of the original values it takes and returns."""

    def __init__(self, index: int, gm: torch.fx.GraphModule, input_names: list[str],
                 output_names: list[str]):
        self.index = index
        self.gm = gm
        self.input_names = input_names
        self.output_names = output_names

    def __repr__(self) -> str:
        return (f"StageGraph({self.index}, inputs={self.input_names}, "
                f"outputs={self.output_names})")


def split_stages(gm: torch.fx.GraphModule, graph: CapturedGraph,
                 stages: tuple[Stage, ...]) -> list[StageGraph]:
    """Split `gm` into one GraphModule per stage (see module docstring).

    Each stage module shares parameter objects with `gm`. Node names are kept, so plan
    strategies (keyed by node name) apply to stage graphs unchanged; every copied node also
    records `meta["orig_name"]`.
    """
    stage, constants = assign_stages(gm, graph, stages)
    num_stages = len(stages)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: n for n in gm.graph.nodes}
    output_node = next(n for n in gm.graph.nodes if n.op == "output")

    def prod_stage(n: torch.fx.Node) -> int | None:
        if n.op == "placeholder":
            return 0
        return stage.get(n.name)  # None for get_attr / constant-like (recomputed per stage)

    last_use: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.name in stage:
            user_stage = stage[node.name]
        elif node.op == "output":
            user_stage = num_stages - 1
        else:
            continue
        for a in node.all_input_nodes:
            if prod_stage(a) is not None:
                last_use[a.name] = max(last_use.get(a.name, -1), user_stage)

    def live_after(s: int) -> list[str]:
        names = [v for v, u in last_use.items()
                 if prod_stage(by_name[v]) <= s < u]
        return sorted(names, key=order.__getitem__)

    result = []
    for s in range(num_stages):
        inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"] if s == 0 \
            else live_after(s - 1)
        g = torch.fx.Graph()
        env: dict[str, torch.fx.Node] = {}
        for name in inputs:
            ph = g.placeholder(name)
            ph.meta = dict(by_name[name].meta)
            ph.meta["orig_name"] = name
            env[name] = ph

        def copy(node: torch.fx.Node) -> torch.fx.Node:
            if node.name in env:
                return env[node.name]
            # Only parameters/buffers and constant-like nodes are recomputed in a stage;
            # anything else must have arrived as a stage input.
            assert node.op == "get_attr" or node.name in constants or stage.get(node.name) == s, (
                f"stage {s} would recompute {node.name} of stage {stage.get(node.name)}")
            for a in node.all_input_nodes:
                copy(a)
            new = g.node_copy(node, lambda a: env[a.name])
            new.meta["orig_name"] = node.name
            env[node.name] = new
            return new

        for node in gm.graph.nodes:
            if node.op == "call_function" and stage.get(node.name) == s:
                copy(node)
        if s == num_stages - 1:
            outs = torch.fx.node.map_arg(output_node.args[0], lambda a: copy(a))
            g.output(outs)
            output_names = [a.name for a in output_node.all_input_nodes]
        else:
            output_names = live_after(s)
            g.output(tuple(env[name] for name in output_names))
        sub = torch.fx.GraphModule(gm, g, class_name=f"Stage{s}")
        result.append(StageGraph(s, sub, inputs, output_names))
    return result


def untie_across_stages(gm: torch.fx.GraphModule) -> None:
    """Give this stage its own Parameter objects, so stages never share one across modules
    (a tied embedding and head in two stages: runtime/tied.py sums their gradients)."""
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            owner_path, _, leaf = node.target.rpartition(".")
            owner = gm.get_submodule(owner_path) if owner_path else gm
            if leaf in owner._parameters:
                old = owner._parameters[leaf]
                owner._parameters[leaf] = nn.Parameter(old.detach().clone(),
                                                       requires_grad=old.requires_grad)
