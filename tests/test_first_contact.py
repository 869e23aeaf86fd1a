"""First contact: the README's scripts run as written (one of them under torchrun), a launch
that disagrees with its cluster is a named error, and bad input is reported in the user's
words (the batch, checkpoints, the job's shape)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoplan.runtime.batch import check_batch
from autoplan.testing import assert_params_close

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


# The documents whose scripts and commands a user copies: each runs as written.
DOCS = ("README.md", "docs/guide.md")


def readme_blocks(language: str) -> list[str]:
    """The bodies of the fenced blocks of `language` ("" for plain ones) of README.md and
    docs/guide.md, in that order."""
    blocks = []
    for doc in DOCS:
        lang, body = None, []
        for line in (ROOT / doc).read_text().splitlines(keepends=True):
            if line.startswith("```"):
                if lang is None:
                    lang, body = line[3:].strip(), []
                else:
                    if lang == language:
                        blocks.append("".join(body))
                    lang = None
            elif lang is not None:
                body.append(line)
    return blocks


def readme_script(name: str) -> str:
    """The Python block whose first line names `name`; README.md and docs/guide.md may both
    show it, then as the same script."""
    found = {b for b in readme_blocks("python") if b.startswith(f"# {name}")}
    assert len(found) == 1, f"{DOCS} have {len(found)} different blocks starting '# {name}'"
    return found.pop()


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", AUTOPLAN_VERBOSITY="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"):
        env.pop(k, None)
    return env


def _torchrun(script: Path, nproc: int, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", str(script)],
        cwd=script.parent, env=_env(), capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.slow
def test_readme_train_script_under_torchrun_trains_one_model(tmp_path):
    """The README's decorator script, with no process-group code of its own, under
    `torchrun --nproc_per_node 2`: both ranks see world 2, report equal losses, and rank 0's
    report and export after training are written. Where threads can be read (Linux), the
    script also counts the gloo worker threads left when the interpreter finalizes: none, the
    group autoplan made ended first ([Note: orderly exit], tests/test_shutdown.py)."""
    from test_shutdown import THREADS_AT_EXIT

    threads = os.path.isdir("/proc/self/task")
    script = tmp_path / "train.py"
    script.write_text((THREADS_AT_EXIT if threads else "") + readme_script("train.py"))
    run = _torchrun(script, 2, timeout_s=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    if threads:
        found = dict(re.findall(r"rank (\d): (\d+) gloo worker threads at exit", run.stdout))
        assert found == {"0": "0", "1": "0"}, run.stdout[-3000:]
    # two ranks print to one pipe: a line's text and its newline are separate writes, so one
    # rank's line may run into the other's -- match the records, not line starts
    lines = re.findall(r"rank (\d) of (\d): step (\d): loss ([\d.]+)", run.stdout)
    assert len(lines) == 6, run.stdout
    assert {world for _, world, _, _ in lines} == {"2"}
    by_step = {}
    for rank, _, step, loss in lines:
        by_step.setdefault(step, {})[rank] = float(loss)
    assert all(len(v) == 2 and v["0"] == v["1"] for v in by_step.values()), by_step
    assert (tmp_path / "out/train/report.html").is_file()
    assert (tmp_path / "out/train/graphs/plan.json").is_file()
    assert list((tmp_path / "out/train/graphs").glob("rank*_stage*.py"))


@pytest.mark.slow
def test_torchrun_world_that_disagrees_with_the_cluster_is_named(tmp_path):
    """A preset of 8 devices launched on 2 ranks fails on every rank with both numbers and the
    fix, before anything is built -- never a silent single-rank run."""
    source = readme_script("train.py").replace('cluster="local-cpu"', 'cluster="dgx-h100"')
    script = tmp_path / "train.py"
    script.write_text(source)
    run = _torchrun(script, 2, timeout_s=300)
    assert run.returncode != 0
    assert "cluster 'dgx-h100' has 8 devices" in run.stderr
    assert "this job has 2 ranks" in run.stderr
    assert "--nproc_per_node 8" in run.stderr
    assert "loss" not in run.stdout


@pytest.mark.slow
def test_readme_local_cluster_script_runs_as_written(tmp_path):
    script = tmp_path / "local.py"
    script.write_text(readme_script("local.py"))
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-6000:]
    per_rank = eval(run.stdout.strip().splitlines()[-1])  # noqa: S307 - our own printout
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1] and len(per_rank[0]) == 3


def readme_commands() -> list[str]:
    """The `autoplan ...` command lines of the plain code blocks of README.md and
    docs/guide.md (continuations joined), each once."""
    out = []
    for block in readme_blocks(""):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith("autoplan ") and line not in out:
                out.append(line)
    return out


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path):
    """Each command the README shows exits 0 (a plan writes its report), run two at a time:
    the commands are independent processes and this machine has two cores."""
    from concurrent.futures import ThreadPoolExecutor

    commands = readme_commands()
    assert len(commands) >= 2

    def run(command: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "autoplan"), *command.split()[1:], "-q"],
                              cwd=tmp_path, env=_env(), capture_output=True, text=True,
                              timeout=300)

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(run, commands))
    for command, done in zip(commands, runs):
        args = command.split()
        assert done.returncode == 0, (command, done.stderr[-3000:])
        if args[1] == "plan":  # `autoplan dryrun` prints its table and writes nothing
            out = args[args.index("-o") + 1]
            assert (tmp_path / out / "report.html").is_file(), command


def test_readme_python_blocks_are_whole_scripts():
    """Every Python block of README.md and docs/guide.md is a script a test runs (nothing
    undefined)."""
    names = [b.splitlines()[0] for b in readme_blocks("python")]
    assert names and all(n.startswith(("# train.py", "# local.py")) for n in names), names


def test_readme_points_at_nothing_outside_the_repo():
    for doc in DOCS:
        assert "../" not in (ROOT / doc).read_text(), doc


# -- the batch, in the user's words --------------------------------------------------------
def _batch(b=4, t=16, vocab=64):
    """(input_ids, labels) of b samples of t tokens."""
    tokens = torch.randint(0, vocab, (b, t + 1))
    return tokens[:, :-1], tokens[:, 1:]


def _check(x, y):
    return check_batch(x, y, global_batch=4, seq_len=16, vocab_size=64)


def test_a_good_batch_counts_its_trained_tokens():
    x, y = _batch()
    y = y.clone()
    y[0, :5] = -100
    assert _check(x, y) == 4 * 16 - 5


@pytest.mark.parametrize("case, message", [
    ("short", r"input_ids has shape \(4, 8\); the plan was made for \(4, 16\) .*8 tokens per "
              r"sample where the plan's seq_len is 16"),
    ("batch", r"input_ids has shape \(2, 16\); .*2 samples where the plan's global_batch is 4"),
    ("float", r"input_ids has dtype torch.float32; expected integer token ids"),
    ("ignored", r"every one of the 64 labels is -100 \(ignored\)"),
    ("vocab", r"input_ids holds token id 64; the model's vocabulary is \[0, 64\)"),
    ("labels", r"labels hold token id -3; expected ids in \[0, 64\) or -100"),
    ("list", r"input_ids is a list; expected a tensor of shape \(4, 16\)"),
])
def test_bad_batches_are_named(case, message):
    x, y = _batch()
    if case == "short":
        x, y = x[:, :8], y[:, :8]
    elif case == "batch":
        x, y = x[:2], y[:2]
    elif case == "float":
        x = x.float()
    elif case == "ignored":
        y = torch.full_like(y, -100)
    elif case == "vocab":
        x = x.clone()
        x[1, 2] = 64
    elif case == "labels":
        y = y.clone()
        y[0, 0] = -3
    elif case == "list":
        x = x.tolist()
    with pytest.raises(ValueError, match=message):
        _check(x, y)


# -- the job's shape ------------------------------------------------------------------------
def test_num_nodes_comes_from_torchrun_and_a_contradiction_is_named(monkeypatch):
    from autoplan.runtime import job

    monkeypatch.setattr(job.dist, "is_initialized", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert job.num_nodes(None, 8) == 2
    assert job.num_nodes(2, 8) == 2
    with pytest.raises(ValueError, match=r"num_nodes=1, but torchrun started 2 nodes of 4"):
        job.num_nodes(1, 8)
    with pytest.raises(ValueError, match="WORLD_SIZE=6 is not a multiple of LOCAL_WORLD_SIZE=4"):
        job.num_nodes(None, 6)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert job.num_nodes(None, 8) is None


def test_run_isolated_returns_and_names_a_childs_failure():
    from autoplan.runtime.job import run_isolated

    assert run_isolated(sum, [1, 2, 3]) == 6
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        run_isolated(divmod, 1, 0)


# -- a single-process model: metrics and checkpoints ---------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """gpt2-tiny trained one step in this process (a world of 1), and a checkpoint of it.
    Planned with an empty plan cache of its own: a module fixture is set up before the
    test's own cache (conftest.py), and the session's may hold this plan already."""
    from autoplan import autoparallel
    from autoplan.models import build_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path_factory.mktemp("tiny-plan-cache")))
        model = autoparallel(build_model("gpt2-tiny"), global_batch=4, seq_len=16)
        x, y = _batch()
        model.step(x, y)
    ckpt = tmp_path_factory.mktemp("ckpt") / "step1"
    model.save(ckpt)
    yield model, ckpt
    import torch.distributed as dist

    dist.destroy_process_group()  # the world of one step() set up: other tests fake their own


def test_step_metrics_beside_the_plans_prediction(tiny):
    model, _ = tiny
    x, y = _batch()
    loss = model.step(x, y)
    m = model.metrics
    assert m.loss == loss and m.step == model._engine.num_steps
    assert m.tokens == 4 * 16 and m.step_time_s > 0
    assert m.tokens_per_s == pytest.approx(m.tokens / m.step_time_s)
    pred = model.plan.prediction
    assert m.predicted_step_time_s == pred.step_time_s
    assert m.mfu == pytest.approx(pred.mfu * pred.step_time_s / m.step_time_s)
    assert m.peak_memory_bytes is None or m.peak_memory_bytes > 0
    assert "tokens/s" in str(m) and "MFU" in str(m)


def test_a_step_with_a_bad_batch_names_it_and_trains_nothing(tiny):
    model, _ = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    steps = model._engine.num_steps
    x, y = _batch()
    with pytest.raises(ValueError, match="tokens per sample where the plan's seq_len is 16"):
        model.step(x[:, :8], y[:, :8])
    assert model._engine.num_steps == steps
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_narrower_integer_ids_are_taken_as_int64(tiny):
    model, _ = tiny
    x, y = _batch()
    model.step(x.to(torch.uint8), y.to(torch.int32))
    assert model.metrics.loss == model.metrics.loss  # a number, not nan


def test_planning_for_other_ranks_after_training_alone(tiny):
    """step() in a lone process sets up a world of one; a model planned afterwards for
    world_size=4 still plans for 4 (it is not a job of one)."""
    from autoplan import autoparallel
    from autoplan.models import build_model

    other = autoparallel(build_model("gpt2-tiny", device="meta"), global_batch=8, seq_len=16,
                         world_size=4)
    assert other.plan.mesh.world_size == 4
    with pytest.raises(RuntimeError, match="the plan needs 4 ranks"):
        other.step(*_batch(8))


def test_build_stats_time_each_phase_to_the_first_loss(tiny, own_capture_cache):
    """build_stats(): every phase that ran, in order, positive, summed in total_s; a model
    given as an instance records nothing; a decorated factory's recording is timed and the
    same request planned again is read from the plan cache; a planning capture that is already
    the runtime's graph is not captured again."""
    from autoplan import autoparallel
    from autoplan.models import build_model

    model, _ = tiny
    stats = model.build_stats()
    phases = ["capture_for_planning_s", "plan_s", "capture_runtime_s", "build_s",
              "first_step_s"]
    assert [k for k in stats if k.endswith("_s")] == phases + ["total_s"]
    assert all(stats[k] > 0 for k in phases), stats
    assert stats["total_s"] == pytest.approx(sum(stats[k] for k in phases))
    assert stats["plan_from_cache"] is False
    # 2 blocks, captured whole for planning at the batch one rank runs: one capture serves both
    assert stats["capture_reused"] is True and model._engine.graph is model.graph
    model.step(*_batch())  # later steps are not build phases
    assert model.build_stats() == stats

    def planned():
        factory = autoparallel(lambda: build_model("gpt2-tiny"), global_batch=8, seq_len=16,
                               world_size=2)
        made = factory()
        _ = made.plan
        return made.build_stats()

    first, again = planned(), planned()
    for s in (first, again):
        assert list(s) == ["record_s", "capture_for_planning_s", "capture_for_planning_cached",
                           "plan_s", "plan_from_cache", "total_s"] and s["record_s"] > 0
    assert first["plan_from_cache"] is False and again["plan_from_cache"] is True
    # the same capture again is read from the capture cache ([Note: capture cache])
    assert first["capture_for_planning_cached"] is False
    assert again["capture_for_planning_cached"] is True


