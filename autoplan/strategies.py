"""Candidate placements per graph node on the tensor-parallel (tp) mesh axis.

The candidates come from DTensor's own sharding rules (../shared/DESIGN.md, "Placements"): for
each node we offer DTensor input placements and keep those it runs *without any implicit
redistribution*, with the output placement DTensor itself produces. The runtime then
redistributes a node's i-th tensor argument to `Candidate.inputs[i]` whenever the producer's
output placement differs, and DTensor runs the op exactly as planned (the solver's costs are
the collectives the runtime inserts, no more, no fewer).

[Note: argument order] `Candidate.inputs[i]` is the placement of the i-th fx Node found by
`tensor_args(node)`: positional args then kwargs, each walked depth-first the way
`torch.fx.node.map_arg` walks them (lists/tuples in order, `None` skipped). For
`aten.cat([a, b], d)` that is (a, b); for `aten.index.Tensor(x, [None, i])` it is (x, i).

[Note: node kinds] Nodes fall into kinds, each with its own candidate rule:
- placeholder (graph input, token ids): only R.
- parameter (get_attr of a parameter): R, or S(d) for each dim d it can be split on; never P.
- constant-like (depends on no parameter and no graph input: position ids, causal masks,
  rotary tables, buffers): the single candidate R, shard_factor 1; they run as plain tensors.
- getitem of a multi-output op: passes the chosen element's placement through.
- aten op with a DTensor rule: every verified (inputs -> outputs) combination, see below.
- aten.scaled_dot_product_attention: explicit rule (DTensor has none for it): q, k, v all R,
  all S(0) (batch) or all S(1) (heads, only when both the query and the key/value head counts
  divide by tp, so no rank ever holds less than one KV head -- case C3); the mask follows.
- any other op (no DTensor rule): only all-R, with a logged note naming the op.
- no tensor output (`aten._assert_tensor_metadata`): "ignored" -- no candidates, the runtime
  runs it on whatever it gets (see `ignored_nodes`).

A dim is split only when its size divides by tp and is at least tp (case C10: never shard a
dim smaller than the mesh axis), and never on a batch-carrying dim: batch splitting is data
parallelism, which the dp mesh axis does; keeping it off the tp axis also keeps every candidate
valid for any microbatch size (batch dims are found by propagating Shard(0) from the inputs
through DTensor's rules, `batch_dims`).

Enumeration: an op with a direct DTensor rule is probed with the all-R combination, every
single-argument change from it and the "all arguments alike" combinations; whenever DTensor
would redistribute, its suggestion (a valid combination) is probed too. A composite op
(aten.linear, [Note: composite ops] in _torch_compat.py) gives no suggestion, so it is probed
with every combination up to 64 (else every one- and two-argument change). At most two Partial
inputs. A split that a view refuses, or a parameter split no consumer computes with, is then
pruned (`_prune`). For a tp with a divisor already planned, the divisor's candidates are
re-checked by size instead ([Note: divisor tp]). Results are cached by (op, argument
shapes/dtypes/allowed placements, static arguments, tp), so identical layers cost one layer.
Measured: a 2-layer llama3-8b graph for tp 2, 4, 8 in ~1 s cold, ~0.3 s with DTensor warm.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
from dataclasses import dataclass

import torch
import torch.fx

from autoplan import _torch_compat as tc
from autoplan.graph import CapturedGraph
from autoplan.plan import format_placement, parse_placement

__all__ = ["Candidate", "node_strategies", "tensor_args", "constant_like_nodes",
           "ignored_nodes", "batch_dims", "node_tensor_meta", "StrategyCache"]

log = logging.getLogger(__name__)
aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_MAX_PARTIAL_INPUTS = 2
# Enumerate the full product of argument placements up to this many combinations; above it,
# the probes of `_seeds` (DTensor's suggestions fill in for ops with a direct rule).
_FULL_PRODUCT_DIRECT = 1
_FULL_PRODUCT_COMPOSITE = 64


@dataclass(frozen=True)
class Candidate:
    """One way to run a node on the tp axis.

    Attributes:
        inputs: placement ("R", "P", "S(d)") of each tensor argument, [Note: argument order].
        outputs: placement of each tensor output (one entry for single-output ops).
        shard_factor: tp when the op's work is split across the tp ranks (an input or an
            output is sharded), else 1. Partial-only candidates do full-size work per rank.
    """

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    shard_factor: float


class StrategyCache(dict):
    """Cache of candidate lists keyed by node signature; pass one to `node_strategies` to
    share work between calls (e.g. several tp degrees of one planning run)."""


# --- graph helpers --------------------------------------------------------------------------

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


def _batch_dims_of_op(graph, node, known, mesh, cache) -> tuple:
    dims = [known.get(a.name, (None,))[0] for a in tensor_args(node)]
    none = tuple(None for _ in node_tensor_meta(graph, node))
    if all(d is None for d in dims):
        return none
    placements = [tc.Shard(d) if d is not None else tc.Replicate() for d in dims]
    try:
        prop = _propagate_node(graph, node, placements, mesh, cache)
    except Exception:  # no rule, or DTensor refuses: the batch split ends here
        return none
    if prop.moves_inputs:
        return none
    return tuple(p.dim if isinstance(p, tc.Shard) else None for p in prop.outputs)


def _arg_specs(graph, node) -> list[tuple]:
    """(shape, dtype) of each tensor argument (a getitem node carries its element's)."""
    return [node_tensor_meta(graph, a)[0] for a in tensor_args(node)]


def _propagate_node(graph, node, placements, mesh, cache=None) -> tc.Propagation:
    specs = _arg_specs(graph, node)
    it = iter(range(len(specs)))

    def to_arg(_n):
        i = next(it)
        return tc.TensorArg(specs[i][0], specs[i][1], placements[i])

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), to_arg)
    op = node.target
    if tc.has_direct_rule(op) or not tc.is_composite(op):
        return tc.propagate(op, tuple(args), dict(kwargs), mesh)
    # [Note: composite ops] in autoplan/_torch_compat.py
    key = ("trace", str(op), tuple(specs), _static_repr(node))
    trace = cache.get(key) if cache is not None else None
    if trace is None:
        trace = tc.decompose(op, tuple(args), dict(kwargs))
        if cache is not None:
            cache[key] = trace
    return tc.propagate_trace(trace, list(placements), mesh)


