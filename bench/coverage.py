"""Architecture coverage: which transformers architectures autoplan plans and trains exactly.

    python bench/coverage.py                    # every architecture -> bench/results/coverage.json
    python bench/coverage.py --only falcon --only gemma3_text --steps 2
    python bench/coverage.py --markdown         # the docs/benchmarks.md table, from coverage.json

For each architecture of `autoplan.models.architectures.ARCHITECTURES` (transformers 5.24,
random weights from a config, nothing downloaded), in order:

- `plan tp2`: the tiny config planned for 2 `local-cpu` ranks with tp=2 fixed;
- `plan 7B`: the same architecture at 7B class (hidden 4096, 32 layers, see
  architectures.py), built on the meta device and planned as `@autoparallel` plans it for 2
  `dgx-h100` nodes (16 H100s), bf16, global batch 64 x 4096 tokens, every choice the solver's;
- `train dp2xtp2`: the tiny config trained `--steps` AdamW steps on 4 gloo ranks under dp=2,
  tp=2 with a memory cap that makes the plan split weights on the tp axis
  (autoplan.testing.train_planned), every step's loss and every parameter on every rank
  compared with one process (autoplan.testing.reference; fp32, rtol 1e-5, atol 1e-6, plus
  [Note: AdamW rounding allowance] for the few elements whose gradient is nearly zero);
- `train dp2xep2` (mixture-of-experts models): the same with expert parallelism, dp=4, ep=2:
  the batch split 4 ways, each pair of ranks holding disjoint halves of the experts. autoplan's
  dp counts every rank that holds its own samples and ep groups are taken from them
  (torchtitan's convention; [Note: expert parallelism] in
  autoplan/cost_model/expert_parallel.py), so the
  row's 2 x 2 is dp=4 with ep=2.

Fine-tuning rows (`FINE_TUNING`): an architecture wrapped in PEFT adapters (`get_peft_model`;
architectures.build_fine_tuning), its base frozen and its adapters trained, through the same
checks: "llama+lora" is Llama with LoRA of rank 8 on every linear layer (QLoRA's recipe); its
7B plan is Llama-2-7B's with the adapters, and its training check compares the frozen base and
the adapters with one process running the same PEFT model.

Refusal rows (`REFUSED`): an architecture with config keys the runtime cannot run exactly,
e.g. "wav2vec2+layerdrop" (LayerDrop 0.1: whole layers skipped by a Python draw per step).
Each check passes when the model is refused with a reason naming the cause (`REFUSED`'s text)
before any rank starts -- in planning, in the calling process -- and fails when it plans or
fails otherwise.

Causal LMs train on autoplan's token batch, `step(input_ids, labels)`; the masked LM (BERT),
seq2seq (T5), image (ViT, Swin, ConvNeXt) and audio (Whisper's encoder, wav2vec2) models on a
dict batch, `step({"input_ids": ..., "labels": ...})`
(architectures.example_batch says what each holds). A check that fails gives the exception's
type and first line (a failed rank: its own cause), truncated to `DETAIL_CHARS`.

The AdamW rounding allowance of the parameter comparison is [Note: AdamW rounding allowance] in
autoplan/testing.py; a row's detail counts the elements that needed it and the largest ratio of
difference to allowance.

Each architecture runs in its own Python process (`--worker NAME`) under a timeout
(`--timeout-s`, default 900 s), so a crash or a hang costs that row only: a check the process
did not finish says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _results.py
from _results import table_head, table_row, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "coverage.json"
CHECKS = ("plan tp2", "plan 7B", "train dp2xtp2", "train dp2xep2")
DETAIL_CHARS = 160
STEPS = 3
BATCH = 4  # samples per global batch of the tiny runs (dp 2 x 2)
SEQ = 16  # tokens per sample of the tiny runs
LARGE = dict(cluster="dgx-h100", num_nodes=2, dtype="bfloat16", global_batch=64, seq_len=4096)
TRAIN = {"train dp2xtp2": dict(dp=2, tp=2), "train dp2xep2": dict(dp=4, ep=2)}
FINE_TUNING = {"llama+lora": ("llama", "lora")}  # row -> (architecture, PEFT adapter)
# row -> (architecture, config keys, text the refusal must contain)
REFUSED = {"wav2vec2+layerdrop": ("wav2vec2", {"layerdrop": 0.1}, "layerdrop")}
RTOL, ATOL = 1e-5, 1e-6


def _first_line(e: BaseException) -> str:
    """`Type: first line` of an exception, truncated; a failed rank's own cause."""
    cause = getattr(e, "cause", None)  # autoplan.runtime.RankError
    text = f"rank {e.rank} {cause}" if cause and hasattr(e, "rank") else str(e)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = f"{type(e).__name__}: {lines[0] if lines else ''}"
    return line if len(line) <= DETAIL_CHARS else line[:DETAIL_CHARS - 3] + "..."


