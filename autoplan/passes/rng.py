"""Layout-invariant random ops: dropout and attention dropout whose masks do not depend on the
parallel layout.

[Note: RNG contract]
Every random value is a function of (seed, step, k, b, position in the row) only -- never of
the dp/tp/pp degrees, the number of microbatches or the rank:
- k is the op's index among the random ops of the FULL captured graph in topological order
  (`random_op_indices`, before stage splitting), or the call order in eager mode
  (`keyed_random_ops`); both orders are program order.
- b is the global row: the index along dim 0 of the drawn tensor over the global batch (the
  op's input; the size of `torch.rand(size)`). Dim 0 holds R rows per sample, sample-major:
  R = 1 for a (B, ...) input, R = T for the (B*T, C) that `x.view(-1, C)` makes of a (B, T, C)
  activation (OPT applies its dropout there). R is the op's `rows_per_sample` (`RandomOp`),
  recorded at capture as the drawn tensor's dim 0 over the captured graph's batch size (eager:
  over `batch_size`, else 1). Rank-local row r of the microbatch running now is global row
  `RandomState.sample_offset * R + (offset of the rank's shard along dim 0) + r`,
  so a (B, ...) input, a flattened one and a microbatch of either give every row the draws
  one process gives it.
- Which dim holds the samples is read from the graph ([Note: sample dims] in
  autoplan/strategies/samples.py): the drawn tensor's own sample dim, else (a tensor the op
  makes: `torch.rand((B, 1, 1))` of stochastic depth, `x.new_empty(...).bernoulli_(p)`) the
  dim that lines up with the samples of the activation it is first combined with, following
  elementwise ops. Samples on dim 0: per sample, as above. No samples (a (C,) noise broadcast
  over the batch, a dropout of a weight, a draw that depends on no input): R = 0, the row is
  its index alone, so every rank and every microbatch draws what one process draws once.
  Samples on another dim (a (T, B, C) sequence-first activation), or a draw that depends on
  the input where the samples cannot be followed: refused when the plan is made, naming the
  op, its module and source line.
- For each row the whole per-row tensor (shape `global_shape[1:]`) is drawn in float32 on
  the CPU from a `torch.Generator` seeded with `sample_seed(seed, step, k, b)`; a rank keeps the
  part it holds (a Shard(d>0) slices dim d-1 of the row; Replicate keeps all of it). CPU
  draws because CUDA's Philox stream differs from the CPU's Mersenne Twister: the values would
  otherwise depend on the device.
- A graph of one sample (a microbatch of 1) cannot tell which dim holds the samples (DTensor's
  rules lose the Shard of a size-1 dim): there a draw computed from the batch, or one whose
  dim 0 has one row, is per sample, any other without samples (`one_sample_rows`). The plan's
  graph, at the global batch, finds the draws this keys wrongly ((1, T, C) noise broadcast
  over the samples), and the batch audit refuses a microbatch of one sample for them
  ([Note: batch coupling] in autoplan/batch_coupling.py).
- Limit: the eager mode (`keyed_random_ops`) sees no graph: it keys every draw per sample
  (R from `batch_size`, else 1), which equals the graph's keying of a draw without samples
  only at sample_offset 0 (one whole batch per step, as autoplan.testing's reference runs).
- Bernoulli(q) is `u < q` for uniform u (q a number or a tensor of probabilities); dropout(p)
  keeps an element with `u < 1 - p`, the same as eager CPU dropout's `bernoulli_(1 - p)`, so
  both paths give the same mask bit for bit.
  out = x * (keep / (1 - p)) in x's dtype (the arithmetic of aten's CPU dropout); p == 0 or
  train=False is the identity and p == 1 gives zeros (no draws, so no index k).
- Attention dropout (SDPA with 0 < dropout_p < 1) is computed explicitly (torch's math path) and
  drops attention probabilities with the mask of per-sample shape (H, T, S).
The cost: B * R small CPU draws per op (one generator per row), copied to the device.

The keyed ops themselves and their state are autoplan/passes/keyed_random.py (re-exported
here); this module is the pass that puts them in a graph, and the eager mode.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan._torch_compat import is_aten_op
from autoplan.passes.keyed_random import (RandomOp, RandomState, check_p, keyed_bernoulli,
                                          keyed_bernoulli_, keyed_bernoulli_tensor,
                                          keyed_bernoulli_tensor_, keyed_dropout,
                                          keyed_native_dropout, keyed_rand, keyed_rand_like,
                                          keyed_sdpa, sample_seed)
from autoplan.passes.sharding import run_replicated, sdpa_local
from autoplan.strategies.samples import SampleFacts, sample_facts

__all__ = ["RandomState", "RandomOp", "sample_seed", "random_op_indices", "where",
           "one_sample_rows", "one_sample_misses", "make_random_ops_layout_invariant",
           "keyed_dropout", "keyed_native_dropout", "keyed_bernoulli", "keyed_bernoulli_",
           "keyed_bernoulli_tensor", "keyed_bernoulli_tensor_", "keyed_rand", "keyed_rand_like",
           "keyed_sdpa", "KeyedRandomOps", "keyed_random_ops"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_DROPOUTS = frozenset({aten.dropout.default, aten.native_dropout.default})
_FACTORIES = frozenset({aten.rand.default, aten.randn.default})
_ELEMENTWISE = frozenset({aten.bernoulli.p, aten.bernoulli_.float, aten.bernoulli.default,
                          aten.bernoulli_.Tensor, aten.rand_like.default,
                          aten.randn_like.default}) | _FACTORIES
_GRAPH_OPS = _DROPOUTS | _ELEMENTWISE | {_SDPA}
_EAGER_OPS = _ELEMENTWISE | {aten.native_dropout.default}
_SUPPORTED = ("dropout, native_dropout, bernoulli (p a number or a tensor), bernoulli_, rand, "
              "randn, rand_like, randn_like and scaled_dot_product_attention")
# Followed from a draw to the activation it meets ([Note: RNG contract]): elementwise ops
# keep the draw's dims where they were (broadcasting aligns dims from the right).
_SAME_DIMS = frozenset({aten._to_copy.default, aten.to.dtype, aten.alias.default,
                        aten.detach.default})


# --- the graph pass ------------------------------------------------------------------------------

def _named(op, args, kwargs) -> dict:
    """The op's arguments by name (its Python signature: `input` for aten's `self`), defaults
    filled in."""
    pair = normalize_function(op, tuple(args), dict(kwargs), normalize_to_only_use_kwargs=True)
    if pair is None:
        raise ValueError(f"{op}: cannot bind args {args} kwargs {kwargs} to its schema")
    return pair.kwargs


def _draws(op, named: dict, where: str, supported: frozenset) -> bool:
    """True when `op` with these arguments draws random numbers (see [Note: RNG contract] for
    the cases that do not); raises for a seeded op that is not in `supported`. Callers skip
    ops without torch.Tag.nondeterministic_seeded first (every random aten op carries it)."""
    if op in _DROPOUTS or "dropout_p" in named:
        name = "p" if op in _DROPOUTS else "dropout_p"
        p = named[name]
        check_p(p, name, where)
        train = named.get("train", True)
        if not isinstance(train, (bool, type(None))):
            raise ValueError(f"{where}: train={train!r} must be a constant bool")
        draws = train is not False and 0 < p < 1
    else:
        draws = True
    if draws and op not in supported:
        raise ValueError(f"{where}: {op} draws random numbers and has no layout-invariant "
                         f"version; supported: {_SUPPORTED}")
    return draws


def _random_nodes(gm: torch.fx.GraphModule):
    """(node, aten op, named args) of every node that draws random numbers (an op the
    placement pass runs through `run_replicated` or `sdpa_local` included)."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        op, args = (_SDPA if node.target is sdpa_local else node.target), node.args
        if node.target is run_replicated:  # an op without a DTensor rule (aten.rand)
            op, args = node.args[0], node.args[1:]
        if not is_aten_op(op) or torch.Tag.nondeterministic_seeded not in op.tags:
            continue
        named = _named(op, args, node.kwargs)
        if _draws(op, named, where(node), _GRAPH_OPS):
            yield node, op, named


