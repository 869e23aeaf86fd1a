"""Whole-step export ([Note: whole-step export] in autoplan/runtime/step_export.py): the dry
run's trace of one rank's training step written as Python, Graphviz and JSON beside its
traffic per mesh axis -- backward, recomputation, FSDP2's gradient reduce-scatters in their
dtype, the pipeline schedule's actions."""

from __future__ import annotations

import ast
import json

import pytest
import torch

from autoplan.capture import capture_preset
from autoplan.runtime.step_export import export_step, traffic_rows
from autoplan.runtime.step_ops import OpLog
from autoplan.solver import plan as solve
from autoplan.spec import TrainingSpec
from autoplan.topology import preset

BATCH, SEQ = 8, 16


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_bf16_dp2_tp2_step_has_fp32_gradient_reduce_scatters_and_backward_tp_collectives(
        tmp_path, zero_stage):
    """bf16 under FSDP2 (ZeRO-2 and 3: `fully_shard`, reduce_dtype fp32): the exported step
    of rank 0 reduce-scatters its gradients over dp in float32 during the backward, gathers
    its bf16 parameters over dp, and its backward (with full recomputation) issues the tp
    collectives of the input gradients; the recomputed forward is marked. The four files say
    it alike."""
    planned = capture_preset("gpt2-tiny", batch=BATCH, seq_len=SEQ, dtype=torch.bfloat16)
    plan = solve(planned, preset("local-cpu", devices_per_node=4),
                 TrainingSpec(BATCH, SEQ, dtype="bfloat16"), pp=1, dp=2, tp=2,
                 zero_stage=zero_stage, num_microbatches=1, checkpointing="full")
    graph = capture_preset("gpt2-tiny", batch=plan.microbatch_size, seq_len=SEQ,
                           dtype=torch.bfloat16)
    paths = export_step(graph, plan, tmp_path, [0], planned_graph=planned, steps=1)
    assert set(paths) == {"plan.json", "rank0_step.py", "rank0_step.dot", "rank0_step.json",
                          "traffic.md"}
    doc = json.loads((tmp_path / "rank0_step.json").read_text())
    assert doc["coordinates"] == {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    assert doc["num_ops"] == len(doc["ops"]) > 0 and doc["num_ops_not_listed"] == 0
    calls = [(op["moment"], doc["collectives"][op["collective"]]) for op in doc["ops"]
             if op["collective"] is not None]
    assert len(calls) == len(doc["collectives"])  # every collective is in the listing
    scatters = [c for m, c in calls if c["op"] == "_reduce_scatter_base_"]
    assert scatters and all(c["axis"] == "dp" and c["dtype"] == "float32" for c in scatters)
    assert any(m.startswith("backward") and c["op"] == "_reduce_scatter_base_"
               for m, c in calls)
    assert any(c["op"] == "_allgather_base_" and c["axis"] == "dp" and c["dtype"] == "bfloat16"
               for _, c in calls)
    backward_tp = [c for m, c in calls if m.startswith("backward") and c["axis"] == "tp"]
    assert backward_tp and {c["dtype"] for c in backward_tp} == {"bfloat16"}
    assert any(m.endswith("(recomputation)") for m, _ in calls)
    assert any(op["moment"] == "optimizer step" for op in doc["ops"])
    assert any(op["op"] == "aten.mm.default" and op["inputs"][0].startswith("bfloat16[")
               for op in doc["ops"])
    # the traffic table adds up to the dry run's bytes per axis
    for axis, total in doc["bytes_by_axis"].items():
        assert sum(t["bytes"] for t in doc["traffic"] if t["axis"] == axis) == total
    # the listing is Python, one line per op, the collectives with axis, dtype and bytes
    code = (tmp_path / "rank0_step.py").read_text()
    ast.parse(code)
    calls_py = [line for line in code.splitlines() if line.startswith("    torch.ops.")]
    assert len(calls_py) == len(doc["ops"])
    assert any("c10d._reduce_scatter_base_" in line and "over dp (2 ranks), float32" in line
               for line in calls_py)
    assert "    # -- backward of microbatch 1 of 1 (recomputation)" in code
    dot = (tmp_path / "rank0_step.dot").read_text()
    assert dot.startswith('digraph "rank0_step"') and dot.count("fillcolor") == len(calls)
    traffic = (tmp_path / "traffic.md").read_text()
    assert "## Rank 0 (pp0 dp0 cp0 tp0)" in traffic and "| dp | _reduce_scatter_base_ |" in traffic
    assert json.loads((tmp_path / "plan.json").read_text())["dry_run"][0]["rank"] == 0


def test_cli_pp2_export_lists_each_rank_schedule_actions(tmp_path, capsys):
    """`autoplan dryrun --export DIR` of a pp2 plan (1F1B, 2 microbatches): each rank's
    actions as torch's schedule IR writes them, in the order it ran them -- stage 0 sends
    activations and receives gradients, stage 1 the reverse, each reduces its gradients
    last -- in the listing, its JSON and traffic.md, the p2p ops beside them. An export path
    that cannot be a directory is a usage error naming --export."""
    from autoplan.cli import main

    out = tmp_path / "export"
    argv = ["dryrun", "-q", "--model", "gpt2-tiny", "--cluster", "local-cpu",
            "--devices-per-node", "2", "--global-batch", "8", "--seq", "16", "--pp", "2",
            "--dp", "1", "--tp", "1", "--microbatches", "2", "--schedule", "1f1b",
            "--ranks", "0,1", "--steps", "1"]
    assert main(argv + ["--export", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == \
        f"wrote each rank's whole step (8 files) into {out}"
    docs = [json.loads((out / f"rank{r}_step.json").read_text()) for r in (0, 1)]
    first, last = (d["actions"] for d in docs)
    for stage, actions in enumerate((first, last)):
        assert all(a.startswith(str(stage)) for a in actions)
        assert actions[-1] == f"{stage}REDUCE_GRAD"
        for j in range(2):
            assert actions.index(f"{stage}F{j}") < actions.index(f"{stage}B{j}")
    for j in range(2):
        assert first.index(f"0F{j}") < first.index(f"0SEND_F{j}")
        assert first.index(f"0RECV_B{j}") < first.index(f"0B{j}")
        assert last.index(f"1RECV_F{j}") < last.index(f"1F{j}")
        assert last.index(f"1B{j}") < last.index(f"1SEND_B{j}")
    assert not any("RECV_F" in a or "SEND_B" in a for a in first)
    assert not any("SEND_F" in a or "RECV_B" in a for a in last)
    # marked in the op listing where they start, with the p2p ops they post on the pp axis
    for doc in docs:
        assert [m["action"] for m in doc["action_marks"]] == doc["actions"]
        counts = {(t["axis"], t["op"]): t["count"] for t in doc["traffic"]}
        assert counts[("pp", "send")] == counts[("pp", "recv_")] == 2
    code = (out / "rank1_step.py").read_text()
    assert "    # action 1RECV_F0" in code and "#   1RECV_F0 1F0" in code
    traffic = (out / "traffic.md").read_text()
    assert f"Pipeline actions: `{' '.join(first)}`" in traffic
    assert "| pp | send | 2 |" in traffic
    # a file where the directory should be
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(argv + ["--export", str(blocker)]) == 2
    assert f"--export {blocker}: {blocker} is a file, not a directory" in \
        capsys.readouterr().err


def test_op_log_keeps_its_bound_and_the_marks():
    """The log lists up to `max_ops` ops and counts the rest; a repeated op on the same
    shapes is stored once; clearing forgets ops and marks."""
    log = OpLog(max_ops=3)
    a, b = torch.empty(2, 3, dtype=torch.bfloat16), torch.empty(3, 4, dtype=torch.bfloat16)
    mm = torch.ops.aten.mm.default
    log.mark("0F0")
    for _ in range(5):
        log.add("forward of microbatch 1 of 1", mm, (a, b), {}, mm(a, b), None)
    assert (len(log), log.num_ops, log.num_dropped) == (3, 5, 2)
    op = next(iter(log))
    assert (op.op, op.inputs, op.outputs) == ("aten.mm.default",
                                              ("bfloat16[2, 3]", "bfloat16[3, 4]"),
                                              ("bfloat16[2, 4]",))
    assert log.marks == [(0, "0F0")] and len(log._texts) == 1
    log.clear()
    assert (len(log), log.num_ops, log.marks) == (0, 0, [])
    with pytest.raises(ValueError, match="max_ops=-1"):
        OpLog(max_ops=-1)


def test_traffic_rows_sum_by_axis_and_op():
    """`traffic_rows`: count and bytes per (axis, op), axis by axis."""
    from autoplan.runtime.dryrun import Collective, RankDryRun

    calls = (Collective("send", "pp", 2, "bfloat16", 10),
             Collective("_reduce_scatter_base_", "dp", 2, "float32", 40),
             Collective("send", "pp", 2, "bfloat16", 10))
    row = RankDryRun(rank=0, coordinates={}, peak_bytes=0, peak_by_category={},
                     resident_bytes=0, collectives=calls, bytes_by_axis={}, flops=0,
                     predicted_peak_bytes=0.0, predicted_by_category={}, predicted_flops=0.0)
    assert traffic_rows(row) == [
        {"axis": "dp", "op": "_reduce_scatter_base_", "count": 1, "bytes": 40},
        {"axis": "pp", "op": "send", "count": 2, "bytes": 20}]


def test_model_dry_run_exports_the_actions_of_an_interleaved_pipeline(tmp_path):
    """`model.dry_run(export=DIR)` of an interleaved 1F1B plan (pp2, 2 virtual stages: rank
    0 holds stages 0 and 2, rank 1 stages 1 and 3), run by torch's action runtime: each
    rank's actions cover both its stages, every microbatch's forward before its backward,
    each stage's gradient reduction after its last backward; the files are written."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from autoplan import autoparallel

    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=4, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        module = GPT2LMHeadModel(config)
    model = autoparallel(module, global_batch=8, seq_len=16, cluster="local-cpu",
                         world_size=2, pp=2, dp=1, tp=1, schedule="interleaved-1f1b",
                         num_virtual_stages=2, num_microbatches=2)
    rows = model.dry_run(ranks=[0, 1], steps=1, export=tmp_path)
    for row, stages in zip(rows, ((0, 2), (1, 3))):
        assert row.ops is not None and len(row.ops) > 0
        actions = list(row.actions)
        assert {int(a[0]) for a in actions} == set(stages)
        for s in stages:
            assert actions.index(f"{s}REDUCE_GRAD") > actions.index(f"{s}B1")
            for j in range(2):
                assert actions.index(f"{s}F{j}") < actions.index(f"{s}B{j}")
        assert json.loads((tmp_path / f"rank{row.rank}_step.json").read_text())["actions"] \
            == actions
    assert "    # action 2F0" in (tmp_path / "rank0_step.py").read_text()