def _check(fn) -> dict:
    """Run one check: {"status": "pass"|"fail", "detail": str, "seconds": float}."""
    start = time.perf_counter()
    try:
        detail = fn()
        status = "pass"
    except Exception as e:  # a check reports every failure; the bench goes on
        import traceback

        traceback.print_exc()
        detail, status = _first_line(e), "fail"
    return {"status": status, "detail": detail, "seconds": round(time.perf_counter() - start, 1)}


def _architecture(name: str) -> str:
    """The architecture of row `name` (a fine-tuning or refusal row's base model's)."""
    return {**FINE_TUNING, **REFUSED}.get(name, (name,))[0]


def _config(name: str) -> dict:
    """The config keys row `name` sets on its architecture's."""
    return REFUSED[name][1] if name in REFUSED else {}


def _build(name: str, size: str):
    """Row `name`'s model at `size` on the meta device."""
    from autoplan.models.architectures import build_architecture, build_fine_tuning

    if name in FINE_TUNING:
        return build_fine_tuning(*FINE_TUNING[name], size)
    return build_architecture(_architecture(name), size, **_config(name))


def _factory(name: str):
    """A picklable factory of row `name`'s tiny model (autoplan.testing)."""
    from autoplan.models.architectures import architecture_factory, fine_tuning_factory

    if name in FINE_TUNING:
        return fine_tuning_factory(*FINE_TUNING[name])
    return architecture_factory(_architecture(name), **_config(name))


def _refused(fn, name: str) -> str:
    """Check `fn` of refusal row `name`: the refusal's first line where it names the cause;
    AssertionError where `fn` plans, and its own error where it fails for another reason."""
    text = REFUSED[name][2]
    try:
        fn()
    except Exception as e:
        message = " ".join(str(e).split())
        at = message.rfind(text)
        if at < 0:
            raise
        # the clause that names the cause (its last mention: what to do), where the first
        # line would be cut before it
        return (f"refused before any rank starts ({type(e).__name__}): ..."
                f"{message[max(at - 90, 0):at + 40]}...")
    raise AssertionError(f"planned, where a refusal naming {text!r} was expected")


def _batch_options(name: str, size: str, batch: int, seq_len: int) -> dict:
    """How the batch is declared: seq_len for a causal LM's token batch, `example_batch=` (on
    meta: shapes only) for the dict batch of the other tasks."""
    from autoplan.models.architectures import ARCHITECTURES, example_batch

    name = _architecture(name)
    if ARCHITECTURES[name].task == "causal-lm":
        return dict(global_batch=batch, seq_len=seq_len)
    return dict(global_batch=batch, example_batch=example_batch(
        name, size, batch=batch, seq_len=seq_len, device="meta"))


def _plan_tiny(name: str) -> str:
    from autoplan.api import autoparallel

    plan = autoparallel(_build(name, "tiny"), world_size=2, tp=2,
                        **_batch_options(name, "tiny", BATCH, SEQ)).plan
    return str(plan)


def _plan_large(name: str) -> str:
    from autoplan.api import autoparallel

    model = _build(name, "7b")
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    options = {k: v for k, v in LARGE.items() if k not in ("global_batch", "seq_len")}
    plan = autoparallel(model, **options, **_batch_options(name, "7b", LARGE["global_batch"],
                                                           LARGE["seq_len"])).plan
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e9
    frozen = f" ({trainable * 1e3:.0f}M trainable)" if trainable < billions else ""
    return f"{billions:.1f}B parameters{frozen}: {plan}"


def _batches(name: str, steps: int) -> list:
    """`steps` global batches: token pairs for causal LMs, dicts for the other tasks."""
    from autoplan.models.architectures import ARCHITECTURES, example_batch

    name = _architecture(name)
    out = []
    for i in range(steps):
        batch = example_batch(name, batch=BATCH, seq_len=SEQ, seed=1 + i)
        causal = ARCHITECTURES[name].task == "causal-lm"
        out.append((batch["input_ids"], batch["labels"]) if causal else batch)
    return out


def _reference(factory, batches: list) -> tuple[list[float], dict, dict]:
    """autoplan.testing.reference: losses, parameters, and each parameter's [Note: AdamW
    rounding allowance] (autoplan/testing.py)."""
    from autoplan import testing

    return testing.reference(factory, batches)


