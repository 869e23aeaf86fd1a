"""Give each repeated block of a stage graph a module of its own, called once per forward.

A captured stage is one flat graph: its parameters are read by `get_attr` nodes and no
submodule is ever *called*. Per-block machinery needs calls: FSDP2 gathers a unit's
parameters in the unit's forward pre-hook and reduce-scatters its gradients from hooks it
registers there, so with a flat graph the whole stage is one unit and ZeRO-3 gathers the whole
stage at once (the model, at pp 1) -- not what ZeRO-3 is for. This pass moves the ops of block
k (the nodes of `CapturedGraph.layer_nodes[k]` and the redistributions inserted for them) into
a GraphModule installed at the block's own path (`CapturedGraph.block_path(k)`, e.g.
`transformer.h.3`), holding the block's parameters at their own FQNs (named_parameters, state
dicts and checkpoints see no change), and calls it (`call_module`). Then each block is one FSDP2
unit (gathered in its pre-forward, resharded after; FSDP2 prefetches the next one), and
activation checkpointing wraps the block's forward inside the unit (torchtitan's order).

A parameter moves into its block when its FQN lies under the block's path and the block alone
reads it; any other (a weight shared across blocks, a tied weight) stays in the stage and
enters the block as an argument, in the stage's unit.

Run after `apply_placements` (the block takes its redistributions with it) and after the tp
parameters are DTensors (the block module shares the stage's Parameter objects).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from autoplan.graph import CapturedGraph

__all__ = ["install_blocks", "block_nodes", "outline"]


def block_nodes(gm: torch.fx.GraphModule, graph: CapturedGraph) -> dict[int, list[torch.fx.Node]]:
    """call_function nodes of `gm` per block id, in graph order: the block's own ops (by
    original node name) and the redistributions inserted for them."""
    layer_of = {n: k for k, names in graph.layer_nodes.items() for n in names}
    blocks: dict[int, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = node.meta.get("orig_name", node.name)
        k = layer_of.get(name)
        if k is None and node.meta.get("redistribute_for") is not None:
            k = layer_of.get(node.meta["redistribute_for"])
        if k is not None:
            blocks.setdefault(k, []).append(node)
    return blocks


def install_blocks(gm: torch.fx.GraphModule, graph: CapturedGraph) -> list[str]:
    """Move every block of `gm` into a called module at its path (in place); returns the
    paths, in graph order. A model without repeated blocks is left as it is ([]); so is a block
    whose own tensors are also read outside it (it stays flat, in the stage's unit).

    Raises ValueError when a block's ops are interleaved with an op outside the block that both
    reads from and feeds the block (naming the node), as checkpointing would.
    """
    if not graph.layer_prefix:
        return []
    paths = []
    for k, nodes in block_nodes(gm, graph).items():
        path = graph.block_path(k)
        if _shared(gm, path, set(nodes)):
            continue  # a tensor under the block's path is read outside it: stays flat
        _install(gm, path, nodes)
        paths.append(path)
    gm.graph.lint()
    gm.recompile()
    return paths


def _shared(gm: torch.fx.GraphModule, path: str, members: set[torch.fx.Node]) -> bool:
    """True when a parameter or buffer under `path` is read by an op outside the block (the
    block module could not own it: its FSDP2 unit would shard it while the stage reads it)."""
    prefix = path + "."
    return any(n.op == "get_attr" and isinstance(n.target, str) and n.target.startswith(prefix)
               and any(u not in members for u in n.users) for n in gm.graph.nodes)


def _install(gm: torch.fx.GraphModule, path: str, nodes: list[torch.fx.Node]) -> None:
    prefix = path + "."
    members = set(nodes)

    def owned(a: torch.fx.Node) -> str | None:
        if a.op == "get_attr" and isinstance(a.target, str) and a.target.startswith(prefix) \
                and all(u in members for u in a.users):
            return a.target[len(prefix):]
        return None

    def install(sub: torch.fx.Graph) -> None:
        block = torch.fx.GraphModule(gm.get_submodule(path), sub, class_name="Block")
        parent_path, _, leaf = path.rpartition(".")
        gm.get_submodule(parent_path).add_module(leaf, block)

    outline(gm, nodes, f"block {path}", install,
            lambda inputs: gm.graph.call_module(path, tuple(inputs)), owned=owned)


def outline(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], what: str,
            install, make_call, owned=lambda a: None) -> None:
    """Move `nodes` (in graph order) out of `gm` into a graph of their own, in place.

    `install(sub_graph)` makes the graph callable (registers a module); `make_call(inputs)`
    inserts the node that calls it, after the last of `nodes`, with the region's inputs (every
    value it reads from outside, in first-use order) as arguments; the region's outputs (values
    read outside it) come back through getitem of that call. `owned(input)` -> a target
    relative to the new module for a get_attr the region alone reads, which moves inside.

    Raises ValueError (naming `what` and the node) when an op outside the region sits between
    its ops and reads one of its values.
    """
    members = set(nodes)
    inputs: list[torch.fx.Node] = []
    inner: dict[torch.fx.Node, str] = {}
    for node in nodes:
        for a in node.all_input_nodes:
            if a in members or a in inputs or a in inner:
                continue
            target = owned(a)
            if target is None:
                inputs.append(a)
            else:
                inner[a] = target
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last = nodes[-1]
    for out in outputs:
        for user in out.users:
            if user not in members and order[user] < order[last]:
                raise ValueError(
                    f"cannot outline {what}: {user.name} ({user.target}) sits between its ops "
                    f"and reads {out.name} from it")
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for a, target in inner.items():
        env[a] = sub.get_attr(target)
        env[a].meta = dict(a.meta)
    for node in nodes:
        env[node] = sub.node_copy(node, lambda a: env[a])
    sub.output(tuple(env[o] for o in outputs))
    install(sub)
    with gm.graph.inserting_after(last):
        call = make_call(inputs)
    replacements = []
    with gm.graph.inserting_after(call):
        for i, out in enumerate(outputs):
            item = gm.graph.call_function(operator.getitem, (call, i))
            item.meta = dict(out.meta)
            replacements.append((out, item))
    for out, item in replacements:
        out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in members)
    for node in reversed(nodes):
        gm.graph.erase_node(node)
    for a in inner:
        gm.graph.erase_node(a)