def where(node: torch.fx.Node) -> str:
    """"node rand (aten.rand.default) in module encoder.layers.0.drop_path at
    modeling_swin.py:123 `random_tensor = ...`": the node, the module that called the op and
    the source line, as torch.export recorded them (what it has of them)."""
    text = f"node {node.name} ({node.target})"
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = re.sub(r"@\d+$", "", list(stack.values())[-1][0])  # "@n": a repeated call
        path = re.sub(r"^(L__self__\.)?(inner\.)?", "", path)  # capture's wrapper
        text += f" in module {path}" if path and path != "inner" else ""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    # the innermost frame outside torch itself: the model's line, not nn.BatchNorm's
    frames = [i for i, ln in enumerate(trace) if ln.strip().startswith("File ")]
    own = [i for i in frames if "/torch/" not in trace[i]] or frames
    if own:
        i = own[-1]  # File "/.../modeling_swin.py", line 123, in drop_path
        last = trace[i].strip()
        try:
            file = last.split('"')[1].rsplit("/", 1)[-1]
            line = last.split(", line ")[1].split(",")[0]
            code = trace[i + 1].strip() if i + 1 < len(trace) else ""
            text += f" at {file}:{line} `{code}`"
        except IndexError:
            pass
    return text


def random_op_indices(gm: torch.fx.GraphModule, samples: SampleFacts | None = None, *,
                      batch_size: int | None = None) -> dict[str, RandomOp]:
    """How every random node of a full captured graph is keyed ([Note: RNG contract]): node
    name -> RandomOp(k: index in topological order, rows_per_sample: the drawn tensor's dim 0
    over the graph's batch size; 0 for a draw without samples). Ops that draw nothing
    (dropout with p in {0, 1} or train=False, SDPA without dropout) have none.
    `samples`: the graph's `sample_facts`, where the caller has them; `batch_size`: the
    capture's samples (CapturedGraph.batch_size; default dim 0 of the first placeholder).

    Raises:
        ValueError: a seeded op without a keyed version (naming the node and op), a
            non-constant p, a draw whose samples are on a dim other than 0 or cannot be
            followed, or one whose dim 0 is not a multiple of the graph's batch size (each
            naming the node, its module and source line).
    """
    found = list(_random_nodes(gm))
    if not found:
        return {}
    batch = batch_size or next((n.meta["val"].shape[0] for n in gm.graph.nodes
                                if n.op == "placeholder" and isinstance(n.meta.get("val"),
                                                                        torch.Tensor)
                                and n.meta["val"].dim()), None)
    if samples is None:
        samples = sample_facts(gm, batch)
    out: dict[str, RandomOp] = {}
    for node, op, named in found:
        rows = _rows_per_sample(node, op, named, samples, batch)
        out[node.meta.get("orig_name", node.name)] = RandomOp(len(out), rows)
    return out


