"""Where the samples are in a captured graph: the dim of each value that holds them, and the ops
that read across them ([Note: sample dims]). Read by the keying of random ops
(autoplan/passes/rng.py: a draw is keyed by its sample where it has one) and by the audit of the
ops whose numbers depend on how the batch is cut (autoplan/batch_coupling.py).

[Note: sample dims] A graph input's samples are its batch dim ([Note: batch dims] in
autoplan/inputs.py). They are followed through each op by DTensor's sharding rules, as
`batch_dims` (strategies/nodes.py) follows them: the samples Shard(d) on a 2-way mesh, every other
tensor Replicate. Two differences, because the question here is whether an op keeps each sample
to itself, not which placements the tp axis may take:
- Where DTensor would move only Replicate arguments (a local slice of a tensor with no samples:
  ViT's class token concatenated to the patches), the op still keeps every sample to itself, and
  the Shard of its output is its output's sample dim (`batch_dims` ends the trail there).
- An op *reads across samples* where it gives a Partial output (a sum, mean or norm over them),
  where it combines values along a dim (`_ALONG`: a matmul over the samples, a sort, a softmax
  or a cumulative sum along them) and DTensor would move its samples to Replicate, and wherever
  it is batch_norm in training mode (`BATCH_NORMS`), whatever DTensor's rule for it says.
  Through a composite op the same is asked of each piece of its decomposition ([Note: composite
  ops] in autoplan/_torch_compat/sharding_rules.py).
An op without a rule, one whose rule moves the samples to another dim, or one of another kind
whose rule gathers them (an index by a constant `arange` over the samples, as HF's padding
masks are built: per sample, but a meta tensor does not say so) ends the trail: its output has
no sample dim, and it is not said to read across samples (`unknown` lists it).
Scaled dot-product attention keeps the samples of q on dim 0 (its rule in strategies/probe.py);
the experts op keeps its tokens' ([Note: experts op]).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx
import torch.utils._pytree as pytree

from autoplan import _torch_compat as tc
from autoplan.experts import EXPERTS_OP
from autoplan.strategies.nodes import _SDPA, tensor_args, value_specs

__all__ = ["SampleFacts", "sample_facts", "BATCH_NORMS", "batch_norm_training"]

aten = torch.ops.aten

BATCH_NORMS = frozenset({
    aten.batch_norm.default, aten.native_batch_norm.default,
    aten._native_batch_norm_legit.default, aten._native_batch_norm_legit.no_stats,
    aten._native_batch_norm_legit_functional.default, aten._batch_norm_with_update.default,
    aten._batch_norm_with_update_functional.default, aten._batch_norm_impl_index.default,
    aten.cudnn_batch_norm.default, aten.miopen_batch_norm.default})
"""batch_norm and the aten ops it lowers to: in training mode each normalises every sample by
the mean and variance of the whole batch (and updates the running statistics, where given)."""



def batch_norm_training(node: torch.fx.Node) -> bool:
    """Whether `node` is one of BATCH_NORMS in training mode (its `training` argument True, or
    an op that always is: `_batch_norm_with_update`). A `training` that is not a constant
    counts as True."""
    if node.op != "call_function" or node.target not in BATCH_NORMS:
        return False
    names = [a.name for a in node.target._schema.arguments]
    if "training" not in names:
        return True
    i = names.index("training")
    value = node.args[i] if i < len(node.args) else node.kwargs.get("training", True)
    return value is not False


@dataclasses.dataclass
class SampleFacts:
    """What `sample_facts` found ([Note: sample dims]).

    Attributes:
        dims: node name -> the sample dim of each of its outputs (None: no samples there).
        mixing: node name -> how the op reads across samples ("sums over the samples",
            "reads every sample (DTensor moves S(0) to R)", "batch statistics").
        unknown: names of ops with a sample-carrying input whose output DTensor cannot tell
            (no rule, or the samples moved to another dim).
        from_inputs: names of the nodes whose value depends on a graph input.
    """

    dims: dict[str, tuple[int | None, ...]]
    mixing: dict[str, str]
    unknown: set[str]
    from_inputs: set[str]

    def dim(self, node: torch.fx.Node) -> int | None:
        """The sample dim of `node`'s (first) output, or None."""
        return (self.dims.get(node.name) or (None,))[0]


def _val(gm: torch.fx.GraphModule, node: torch.fx.Node):
    val = node.meta.get("val")
    if val is None and node.op == "get_attr":
        val = gm
        for part in str(node.target).split("."):
            val = getattr(val, part, None)
    return val


def _input_dim(shape: tuple, batch_size: int) -> int | None:
    """[Note: batch dims]: dim 0 when it has `batch_size` entries, else the one dim that has."""
    if shape and shape[0] == batch_size:
        return 0
    dims = [d for d, n in enumerate(shape) if n == batch_size]
    return dims[0] if len(dims) == 1 else None