@pytest.mark.parametrize("kwargs, message", [
    (dict(global_batch=0), r"global_batch=0; expected an integer >= 1"),
    (dict(seq_len=-1), r"seq_len=-1; expected an integer >= 1"),
    (dict(global_batch=8.0), r"global_batch=8.0; expected an integer >= 1"),
    (dict(world_size=0), r"world_size=0; expected an integer >= 1"),
    (dict(max_grad_nrom=1.0), r"unknown option\(s\) \['max_grad_nrom'\]; did you mean "
                              r"'max_grad_norm'"),
])
def test_bad_options_are_named(kwargs, message):
    from autoplan import autoparallel

    options = dict(global_batch=4, seq_len=16) | kwargs
    with pytest.raises(ValueError, match=message):
        autoparallel(**options)


def test_missing_and_truncated_checkpoints_are_named_and_change_nothing(tiny, tmp_path):
    import shutil

    from autoplan.runtime.checkpoint import CheckpointError

    model, ckpt = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"checkpoint directory '.*nowhere' does not exist"):
        model.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="has no .metadata file"):
        model.load(tmp_path / "empty")
    cut = tmp_path / "cut"
    shutil.copytree(ckpt, cut)
    data = sorted(cut.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"{data.name} holds \d+ bytes; .*needs \d+"):
        model.load(cut)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    model.load(ckpt)  # the intact one still loads


