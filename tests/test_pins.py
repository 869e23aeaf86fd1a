"""Pinned placements ([Note: pinned placements] in autoplan/solver/pins.py): parameters the
user fixes on the tp axis are hard constraints of the plan, recorded in it, refused by name
where they cannot hold, and trained as one process."""

from __future__ import annotations

import json

import pytest
import _jobs

from autoplan.capture import capture
from autoplan.models import build_model, example_inputs
from autoplan.plan import Plan
from autoplan.solver import InvalidConfig, plan
from autoplan.solver.pins import parse_pins
from autoplan.spec import TrainingSpec
from autoplan.testing import compare
from autoplan.topology import preset


@pytest.fixture(scope="module")
def llama():
    return capture(build_model("llama-tiny"), example_inputs("llama-tiny", batch=8, seq_len=16),
                   model_name="llama-tiny")


@pytest.fixture(scope="module")
def local4():
    return preset("local-cpu", devices_per_node=4)


def test_a_pinned_head_and_blocks_are_planned_so_and_recorded(llama, local4):
    """lm_head pinned S(0) (vocabulary-parallel) with tp left to the planner: a mesh with
    tp > 1 whose head is S(0); a glob over every block's down_proj pins all of them; the plan
    records the pins and keeps them through JSON."""
    p = plan(llama, local4, TrainingSpec(8, 16), placements={"lm_head.weight": "S(0)"})
    assert p.mesh.tp > 1 and p.placement_of("lm_head.weight") == "S(0)"
    assert p.pinned == (("lm_head.weight", "S(0)"),)
    assert Plan.from_json(p.to_json()) == p and '"pinned"' in p.to_json()
    pins = ["model.layers.*.mlp.down_proj.weight=S(1)", "model.embed_tokens.weight=S(1)"]
    p = plan(llama, local4, TrainingSpec(8, 16), tp=2, placements=pins)
    placed = dict(p.param_placements)
    assert [placed[f"model.layers.{k}.mlp.down_proj.weight"] for k in range(2)] == ["S(1)"] * 2
    assert placed["model.embed_tokens.weight"] == "S(1)"
    free = plan(llama, local4, TrainingSpec(8, 16), tp=2)
    assert free.pinned == () and '"pinned"' not in free.to_json()  # plan.json as before


@pytest.mark.parametrize("pins, tp, message", [
    ({"model.layers.0.mlp.down_proj.weight": "S(1)"}, 2,
     "not the same parameter in every block (1 of 2); blocks share their placements, so pin "
     "it in all of them, e.g. model.layers.*.mlp.down_proj.weight"),
    ({"model.layers.*.nothing": "R"}, 2, "matches no parameter of llama-tiny"),
    ({"lm_head.weight": "P"}, 2, "is R or S(d)"),
    ({"lm_head.weight": "S(2)"}, 2, "the parameter has 2 dims"),
    # 8 rows of 2 key/value heads over 4 ranks would cut a head: no strategy offers it
    ({"model.layers.*.self_attn.k_proj.weight": "S(0)"}, 4,
     "k_proj.weight (8, 32) at tp 4: no strategy of its node places it so"),
])
def test_a_pin_that_cannot_hold_is_refused_by_name(llama, local4, pins, tp, message):
    with pytest.raises(ValueError) as e:
        plan(llama, local4, TrainingSpec(8, 16), tp=tp, placements=pins)
    assert str(e.value).startswith("placements: ") and message in str(e.value)


def test_a_tp_that_does_not_divide_a_pinned_dim(llama):
    """3 ranks: tp 3 fixed cannot split the 64-row embedding (InvalidConfig naming the
    numbers); with tp searched, tp 3 is skipped and tp 1 cannot hold a split either."""
    local3 = preset("local-cpu", devices_per_node=3)
    pins = {"model.embed_tokens.weight": "S(0)"}
    with pytest.raises(InvalidConfig, match=r"embed_tokens\.weight \(64, 32\) at tp 3: dim 0 "
                                            r"of size 64 does not split over 3 ranks"):
        plan(llama, local3, TrainingSpec(6, 16), tp=3, placements=pins)
    with pytest.raises(InvalidConfig, match="tp 3: placements: "):
        plan(llama, local3, TrainingSpec(6, 16), placements=pins)
    # tp 3 on llama-tiny's 8 query heads of 4: the query projection cannot be cut by heads
    with pytest.raises(InvalidConfig, match=r"placements: model\.layers\.\*\.self_attn\."
                                            r"q_proj\.weight=S\(0\) cannot hold for model\."
                                            r"layers\.0\.self_attn\.q_proj\.weight \(32, 32\) "
                                            r"at tp 3: dim 0 of size 32 does not split"):
        plan(llama, local3, TrainingSpec(6, 16), tp=3,
             placements={"model.layers.*.self_attn.q_proj.weight": "S(0)"})


