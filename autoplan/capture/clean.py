"""Step 2 of capture: the unlifted export graph rebuilt as a plain GraphModule (placeholders,
one get_attr per canonical FQN, the ops, one output) with meta copies of the parameters and
buffers ([Note: tied weights] in the package docstring).

A dropout that cannot drop -- probability 0 or train False, as Llama's attention_dropout = 0.0
and every `nn.Dropout(0.0)` are traced -- is left out: ATen returns its input itself
(aten/src/ATen/native/Dropout.cpp, `_dropout_impl`: "if (p == 0 || !train ...) return input"),
drawing no random numbers and saving nothing, so the graph computes the same without it and the
cost model does not price a mask and a copy that never exist. So is a cast to the dtype its
input has (`aten.to.dtype`, no copy, memory format preserved: Tensor.to returns self, as HF's
`softmax(...).to(query.dtype)` in fp32): its value is its input's storage, which the memory
model would otherwise count twice when two ops save it under the two names.
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from autoplan.capture.errors import CaptureError

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


_DROPOUTS = (torch.ops.aten.dropout.default, torch.ops.aten.feature_dropout.default,
             torch.ops.aten.alpha_dropout.default, torch.ops.aten.feature_alpha_dropout.default)


def _is_identity_dropout(node: torch.fx.Node) -> bool:
    """A dropout(input, p, train) whose p is 0 or train False: ATen returns `input` itself."""
    if node.target not in _DROPOUTS or len(node.args) < 3:
        return False
    p, train = node.args[1], node.args[2]
    return isinstance(p, (int, float)) and isinstance(train, bool) and (p == 0 or not train)


def _is_identity_cast(node: torch.fx.Node) -> bool:
    """An aten.to.dtype to the dtype its input has, without copy=True or a memory format:
    Tensor.to returns `self`."""
    if node.target is not torch.ops.aten.to.dtype or not isinstance(node.args[0], torch.fx.Node):
        return False
    src = node.args[0].meta.get("val")
    dtype = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    copy = node.args[3] if len(node.args) > 3 else node.kwargs.get("copy", False)
    fmt = node.args[4] if len(node.args) > 4 else node.kwargs.get("memory_format")
    return (isinstance(src, torch.Tensor) and src.dtype == dtype and not copy
            and fmt in (None, torch.preserve_format))


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
        elif node.op == "call_function" and (_is_identity_dropout(node)
                                             or _is_identity_cast(node)):
            env[node] = env[node.args[0]]
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
