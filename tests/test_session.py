"""The planner's options (autoplan/options.py `SearchOptions`) and the planning session both
entry points share (autoplan/session.py `audit` and `solve`): one spelling per option, checks
at construction, the former flags accepted, and `autoplan plan` audited as `@autoparallel` is."""

from __future__ import annotations

import dataclasses

import pytest

from autoplan.cli import build_parser, main
from autoplan.options import OptionError, SearchOptions, search_options_of


@pytest.mark.parametrize("kwargs, message", [
    (dict(zero_stage=5), r"zero_stage 5 is not one of 0, 1, 2, 3"),
    (dict(schedule="zigzag"), r"schedule 'zigzag' is not one of"),
    (dict(checkpointing="some"), r"checkpointing 'some' is not one of"),
    (dict(offload="disk"), r"offload 'disk' is not one of"),
    (dict(tp=0), r"tp=0; expected an integer >= 1"),
    (dict(num_microbatches=2.0), r"num_microbatches=2.0; expected an integer >= 1"),
    (dict(sequence_parallel="yes"), r"sequence_parallel='yes'; expected True or False"),
    (dict(time_limit_s=float("inf")), r"time_limit_s inf must be a positive number"),
    (dict(stages=3), r"stages 3; expected blocks per stage"),
])
def test_a_bad_option_is_named_with_its_value(kwargs, message):
    with pytest.raises(OptionError, match=message):
        SearchOptions(**kwargs)


def test_options_hold_hashable_values_and_say_what_was_given():
    o = SearchOptions(tp=2, stages=[3, 5], placements={"lm_head.weight": "S(0)"})
    assert o.stages == (3, 5) and o.placements == (("lm_head.weight", "S(0)"),)
    assert hash(o) == hash(dataclasses.replace(o))
    assert o.given() == {"tp": 2, "placements": (("lm_head.weight", "S(0)"),),
                         "stages": (3, 5)}
    assert SearchOptions().given() == {}


def test_each_option_is_one_flag_and_the_former_flags_still_parse():
    """--zero-stage, --num-microbatches, ... are the options' names; --zero, --microbatches,
    --virtual-stages, --place and --time-limit, the flags before them, set the same option
    (and are not listed in --help)."""
    head = ["plan", "--model", "gpt2-tiny", "--cluster", "local-cpu", "--global-batch", "8",
            "--seq", "16"]
    parser = build_parser()
    old = parser.parse_args(head + ["--zero", "3", "--microbatches", "2", "--virtual-stages",
                                    "2", "--place", "lm_head.weight=S(0)", "--time-limit", "5"])
    new = parser.parse_args(head + ["--zero-stage", "3", "--num-microbatches", "2",
                                    "--num-virtual-stages", "2", "--placements",
                                    "lm_head.weight=S(0)", "--time-limit-s", "5"])
    assert search_options_of(old) == search_options_of(new) == SearchOptions(
        zero_stage=3, num_microbatches=2, num_virtual_stages=2,
        placements={"lm_head.weight": "S(0)"}, time_limit_s=5.0)
    helptext = parser._subparsers._group_actions[0].choices["plan"].format_help()
    assert "--zero-stage" in helptext and "--zero " not in helptext
    for f in dataclasses.fields(SearchOptions):
        assert "--" + f.name.replace("_", "-") in helptext


def test_the_command_line_plans_a_batch_statistic_as_the_decorator_does(capsys, monkeypatch):
    """BatchNorm in training mode: `autoplan plan` audits the model as `@autoparallel` does
    (one session, autoplan/session.py): dp 2 is refused naming the op, and the free plan keeps
    the batch whole (dp 1, one microbatch) where before it could show dp 2."""
    import _coupling_jobs as jobs
    import autoplan.capture
    from autoplan.capture import capture

    def capture_batch_norm(name, *, batch, seq_len, **_):  # the preset's capture, replaced
        graph = capture(jobs.MODELS["BatchNorm"](), (), example_kwargs=jobs.batch(0, batch),
                        model_name="BatchNorm")
        graph.batch_size, graph.seq_len = batch, seq_len
        return graph

    monkeypatch.setattr(autoplan.capture, "capture_preset", capture_batch_norm)
    argv = ["plan", "--model", "mlp-tiny", "--cluster", "local-cpu", "--devices-per-node", "2",
            "--global-batch", "4", "--seq", "6", "--no-cache", "-q"]
    assert main(argv + ["--dp", "2"]) == 2
    err = capsys.readouterr().err
    assert "the plan's dp=2 would change what node batch_norm" in err, err
    assert main(argv + ["--json"]) == 0
    out = capsys.readouterr().out
    import json

    summary = json.loads(out)
    assert (summary["mesh"]["dp"], summary["num_microbatches"]) == (1, 1)
