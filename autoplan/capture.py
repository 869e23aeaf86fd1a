"""Capture: nn.Module + example inputs -> `CapturedGraph` (an aten FX graph + per-node facts).

The steps, in order:
1. `torch.export.export(strict=False)` of a thin wrapper that calls the model (HF models with
   `use_cache=False`) and returns one tensor (`.logits` of a ModelOutput, the first tensor of a
   tuple). Export runs on fake tensors, so a model on the meta device is captured without
   allocating it; a model on the meta device gets its example inputs moved to meta.
   The graph stays at the export training-IR level (aten.linear, aten.addmm, aten.view,
   aten.scaled_dot_product_attention, ...): no core-aten decomposition, because strategies and
   costs speak these ops.
2. Clean the unlifted graph (`ep.module()`) into a plain GraphModule: placeholders named after the
   model's forward arguments (`input_ids`), then one get_attr per parameter/buffer at its
   canonical FQN (tied weights: one node, see [Note: tied weights]), then the ops; the export
   guard module, `aten._assert_tensor_metadata` nodes (they pin the capture device) and the pytree
   codegen are dropped; the output is one tensor.
3. Device constants (`aten.arange(..., device=...)`, `aten.to(..., device)`) are set to meta; the
   passes (or `materialize`) retarget them with `retarget_device`. `node.meta["val"]` keeps the
   export's fake tensors (global shapes, on the capture device).
4. Per call_function node: shapes, dtypes, bytes, forward FLOPs (torch.utils.flop_counter run on
   meta tensors, see `_node_flops`), innermost module FQN and layer id.
5. Repeated blocks: the nn.ModuleList / nn.ModuleDict (digit keys) with the most children of one
   class holds the layers (`layer_prefix` overrides); ops under `{layer_prefix}.{k}` get
   layer id k.

[Note: tied weights] Export may read a tied tensor under either name (GPT-2's embedding reads
`lm_head.weight`). Every name is mapped by tensor identity to its canonical FQN, the first name
`named_parameters(remove_duplicate=False)` yields (`transformer.wte.weight`); the others are
`ParamInfo.aliases` and are absent from the GraphModule.

What capture cannot do raises `CaptureError`, naming the module FQN, the source line and the
original error (data-dependent control flow such as `if x.sum() > 0:`, `.item()` used as a
shape or a condition, ops without a meta/fake kernel).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import operator
import re
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.fx
import torch.utils.flop_counter as flop_counter
from torch import nn

from autoplan.graph import CapturedGraph, NodeInfo, ParamInfo

__all__ = ["CaptureError", "capture", "capture_preset", "materialize", "retarget_device"]

# Re-exported: they live with the passes, which own graph rewriting.
from autoplan.passes.device import materialize, retarget_device  # noqa: E402

_WRAPPED = "inner"  # attribute name of the model inside the export wrapper; stripped from FQNs


class CaptureError(ValueError):
    """The model could not be captured; the message names the module FQN and the failing op.

    Attributes:
        partial_graph: what torch.export had traced before it failed (text; may be empty).
    """

    partial_graph: str = ""


class _Root(nn.Module):
    """Calls the model and returns one tensor, so the exported graph has a single output."""

    def __init__(self, model: nn.Module, use_cache_kwarg: bool) -> None:
        super().__init__()
        self.inner = model
        self.use_cache_kwarg = use_cache_kwarg

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        out = self.inner(*inputs, use_cache=False) if self.use_cache_kwarg else self.inner(*inputs)
        return _main_output(out)


def _main_output(out: object) -> torch.Tensor:
    """The tensor, the `.logits` of a ModelOutput, or the first tensor of a tuple/dict."""
    if isinstance(getattr(out, "logits", None), torch.Tensor):
        return out.logits
    values = list(out.values()) if isinstance(out, Mapping) else out
    for v in values if isinstance(values, (tuple, list)) else [out]:
        if isinstance(v, torch.Tensor):
            return v
    raise CaptureError(f"model output of type {type(out).__name__} has no tensor to capture "
                       "(expected a tensor, a ModelOutput with .logits, or a tuple of tensors)")


def capture(model: nn.Module, example_inputs: tuple[torch.Tensor, ...], *,
            model_name: str = "model", layer_prefix: str | None = None,
            total_layers: int | None = None) -> CapturedGraph:
    """Capture `model(*example_inputs)` as an aten FX graph with per-node facts.

    Args:
        model: any nn.Module; on the meta device to capture without allocating (recommended).
        example_inputs: positional tensor inputs with their global shapes (e.g. input_ids
            (batch, seq) int64); moved to meta when the model is on meta.
        model_name: name for reports and error messages.
        layer_prefix: FQN of the ModuleList/ModuleDict of repeated blocks (default: detected,
            the container with most children of one class); "" for no layers.
        total_layers: depth of the real model when `model` is a shallow copy (default: the
            number of blocks captured).

    Returns:
        CapturedGraph; `gm(*inputs)` returns one tensor. Parameters/buffers are meta attributes
        at canonical FQNs; use `materialize` to load real weights.

    Raises:
        CaptureError: the model does not trace (message: module FQN, source line, cause).
        ValueError: bad inputs or a `layer_prefix` that names no module container.
    """
    inputs = _check_inputs(model, example_inputs)
    if total_layers is not None and total_layers < 1:
        raise ValueError(f"total_layers must be >= 1, got {total_layers}")
    ep = _export(model, inputs, model_name)
    gm = _clean_graph(ep.module(), model, _input_names(model, len(inputs)))
    retarget_device(gm, torch.device("meta"))

    prefix, num_layers = _find_layers(model, layer_prefix)
    module_names = {name for name, _ in model.named_modules()}
    nodes: dict[str, NodeInfo] = {}
    with flop_counter.FlopCounterMode(display=False) as counter:
        for node in gm.graph.nodes:
            if node.op == "call_function":
                nodes[node.name] = _node_info(node, counter, module_names, prefix, model_name)
    layer_nodes: dict[int, list[str]] = {k: [] for k in range(num_layers)}
    for info in nodes.values():
        if info.layer_id is not None:
            layer_nodes.setdefault(info.layer_id, []).append(info.name)
    _check_layers_align(nodes, layer_nodes, prefix, model_name)
    return CapturedGraph(
        gm=gm, nodes=nodes, params=_param_infos(model, prefix),
        input_names=tuple(n.name for n in gm.graph.find_nodes(op="placeholder")),
        input_shapes=tuple(tuple(t.shape) for t in inputs),
        input_dtypes=tuple(_dtype_name(t.dtype) for t in inputs),
        layer_prefix=prefix, num_layers=num_layers,
        layer_nodes={k: tuple(v) for k, v in sorted(layer_nodes.items())},
        model_name=model_name, total_layers=total_layers or num_layers)


def capture_preset(name: str, *, batch: int, seq_len: int, num_layers: int | None = None,
                   dtype: torch.dtype | None = None) -> CapturedGraph:
    """Build preset `name` on meta with at most `num_layers` blocks and capture it on
    (batch, seq_len) inputs; `total_layers` is the preset's real depth (see autoplan.models)."""
    from autoplan.models import build_model, example_inputs, model_depth

    model = build_model(name, device="meta", num_layers=num_layers, dtype=dtype)
    inputs = example_inputs(name, batch=batch, seq_len=seq_len, device="meta")
    return capture(model, inputs, model_name=name, total_layers=model_depth(name))


