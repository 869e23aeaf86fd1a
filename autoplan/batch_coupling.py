"""The ops whose numbers depend on how the batch is cut or how often a forward runs, found in the
captured graph before the search, and what a plan must keep for them ([Note: batch coupling]).

[Note: batch coupling] A plan cuts the batch where dp > 1 (each rank a slice of the samples) or
num_microbatches > 1 (each forward a slice of them), cuts every sample where cp > 1, and runs a
checkpointed block's forward twice. One process does none of these, so an op whose result at
one sample reads other samples, or that changes state each time it runs, computes another
number under them. The audit (`batch_couplings`) lists each such op of the graph with what it
depends on; the search is then held to plans that keep it (`held_overrides`: dp 1, one
microbatch, cp 1, no checkpointing, as the op needs), and a plan that would not -- one the user
asks for (dp=2), or one given to the runtime (`check_plan`) -- is refused before any rank
starts, naming the op, its module and source line, and what to do. Per kind of op:

- batch_norm in training mode (`BATCH_NORMS` in autoplan/strategies/samples.py: aten.batch_norm,
  native_batch_norm, _native_batch_norm_legit, cudnn_batch_norm, ... with training=True)
  normalises each sample by the mean and variance of the batch: held to dp 1, one
  microbatch, cp 1.
- An op that reduces over the samples (a Partial under DTensor's rule: a sum, mean, variance or
  norm) or reads other samples (a matmul over them, a sort, cumsum or softmax along them;
  [Note: sample dims]): held likewise -- except the loss.
- The loss: a loss op (an aten op with a `reduction` argument) or a sum or mean over the
  samples, followed only by sums, means, additions and products with values the batch does not
  hold into a 0-d output. A mean of per-sample terms: [Note: step loss] in
  autoplan/runtime/step_inputs.py takes it as a mean over microbatches and dp ranks. Not held.
- An in-place update of a buffer from the batch (batch_norm's running_mean / running_var,
  instance_norm's running statistics, `buf.mul_(m).add_(x.mean(0))`) depends on the batch and
  on how often forward runs: held to dp 1, one microbatch, cp 1, no checkpointing.
- An in-place update of a buffer from nothing the batch holds (`num_batches_tracked.add_(1)`, a
  step counter) runs once per microbatch and again in a recompute: held to one microbatch and
  no checkpointing (dp ranks each update their own copy alike), and pp 1 where forward reads
  the buffer (each pp stage holds its own copy).
- A random draw per sample or without samples is keyed ([Note: RNG contract] in
  autoplan/passes/rng.py): exact under every plan; one with its samples on another dim is
  refused. One that a graph of one sample keys as the other kind ((1, T, C) noise broadcast
  over the samples: `one_sample_rows`) keeps microbatches of 2 or more samples (checked once
  the plan is made).
- A reduction over a dim a tp placement splits (a row-parallel matmul, a norm over a sharded
  hidden dim) is exact by construction: DTensor's rule gives a Partial that the planned
  redistribution reduces (the summation order differs: fp32 rounding, within the contract's
  rtol).

Eval-mode batch_norm, LayerNorm, GroupNorm, RMSNorm and InstanceNorm without running statistics
normalise each sample by its own statistics: nothing to hold. The facts come from [Note: sample
dims] (autoplan/strategies/samples.py); an op whose samples it cannot follow is not listed.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from autoplan.passes.rng import one_sample_misses, where
from autoplan.strategies.samples import SampleFacts, batch_norm_training, sample_facts

__all__ = ["Coupling", "batch_couplings", "held_overrides", "check_plan"]

aten = torch.ops.aten

_WHOLE_BATCH = ("dp", "num_microbatches", "cp")
_ONE_FORWARD = ("num_microbatches", "checkpointing")
_HELD = {"dp": 1, "num_microbatches": 1, "cp": 1, "checkpointing": "none", "pp": 1}
# given by the user, also kept: core-attention checkpointing recomputes attention alone
_ALSO_KEPT = {"checkpointing": ("core-attention",)}
# After the loss's reduction over the samples: ops that keep it a mean of per-sample terms.
_LINEAR = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor,
    aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.sum.default,
    aten.sum.dim_IntList, aten.mean.default, aten.mean.dim, aten.view.default,
    aten.reshape.default, aten._unsafe_view.default, aten.squeeze.default, aten.squeeze.dim,
    aten.unsqueeze.default, aten.clone.default, aten._to_copy.default, aten.to.dtype,
    aten.alias.default, aten.detach.default})
_VIEWS = frozenset({aten.slice.Tensor, aten.select.int, aten.view.default, aten.alias.default,
                    aten.narrow.default, aten.as_strided.default, aten.expand.default})


@dataclasses.dataclass(frozen=True)
class Coupling:
    """One op whose number depends on how the batch is cut ([Note: batch coupling]).

    Attributes:
        node: the graph node's name.
        where: the node, its op, module and source line (autoplan/passes/rng.py `where`).
        what: what its number depends on, in words.
        keeps: the plan choices it needs held: "dp", "num_microbatches", "cp", "pp" (1
            each), "checkpointing" ("none"; "core-attention", which recomputes attention
            alone, where asked for); "microbatch_size" (at least 2: a draw a graph of one
            sample keys as the other kind, checked once the plan is made).
        fix: what the user can do instead.
    """

    node: str
    where: str
    what: str
    keeps: tuple[str, ...]
    fix: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


_BN_FIX = ("keep the batch whole (dp 1 and one microbatch: tp or pp spread the model "
           "instead), normalise each sample by its own statistics (GroupNorm, LayerNorm), or "
           "freeze the statistics (the BatchNorm module in eval mode)")
_MIX_FIX = ("keep the batch whole (dp 1 and one microbatch: tp or pp spread the model "
            "instead), or compute it from each sample alone (a statistic of the data made "
            "before training can be given to the model as a buffer)")
_COUNT_FIX = ("keep one forward per step (one microbatch, no activation checkpointing), or "
              "update it outside forward (after the optimizer step)")


def batch_couplings(gm: torch.fx.GraphModule, buffers: set[str],
                    samples: SampleFacts | None = None, *,
                    batch_size: int | None = None) -> list[Coupling]:
    """Every op of captured graph `gm` whose number depends on how the batch is cut or how
    often a forward runs, in graph order ([Note: batch coupling]).

    Args:
        gm: the captured graph (global shapes in node.meta["val"]).
        buffers: FQNs of the model's buffers (get_attr targets).
        samples: `sample_facts(gm)`, where the caller has them; None: the kinds that need
            no sample tracking only (batch_norm in training mode, in-place buffer updates).
        batch_size: the capture's samples (CapturedGraph.batch_size).
    """
    found: dict[str, Coupling] = {}
    from_inputs = samples.from_inputs if samples is not None else _from_inputs(gm)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if batch_norm_training(node):
            found[node.name] = Coupling(
                node.name, where(node), "batch statistics: batch_norm in training mode "
                "normalises each sample by the mean and variance of the whole batch",
                _WHOLE_BATCH, _BN_FIX)
        for fqn, from_batch in _buffer_updates(node, buffers, from_inputs):
            keeps = _WHOLE_BATCH + ("checkpointing",) if from_batch else _ONE_FORWARD
            what = (f"updates buffer {fqn} in place from the batch" if from_batch else
                    f"updates buffer {fqn} in place each time the forward runs")
            if _read_elsewhere(gm, fqn, buffers):  # each pp stage holds its own copy
                keeps, what = keeps + ("pp",), what + ", and forward reads it"
            previous = found.get(node.name)
            found[node.name] = Coupling(
                node.name, where(node), (previous.what + "; " if previous else "") + what,
                tuple(dict.fromkeys((previous.keeps if previous else ()) + keeps)),
                _BN_FIX if previous or node.target in (aten.instance_norm.default,)
                else _COUNT_FIX if not from_batch else _MIX_FIX)
    if samples is not None:
        for name, why in samples.mixing.items():
            node = _node(gm, name)
            if name in found or _is_loss(node, samples):
                continue
            found[name] = Coupling(name, where(node), f"reads across samples ({why})",
                                   _WHOLE_BATCH, _MIX_FIX)
        for coupling in _one_sample_draws(gm, samples, batch_size):
            found.setdefault(coupling.node, coupling)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(found.values(), key=lambda c: order[c.node])


def _node(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def _from_inputs(gm: torch.fx.GraphModule) -> set[str]:
    """Names of the nodes whose value depends on a graph input."""
    out: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out


def _buffer_updates(node: torch.fx.Node, buffers: set[str], from_inputs: set[str]):
    """(buffer FQN, whether the new value depends on the batch) for each buffer `node`
    writes in place: through an argument its schema marks written (add_, copy_, mul_, ...:
    through views of the buffer too), or as the running statistics of batch_norm in
    training mode and of instance_norm with use_input_stats."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return
    names = [a.name for a in schema.arguments]
    written = [i for i, a in enumerate(schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]
    if batch_norm_training(node) or (node.target is aten.instance_norm.default
                                     and _arg(node, names, "use_input_stats") is not False):
        written += [names.index(n) for n in ("running_mean", "running_var") if n in names]
    reads_batch = any(a.name in from_inputs for a in node.all_input_nodes
                      if _buffer(a, buffers) is None)
    for i in written:
        value = node.args[i] if i < len(node.args) else node.kwargs.get(names[i])
        fqn = _buffer(value, buffers) if isinstance(value, torch.fx.Node) else None
        if fqn is not None:
            yield fqn, reads_batch


def _read_elsewhere(gm: torch.fx.GraphModule, fqn: str, buffers: set[str]) -> bool:
    """Whether an op reads buffer `fqn` other than to write it (a view of it, an in-place op
    on it, batch_norm's running statistics)."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target in _VIEWS or _in_place(node):
            continue
        schema = getattr(node.target, "_schema", None)
        names = [a.name for a in schema.arguments] if schema is not None else []
        for i, a in enumerate(node.args):
            if isinstance(a, torch.fx.Node) and _buffer(a, buffers) == fqn and not (
                    i < len(names) and names[i] in ("running_mean", "running_var")):
                return True
    return False


def _arg(node: torch.fx.Node, names: list[str], name: str):
    i = names.index(name)
    return node.args[i] if i < len(node.args) else node.kwargs.get(name)


def _buffer(value: torch.fx.Node, buffers: set[str]) -> str | None:
    """The FQN of the buffer `value` is (a view of it, or what an in-place op on it returns:
    `buf.mul_(m).add_(x)`), else None."""
    while value.op == "call_function" and (value.target in _VIEWS or _in_place(value)):
        value = value.args[0]
    return str(value.target) if value.op == "get_attr" and str(value.target) in buffers \
        else None


def _in_place(node: torch.fx.Node) -> bool:
    """Whether `node`'s op writes its first argument and returns it (add_, mul_, copy_)."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.arguments and node.args
                and schema.arguments[0].alias_info is not None
                and schema.arguments[0].alias_info.is_write
                and isinstance(node.args[0], torch.fx.Node))


