"""The candidates of one node ([Note: node kinds] and Enumeration in the package docstring):
`_Context` probes DTensor's rules with combinations of argument placements, keeps those DTensor
runs without redistributing, and re-checks a divisor tp's candidates by size ([Note: divisor
tp]).
"""

from __future__ import annotations

import itertools
import logging
import math
import operator

import torch
import torch.fx

from autoplan import _torch_compat as tc
from autoplan.experts import EXPERTS_OP
from autoplan.graph import CapturedGraph
from autoplan.plan import format_placement, parse_placement
from autoplan.strategies.candidate import Candidate, StrategyCache
from autoplan.strategies.experts_candidates import experts_candidates
from autoplan.strategies.nodes import (_SDPA, _arg_specs, _propagate_node, _static_repr,
                                       arg_strides, batch_dims, constant_like_nodes, ignored_nodes,
                                       node_tensor_meta, tensor_args, vocab_nodes)

# The package's logger: messages name the package, whichever of its files logs them.
log = logging.getLogger("autoplan.strategies")
aten = torch.ops.aten
_MAX_PARTIAL_INPUTS = 2
# Enumerate the full product of argument placements up to this many combinations; above it,
# the probes of `_seeds` (DTensor's suggestions fill in for ops with a direct rule).
_FULL_PRODUCT_DIRECT = 1
_FULL_PRODUCT_COMPOSITE = 64


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
        key = ("vocab_nodes", graph.gm)
        if key not in cache:
            cache[key] = vocab_nodes(graph)
        self.vocab, self.vocab_nodes = graph.vocab_size, cache[key]

    def candidates(self, node: torch.fx.Node, known: dict) -> list[Candidate]:
        metas = node_tensor_meta(self.graph, node)
        all_r = Candidate(("R",) * len(tensor_args(node)), ("R",) * len(metas), 1.0)
        if node.op == "placeholder" or node.name in self.consts or self.tp == 1:
            return [all_r]
        if node.op == "get_attr":
            shape = metas[0][0]
            return [all_r] + [Candidate((), (f"S({d})",), float(self.tp))
                              for d in range(len(shape)) if self._splittable(shape[d], node)]
        if node.target is operator.getitem:
            idx = node.args[1]
            seen = dict.fromkeys(c.outputs[idx] for c in known[node.args[0].name])
            return [Candidate((p,), (p,), 1.0) for p in seen]
        if node.target is _SDPA:
            return self._sdpa(node)
        if node.target is EXPERTS_OP:
            return experts_candidates(node, [s for s, _ in _arg_specs(self.graph, node)], self.tp)
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

    def _splittable(self, size: int, node: torch.fx.Node) -> bool:
        # [Note: uneven vocabulary]
        # A dim splits over tp ranks when tp divides it -- and the vocabulary (the last dim
        # of the main output, `CapturedGraph.vocab_size`) whatever its size. Megatron pads
        # the vocabulary to a multiple of tp (--make-vocab-size-divisible-by); here the
        # split is torch.chunk's, ceil(V / tp) rows on the first ranks and the rest on the
        # last (11 over 2: 6 and 5), which DTensor's rules and collectives take as they are
        # and the vocabulary-parallel cross-entropy reads by each rank's first row
        # (runtime/rank_stages.py `_vocab_parallel_loss`): no padded rows, so nothing is
        # added to the softmax's denominator, and a pin or a memory cap can split a
        # vocabulary of 50,257 at tp 8. Only that dim, and only on the nodes that carry it
        # (`vocab_nodes`: from the main output back while a dim of V lasts, so a width that
        # happens to equal V is not split unevenly): another uneven split would meet views
        # whose rules need an even one. The cost model prices V / tp rows per rank; the
        # largest shard has ceil(V / tp).
        return size >= self.tp and (size % self.tp == 0 or (
            size == self.vocab and node.name in self.vocab_nodes))

    def _arg_options(self, node) -> list[list]:
        """Allowed placements of each tensor argument (R first)."""
        options = []
        written = _writes_first(node)
        for i, (a, (shape, dtype)) in enumerate(zip(tensor_args(node),
                                                    _arg_specs(self.graph, node))):
            if i == 0 and written and a.name in self.consts:
                # an in-place write into a buffer (`buf.add_(x.mean(0))`): the buffer is
                # Replicate on every rank, and a redistributed copy would take the write
                options.append([tc.Replicate()])
                continue
            bdim = self._bdim_of(a)
            opts = [tc.Replicate()]
            if dtype.is_floating_point and _arg_kind(a, self.consts) == "data":
                opts.append(tc.Partial())
            opts += [tc.Shard(d) for d in range(len(shape))
                     if d != bdim and self._splittable(shape[d], a)]
            options.append(opts)
        return options

    def _bdim_of(self, arg: torch.fx.Node):
        dims = self.bdims.get(arg.name, (None,))
        return dims[0] if dims else None

    def _key(self, node) -> tuple:
        specs = _arg_specs(self.graph, node)
        arg_keys = tuple((s, str(d), self._bdim_of(a), _arg_kind(a, self.consts))
                         for a, (s, d) in zip(tensor_args(node), specs))
        # tp last: `candidates` looks up the base tp's entry by replacing it
        return (str(node.target), arg_keys, _static_repr(node), self.bdims.get(node.name),
                arg_strides(node) if tc.is_composite(node.target) else (),
                node.name in self.vocab_nodes, self.tp)

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
                if p.dim == bdim or not self._splittable(size, node):
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
        q_node = tensor_args(node)[0]
        for dim, ok in ((1, self._splittable(q[1], q_node) and self._splittable(k[1], q_node)),
                        (0, self._splittable(q[0], q_node) and self._bdim_of(q_node) != 0)):
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


def _writes_first(node: torch.fx.Node) -> bool:
    """Whether `node`'s op writes its first argument in place (add_, copy_)."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.arguments
                and schema.arguments[0].alias_info is not None
                and schema.arguments[0].alias_info.is_write)