def _drawn(op, named: dict) -> tuple[tuple | None, torch.fx.Node | None]:
    """(shape of the tensor a random op draws over, the input node it draws over: None for
    `torch.rand(size)`)."""
    if op in _FACTORIES:
        return tuple(int(s) for s in named["size"]), None
    x = named.get("input", named.get("query"))
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    return (tuple(val.shape) if isinstance(val, torch.Tensor) else None), x


def _rows_per_sample(node, op, named: dict, samples: SampleFacts, batch: int | None) -> int:
    """R of [Note: RNG contract] for one random node (0: a draw without samples)."""
    shape, x = _drawn(op, named)
    if not batch or shape is None:
        return 1
    from_batch = x is not None and x.name in samples.from_inputs
    if batch == 1:  # DTensor's rules lose the Shard of a size-1 dim: `one_sample_rows`
        return one_sample_rows(shape, from_batch)
    dim = samples.dim(x) if x is not None else None
    if dim is None:
        met = _dim_met(node, shape, samples)
        if met is not None and not met.per_sample:
            return 0  # broadcast over the samples: one draw for all of them
        dim = met.dim if met is not None else None
    if dim is None and not from_batch:
        return 0  # depends on no input and meets no samples
    if dim is None:
        raise ValueError(
            f"{where(node)}: draws over a tensor of shape {shape} computed from the batch, "
            "and which of its dims holds the samples cannot be followed ([Note: sample dims] "
            "in autoplan/strategies/samples.py); the RNG contract keys the samples' dim 0")
    if dim != 0:
        raise ValueError(
            f"{where(node)}: draws over a tensor of shape {shape} whose samples are on dim "
            f"{dim}; the RNG contract keys dim 0 as the samples' dim (put the batch first, "
            "e.g. batch_first=True)")
    if not shape or shape[0] % batch or not shape[0]:
        raise ValueError(
            f"{where(node)}: draws over a tensor of shape {shape} whose dim 0 is not a "
            f"multiple of the batch ({batch}); the RNG contract keys dim 0 as the global "
            "row, a whole number of rows per sample")
    return shape[0] // batch