def sample_facts(gm: torch.fx.GraphModule, batch_size: int | None = None, *,
                 input_dims: dict[str, int | None] | None = None,
                 cache: dict | None = None) -> SampleFacts:
    """The sample dim of every value of `gm` and the ops that read across samples
    ([Note: sample dims]).

    Args:
        gm: a captured graph (node.meta["val"] holds each value's global shape).
        batch_size: samples of the capture (default: dim 0 of the first placeholder); at
            1, DTensor's rules cannot follow the size-1 dim: only `from_inputs` is found.
        input_dims: placeholder name -> its batch dim, where known (default: dim 0 when it has
            batch_size entries, else the one dim that has).
        cache: a dict shared between calls (the decompositions of composite ops).
    """
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if batch_size is None:
        first = next((value_specs(_val(gm, n))[0] for n in placeholders), None)
        batch_size = first[0][0] if first and first[0] else 1
    facts = SampleFacts({}, {}, set(), set())
    mesh, cache = tc.tp_mesh(2), cache if cache is not None else {}
    given = dict(input_dims or {})
    follow = batch_size > 1  # DTensor's rules lose the Shard of a size-1 dim: from_inputs only
    for node in nodes:
        metas = value_specs(_val(gm, node))
        none = tuple(None for _ in metas)
        args = tensor_args(node)
        if node.op == "placeholder":
            facts.from_inputs.add(node.name)
            shape = metas[0][0] if metas[0] else ()
            facts.dims[node.name] = (given.get(node.name, _input_dim(shape, batch_size)),)
            continue
        if node.op != "call_function":
            facts.dims[node.name] = none
            continue
        if any(a.name in facts.from_inputs for a in args):
            facts.from_inputs.add(node.name)
        dims = [facts.dims.get(a.name, (None,))[0] if follow else None for a in args]
        if node.target is operator.getitem:
            facts.dims[node.name] = (facts.dims[node.args[0].name][node.args[1]],)
        elif all(d is None for d in dims):
            facts.dims[node.name] = none
        elif batch_norm_training(node) and dims[0] is not None:
            facts.mixing[node.name] = "batch statistics"
            facts.dims[node.name] = (dims[0],) + none[1:]
        elif node.target is _SDPA or node.target is EXPERTS_OP:
            facts.dims[node.name] = (dims[0] if node.target is EXPERTS_OP or dims[0] == 0
                                     else None,)
        else:
            facts.dims[node.name] = _through(gm, node, args, dims, metas, facts, mesh, cache)
    return facts


def _through(gm, node, args, dims, metas, facts: SampleFacts, mesh, cache) -> tuple:
    """The sample dims of `node`'s outputs ([Note: sample dims]), recording in `facts` an op
    that reads across samples or that DTensor cannot tell."""
    none = tuple(None for _ in metas)
    specs = [value_specs(_val(gm, a))[0] for a in args]
    if any(s is None for s in specs):
        facts.unknown.add(node.name)
        return none
    placements = [tc.Shard(d) if d is not None else tc.Replicate() for d in dims]
    try:
        outs, why = _propagate(node, specs, placements, mesh, cache)
        if why is not None and why != "sums over the samples":
            # a tensor without samples shaped like one with them (the buffer an in-place
            # copy_ fills, DeepSeek-V3's key states): each rank's graph holds its own slice
            alike = _alike(specs, dims)
            if alike != placements:
                retried = _propagate(node, specs, alike, mesh, cache)
                if retried[1] is None:
                    outs, why = retried
    except Exception:  # noqa: BLE001 - no rule, or DTensor refuses: the trail ends here
        facts.unknown.add(node.name)
        return none
    if why is None and any(isinstance(p, tc.Partial) for p in outs if p is not None):
        why = "sums over the samples"
    if why == "unknown":
        facts.unknown.add(node.name)
        return none
    if why is not None:
        facts.mixing[node.name] = why
        return none
    out = tuple(p.dim if isinstance(p, tc.Shard) else None for p in outs)
    _written(node, out[0], facts)
    return out


def _alike(specs: list, dims: list) -> list:
    """The placements with every tensor without samples that has the rank and the size of
    the first sample-carrying one at its sample dim given that dim's Shard as well."""
    i = next(i for i, d in enumerate(dims) if d is not None)
    shape, d = specs[i][0], dims[i]
    return [tc.Shard(d) if dims[j] is None and len(specs[j][0]) == len(shape)
            and specs[j][0][d] == shape[d] else
            (tc.Shard(dims[j]) if dims[j] is not None else tc.Replicate())
            for j in range(len(specs))]


_VIEWS = frozenset({aten.slice.Tensor, aten.alias.default, aten.narrow.default})


