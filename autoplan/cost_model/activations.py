"""Activations derived from a captured graph: the tensors autograd saves for the backward, op
by op ([Note: saved tensors]), their producers and which of them carry a gradient, the regions
"core-attention" checkpointing recomputes, and the activation bytes of a layer by checkpointing
policy (`activation_bytes_from_graph`). Model states, the closed form and the peak per rank:
memory.py.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.fx

from autoplan.cost_model.compute import DTYPE_BYTES, matmul_dims
from autoplan.cost_model.memory import RECOMPUTE_POLICIES
from autoplan.experts import EXPERTS_TARGET
from autoplan.graph import NodeInfo
from autoplan.op_classes import ATTENTION_OPS, MATMUL_OPS, NO_GRAD_OPS, VIEW_OPS, op_name

__all__ = ["PARAM_PREFIX", "SavedTensor", "node_producers", "grad_carriers",
           "core_attention_regions", "attention_dropout_scores", "saved_tensors",
           "activation_bytes_from_graph"]


# [Note: saved tensors]
# The activation memory of a layer is what autograd keeps from its forward for its backward. We
# derive it per op class from the ops' own backward formulas (torch/csrc/autograd/derivatives.yaml
# says what each op saves):
# | op class                                   | saves (global shapes)                          |
# |--------------------------------------------|------------------------------------------------|
# | linear, mm, addmm                          | the activation operand (m x k); the weight is a |
# |                                            | parameter, not an activation                   |
# | bmm, matmul, baddbmm                       | both operands (unless one is a parameter)      |
# | layer_norm / rms_norm                      | input + per-row fp32 statistics (2 or 1 x 4 B) |
# | gelu, silu, pow, log, erf, var, ...        | input                                          |
# | softmax, log_softmax, relu, tanh, sigmoid, | output                                         |
# | exp, rsqrt, sqrt                           |                                                |
# | dropout, native_dropout                    | a 1-byte mask per element (training, p > 0)    |
# | masked_fill, where                         | the boolean mask/condition: in - out bytes     |
# | mul, div of two activations                | both operands (each for the other's gradient)  |
# | fused attention (sdpa, flash, efficient)   | q, k, v, output, fp32 log-sum-exp per row      |
# |   with dropout (dropout_p > 0)             | and a 1-byte keep mask per score (the runtime's|
# |                                            | keyed attention dropout, passes/rng.py)        |
# | embedding                                  | int64 indices                                  |
# | routed experts (autoplan.experts)          | hidden (T x H) and routing weights (T x k);    |
# |                                            | under ep > 1 the exchange's buffers instead    |
# |                                            | (rank_memory.ExpertSlices.act_bytes)           |
# | cross_entropy_loss                         | log-probabilities (in_bytes)                   |
# | views, add/sub, casts, clone, cat, sum,    | nothing                                        |
# | mean, cumsum, comparisons, creation ops    |                                                |
# | index, index_select, gather                | their integer indices: negligible, not counted |
# | an op whose first output is not floating   | nothing: autograd does not record it           |
# | any other op                               | all its inputs (conservative; kind "unknown")  |
# Floating tensors are counted at `dtype_bytes` when given (a graph captured in fp32 that trains
# in bf16), else at the op's output dtype; masks are 1 byte, statistics 4, indices 8.
# A tensor saved by two ops is counted once when `producers` (from `node_producers`) says where
# each argument comes from; without it each consumer's copy counts (an over-estimate when, e.g.,
# separate q/k/v projections read the same normed input).
# Only what a gradient needs: autograd records an op only when an input requires a gradient,
# and keeps an operand only for a gradient that needs it (derivatives.yaml's saved inputs are
# those of the formulas it evaluates, per `needs_input_grad`). With `grads` (`grad_carriers`:
# what descends from a trainable parameter; buffers, frozen parameters and graph inputs do not)
# an op none of whose inputs requires one saves nothing (the rotary tables computed from
# `inv_freq`); a matmul keeps a only when b requires a gradient and b only when a does (the
# input of a frozen weight's linear is not kept for it); mul keeps each operand for the
# other's gradient (q * cos keeps cos, not q; a frozen norm weight's product keeps nothing),
# div its divisor always and its dividend for the divisor's. Each operand is then its
# producer's value, so the input a norm's pow and its mul both keep counts once. Measured
# (LoRA r=16 on a 0.48B Llama at tp4, bench/finetune_memory.py, the dry run's activations at
# the end of the forward): 161.5 MB; priced 230.1 MB before this rule.
# Selective recompute (Korthikanti et al. 2022, "selective activation recomputation") drops the
# attention scores: the saved tensors of the ops between a score matmul (a batched matmul whose
# contraction dim is smaller than both output dims, q @ k^T) and the next matmul (scores @ v),
# plus that matmul's scores operand -- the 5as^2b term. Full recompute keeps only the layer input.
# `activation_bytes_from_graph(policy="selective")` is this published variant (the formula
# checks against Table 2). What autoplan plans and runs as "selective" is op-level: see
# [Note: selective saved set] in autoplan/op_classes.py.

PARAM_PREFIX = "param:"
"""`node_producers` marks an argument that is a parameter/buffer (or a view of one) so."""

_NO_SAVE = frozenset({
    "add", "sub", "rsub", "neg", "clone", "contiguous", "copy", "copy_", "_to_copy", "to",
    "type_as", "cat", "stack", "sum", "mean", "tril", "triu", "repeat", "roll", "flip",
    "constant_pad_nd", "pad", "nll_loss", "nll_loss_forward", "nll_loss2d_forward", "cumsum",
    "diff", "index", "index_select", "gather",
})
_NORMS = {"layer_norm": 2, "native_layer_norm": 2, "rms_norm": 1, "_fused_rms_norm": 1,
          "group_norm": 0, "native_group_norm": 0, "batch_norm": 0, "native_batch_norm": 0}
_SAVES_INPUT = frozenset({
    "gelu", "silu", "mish", "elu", "log", "pow", "erf", "sin", "cos", "hardswish", "softplus",
    "leaky_relu", "var", "std", "var_mean", "abs",
})
_SAVES_OUTPUT = frozenset({
    "softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax", "relu", "tanh",
    "sigmoid", "exp", "rsqrt", "sqrt", "reciprocal",
})
_DROPOUT = frozenset({"dropout", "native_dropout", "feature_dropout", "alpha_dropout"})
_BATCHED = frozenset({"bmm", "matmul", "baddbmm"})
_FLOATING = frozenset({"float64", "float32", "bfloat16", "float16", "float8_e4m3fn",
                       "float8_e5m2"})


@dataclass(frozen=True)
class SavedTensor:
    """One tensor that autograd keeps from the forward for the backward.

    Attributes:
        owner: node whose output it is (its shard factor applies); the consumer itself when
            the producer is unknown.
        slot: which tensor of the owner: "out", "mask", "stats", or "arg<i>" (producer unknown).
        consumer: the node whose backward needs it.
        nbytes: bytes at global (unsharded) shapes.
        kind: the rule that counted it ([Note: saved tensors]).
        attention_scores: True for the tensors selective recompute drops.
    """

    owner: str
    slot: str
    consumer: str
    nbytes: float
    kind: str
    attention_scores: bool = False


def node_producers(
        graph: torch.fx.Graph | torch.fx.GraphModule) -> dict[str, tuple[str | None, ...]]:
    """Where each positional argument of each call_function node comes from: the argument
    node's name for an activation, PARAM_PREFIX + FQN for a parameter/buffer (a get_attr node,
    possibly behind view ops such as t/permute/alias), None for a non-tensor argument."""
    graph = graph.graph if isinstance(graph, torch.fx.GraphModule) else graph
    result = {}
    for node in graph.nodes:
        if node.op == "call_function":
            result[node.name] = tuple(_producer(a) for a in node.args)
    return result


def _producer(arg) -> str | None:
    if not isinstance(arg, torch.fx.Node):
        return None
    root = arg
    while (root.op == "call_function" and root.args and isinstance(root.args[0], torch.fx.Node)
           and root.target is not operator.getitem and op_name(str(root.target)) in VIEW_OPS):
        root = root.args[0]
    return PARAM_PREFIX + str(root.target) if root.op == "get_attr" else arg.name


def grad_carriers(graph: torch.fx.Graph | torch.fx.GraphModule, params) -> frozenset[str]:
    """The values that require a gradient in a training step ([Note: saved tensors], "only
    what a gradient needs"): PARAM_PREFIX + FQN of every trainable parameter (each alias of
    a tied one), and the name of every call_function node with an input among them.
    Buffers, frozen parameters, graph inputs and constants require none.

    Args:
        graph: the captured graph; params: `CapturedGraph.params` (FQN -> ParamInfo).
    """
    graph = graph.graph if isinstance(graph, torch.fx.GraphModule) else graph
    trainable = {name for p in params.values() if p.trainable and not p.is_buffer
                 for name in (p.fqn, *p.aliases)}
    out = {PARAM_PREFIX + name for name in trainable}
    carrying: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr" and node.target in trainable:
            carrying.add(node)
        elif node.op == "call_function" and any(a in carrying for a in node.all_input_nodes):
            carrying.add(node)
            out.add(node.name)
    return frozenset(out)


class _Rules:
    """Saved tensors of one node ([Note: saved tensors]); `items` collects them."""

    def __init__(self, node: NodeInfo, producers: Sequence[str | None] | None,
                 dtype_bytes: int | None, grads: frozenset[str] | None = None,
                 value_numel: Mapping[str, int] | None = None):
        self.node, self.producers, self.items = node, producers, []
        out_width = DTYPE_BYTES.get(node.dtypes[0], 4) if node.dtypes else 4
        self.width = dtype_bytes or out_width
        self.scale = self.width / out_width
        self.numel0 = math.prod(node.shapes[0]) if node.shapes else 0
        # [Note: saved tensors], "only what a gradient needs": None without producers
        self.grads = grads if producers is not None else None
        self.value_numel = value_numel or {}

    def carries(self, i: int) -> bool:
        """Whether argument i requires a gradient (`grad_carriers`; True when unknown)."""
        if self.grads is None:
            return True
        p = self.producers
        return i < len(p) and p[i] is not None and p[i] in self.grads

    def arg_bytes(self, i: int) -> float:
        """Bytes of argument i at the activation width: its producer's first output, or
        the op's output size where the producer is not known."""
        numel = self.value_numel.get(self.producers[i]) if self.producers is not None and \
            i < len(self.producers) else None
        return (self.numel0 if numel is None else numel) * self.width

    def is_param(self, i: int) -> bool:
        p = self.producers
        return p is not None and (i >= len(p) or p[i] is None or p[i].startswith(PARAM_PREFIX))

    def known_activation(self, i: int) -> bool:
        return self.producers is not None and not self.is_param(i)

    def arg(self, i: int, nbytes: float, kind: str) -> None:
        if self.producers is not None:
            if self.is_param(i):
                return
            self.items.append((self.producers[i], "out", nbytes, kind))
        else:
            self.items.append((self.node.name, f"arg{i}", nbytes, kind))

    def own(self, slot: str, nbytes: float, kind: str) -> None:
        self.items.append((self.node.name, slot, nbytes, kind))

    def rows(self) -> int:
        shape = self.node.shapes[0] if self.node.shapes else ()
        return self.numel0 // shape[-1] if shape and shape[-1] else 0

    def apply(self) -> None:
        name, node, w = op_name(self.node.target), self.node, self.width
        floating = not node.dtypes or node.dtypes[0] in _FLOATING
        if name in VIEW_OPS or name in NO_GRAD_OPS or name in _NO_SAVE or not floating:
            return
        if self.grads is not None and node.name not in self.grads:
            return  # nothing upstream requires a gradient: autograd records no backward
        if node.target == EXPERTS_TARGET:  # op_name is "default": not the aten matmul rule
            self.arg(0, self.arg_bytes(0), "experts_hidden")
            self.arg(2, self.arg_bytes(2), "experts_routing_weights")
        elif name in MATMUL_OPS and name != "convolution":
            self.matmul(name)
        elif name in ATTENTION_OPS:
            self.own("out", node.in_bytes * self.scale + self.numel0 * w + self.rows() * 4,
                     "attention_qkv_out")
        elif name in _NORMS:
            self.arg(0, self.numel0 * w, "norm_input")
            if _NORMS[name]:
                self.own("stats", _NORMS[name] * self.rows() * 4, "norm_stats")
        elif name in _SAVES_INPUT:
            self.arg(0, self.numel0 * w, "activation_input")
        elif name in _SAVES_OUTPUT:
            self.own("out", self.numel0 * w, "softmax_output" if "softmax" in name
                     else "activation_output")
        elif name in _DROPOUT:
            self.own("mask", self.numel0, "dropout_mask")
        elif name in ("masked_fill", "where"):
            self.arg(1 if name == "masked_fill" else 0,
                     max(0, node.in_bytes - node.out_bytes), "mask")
        elif name in ("mul", "div"):
            self.product()
        elif name == "embedding":
            self.arg(1, self.rows() * 8, "indices")
        elif name in ("cross_entropy_loss", "cross_entropy"):
            self.own("log_probs", node.in_bytes * self.scale, "log_probs")
        else:
            self.own("inputs", node.in_bytes * self.scale, "unknown")

    def matmul(self, name: str) -> None:
        batch, m, n, k = matmul_dims(self.node)
        first = {"addmm": 1, "baddbmm": 1}.get(name, 0)
        # a's gradient needs b and b's needs a: each is kept when the other requires one
        if self.carries(first + 1):
            self.arg(first, batch * m * k * self.width, "matmul_operand")
        # The second operand of linear/mm/addmm is a weight unless producers say otherwise.
        if (name in _BATCHED or (name != "linear" and self.known_activation(first + 1))) \
                and self.carries(first):
            self.arg(first + 1, batch * k * n * self.width, "matmul_operand")

    def product(self) -> None:
        if self.producers is None:
            if self.node.in_bytes > self.node.out_bytes:
                self.own("operands", self.node.in_bytes * self.scale, "product_operands")
            return
        acts = [i for i in (0, 1) if self.known_activation(i)]
        if len(acts) == 2 and self.grads is None:
            self.own("operands", self.node.in_bytes * self.scale, "product_operands")
        elif len(acts) == 2:
            # mul: a's gradient needs b, b's needs a; div (a / b): a's needs b, b's both
            div = op_name(self.node.target) == "div"
            for i in (0, 1):
                if self.carries(1 - i) or (div and i == 1 and self.carries(0)):
                    self.arg(i, self.arg_bytes(i), "product_operands")
        elif len(acts) == 1 and self.producers[1 - acts[0]] is not None:
            if self.carries(1 - acts[0]):  # other: a parameter, kept for its gradient
                self.arg(acts[0], self.numel0 * self.width, "product_operands")


