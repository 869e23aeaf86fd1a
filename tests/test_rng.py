"""Layout-invariant random ops ([Note: RNG contract], autoplan/passes/rng.py): the same masks for
any split of the batch, any tp placement, eager or captured, with or without checkpointing."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import _rng_jobs
from autoplan.capture import capture
from autoplan.passes import rng
from autoplan.passes.checkpointing import wrap_checkpointing
from autoplan.passes.device import materialize
from autoplan.passes.rng import (RandomState, keyed_dropout, keyed_random_ops, keyed_sdpa,
                                 make_random_ops_layout_invariant, random_op_indices)

aten = torch.ops.aten


def _state(seed=1, step=0, sample_offset=0):
    return RandomState(seed, step, sample_offset)


def test_split_batch_equals_whole_batch():
    x = torch.randn(6, 5, 7)
    whole = keyed_dropout(_state(), x, 0.4, True, 3)
    halves = [keyed_dropout(_state(sample_offset=o), x[o:o + 3], 0.4, True, 3) for o in (0, 3)]
    torch.testing.assert_close(torch.cat(halves), whole, rtol=0, atol=0)
    q, k, v = torch.randn(3, 6, 2, 5, 8).unbind(0)
    whole = keyed_sdpa(_state(), q, k, v, None, 0.5, True, 0)
    halves = [keyed_sdpa(_state(sample_offset=o), q[o:o + 3], k[o:o + 3], v[o:o + 3], None, 0.5,
                         True, 0) for o in (0, 3)]
    torch.testing.assert_close(torch.cat(halves), whole)


def test_masks_are_keyed_by_seed_step_and_op():
    x = torch.ones(4, 8, 8)
    mask = lambda s, k=0: keyed_dropout(s, x, 0.5, True, k) != 0  # noqa: E731
    base = mask(_state(seed=1, step=2))
    assert torch.equal(base, mask(_state(seed=1, step=2)))
    for other in (mask(_state(seed=2, step=2)), mask(_state(seed=1, step=3)),
                  mask(_state(seed=1, step=2), k=1)):
        assert not torch.equal(base, other)
    # rows are keyed by their global sample: every row's mask differs from the others
    assert all(not torch.equal(base[0], base[b]) for b in range(1, 4))
    assert 0 <= rng.sample_seed(-1, 2 ** 70, 3, 4) < 2 ** 63


def test_keep_fraction_and_scale():
    x = torch.ones(64, 32, 32)
    out = keyed_dropout(_state(), x, 0.3, True, 0)
    kept = out != 0
    assert kept.float().mean().item() == pytest.approx(0.7, abs=0.01)
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / 0.7))
    half = keyed_dropout(_state(), x.half(), 0.3, True, 0)
    assert half.dtype == torch.float16 and torch.equal(half != 0, kept)


def test_dropout_edge_cases():
    x = torch.randn(3, 4, requires_grad=True)
    assert keyed_dropout(_state(), x, 0.0, True, 0) is x
    assert keyed_dropout(_state(), x, 0.7, False, 0) is x
    zeros = keyed_dropout(_state(), x, 1.0, True, 0)
    assert torch.equal(zeros, torch.zeros(3, 4)) and zeros.requires_grad
    with pytest.raises(ValueError, match=r"dropout: p=1.5 must be a number in \[0, 1\]"):
        keyed_dropout(_state(), x, 1.5, True, 0)
    with pytest.raises(ValueError, match="dropout: input is 0-d"):
        keyed_dropout(_state(), torch.tensor(1.0), 0.5, True, 0)
    out = keyed_dropout(_state(), x, 0.5, True, 0)
    out.sum().backward()  # the mask is a constant factor: d out / d x = keep / (1 - p)
    torch.testing.assert_close(x.grad, (out != 0).float() * 2)


@pytest.mark.parametrize("kind", ["none", "causal", "bool", "additive", "gqa", "scale"])
def test_keyed_sdpa_equals_eager_sdpa_under_the_mode(kind):
    """keyed_sdpa computes what eager CPU SDPA (math path) computes when its dropout draws the
    keyed mask, forward and backward."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 5, 8, generator=g)
    kv_heads = 2 if kind == "gqa" else 4
    k, v = torch.randn(2, 3, kv_heads, 7, 8, generator=g).unbind(0)
    kwargs = {"causal": dict(is_causal=True), "gqa": dict(enable_gqa=True),
              "scale": dict(scale=-0.3),
              "bool": dict(attn_mask=torch.rand(3, 1, 5, 7, generator=g) > 0.5),
              "additive": dict(attn_mask=torch.randn(5, 7, generator=g))}.get(kind, {})
    if kind == "causal":
        k, v = k[:, :, :5], v[:, :, :5]
    # an additive mask that is a parameter's function (T5's relative position bias) gets its
    # gradient, broadcast back to the mask's shape
    mask = kwargs.pop("attn_mask", None)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    want_mask = mask if kind != "additive" else mask.clone().requires_grad_()
    with keyed_random_ops(seed=9, step=4, sample_offset=2):
        want = F.scaled_dot_product_attention(*ins, attn_mask=want_mask, dropout_p=0.4, **kwargs)
    want_grads = torch.autograd.grad(want.sum(), ins + [want_mask] * (kind == "additive"))
    got_ins = [t.clone().requires_grad_() for t in (q, k, v)]
    got_mask = mask if kind != "additive" else mask.clone().requires_grad_()
    got = keyed_sdpa(_state(9, 4, 2), *got_ins, got_mask, 0.4,
                     kwargs.get("is_causal", False), 0, scale=kwargs.get("scale"),
                     enable_gqa=kwargs.get("enable_gqa", False))
    torch.testing.assert_close(got, want)
    got_grads = torch.autograd.grad(got.sum(), got_ins + [got_mask] * (kind == "additive"))
    assert len(got_grads) == len(want_grads)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)
    assert not torch.isnan(got).any()  # fully masked rows (bool case) give 0, as torch does


