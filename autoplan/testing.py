"""The correctness contract as code: train a model on one process and under a plan on N ranks,
and compare every step's loss and every parameter (DESIGN.md, "The correctness contract").

    ref = reference(factory, batches)                          # one process, eager
    results = LocalCluster(4).run(train_planned, factory, batches, dict(dp=2, tp=2))
    for result in results:
        problems = compare(result, ref)                        # [] when the plan is exact

A *factory* is a picklable callable (a module-level function or a functools.partial of one)
that builds the model on torch's default device with torch's generator, seeded by both sides
with `torch.manual_seed(SEED)` just before the call: the reference calls it, every rank calls
it decorated by `@autoparallel`, whose recorded construction gives each rank's shards the
weights the reference has ([Note: sharded construction] in autoplan/runtime/weights.py: the
generator state when the factory is called is the one replayed, so a factory must not seed
torch itself). A batch is either a token pair `(input_ids, labels)` -- autoplan's token-LM form,
given to `AutoParallel.step(input_ids, labels)` -- or a dict of named tensors holding "labels",
given whole to `AutoParallel.step(batch)`; on one process the model is called with every other
key (`model(**batch)`). The loss is the mean cross-entropy of the logits against the labels over
the whole global batch, labels -100 ignored (`cross_entropy`): the default loss of
`@autoparallel`. Both sides step AdamW (`adamw`), and draw dropout (every random op) from the
stream keyed by (seed, step, op, sample) of [Note: RNG contract] in autoplan/passes/rng.py, so
that models with dropout (most Hugging Face configs' default) are compared as they train.

Used by the tests (tests/_jobs.py), the coverage bench (bench/coverage.py) and the examples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LR", "SEED", "adamw", "compare", "cross_entropy", "model_logits", "reference",
           "split_weights_budget", "train_planned", "token_batches"]

LR = 1e-3
"""Learning rate of `adamw`: large enough that 3 steps move every parameter measurably."""
SEED = 0
"""Seed of the weights and of the random ops' stream, on both sides."""


def adamw(params):
    """AdamW at LR with eps = 1e-6. Reduction order differs between one process and N ranks, so a
    gradient that is (nearly) zero -- GPT-2's key bias has an exactly zero one, softmax being
    shift-invariant -- carries rounding noise dg ~ 1e-10 of its own size. Adam turns it into a
    parameter step of up to lr * |dg| / eps: 1e-5 with torch's default eps = 1e-8 (over the
    1e-6 tolerance, for reasons that have nothing to do with parallelism), 1e-7 with 1e-6."""
    return torch.optim.AdamW(params, lr=LR, eps=1e-6)


def token_batches(vocab: int, steps: int, batch: int, seq: int, seed: int = 1):
    """Seeded token batches: (input_ids, labels), each (steps, batch, seq) int64, labels the
    next tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (steps, batch, seq + 1), generator=g)
    return x[..., :-1], x[..., 1:]


def model_logits(model: nn.Module, inputs) -> torch.Tensor:
    """The model's logits for `inputs` (a tensor of token ids, or a dict of named inputs):
    HF models with `use_cache=False` where their config has a cache, `.logits` of a
    ModelOutput, a plain module's output as it is."""
    kwargs = dict(inputs) if isinstance(inputs, dict) else {}
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        kwargs["use_cache"] = False
    out = model(**kwargs) if isinstance(inputs, dict) else model(inputs, **kwargs)
    return out.logits if hasattr(out, "logits") else out


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every label that is not -100. logits: (..., C) with one class
    dim last (tokens (B, T, C) or samples (B, C)); labels: the leading dims, int64."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=-100)


def _split(batch) -> tuple[object, torch.Tensor]:
    """(model inputs, labels) of a token pair or a dict with "labels"."""
    if isinstance(batch, dict):
        return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]
    return batch[0], batch[1]


def reference(factory, batches: list) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train `factory()` on one process, one AdamW step per batch of `batches`, random ops
    keyed by (SEED, step): (the loss of every step, every parameter after the last step by
    FQN)."""
    from autoplan.passes.rng import keyed_random_ops

    torch.manual_seed(SEED)
    model = factory()
    model.train()
    opt = adamw(model.parameters())
    losses = []
    for step, batch in enumerate(batches):
        inputs, labels = _split(batch)
        opt.zero_grad()
        with keyed_random_ops(SEED, step=step):
            loss = cross_entropy(model_logits(model, inputs), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _batch_options(batch, global_batch: int, seq_len: int) -> dict:
    """How `@autoparallel` is told the batch: the token form by seq_len, a dict by
    `example_batch=` (the dict itself; its shapes set the plan's)."""
    if isinstance(batch, dict):
        return dict(global_batch=global_batch, example_batch=batch)
    return dict(global_batch=global_batch, seq_len=seq_len)


def split_weights_budget(model: nn.Module, overrides: dict, batch, *, global_batch: int,
                         seq_len: int, world_size: int) -> float | None:
    """A per-device memory budget (bytes) 0.9 of what `model`'s plan for `world_size` ranks
    needs with ample memory: under it a tp plan has to split weights instead of replicating
    them (a tiny model is latency-bound, and with ample memory the solver replicates). None
    without tp. Plans outside any process group (`model` may be on meta) for `batch` (a
    token pair or a dict, as `train_planned` steps)."""
    from autoplan.api import autoparallel

    if overrides.get("tp", 1) == 1:
        return None
    ample = autoparallel(model, world_size=world_size,
                         **_batch_options(batch, global_batch, seq_len), **overrides)
    return ample.plan.prediction.memory_bytes * 0.9


def train_planned(factory, batches: list, overrides: dict, *, global_batch: int, seq_len: int,
                  device_memory_bytes: float | None = None) -> tuple[list[float], dict, str]:
    """On every rank of a process group: decorate `factory` (its construction is recorded on
    the meta device and each rank replays it on its own shards, as for a user's model class),
    plan with `overrides` (tp, dp, pp, ...) and at most `device_memory_bytes` per device (see
    `split_weights_budget`), step once per batch (the same global batches on every rank;
    random ops seeded by SEED), and return (losses, this rank's full parameters by FQN, the
    plan as JSON)."""
    from autoplan.api import autoparallel

    decorated = autoparallel(factory, optimizer=adamw, seed=SEED,
                             device_memory_bytes=device_memory_bytes,
                             **_batch_options(batches[0], global_batch, seq_len), **overrides)
    torch.manual_seed(SEED)
    ap = decorated()
    losses = []
    for batch in batches:
        losses.append(ap.step(batch) if isinstance(batch, dict) else ap.step(*batch))
    return losses, ap.state_dict(), ap.plan.to_json()


def compare(result, ref, *, rtol: float = 1e-5, atol: float = 1e-6) -> list[str]:
    """What differs between one rank's `train_planned` result and the `reference`: a line per
    loss or parameter out of tolerance (torch.testing.assert_close's), [] when none is."""
    problems = []
    try:
        torch.testing.assert_close(torch.tensor(result[0]), torch.tensor(ref[0]), rtol=rtol,
                                   atol=atol)
    except AssertionError as e:
        problems.append(f"losses {result[0]} vs {ref[0]}: {str(e).splitlines()[0]}")
    for fqn, value in result[1].items():
        if fqn not in ref[1]:
            problems.append(f"{fqn}: not a parameter of the model on one process")
            continue
        try:
            torch.testing.assert_close(value, ref[1][fqn], rtol=rtol, atol=atol)
        except AssertionError as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            problems.append(f"{fqn}: {'; '.join(lines[:3])}")
    return problems
