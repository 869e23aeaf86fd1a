"""The correctness contract as code: train a model on one process and under a plan on N ranks,
and compare every step's loss and every parameter (docs/design.md, "The correctness contract").

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

[Note: AdamW rounding allowance] N ranks sum a gradient in another order than one process,
so each gradient element carries fp32 rounding noise dg <= C * u * max|G| (u = 2^-24, the unit
roundoff; max|G| the largest element of that parameter's gradient at that step, the scale of
the terms an element's sum cancels; C = ALLOWANCE_ROUNDINGS). AdamW's step
lr * m_hat / (sqrt(v_hat) + eps) moves by up to lr * dg / (sqrt(v_hat) + eps) for it: nothing
for an ordinary element (|g| ~ 3e-3: 1e-9), but lr / eps = 1e3 times dg for an element whose
gradient is nearly zero. Measured: GPT-NeoX (tiny, 3 steps) layers.1.mlp.dense_h_to_4h element
(19, 15) has g = 2.5e-8 at step 0 against max|G| = 2.5e-2, so dg ~ 1.5e-9 becomes ~1.5e-6 of
parameter (0.9e-6 and 1.8e-6 in two runs at dp2xtp2, the latter over atol 1e-6); gpt2-tiny
loaded from HF files (seed 3) h.1.attn.c_proj.weight element (8, 10) has g = 1.6e-8 at step 0
and differs by 1.75e-6 at dp2xtp2 on an AMD EPYC (AVX-512) machine, by less on an Intel one.
One process itself moves that much (accumulating two half batches instead of one whole batch
changes parameters by up to 6.4e-7, and fp32 differs from fp64 by up to 1.0e-6). So a parameter
element passes when |planned - one process| <= atol + rtol * |one process| + sum over steps of
lr * C * u * max|G_t| / (sqrt(v_hat_t) + eps), with G_t and v_hat_t (AdamW's, from G_t, betas
(0.9, 0.999)) of the one-process run (`adamw_allowance`). The allowance is per element and
vanishes wherever the gradient is not nearly zero, so a real difference (a wrong rotary slice, a
missing reduction: whole rows of ordinary elements) still fails.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LR", "SEED", "ALLOWANCE_ROUNDINGS", "adamw", "adamw_allowance",
           "assert_params_close", "compare", "cross_entropy", "model_logits", "reference",
           "split_weights_budget", "train_planned", "token_batches"]

ALLOWANCE_ROUNDINGS = 4
"""C of [Note: AdamW rounding allowance]: roundings of max|G| an element's noise may reach."""
_UNIT_ROUNDOFF = 2.0 ** -24  # fp32

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


def reference(factory, batches: list) -> tuple[list[float], dict[str, torch.Tensor],
                                              dict[str, torch.Tensor]]:
    """Train `factory()` on one process, one AdamW step per batch of `batches`, random ops
    keyed by (SEED, step): (the loss of every step, every parameter after the last step by
    FQN, each parameter's [Note: AdamW rounding allowance])."""
    from autoplan.passes.rng import keyed_random_ops

    torch.manual_seed(SEED)
    model = factory()
    model.train()
    opt = adamw(model.parameters())
    losses, grads = [], {}
    for step, batch in enumerate(batches):
        inputs, labels = _split(batch)
        opt.zero_grad()
        with keyed_random_ops(SEED, step=step):
            loss = cross_entropy(model_logits(model, inputs), labels)
        loss.backward()
        record_gradients(model, grads)
        opt.step()
        losses.append(loss.item())
    return (losses, {k: v.detach().clone() for k, v in model.named_parameters()},
            adamw_allowance(grads))


def record_gradients(model: nn.Module, grads: dict[str, list[torch.Tensor]]) -> None:
    """Append each parameter's gradient (as the optimizer is about to see it) to
    grads[FQN]; a parameter without one (unused this step) gets zeros."""
    for fqn, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        grads.setdefault(fqn, []).append(g.detach().clone())


