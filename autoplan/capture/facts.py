"""Steps 4 and 5 of capture: the facts of each call_function node (shapes, dtypes, bytes,
forward FLOPs, module FQN, layer id, backward share), the container of repeated blocks, and the
parameters.
"""

from __future__ import annotations

import operator
import re
import warnings
from collections import Counter

import torch
import torch.fx
import torch.utils.flop_counter as flop_counter
from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

from autoplan.capture.clean import _WRAPPED, _canonical_tensors, _strip
from autoplan.capture.errors import CaptureError
from autoplan.experts import EXPERTS_OP
from autoplan.graph import NodeInfo, ParamInfo
from autoplan.op_classes import MATMUL_OPERANDS, op_name


# --- per-node facts ----------------------------------------------------------------------------

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensors(val: object) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for v in val for t in _tensors(v)]
    return []


def _nbytes(val: object) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(val))


def _target_name(target: object) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # "aten.addmm.default"
    module = getattr(target, "__module__", "") or ""
    return f"{module.lstrip('_')}.{getattr(target, '__name__', repr(target))}".lstrip(".")


def _meta_like(val: object) -> object:
    if isinstance(val, torch.Tensor):
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    if isinstance(val, (tuple, list)):
        return type(val)(_meta_like(v) for v in val)
    return val


def _counts_flops(target: object) -> bool:
    """Ops the flop counter can see: registered ones and composites that decompose into them."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return target.overloadpacket in flop_counter.flop_registry or \
        target.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)


def _node_flops(node: torch.fx.Node, counter: flop_counter.FlopCounterMode) -> int:
    """Forward FLOPs of one op, as torch.utils.flop_counter counts them, by running the op on
    meta tensors of the node's input shapes inside `counter` (allocates nothing)."""
    if not _counts_flops(node.target):
        return 0
    args = torch.fx.node.map_arg(node.args, lambda n: _meta_like(n.meta.get("val")))
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: _meta_like(n.meta.get("val")))
    before = counter.get_total_flops()
    node.target(*args, **kwargs)
    return counter.get_total_flops() - before


def _module_path(node: torch.fx.Node, module_names: set[str]) -> str:
    """FQN of the innermost module in node.meta["nn_module_stack"], as named_modules names it.

    Non-strict export spells paths as FQNs under the wrapper ("inner.model.layers.0.mlp"),
    "@n" marking a repeated call; anything else falls back to the closest real module."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = _strip(re.sub(r"@\d+$", "", next(reversed(stack.values()))[0]))
    path = "" if path == _WRAPPED else path
    while path and path not in module_names:
        path = path.rpartition(".")[0]
    return path


def _layer_of(path: str, prefix: str, first: int = 0) -> int | None:
    """Layer id of module `path`: its block's index in container `prefix` less the `first`
    leading blocks ([Note: leading blocks] in capture/stack.py); None outside the blocks."""
    if not prefix or not path.startswith(prefix + "."):
        return None
    key = path[len(prefix) + 1:].split(".", 1)[0]
    return int(key) - first if key.isdigit() and int(key) >= first else None


def _node_info(node: torch.fx.Node, counter: flop_counter.FlopCounterMode,
               module_names: set[str], prefix: str, model_name: str,
               first: int = 0) -> NodeInfo:
    val = node.meta.get("val")
    outs = _tensors(val)
    path = _module_path(node, module_names)
    dynamic = [t for t in outs if not all(isinstance(d, int) for d in t.shape)]
    if dynamic:
        # nonzero, masked_select, boolean indexing...: the output size depends on the values
        # (an unbacked symbol). Plans need static shapes to cost and to split.
        raise CaptureError(
            f"{model_name!r} node {node.name} ({_target_name(node.target)}) in module "
            f"{path or '<root>'} has a data-dependent output shape "
            f"{tuple(dynamic[0].shape)}: the number of elements depends on the input values "
            "(e.g. routing tokens to experts with nonzero); autoplan plans static shapes. "
            "Use a fixed-capacity formulation (pad each expert to a capacity).")
    try:
        flops = _node_flops(node, counter)
    except Exception as e:  # noqa: BLE001
        first = (str(e).splitlines() or [""])[0]
        raise CaptureError(f"cannot count FLOPs of {model_name!r} node {node.name} "
                           f"({_target_name(node.target)}) in module {path or '<root>'}: "
                           f"{type(e).__name__}: {first}") from e
    if node.target is operator.getitem:
        in_bytes = _nbytes(val)  # reads only the selected output
    else:
        in_bytes = sum(_nbytes(n.meta.get("val")) for n in node.all_input_nodes)
    return NodeInfo(
        name=node.name, target=_target_name(node.target),
        shapes=tuple(tuple(int(d) for d in t.shape) for t in outs),
        dtypes=tuple(_dtype_name(t.dtype) for t in outs),
        out_bytes=_nbytes(val), in_bytes=in_bytes, flops=int(flops),
        module_path=path, layer_id=_layer_of(path, prefix, first),
        experts=_experts_shape(node))


def _experts_shape(node: torch.fx.Node) -> tuple[int, int, int] | None:
    """(E, k, I) of an `autoplan.experts` node (NodeInfo.experts): top_k_index (T, k) and
    down_proj (E, H, I) are its arguments 1 and 4 ([Note: experts op]); None for another op."""
    if node.target is not EXPERTS_OP:
        return None
    index, down = (_value(node.args[i]) for i in (1, 4))
    return int(down.shape[0]), int(index.shape[1]), int(down.shape[2])


def _value(arg: torch.fx.Node) -> torch.Tensor:
    """A node's value: its meta "val", or the module attribute a get_attr names."""
    if "val" in arg.meta:
        return arg.meta["val"]
    value = arg.graph.owning_module
    for part in str(arg.target).split("."):
        value = getattr(value, part)
    return value