def _is_loss(node: torch.fx.Node, samples: SampleFacts) -> bool:
    """Whether `node`, an op that reads across samples, is the loss's reduction over them: a
    loss op (an argument named `reduction`) or a sum/mean, followed only by `_LINEAR` ops
    (a product or quotient with a value the batch does not hold) into 0-d outputs."""
    schema = getattr(node.target, "_schema", None)
    is_reduction = node.target in _LINEAR and node.target not in (aten.add.Tensor,
                                                                     aten.sub.Tensor)
    if not (schema is not None and any(a.name == "reduction" for a in schema.arguments)
            or is_reduction and samples.mixing.get(node.name) == "sums over the samples"):
        return False
    frontier, seen = [node], {node.name}
    while frontier:
        value = frontier.pop()
        for user in value.users:
            if user.op == "output":
                val = value.meta.get("val")
                if not isinstance(val, torch.Tensor) or val.dim() != 0:
                    return False
                continue
            if user.target not in _LINEAR or samples.dim(user) is not None:
                return False
            elif user.target in (aten.mul.Tensor, aten.div.Tensor) and any(
                    a is not value and a.name in samples.from_inputs
                    for a in user.all_input_nodes):
                return False  # a product of two values of the batch
            if user.name not in seen:
                seen.add(user.name)
                frontier.append(user)
    return True