def one_sample_rows(shape: tuple, from_batch: bool) -> int:
    """R of a draw of `shape` in a graph of one sample ([Note: RNG contract]): per sample
    (R = dim 0) where it is computed from the batch or its dim 0 has one row, else without
    samples (0). The plan's graph, at the global batch, tells the draws this keys wrongly
    (autoplan/batch_coupling.py refuses a microbatch of one sample for them)."""
    return shape[0] if from_batch or shape[0] == 1 else 0


def one_sample_misses(gm: torch.fx.GraphModule, samples: SampleFacts,
                      batch_size: int) -> list[tuple[torch.fx.Node, tuple, int]]:
    """The random nodes of a graph captured at `batch_size` (> 1) samples that the same graph
    captured at one sample would key otherwise (`one_sample_rows`): (node, the shape it draws
    over, its rows per sample). Raises what `random_op_indices` raises."""
    keyed = random_op_indices(gm, samples, batch_size=batch_size)
    out = []
    for node, op, named in _random_nodes(gm):
        shape, x = _drawn(op, named)
        rows = keyed[node.meta.get("orig_name", node.name)].rows_per_sample
        if shape is None or not shape:
            continue
        one = shape[0] // batch_size if rows else shape[0]  # its dim 0 at one sample
        if one_sample_rows((one,), x is not None and x.name in samples.from_inputs) != rows:
            out.append((node, shape, rows))
    return out


class _Met(NamedTuple):
    """Where a draw meets the samples (`_dim_met`): `dim`, the draw's dim lined up with them
    (None: the draw has fewer dims than reach them); `per_sample`, whether the draw has the
    samples' size there (one draw per sample) or is broadcast over them (size 1)."""

    dim: int | None
    per_sample: bool


def _dim_met(node: torch.fx.Node, shape: tuple, samples: SampleFacts) -> _Met | None:
    """How a draw of `shape` (the output of random node `node`) lines up with the samples of
    the first activation it is combined with, following elementwise ops; None where it meets
    no samples."""
    frontier = [(node, 0)]  # (value derived from the draw, its dims minus the draw's)
    seen = set()
    while frontier:
        value, shift = frontier.pop(0)
        for user in value.users:
            if user.name in seen or user.op != "call_function":
                continue
            seen.add(user.name)
            op = user.target
            if op not in _SAME_DIMS and (not hasattr(op, "tags")
                                         or torch.Tag.pointwise not in op.tags):
                continue
            out = user.meta.get("val")
            if not isinstance(out, torch.Tensor):
                continue
            here = out.dim() - value.meta["val"].dim() + shift  # the draw's dim j is j + here
            met = [(a, samples.dim(a)) for a in user.all_input_nodes
                   if a is not value and samples.dim(a) is not None]
            if not met:
                frontier.append((user, here))
                continue
            a, d = met[0]
            j = d + out.dim() - a.meta["val"].dim() - here
            if not 0 <= j < len(shape):
                return _Met(None, False)
            return _Met(j, shape[j] == a.meta["val"].shape[d])
    return None


