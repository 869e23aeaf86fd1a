"""Step 2 of capture: the unlifted export graph rebuilt as a plain GraphModule (placeholders,
one get_attr per canonical FQN, the ops, one output) with meta copies of the parameters and
buffers ([Note: tied weights] in the package docstring).
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from autoplan.capture import CaptureError

_WRAPPED = "inner"  # attribute name of the model inside the export wrapper; stripped from FQNs


def _canonical_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(canonical FQN -> tensor, in registration order; any FQN -> canonical FQN)."""
    canonical: dict[str, torch.Tensor] = {}
    by_id: dict[int, str] = {}
    to_canonical: dict[str, str] = {}
    named = list(model.named_parameters(remove_duplicate=False))
    named += list(model.named_buffers(remove_duplicate=False))
    for fqn, t in named:
        first = by_id.setdefault(id(t), fqn)
        if first == fqn:
            canonical[fqn] = t
        to_canonical[fqn] = first
    return canonical, to_canonical


def _strip(target: str) -> str:
    return target[len(_WRAPPED) + 1:] if target.startswith(_WRAPPED + ".") else target


def _clean_graph(ugm: torch.fx.GraphModule, model: nn.Module,
                 input_names: list[str]) -> torch.fx.GraphModule:
    """Rebuild the unlifted export graph: placeholders, canonical get_attrs, ops, the output
    (one tensor, or a flat tuple of the model output's tensors)."""
    canonical, to_canonical = _canonical_tensors(model)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    old_nodes = list(ugm.graph.nodes)
    for node, name in zip([n for n in old_nodes if n.op == "placeholder"], input_names):
        env[node] = graph.placeholder(name)
        env[node].meta = dict(node.meta)
    attrs = {fqn: graph.get_attr(fqn) for fqn in canonical}
    extra: dict[str, object] = {}  # lifted constants / higher-order-op subgraphs
    assert_op = torch.ops.aten._assert_tensor_metadata.default
    for node in old_nodes:
        if node.op == "get_attr":
            target = _strip(node.target)
            if target in to_canonical:
                env[node] = attrs[to_canonical[target]]
                env[node].meta = env[node].meta or dict(node.meta)
            else:
                extra[target] = _get_attr(ugm, node.target)
                env[node] = graph.node_copy(node, lambda n: env[n])
                env[node].target = target
        elif node.op == "call_module" and node.target == "_guards_fn":
            continue  # export's input guards; the planner owns the shapes
        elif node.op == "call_function" and node.target is assert_op:
            continue  # pins the capture device (meta); the rest of the graph is device-free
        elif node.op == "output":
            flat = node.args[0]
            flat = flat if isinstance(flat, (tuple, list)) else (flat,)
            outs = tuple(env[a] for a in flat)
            graph.output(outs[0] if len(outs) == 1 else outs)
        elif node.op in ("call_function", "call_method"):
            env[node] = graph.node_copy(node, lambda n: env[n])
        elif node.op != "placeholder":
            raise CaptureError(f"unexpected {node.op} node {node.name} ({node.target}) in the "
                               "exported graph")
    for fqn, node in attrs.items():
        if "val" not in node.meta:  # unused by the graph: give it a shape anyway
            t = canonical[fqn]
            node.meta["val"] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                   device="meta")
    return _graph_module(graph, model, canonical, extra)


def _get_attr(root: nn.Module, target: str) -> object:
    obj: object = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _graph_module(graph: torch.fx.Graph, model: nn.Module, canonical: dict[str, torch.Tensor],
                  extra: dict[str, object]) -> torch.fx.GraphModule:
    """A GraphModule whose attributes are meta copies of the parameters/buffers at their FQNs
    (buffers keep their persistence, so gm.state_dict() keys match the model's)."""
    non_persistent = {f"{mod_name}.{b}" if mod_name else b
                      for mod_name, mod in model.named_modules()
                      for b in mod._non_persistent_buffers_set}
    root = nn.Module()
    params = {id(p) for p in model.parameters()}
    for fqn, t in canonical.items():
        owner_name, _, leaf = fqn.rpartition(".")
        owner = _ensure_submodule(root, owner_name)
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        if id(t) in params:
            owner.register_parameter(leaf, nn.Parameter(meta, requires_grad=t.requires_grad))
        else:
            owner.register_buffer(leaf, meta, persistent=fqn not in non_persistent)
    for target, obj in extra.items():
        owner_name, _, leaf = target.rpartition(".")
        setattr(_ensure_submodule(root, owner_name), leaf, obj)
    gm = torch.fx.GraphModule(root, graph)
    for fqn in non_persistent & canonical.keys():  # GraphModule re-registers buffers persistent
        owner_name, _, leaf = fqn.rpartition(".")
        gm.get_submodule(owner_name)._non_persistent_buffers_set.add(leaf)
    gm.graph.lint()
    gm.recompile()
    return gm


def _ensure_submodule(root: nn.Module, path: str) -> nn.Module:
    mod = root
    for part in path.split(".") if path else []:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    return mod