def adamw_allowance(grads: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per parameter element, how far a planned run may differ from the one-process run
    beyond rtol/atol after `adamw` steps whose gradients were `grads` (FQN -> one tensor per
    step): [Note: AdamW rounding allowance]."""
    defaults = adamw([torch.zeros(1)]).defaults
    (_, beta2), eps, lr = defaults["betas"], defaults["eps"], defaults["lr"]
    allowance = {}
    for fqn, gs in grads.items():
        v, total = torch.zeros_like(gs[0]), torch.zeros_like(gs[0])
        for t, g in enumerate(gs, start=1):
            v = beta2 * v + (1 - beta2) * g * g
            v_hat = v / (1 - beta2 ** t)
            noise = ALLOWANCE_ROUNDINGS * _UNIT_ROUNDOFF * g.abs().max()
            total += lr * noise / (v_hat.sqrt() + eps)
        allowance[fqn] = total
    return allowance


def _param_problem(fqn: str, value: torch.Tensor, want: torch.Tensor, rtol: float, atol: float,
                   allowance: torch.Tensor | None) -> str | None:
    """A line saying how `value` differs from `want` beyond rtol/atol and the element's
    AdamW allowance, or None."""
    if value.shape != want.shape:
        return f"{fqn}: shape {tuple(value.shape)} vs {tuple(want.shape)}"
    diff = (value.detach().double() - want.double()).abs()
    bound = atol + rtol * want.double().abs()
    if allowance is not None:
        bound = bound + allowance.double()
    beyond = ~(diff <= bound)  # NaN differs
    if not beyond.any():
        return None
    i = int(torch.where(beyond, diff.nan_to_num(float("inf")), 0).flatten().argmax())
    return (f"{fqn}: {int(beyond.sum())} of {want.numel()} elements differ beyond rtol {rtol}, "
            f"atol {atol}" + (" and the AdamW allowance" if allowance is not None else "")
            + f"; first {diff.flatten()[i].item():.2e} > {bound.flatten()[i].item():.2e} at "
            f"flat index {i} ({value.flatten()[i].item():.7g} vs {want.flatten()[i].item():.7g})")


def assert_params_close(params: dict[str, torch.Tensor], ref_params: dict[str, torch.Tensor],
                        allowance: dict[str, torch.Tensor] | None = None, *,
                        rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """AssertionError naming every parameter of `params` that differs from `ref_params`
    beyond rtol/atol plus its [Note: AdamW rounding allowance] (`allowance`, None: none)."""
    problems = []
    for fqn, value in params.items():
        if fqn not in ref_params:
            problems.append(f"{fqn}: not a parameter of the model on one process")
            continue
        line = _param_problem(fqn, value, ref_params[fqn], rtol, atol,
                              None if allowance is None else allowance.get(fqn))
        if line:
            problems.append(line)
    if problems:
        raise AssertionError("\n".join(problems))


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
    loss out of tolerance (torch.testing.assert_close's) or parameter beyond it plus the
    reference's [Note: AdamW rounding allowance] (its first dict after the parameters:
    `reference`'s third element, tests/_jobs.py's fourth), [] when none is."""
    problems = []
    try:
        torch.testing.assert_close(torch.tensor(result[0]), torch.tensor(ref[0]), rtol=rtol,
                                   atol=atol)
    except AssertionError as e:
        problems.append(f"losses {result[0]} vs {ref[0]}: {str(e).splitlines()[0]}")
    allowance = next((r for r in ref[2:] if isinstance(r, dict)), {})
    for fqn, value in result[1].items():
        if fqn not in ref[1]:
            problems.append(f"{fqn}: not a parameter of the model on one process")
            continue
        line = _param_problem(fqn, value, ref[1][fqn], rtol, atol, allowance.get(fqn))
        if line:
            problems.append(line)
    return problems