def _compare(result, reference) -> tuple[list[str], str]:
    """(what differs, a note on the elements within the AdamW allowance) between one rank's
    train_planned result and `_reference`: losses strictly, parameters per element."""
    import torch

    from autoplan import testing

    losses, params, allowance = reference
    problems = testing.compare((result[0], {}), (losses, {}), rtol=RTOL, atol=ATOL)
    noisy, worst = 0, 0.0
    for fqn, value in result[1].items():
        if fqn not in params:
            problems.append(f"{fqn}: not a parameter of the model on one process")
            continue
        want = params[fqn]
        diff = (value - want).abs()
        strict = ATOL + RTOL * want.abs()
        over = diff > strict
        if not over.any():
            continue
        bound = strict + allowance.get(fqn, torch.zeros_like(want))
        beyond = diff > bound
        if beyond.any():
            i = int(diff.where(beyond, torch.zeros_like(diff)).argmax())
            problems.append(f"{fqn}: {int(beyond.sum())} of {want.numel()} elements differ "
                            f"beyond rtol {RTOL}, atol {ATOL} and the AdamW allowance; first "
                            f"{diff.flatten()[i].item():.2e} > {bound.flatten()[i].item():.2e} "
                            f"at flat index {i}")
        noisy += int((over & ~beyond).sum())
        worst = max(worst, (diff / bound).where(over & ~beyond, torch.zeros_like(diff))
                    .max().item())
    note = (f" ({noisy} parameter elements within the AdamW rounding allowance, up to "
            f"{worst:.0%} of it)") if noisy else ""
    return problems, note


def _train(name: str, overrides: dict, steps: int, state: dict) -> str:
    """Train on 4 gloo ranks and compare with one process; the plan when every rank matches.
    `state` keeps the reference and the cluster between this architecture's checks."""
    from autoplan import testing
    from autoplan.runtime import LocalCluster

    factory, batches = _factory(name), _batches(name, steps)
    # planned once here, not on every rank: the ranks then plan once each
    budget = testing.split_weights_budget(_build(name, "tiny"), overrides,
                                          batches[0], global_batch=BATCH, seq_len=SEQ,
                                          world_size=4)
    if name in REFUSED:  # planned: no rank may start
        raise AssertionError(f"planned for {overrides} in the calling process")
    if "reference" not in state:
        state["reference"] = _reference(factory, batches)
    if state.get("cluster") is None or state["cluster"]._closed:  # a failed job closes it
        state["cluster"] = LocalCluster(4)
    results = state["cluster"].run(testing.train_planned, factory, batches, overrides,
                                   global_batch=BATCH, seq_len=SEQ, device_memory_bytes=budget,
                                   timeout_s=600)
    notes = []
    for rank, result in enumerate(results):
        problems, note = _compare(result, state["reference"])
        if problems:
            raise AssertionError(f"rank {rank} differs from one process in {len(problems)} "
                                 f"values, first: {problems[0]}")
        notes.append(note)
    plan = json.loads(results[0][2])
    split = sum(1 for _, p in plan["param_placements"] if p != "R")
    return (f"{steps} steps equal one process on 4 ranks; mesh {plan['mesh']}, "
            f"{split} of {len(plan['param_placements'])} parameters split"
            + max(notes, key=len))


def run_worker(name: str, steps: int, out: Path) -> None:
    """One architecture's checks in this process; the row is (re)written to `out` after each
    check, so that a parent that kills a hung worker keeps the checks it finished."""
    from autoplan.models.architectures import ARCHITECTURES

    arch = ARCHITECTURES[_architecture(name)]
    row = {"architecture": name, "task": arch.task, "moe": arch.moe, "checks": {}}
    if name in FINE_TUNING:
        row["adapter"] = FINE_TUNING[name][1]
    todo = {"plan tp2": lambda: _plan_tiny(name), "plan 7B": lambda: _plan_large(name)}
    state: dict = {}
    for check, overrides in TRAIN.items():
        if arch.moe or "ep" not in overrides:
            todo[check] = lambda o=overrides: _train(name, o, steps, state)
    if name in REFUSED:
        row["refusal"] = REFUSED[name][2]
        todo = {check: lambda fn=fn: _refused(fn, name) for check, fn in todo.items()}
    try:
        for check, fn in todo.items():
            print(f"--- {name}: {check}", file=sys.stderr, flush=True)
            row["checks"][check] = _check(fn)
            out.write_text(json.dumps(row, indent=1))
    finally:
        if "cluster" in state:
            state["cluster"].close()