def _replacement(op, named: dict, state: torch.fx.Node, key: RandomOp):
    k = key.k
    # rows_per_sample only where it is not 1: the graphs of (B, ...) inputs read as before
    rows = {"rows_per_sample": key.rows_per_sample} if key.rows_per_sample != 1 else {}
    if op is _SDPA:
        return keyed_sdpa, (state, named["query"], named["key"], named["value"],
                            named["attn_mask"], named["dropout_p"], named["is_causal"], k), \
            {"scale": named["scale"], "enable_gqa": named["enable_gqa"], **rows}
    if op in _DROPOUTS:
        fn = keyed_dropout if op is aten.dropout.default else keyed_native_dropout
        return fn, (state, named["input"], named["p"], named["train"], k), rows
    if op in (aten.bernoulli.p, aten.bernoulli_.float):
        fn = keyed_bernoulli if op is aten.bernoulli.p else keyed_bernoulli_
        return fn, (state, named["input"], named["p"], k), rows
    if op is aten.bernoulli.default:
        return keyed_bernoulli_tensor, (state, named["input"], k), rows
    if op is aten.bernoulli_.Tensor:
        return keyed_bernoulli_tensor_, (state, named["input"], named["p"], k), rows
    if op in _FACTORIES:
        return keyed_rand, (state, named["size"], k), {
            "normal": op is aten.randn.default, "dtype": named.get("dtype"),
            "device": named.get("device"), **rows}
    return keyed_rand_like, (state, named["input"], k), {
        "normal": op is aten.randn_like.default, "dtype": named.get("dtype"), **rows}


def make_random_ops_layout_invariant(gm: torch.fx.GraphModule, indices: Mapping[str, RandomOp],
                                     state_attr: str = "random_state") -> int:
    """Replace every random node of a (stage) graph by its keyed version, in place.

    Nodes are looked up in `indices` (from `random_op_indices` of the full graph) by
    `meta["orig_name"]` (else their name). The RandomState is the submodule `gm.<state_attr>`
    (registered as RandomState(seed=0) when absent: the engine sets seed, step and
    sample_offset before each forward), read by one get_attr node placed before the first op.
    SDPA nodes may already be `sharding.sdpa_local`. Keeps node.meta. Recompiles. Returns the
    number of nodes replaced.

    Raises:
        ValueError: a random node missing from `indices` (they come from another graph), an
            attribute `state_attr` that is not a RandomState, or what `random_op_indices` raises.
    """
    state = getattr(gm, state_attr, None)
    if state is None:
        state = RandomState(seed=0)
        setattr(gm, state_attr, state)
    if not isinstance(state, RandomState):
        raise ValueError(f"gm.{state_attr} is a {type(state).__name__}, not a RandomState")
    found = list(_random_nodes(gm))
    if not found:
        return 0
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        state_node = gm.graph.get_attr(state_attr)
    for node, op, named in found:
        name = node.meta.get("orig_name", node.name)
        if name not in indices:
            raise ValueError(f"node {node.name} ({op}) draws random numbers but {name!r} has no "
                             "index; compute the indices with random_op_indices on the full "
                             "graph this stage was split from")
        fn, args, kwargs = _replacement(op, named, state_node, indices[name])
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(fn, args, kwargs)
        new.meta = dict(node.meta)
        new.meta["orig_name"] = name
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return len(found)


# --- eager models ----------------------------------------------------------------------------

