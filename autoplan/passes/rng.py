"""Layout-invariant random ops: dropout and attention dropout whose masks do not depend on the
parallel layout.

[Note: RNG contract]
Every random value is a function of (seed, step, k, b, position in the row) only -- never of
the dp/tp/pp degrees, the number of microbatches or the rank:
- k is the op's index among the random ops of the FULL captured graph in topological order
  (`random_op_indices`, before stage splitting), or the call order in eager mode
  (`keyed_random_ops`); both orders are program order.
- b is the global row: the index along dim 0 of the op's input over the global batch. Dim 0
  holds R rows per sample, sample-major: R = 1 for a (B, ...) input, R = T for the (B*T, C)
  that `x.view(-1, C)` makes of a (B, T, C) activation (OPT applies its dropout there). R is
  the op's `rows_per_sample` (`RandomOp`), recorded at capture as the input's dim 0 over the
  captured graph's batch size (eager: over `batch_size`, else 1). Rank-local row r of the
  microbatch running now is global row
  `RandomState.sample_offset * R + (offset of the rank's shard along dim 0) + r`,
  so a (B, ...) input, a flattened one and a microbatch of either give every row the draws
  one process gives it.
- For each row the whole per-row tensor (shape `global_shape[1:]`) is drawn in float32 on
  the CPU from a `torch.Generator` seeded with `sample_seed(seed, step, k, b)`; a rank keeps the
  part it holds (a Shard(d>0) slices dim d-1 of the row; Replicate keeps all of it). CPU
  draws because CUDA's Philox stream differs from the CPU's Mersenne Twister: the values would
  otherwise depend on the device.
- Limit: R is a ratio of sizes, so dim 0 must hold whole samples in sample order (a
  (T, B, C) sequence-first input, or a dim 0 that does not grow with the batch, is keyed
  wrongly when its size happens to be a multiple of the batch; otherwise it is refused).
- Bernoulli(q) is `u < q` for uniform u; dropout(p) keeps an element with `u < 1 - p`, the
  same as eager CPU dropout's `bernoulli_(1 - p)`, so both paths give the same mask bit for bit.
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

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan._torch_compat import is_aten_op
from autoplan.passes.keyed_random import (RandomOp, RandomState, check_p, keyed_bernoulli,
                                          keyed_bernoulli_, keyed_dropout,
                                          keyed_native_dropout, keyed_rand_like, keyed_sdpa,
                                          sample_seed)
from autoplan.passes.sharding import sdpa_local

__all__ = ["RandomState", "RandomOp", "sample_seed", "random_op_indices",
           "make_random_ops_layout_invariant",
           "keyed_dropout", "keyed_native_dropout", "keyed_bernoulli", "keyed_bernoulli_",
           "keyed_rand_like", "keyed_sdpa", "KeyedRandomOps", "keyed_random_ops"]

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_DROPOUTS = frozenset({aten.dropout.default, aten.native_dropout.default})
_ELEMENTWISE = frozenset({aten.bernoulli.p, aten.bernoulli_.float, aten.rand_like.default,
                          aten.randn_like.default})
_GRAPH_OPS = _DROPOUTS | _ELEMENTWISE | {_SDPA}
_EAGER_OPS = _ELEMENTWISE | {aten.native_dropout.default}
_SUPPORTED = ("dropout, native_dropout, bernoulli.p, bernoulli_.float, rand_like, randn_like "
              "and scaled_dot_product_attention")


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
    """(node, aten op, named args) of every node that draws random numbers."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        op = _SDPA if node.target is sdpa_local else node.target
        if not is_aten_op(op) or torch.Tag.nondeterministic_seeded not in op.tags:
            continue
        named = _named(op, node.args, node.kwargs)
        if _draws(op, named, _where(node), _GRAPH_OPS):
            yield node, op, named


def _where(node: torch.fx.Node) -> str:
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
    files = [ln.strip() for ln in trace if ln.strip().startswith("File ")]
    if files:
        last = files[-1]  # File "/.../modeling_swin.py", line 123, in drop_path
        try:
            file = last.split('"')[1].rsplit("/", 1)[-1]
            line = last.split(", line ")[1].split(",")[0]
            code = trace[-1].strip()
            text += f" at {file}:{line} `{code}`"
        except IndexError:
            pass
    return text


def random_op_indices(gm: torch.fx.GraphModule) -> dict[str, RandomOp]:
    """How every random node of a full captured graph is keyed ([Note: RNG contract]): node
    name -> RandomOp(k: index in topological order, rows_per_sample: its input's dim 0 over the
    graph's batch size, dim 0 of the first placeholder). Ops that draw nothing (dropout with p
    in {0, 1} or train=False, SDPA without dropout) have none.

    Raises:
        ValueError: a seeded op without a keyed version (naming the node and op), a
            non-constant p, or an input whose dim 0 is not a multiple of the graph's batch size.
    """
    batch = next((n.meta["val"].shape[0] for n in gm.graph.nodes if n.op == "placeholder"
                  and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim()), None)
    out: dict[str, RandomOp] = {}
    for node, op, named in _random_nodes(gm):
        x = named.get("input", named.get("query"))
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        rows = 1
        if batch and isinstance(val, torch.Tensor):
            if val.dim() == 0 or val.shape[0] % batch or not val.shape[0]:
                raise ValueError(
                    f"node {node.name} ({op}): input of shape {tuple(val.shape)} whose dim 0 "
                    f"is not a multiple of the batch ({batch}); the RNG contract keys dim 0 as "
                    "the global row, a whole number of rows per sample")
            rows = int(val.shape[0]) // batch
        out[node.meta.get("orig_name", node.name)] = RandomOp(len(out), rows)
    return out


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
    (B, H, T, S) probabilities). Those, bernoulli.p, rand_like, randn_like and native_dropout
    (CUDA's fused dropout; its saved mask keeps autograd right) get keyed values; rows are
    global rows `sample_offset * R + r`, where R (rows per sample) is an op's dim 0 over
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
        k, state, x = self.num_drawn, self.state, named["input"]
        rows = self._rows_per_sample(func, x)
        self.num_drawn += 1
        if func is aten.native_dropout.default:
            return keyed_native_dropout(state, x, named["p"], named["train"], k,
                                        rows_per_sample=rows)
        if func is aten.bernoulli.p:
            return keyed_bernoulli(state, x, named["p"], k, rows_per_sample=rows)
        if func is aten.bernoulli_.float:
            return keyed_bernoulli_(state, x, named["p"], k, rows_per_sample=rows)
        return keyed_rand_like(state, x, k, normal=func is aten.randn_like.default,
                               dtype=named.get("dtype"), rows_per_sample=rows)

    def _rows_per_sample(self, func, x: torch.Tensor) -> int:
        if self.batch_size is None or x.dim() == 0:
            return 1  # a 0-d input is refused by the keyed op itself
        if x.shape[0] % self.batch_size or not x.shape[0]:
            raise ValueError(
                f"keyed_random_ops: {func} on an input of shape {tuple(x.shape)} whose dim 0 is "
                f"not a multiple of batch_size={self.batch_size}")
        return x.shape[0] // self.batch_size


def keyed_random_ops(seed: int, step: int = 0, sample_offset: int = 0,
                     batch_size: int | None = None) -> KeyedRandomOps:
    """`with keyed_random_ops(seed) as mode: model(x)` -- see KeyedRandomOps."""
    return KeyedRandomOps(seed, step, sample_offset, batch_size)