def _one_sample_draws(gm: torch.fx.GraphModule, samples: SampleFacts,
                      batch_size: int | None):
    """The draws a microbatch of one sample keys otherwise than this graph does
    (autoplan/passes/rng.py `one_sample_rows`): (1, T, C) noise broadcast over the samples
    looks per sample there, a (T, 1) mask per sample made by `torch.rand` looks shared."""
    if not batch_size or batch_size < 2:
        return
    for node, shape, rows in one_sample_misses(gm, samples, batch_size):
        what = (f"a draw over {shape} broadcast over the samples" if not rows else
                f"a draw over {shape}, {rows} rows per sample, made without an input")
        yield Coupling(
            node.name, where(node),
            f"{what}, which a microbatch of one sample cannot tell from "
            + ("one per sample" if not rows else "a draw without samples"),
            ("microbatch_size",),
            "plan microbatches of 2 or more samples (num_microbatches=), or "
            + ("draw it without its size-1 dim 0 (broadcasting adds it)" if not rows else
               "draw it over the activation (rand_like) or with its samples on dim 0 alone"))


def held_overrides(overrides: dict, couplings: list[Coupling], model_name: str) -> dict:
    """`overrides` (the user's plan options) with the choices `couplings` need held
    ([Note: batch coupling]): dp 1, num_microbatches 1, cp 1, checkpointing "none" as each
    coupling keeps.

    Raises:
        ValueError: an override that breaks a coupling (dp=2 with batch_norm in training
            mode), naming the op, its module and source line, and what to do.
    """
    out = dict(overrides)
    for coupling in couplings:
        for choice in coupling.keeps:
            if choice not in _HELD:
                continue
            given = out.get(choice)
            if given is None:
                out[choice] = _HELD[choice]
            elif given != _HELD[choice] and given not in _ALSO_KEPT.get(choice, ()):
                raise ValueError(_refusal(model_name, f"{choice}={given!r}", coupling))
    return out