def _is_score_matmul(node: NodeInfo, producers: Sequence[str | None] | None) -> bool:
    if op_name(node.target) not in _BATCHED:
        return False
    if producers is not None and any(p is None or p.startswith(PARAM_PREFIX)
                                     for p in producers[:2]):
        return False
    _, m, n, k = matmul_dims(node)
    return k < m and k < n


def core_attention_regions(graph) -> list[tuple[str, ...]]:
    """The attention cores of the blocks of `graph` (a CapturedGraph): per score matmul of a
    block, the node names of its core, in graph order ([Note: core attention]).

    A core starts at a score matmul (a batched matmul of two activations whose contraction dim
    is smaller than both output dims: q @ k^T) and holds every block op its value reaches
    through the other ops (scale, mask, softmax, dropout, casts, views) up to and including the
    matmuls that consume it (scores @ v). Fused attention (sdpa, flash) has no score matmul and
    no core. The names are the captured graph's, which the rewritten per-rank graphs keep."""
    fx_nodes = {n.name: n for n in graph.gm.graph.nodes}
    producers = node_producers(graph.gm)
    regions = []
    for names in graph.layer_nodes.values():
        block = set(names)
        for name in names:
            info = graph.nodes.get(name)
            if info is None or not _is_score_matmul(info, producers.get(name)):
                continue
            region, todo = {name}, [name]
            while todo:
                for user in fx_nodes[todo.pop()].users:
                    if user.name in block and user.name not in region:
                        region.add(user.name)
                        if op_name(str(user.target)) not in MATMUL_OPS:
                            todo.append(user.name)
            regions.append(tuple(n for n in names if n in region))
    return regions