def _static_repr(node: torch.fx.Node) -> str:
    """The node's arguments with tensors blanked out: what, besides shapes, a rule reads."""
    return repr(torch.fx.node.map_arg((node.args, node.kwargs), lambda n: "<T>"))


# --- candidates ------------------------------------------------------------------------------

def node_strategies(graph: CapturedGraph, tp: int, *, cache: StrategyCache | None = None,
                    base_tp: int | None = None) -> dict[str, list[Candidate]]:
    """Candidate placements on a tp-way mesh axis for every node of `graph`.

    Args:
        graph: the captured graph (global shapes).
        tp: size of the tensor-parallel mesh axis (1 gives every node its all-R candidate).
        cache: optional `StrategyCache` shared between calls.
        base_tp: a divisor of tp (> 1) whose candidates are computed first (or taken from
            `cache`); the tp candidates are then only those of base_tp that DTensor still
            accepts at tp. Exact, because a split valid on tp ranks is valid on any divisor
            of tp (every size check is a divisibility check) -- and much cheaper than probing.

    Returns:
        node name -> candidates, for placeholders, get_attr and call_function nodes in graph
        order (`ignored_nodes` are left out). See [Note: node kinds]; the all-R candidate is
        always present, first.

    Raises:
        ValueError: tp < 1, or a call_module / call_method node with users (capture should
            have inlined it; the message names the node).
    """
    if tp < 1:
        raise ValueError(f"node_strategies: tp={tp} must be >= 1")
    cache = cache if cache is not None else StrategyCache()
    if base_tp is not None and not (1 < base_tp < tp and tp % base_tp == 0):
        raise ValueError(f"node_strategies: base_tp={base_tp} must be a divisor of tp={tp} "
                         "between 1 and tp")
    if base_tp is not None:
        node_strategies(graph, base_tp, cache=cache)
    ctx = _Context(graph, tp, cache, base_tp)
    out: dict[str, list[Candidate]] = {}
    for node in graph.gm.graph.nodes:
        if node.op == "output" or node.name in ctx.ignored:
            continue
        if node.op in ("call_module", "call_method"):
            if node.users:
                raise ValueError(f"node {node.name!r} is a {node.op} ({node.target}); the planner "
                                 "needs an aten graph (capture inlines modules)")
            continue
        out[node.name] = ctx.candidates(node, out)
    if tp > 1:
        _prune(graph, out)
    return out