# --- inputs and errors -------------------------------------------------------------------------

def _check_inputs(model: nn.Module, example_inputs: tuple) -> tuple[torch.Tensor, ...]:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)) or not all(
            isinstance(t, torch.Tensor) for t in example_inputs):
        raise ValueError("capture: example_inputs must be a tuple of tensors, got "
                         f"{type(example_inputs).__name__}")
    on_meta = any(t.is_meta for t in model.parameters()) or any(
        t.is_meta for t in model.buffers())
    return tuple(t.to("meta") if on_meta else t for t in example_inputs)


def _export(model: nn.Module, inputs: tuple[torch.Tensor, ...],
            model_name: str) -> torch.export.ExportedProgram:
    """torch.export (non-strict) of the model behind `_Root`; failures become CaptureError.

    On failure export prints the partial graph to stderr; it goes to `CaptureError.partial_graph`
    instead (on success anything printed is passed through)."""
    use_cache = "use_cache" in inspect.signature(model.forward).parameters
    printed = io.StringIO()
    with _running_modules(model) as running:
        try:
            with contextlib.redirect_stderr(printed):
                ep = torch.export.export(_Root(model, use_cache), inputs, strict=False)
        except CaptureError:
            raise
        except Exception as e:  # noqa: BLE001 - every trace failure becomes a CaptureError
            fqn = running[-1] if running else None
            error = _capture_error(e, model, fqn, model_name)
            error.partial_graph = printed.getvalue()
            raise error from e
    sys.stderr.write(printed.getvalue())
    return ep