def test_eager_mode_rejects_what_it_cannot_key():
    q = torch.randn(1, 2, 4, 8)
    with keyed_random_ops(0) as mode:
        F.dropout(q, 0.0)  # draws nothing, counts nothing
        aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, 0.0)
        assert mode.num_drawn == 0
        with pytest.raises(ValueError, match="_scaled_dot_product_flash_attention_for_cpu.*"
                                             "no layout-invariant version"):
            aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, 0.5)
        with pytest.raises(ValueError, match="randperm"):
            torch.randperm(5)
        F.dropout(q, 0.5)
        assert mode.num_drawn == 1
        mode.next_step()
        assert (mode.step, mode.num_drawn) == (1, 0)


def _tiny_gpt2():
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=32,
                                  resid_pdrop=0.5, attn_pdrop=0.5, embd_pdrop=0.5)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train()


def _keyed_graph(model, batch, seq=16):
    graph = capture(model, (torch.zeros(batch, seq, dtype=torch.long),))
    gm = torch.fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph))
    materialize(gm, model, "cpu")
    replaced = make_random_ops_layout_invariant(gm, random_op_indices(gm))
    return graph, gm, replaced


def test_captured_gpt2_equals_eager_gpt2_under_the_mode():
    """HF GPT-2 with dropout 0.5 everywhere: the captured graph after the pass gives the logits
    and gradients of the eager model under keyed_random_ops, and a half batch (captured at
    batch 2, sample_offset 2) gives the same rows."""
    model = _tiny_gpt2()
    x = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    _, gm, replaced = _keyed_graph(model, 4)
    assert replaced == 7  # embedding, 2 x (attention, attention output, MLP output)
    gm.random_state.seed, gm.random_state.step = 7, 3
    got = gm(x)
    got.sum().backward()
    with keyed_random_ops(seed=7, step=3) as mode:
        want = model(x, use_cache=False).logits
        assert mode.num_drawn == 7
    want.sum().backward()
    torch.testing.assert_close(got, want)
    params = dict(model.named_parameters())
    for name, p in gm.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, rtol=1e-5, atol=1e-6)
    _, half, _ = _keyed_graph(model, 2)
    half.random_state.seed, half.random_state.step, half.random_state.sample_offset = 7, 3, 2
    torch.testing.assert_close(half(x[2:]), want[2:])


