"""Graph helpers of the candidate rules: the tensor arguments of a node ([Note: argument
order]), output shapes, constant-like and ignored nodes, batch dims, and DTensor's sharding
propagation for one node (through the decomposition for a composite op).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from autoplan import _torch_compat as tc
from autoplan.experts import EXPERTS_OP
from autoplan.graph import CapturedGraph

_SDPA = torch.ops.aten.scaled_dot_product_attention.default  # probe.py, samples.py use it too


def tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The fx Nodes among `node`'s args and kwargs, in [Note: argument order]."""
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n) or n)
    return found


def _fetch_attr(gm: torch.fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def node_tensor_meta(graph: CapturedGraph, node: torch.fx.Node) -> list[tuple | None]:
    """(shape, dtype) of each output of `node` (None for a non-tensor output).

    Reads `node.meta["val"]` (set by torch.export) and falls back to the attribute for
    get_attr nodes and to `graph.input_shapes` for placeholders.
    """
    val = node.meta.get("val")
    if val is None and node.op == "get_attr":
        val = _fetch_attr(graph.gm, node.target)
    if val is None and node.op == "placeholder" and node.name in graph.input_names:
        i = graph.input_names.index(node.name)
        return [(tuple(graph.input_shapes[i]), getattr(torch, graph.input_dtypes[i]))]
    return value_specs(val)


def value_specs(val) -> list[tuple | None]:
    """The (shape, dtype) of each output of a node's value (None where not a tensor)."""
    if isinstance(val, torch.Tensor):
        return [(tuple(int(s) for s in val.shape), val.dtype)]
    if isinstance(val, (tuple, list)):
        return [(tuple(int(s) for s in v.shape), v.dtype) if isinstance(v, torch.Tensor)
                else None for v in val]
    return [None]


def constant_like_nodes(graph: CapturedGraph) -> set[str]:
    """Names of nodes that depend on no parameter and no graph input (buffers count as
    constants). They run as plain tensors and get the single candidate R."""
    trained = {name for fqn, info in graph.params.items() if not info.is_buffer
               for name in (fqn, *info.aliases)}
    const: set[str] = set()
    for node in graph.gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) not in trained:
            const.add(node.name)
        elif node.op == "call_function" and all(a.name in const for a in tensor_args(node)):
            const.add(node.name)
    return const


def ignored_nodes(graph: CapturedGraph) -> set[str]:
    """call_function nodes with no tensor output and no users (`_assert_tensor_metadata`):
    they get no candidates and no cost; the runtime runs them on whatever it has or drops them."""
    out = set()
    for node in graph.gm.graph.nodes:
        if node.op == "call_function" and not node.users and node.target is not operator.getitem:
            if all(m is None for m in node_tensor_meta(graph, node)):
                out.add(node.name)
    return out


def batch_dims(graph: CapturedGraph, *, cache: dict | None = None) -> dict[str, tuple]:
    """Batch-carrying dim of each output of each node (None where there is none).

    Found by running DTensor's rules on a 2-way mesh with the graph inputs Shard(0) and all
    parameters and constants Replicate (pure data parallelism): where the batch split lands is
    the batch dim. Names map to one entry per output.
    """
    mesh = tc.tp_mesh(2)
    consts = constant_like_nodes(graph)
    out: dict[str, tuple] = {}
    for node in graph.gm.graph.nodes:
        metas = node_tensor_meta(graph, node)
        if node.op == "placeholder":
            out[node.name] = tuple(0 if m and len(m[0]) >= 1 else None for m in metas)
        elif node.op != "call_function" or node.name in consts:
            out[node.name] = tuple(None for _ in metas)
        elif node.target is operator.getitem:
            out[node.name] = (out[node.args[0].name][node.args[1]],)
        else:
            out[node.name] = _batch_dims_of_op(graph, node, out, mesh, cache)
    return out


