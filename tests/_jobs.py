"""Jobs that run on every rank of a test cluster, and their single-process references.

A model is named by a *factory*: a picklable callable (module-level function or
functools.partial of one) returning the model with seeded weights, so every rank and the
reference start from the same weights; batches are seeded the same way.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from autoplan.runtime.engine import cross_entropy_loss
from autoplan.testing import LR, adamw, token_batches  # noqa: F401 - LR, adamw: for the tests
from autoplan.testing import model_logits as logits

SEQ = 16


def _preset(name: str, seed: int, overrides: dict):
    from autoplan.models import build_model

    torch.manual_seed(seed)
    return build_model(name, device="cpu", **overrides)


def preset(name: str, seed: int = 0, **overrides):
    """Factory for a model preset (HF config) with seeded random weights."""
    return functools.partial(_preset, name, seed, overrides)


def vocab_of(model) -> int:
    if hasattr(model, "config") and hasattr(model.config, "vocab_size"):
        return model.config.vocab_size
    return model.vocab_size


def batches(vocab: int, steps: int, batch: int, seq: int = SEQ, seed: int = 1):
    """autoplan.testing.token_batches at the tests' sequence length."""
    return token_batches(vocab, steps, batch, seq, seed)


def reference(factory, steps: int, batch: int, *, accumulation: int = 1,
              max_grad_norm: float | None = None, seq: int = SEQ):
    """Single-process training: (losses per step, parameters after the last step, grad norms
    before clipping, each parameter's [Note: AdamW rounding allowance] in autoplan/testing.py).
    """
    from autoplan.testing import adamw_allowance, record_gradients

    model = factory()
    opt = adamw(model.parameters())
    x, y = batches(vocab_of(model), steps, batch, seq)
    losses, norms, grads = [], [], {}
    for i in range(steps):
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x[i].chunk(accumulation), y[i].chunk(accumulation)):
            loss = cross_entropy_loss(logits(model, xm), ym) / accumulation
            loss.backward()
            total += loss.item()
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                              max_grad_norm)))
        record_gradients(model, grads)
        opt.step()
        losses.append(total)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return losses, params, norms, adamw_allowance(grads)


def memory_budget(factory, batch: int, overrides: dict, fraction: float | None,
                  world_size: int, seq: int = SEQ):
    """A per-device memory budget `fraction` of what the plan for `world_size` ranks needs
    with ample memory: under it the planner has to split weights on the tp axis instead of
    replicating them (tiny models are latency-bound, so with ample memory replication wins).
    None for None. Called in the test's process, once, not on every rank: planning without a
    process group for `world_size` local-cpu ranks is the plan each rank makes."""
    if fraction is None:
        return None
    return _ample_memory_bytes(factory, batch, overrides, world_size, seq) * fraction


_AMPLE: dict[str, float] = {}


def _ample_memory_bytes(factory, batch: int, overrides: dict, world_size: int,
                        seq: int) -> float:
    """The predicted peak of the plan with ample memory, planned once per session for each
    model factory (a `preset` partial: its name, seed and config overrides), batch, options
    and world: many parametrizations of a test share it, and the plan is deterministic."""
    from autoplan.api import autoparallel

    if not isinstance(factory, functools.partial):  # not a preset: no key, planned each time
        key = None
    else:
        key = repr((factory.func.__module__, factory.func.__qualname__, factory.args,
                    sorted(factory.keywords.items()), batch, sorted(overrides.items()),
                    world_size, seq))
    if key is None or key not in _AMPLE:
        ample = autoparallel(factory(), global_batch=batch, seq_len=seq,
                             world_size=world_size, **overrides).plan
        if key is None:
            return ample.prediction.memory_bytes
        _AMPLE[key] = ample.prediction.memory_bytes
    return _AMPLE[key]


def fused_adamw(params):
    """`adamw`'s hyperparameters with the runtime's fused update ([Note: fused AdamW])."""
    from autoplan.runtime.optim import FusedAdamW

    return FusedAdamW(params, lr=LR, eps=1e-6)


def train(factory, steps: int, batch: int, overrides: dict, *, max_grad_norm=None,
          seq: int = SEQ, device_memory_bytes: float | None = None, optimizer=adamw):
    """On every rank: plan with `overrides` (fixing some of the solver's choices) and
    `device_memory_bytes` (see `memory_budget`), train with `optimizer` (a factory), and
    return (losses, this rank's full parameters, plan JSON, gradient norms before
    clipping)."""
    from autoplan.api import autoparallel

    model = factory()
    ap = autoparallel(model, global_batch=batch, seq_len=seq, optimizer=optimizer,
                      max_grad_norm=max_grad_norm, device_memory_bytes=device_memory_bytes,
                      **overrides)
    x, y = batches(vocab_of(model), steps, batch, seq)
    losses, norms = [], []
    for i in range(steps):
        losses.append(ap.step(x[i], y[i]))
        norms.append(ap._engine.grad_norm)
    return losses, ap.state_dict(), ap.plan.to_json(), norms