def check_plan(plan, couplings: list[Coupling], model_name: str) -> None:
    """Refuse `plan` (a Plan) where it breaks a coupling ([Note: batch coupling]): ValueError
    naming the plan's choice, the op, its module and source line, and what to do."""
    chosen = {"dp": plan.mesh.dp, "num_microbatches": plan.num_microbatches,
              "cp": plan.mesh.cp, "checkpointing": plan.checkpointing, "pp": plan.mesh.pp}
    for coupling in couplings:
        for choice in coupling.keeps:
            if choice == "microbatch_size" and plan.microbatch_size == 1:
                raise ValueError(_refusal(model_name, "a microbatch of 1 sample "
                                          f"({plan.num_microbatches} per dp rank)", coupling))
            if choice in _HELD and chosen[choice] != _HELD[choice] and \
                    chosen[choice] not in _ALSO_KEPT.get(choice, ()):
                raise ValueError(_refusal(model_name, f"{choice} {chosen[choice]}", coupling))


def _refusal(model_name: str, choice: str, coupling: Coupling) -> str:
    return (f"{model_name}: the plan's {choice} would change what {coupling.where} computes "
            f"({coupling.what}; [Note: batch coupling] in autoplan/batch_coupling.py). "
            f"It needs {_needs(coupling.keeps)}: {coupling.fix}")


def _needs(keeps: tuple[str, ...]) -> str:
    words = {"dp": "dp 1", "num_microbatches": "one microbatch", "cp": "cp 1", "pp": "pp 1",
             "checkpointing": "no activation checkpointing",
             "microbatch_size": "microbatches of 2 or more samples"}
    return ", ".join(words[k] for k in keeps)