def vocab_nodes(graph: CapturedGraph) -> frozenset[str]:
    """The nodes that carry the vocabulary ([Note: uneven vocabulary] in probe.py): from the
    main output back through every node with a dim of `graph.vocab_size` -- the logits, their
    views, the head's matmul, the transposed weight and the weight's get_attr. Empty when the
    main output has fewer than 2 dims."""
    vocab = graph.vocab_size
    if vocab is None:
        return frozenset()
    out = next(n for n in graph.gm.graph.nodes if n.op == "output")
    flat = tensor_args(out)
    seen: set[str] = set()
    pending = [flat[graph.main_output_index]]
    while pending:
        node = pending.pop()
        val = node.meta.get("val")
        if node.name in seen or not isinstance(val, torch.Tensor) or vocab not in val.shape:
            continue
        seen.add(node.name)
        pending += tensor_args(node)
    return frozenset(seen)


def _batch_dims_of_op(graph, node, known, mesh, cache) -> tuple:
    dims = [known.get(a.name, (None,))[0] for a in tensor_args(node)]
    none = tuple(None for _ in node_tensor_meta(graph, node))
    if all(d is None for d in dims):
        return none
    if node.target is EXPERTS_OP:  # (T, H) tokens in, (T, H) out ([Note: experts op])
        return (dims[0],)
    if node.target is _SDPA:  # (B, H, S, D): the query's batch is the output's (the explicit
        return (0 if dims[0] == 0 else None,)  # rule, probe.py `_sdpa`; as samples.py)
    placements = [tc.Shard(d) if d is not None else tc.Replicate() for d in dims]
    try:
        prop = _propagate_node(graph, node, placements, mesh, cache)
    except Exception:  # no rule, or DTensor refuses: the batch split ends here
        return none
    # [Note: batch through broadcast operands] A Replicate argument that DTensor slices to a
    # Shard (a causal mask expanded over the batch, a position table) keeps the batch split
    # going: data parallelism slices it per rank without moving anything, as samples.py's
    # `_step` allows. Only a batch-carrying argument DTensor moves ends the split. (Ending it
    # at every such op lost the batch dim at each model's first attention -- its mask is
    # Replicate -- and the tp axis was then offered Shard(batch) for the rest of the model:
    # at microbatch 1 one rank held the whole tensor, priced as a tp-th.)
    if prop.moves_inputs and any(
            given != wanted and not (isinstance(given, tc.Replicate) and
                                     isinstance(wanted, tc.Shard))
            for given, wanted in zip(placements, prop.inputs)):
        return none
    return tuple(p.dim if isinstance(p, tc.Shard) else None for p in prop.outputs)


def _arg_specs(graph, node) -> list[tuple]:
    """(shape, dtype) of each tensor argument (a getitem node carries its element's)."""
    return [node_tensor_meta(graph, a)[0] for a in tensor_args(node)]


def arg_strides(node: torch.fx.Node) -> tuple:
    """The strides of each tensor argument of `node` where it is not contiguous (None where
    it is, or where the captured value is not known): a composite op's decomposition can
    depend on them ([Note: composite ops] in autoplan/_torch_compat/sharding_rules.py)."""
    out = []
    for a in tensor_args(node):
        v = a.meta.get("val")
        out.append(tuple(v.stride()) if isinstance(v, torch.Tensor) and v.layout == torch.strided
                   and not v.is_contiguous() else None)
    return tuple(out)


def _propagate_node(graph, node, placements, mesh, cache=None) -> tc.Propagation:
    specs = _arg_specs(graph, node)
    op = node.target
    composite = not (tc.has_direct_rule(op) or not tc.is_composite(op))
    strides = arg_strides(node) if composite else (None,) * len(specs)
    it = iter(range(len(specs)))

    def to_arg(_n):
        i = next(it)
        return tc.TensorArg(specs[i][0], specs[i][1], placements[i], strides[i])

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), to_arg)
    if not composite:
        return tc.propagate(op, tuple(args), dict(kwargs), mesh)
    # [Note: composite ops] in autoplan/_torch_compat/sharding_rules.py
    key = ("trace", str(op), tuple(specs), strides, _static_repr(node))
    trace = cache.get(key) if cache is not None else None
    if trace is None:
        trace = tc.decompose(op, tuple(args), dict(kwargs))
        if cache is not None:
            cache[key] = trace
    return tc.propagate_trace(trace, list(placements), mesh)


def _static_repr(node: torch.fx.Node) -> str:
    """The node's arguments with tensors blanked out: what, besides shapes, a rule reads."""
    return repr(torch.fx.node.map_arg((node.args, node.kwargs), lambda n: "<T>"))