def _preset_via_meta(name: str, seed: int, overrides: dict):
    """Build on the meta device, then materialise: to_empty + HF init_weights (which also
    recomputes non-persistent buffers such as rotary inv_freq)."""
    from autoplan.models import build_model

    model = build_model(name, device="meta", **overrides)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def preset_via_meta(name: str, seed: int = 0, **overrides):
    return functools.partial(_preset_via_meta, name, seed, overrides)


def train_resume(factory, batch: int, first: dict, second: dict, path: str, *, seq: int = SEQ):
    """On every rank: 1 step under plan `first`, save; a new model under plan `second` (same
    ranks) loads the checkpoint and takes 1 more step. Returns (losses, params, the rotary
    buffer values each stage graph holds after loading)."""
    from autoplan.api import autoparallel

    x, y = batches(vocab_of(factory()), 2, batch, seq)
    a = autoparallel(factory(), global_batch=batch, seq_len=seq, optimizer=adamw, **first)
    losses = [a.step(x[0], y[0])]
    a.save(path)
    b = autoparallel(factory(), global_batch=batch, seq_len=seq, optimizer=adamw, **second)
    # garbage weights: everything must come from the checkpoint
    with torch.no_grad():
        for p in b.module.parameters():
            p.normal_()
    b.load(path)
    losses.append(b.step(x[1], y[1]))
    buffers = [sg.gm.get_buffer(n.target).clone()
               for sg in b._engine.stage_graphs.values() for n in sg.gm.graph.nodes
               if n.op == "get_attr" and n.target.endswith("inv_freq")]
    return losses, b.state_dict(), buffers


@functools.lru_cache(maxsize=None)
def preset_reference(name: str, steps: int, batch: int):
    """`reference` of preset `name`, computed once per test session (read it, never change
    it)."""
    return reference(preset(name), steps, batch)


def reference_keyed(factory, steps: int, batch: int, seed: int, *, seq: int = SEQ):
    """Single-process eager training with random ops under the RNG contract
    (autoplan.passes.rng.keyed_random_ops): (losses, parameters after the last step)."""
    from autoplan.passes.rng import keyed_random_ops

    model = factory()
    model.train()
    opt = adamw(model.parameters())
    x, y = batches(vocab_of(model), steps, batch, seq)
    losses = []
    for i in range(steps):
        opt.zero_grad()
        with keyed_random_ops(seed, step=i):
            loss = cross_entropy_loss(logits(model, x[i]), y[i])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def train_seeded(factory, steps: int, batch: int, overrides: dict, seed: int, *,
                 seq: int = SEQ, device_memory_bytes: float | None = None):
    """`train` with an explicit random-op seed: (losses, this rank's full parameters)."""
    from autoplan.api import autoparallel

    model = factory()
    ap = autoparallel(model, global_batch=batch, seq_len=seq, optimizer=adamw, seed=seed,
                      device_memory_bytes=device_memory_bytes, **overrides)
    x, y = batches(vocab_of(model), steps, batch, seq)
    losses = [ap.step(x[i], y[i]) for i in range(steps)]
    return losses, ap.state_dict()


def build_tracked(factory_name: str, seed: int, overrides: dict, batch: int, config: dict,
                  dtype: str = "float32"):
    """On every rank: decorate the preset's factory (recorded on meta), build under the
    live-bytes tracker; returns (full parameters after construction, live-bytes peak of the
    build, this rank's local parameter bytes, largest full tensor bytes, buffer bytes)."""
    from autoplan.api import autoparallel
    from autoplan.models import build_model
    from autoplan.runtime.live_bytes import LiveTensorBytes

    factory = autoparallel(lambda: build_model(factory_name, device="meta", **config),
                           global_batch=batch, seq_len=SEQ, dtype=dtype, **overrides)
    torch.manual_seed(seed)
    ap = factory()
    _ = ap.plan  # planning allocates nothing real, but keep it outside the measurement
    with LiveTensorBytes() as live:
        ap.build()
    engine = ap._engine
    # this rank's share as allocated (FSDP2 pads uneven shards): unique storages of its shards
    storages = {}
    for p in engine._unique_params():
        t = p.to_local() if hasattr(p, "to_local") else p
        storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    local = sum(storages.values())
    largest = max(p.numel * 4 for p in ap.graph.params.values())
    buffers = sum(b.numel() * b.element_size() for sg in engine.stage_graphs.values()
                  for b in sg.gm.buffers())
    return ap.state_dict(), live.peak, local, largest, buffers