def test_pass_handles_sdpa_local_and_checks_its_inputs():
    from autoplan.passes.sharding import swap_dtensor_op

    model = _tiny_gpt2()
    graph = capture(model, (torch.zeros(2, 8, dtype=torch.long),))
    indices = random_op_indices(graph.gm)
    for node in graph.gm.graph.nodes:
        swap_dtensor_op(node)
    gm = torch.fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph))
    with pytest.raises(ValueError, match="has no index"):
        make_random_ops_layout_invariant(gm, {})
    assert make_random_ops_layout_invariant(gm, indices) == 7
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(keyed_sdpa) == 2 and targets.count(keyed_dropout) == 5
    assert [n.meta["orig_name"] for n in gm.graph.nodes if n.target is keyed_sdpa] == [
        "scaled_dot_product_attention", "scaled_dot_product_attention_1"]


class _Flattens(torch.nn.Module):
    """OPT's layout: dropout on the (B*T, C) rows of a (B, T, C) activation, then back."""

    def __init__(self, rows: int = -1):
        super().__init__()
        self.rows = rows
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):  # (B, T, C)
        h = self.proj(x)
        flat = h.reshape(-1, x.shape[-1]) if self.rows < 0 else h.reshape(self.rows, -1)  # (B*T, C)
        return F.dropout(flat, 0.5).reshape(x.shape) * 2 + x  # (B, T, C)


class _Uniform(torch.nn.Module):
    def forward(self, x):
        return x + torch.empty(3).uniform_()


def test_flattened_rows_are_keyed_by_global_row():
    """Row r of a (B*T, C) input is global row sample_offset * T + r: any split of the samples
    gives the rows of the whole batch, and every row draws its own mask."""
    x = torch.ones(4 * 5, 64)  # 4 samples of 5 rows
    whole = keyed_dropout(_state(), x, 0.5, True, 0, rows_per_sample=5)
    halves = [keyed_dropout(_state(sample_offset=s), x[s * 5:(s + 2) * 5], 0.5, True, 0,
                            rows_per_sample=5) for s in (0, 2)]
    torch.testing.assert_close(torch.cat(halves), whole, rtol=0, atol=0)
    assert all(not torch.equal(whole[0], whole[r]) for r in range(1, 20))
    # the eager mode: R from batch_size, so microbatches of samples give the same rows
    with keyed_random_ops(1, sample_offset=2, batch_size=2):
        late = F.dropout(x[10:], 0.5)
    torch.testing.assert_close(late, whole[10:], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"shape \(20, 64\) whose dim 0 is not a multiple of "
                                         r"batch_size=3"):
        with keyed_random_ops(1, batch_size=3):
            F.dropout(x, 0.5)


@pytest.mark.parametrize("captured_batch", [4, 2])
def test_captured_flattened_dropout_equals_eager_under_the_mode(captured_batch):
    """A graph captured at the whole batch (4) or at half of it (2, as a dp rank or a
    microbatch runs it, sample_offset 2) gives the eager model's rows under the mode."""
    torch.manual_seed(0)
    model = _Flattens().train()
    x = torch.randn(4, 6, 8)
    with keyed_random_ops(seed=3, step=1):
        want = model(x)
    graph = capture(model, (torch.zeros(captured_batch, 6, 8),))
    gm = torch.fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph))
    materialize(gm, model, "cpu")
    indices = random_op_indices(gm)
    assert [(op.k, op.rows_per_sample) for op in indices.values()] == [(0, 6)]
    assert make_random_ops_layout_invariant(gm, indices) == 1
    gm.random_state.seed, gm.random_state.step = 3, 1
    offset = 4 - captured_batch
    gm.random_state.sample_offset = offset
    torch.testing.assert_close(gm(x[offset:]), want[offset:])