# --- which inputs carry a gradient -------------------------------------------------------------

def _backward_shares(gm: torch.fx.GraphModule, params: dict[str, ParamInfo]) -> dict[str, float]:
    """`NodeInfo.backward_share` per call_function node name ([Note: backward share]).

    [Note: backward share]
    Autograd computes a gradient for a tensor only when something upstream of it requires one
    (torch/csrc/autograd: a node's `needs_input_grad`). A value is *frozen-only* when it derives
    from frozen parameters alone: a get_attr of a parameter with `trainable` False, or a node
    with at least one input node, all of them frozen-only. Everything else carries a gradient,
    conservatively: placeholders (graph inputs), buffers, lifted constants, get_attrs that are
    not parameters, and nodes without input nodes (arange, full), so that a model without
    frozen parameters has share 1.0 on every node and is priced exactly as before.
    A matmul-like op (MATMUL_OPERANDS names its operands a and b) computes grad a = grad out
    @ b^T and grad b = a^T @ grad out, each a matmul of the forward's size (Narayanan et al.,
    SC'21): share = (a carries a gradient + b carries one) / 2, 0.5 for a frozen weight. Any
    other op: 0.0 when frozen-only, else 1.0.
    """
    frozen_fqns = {name for p in params.values() if not p.trainable and not p.is_buffer
                   for name in (p.fqn, *p.aliases)}
    frozen: set[torch.fx.Node] = set()
    shares: dict[str, float] = {}

    def carries(arg: object) -> bool:
        return not (isinstance(arg, torch.fx.Node) and arg in frozen)

    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in frozen_fqns:
            frozen.add(node)
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if inputs and all(n in frozen for n in inputs):
            frozen.add(node)
        operands = MATMUL_OPERANDS.get(op_name(_target_name(node.target)))
        if operands is None:
            shares[node.name] = 0.0 if node in frozen else 1.0
            continue
        # an operand passed by keyword is not looked up: it counts as carrying a gradient
        a, b = (any(carries(node.args[i] if i < len(node.args) else None) for i in side)
                for side in operands)
        shares[node.name] = (a + b) / 2
    return shares


# --- repeated blocks and parameters ------------------------------------------------------------

def _find_layers(model: nn.Module, layer_prefix: str | None) -> tuple[str, int]:
    """(FQN of the container of repeated blocks, number of blocks); ("", 0) when none. A
    parametrization's list (`conv.parametrizations.weight`, torch.nn.utils.parametrize) is a
    ModuleList with digit keys but holds the functions that compute one weight, not blocks."""
    containers = {
        name: mod for name, mod in model.named_modules()
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and len(mod) > 0
        and not isinstance(mod, ParametrizationList)
        and all(key.isdigit() for key, _ in mod.named_children())}
    if layer_prefix is not None:
        if layer_prefix == "":
            return "", 0
        if layer_prefix not in containers:
            raise ValueError(f"layer_prefix {layer_prefix!r} is not a ModuleList/ModuleDict with "
                             f"integer keys in the model; candidates: {sorted(containers)}")
        return layer_prefix, len(containers[layer_prefix])
    best, best_count = "", 0
    for name, mod in containers.items():
        count = Counter(type(m) for m in mod.children()).most_common(1)[0][1]
        if count > best_count:
            best, best_count = name, count
    return best, len(containers[best]) if best else 0


def _check_layers_align(nodes: dict[str, NodeInfo], layer_nodes: dict[int, list[str]],
                        prefix: str, model_name: str) -> None:
    """Warn when the repeated blocks do not have the same op sequence (planning shares one set
    of variables per block, which then is an approximation)."""
    seqs = {k: [nodes[n].target for n in names] for k, names in layer_nodes.items()}
    if not seqs:
        return
    first = min(seqs)
    differ = [k for k, s in seqs.items() if s != seqs[first]]
    if differ:
        warnings.warn(f"{model_name}: blocks of {prefix!r} differ from block {first} in their op "
                      f"sequence: blocks {differ}", stacklevel=3)


def _param_infos(model: nn.Module, prefix: str, first: int = 0) -> dict[str, ParamInfo]:
    canonical, to_canonical = _canonical_tensors(model)
    params = {id(p) for p in model.parameters()}
    aliases: dict[str, list[str]] = {fqn: [] for fqn in canonical}
    for fqn, name in to_canonical.items():
        if fqn != name:
            aliases[name].append(fqn)
    return {
        fqn: ParamInfo(fqn=fqn, shape=tuple(t.shape), dtype=_dtype_name(t.dtype),
                       numel=t.numel(), is_buffer=id(t) not in params,
                       layer_id=_layer_of(fqn.rpartition(".")[0], prefix, first),
                       aliases=tuple(aliases[fqn]),
                       trainable=id(t) in params and t.requires_grad)
        for fqn, t in canonical.items()}