def step_mixed(loss, masters: dict, params: dict, opt) -> float:
    """One mixed-precision step of [Note: precision recipe] on one process: backward through
    the 16-bit `params`, their gradients cast to fp32 onto the `masters` the AdamW `opt`
    steps, the masters copied back into the 16-bit parameters. Returns the loss."""
    loss.backward()
    for k, m in masters.items():
        m.grad = params[k].grad.float()
    opt.step()
    with torch.no_grad():
        for k, m in masters.items():
            params[k].copy_(m)
    return loss.item()


def reference_mixed(factory, steps: int, batch: int, dtype: str, *, seq: int = SEQ):
    """Single-process mixed precision, the recipe of [Note: precision recipe]: the model's
    parameters in `dtype` for forward and backward, fp32 master weights stepped by AdamW (fp32
    states) for the trainable ones, gradients cast to fp32; frozen parameters are left as
    their `dtype` cast. Returns (losses, parameters after the last step: fp32 masters, frozen
    ones in `dtype`)."""
    low = getattr(torch, dtype)
    model = factory()
    masters = {k: v.detach().clone().float().requires_grad_(True)
               for k, v in model.named_parameters() if v.requires_grad}
    for p in model.parameters():
        p.data = p.data.to(low)
    opt = adamw(list(masters.values()))
    params = dict(model.named_parameters())
    x, y = batches(vocab_of(model), steps, batch, seq)
    losses = []
    for i in range(steps):
        model.zero_grad()
        losses.append(step_mixed(cross_entropy_loss(logits(model, x[i]), y[i]), masters,
                                 params, opt))
    out = {k: v.detach().clone() for k, v in model.named_parameters()}
    out.update({k: v.detach().clone() for k, v in masters.items()})
    return losses, out