_VIEW_LIKE = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                        aten.unflatten.int})


def _prune(graph: CapturedGraph, cands: dict[str, list[Candidate]]) -> None:
    """Drop splits that cut through a logical unit, to a fixpoint, in place.

    1. An output S(d) that a view/reshape consumer refuses (DTensor cannot split that dim evenly
       into the view's dims: the split would cut through a unit such as an attention head, e.g.
       2 KV heads of width 4 as a dim of 8 split 4 ways -- case C3) is not offered.
    2. A parameter is split on the tp axis only in a way some consumer computes with directly
       (storage-only sharding of parameters is ZeRO's business on the dp axis).
    The all-R candidate is never dropped.
    """
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    users = {name: [(u, i) for u in nodes[name].users if u.name in cands
                    for i, a in enumerate(tensor_args(u)) if a is nodes[name]]
             for name in cands}
    # A worklist: a node is checked again only when a consumer lost candidates (its producers
    # are what that can affect). Removal is monotone, so the fixpoint is the same as
    # re-checking every node until nothing changes; consumers first, so one pass mostly does.
    pending, queued = list(cands), set(cands)
    while pending:
        name = pending.pop()
        queued.discard(name)
        lst = cands[name]
        keep = [c for c in lst if _usable(nodes[name], c, users[name], cands)]
        if len(keep) < len(lst):
            cands[name] = keep
            for a in tensor_args(nodes[name]):
                if a.name in cands and a.name not in queued:
                    pending.append(a.name)
                    queued.add(a.name)


def _usable(node, cand: Candidate, users, cands) -> bool:
    if all(p == "R" for p in cand.outputs) or len(cand.outputs) != 1:
        return True
    out = cand.outputs[0]
    accepted = [any(c.inputs[i] == out for c in cands[u.name]) for u, i in users]
    if node.op == "get_attr":
        return any(accepted)
    if not out.startswith("S("):
        return True
    return all(ok for (u, _), ok in zip(users, accepted) if u.target in _VIEW_LIKE)


