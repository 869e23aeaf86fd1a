"""Rank jobs of tests/test_float8.py and their single-process reference: the float8 recipe
([Note: float8 recipe] in autoplan/float8.py) on gloo ranks and on one process."""

from __future__ import annotations

import functools

import torch

from _jobs import SEQ, adamw, batches, logits, preset, reference_mixed, vocab_of

MODEL = "llama-tiny"


def train_float8(steps: int, batch: int, overrides: dict,
                 device_memory_bytes: float | None = None, model: str = MODEL):
    """On every rank: plan `model` with float8="on" under `overrides`; the logits of the
    first batch before any step (eval), then `steps` AdamW steps. Returns (the logits, the
    losses, the plan as JSON, the weight FQNs of the FP8 linears built on this rank, the
    number of FP8 linear calls in its modules, the export's code of this rank's stages)."""
    from autoplan.api import autoparallel
    from autoplan.float8 import float8_addmm, float8_linear
    from autoplan.runtime.checks import check_against_plan

    torch.manual_seed(11)
    model = preset(model)()
    ap = autoparallel(model, global_batch=batch, seq_len=SEQ, optimizer=adamw, float8="on",
                      device_memory_bytes=device_memory_bytes, **overrides)
    x, y = batches(vocab_of(model), steps, batch)
    _, out = ap.eval_step(x[0], y[0], return_outputs=True)
    losses = [ap.step(x[i], y[i]) for i in range(steps)]
    engine = ap._engine
    check_against_plan(engine)
    calls = sum(1 for _, module in engine.stages for m in module.modules()
                if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
                if n.target in (float8_linear, float8_addmm))
    out = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
    return (out.detach().float(), losses, ap.plan.to_json(), sorted(engine.float8_linears),
            calls)


def tampered_plan_is_named(batch: int, overrides: dict):
    """On every rank: build a float8 plan, then check the built model against the same plan
    with one FP8 linear fewer; returns the PlanMismatchError message (None if none)."""
    import dataclasses

    from autoplan.api import autoparallel
    from autoplan.runtime.checks import PlanMismatchError, check_against_plan

    ap = autoparallel(preset(MODEL)(), global_batch=batch, seq_len=SEQ, float8="on",
                      **overrides).build()
    engine = ap._engine
    check_against_plan(engine)
    engine.plan = dataclasses.replace(engine.plan,
                                      float8_linears=engine.plan.float8_linears[1:])
    try:
        check_against_plan(engine)
    except PlanMismatchError as e:
        return str(e)
    return None


def _conv1d_float8(mod, x):
    """HF Conv1D's forward (x (..., K) -> (..., N), weight (K, N)) as the FP8 linear."""
    from autoplan.float8 import float8_addmm

    y = float8_addmm(mod.bias, x.reshape(-1, x.shape[-1]), mod.weight)
    return y.reshape(*x.shape[:-1], mod.weight.shape[1])


def _with_float8(fqns: frozenset[str], name: str = MODEL):
    """Preset `name` whose linears (nn.Linear, HF Conv1D) of weight FQN in `fqns` run the FP8
    linear (one process)."""
    from transformers.pytorch_utils import Conv1D

    from autoplan.float8 import float8_linear

    model = preset(name)()
    for path, m in model.named_modules():
        if f"{path}.weight" not in fqns:
            continue
        if isinstance(m, torch.nn.Linear):
            m.forward = functools.partial(lambda mod, x: float8_linear(x, mod.weight, mod.bias),
                                          m)
        elif isinstance(m, Conv1D):
            m.forward = functools.partial(_conv1d_float8, m)
    return model


def reference_float8(fqns, steps: int, batch: int, name: str = MODEL):
    """One process running the recipe: the bf16 mixed-precision recipe of `reference_mixed`
    with the linears of weight FQN in `fqns` in FP8 ([] : the bf16 recipe). Returns (the
    logits of the first batch before any step, the losses)."""
    fqns = frozenset(fqns)
    torch.manual_seed(11)
    model = _with_float8(fqns, name)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    x, _ = batches(vocab_of(model), steps, batch)
    model.eval()
    with torch.no_grad():
        out = logits(model, x[0]).float()
    torch.manual_seed(11)
    losses, _ = reference_mixed(lambda: _with_float8(fqns, name), steps, batch, "bfloat16")
    return out, losses