def test_random_op_indices_errors():
    x = torch.randn(2, 3, 8)
    gm = torch.export.export(_Flattens(rows=3), (x,), strict=False).module()
    with pytest.raises(ValueError, match=r"node dropout .*shape \(3, 16\) whose dim 0 is not "
                                         r"a multiple of the batch \(2\)"):
        random_op_indices(gm)
    gm = torch.export.export(_Uniform(), (torch.randn(2, 3, 3),), strict=False).module()
    with pytest.raises(ValueError, match=r"node uniform_ \(aten.uniform_.default\).*supported: "
                                         r"dropout"):
        random_op_indices(gm)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointing_recomputes_the_forward_masks(policy, monkeypatch):
    """The engine moves the RandomState on between a microbatch's forward and its backward;
    a checkpointed block's recompute still draws the forward's masks."""
    model = _tiny_gpt2()
    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    graph, gm, _ = _keyed_graph(model, 2)
    state = gm.random_state
    state.seed, state.step, state.sample_offset = 5, 1, 4
    gm(x).sum().backward()
    want = {n: p.grad.clone() for n, p in gm.named_parameters()}
    gm.zero_grad()
    assert wrap_checkpointing(gm, graph, policy) == 2

    def grads():
        state.step, state.sample_offset = 1, 4
        out = gm(x)
        state.step, state.sample_offset = 2, 12  # the next step / microbatch
        out.sum().backward()
        got = {n: p.grad.clone() for n, p in gm.named_parameters()}
        gm.zero_grad()
        return got

    for name, g in grads().items():
        torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-6)
    assert state.snapshot() == (5, 2, 12)  # left where the engine put it
    monkeypatch.setattr(RandomState, "restore", lambda self, snap: None)
    broken = grads()  # without the replay the recompute draws other masks
    assert any(not torch.allclose(broken[n], want[n]) for n in want)


@pytest.mark.slow
def test_dtensor_placements_equal_the_full_batch(clusters):
    """On 2 gloo ranks: keyed_dropout at S(0), S(1), S(2), R (uneven shards), on flattened
    rows at S(0), S(1), R, and keyed_sdpa at S(0) (batch), S(1) (heads), R gather to the plain
    full-batch result, gradients too."""
    results = clusters.get(2).run(_rng_jobs.keyed_ops_on_tp_mesh, 11, timeout_s=120)
    for rank_results in results:
        for label, got, want in rank_results:
            torch.testing.assert_close(got, want, msg=lambda m, label=label: f"{label}: {m}")
        assert len(rank_results) == 8 + 6 + 3 * 3 * 4


def test_partial_input_is_rejected(fake_world):
    from torch.distributed.tensor import DeviceMesh, DTensor, Partial

    mesh = DeviceMesh("cpu", torch.arange(4))
    x = DTensor.from_local(torch.randn(2, 3, device="meta"), mesh, [Partial()], run_check=False)
    with pytest.raises(ValueError, match="dropout: input has placements .*Partial"):
        keyed_dropout(_state(), x, 0.5, True, 0)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [dict(dp=2), dict(dp=2, num_microbatches=2)],
                         ids=["dp2", "dp2-m2"])
def test_flattened_dropout_trains_as_one_process(clusters, overrides):
    """HF OPT (dropout 0.1 on the (B*T, C) rows of its MLP, and on (B, T, C) elsewhere)
    from a decorated factory on 2 gloo ranks, the batch split by dp and by microbatches:
    losses and parameters equal one eager process under the RNG contract (fp32, rtol 1e-5)."""
    pytest.importorskip("transformers")
    from autoplan import testing
    from autoplan.models.architectures import architecture_factory, example_batch

    factory = architecture_factory("opt")
    batches = [(b["input_ids"], b["labels"]) for b in (
        example_batch("opt", batch=4, seq_len=16, seed=1 + i) for i in range(2))]
    ref = testing.reference(factory, batches)
    results = clusters.get(2).run(testing.train_planned, factory, batches, overrides,
                                  global_batch=4, seq_len=16, timeout_s=300)
    for rank, result in enumerate(results):
        assert not testing.compare(result, ref), (rank, testing.compare(result, ref)[:3])
    plan = json.loads(results[0][2])
    assert plan["mesh"]["dp"] == 2
    assert plan["num_microbatches"] == overrides.get("num_microbatches", 1)


