"""Stage splits the search chooses ([Note: uneven stages] in autoplan/solver/configurations.py):
the blocks of the stages that also hold the embedding and the head are fewer when the cost model
prices that faster, the report says what the even split would cost, and the runtime trains the
split as one process does."""

from __future__ import annotations

import json

import pytest

import _jobs
from autoplan.capture import capture
from autoplan.models import build_model, example_inputs
from autoplan.plan import Plan
from autoplan.report.markdown import render_markdown, render_summary
from autoplan.solver import plan
from autoplan.solver.configurations import balanced_stages, end_weights
from autoplan.solver.planner import reprice
from autoplan.spec import TrainingSpec
from autoplan.testing import compare
from autoplan.topology import preset


@pytest.fixture(scope="module")
def llama6():
    """A 6-block llama-tiny: pp 4 splits it 2/2/1/1 evenly."""
    return capture(build_model("llama-tiny", num_hidden_layers=6),
                   example_inputs("llama-tiny", batch=4, seq_len=16), model_name="llama-tiny")


def test_the_llama_3_405b_split_is_the_published_one():
    """126 blocks on 16 stages, the embedding and the head each 0.66 of a block (Llama 3
    405B's 2.1B-parameter vocabulary matrices against 3.2B per block): one block fewer on the
    first and the last stage, as Dubey et al. 2024 (sec. 3.3.2) trained it."""
    assert balanced_stages(126, 16, 1, 0.66, 0.66) == (7,) + (8,) * 14 + (7,)


def test_a_split_is_offered_only_where_the_heaviest_rank_gets_lighter():
    assert balanced_stages(8, 2, 1, 0.0, 0.0) is None  # nothing at the ends: the even split
    assert balanced_stages(8, 2, 1, 0.3, 0.3) is None  # 4 + 0.3 either way
    assert balanced_stages(8, 2, 1, 0.0, 1.5) == (5, 3)  # 5 against 4 + 1.5
    assert balanced_stages(3, 4, 1, 1.0, 1.0) is None  # fewer blocks than stages
    split = balanced_stages(80, 32, 1, 1.2, 1.2)
    assert sum(split) == 80 and min(split) >= 1 and split[0] == split[-1] == 1
    # under 5% off the heaviest rank (SPLIT_GAIN): not worth a configuration more
    assert balanced_stages(20, 2, 1, 0.0, 1.2) is None  # 11 against 10 + 1.2
    # interleaved: stage k runs on pipeline rank k % pp; the ranks are balanced, not stages
    split = balanced_stages(24, 4, 2, 2.0, 2.0)
    load = [split[r] + split[r + 4] for r in range(4)]
    load[0] += 2.0
    load[3] += 2.0
    assert sum(split) == 24 and max(load) == 7  # 6 + 2 split evenly


def test_end_weights_count_the_embedding_and_the_head(llama6):
    """llama-tiny: the embedding (vocab x width) before the blocks, the final norm and the
    untied head after them; each in blocks, the larger of parameters and forward FLOPs."""
    block = sum(p.numel for p in llama6.params.values()
                if p.layer_id is not None and not p.is_buffer) / llama6.num_layers
    vocab, width = llama6.params["model.embed_tokens.weight"].shape
    before, after = end_weights(llama6)
    assert before == pytest.approx(vocab * width / block)
    assert after >= (vocab * width + width) / block - 1e-9
    bare = capture(build_model("llama-tiny", num_hidden_layers=1),
                   example_inputs("llama-tiny", batch=4, seq_len=16), model_name="llama-tiny")
    assert end_weights(bare)[0] == pytest.approx(vocab * width / block)


def test_the_search_splits_the_end_stages_lighter_and_says_by_how_much(llama6):
    """pp 4 on 6 blocks, uneven_stages=True: 1/2/2/1 beats the even 2/2/1/1 (whose first stage
    runs the embedding and two blocks), which is the split by default; the plan records it
    unpinned, the runner-up is the even split with its
    step time, the summary and the report say both, and repricing the plan prices its split."""
    topo, spec = preset("local-cpu", devices_per_node=4), TrainingSpec(4, 16)
    assert [s.num_layers for s in plan(llama6, topo, spec, pp=4).stages] == [2, 2, 1, 1]
    p = plan(llama6, topo, spec, pp=4, uneven_stages=True)
    assert [s.num_layers for s in p.stages] == [1, 2, 2, 1] and not p.pinned_stages
    even = p.alternatives[0]
    assert even.reason.startswith("stages split evenly (2x2/1x2 blocks): ")
    assert (even.mesh, even.stages) == (p.mesh, ())
    assert even.step_time_s > p.prediction.step_time_s
    assert Plan.from_json(p.to_json()) == p
    assert "stages of 1/2x2/1 blocks (split evenly: +" in render_summary(p, graph=llama6)
    assert "stages split evenly (2x2/1x2 blocks)" in render_markdown(p, graph=llama6)
    again = reprice(llama6, p, topo, spec)
    assert [s.num_layers for s in again.stages] == [1, 2, 2, 1]
    assert again.prediction.step_time_s == pytest.approx(p.prediction.step_time_s, rel=1e-9)
    # a pinned split is the only one priced: no even-split runner-up
    pinned = plan(llama6, topo, spec, stages=[2, 2, 1, 1], uneven_stages=True)
    assert pinned.pinned_stages and not any(
        a.reason.startswith("stages split evenly") for a in pinned.alternatives)


@pytest.mark.slow
def test_a_searched_split_at_pp4_trains_as_one_process(clusters):
    """The 6-block llama-tiny on 4 ranks at pp 4 with the split the search chose (1/2/2/1):
    every rank's losses and parameters equal one process after 3 AdamW steps (fp32, rtol
    1e-5)."""
    factory = _jobs.preset("llama-tiny", num_hidden_layers=6)
    results = clusters.get(4).run(_jobs.train, factory, 3, 4, dict(pp=4, uneven_stages=True),
                                  timeout_s=300)
    ref = _jobs.reference(factory, 3, 4)
    for rank, result in enumerate(results):
        assert compare(result, ref) == [], f"rank {rank}"
        stages = [(s["layer_start"], s["layer_end"]) for s in json.loads(result[2])["stages"]]
        assert stages == [(0, 1), (1, 3), (3, 5), (5, 6)]


@pytest.mark.slow
def test_a_pinned_uneven_split_at_pp2_with_dp2_trains_as_one_process(clusters):
    """The 4-block llama-tiny on 4 ranks at pp2 x dp2 with the head's stage lighter (3/1
    blocks, pinned): every rank's losses and parameters equal one process after 3 AdamW steps
    (fp32, rtol 1e-5)."""
    factory = _jobs.preset("llama-tiny", num_hidden_layers=4)
    results = clusters.get(4).run(_jobs.train, factory, 3, 4,
                                  dict(pp=2, dp=2, stages=[3, 1], num_microbatches=2),
                                  timeout_s=300)
    ref = _jobs.reference(factory, 3, 4)
    for rank, result in enumerate(results):
        assert compare(result, ref) == [], f"rank {rank}"
        stages = [(s["layer_start"], s["layer_end"]) for s in json.loads(result[2])["stages"]]
        assert stages == [(0, 3), (3, 4)]
