"""A training step's batch checked in the user's words, and what a step measured.

`check_batch` runs before any rank computes: the same global batch is on every rank, so every
rank raises the same ValueError (no rank is left waiting in a collective). `StepMetrics` is
what `AutoParallel.step` measured beside what the plan predicted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

__all__ = ["IGNORE_INDEX", "check_batch", "check_ids", "checked_leaves", "embedding_rows",
           "is_token_pair", "StepMetrics"]

IGNORE_INDEX = -100  # F.cross_entropy's default: a label that is not trained on


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(d) for d in t.shape) + ")"


def check_batch(input_ids, labels, *, global_batch: int, seq_len: int,
                vocab_size: int | None) -> int:
    """Check one step's batch against the plan; returns the number of trained label tokens.

    input_ids, labels: (global_batch, seq_len) integer tensors (any width: the step takes
    them as int64); labels are token ids in [0, vocab_size) or IGNORE_INDEX (-100).

    Raises ValueError naming the argument, the expected and the given value: not a tensor, not
    integer, a shape other than the plan's, ids outside the vocabulary, or labels that are all
    IGNORE_INDEX (a step with nothing to train on: its mean loss is 0/0).
    """
    want = f"({global_batch}, {seq_len})"
    for name, t in (("input_ids", input_ids), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"step: {name} is a {type(t).__name__}; expected a tensor of "
                             f"shape {want} (global_batch, seq_len) of token ids")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"step: {name} has dtype {t.dtype}; expected integer token ids "
                             f"(torch.long), e.g. {name}.long()")
        if tuple(t.shape) != (global_batch, seq_len):
            what = []
            if t.dim() != 2:
                what.append(f"{t.dim()} dims, not 2")
            else:
                if t.shape[0] != global_batch:
                    what.append(f"{t.shape[0]} samples where the plan's global_batch is "
                                f"{global_batch}")
                if t.shape[1] != seq_len:
                    what.append(f"{t.shape[1]} tokens per sample where the plan's seq_len is "
                                f"{seq_len}")
            raise ValueError(f"step: {name} has shape {_shape(t)}; the plan was made for {want} "
                             f"(global_batch, seq_len): {'; '.join(what)}. A different batch "
                             "or length needs its own plan")
    if vocab_size is not None:
        check_ids(input_ids, "input_ids", vocab_size)
    trained = labels != IGNORE_INDEX
    count = int(trained.sum())
    if count == 0:
        raise ValueError(f"step: every one of the {labels.numel()} labels is {IGNORE_INDEX} "
                         "(ignored): the step has no token to train on and its mean loss "
                         "would be nan; drop the batch or give it at least one label")
    if vocab_size is not None:
        kept = labels[trained]
        low, high = int(kept.min()), int(kept.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"step: labels hold token id {bad}; expected ids in "
                             f"[0, {vocab_size}) or {IGNORE_INDEX} (ignored)")
    return count


def check_ids(ids: torch.Tensor, name: str, vocab_size: int) -> None:
    """Raises ValueError when integer `ids` (an embedding's indices) leave [0, vocab_size)."""
    if ids.numel() and not ids.is_floating_point():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"step: {name} holds token id {bad}; the model's vocabulary is "
                             f"[0, {vocab_size})")


def is_token_pair(batch: tuple) -> bool:
    """`step(input_ids, labels)`: two tensors."""
    return len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)