def attention_dropout_scores(gm: torch.fx.GraphModule | torch.fx.Graph) -> dict[str, float]:
    """{attention node: score elements, B x H x T x S} of the graph's attention ops that drop
    probabilities (scaled_dot_product_attention with dropout_p > 0): the runtime keeps a
    1-byte mask per score for their backward ([Note: saved tensors])."""
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    out = {}
    for node in graph.nodes:
        if node.op != "call_function" or op_name(str(node.target)) not in ATTENTION_OPS:
            continue
        p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        q, k = (a.meta.get("val") if isinstance(a, torch.fx.Node) else None
                for a in node.args[:2])
        if isinstance(p, (int, float)) and p > 0 and q is not None and k is not None:
            out[node.name] = float(math.prod(q.shape[:-1]) * k.shape[-2])
    return out


def saved_tensors(nodes: Sequence[NodeInfo], *,
                  producers: Mapping[str, Sequence[str | None]] | None = None,
                  dtype_bytes: int | None = None,
                  attention_dropout: Mapping[str, float] | None = None,
                  grads: frozenset[str] | None = None,
                  value_numel: Mapping[str, int] | None = None) -> list[SavedTensor]:
    """The tensors autograd saves for the backward of `nodes` (one layer, graph order), by the
    rules of [Note: saved tensors], unsharded and not deduplicated.

    Args:
        nodes: captured ops in graph order.
        producers: `node_producers(gm)` for exact attribution (parameters excluded, a tensor
            saved by several ops counted once by `activation_bytes_from_graph`).
        dtype_bytes: width of floating activations (2 for bf16 training); default: as captured.
        attention_dropout: `attention_dropout_scores(gm)`: the attention ops that drop
            probabilities, whose 1-byte masks count as attention scores (selective
            recomputation drops them).
        grads: `grad_carriers(gm, params)`: with `producers`, only what a gradient needs is
            saved ([Note: saved tensors]); None: every value requires one.
        value_numel: node name -> elements of its first output (global), for the operands
            of a product saved one by one; default: the product's output size.

    Raises ValueError for a matmul without FLOPs (see compute.matmul_dims).
    """
    result: list[SavedTensor] = []
    in_scores = False
    dropping = attention_dropout or {}
    for node in nodes:
        node_prod = None if producers is None else producers.get(node.name, ())
        rules = _Rules(node, node_prod, dtype_bytes, grads, value_numel)
        rules.apply()
        if node.name in dropping:
            result.append(SavedTensor(node.name, "dropout_mask", node.name,
                                      dropping[node.name], "attention_dropout_mask", True))
        is_matmul = op_name(node.target) in MATMUL_OPS
        starts = is_matmul and _is_score_matmul(node, node_prod)
        for index, (owner, slot, nbytes, kind) in enumerate(rules.items):
            # inside the score region; the closing matmul's first operand is the scores too
            scores = in_scores and (not is_matmul or index == 0)
            result.append(SavedTensor(owner, slot, node.name, float(nbytes), kind, scores))
        if is_matmul:
            in_scores = starts
    return result


