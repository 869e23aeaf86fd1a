"""Fine-tuning priced as fine-tuning (issue 24, item 3): frozen parameters are held (and
gathered) but have no gradient, no gradient reduction and no optimizer state ([Note: frozen
pricing] in autoplan/cost_model/memory.py); a 16-bit plan holds them in the compute dtype when
nothing is lost or nothing else fits ([Note: frozen dtype] in autoplan/solver/frozen.py).
A model without frozen parameters plans as before (the golden plans, tests/test_planner_scale.py,
and byte-identical plan JSON, checked against the previous commit when this was written)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autoplan.capture import capture
from autoplan.cost_model.comm import collective_time_s
from autoplan.cost_model.compute import backward_time_s, op_time_s
from autoplan.cost_model.config import Config
from autoplan.cost_model.memory import STATE_BYTES_PER_PARAM, model_state_bytes
from autoplan.cost_model.placement_totals import Solution
from autoplan.cost_model.step_time import assess
from autoplan.models import build_model, example_inputs
from autoplan.models.mlp import MLP
from autoplan.op_classes import MATMUL_OPS, op_name
from autoplan.solver import plan
from autoplan.solver.ilp import evaluate
from autoplan.solver.search import Search
from autoplan.spec import TrainingSpec
from autoplan.topology import preset
from test_planner_scale import _random_placements

FIXED = dict(tp=1, pp=1, dp=4, num_microbatches=1, checkpointing="none")


def _mlp(frozen: bool):
    """4 blocks of Linear(256, 1024) -> GELU -> Linear(1024, 256); fc1 frozen when `frozen`:
    (trainable, all) elements = (4 x 262,400, 4 x 525,568)."""
    with torch.device("meta"):
        model = MLP(256, 1024, 4)
    for name, p in model.named_parameters():
        p.requires_grad_(not (frozen and "fc1" in name))
    return capture(model, (torch.zeros(8, 16, 256, device="meta"),), model_name="mlp")


@pytest.fixture(scope="module")
def mlps():
    return {frozen: _mlp(frozen) for frozen in (False, True)}


TRAINABLE, ALL = 4 * (1024 * 256 + 256), 4 * (2 * 1024 * 256 + 1024 + 256)


def _states(p) -> dict:
    b = p.prediction.memory_breakdown
    return {k: b[k] for k in ("params", "grads", "optimizer")}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_gradients_and_optimizer_states_are_the_trainable_parameters_only(mlps, zero):
    """fp32 AdamW, dp 4: params 4 B per element of all, grads 4 B and optimizer 8 B per
    trainable element, each sharded over dp from its ZeRO stage on (ZeRO Table 1; the
    parameters from ZeRO-2 on: FSDP2's fully_shard keeps only the shard as the parameter, the
    gathered copy of ZeRO-2 is counted with the temporaries). The peak is
    the backward of the first block before the reduction ([Note: peak moments]), where ZeRO
    2/3 also hold unsharded gradients: of the trainable parameters of the stage (ZeRO-2) or of
    one of its four blocks (ZeRO-3)."""
    spec = TrainingSpec(global_batch=8, seq_len=16)
    got = plan(mlps[True], preset("local-cpu", devices_per_node=4), spec, zero_stage=zero,
               **FIXED)
    shard = lambda stage: 4 if zero >= stage else 1  # noqa: E731
    unsharded = {2: 4 * TRAINABLE, 3: 4 * TRAINABLE / 4}.get(zero, 0.0)
    assert got.frozen_dtype == ""  # an fp32 plan holds everything in fp32
    assert _states(got) == pytest.approx({"params": 4 * ALL / shard(2),
                                          "grads": 4 * TRAINABLE / shard(2) + unsharded,
                                          "optimizer": 8 * TRAINABLE / shard(1)}, rel=1e-12)


def test_a_16_bit_frozen_base_is_priced_at_the_compute_dtype(mlps):
    """bf16, frozen weights already bf16 (a bf16 checkpoint): the plan holds them in bf16
    only, 2 B per frozen element; the trainable ones keep 4 + 4 + 8 B (fp32 master, fp32
    gradient, AdamW moments: the runtime's FSDP2 recipe)."""
    spec = TrainingSpec(global_batch=8, seq_len=16, dtype="bfloat16")
    topo = preset("local-cpu", devices_per_node=4)
    got = plan(mlps[True], topo, spec, zero_stage=3, frozen_weights_dtype="bfloat16", **FIXED)
    assert got.frozen_dtype == "bfloat16" and '"frozen_dtype": "bfloat16"' in got.to_json()
    assert _states(got) == pytest.approx({"params": (4 * TRAINABLE + 2 * (ALL - TRAINABLE)) / 4,
                                          "grads": 4 * TRAINABLE / 4 + 2 * TRAINABLE / 4,
                                          "optimizer": 8 * TRAINABLE / 4}, rel=1e-12)


def test_a_model_without_frozen_parameters_is_priced_as_before(mlps):
    """No frozen parameter: every element has its gradient and states, no frozen_dtype in the
    plan (nor its JSON key), whatever the weights' dtype; model_state_bytes is the paper's."""
    spec = TrainingSpec(global_batch=8, seq_len=16, dtype="bfloat16")
    got = plan(mlps[False], preset("local-cpu", devices_per_node=4), spec, zero_stage=0,
               frozen_weights_dtype="bfloat16", **FIXED)
    assert got.frozen_dtype == "" and "frozen_dtype" not in got.to_json()
    assert _states(got) == pytest.approx({"params": 4 * ALL, "grads": 4 * ALL,
                                          "optimizer": 8 * ALL}, rel=1e-12)
    assert model_state_bytes(1e9, 1, 8, frozen_params=0.0) == model_state_bytes(1e9, 1, 8)
    assert model_state_bytes(1e9, 1, 8) == {"params": 2e9, "grads": 2e9, "optimizer": 12e9 / 8}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_dp_sync_reduces_only_trainable_gradients(zero):
    """[Note: step time], dp_sync: gradients of the trainable elements only are reduced
    (all-reduce, or reduce-scatter at ZeRO 2/3); ZeRO-1 gathers the updated trainable
    parameters only (their fp32 masters); ZeRO-2/3 still gather every parameter (frozen ones
    are sharded too)."""
    topo, dp, units = preset("dgx-h100"), 8, 5  # 4 blocks and the stage root: 5 FSDP2 units
    spec = TrainingSpec(global_batch=8, seq_len=16, dtype="bfloat16")
    cfg = Config(1, dp, 1, zero, 1, 1, "1f1b")
    elems, frozen = 4e9, 3.5e9
    tuned = Solution({}, param_elems={"layer": elems}, frozen_elems={"layer": frozen})
    full = Solution({}, param_elems={"layer": elems})
    kw = dict(total_layers=4, output_bytes=0.0, boundary_bytes=0.0)
    got = assess(cfg, tuned, spec, topo, **kw).dp_sync_s
    grad_b = STATE_BYTES_PER_PARAM[(True, "adamw")][1]

    def t(kind, nbytes, n=units):
        return n * collective_time_s(kind, nbytes / n, dp, topo, stride=1)
    grads = (elems - frozen) * grad_b
    want = {0: t("all_reduce", grads),
            # the fp32 masters, one all-gather per tensor ([Note: ZeRO-1 partition]); no
            # tensor count given to assess: one
            1: t("all_reduce", grads) + t("all_gather", (elems - frozen) * 4, 1),
            2: t("reduce_scatter", grads) + t("all_gather", elems * 2),
            3: t("reduce_scatter", grads) + 2 * t("all_gather", elems * 2)}[zero]
    assert got == pytest.approx(want, rel=1e-12)
    assert got < assess(cfg, full, spec, topo, **kw).dp_sync_s


@pytest.fixture(scope="module")
def frozen_llama():
    """llama-tiny with its embedding and attention frozen (a fine-tune of the MLPs)."""
    with torch.device("meta"):
        model = build_model("llama-tiny")
    for name, p in model.named_parameters():
        p.requires_grad_("mlp" in name or "lm_head" in name)
    return capture(model, example_inputs("llama-tiny", batch=1, seq_len=16, device="meta"),
                   model_name="llama-tiny-frozen")


def test_ilp_forms_equal_assess_with_frozen_parameters(frozen_llama):
    """The ILP's step form and memory forms (RankMemory.frozen_coef, StepForm's B_f) give
    what pipeline.assess gives, on random placements of random configurations of a model
    with frozen parameters: the ILP optimises and constrains what the plan is priced at."""
    topo = preset("dgx-h100")
    spec = TrainingSpec(global_batch=8, seq_len=16, dtype="bfloat16", frozen_dtype="bfloat16")
    checked = 0
    for search, cfg, prob, costs, choice, sol in _random_placements(
            5, 25, (frozen_llama, topo, spec)):
        assert prob.frozen  # the embedding and attention weights
        a = search.assess(cfg, sol)
        assert search.step_form(cfg).value(sol) == pytest.approx(a.step_time_s, rel=1e-9)
        memories = [_form_memory(prob, costs, rank, choice) for rank in search.ranks(cfg)]
        assert max(memories) == pytest.approx(a.memory_bytes, rel=1e-9), cfg
        checked += 1
    assert checked >= 10


def _form_memory(prob, costs, rank, choice) -> float:
    total = rank.const_bytes
    for g, elems in costs.param_elems.items():
        per_part = rank.frozen_coef if g in prob.frozen else rank.param_coef
        total += max(per_part.get(p, 0.0) for p in prob.params[g][2]) * elems[choice[g]]
    for n, row in costs.act_bytes.items():
        part = prob.part.get(n, "pre") if n is not None else "pre"
        total += rank.act_coef.get(part, 0.0) * (row[choice[n]] if n in choice else row[0])
    for n, row in costs.boundary_bytes.items():
        total += rank.boundary_coef * (row[choice[n]] if n in choice else row[0])
    return total


def test_frozen_dtype_follows_the_rule(mlps):
    """[Note: frozen dtype]: weights of unknown dtype keep fp32 masters where they fit; where
    only the 16-bit base fits, the plan holds it in bf16; bf16 weights are held in bf16."""
    spec = TrainingSpec(global_batch=8, seq_len=16, dtype="bfloat16")
    base = preset("local-cpu", devices_per_node=4)
    kept = plan(mlps[True], base, spec, zero_stage=0, **FIXED)
    sixteen = plan(mlps[True], base, spec, zero_stage=0, frozen_weights_dtype="bfloat16",
                   **FIXED)
    assert (kept.frozen_dtype, sixteen.frozen_dtype) == ("", "bfloat16")
    saved = 2 * (ALL - TRAINABLE)  # fp32 -> bf16 frozen weights, ZeRO-0
    assert kept.prediction.memory_bytes - sixteen.prediction.memory_bytes == pytest.approx(
        saved, rel=1e-9)
    budget = sixteen.prediction.memory_bytes + saved / 2  # between the two
    small = dataclasses.replace(base, device=dataclasses.replace(
        base.device, mem_bytes=budget / spec.max_memory_fraction))
    assert kept.prediction.memory_bytes > budget  # the fp32 masters do not fit
    chosen = plan(mlps[True], small, spec, zero_stage=0, **FIXED)
    assert chosen.frozen_dtype == "bfloat16"
    assert chosen.prediction.memory_bytes == pytest.approx(sixteen.prediction.memory_bytes)


def test_memory_constrained_ilp_equals_exhaustive_search_with_frozen_parameters():
    """Optimality bar with a frozen part: on a wide MLP whose first Linear is frozen, at tp 2
    and a memory limit that binds, the constrained ILP's placement is the fastest that fits
    among all placements (brute force, each priced by Search.assess)."""
    import itertools

    from autoplan.models.mlp import WideMLP
    from autoplan.solver.configurations import PlanConfig

    with torch.device("meta"):
        model = WideMLP(256, 1024)
    model.fc1.weight.requires_grad_(False)
    model.fc1.bias.requires_grad_(False)
    graph = capture(model, (torch.zeros(1, 64, 256),), model_name="wide-mlp-frozen")
    spec = TrainingSpec(global_batch=2, seq_len=64, dtype="bfloat16", frozen_dtype="bfloat16")
    base = preset("local-cpu", devices_per_node=4)
    cfg = PlanConfig(1, 2, 2, 1, 1, 1, "1f1b")
    search = Search(graph, base, spec, 10.0)
    prob, costs = search.problem(2), search.cost(*cfg.costs_key)
    assert prob.frozen
    priced = []
    for combo in itertools.product(*[range(len(prob.cands[n])) for n in prob.nodes]):
        try:
            sol = evaluate(prob, costs, dict(zip(prob.nodes, combo)))
        except KeyError:
            continue
        a = search.assess(cfg, sol)
        priced.append((a.step_time_s, a.memory_bytes))
    fastest = min(priced)
    smallest = min(m for _t, m in priced)
    budget = (fastest[1] + smallest) / 2  # the fastest does not fit, the smallest does
    assert smallest < budget < fastest[1]
    small = dataclasses.replace(base, device=dataclasses.replace(
        base.device, mem_bytes=budget / spec.max_memory_fraction))
    search = Search(graph, small, spec, 10.0)
    got = search.assess(cfg, search.solution(cfg, constrained=True))
    best = min(t for t, m in priced if m <= budget)
    ties = len(prob.nodes) * 1e-9  # the ILP's tie-breaks ([Note: step form])
    assert got.fits and got.step_time_s == pytest.approx(best, rel=1e-9, abs=ties)


# --- backward compute ([Note: backward share] in autoplan/capture/facts.py) --------------------

class _FrozenThenTrainable(torch.nn.Module):
    """x (4, 16) -> frozen Linear(16, 32), its weight cast to bf16 and transposed in the graph
    -> trainable Linear(32, 8)."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(16, 32, bias=False)
        self.head = torch.nn.Linear(32, 8)
        self.base.requires_grad_(False)

    def forward(self, x):
        w = self.base.weight.to(torch.bfloat16).t()  # (16, 32), frozen-only
        h = torch.mm(x.to(torch.bfloat16), w).float()
        return self.head(h)


def _shares(graph) -> dict[str, tuple[str, float]]:
    return {n: (op_name(i.target), i.backward_share) for n, i in graph.nodes.items()}


def test_backward_share_follows_the_frozen_weight():
    """The frozen matmul computes only its input gradient (share 0.5); the cast and transpose
    of the frozen weight have no backward (0); everything downstream of the input is 1."""
    with torch.device("meta"):
        model = _FrozenThenTrainable()
    graph = capture(model, (torch.zeros(4, 16, device="meta"),), model_name="frozen-then")
    shares = _shares(graph)
    weight_side = {n for n, (op, _) in shares.items() if op in ("_to_copy", "t", "to")}
    by_op = {op: s for op, s in shares.values()}
    assert by_op["mm"] == 0.5 and by_op["linear"] == 1.0
    frozen_only = {n for n, (_, s) in shares.items() if s == 0.0}
    assert frozen_only and frozen_only <= weight_side
    assert {op for n, (op, _) in shares.items() if n in frozen_only} >= {"t"}
    assert all(s == 1.0 for n, (op, s) in shares.items() if op not in ("mm",)
               and n not in frozen_only)
    # no frozen parameter: share 1 everywhere
    model.base.requires_grad_(True)
    full = capture(model, (torch.zeros(4, 16, device="meta"),), model_name="all-trainable")
    assert all(s == 1.0 for _, s in _shares(full).values())


def test_backward_time_scales_with_the_share(mlps):
    """A matmul at share 0.5 costs half its backward at 1 (one of its two gradient matmuls);
    an op at share 0 has none; the forward does not change."""
    device = preset("dgx-h100").device
    frozen = [i for i in mlps[True].nodes.values() if i.backward_share != 1.0]
    assert frozen and all(op_name(i.target) in MATMUL_OPS and i.backward_share == 0.5
                          or i.backward_share == 0.0 for i in frozen)
    mm = next(i for i in frozen if i.backward_share == 0.5)
    whole = dataclasses.replace(mm, backward_share=1.0)
    assert backward_time_s(mm, device, "bfloat16") == pytest.approx(
        0.5 * backward_time_s(whole, device, "bfloat16"), rel=1e-12)
    assert op_time_s(mm, device, "bfloat16") == op_time_s(whole, device, "bfloat16")
    add = dataclasses.replace(whole, target="aten.add.Tensor", backward_share=0.0)
    assert backward_time_s(add, device, "bfloat16") == 0.0
    assert all(i.backward_share == 1.0 for i in mlps[False].nodes.values())