def test_a_vocabulary_tp_does_not_divide_is_split_unevenly():
    """[Note: uneven vocabulary]: a head of 11 rows pinned S(0) at tp 2 (6 and 5 rows) and at
    tp 3 (4, 4, 3); its width of 32, which tp 3 does not divide, stays refused by its
    numbers."""
    g = capture(build_model("llama-tiny", vocab_size=11),
                tuple(t % 11 for t in example_inputs("llama-tiny", batch=6, seq_len=16)),
                model_name="llama-tiny")
    assert g.vocab_size == 11
    for tp in (2, 3):
        p = plan(g, preset("local-cpu", devices_per_node=tp), TrainingSpec(6, 16), tp=tp,
                 placements={"lm_head.weight": "S(0)"})
        assert p.placement_of("lm_head.weight") == "S(0)"
    with pytest.raises(InvalidConfig, match=r"lm_head\.weight \(11, 32\) at tp 3: dim 1 of "
                                            r"size 32 does not split over 3 ranks"):
        plan(g, preset("local-cpu", devices_per_node=3), TrainingSpec(6, 16), tp=3,
             placements={"lm_head.weight": "S(1)"})


def test_a_tied_weight_pinned_where_one_reader_cannot_take_it():
    """GPT-2's head is its token embedding: pinning lm_head.weight S(0) pins the embedding's
    table, which the embedding lookup reads at R or S(1) only (a split parameter is used as
    it is stored): refused naming the tie and the reader, where an ILP without a solution
    once reported "no plan fits in memory"."""
    g = capture(build_model("gpt2-tiny"), example_inputs("gpt2-tiny", batch=8, seq_len=16),
                model_name="gpt2-tiny")
    with pytest.raises(ValueError, match=r"transformer\.wte\.weight \(the tensor of "
                                         r"lm_head\.weight\) at tp \d: embedding "):
        plan(g, preset("local-cpu", devices_per_node=4), TrainingSpec(8, 16),
             placements={"lm_head.weight": "S(0)"})


def test_parse_pins_forms():
    assert parse_pins(None) == () and parse_pins({}) == ()
    assert parse_pins(["b=S(0)", ("a", "R")]) == (("a", "R"), ("b", "S(0)"))
    with pytest.raises(ValueError, match="expected PATTERN=PLACEMENT"):
        parse_pins(["lm_head.weight"])