class _DtypeLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Output dtypes of the matmuls run under it (DTensors through their local ops)."""

    MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
               torch.ops.aten.bmm.default}

    def __init__(self):
        super().__init__()
        self.matmul_dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func in self.MATMULS:
            self.matmul_dtypes.add(str(out.dtype))
        return out


def train_mixed(factory, steps: int, batch: int, overrides: dict, dtype: str, *,
                seq: int = SEQ, device_memory_bytes: float | None = None):
    """On every rank: train under a 16-bit plan; returns (losses, full master parameters,
    matmul output dtypes, dtypes of the dp collectives (FSDP2's reduce-scatter / all-reduce),
    master dtypes, optimizer state dtypes, the report's precision line)."""
    import torch.distributed as dist

    from autoplan.api import autoparallel

    model = factory()
    ap = autoparallel(model, global_batch=batch, seq_len=seq, optimizer=adamw, dtype=dtype,
                      device_memory_bytes=device_memory_bytes, **overrides)
    x, y = batches(vocab_of(model), steps, batch, seq)
    collective_dtypes = set()
    originals = (dist.reduce_scatter_single, dist.all_reduce)

    def spy(original):
        def call(*args, **kwargs):
            t = kwargs.get("input", args[1] if len(args) > 1 else None) \
                if original is originals[0] else (args[0] if args else kwargs["tensor"])
            if t is not None and t.is_floating_point() and t.numel() > 1:
                collective_dtypes.add(str(t.dtype))
            return original(*args, **kwargs)
        return call

    ap.build()
    log = _DtypeLog()
    losses = []
    dist.reduce_scatter_single, dist.all_reduce = spy(originals[0]), spy(originals[1])
    try:
        for i in range(steps):
            with log:
                losses.append(ap.step(x[i], y[i]))
    finally:
        dist.reduce_scatter_single, dist.all_reduce = originals
    engine = ap._engine
    masters = {str(p.dtype) for p in engine._unique_params()}
    opt = getattr(engine.optimizer, "inner", engine.optimizer)
    states = {str(v.dtype) for s in (opt.state.values() if opt else ())
              for v in s.values() if torch.is_tensor(v) and v.numel() > 1}
    return (losses, ap.state_dict(), log.matmul_dtypes, collective_dtypes, masters, states,
            engine.precision.describe())


def train_fp16_overflow(factory, batch: int, overrides: dict, *, seq: int = SEQ):
    """On every rank: 3 fp16 steps; in step 2 one rank's gradient gets an inf (injected after
    the backward). Returns (losses, parameters after each step, loss scale after each step,
    skipped steps)."""
    from autoplan.api import autoparallel

    model = factory()
    ap = autoparallel(model, global_batch=batch, seq_len=seq, optimizer=adamw, dtype="float16",
                      **overrides).build()
    engine = ap._engine
    grads = engine._local_grads

    def poisoned():
        out = grads()
        if engine.num_steps == 2 and torch.distributed.get_rank() == 0 and out:
            out[0].view(-1)[0] = float("inf")
        return out

    engine._local_grads = poisoned
    x, y = batches(vocab_of(model), 3, batch, seq)
    losses, params, scales = [], [], []
    for i in range(3):
        losses.append(ap.step(x[i], y[i]))
        params.append(ap.state_dict())
        scales.append(engine.scaler.scale)
    return losses, params, scales, engine.skipped_steps


def train_factory_stats(name: str, steps: int, batch: int, overrides: dict, *, seq: int = SEQ):
    """On every rank: decorate a factory (recorded on meta, seed 11), train; returns (losses,
    full parameters, memory_stats())."""
    from autoplan.api import autoparallel
    from autoplan.models import build_model

    factory = autoparallel(lambda: build_model(name, device="meta"), global_batch=batch,
                           seq_len=seq, optimizer=adamw, **overrides)
    torch.manual_seed(11)
    ap = factory()
    x, y = batches(vocab_of(ap.module), steps, batch, seq)
    losses = [ap.step(x[i], y[i]) for i in range(steps)]
    return losses, ap.state_dict(), ap.memory_stats()


def _hf_load(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")


def hf_loader(path: str):
    """Factory: the HF model in checkpoint directory `path`, loaded whole on this process."""
    return functools.partial(_hf_load, path)


def train_from_hf(path: str, out: str, steps: int, batch: int, overrides: dict, *,
                  seq: int = SEQ, device_memory_bytes: float | None = None):
    """On every rank: `autoplan.from_pretrained(path)` (each rank reads its slices), train,
    `save_pretrained(out)`. Returns (losses, this rank's full parameters, bytes read)."""
    import autoplan

    ap = autoplan.from_pretrained(path, global_batch=batch, seq_len=seq, optimizer=adamw,
                                  device_memory_bytes=device_memory_bytes, **overrides)
    x, y = batches(vocab_of(ap.module), steps, batch, seq)
    losses = [ap.step(x[i], y[i]) for i in range(steps)]
    ap.save_pretrained(out)
    return losses, ap.state_dict(), ap.bytes_read()


def resume_from_weights(name: str, path: str, batch: int, first: dict, second: dict, *,
                        seq: int = SEQ):
    """On every rank: a recorded factory trains 1 step under plan `first` and `save`s; a new
    one under plan `second` builds with `weights=path`. Returns (first's full parameters,
    second's full parameters, second's loss on the next batch, first's loss on it)."""
    from autoplan.api import autoparallel
    from autoplan.models import build_model

    def make(**kw):
        return autoparallel(lambda: build_model(name, device="meta"), global_batch=batch,
                            seq_len=seq, optimizer=adamw, **kw)()

    torch.manual_seed(11)
    a = make(**first)
    x, y = batches(vocab_of(a.module), 2, batch, seq)
    a.step(x[0], y[0])
    a.save(path)
    b = make(weights=path, **second)
    got = b.build().state_dict()
    return a.state_dict(), got, b.step(x[1], y[1]), a.step(x[1], y[1])


def mismatch_is_named(factory, batch: int, overrides: dict, *, seq: int = SEQ):
    """On every rank: build a ZeRO-3 bf16 model, then check it against plans it does not
    match; returns the PlanMismatchError messages (ZeRO stage, dtype)."""
    import dataclasses

    from autoplan.api import autoparallel
    from autoplan.runtime.checks import PlanMismatchError, check_against_plan
    from autoplan.runtime.precision import Precision

    ap = autoparallel(factory(), global_batch=batch, seq_len=seq, dtype="bfloat16",
                      **overrides).build()
    engine = ap._engine
    check_against_plan(engine)  # the plan it was built from: no error
    messages = []
    plan = engine.plan
    for plan_change, precision in [(dict(zero_stage=0), engine.precision),
                                   (dict(dtype="float32"), Precision.of("float32"))]:
        engine.plan, engine.precision = dataclasses.replace(plan, **plan_change), precision
        try:
            check_against_plan(engine)
            messages.append(None)
        except PlanMismatchError as e:
            messages.append(str(e))
    return messages


def _mask_unevenly(y: torch.Tensor) -> torch.Tensor:
    """Labels with -100 (ignored) over the first 2 x i tokens of sample i: the dp ranks and
    microbatches hold different numbers of trained tokens."""
    y = y.clone()
    for i in range(y.shape[-2]):
        y[..., i, : 2 * i] = -100
    return y


def grouped_adamw(named):
    """AdamW with groups by FQN, as HF and torchtitan build them: weight decay 0.1 on the
    matrices, none on norms and biases, and the position embedding frozen at lr 0 (under
    ZeRO-1 some ranks own nothing of it: its group is empty there)."""
    named = list(named)
    frozen = [(n, p) for n, p in named if "wpe" in n]
    no_decay = [(n, p) for n, p in named if "wpe" not in n and (n.endswith("bias") or "ln" in n)]
    taken = {n for n, _ in frozen + no_decay}
    decay = [(n, p) for n, p in named if n not in taken]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0},
                              {"params": frozen, "lr": 0.0}], lr=LR, eps=1e-6)