def test_progress_lines_for_long_phases_only(capsys, monkeypatch):
    import time

    from autoplan import progress

    monkeypatch.delenv("RANK", raising=False)
    progress.set_verbosity(1)
    try:
        # a phase within its threshold prints nothing; 30 s, not the default 1 s, so that a
        # loaded machine's stall (3.0 s once, CI with 4-rank jobs beside) is still within it
        with progress.phase("quick", quiet_below_s=30.0):
            pass
        with progress.phase("slow", quiet_below_s=0.05):
            time.sleep(0.2)
        with pytest.raises(KeyError), progress.phase("broken", quiet_below_s=0.05):
            time.sleep(0.2)
            raise KeyError("x")
        with pytest.raises(KeyError), progress.phase("quick failure", quiet_below_s=30.0):
            raise KeyError("x")
        progress.set_verbosity(0)
        with progress.phase("silenced", quiet_below_s=0.0):
            time.sleep(0.01)
    finally:
        progress.set_verbosity(None)
    err = capsys.readouterr().err
    assert "quick" not in err and "silenced" not in err  # its error says enough
    assert "autoplan: slow ..." in err and re.search(r"autoplan: slow: done in 0\.\d s", err)
    assert "autoplan: broken: failed" in err


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    dict(dp=2, tp=1, pp=1, num_microbatches=2, zero_stage=0),
    dict(pp=2, dp=1, tp=1, num_microbatches=4, schedule="1f1b"),
], ids=["dp2-m2", "pp2-m4"])
def test_ignored_labels_spread_unevenly_give_one_processs_mean(clusters, overrides):
    """Labels -100 over a different number of tokens per sample: the loss is the mean over the
    global batch's trained tokens (not a mean of per-rank or per-microbatch means), and the
    parameters follow one process's."""
    import _jobs

    steps, batch = 2, 8
    ref_losses, ref_params, allowance = _jobs.reference_variant("ignored", _jobs.preset("gpt2-tiny"),
                                                      steps, batch)
    results = clusters.get(2).run(_jobs.train_variant, "ignored", _jobs.preset("gpt2-tiny"),
                                  steps, batch, overrides, timeout_s=300)
    held = set()
    for losses, params, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for k, v in params.items():  # a pipeline rank holds its stage's parameters
            assert_params_close({k: v}, ref_params, allowance)
        held |= set(params)
    assert held == set(ref_params)