def test_autoparallel_and_the_cli_take_pins(tmp_path, capsys):
    from autoplan.api import autoparallel
    from autoplan.cli import main

    ap = autoparallel(build_model("llama-tiny", device="meta"), global_batch=8, seq_len=16,
                      world_size=4, placements={"lm_head.weight": "S(0)"})
    assert ap.plan.placement_of("lm_head.weight") == "S(0)"
    code = main(["plan", "-q", "--model", "llama-tiny", "--cluster", "local-cpu",
                 "--devices-per-node", "4", "--global-batch", "8", "--seq", "16",
                 "--place", "lm_head.weight=S(0)", "--json", "-o", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert json.loads(out)["mesh"]["tp"] > 1
    written = Plan.from_json((tmp_path / "plan.json").read_text())
    assert written.pinned == (("lm_head.weight", "S(0)"),)
    assert "Pinned by the user (hard constraints of the search): `lm_head.weight` `S(0)`." in \
        (tmp_path / "report.md").read_text()
    code = main(["plan", "-q", "--model", "llama-tiny", "--cluster", "local-cpu",
                 "--devices-per-node", "4", "--global-batch", "8", "--seq", "16",
                 "--stages", "1,1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["mesh"]["pp"] == 2 and out["pinned_stages"] is True
    assert out["stage_blocks"] == [1, 1]


@pytest.mark.slow
def test_a_pinned_plan_trains_as_one_process(clusters):
    """llama-tiny at dp2 x tp2 with its head pinned vocabulary-parallel (S(0)) and its token
    embedding pinned whole (R): every rank's losses and parameters equal one process after
    3 AdamW steps (fp32, rtol 1e-5)."""
    overrides = dict(dp=2, tp=2, placements={"lm_head.weight": "S(0)",
                                            "model.embed_tokens.weight": "R"})
    results = clusters.get(4).run(_jobs.train, _jobs.preset("llama-tiny"), 3, 4, overrides,
                                  timeout_s=180)
    ref = _jobs.preset_reference("llama-tiny", 3, 4)
    for rank, result in enumerate(results):
        assert compare(result, ref) == [], f"rank {rank}"
        placed = dict(json.loads(result[2])["param_placements"])
        assert placed["lm_head.weight"] == "S(0)"
        assert placed["model.embed_tokens.weight"] == "R"


@pytest.mark.slow
def test_an_uneven_vocabulary_head_trains_as_one_process(clusters):
    """A vocabulary of 11 pinned S(0) at dp2 x tp2: the tp ranks hold rows 0-5 and 6-10 and
    run the vocabulary-parallel cross-entropy on them ([Note: uneven vocabulary]); losses and
    parameters equal one process after 3 AdamW steps (fp32, rtol 1e-5) -- no padded rows
    that would add to the softmax's denominator (log 2 per token at tp 2)."""
    factory = _jobs.preset("llama-tiny", vocab_size=11)
    overrides = dict(dp=2, tp=2, placements={"lm_head.weight": "S(0)"})
    results = clusters.get(4).run(_jobs.train_vocab_shard, factory, 3, 4, overrides,
                                  timeout_s=180)
    ref = _jobs.reference(factory, 3, 4)
    for rank, result in enumerate(results):
        assert compare(result[:4], ref) == [], f"rank {rank}"
        assert result[4] == ((0, 11), (6, 11))[rank % 2], f"rank {rank}"


@pytest.fixture(scope="module")
def llama4():
    return capture(build_model("llama-tiny", num_hidden_layers=4),
                   example_inputs("llama-tiny", batch=8, seq_len=16), model_name="llama-tiny")


def test_pinned_stages_are_planned_priced_and_recorded(llama4, local4):
    """stages=[3, 1]: pp 2 with 3 blocks on the first stage and 1 on the last, priced so (the
    first rank holds more: a slower step than the even split at the same configuration),
    recorded in plan.json and the report; stages that cannot hold are refused naming the
    numbers."""
    from autoplan.report.markdown import render_markdown, render_summary

    p = plan(llama4, local4, TrainingSpec(8, 16), stages=[3, 1], dp=2, schedule="1f1b")
    assert (p.mesh.pp, [(s.layer_start, s.layer_end) for s in p.stages]) == (2, [(0, 3), (3, 4)])
    even = plan(llama4, local4, TrainingSpec(8, 16), pp=2, dp=2, schedule="1f1b")
    assert [s.num_layers for s in even.stages] == [2, 2] and not even.pinned_stages
    assert (p.mesh, p.zero_stage, p.num_microbatches) == (even.mesh, even.zero_stage,
                                                          even.num_microbatches)
    assert p.prediction.step_time_s > even.prediction.step_time_s
    assert p.pinned_stages and Plan.from_json(p.to_json()) == p
    from autoplan.solver.planner import reprice

    again = reprice(llama4, p, local4, TrainingSpec(8, 16)).prediction.step_time_s
    assert again == pytest.approx(p.prediction.step_time_s, rel=1e-9)
    assert '"pinned_stages"' not in even.to_json()
    assert "stages=3/1" in render_summary(p, graph=llama4)
    assert "stages of 3/1 blocks" in render_markdown(p, graph=llama4)
    for stages, message in (([2, 1], r"stages \[2, 1\] hold 3 blocks; the model has 4"),
                            ([4, 0], "every stage needs at least one block"),
                            ([1, 1, 2], r"3 stages for pp 2 x num_virtual_stages 1 = 2")):
        with pytest.raises(InvalidConfig, match=message):
            plan(llama4, local4, TrainingSpec(8, 16), stages=stages,
                 pp=2 if len(stages) == 3 else None)


@pytest.mark.slow
def test_pinned_stages_train_as_one_process(clusters):
    """A 4-block llama-tiny at pp2 x dp2 with stages of 3 and 1 blocks: every rank's losses
    and parameters equal one process after 3 AdamW steps (fp32, rtol 1e-5)."""
    factory = _jobs.preset("llama-tiny", num_hidden_layers=4)
    results = clusters.get(4).run(_jobs.train, factory, 3, 4, dict(stages=[3, 1], dp=2),
                                  timeout_s=180)
    ref = _jobs.reference(factory, 3, 4)
    for rank, result in enumerate(results):
        assert compare(result, ref) == [], f"rank {rank}"
        stages = [(s["layer_start"], s["layer_end"]) for s in json.loads(result[2])["stages"]]
        assert stages == [(0, 3), (3, 4)]