def _written(node: torch.fx.Node, dim: int | None, facts: SampleFacts) -> None:
    """An in-place op that writes samples into a tensor without them (`buf[:, :d].copy_(x)`):
    the tensor and the views it is a slice of hold the samples from here on."""
    schema = getattr(node.target, "_schema", None)
    if dim is None or schema is None or not schema.arguments or \
            schema.arguments[0].alias_info is None or not schema.arguments[0].alias_info.is_write:
        return
    base = node.args[0] if node.args else None
    while isinstance(base, torch.fx.Node) and facts.dims.get(base.name, (None,))[0] is None:
        facts.dims[base.name] = (dim,) + facts.dims.get(base.name, (None,))[1:]
        base = base.args[0] if base.op == "call_function" and base.target in _VIEWS else None


# Ops that combine the values along a dim: where DTensor gathers their samples to Replicate,
# they read every sample. Any other op it gathers them for (an index with a constant
# arange over the samples, HF's padding mask; a view) ends the trail instead.
_ALONG = frozenset({
    "mm", "bmm", "matmul", "addmm", "baddbmm", "dot", "mv", "einsum", "sort", "argsort",
    "topk", "kthvalue", "median", "mode", "cumsum", "cumprod", "cummax", "cummin",
    "logcumsumexp", "softmax", "_softmax", "log_softmax", "_log_softmax", "max", "min",
    "amax", "amin", "argmax", "argmin", "aminmax", "var", "std", "var_mean", "std_mean",
    "norm", "linalg_vector_norm", "logsumexp", "prod", "all", "any", "sum", "mean", "flip",
    "roll", "diff", "nll_loss_forward", "nll_loss2d_forward", "cross_entropy_loss"})


def _step(op, args, kwargs, placements, mesh):
    """(output placements, None | "unknown" | how the op reads across samples) of one aten
    call under DTensor's rule, the samples' Shard kept and Replicate arguments allowed to move
    ([Note: sample dims])."""
    prop = tc.propagate(op, args, kwargs, mesh)
    if prop.moves_inputs:
        for given, wanted in zip(placements, prop.inputs):
            if isinstance(given, tc.Shard) and given != wanted:
                if isinstance(wanted, tc.Replicate) and op.__name__.split(".")[0] in _ALONG:
                    return prop.outputs, f"reads every sample (DTensor moves {given} to R)"
                return prop.outputs, "unknown"
    return prop.outputs, None


def _propagate(node, specs, placements, mesh, cache):
    """`_step` for `node`, through its decomposition when it is composite."""
    op = node.target
    composite = not (tc.has_direct_rule(op) or not tc.is_composite(op))
    it = iter(range(len(specs)))

    def to_arg(_n):
        i = next(it)
        stride = None
        if composite:
            v = _n.meta.get("val")
            if isinstance(v, torch.Tensor) and v.layout == torch.strided and \
                    not v.is_contiguous():
                stride = tuple(v.stride())
        return tc.TensorArg(specs[i][0], specs[i][1], placements[i], stride)

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), to_arg)
    if not composite:
        return _step(op, tuple(args), dict(kwargs), placements, mesh)
    key = ("samples-trace", str(op), tuple(specs), repr(torch.fx.node.map_arg(
        (node.args, node.kwargs), lambda n: (n.meta.get("val").stride()
                                             if isinstance(n.meta.get("val"), torch.Tensor)
                                             else "<T>"))))
    trace = cache.get(key)
    if trace is None:
        trace = cache[key] = tc.decompose(op, tuple(args), dict(kwargs))
    return _through_trace(trace, placements, mesh)


def _through_trace(trace, placements, mesh):
    """`_step` chained through the pieces of a composite op's `trace` (tc.Trace)."""
    env: dict = {("in", i): p for i, p in enumerate(placements)}
    is_ref = lambda a: isinstance(a, tuple) and len(a) in (2, 3) and a[0] in ("in", "t")  # noqa
    for func, a_ref, kw_ref, out_refs in trace.steps:
        given = []

        def to_arg(a):
            if is_ref(a):
                shape, dtype = trace.metas[a]
                given.append(env[a])
                return tc.TensorArg(shape, dtype, env[a])
            if isinstance(a, tc.TensorArg):  # a tensor made inside the decomposition
                given.append(a.placement)
            return a

        a = pytree.tree_map(to_arg, a_ref, is_leaf=is_ref)
        kw = pytree.tree_map(to_arg, kw_ref, is_leaf=is_ref)
        outs, why = _step(func, a, kw, given, mesh)
        if why is not None:
            return outs, why
        if any(isinstance(p, tc.Partial) for p in outs if p is not None):
            return outs, "sums over the samples"
        for ref, p in zip(out_refs, outs):
            env[ref] = p
    return tuple(env.get(r) if is_ref(r) else None for r in trace.outputs), None