def train_with_a_sleeper(sleep_s: float, done_path: str):
    """dp2 gpt2-tiny: one step together, then rank 1 sleeps instead of stepping -- until rank
    0 has written `done_path` (its second step gave up on rank 1), at most `sleep_s`; rank 0's
    second step waits for it past the collective timeout. What each rank saw."""
    import os
    import time

    import torch.distributed as dist

    from autoplan.api import autoparallel

    model = preset("gpt2-tiny")()
    ap = autoparallel(model, global_batch=4, seq_len=SEQ, optimizer=adamw, dp=2, tp=1, pp=1,
                      zero_stage=0)
    x, y = batches(vocab_of(model), 2, 4)
    ap.step(x[0], y[0])
    if dist.get_rank() == 1:
        # asleep while rank 0 waits; woken once it is done waiting, not a fixed time later
        until = time.monotonic() + sleep_s
        while not os.path.exists(done_path) and time.monotonic() < until:
            time.sleep(0.1)
        return "slept"
    try:
        ap.step(x[1], y[1])
        seen = "no error"
    except Exception as e:  # noqa: BLE001 - the test reads it
        seen = f"{type(e).__name__}: {e}"
    with open(done_path, "w") as f:
        f.write(seen)
    return seen


def warmup(optimizer):
    """Linear warm-up over 2 steps, then constant: a schedule that changes every step here."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))


def resume_scheduled(factory, batch: int, path: str, *, seq: int = SEQ):
    """Warm-up schedule: 4 steps straight, against 2 steps, save, a fresh model that loads and
    takes steps 3 and 4 (the 4th loss shows the lr step 3 used). (4th loss straight, resumed)."""
    from autoplan.api import autoparallel

    def fresh():
        return autoparallel(factory(), global_batch=batch, seq_len=seq, optimizer=adamw,
                            lr_scheduler=warmup, dp=2, tp=1, pp=1, zero_stage=0)

    model = factory()
    x, y = batches(vocab_of(model), 4, batch, seq)
    straight = fresh()
    fourth = [straight.step(x[i], y[i]) for i in range(4)][-1]
    first = fresh()
    for i in range(2):
        first.step(x[i], y[i])
    first.save(path)
    again = fresh()
    again.load(path)
    return fourth, [again.step(x[i], y[i]) for i in (2, 3)][-1]


def smoothed_loss(logits, labels):
    """A user's loss: token cross-entropy with label smoothing 0.1 (a mean per microbatch)."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             labels.reshape(-1), label_smoothing=0.1)


# -- one-process references and gloo runs of the decorator's options (test_first_contact) --
def _variant(name: str) -> dict:
    """What a variant changes: autoparallel options, and how one process does the same."""
    if name == "ignored":  # labels -100 over 2 x i tokens of sample i
        return dict(mask=True)
    if name == "grouped":
        return dict(optimizer=grouped_adamw, named=True)
    if name == "scheduled":
        return dict(lr_scheduler=warmup)
    if name == "user_loss":
        return dict(loss_fn=smoothed_loss)
    if name == "whole_tensor":  # a per-tensor norm: not elementwise (runtime/optim.py)
        return dict(optimizer=Lamb, named=True)
    raise ValueError(name)


