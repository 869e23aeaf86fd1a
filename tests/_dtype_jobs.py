"""Jobs of tests/test_checkpoint_dtype.py, run on every rank of a test cluster, and their
single-process references: a checkpoint's dtype as the compute dtype ([Note: dtype of the
weights] in autoplan/runtime/construction.py), frozen parameters held in the compute dtype
(`Plan.frozen_dtype`, [Note: precision recipe])."""

from __future__ import annotations

import dataclasses
import functools

import torch

from _jobs import SEQ, adamw, batches, preset, vocab_of

# llama-tiny's frozen part: the token embedding and the first block's attention and MLP
FROZEN = ("model.embed_tokens.weight", "model.layers.0.self_attn.", "model.layers.0.mlp.")


def _is_frozen(fqn: str) -> bool:
    return fqn.startswith(FROZEN)


def _partly_frozen(seed: int):
    model = preset("llama-tiny", seed)()
    for fqn, p in model.named_parameters():
        p.requires_grad_(not _is_frozen(fqn))
    return model


def partly_frozen(seed: int = 0):
    """Factory: llama-tiny with seeded weights and the `FROZEN` parameters frozen."""
    return functools.partial(_partly_frozen, seed)


def _hf_load(path: str, dtype: torch.dtype | None):
    import transformers

    kwargs = {} if dtype is None else {"dtype": dtype}
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa",
                                                             **kwargs)


def hf_loader(path: str, dtype: torch.dtype | None = None):
    """Factory: the HF model in `path`, loaded whole on this process (in `dtype` if given)."""
    return functools.partial(_hf_load, path, dtype)


def train_from_checkpoint(path: str, steps: int, batch: int, overrides: dict, *,
                          seq: int = SEQ):
    """On every rank: `autoplan.from_pretrained(path, **overrides)` (dtype= or not), train.
    Returns (losses, full parameters, dtypes of the held parameters, ap.dtype, its origin,
    the report's dtype line)."""
    import autoplan

    ap = autoplan.from_pretrained(path, global_batch=batch, seq_len=seq, optimizer=adamw,
                                  **overrides)
    x, y = batches(vocab_of(ap.module), steps, batch, seq)
    losses = [ap.step(x[i], y[i]) for i in range(steps)]
    held = {str(p.dtype) for p in ap._engine._unique_params()}
    line = next(l for l in ap.report().splitlines() if l.startswith("| dtype"))
    return losses, ap.state_dict(), held, ap.dtype, ap.dtype_origin, line


def train_frozen(factory, steps: int, batch: int, overrides: dict, dtype: str,
                 frozen_dtype: str, *, seq: int = SEQ):
    """On every rank: plan `factory()` under `dtype`, then run that plan with `frozen_dtype`
    (the planner's choice, set here over it), and train. Returns (losses, full parameters,
    {fqn: local dtype}, memory_stats()["local_param_bytes"], the frozen parameters' local
    elements, the recipe in words, check_against_plan's message for the plan with the other
    frozen_dtype)."""
    from autoplan.api import autoparallel
    from autoplan.runtime.checks import PlanMismatchError, check_against_plan
    from autoplan.runtime.parallel import local_tensor

    model = factory()
    ap = autoparallel(model, global_batch=batch, seq_len=seq, optimizer=adamw, dtype=dtype,
                      **overrides)
    ap._plan = dataclasses.replace(ap.plan, frozen_dtype=frozen_dtype)
    x, y = batches(vocab_of(model), steps, batch, seq)
    losses = [ap.step(x[i], y[i]) for i in range(steps)]
    engine = ap._engine
    held = {fqn: str(p.dtype) for fqn, p in engine._unique_named_params()}
    frozen_numel = sum(local_tensor(p).numel() for _, p in engine._unique_named_params()
                       if not p.requires_grad)
    plan = engine.plan
    engine.plan = dataclasses.replace(plan, frozen_dtype="" if frozen_dtype else dtype)
    try:
        check_against_plan(engine)
        mismatch = None
    except PlanMismatchError as e:
        mismatch = str(e)
    engine.plan = plan
    return (losses, ap.state_dict(), held, ap.memory_stats()["local_param_bytes"],
            frozen_numel, engine.precision.describe(), mismatch)