def _input_names(model: nn.Module, n: int) -> list[str]:
    """Placeholder names: the model's positional forward arguments (`input_ids`, `idx`, ...)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in inspect.signature(model.forward).parameters.values()
             if p.kind in kinds]
    return [names[i] if i < len(names) else f"input_{i}" for i in range(n)]


@contextlib.contextmanager
def _running_modules(model: nn.Module) -> Iterator[list[str]]:
    """Yield the stack of FQNs of the submodules running now, kept by forward hooks, so that a
    trace failure can name its module (traceback frames cannot: export clears their locals).
    The hooks do Python bookkeeping only and leave the traced graph unchanged."""
    stack: list[str] = []

    def pop(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            while stack and stack.pop() != name:  # not called when forward raises, so the
                pass                              # failing module stays on top
        return hook

    handles = []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
        handles.append(mod.register_forward_hook(pop(name)))
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


_TORCH_DIR = str(Path(torch.__file__).parent)


def _capture_error(err: BaseException, model: nn.Module, module_fqn: str | None,
                   model_name: str) -> CaptureError:
    """A CaptureError naming the module that was running, the innermost source line outside
    torch, and the original error's first line."""
    chain, e = [], err
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    site = None
    for exc in chain:
        for frame, lineno in traceback.walk_tb(exc.__traceback__):
            filename = frame.f_code.co_filename
            if not filename.startswith(_TORCH_DIR) and filename != __file__:
                site = (filename, lineno)
        if site:
            break
    cause = chain[-1]
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()] or [""]
    if module_fqn is None:
        where = f"before entering {type(model).__name__}"
    else:
        cls = type(model.get_submodule(module_fqn)).__name__
        where = f"in module {module_fqn or '<root>'} ({cls})"
    if site:
        src = linecache.getline(site[0], site[1]).strip()
        where += f" at `{src}` ({site[0]}:{site[1]})" if src else f" at {site[0]}:{site[1]}"
    hint = ""
    if "data-dependent" in str(cause) or "data dependent" in str(cause):
        hint = (" -- Python control flow or a shape depends on tensor values; use torch.cond / "
                "torch.where, or move the decision out of forward")
    return CaptureError(f"cannot capture {model_name!r}: {where}: "
                        f"{type(cause).__name__}: {lines[0]}{hint}")


# --- graph cleaning ----------------------------------------------------------------------------

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
    """Rebuild the unlifted export graph: placeholders, canonical get_attrs, ops, one output."""
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
            assert len(flat) == 1, f"wrapper returns one tensor, export gave {len(flat)}"
            graph.output(env[flat[0]])
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


def _layer_of(path: str, prefix: str) -> int | None:
    if not prefix or not path.startswith(prefix + "."):
        return None
    key = path[len(prefix) + 1:].split(".", 1)[0]
    return int(key) if key.isdigit() else None


def _node_info(node: torch.fx.Node, counter: flop_counter.FlopCounterMode,
               module_names: set[str], prefix: str, model_name: str) -> NodeInfo:
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
        module_path=path, layer_id=_layer_of(path, prefix))


# --- repeated blocks and parameters ------------------------------------------------------------

def _find_layers(model: nn.Module, layer_prefix: str | None) -> tuple[str, int]:
    """(FQN of the container of repeated blocks, number of blocks); ("", 0) when none."""
    containers = {
        name: mod for name, mod in model.named_modules()
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and len(mod) > 0
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


def _param_infos(model: nn.Module, prefix: str) -> dict[str, ParamInfo]:
    canonical, to_canonical = _canonical_tensors(model)
    params = {id(p) for p in model.parameters()}
    aliases: dict[str, list[str]] = {fqn: [] for fqn in canonical}
    for fqn, first in to_canonical.items():
        if fqn != first:
            aliases[first].append(fqn)
    return {
        fqn: ParamInfo(fqn=fqn, shape=tuple(t.shape), dtype=_dtype_name(t.dtype),
                       numel=t.numel(), is_buffer=id(t) not in params,
                       layer_id=_layer_of(fqn.rpartition(".")[0], prefix),
                       aliases=tuple(aliases[fqn]))
        for fqn, t in canonical.items()}
