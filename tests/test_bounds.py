"""The search's cheap bounds agree with the ones they stand in for: a configuration's step-time
bound priced without memory is its lower bound's step time, the memory floor drops only
configurations that do not fit ([Note: time first] in autoplan/solver/branch_bound.py), and a
reused LP bounds as a fresh one ([Note: LP reuse] in autoplan/solver/ilp.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import _moe
from autoplan.capture import capture, capture_preset
from autoplan.solver.branch_bound import variants
from autoplan.solver.configurations import Overrides, enumerate_configs
from autoplan.solver.search import Search
from autoplan.spec import TrainingSpec
from autoplan.topology import preset


def _graph(kind: str):
    if kind == "llama":
        graph = capture_preset("llama-tiny", batch=8, seq_len=64, num_layers=1)
    else:  # experts: ep > 1 configurations, their slices in the floor
        graph = capture(_moe.factory("mixtral", intermediate_size=512, num_local_experts=8)()
                        .to("meta"), (torch.zeros(1, 64, dtype=torch.long, device="meta"),))
    graph.total_layers = 32
    return graph


@pytest.fixture(scope="module", params=["llama", "mixtral"])
def search(request):
    """A tiny model at 32 blocks on 2 dgx-h100 nodes whose devices are made so small that
    some configurations fit, some do not, some on their memory floor alone (the budget: the
    median lower bound's memory, below the largest floor)."""
    graph, spec = _graph(request.param), TrainingSpec(global_batch=8, seq_len=64)
    topo = preset("dgx-h100", num_nodes=2)
    probe = Search(graph, topo, spec, 10.0)
    configs = _configs(probe)
    mem = sorted(probe.lower_bound(c).memory_bytes for c in configs)
    budget = min(mem[len(mem) // 2], 0.9 * max(probe.floor_bytes(c) for c in configs))
    topo = dataclasses.replace(topo, device=dataclasses.replace(
        topo.device, mem_bytes=budget / spec.max_memory_fraction))
    return Search(graph, topo, spec, 10.0)


def _configs(search):
    configs = enumerate_configs(search.graph, search.topology, search.spec, Overrides(),
                                search.policies())
    return configs + [v for c in configs for v in variants(search, c, Overrides())]


def test_time_bound_is_the_lower_bound_and_the_floor_drops_only_what_does_not_fit(search):
    over = fits = unfit = 0
    for cfg in _configs(search):
        time_s = search.time_bound(cfg)  # before lower_bound: priced without memory
        dropped = search.over_budget(cfg)
        lb = search.lower_bound(cfg)
        assert time_s == lb.step_time_s, cfg  # the same float: the heap's order is kept
        assert not (dropped and lb.fits), cfg
        # the floor: at least what the fullest rank holds at every moment (its states), no
        # more than its peak
        floor = search.floor_bytes(cfg)
        worst = lb.memory_breakdown
        assert worst["params"] + worst["optimizer"] <= floor * (1 + 1e-12), cfg
        assert floor <= lb.memory_bytes * (1 + 1e-12), cfg
        assert dropped == (floor > search.budget_bytes * (1 + 1e-9)), cfg
        over += dropped
        fits += lb.fits
        unfit += not lb.fits and not dropped
    # each kind is there: the checks above are not vacuous
    assert over and fits and unfit, (over, fits, unfit)
    assert search.moe is None or any(c.ep > 1 for c in _configs(search))


def test_a_reused_lp_bounds_as_a_fresh_one(search):
    """Relaxations of configurations sharing LP rows, solved in turn on one kept LP (its
    objective set anew, GLOP from the previous basis), against each solved on a new LP."""
    configs = [c for c in _configs(search) if c.pp == 2 and c.tp == 2 and c.offload == "none"]
    assert len(configs) >= 4
    prob = search.problem(2)
    for cfg in configs[:12]:
        key = search._key(cfg, True, False)[0]
        search.bounds.pop(("relax",) + key, None)
        reused = search.relaxation(cfg)
        search.bounds.pop(("relax",) + key)
        prob.__dict__.pop("_lp_models", None)  # a fresh LP
        fresh = search.relaxation(cfg)
        assert reused[0] == pytest.approx(fresh[0], rel=1e-9, abs=1e-12), cfg
        assert (reused[1] is None) == (fresh[1] is None), cfg
        if fresh[1] is not None:
            form = search.step_form(cfg)
            assert form.value(reused[1]) == pytest.approx(form.value(fresh[1]), rel=1e-7), cfg


def test_a_recosted_lp_solves_as_a_fresh_one(search):
    """The time-optimal placements of several (b, policy) of one problem, solved in turn on
    one kept LP re-costed each time ([Note: LP re-costing] in autoplan/solver/ilp.py: the
    same variables and rows, the new costs' terms), against each solved on a new LP: the
    same step time and LP bound. The re-costings are counted: the test is not vacuous."""
    from autoplan.solver import ilp
    from autoplan.solver.ilp_types import TIME_FORM

    prob = search.problem(2)
    keys = sorted({c.costs_key for c in _configs(search) if c.tp == 2 and c.cp == 1})
    assert len(keys) >= 3
    prob.__dict__.pop("_lp_models", None)
    recosted = 0

    def solved(costs):  # the placement, the LP bound, the LP it was solved on
        sol = ilp.solve(prob, costs, time_limit_s=10.0)
        model = next(reversed(prob.__dict__["_lp_models"].values()))[1]
        return sol, model.s.Objective().Value(), model

    for key in keys:
        costs = search.cost(*key)
        before = [m for _c, m in prob.__dict__["_lp_models"].values()] \
            if "_lp_models" in prob.__dict__ else []
        reused, reused_bound, model = solved(costs)
        recosted += any(model is m for m in before)
        kept = prob.__dict__.pop("_lp_models")
        fresh, fresh_bound, _model = solved(costs)  # on a new LP
        prob.__dict__["_lp_models"] = kept
        assert reused_bound == pytest.approx(fresh_bound, rel=1e-9), key
        assert TIME_FORM.value(reused) == pytest.approx(TIME_FORM.value(fresh), rel=1e-7), key
    assert recosted >= 1, recosted
