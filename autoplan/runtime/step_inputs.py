"""How a step's batch reaches the stages and the loss: the dp and microbatch split of every
tensor along its batch dim, the model's inputs, what the loss reads, and the loss itself.

[Note: step loss] A step's loss is, in this order of choice:
- `loss_fn(output, target)` when the user gives one: the token-LM form (`step(input_ids,
  labels)`) passes `(logits, labels)`; every other form passes the model's output (rebuilt:
  a ModelOutput, tuple, dict, tensor) and the batch as given to `step`, both cut to the
  microbatch. It is the microbatch's mean loss; the step's loss is the mean over microbatches
  and dp ranks (gradient accumulation divides by m, dp gradients are averaged).
- the model's own `loss` output (an HF model given `labels`), a microbatch mean likewise;
- the token cross-entropy of the main output (`logits`) against the batch's `labels`, -100
  ignored, weighted so that the step's loss is the mean over the *global* batch's trained
  tokens, as one process computes it on the whole batch (`token_loss`).

Under context parallelism (cp > 1, [Note: context parallelism] in autoplan/cost_model/context_parallel.py)
only the last applies, to the token-LM form: the labels are the next tokens already (the
token loss reads `labels[t]` as the target of position t and shifts nothing), so cutting
input_ids and labels into the same 2 cp chunks (chunks i and 2 cp - 1 - i on cp rank i) gives
every rank the targets of its own positions, the last position's included; each rank's
summed token loss is weighted by cp x num_microbatches x dp / the global batch's trained
tokens, and gradients and the step's loss are averaged over the dp x cp ranks. The model's own
loss (Hugging Face shifts its labels inside, per local chunk: it would pair a chunk's last
token with the wrong target and drop a target per chunk) and a user's loss_fn (a mean over
the rank's tokens, weighted per rank, not per token) are refused (runtime/checks.py).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from autoplan._torch_compat import concrete_value
from autoplan.graph import CapturedGraph
from autoplan.inputs import InputSpec
from autoplan.passes.context_parallel import chunk_positions

__all__ = ["StepInputs", "loss_mode"]


def loss_mode(graph: CapturedGraph, inputs: InputSpec, loss_fn: Callable | None) -> str:
    """[Note: step loss]: "user", "model" or "tokens". Raises ValueError when there is no
    loss to take: no loss_fn, no `loss` output and no `labels` in the batch."""
    if loss_fn is not None:
        return "user"
    if graph.output_index("loss") is not None:
        return "model"
    if any(leaf.name == "labels" for leaf in inputs.leaves):
        return "tokens"
    raise ValueError(
        f"{graph.model_name}: no loss to train on: no loss_fn= was given, the model returns "
        f"no `loss` (its outputs: {list(graph.output_names)}) and the batch has no `labels` "
        f"(it has {[leaf.name for leaf in inputs.leaves]}); give loss_fn=(output, batch) -> "
        "scalar, or labels the model takes")


class StepInputs:
    """One rank's view of the step's batch.

    Args:
        graph: the runtime graph (its outputs' names and structure).
        inputs: the planned batch (autoplan.inputs.InputSpec).
        loss_fn: the user's loss, or None.
        global_batch, num_microbatches, dp, dp_rank: the plan's split.
        device: where this rank computes.
        cp, cp_rank: the context-parallel degree and this rank's index on the cp axis (token-LM
            form only: the leaves, (B, s), keep this rank's 2 of 2 cp sequence chunks).

    Attributes:
        mode: "user" | "model" | "tokens" ([Note: step loss]).
        targets: what the loss reads for each microbatch of the step now running.
        token_scale: num_microbatches x dp / trained tokens of the global batch (token loss).
    Raises ValueError (at construction) when there is no loss to take.
    """

    def __init__(self, graph: CapturedGraph, inputs: InputSpec, loss_fn: Callable | None, *,
                 global_batch: int, num_microbatches: int, dp: int, dp_rank: int,
                 device: torch.device, cp: int = 1, cp_rank: int = 0):
        self.graph, self.inputs, self.loss_fn = graph, inputs, loss_fn
        self.mode = loss_mode(graph, inputs, loss_fn)
        self.global_batch, self.m, self.dp, self.dp_rank = (global_batch, num_microbatches,
                                                             dp, dp_rank)
        self.device = device
        self.cp = cp
        # the global positions of this cp rank's tokens (s / cp,), None without cp
        self.positions: torch.Tensor | None = None
        if cp > 1:
            seq_len = inputs.leaves[0].shape[1]  # the token form: (B, s)
            self.positions = chunk_positions(seq_len, cp, cp_rank).to(device)
        self.targets: list = []
        self.token_scale = 1.0
        # (tp group, first token id of this rank's shard, vocabulary size) when the stage
        # returns vocab-sharded logits (passes/kernels.py keep_logits_sharded); else None
        self.vocab_parallel: tuple[object, int, int] | None = None

    # -- the split ---------------------------------------------------------------------------
    def split(self, leaves: list[torch.Tensor], n: int) -> list[list[torch.Tensor]]:
        """The leaves cut into `n` parts along their batch dims ([Note: batch dims] in
        autoplan/inputs.py); a leaf without one is whole in every part."""
        cut = [t.chunk(n, leaf.batch_dim) if leaf.batch_dim is not None else [t] * n
               for leaf, t in zip(self.inputs.leaves, leaves)]
        return [[c[j] for c in cut] for j in range(n)]

    def local(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """This dp rank's part of the global batch's leaves, on the device. Raises ValueError
        for a leaf whose batch dim is not the plan's global batch."""
        for leaf, t in zip(self.inputs.leaves, leaves):
            if leaf.batch_dim is not None and t.shape[leaf.batch_dim] != self.global_batch:
                raise ValueError(
                    f"batch value {leaf.name} has {t.shape[leaf.batch_dim]} samples; the plan "
                    f"was made for global_batch {self.global_batch}")
        local = [t.to(self.device) for t in self.split(leaves, self.dp)[self.dp_rank]]
        if self.positions is not None:  # token form: (B, s) ids and labels, s on dim 1
            local = [t.index_select(1, self.positions) for t in local]
        return local

    def start(self, leaves: list[torch.Tensor], local: list[torch.Tensor],
              training: bool = True) -> list[list[torch.Tensor]]:
        """Begin a step on the global `leaves` (this rank's part: `local`): the token loss's
        weight and each microbatch's target; returns the microbatches of `local`. Raises
        ValueError when training on a token batch whose labels are all -100."""
        if self.mode == "tokens":
            labels = leaves[self._labels_index()]
            # a dry run's fake labels have no values: every one counts as trained
            trained = int(concrete_value((labels != -100).sum(), labels.numel()))
            if trained == 0 and training:
                raise ValueError(f"step: every one of the {labels.numel()} labels is -100 "
                                 "(ignored)")
            self.token_scale = self.m * self.dp * self.cp / max(trained, 1)
        parts = self.split(local, self.m)
        self.targets = [self._target(p) for p in parts]
        return parts

    def model_inputs(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """The leaves the model takes, in the graph's input order; a floating one in the
        dtype the graph was captured with ([Note: floating inputs]).

        [Note: floating inputs] Under a 16-bit plan the model runs on its 16-bit compute
        copy, so a floating input (an image's pixel values, audio features) is cast to the
        compute dtype where it enters the model, as autocast or FSDP2's
        `cast_forward_inputs` would: a bf16 convolution does not take fp32 pixels. Capture
        casts the example the same way (session.py `_capture`), so the graph's input dtypes
        say what the runtime feeds; integer inputs (token ids) and what the loss reads of the
        batch (the labels, a user loss_fn's batch) are left as given."""
        out = [t for leaf, t in zip(self.inputs.leaves, leaves) if leaf.to_model]
        dtypes = self.graph.input_dtypes
        if len(dtypes) != len(out):
            return out
        return [t.to(getattr(torch, d)) if t.is_floating_point() and
                getattr(torch, d).is_floating_point else t for t, d in zip(out, dtypes)]

    @property
    def batch_dims(self) -> list[int | None]:
        """The batch dim of each graph input."""
        return [leaf.batch_dim for leaf in self.inputs.model_leaves]

    def _labels_index(self) -> int:
        return next(i for i, leaf in enumerate(self.inputs.leaves) if leaf.name == "labels")

    def _target(self, leaves: list[torch.Tensor]):
        """What the loss reads of these leaves: the labels (token loss, token-LM form), the
        batch as given (a user loss_fn), nothing (the model's own loss)."""
        if self.mode == "model":
            return None
        if self.mode == "tokens" or self.inputs.form == "tokens":
            return leaves[self._labels_index()]
        return pytree.tree_unflatten(list(leaves), self.inputs.treespec)

    # -- the loss ----------------------------------------------------------------------------
    def loss(self, output, target) -> torch.Tensor:
        """One microbatch's loss from the stage's output (a tensor or the flat tuple of the
        model output's tensors) and its target ([Note: step loss])."""
        flat = output if isinstance(output, tuple) else (output,)
        if self.mode == "user":  # the token-LM form's loss_fn takes (logits, labels)
            out = flat[self.graph.main_output_index] if self.inputs.form == "tokens" \
                else self.graph.unflatten_output(flat)
            return self.loss_fn(out, target)
        if self.mode == "model":
            return flat[self.graph.output_index("loss")]
        return self.token_loss(flat[self.graph.main_output_index], target)

    def token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One microbatch's share of the global batch's mean token cross-entropy, in the units
        the schedules expect (a microbatch mean, averaged over microbatches and dp ranks): its
        summed token losses x num_microbatches x dp / the batch's trained tokens. Labels -100
        are not trained on; where they are spread unevenly over microbatches this is still the
        mean over the global batch's trained tokens, as one process computes it."""
        if self.vocab_parallel is not None:  # logits (..., V_local): this tp rank's shard
            from kernels import vocab_parallel_cross_entropy

            group, vocab_start, _ = self.vocab_parallel
            ce = vocab_parallel_cross_entropy(logits, labels, vocab_start, group,
                                              reduction="sum")
            return ce * self.token_scale
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                             reduction="sum")
        return ce * self.token_scale