@pytest.mark.slow
def test_demo_output_fits_on_a_screen_and_matches_one_process(tmp_path):
    """`autoplan demo` (3 steps on 2 ranks here; `make demo` runs 20 on 4): its loss table and
    a few lines, no warning repeated by every rank, and the MATCH verdict."""
    run = subprocess.run([str(BIN / "autoplan"), "demo", "--steps", "3", "--world-size", "2",
                          "-o", str(tmp_path / "demo")],
                         env=_env(), capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "MATCH" in run.stdout and "MISMATCH" not in run.stdout
    assert "Warning" not in out, out
    assert len(out.splitlines()) <= 40, out


def test_cli_export_traces_at_the_plans_microbatch_size(tmp_path, capsys):
    """`autoplan export` plans at batch 1 (costs scale with tokens) but writes the graphs a
    rank runs: shapes at the plan's microbatch size."""
    import json

    from autoplan.cli import main

    out = tmp_path / "x"
    assert main(["export", "--model", "gpt2-tiny", "--cluster", "local-cpu",
                 "--devices-per-node", "1", "--global-batch", "4", "--seq", "16",
                 "--dtype", "float32", "-o", str(out), "-q"]) == 0
    mb = json.loads((out / "plan.json").read_text())["microbatch_size"]
    assert mb > 1
    code = (out / "rank0_stage0.py").read_text()
    assert re.search(rf"\[{mb}, 16, \d+\]", code), code[:3000]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    dict(dp=4, tp=1, pp=1, zero_stage=1), dict(dp=4, tp=1, pp=1, zero_stage=2),
    dict(dp=4, tp=1, pp=1, zero_stage=3), dict(dp=2, tp=2, pp=1, zero_stage=0),
], ids=["dp4-zero1", "dp4-zero2", "dp4-zero3", "dp2xtp2"])
def test_optimizer_groups_by_name_match_one_process(clusters, overrides):
    """The optimizer factory gets (FQN, parameter) pairs: AdamW groups by name (decay on
    matrices, none on norms and biases, the position embedding at lr 0) train as on one
    process under every ZeRO stage and under tp."""
    import _jobs

    steps, batch = 2, 8
    ref_losses, ref_params, allowance = _jobs.reference_variant("grouped", _jobs.preset("gpt2-tiny"),
                                                      steps, batch)
    results = clusters.get(4).run(_jobs.train_variant, "grouped", _jobs.preset("gpt2-tiny"),
                                  steps, batch, overrides, timeout_s=300)
    for losses, params, groups in results:
        assert len(groups) == 3
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for k, v in params.items():
            assert_params_close({k: v}, ref_params, allowance)
    if overrides.get("zero_stage") == 1:  # every rank steps its rows of every tensor
        # ([Note: ZeRO-1 partition] in autoplan/runtime/zero1.py): the groups are whole
        assert all(groups == results[0][2] and 0 not in groups for _, _, groups in results)