def activation_bytes_from_graph(nodes: Sequence[NodeInfo],
                                shard_factor: Mapping[str, float] | None = None, *,
                                policy: str = "none", dtype_bytes: int | None = None,
                                producers: Mapping[str, Sequence[str | None]] | None = None,
                                layer_input_bytes: float | None = None,
                                grads: frozenset[str] | None = None,
                                value_numel: Mapping[str, int] | None = None) -> float:
    """Bytes one rank keeps from the forward of `nodes` (one layer, one microbatch at the
    captured shapes) for the backward ([Note: saved tensors]).

    Args:
        nodes: the layer's captured ops in graph order.
        shard_factor: node name -> how many ways that node's output is split on this rank (tensor
            or sequence parallelism); a saved tensor is divided by its owner's factor, and nodes
            not listed are unsharded.
        policy: "none"; "selective" (drops the attention scores, the 5as^2b term of Korthikanti
            et al. Table 2); "full" (keeps only the layer input).
        dtype_bytes: width of floating activations; default: as captured.
        producers: `node_producers(gm)`; see `saved_tensors`.
        layer_input_bytes: global bytes of the layer input for "full"; default: the first
            node's first output (a pre-norm layer starts with a shape-preserving norm), at the
            activation width, divided by that node's shard factor.
        grads, value_numel: see `saved_tensors` (what requires a gradient).

    Raises ValueError for an unknown policy, an empty layer, or a shard factor < 1.
    """
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"policy {policy!r} not in {list(RECOMPUTE_POLICIES)}")
    if not nodes:
        raise ValueError("activation_bytes_from_graph: no nodes")
    factors = dict(shard_factor or {})
    bad = {k: v for k, v in factors.items() if not v >= 1}
    if bad:
        raise ValueError(f"shard factors must be >= 1: {bad}")
    if policy == "full":
        first = nodes[0]
        if layer_input_bytes is None:
            rules = _Rules(first, None, dtype_bytes)
            layer_input_bytes = rules.numel0 * rules.width
        return layer_input_bytes / factors.get(first.name, 1.0)
    seen: dict[tuple[str, str], float] = {}
    for item in saved_tensors(nodes, producers=producers, dtype_bytes=dtype_bytes,
                              grads=grads, value_numel=value_numel):
        if policy == "selective" and item.attention_scores:
            continue
        seen[(item.owner, item.slot)] = item.nbytes / factors.get(item.owner, 1.0)
    return sum(seen.values())