def _run_one(name: str, steps: int, timeout_s: float, log_dir: Path) -> dict:
    """Run `name`'s worker process; its row, with what a crash or timeout left unfinished."""
    out = log_dir / f"{name}.json"
    log = log_dir / f"{name}.log"
    start = time.perf_counter()
    cmd = [sys.executable, __file__, "--worker", name, "--steps", str(steps), "--out", str(out)]
    with open(log, "w") as f:
        # its own session: a timeout ends the worker and the gloo ranks it started, together
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
            ended = None if code == 0 else f"worker exited with code {code}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            ended = f"worker timed out after {timeout_s:.0f} s"
    row = json.loads(out.read_text()) if out.exists() else {"architecture": name, "checks": {}}
    if ended:
        # a crash's last line is its cause; a hung worker's is whatever it last logged
        tail = [line for line in log.read_text().splitlines() if line.strip()][-1:]
        said = f"{ended}; last output: {tail[0]}" if tail and "timed out" not in ended else ended
        for check in CHECKS:
            if check not in row["checks"] and (check != "train dp2xep2" or row.get("moe")):
                row["checks"][check] = {"status": "fail", "seconds": None,
                                        "detail": said[:DETAIL_CHARS]}
                break  # the check that was running; the ones after it never started
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def run(names: list[str], steps: int, timeout_s: float, results: Path) -> dict:
    """Every architecture of `names` in its own process; writes `results` after each row (a
    partial run with --only updates its rows and keeps the others)."""
    doc = json.loads(results.read_text()) if results.exists() else {"rows": {}}
    doc.update(steps=steps, batch=BATCH, seq_len=SEQ, large=LARGE,
               python=platform.python_version(), cpu_count=os.cpu_count())
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="coverage-") as tmp:
        for name in names:
            row = _run_one(name, steps, timeout_s, Path(tmp))
            row["measured_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            doc["rows"][name] = row
            passed = sum(c["status"] == "pass" for c in row["checks"].values())
            print(f"{name}: {passed}/{len(row['checks'])} checks pass ({row['seconds']} s)",
                  flush=True)
            for check, c in row["checks"].items():
                if c["status"] != "pass":
                    print(f"  {check}: {c['detail']}", flush=True)
            results.parent.mkdir(parents=True, exist_ok=True)
            write_json(results, doc)
    doc["last_run"] = {"architectures": names, "seconds": round(time.perf_counter() - start),
                       "load_average": os.getloadavg()[0],
                       "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    write_json(results, doc)
    return doc


def _cell(check: dict | None) -> str:
    if check is None:  # the worker ended (timeout, crash) before it came to this check
        return "not run"
    if check["status"] == "pass":
        return "pass"
    return "fail: " + check["detail"].replace("|", "\\|").replace("`", "'")


def markdown(doc: dict) -> str:
    """The docs/benchmarks.md table of a coverage.json document: a row per architecture, a
    column per check ("pass", "fail: <why>", "not run" after a worker that ended early, "n/a"
    for expert parallelism on a dense model)."""
    lines = table_head(["architecture", "task", *CHECKS])
    for name, row in doc["rows"].items():
        cells = [_cell(row["checks"].get(c)) if c != "train dp2xep2" or row.get("moe")
                 else "n/a" for c in CHECKS]
        lines.append(table_row([name, row.get("task", "?"), *cells]))
    total = sum(1 for row in doc["rows"].values() for c in row["checks"].values())
    passed = sum(1 for row in doc["rows"].values() for c in row["checks"].values()
                 if c["status"] == "pass")
    lines.append("")
    lines.append(f"{passed} of {total} checks pass over {len(doc['rows'])} architectures "
                 f"({doc.get('steps', STEPS)} training steps).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", metavar="NAME",
                        help="run this architecture only (repeatable)")
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps per check")
    parser.add_argument("--timeout-s", type=float, default=900.0,
                        help="seconds one architecture's process may take")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--markdown", action="store_true",
                        help="print the docs/benchmarks.md table from --results and run nothing")
    parser.add_argument("--worker", metavar="NAME", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: expected an integer >= 1")
    if args.markdown:
        print(markdown(json.loads(args.results.read_text())))
        return 0
    if args.worker:
        run_worker(args.worker, args.steps, args.out)
        return 0
    from autoplan.models.architectures import ARCHITECTURES

    known = [*ARCHITECTURES, *FINE_TUNING, *REFUSED]
    names = args.only or known
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"--only {unknown[0]}: unknown; known: {', '.join(known)}")
    doc = run(names, args.steps, args.timeout_s, args.results)
    print(f"{len(names)} architectures in {doc['last_run']['seconds']} s -> {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