class Lamb(torch.optim.Optimizer):
    """LAMB's trust ratio (You et al. 2020, Algorithm 2) on SGD: each tensor's step scaled by
    ||w|| / ||g||, norms of the whole tensor (DTensor ops: FSDP2's shards reduce them)."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    ratio = p.norm() / p.grad.norm().clamp_min(1e-12)
                    p.sub_(p.grad * ratio * group["lr"])


def reference_variant(name: str, factory, steps: int, batch: int, *, seq: int = SEQ):
    """One process, whole batch: (losses, parameters after the last step, [Note: AdamW
    rounding allowance] at `adamw`'s lr and eps, which the variants' optimizers and schedules do
    not exceed)."""
    from autoplan.testing import adamw_allowance, record_gradients

    v = _variant(name)
    model = factory()
    opt = v.get("optimizer", adamw)(model.named_parameters() if v.get("named")
                                     else model.parameters())
    sched = v["lr_scheduler"](opt) if "lr_scheduler" in v else None
    loss_fn = v.get("loss_fn", cross_entropy_loss)
    x, y = batches(vocab_of(model), steps, batch, seq)
    y = _mask_unevenly(y) if v.get("mask") else y
    losses, grads = [], {}
    for i in range(steps):
        opt.zero_grad()
        loss = loss_fn(logits(model, x[i]), y[i])
        loss.backward()
        record_gradients(model, grads)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return (losses, {k: p.detach().clone() for k, p in model.named_parameters()},
            adamw_allowance(grads))


def train_variant(name: str, factory, steps: int, batch: int, overrides: dict, *,
                  seq: int = SEQ):
    """On every rank: (losses, this rank's parameters, sizes of the optimizer's groups)."""
    from autoplan.api import autoparallel

    v = _variant(name)
    options = {k: v[k] for k in ("lr_scheduler", "loss_fn") if k in v}
    model = factory()
    ap = autoparallel(model, global_batch=batch, seq_len=seq,
                      optimizer=v.get("optimizer", adamw), **options, **overrides)
    x, y = batches(vocab_of(model), steps, batch, seq)
    y = _mask_unevenly(y) if v.get("mask") else y
    losses = [ap.step(x[i], y[i]) for i in range(steps)]
    opt = ap._engine.optimizer
    groups = [len(g["params"]) for g in getattr(opt, "inner", opt).param_groups]
    return losses, ap.state_dict(), groups



def train_kernel_counts(factory, steps: int, batch: int, overrides: dict, *, seq: int = SEQ,
                        memory_fraction: float | None = None):
    """`train` (losses, this rank's full parameters, plan JSON), the fused kernel calls by stage
    of this rank (DistributedModel.kernel_counts, autoplan/passes/kernels.py), whether the loss
    ran vocab-parallel, and (loss, logits) of `eval_batch` on the first batch after training."""
    from autoplan.api import autoparallel

    budget = memory_budget(factory, batch, overrides, memory_fraction, seq)
    model = factory()
    ap = autoparallel(model, global_batch=batch, seq_len=seq, optimizer=adamw,
                      device_memory_bytes=budget, **overrides)
    x, y = batches(vocab_of(model), steps, batch, seq)
    losses = [ap.step(x[i], y[i]) for i in range(steps)]
    engine = ap._engine
    # the loss and whole logits of the first batch after training (gathered over tp when the
    # stage keeps them vocab-sharded)
    evaluated = engine.eval_batch([x[0], y[0]], return_outputs=True)
    logits_out = evaluated[1] if isinstance(evaluated[1], torch.Tensor) else evaluated[1][0]
    return (losses, ap.state_dict(), ap.plan.to_json(), engine.kernel_counts,
            engine.batch.vocab_parallel is not None, (evaluated[0], logits_out))


def kernel_wrappers_under_dtensor():
    """On every rank of a 1-D mesh: autoplan/passes/kernels.py's wrappers against the unfused
    ops under DTensor, per placement of the input: {case: (fused path's grad_fn name, max abs
    difference of output and input/weight gradients, full tensors)}."""
    import kernels
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from autoplan.passes.kernels import rms_norm_local, swiglu_local

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    gen = torch.Generator().manual_seed(3)
    x_full, dy_full = (torch.randn(4, 6, 8, generator=gen) for _ in range(2))
    w_full = 1 + 0.1 * torch.randn(8, generator=gen)
    out = {}
    for name, placement in [("R", Replicate()), ("S(0)", Shard(0)), ("S(1)", Shard(1)),
                            ("S(2)", Shard(2))]:
        runs = []
        for fused in (True, False):
            x = distribute_tensor(x_full, mesh, [placement]).requires_grad_(True)
            u = distribute_tensor(dy_full, mesh, [placement]).requires_grad_(True)
            w = torch.nn.Parameter(distribute_tensor(w_full, mesh, [Replicate()]))
            dy = distribute_tensor(dy_full, mesh, [placement])
            if fused:
                y, z = rms_norm_local(x, w, 1e-6), swiglu_local(x, u)
            else:
                y, z = kernels.rms_norm_reference(x, w, 1e-6), kernels.swiglu_reference(x, u)
            ((y * dy).sum() + (z * dy).sum()).backward()
            runs.append(([y.grad_fn.name(), z.grad_fn.name()],
                         [t.full_tensor() for t in (y, z, x.grad, u.grad, w.grad)]))
        (paths, got), (_, want) = runs
        out[name] = (paths, max(float((a - b).abs().max()) for a, b in zip(got, want)))
    return out


def held_after_forward(name: str, batch: int, overrides: dict, tagged: bool, *,
                       seq: int = SEQ):
    """On every rank: one training step of preset `name` (one stage, one microbatch), with
    gathered activations held as their shards (`tagged`, the runtime's way: [Note: gathered
    inputs saved sharded]) or as autograd would hold them (the tag switched off). Returns
    (live tensor bytes the stage's forward leaves for its backward, less its output; the
    plan's predicted activation bytes; predicted bytes the shards save: every planned
    all-gather into a node whose input an op saves, (1 - 1/tp) of its bytes)."""
    import autoplan.passes.sharding as sharding

    tag = sharding.tag_gathered
    if not tagged:  # restored below: the cluster's ranks run later jobs in this process
        sharding.tag_gathered = lambda source, out: None
    try:
        return _held_after_forward(name, batch, overrides, seq)
    finally:
        sharding.tag_gathered = tag


def _held_after_forward(name: str, batch: int, overrides: dict, seq: int):
    from autoplan.api import autoparallel
    from autoplan.runtime.live_bytes import LiveTensorBytes
    from autoplan.solver.problem import build_problem

    model = preset(name)()
    ap = autoparallel(model, global_batch=batch, seq_len=seq, optimizer=adamw, **overrides)
    x, y = batches(vocab_of(model), 1, batch, seq)
    ap.build()
    (_, module), = ap._engine.stages
    held, before = [], []
    with LiveTensorBytes() as live:
        module.register_forward_pre_hook(lambda _m, _a: before.append(live.current))
        module.register_forward_hook(
            lambda _m, _a, out: held.append(live.current - before.pop()
                                            - out.numel() * out.element_size()))
        # the least of three steps: now and then one rank's forward leaves 8-12 kB more
        # (seen in CI and in repeated runs of the same job, 1 run in ~6: a buffer released a
        # moment late, most likely by a gloo work object on gloo's own thread) -- only ever
        # more than the forward holds, never less
        for _ in range(3):
            ap.step(x[0], y[0])
    plan, tp = ap.plan, ap.plan.mesh.tp
    saver = build_problem(ap.graph, tp, 4).regathered
    shards_save = sum(r.bytes * (1 - 1 / tp) for r in plan.redistributions
                      if r.collective == "all_gather" and r.consumer in saver)
    return min(held), plan.prediction.memory_breakdown["activations"], shards_save



def eval_outputs_refusal(factory, batch: int, overrides: dict, *, seq: int = SEQ):
    """On every rank: plan with `overrides`, evaluate one batch for its loss, then ask for the
    outputs too, then the loss again; returns (loss, what the second call raised:
    "NotImplementedError: ..." or "no error", the third call's loss)."""
    from autoplan.api import autoparallel

    model = factory()
    ap = autoparallel(model, global_batch=batch, seq_len=seq, **overrides)
    x, y = batches(vocab_of(model), 1, batch, seq)
    loss = ap.eval_step(x[0], y[0])
    try:
        ap.eval_step(x[0], y[0], return_outputs=True)
        raised = "no error"
    except NotImplementedError as e:
        raised = f"NotImplementedError: {e}"
    return float(loss), raised, float(ap.eval_step(x[0], y[0]))


class PooledHead(torch.nn.Module):
    """Linear(8, 64) -> Linear(64, 32) -> AdaptiveAvgPool1d(1) over the sequence (of the
    transposed activations) -> Linear(32, 10), its own cross-entropy loss: Swin's pooler."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 64), torch.nn.Linear(64, 32)
        self.pool, self.c = torch.nn.AdaptiveAvgPool1d(1), torch.nn.Linear(32, 10)

    def forward(self, x, labels):
        h = self.b(torch.relu(self.a(x)))  # (B, T, 32)
        h = self.pool(h.transpose(1, 2)).squeeze(-1)  # (B, 32)
        return torch.nn.functional.cross_entropy(self.c(h), labels)


def pooled_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(1 + step)
    return {"x": torch.randn(4, 6, 8, generator=g),
            "labels": torch.randint(0, 10, (4,), generator=g)}


def pooled_losses(overrides: dict | None, steps: int = 2) -> list[float]:
    """PooledHead's losses over `steps` AdamW steps (lr 1e-3): planned with `overrides` on
    this job's ranks, or on one process (None)."""
    torch.manual_seed(0)
    model = PooledHead()
    if overrides is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = []
        for s in range(steps):
            opt.zero_grad()
            loss = model(**pooled_batch(s))
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out
    from autoplan.api import autoparallel

    ap = autoparallel(model, global_batch=4, example_batch=pooled_batch(0),
                      loss_fn=lambda out, batch: out, **overrides)
    return [ap.step(pooled_batch(s)) for s in range(steps)]


class TinyConv(torch.nn.Module):
    """Conv2d(3, 8, 3) -> ReLU -> mean over the image -> Linear(8, 4): an image classifier
    whose input is float pixels."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Linear(8, 4)

    def forward(self, pixel_values):
        return self.head(torch.relu(self.conv(pixel_values)).mean((2, 3)))


def conv_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(1 + step)
    return {"pixel_values": torch.randn(4, 3, 8, 8, generator=g),
            "labels": torch.randint(0, 4, (4,), generator=g)}


def _conv_loss(out, batch):
    return torch.nn.functional.cross_entropy(out.float(), batch["labels"])


def conv_losses(overrides: dict | None, dtype: str, steps: int = 3) -> list[float]:
    """TinyConv's losses over `steps` AdamW steps under `dtype`: planned with `overrides` on
    this job's ranks, or one process running the same recipe (None: [Note: precision
    recipe], fp32 masters, the pixels cast to the compute dtype as they enter the model)."""
    torch.manual_seed(0)
    model = TinyConv()
    if overrides is not None:
        from autoplan.api import autoparallel

        ap = autoparallel(model, global_batch=4, example_batch=conv_batch(0), dtype=dtype,
                          loss_fn=_conv_loss, optimizer=adamw, **overrides)
        return [ap.step(conv_batch(s)) for s in range(steps)]
    low = getattr(torch, dtype)
    masters = {k: v.detach().clone().float().requires_grad_(True)
               for k, v in model.named_parameters()}
    for p in model.parameters():
        p.data = p.data.to(low)
    opt, params, losses = adamw(list(masters.values())), dict(model.named_parameters()), []
    for s in range(steps):
        model.zero_grad()
        batch = conv_batch(s)
        losses.append(step_mixed(_conv_loss(model(batch["pixel_values"].to(low)), batch),
                                 masters, params, opt))
    return losses


def train_vocab_shard(factory, steps: int, batch: int, overrides: dict):
    """`train`, and this rank's vocabulary shard of the vocabulary-parallel loss: (first row,
    vocabulary size), or None where the loss runs on gathered logits."""
    from autoplan.api import autoparallel

    model = factory()
    ap = autoparallel(model, global_batch=batch, seq_len=SEQ, optimizer=adamw, **overrides)
    x, y = batches(vocab_of(model), steps, batch, SEQ)
    losses = [ap.step(x[i], y[i]) for i in range(steps)]
    shard = ap._engine.batch.vocab_parallel
    return (losses, ap.state_dict(), ap.plan.to_json(), [],
            None if shard is None else tuple(shard[1:]))


def shard_dim_all_to_all_against_the_fallback():
    """On every rank of a 1-D mesh: a DTensor Shard(1) -> Shard(2) redistribution and its
    backward, by gloo's fallback (all-gather and chunk) and under
    `_torch_compat.shard_dim_all_to_all` (one all-to-all, as on a GPU mesh, what the dry run
    of a GPU plan runs): (equal outputs and gradients, bitwise; the all-to-all output's shape
    and whether it owns its storage)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from autoplan._torch_compat import shard_dim_all_to_all

    n = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    full = torch.randn(2, 2 * n, 3 * n, generator=torch.Generator().manual_seed(5))
    runs = []
    for emulated in (False, True):
        x = distribute_tensor(full, mesh, [Shard(1)]).requires_grad_(True)
        with shard_dim_all_to_all() if emulated else contextlib.nullcontext():
            y = x.redistribute(mesh, [Shard(2)])
            (y * y.detach().roll(1, 0)).sum().backward()
        runs.append((y.to_local(), x.grad.to_local()))
    (y0, g0), (y1, g1) = runs
    owns = y1.untyped_storage().nbytes() == y1.numel() * y1.element_size()
    return torch.equal(y0, y1) and torch.equal(g0, g1), tuple(y1.shape), owns