@pytest.mark.slow
def test_a_collective_that_times_out_names_the_rank_it_waited_for(tmp_path):
    """Rank 1 stops stepping (a hang between steps, as under torchrun): rank 0's collective
    times out, and its error names rank 1 and where it last was, not only gloo's "Timed out".
    Rank 1 sleeps until rank 0 has its answer (at most 60 s)."""
    import _jobs

    from autoplan.runtime.launcher import LocalCluster

    with LocalCluster(2, pg_timeout_s=4) as cluster:
        seen = cluster.run(_jobs.train_with_a_sleeper, 60.0, str(tmp_path / "rank0-done"),
                           timeout_s=240)
    assert seen[1] == "slept"
    assert seen[0].startswith("PeerError: rank 0, step 2: a collective failed"), seen[0]
    assert re.search(r"rank 1: last at 'after step 1', \d+ s ago", seen[0]), seen[0]



def test_only_a_collectives_failure_is_blamed_on_a_peer():
    """An error of the step's own computation (a missing CPU kernel, a shape) is re-raised as
    it is; a collective's failure (torch.distributed's errors, gloo's and NCCL's words) names
    the peers."""
    from autoplan.runtime.job import is_collective_failure

    assert not is_collective_failure(RuntimeError('"histc_cpu" not implemented for \'Int\''))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert is_collective_failure(torch.distributed.DistBackendError("anything"))
    assert is_collective_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection "
                                              "closed by peer [127.0.0.1]:1234"))
    assert is_collective_failure(RuntimeError("Timed out waiting 4000ms for recv operation"))