class _Context:
    """Per-call state of node_strategies (graph facts computed once)."""

    def __init__(self, graph: CapturedGraph, tp: int, cache: StrategyCache,
                 base_tp: int | None = None) -> None:
        self.graph, self.tp, self.cache, self.base_tp = graph, tp, cache, base_tp
        self.consts = constant_like_nodes(graph)
        self.ignored = ignored_nodes(graph) | {
            n.name for n in graph.gm.graph.nodes
            if n.op in ("call_module", "call_method") and not n.users}
        self.mesh = tc.tp_mesh(tp) if tp > 1 else None
        key = ("batch_dims", graph.gm)
        if key not in cache:
            cache[key] = batch_dims(graph, cache=cache)
        self.bdims = cache[key]

    def candidates(self, node: torch.fx.Node, known: dict) -> list[Candidate]:
        metas = node_tensor_meta(self.graph, node)
        all_r = Candidate(("R",) * len(tensor_args(node)), ("R",) * len(metas), 1.0)
        if node.op == "placeholder" or node.name in self.consts or self.tp == 1:
            return [all_r]
        if node.op == "get_attr":
            shape = metas[0][0]
            return [all_r] + [Candidate((), (f"S({d})",), float(self.tp))
                              for d in range(len(shape)) if self._splittable(shape[d])]
        if node.target is operator.getitem:
            idx = node.args[1]
            seen = dict.fromkeys(c.outputs[idx] for c in known[node.args[0].name])
            return [Candidate((p,), (p,), 1.0) for p in seen]
        if node.target is _SDPA:
            return self._sdpa(node)
        if not tc.is_aten_op(node.target):
            log.info("strategies: %s (%s) is not an aten op; only all-R", node.name, node.target)
            return [all_r]
        key = self._key(node)
        if key not in self.cache:
            base = self.cache.get(key[:-1] + (self.base_tp,)) if self.base_tp else None
            found = self._verify(node, base) if base is not None else self._probe(node)
            if all_r not in found:
                found.insert(0, all_r)
            self.cache[key] = found
        return self.cache[key]

    def _splittable(self, size: int) -> bool:
        return size >= self.tp and size % self.tp == 0

    def _arg_options(self, node) -> list[list]:
        """Allowed placements of each tensor argument (R first)."""
        options = []
        for a, (shape, dtype) in zip(tensor_args(node), _arg_specs(self.graph, node)):
            bdim = self._bdim_of(a)
            opts = [tc.Replicate()]
            if dtype.is_floating_point and _arg_kind(a, self.consts) == "data":
                opts.append(tc.Partial())
            opts += [tc.Shard(d) for d in range(len(shape))
                     if d != bdim and self._splittable(shape[d])]
            options.append(opts)
        return options

    def _bdim_of(self, arg: torch.fx.Node):
        dims = self.bdims.get(arg.name, (None,))
        return dims[0] if dims else None

    def _key(self, node) -> tuple:
        specs = _arg_specs(self.graph, node)
        arg_keys = tuple((s, str(d), self._bdim_of(a), _arg_kind(a, self.consts))
                         for a, (s, d) in zip(tensor_args(node), specs))
        return (str(node.target), arg_keys, _static_repr(node), self.bdims.get(node.name), self.tp)

    def _probe(self, node) -> list[Candidate]:
        """Verified candidates of an aten op, see the module docstring (Enumeration)."""
        options = self._arg_options(node)
        found: dict[tuple, Candidate] = {}
        tried: set[tuple] = set()
        answered = False
        # Composite ops give no suggestion to follow (see _torch_compat), so try more combos.
        composite = tc.is_composite(node.target) and not tc.has_direct_rule(node.target)
        limit = _FULL_PRODUCT_COMPOSITE if composite else _FULL_PRODUCT_DIRECT
        pending = [c for c in dict.fromkeys(_seeds(options, limit, pairs=composite))
                   if sum(isinstance(p, tc.Partial) for p in c) <= _MAX_PARTIAL_INPUTS]
        while pending:
            combo = pending.pop(0)
            if combo in tried:
                continue
            tried.add(combo)
            try:
                prop = _propagate_node(self.graph, node, list(combo), self.mesh, self.cache)
            except Exception:  # DTensor refuses this combination (or has no rule)
                continue
            answered = True
            if prop.moves_inputs:
                suggestion = tuple(prop.inputs)
                if _allowed(suggestion, options) and suggestion not in tried:
                    pending.append(suggestion)
                continue
            cand = self._make(node, combo, prop.outputs)
            if cand is not None:
                found.setdefault(cand.inputs, cand)
        if not answered:
            log.info("strategies: no DTensor sharding rule for %s (%s); only all-R",
                     node.target, node.name)
        return sorted(found.values(), key=lambda c: (any(p != "R" for p in c.inputs + c.outputs),
                                                     c.shard_factor, c.inputs))

    def _verify(self, node, base: list[Candidate]) -> list[Candidate]:
        """The candidates of a divisor of tp whose splits still divide at tp.

        [Note: divisor tp] DTensor's rules are structural: which dims a placement may take and
        where the output lands do not depend on the mesh size; the mesh size enters only
        through size checks (a sharded dim divides evenly and is at least the mesh size, the
        dims a view splits a sharded dim into divide). So a combination valid at tp is valid at
        every divisor of tp with the same output, and the tp candidates are exactly those base
        candidates whose sharded input and output dims pass the tp size checks (tested against
        direct probing in tests/test_strategies.py)."""
        options = self._arg_options(node)
        found: dict[tuple, Candidate] = {}
        for cand in base:
            combo = tuple(parse_placement(p) for p in cand.inputs)
            outs = tuple(parse_placement(p) for p in cand.outputs)
            if not _allowed(combo, options):
                continue
            made = self._make(node, combo, outs)
            if made is not None:
                found.setdefault(made.inputs, made)
        return list(found.values())

    def _make(self, node, inputs, outputs) -> Candidate | None:
        metas = node_tensor_meta(self.graph, node)
        bdims = self.bdims.get(node.name, ())
        if sum(isinstance(p, tc.Partial) for p in inputs) > _MAX_PARTIAL_INPUTS:
            return None
        for i, p in enumerate(outputs):
            if p is None:
                continue
            if type(p) not in (tc.Shard, tc.Replicate, tc.Partial):
                return None  # e.g. _StridedShard from a view merging a sharded dim
            if isinstance(p, tc.Partial) and p.reduce_op != "sum":
                return None  # "P" means a sum; avg/max partials have no plan spelling
            if isinstance(p, tc.Shard):
                size = metas[i][0][p.dim] if metas[i] is not None else 0
                bdim = bdims[i] if i < len(bdims) else None
                if p.dim == bdim or not self._splittable(size):
                    return None
        out = tuple(format_placement(p) if p is not None else "R" for p in outputs)
        ins = tuple(format_placement(p) for p in inputs)
        split = any(s.startswith("S(") for s in ins + out)
        return Candidate(ins, out, float(self.tp) if split else 1.0)

    def _sdpa(self, node) -> list[Candidate]:
        """Explicit rule for scaled_dot_product_attention: (B, H, S, D) q/k/v, see the
        module docstring; the optional attn_mask (4th tensor) follows the split."""
        specs = _arg_specs(self.graph, node)
        (q, _), (k, _) = specs[0], specs[1]
        mask = specs[3][0] if len(specs) > 3 else None
        cands = [Candidate(("R",) * len(specs), ("R",), 1.0)]
        for dim, ok in ((1, self._splittable(q[1]) and self._splittable(k[1])),
                        (0, self._splittable(q[0]) and self._bdim_of(tensor_args(node)[0]) != 0)):
            if not ok:
                continue
            s = f"S({dim})"
            ins = [s, s, s]
            if mask is not None:
                mdim = dim - (4 - len(mask))  # the mask broadcasts from the right
                ins.append(f"S({mdim})" if mdim >= 0 and mask[mdim] > 1 else "R")
            cands.append(Candidate(tuple(ins), (s,), float(self.tp)))
        return cands