def amax_over_the_split_dim():
    """On 2 ranks, each holding half the columns of one (4, 32) bf16 tensor whose rows have
    their large values in rank 0's half and values 2^-24 of those in rank 1's: `quantize_rows`
    over the group equals one process's quantization of the whole tensor, bit for bit; without
    the group rank 1 scales its half by its own amax and its values come out otherwise (they
    are subnormal under the whole row's scale). Then the groups `float8_linear` passes for a
    row-parallel weight (Shard(1): the forward's) and a column-parallel one (Shard(0): the
    backward's). Returns (grouped equal, ungrouped equal, {placement: (k_group set, n_group
    set, w_group set)})."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import autoplan.float8 as f8

    rank = dist.get_rank()
    t = torch.full((4, 32), 1.0, dtype=torch.bfloat16)
    t[:, :16] = torch.linspace(100, 400, 16, dtype=torch.bfloat16)
    t[:, 16:] *= 2.0 ** -24 * torch.arange(1, 17, dtype=torch.bfloat16) * 17
    mine = slice(16 * rank, 16 * rank + 16)
    q_full, inv_full = f8.quantize_rows(t, -1, f8.E4M3)
    q, inv = f8.quantize_rows(t[:, mine].contiguous(), -1, f8.E4M3, dist.group.WORLD)
    q_alone, inv_alone = f8.quantize_rows(t[:, mine].contiguous(), -1, f8.E4M3)
    grouped = torch.equal(q.float(), q_full[:, mine].float()) and torch.equal(inv, inv_full)
    alone = torch.equal((q_alone.float() * inv_alone), (q_full[:, mine].float() * inv_full))

    seen, original = [], f8._Float8Matmul.apply
    f8._Float8Matmul.apply = lambda *a: (seen.append(tuple(g is not None for g in a[2:5])),
                                         original(*a))[1]
    mesh = init_device_mesh("cpu", (2,))
    groups = {}
    try:
        for wp, xp in ((Shard(1), Shard(2)), (Shard(0), Replicate())):
            seen.clear()
            x = DTensor.from_local(torch.randn(2, 4, 32 if xp == Replicate() else 16),
                                   mesh, [xp], run_check=False)
            w = DTensor.from_local(torch.randn(16, 16 if wp == Shard(1) else 32), mesh, [wp],
                                   run_check=False)
            f8.float8_linear(x, w)
            groups[str(wp)] = seen[0]
    finally:
        f8._Float8Matmul.apply = original
    return grouped, alone, groups


def tp_gradients_as_one_process():
    """On 2 ranks: the FP8 linear on DTensors under each placement the planner runs it with
    -- column parallel with a Shard(0) bias, row parallel with a bias (the plan's R -> P left
    to the op), a token split with a bias, GPT-2's Conv1D column and row parallel -- against
    `float8_linear_local` on the whole fp32 tensors: the largest relative difference of the
    output and of the input, weight and bias gradients, by case."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from autoplan.float8 import float8_addmm, float8_linear, float8_linear_local

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 8, 32), torch.randn(48, 32), torch.randn(48)
    dy = torch.randn(2, 8, 48)
    cases = {"column": (Replicate(), Shard(0), Shard(0), False),
             "row": (Shard(2), Shard(1), Replicate(), False),
             "tokens": (Shard(1), Replicate(), Replicate(), False),
             "conv1d column": (Replicate(), Shard(0), Shard(0), True),
             "conv1d row": (Shard(2), Shard(1), Replicate(), True)}
    out = {}
    for name, (xp, wp, bp, conv1d) in cases.items():
        whole = [t.clone().requires_grad_() for t in (x, w, b)]
        want = float8_linear_local(*whole)
        want.backward(dy)
        if conv1d:  # x (M, K), weight (K, N): the weight's dim 0 is the linear's dim 1
            wd = distribute_tensor(w.t().contiguous(), mesh, [Shard(1 - wp.dim)])
            xd = distribute_tensor(x.reshape(16, 32), mesh, [Shard(1) if xp.is_shard()
                                                             else xp])
        else:
            wd, xd = distribute_tensor(w, mesh, [wp]), distribute_tensor(x, mesh, [xp])
        bd = distribute_tensor(b, mesh, [bp])
        leaves = [t.detach().requires_grad_() for t in (xd, wd, bd)]
        got = float8_addmm(leaves[2], leaves[0], leaves[1]) if conv1d else float8_linear(
            *leaves)
        # the gradient of a Partial output is Replicate
        placement = got.placements[0] if got.placements[0].is_shard() else Replicate()
        got.backward(distribute_tensor(dy.reshape(got.shape), mesh, [placement]))
        full = [got.full_tensor().reshape(want.shape)] + [
            leaf.grad.full_tensor() for leaf in leaves]
        full[2] = full[2].t() if conv1d else full[2]
        full[1] = full[1].reshape(x.shape)
        out[name] = max(((f - r).norm() / r.norm()).item()
                        for f, r in zip(full, [want] + [t.grad for t in whole]))
    return out


class _CountScaledMM(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts `aten._scaled_mm` calls (DTensors through their local ops)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        self.calls += func is torch.ops.aten._scaled_mm.default
        return func(*args, **(kwargs or {}))


def scaled_mm_per_step(batch: int, overrides: dict):
    """On every rank: the FP8 matmuls one float8 training step runs (its second), and the
    number of FP8 linears the plan lists."""
    from autoplan.api import autoparallel

    model = preset(MODEL)()
    ap = autoparallel(model, global_batch=batch, seq_len=SEQ, float8="on", **overrides)
    x, y = batches(vocab_of(model), 2, batch)
    ap.step(x[0], y[0])
    with _CountScaledMM() as count:
        ap.step(x[1], y[1])
    return count.calls, len(ap.plan.float8_linears)