@pytest.mark.slow
def test_a_resumed_run_continues_its_lr_schedule(clusters, tmp_path):
    import _jobs

    results = clusters.get(2).run(_jobs.resume_scheduled, _jobs.preset("gpt2-tiny"), 4,
                                  str(tmp_path / "ckpt"), timeout_s=300)
    for straight, resumed in results:
        assert resumed == straight  # bit-identical: same lr, same states


@pytest.mark.slow
@pytest.mark.parametrize("variant, overrides", [
    ("scheduled", dict(dp=2, tp=1, pp=1, zero_stage=1)),
    ("scheduled", dict(dp=1, tp=1, pp=2, num_microbatches=2)),
    ("user_loss", dict(dp=2, tp=1, pp=1, num_microbatches=2)),
    ("user_loss", dict(dp=1, tp=1, pp=2, num_microbatches=2)),
], ids=["lr_scheduler-dp2-zero1", "lr_scheduler-pp2", "loss_fn-dp2-m2", "loss_fn-pp2"])
def test_an_lr_scheduler_and_a_users_loss_train_as_on_one_process(clusters, variant,
                                                                  overrides):
    """lr_scheduler= (a warm-up, stepped every step) and loss_fn= (label smoothing, a
    microbatch mean) give one process's losses and parameters."""
    import _jobs

    steps, batch = 3, 4
    ref_losses, ref_params, allowance = _jobs.reference_variant(variant, _jobs.preset("gpt2-tiny"), steps,
                                                     batch)
    results = clusters.get(2).run(_jobs.train_variant, variant, _jobs.preset("gpt2-tiny"),
                                  steps, batch, overrides, timeout_s=300)
    for losses, params, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for k, v in params.items():
            assert_params_close({k: v}, ref_params, allowance)