def _arg_kind(arg: torch.fx.Node, consts: set[str]) -> str:
    """"fixed" (graph input or constant: R only, never Partial) or "data" (an activation or a
    parameter: a parameter may be taken as Partial, e.g. the bias of a row-parallel addmm,
    which DTensor adds to a partial sum)."""
    return "fixed" if arg.op == "placeholder" or arg.name in consts else "data"


def _seeds(options: list[list], full_limit: int, *, pairs: bool = False):
    """Every combination when there are at most `full_limit`; otherwise all-R, every
    single-argument change from all-R (and, with `pairs`, every two-argument change), and the
    all-alike combinations."""
    if math.prod(len(o) for o in options) <= full_limit:
        yield from itertools.product(*options)
        return
    base = tuple(o[0] for o in options)
    yield base
    for i, opts in enumerate(options):
        for p in opts[1:]:
            yield base[:i] + (p,) + base[i + 1:]
    if pairs:
        for i, j in itertools.combinations(range(len(options)), 2):
            for p, q in itertools.product(options[i][1:], options[j][1:]):
                combo = list(base)
                combo[i], combo[j] = p, q
                yield tuple(combo)
    for p in dict.fromkeys(p for opts in options for p in opts[1:]):  # ordered, unlike a set
        yield tuple(p if p in opts else opts[0] for opts in options)


def _allowed(combo: tuple, options: list[list]) -> bool:
    return len(combo) == len(options) and all(p in o for p, o in zip(combo, options))