class KeyedRandomOps(TorchDispatchMode):
    """Eager random ops under [Note: RNG contract], for a plain single-process model.

    Below autograd, eager CPU dropout reaches `aten.bernoulli_.float` (aten.dropout is
    CompositeImplicitAutograd: empty_like, bernoulli_(1 - p), div_, mul), and so does the
    attention dropout of SDPA, which takes the math path on CPU (its bernoulli_ is on the
    (B, H, T, S) probabilities). Those, bernoulli.p, bernoulli with a tensor p (`bernoulli`,
    `bernoulli_.Tensor`), rand, randn (stochastic depth's `torch.rand((B, 1, 1))`), rand_like,
    randn_like and native_dropout (CUDA's fused dropout; its saved mask keeps autograd right)
    get keyed values; rows are global rows `sample_offset * R + r`, where R (rows per
    sample) is an op's dim 0 over
    `batch_size` (the samples each forward runs) when that is given, else 1 -- R matters only
    where `sample_offset` is not 0, for an op on a flattened (B*T, C) input (OPT's dropout). A
    fused SDPA kernel with dropout (CUDA) or any other seeded op raises ValueError: its
    backward would draw again; so does an op whose dim 0 is not a multiple of `batch_size`.

    k counts the random ops in call order from 0; setting `step` or `sample_offset`, or
    `next_step()`, restarts it, so set one of them before every forward (e.g.
    `mode.sample_offset = i * mb` per accumulated microbatch).
    """

    def __init__(self, seed: int, step: int = 0, sample_offset: int = 0,
                 batch_size: int | None = None):
        super().__init__()
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"keyed_random_ops: batch_size={batch_size!r}, expected an int >= 1")
        self.state = RandomState(seed, step, sample_offset)
        self.batch_size = batch_size
        self.num_drawn = 0
        """Random ops drawn since the last reset: the k of the next one."""

    @property
    def step(self) -> int:
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step, self.num_drawn = value, 0

    @property
    def sample_offset(self) -> int:
        return self.state.sample_offset

    @sample_offset.setter
    def sample_offset(self, value: int) -> None:
        self.state.sample_offset, self.num_drawn = value, 0

    def next_step(self) -> None:
        """Move to the next training step (k restarts at 0)."""
        self.step = self.step + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        named = _named(func, args, kwargs)
        if not _draws(func, named, f"keyed_random_ops: {func}", _EAGER_OPS):
            return func(*args, **kwargs)
        k, state, x = self.num_drawn, self.state, named.get("input")
        shape = tuple(named["size"]) if func in _FACTORIES else tuple(x.shape)
        rows = self._rows_per_sample(func, shape)
        self.num_drawn += 1
        if func in _FACTORIES:
            return keyed_rand(state, shape, k, normal=func is aten.randn.default,
                              dtype=named.get("dtype"), device=named.get("device"),
                              rows_per_sample=rows)
        if func is aten.bernoulli.default:
            return keyed_bernoulli_tensor(state, x, k, rows_per_sample=rows)
        if func is aten.bernoulli_.Tensor:
            return keyed_bernoulli_tensor_(state, x, named["p"], k, rows_per_sample=rows)
        if func is aten.native_dropout.default:
            return keyed_native_dropout(state, x, named["p"], named["train"], k,
                                        rows_per_sample=rows)
        if func is aten.bernoulli.p:
            return keyed_bernoulli(state, x, named["p"], k, rows_per_sample=rows)
        if func is aten.bernoulli_.float:
            return keyed_bernoulli_(state, x, named["p"], k, rows_per_sample=rows)
        return keyed_rand_like(state, x, k, normal=func is aten.randn_like.default,
                               dtype=named.get("dtype"), rows_per_sample=rows)

    def _rows_per_sample(self, func, shape: tuple) -> int:
        if self.batch_size is None or not shape:
            return 1  # a 0-d input is refused by the keyed op itself
        if shape[0] % self.batch_size or not shape[0]:
            raise ValueError(
                f"keyed_random_ops: {func} on an input of shape {shape} whose dim 0 is "
                f"not a multiple of batch_size={self.batch_size}")
        return shape[0] // self.batch_size


def keyed_random_ops(seed: int, step: int = 0, sample_offset: int = 0,
                     batch_size: int | None = None) -> KeyedRandomOps:
    """`with keyed_random_ops(seed) as mode: model(x)` -- see KeyedRandomOps."""
    return KeyedRandomOps(seed, step, sample_offset, batch_size)