def checked_leaves(spec, batch: tuple, vocab: dict[str, int], input_names: tuple[str, ...], *,
                   seq_len: int) -> list[torch.Tensor]:
    """The leaves of `step`'s arguments `batch` under `spec` (autoplan.inputs.InputSpec),
    checked: the form, then `check_batch` for a token pair, `spec.flatten` and the ids of
    every input that indexes an embedding (`vocab`: input name -> rows, `input_names`: the
    graph's inputs) otherwise. Narrower integers are taken as int64. Raises ValueError naming
    the value at fault."""
    tokens = is_token_pair(batch)
    if len(batch) not in (1, 2) or (len(batch) == 2 and not tokens):
        raise ValueError(f"step: got {len(batch)} arguments; give step(batch) (a dict, "
                         "tuple or tensor) or step(input_ids, labels)")
    if (spec.form == "tokens") != tokens:
        raise ValueError(f"step: the plan was made for a {spec.describe()}; got "
                         f"{'step(input_ids, labels)' if tokens else 'step(batch)'}")
    if tokens:
        check_batch(*batch, global_batch=spec.global_batch, seq_len=seq_len,
                    vocab_size=vocab.get(input_names[0]))
        return [t.long() for t in batch]  # int32, uint8 ids: as int64
    leaves = spec.flatten(batch[0])
    by_name = dict(zip(input_names, spec.model_leaves))
    for name, rows in vocab.items():
        leaf = by_name.get(name)
        if leaf is not None:
            check_ids(leaves[spec.leaves.index(leaf)], leaf.name, rows)
    return leaves


def embedding_rows(graph) -> dict[str, int]:
    """Rows of each embedding that a graph input indexes (an `aten.embedding` whose indices
    are the input, through views), by input name."""
    out = {}
    for node in graph.gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.embedding.default:
            indices = node.args[1]
            while indices.op == "call_function" and indices.args and isinstance(
                    indices.args[0], torch.fx.Node):  # views of the ids
                indices = indices.args[0]
            val = node.args[0].meta.get("val")
            if indices.op == "placeholder" and val is not None:
                out.setdefault(indices.name, int(val.shape[0]))
    return out


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step as measured on this rank, beside the plan's prediction.

    Attributes:
        step: 1 for the first step (the build before it is not counted).
        loss: the global mean token loss (every rank).
        step_time_s: wall time of the step on this rank, seconds.
        tokens: tokens in the global batch (global_batch x seq_len).
        tokens_per_s: tokens / step_time_s, the whole job.
        mfu: model FLOPs utilisation measured: the plan's model FLOPs per step over
            (step_time_s x world size x the device's dense peak FLOP/s for the dtype), i.e.
            the plan's predicted MFU scaled by predicted / measured step time.
        peak_memory_bytes: this rank's peak during the step (CUDA max allocated on GPU; on
            CPU the whole process's resident-set high-water mark, which also holds the
            interpreter, the libraries and allocator slack: larger than the tensor bytes the
            plan predicts, most of all for a tiny model; `memory_stats()` gives it above the
            process's baseline, which is 0 when a step touches no new pages).
        predicted_step_time_s, predicted_mfu, predicted_peak_memory_bytes: the plan's (the
            last: tensor bytes of the most loaded rank).
        memory_measure: "cuda_max_allocated" | "resident_hwm".
    """

    step: int
    loss: float
    step_time_s: float
    tokens: int
    tokens_per_s: float
    mfu: float
    peak_memory_bytes: int | None
    predicted_step_time_s: float
    predicted_mfu: float
    predicted_peak_memory_bytes: float
    memory_measure: str = "resident_hwm"

    def __str__(self) -> str:
        from autoplan.units import fmt_bytes, fmt_pct, fmt_time

        mem = fmt_bytes(self.peak_memory_bytes) if self.peak_memory_bytes is not None else "?"
        how = "allocated" if self.memory_measure == "cuda_max_allocated" else "resident"
        return (f"step {self.step}: loss {self.loss:.4f}, {fmt_time(self.step_time_s)} "
                f"(plan {fmt_time(self.predicted_step_time_s)}), "
                f"{self.tokens_per_s:,.0f} tokens/s, MFU {fmt_pct(self.mfu)} "
                f"(plan {fmt_pct(self.predicted_mfu)}), peak {mem} {how} "
                f"(plan {fmt_bytes(self.predicted_peak_memory_bytes)} of tensors)")