class _Shuffle(torch.nn.Module):
    """A random op with no keyed version: the samples shuffled by `torch.randperm`."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        order = torch.randperm(x.shape[0], device=x.device)
        return self.proj(x[order]).mean()


def test_an_unkeyed_random_op_is_refused_at_planning():
    """A random op without a layout-invariant version is refused when the plan is made,
    before any rank starts (it failed at the first step), naming the node, its module and
    its source line, and what to do."""
    from autoplan.api import autoparallel

    model = autoparallel(_Shuffle(), global_batch=4, example_batch=torch.randn(4, 8),
                         loss_fn=lambda out, batch: out, world_size=2)
    with pytest.raises(ValueError, match=r"_Shuffle: node randperm \(aten.randperm.default\) at "
                                         r"test_rng.py:\d+ `order = torch.randperm.*no "
                                         r"layout-invariant version.*drop_path_rate=0"):
        _ = model.plan


def test_a_draw_is_keyed_by_its_sample_or_by_its_position_alone():
    """`torch.rand((B, 1, 1))` (stochastic depth) draws per sample: half batches at their
    sample offsets give the whole batch's rows; a draw without samples (rows_per_sample 0)
    gives the same values at any sample offset."""
    whole = rng.keyed_rand(_state(), (6, 1, 1), 2)
    halves = [rng.keyed_rand(_state(sample_offset=o), (3, 1, 1), 2) for o in (0, 3)]
    torch.testing.assert_close(torch.cat(halves), whole, rtol=0, atol=0)
    assert len(set(whole.flatten().tolist())) == 6
    shared = [rng.keyed_rand(_state(sample_offset=o), (5,), 2, rows_per_sample=0,
                             normal=True) for o in (0, 3)]
    torch.testing.assert_close(shared[0], shared[1], rtol=0, atol=0)
    p = torch.tensor([[0.0], [1.0], [0.5], [0.5]])
    drawn = rng.keyed_bernoulli_tensor(_state(), p, 0)
    assert drawn[0].item() == 0 and drawn[1].item() == 1
    x = torch.empty(4, 3)
    assert rng.keyed_bernoulli_tensor_(_state(), x, p, 0) is x
    assert torch.equal(x[:2], torch.tensor([[0.0] * 3, [1.0] * 3]))


@pytest.mark.parametrize("name, rows", [("DropPath", [1, 1, 1]), ("Noise", [0, 0])])
@pytest.mark.parametrize("captured_batch", [4, 2])
def test_captured_draws_equal_eager_under_the_mode(name, rows, captured_batch):
    """HF Swin's and timm's stochastic depth and `torch.bernoulli` of probabilities (per
    sample), (16,) noise and dropout of a weight (without samples): the graph captured at the
    whole batch (4) or at half of it (2, as a dp rank or a microbatch runs it, sample_offset
    2) gives the eager model's loss under the mode, and its gradients -- the eager model's
    at the same sample offset, or at offset 0 for the draws without samples (the eager mode
    keys every draw per sample: [Note: RNG contract])."""
    import _coupling_jobs

    torch.manual_seed(0)
    model = _coupling_jobs.MODELS[name]()
    batch = _coupling_jobs.batch(0)
    offset = 4 - captured_batch
    part = {k: v[offset:] for k, v in batch.items()}
    with keyed_random_ops(seed=3, step=1, sample_offset=offset if rows[0] else 0,
                          batch_size=captured_batch):
        want = model(**part)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    graph = capture(model, (), example_kwargs=_coupling_jobs.batch(0, captured_batch))
    gm = torch.fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph))
    materialize(gm, model, "cpu")
    indices = random_op_indices(gm)
    assert [op.rows_per_sample for op in indices.values()] == rows
    make_random_ops_layout_invariant(gm, indices)
    gm.random_state.seed, gm.random_state.step, gm.random_state.sample_offset = 3, 1, offset
    got = gm(part["x"], part["labels"])
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got, list(gm.parameters())), want_grads):
        torch.testing.assert_close(g, w)


class _SequenceFirst(torch.nn.Module):
    """Dropout of a (T, B, C) activation: the samples on dim 1."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):  # (T, B, C)
        return F.dropout(self.proj(x), 0.5).mean()


def test_a_draw_whose_samples_are_not_on_dim_0_is_refused_at_planning():
    """A (T, B, C) activation's dropout would be keyed by its T rows ([Note: RNG contract]
    keys dim 0): refused when the plan is made, naming the node, module, line and dim."""
    from autoplan.api import autoparallel

    model = autoparallel(_SequenceFirst(), global_batch=4, example_batch=torch.randn(6, 4, 8),
                         loss_fn=lambda out, batch: out, world_size=2)
    with pytest.raises(ValueError, match=r"_SequenceFirst: node dropout \(aten.dropout.default\) "
                                         r"at test_rng.py:\d+ `.*`: draws over a tensor of shape "
                                         r"\(6, 4, 8\) whose samples are on dim 1.*batch_first"):
        _ = model.plan


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [dict(dp=2), dict(tp=2), dict(dp=2, num_microbatches=2)],
                         ids=["dp2", "tp2", "dp2-m2"])
def test_stochastic_depth_trains_as_one_process(clusters, overrides):
    """Residual blocks with HF Swin's and timm's stochastic depth and a `torch.bernoulli` of
    probabilities (refused at planning before: aten.rand had no keyed version) on 2 gloo
    ranks, the batch split by dp and microbatches, or tp splitting the weights: 3 steps'
    losses and parameters equal one process under the RNG contract (fp32, rtol 1e-5)."""
    import _coupling_jobs
    from autoplan import testing

    if "tp" in overrides:  # under 0.9 of an ample tp2 plan's memory tp splits the weights
        from autoplan.api import autoparallel

        ample = autoparallel(_coupling_jobs.DropPath(), global_batch=4,
                             example_batch=_coupling_jobs.batch(0),
                             loss_fn=lambda out, batch: out, world_size=2, **overrides)
        overrides = dict(overrides, device_memory_bytes=ample.plan.prediction.memory_bytes * 0.9)
    want_losses, want_params, _, _ = _coupling_jobs.train("DropPath", None)
    for losses, params, _, plan in clusters.get(2).run(_coupling_jobs.train, "DropPath",
                                                       overrides, timeout_s=300):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses),
                                   rtol=1e-5, atol=1e-6)
        testing.assert_params_close(params, want_params)
        plan = json.loads(plan)
        assert (plan["mesh"]["dp"], plan["num_microbatches"]) == (
            overrides.get("dp", 1), overrides.get("num_microbatches", 1))
        if "tp" in overrides:
            assert any("S(" in p for s in plan["strategies"] for p in s["inputs"])


@pytest.mark.slow
def test_hf_swin_with_stochastic_depth_trains_as_one_process(clusters):
    """Hugging Face Swin with drop_path_rate 0.3 (refused at planning before: its
    `torch.rand((B, 1, 1))` had no keyed version) on 2 gloo ranks at dp 2 with 2 microbatches
    of one sample: 3 steps' losses and parameters equal one process (fp32, rtol 1e-5)."""
    import _coupling_jobs
    from autoplan import testing

    batches = _coupling_jobs.swin_batches()
    ref = testing.reference(_coupling_jobs.swin, batches)
    overrides = dict(dp=2, num_microbatches=2)
    for rank, result in enumerate(clusters.get(2).run(
            testing.train_planned, _coupling_jobs.swin, batches, overrides, global_batch=4,
            seq_len=1, timeout_s=600)):
        assert not testing.compare(result, ref), (rank, testing.compare(result, ref)[:3])
