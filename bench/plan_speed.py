"""Planning speed: capture + solve + report, per model and cluster, against the bars of issue 4.

    python bench/plan_speed.py            # every case, 3 runs each -> bench/results/plan_speed.json
    python bench/plan_speed.py --runs 1 --case llama3-8b
    python bench/plan_speed.py --case cli --merge   # cli-cold/-warm only, into the JSON

What is measured. Every run is a fresh Python process (`--worker CASE`), so each pays the same
cold costs: the first torch.export, DTensor's first sharding propagations, OR-Tools' first
model. Inside the worker the clock starts after the library imports -- torch, transformers (for
HF presets), OR-Tools and autoplan, `import_s`: recorded, not part of the bar, since
`import torch` and `import transformers` alone take 3-4 s on this machine whatever is planned --
and then covers, in order,

    capture_s   capture_preset(...) on the meta device: the model is built and torch.export
                traces it (its first call in the process, with export's own lazy imports)
    solve_s     autoplan.solver.plan(...)
    report_s    render_markdown + render_html (strings; nothing is written)

`plan_s` = capture_s + solve_s + report_s is what the bars apply to; `process_s` is the whole
subprocess as the parent saw it (interpreter start and imports included), for reference.

The preset cases capture one block (`num_layers=1`) and plan at the real depth: the planner's
answer does not depend on how many identical blocks are captured (tests/test_solver.py,
test_the_answer_does_not_depend_on_how_many_blocks_were_captured). The depth cases plan the
same Llama-3-8B block repeated 8, 32 and 128 times on 16 DGX-H100 nodes (total_layers = N):
the bar is plan_s(128) <= 2 x plan_s(8). The `full-N` cases capture all N blocks of a small
nanoGPT (width 256) to show what a full capture costs: torch.export traces every block (linear
in N); the ILPs do not grow (identical blocks share one set of variables) but the per-node
bookkeeping over the captured graph (candidates, edges, saved tensors, the plan's per-node
strategies) still does. Their ratios are reported as `info`, not as a bar.

The `llama-6.7b` pair is issue 10's model (hidden 4096, 32 layers, 32 heads, vocab 32000: an HF
LlamaConfig) on 16 H100s (2 dgx-h100 nodes), global batch 64, seq 4096, bf16, planned the two
ways a user can: `llama-6.7b` as `autoplan plan --model config.json` does (capture_preset of
the config file: 2 blocks, the global batch, the compute dtype), `llama-6.7b-instance` as
`@autoparallel(model)` does with a `LlamaForCausalLM` instance of all 32 layers built on meta
by the user (its construction, `build_s`, is recorded, not timed in plan_s): `.plan` (its
shallow capture, [Note: shallow planning capture], and the solve), then the report. Both must
give the same plan; the bar is plan_s(instance) <= 2 x plan_s(config file).

The `cli` cases are what a user waits for (issue 12): the whole process of

    autoplan plan --model llama3-405b --cluster dgx-h100 --nodes 2048 --global-batch 2048 \
        --seq 8192 -o DIR

timed by this process around `subprocess.run` (interpreter start, every import, capture, solve,
rendering and writing the three files), run as the tests run the CLI (the venv's `autoplan`
script, else `python -m autoplan.cli`). Each run pairs `cli-cold` -- an empty plan cache of its
own (AUTOPLAN_CACHE_DIR, autoplan/cache.py) -- with `cli-warm`, the same command again,
answered from that cache; the warm run must say so on stderr and write the same plan.json. The
wall time (`process_s`) is what the bars apply to (cold <= 8 s, warm <= 3 s, medians); the
children's CPU time (`cpu_s`, user + system, from getrusage) is recorded beside it, since on a
loaded machine the wall time is mostly waiting for a core.

Median of the runs per case; the JSON holds every run, the medians, the bars and the machine's
load average (other jobs on a shared 2-core machine slow every phase).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import tempfile
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _results.py
from _results import write_json  # noqa: E402

_START = time.perf_counter()

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "plan_speed.json"

# name: (model, cluster, nodes, global_batch, seq_len, total_layers or None, capture layers)
CASES: dict[str, tuple] = {
    "llama3-405b": ("llama3-405b", "dgx-h100", 2048, 2048, 8192, None, 1),
    # issue 13: the 128K-token phase, which only context parallelism makes fit; captured as
    # `autoplan plan` captures it (2 blocks, bf16, the global batch): the bar wants cp > 1
    "llama3.1-405b-128k": ("llama3.1-405b", "dgx-h100", 2048, 128, 131072, None, 2),
    "gpt3-175b": ("gpt3-175b", "dgx-a100", 128, 1536, 2048, None, 1),
    "llama3-8b": ("llama3-8b", "dgx-h100", 1, 64, 8192, None, 1),
    "depth-8": ("llama3-8b", "dgx-h100", 16, 256, 4096, 8, 1),
    "depth-32": ("llama3-8b", "dgx-h100", 16, 256, 4096, 32, 1),
    "depth-128": ("llama3-8b", "dgx-h100", 16, 256, 4096, 128, 1),
    "full-8": ("nanogpt", "dgx-h100", 1, 64, 1024, 8, 8),
    "full-32": ("nanogpt", "dgx-h100", 1, 64, 1024, 32, 32),
    "full-128": ("nanogpt", "dgx-h100", 1, 64, 1024, 128, 128),
    "llama-6.7b": ("llama-6.7b", "dgx-h100", 2, 64, 4096, None, 2),
    "llama-6.7b-instance": ("llama-6.7b-instance", "dgx-h100", 2, 64, 4096, None, None),
    # issue 28: mixtures of experts as published, on 16 dgx-h100 nodes
    "mixtral-8x22b": ("mixtral-8x22b", "dgx-h100", 16, 1024, 4096, None, 2),
    "qwen3-235b-a22b": ("qwen3-235b-a22b", "dgx-h100", 16, 1024, 4096, None, 2),
}
# captured as `autoplan plan` does, not at batch 1 in fp32 (issue 28's bars are the command's)
AS_THE_CLI = {"llama3.1-405b-128k", "mixtral-8x22b", "qwen3-235b-a22b"}
CP_BAR = "llama3.1-405b-128k"  # its plan must have context parallelism (cp > 1)
BARS_S = {"llama3-405b": 10.0, "llama3.1-405b-128k": 10.0, "gpt3-175b": 5.0, "llama3-8b": 3.0,
          "mixtral-8x22b": 10.0, "qwen3-235b-a22b": 10.0}
# the whole `autoplan plan ... -o DIR` process, wall seconds (issue 12): cache empty / from it
CLI_ARGS = ("plan", "--model", "llama3-405b", "--cluster", "dgx-h100", "--nodes", "2048",
            "--global-batch", "2048", "--seq", "8192")
CLI_BARS_S = {"cli-cold": 8.0, "cli-warm": 3.0}
# issue 13: the 128K-token command, whole process with an empty cache (`--case cli-128k`)
CLI_128K_ARGS = ("plan", "--model", "llama3.1-405b", "--cluster", "dgx-h100", "--nodes", "2048",
                 "--global-batch", "128", "--seq", "131072")
CLI_128K_BARS_S = {"cli-128k-cold": 10.0}
DEPTH_RATIO_BAR = 2.0  # plan_s(depth-128) <= 2 x plan_s(depth-8)
_NANOGPT = dict(vocab_size=50304, n_embd=256, n_head=4, block_size=1024, dropout=0.0, bias=True)
INSTANCE_RATIO_BAR = 2.0  # plan_s(llama-6.7b-instance) <= 2 x plan_s(llama-6.7b)
# issue 10's model: transformers.LlamaConfig(hidden_size=4096, num_hidden_layers=32,
# num_attention_heads=32, vocab_size=32000) with positions for seq 4096 (FFN 11008: the default)
_LLAMA_6_7B = dict(model_type="llama", hidden_size=4096, intermediate_size=11008,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                   vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)


def _decisions(result) -> str:
    """The plan in words without the model's name (a config file and an instance differ
    there): mesh, ZeRO stage, microbatches, schedule, step time, memory."""
    import dataclasses

    return str(dataclasses.replace(result, model="-"))


def _instance_worker(case: str, t_import: float) -> dict:
    """llama-6.7b-instance: `@autoparallel` on a LlamaForCausalLM built on meta."""
    import torch
    import transformers

    from autoplan import autoparallel
    from autoplan.report import render_html, render_markdown

    _model, cluster, nodes, global_batch, seq, _total, _keep = CASES[case]
    config = {k: v for k, v in _LLAMA_6_7B.items() if k != "model_type"}
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    t_build = time.perf_counter()
    ap = autoparallel(model, global_batch=global_batch, seq_len=seq, cluster=cluster,
                      num_nodes=nodes, dtype="bfloat16")
    result = ap.plan
    t_solve = time.perf_counter()
    markdown = render_markdown(result, graph=ap.graph, topology=ap.topology)
    html = render_html(result, graph=ap.graph, topology=ap.topology)
    t_report = time.perf_counter()
    return {
        "import_s": t_import - _START, "build_s": t_build - t_import,
        "capture_s": None, "solve_s": t_solve - t_build, "report_s": t_report - t_solve,
        "plan_s": t_report - t_build, "report_chars": len(markdown) + len(html),
        "plan": str(result), "decisions": _decisions(result),
        "step_time_s": result.prediction.step_time_s, "world_size": ap.topology.world_size,
        "total_layers": ap.graph.total_layers,
        "captured_layers": ap.graph.num_layers,
    }


def _capture(case: str):
    model, _cluster, _nodes, _gb, seq, total, keep = CASES[case]
    from autoplan.capture import capture, capture_preset
    if model == "nanogpt":
        import torch
        from autoplan.models.nanogpt import GPT, GPTConfig
        with torch.device("meta"):
            net = GPT(GPTConfig(n_layer=keep, **_NANOGPT))
        return capture(net, (torch.zeros(1, seq, dtype=torch.long),), model_name=case,
                       total_layers=total)
    if model == "llama-6.7b":  # as `autoplan plan --model config.json` captures it
        import tempfile

        import torch
        with tempfile.TemporaryDirectory(prefix="plan-speed-") as tmp:
            path = Path(tmp) / "config.json"
            path.write_text(json.dumps(_LLAMA_6_7B))
            return capture_preset(str(path), batch=CASES[case][3], seq_len=seq,
                                  num_layers=keep, dtype=torch.bfloat16)
    if case in AS_THE_CLI:  # a 16-bit graph has the model's own upcasts as nodes
        import torch
        return capture_preset(model, batch=CASES[case][3], seq_len=seq, num_layers=keep,
                              dtype=torch.bfloat16)
    graph = capture_preset(model, batch=1, seq_len=seq, num_layers=keep)
    if total is not None:  # the same block at another depth
        graph.total_layers = total
        graph.model_name = f"{model} x{total} layers"
    return graph


def worker(case: str) -> dict:
    """One measurement (run in a fresh process); returns the phase times and the plan."""
    import ortools.linear_solver.pywraplp  # noqa: F401  (imports are timed apart, see the
    import torch  # noqa: F401                              module docstring)

    import autoplan.api  # noqa: F401  (the decorator's modules, for the instance case: its
    import autoplan.runtime.job  # noqa: F401   first `.plan` imports these two)
    import autoplan.runtime.precision  # noqa: F401
    import autoplan.capture  # noqa: F401
    from autoplan.models import is_hf
    name = CASES[case][0]
    if name in ("llama-6.7b", "llama-6.7b-instance") or (name != "nanogpt" and is_hf(name)):
        import transformers  # noqa: F401
        from transformers import GPT2LMHeadModel, LlamaForCausalLM  # noqa: F401  (lazy)
    from autoplan.report import render_html, render_markdown
    from autoplan.solver import plan
    from autoplan.spec import TrainingSpec
    from autoplan.topology import preset

    t_import = time.perf_counter()
    if case == "llama-6.7b-instance":
        return _instance_worker(case, t_import)
    _model, cluster, nodes, global_batch, seq, _total, _keep = CASES[case]
    graph = _capture(case)
    t_capture = time.perf_counter()
    topology = preset(cluster, num_nodes=nodes)
    spec = TrainingSpec(global_batch=global_batch, seq_len=seq, dtype="bfloat16")
    result = plan(graph, topology, spec)
    t_solve = time.perf_counter()
    markdown = render_markdown(result, graph=graph, topology=topology)
    html = render_html(result, graph=graph, topology=topology)
    t_report = time.perf_counter()
    return {
        "import_s": t_import - _START, "capture_s": t_capture - t_import,
        "solve_s": t_solve - t_capture, "report_s": t_report - t_solve,
        "plan_s": t_report - t_import, "report_chars": len(markdown) + len(html),
        "plan": str(result), "decisions": _decisions(result),
        "step_time_s": result.prediction.step_time_s, "world_size": topology.world_size,
        "cp": result.mesh.cp,
        "total_layers": graph.total_layers, "captured_layers": graph.num_layers,
    }


def _measure(case: str) -> dict:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", case], capture_output=True,
                          text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{proc.stderr[-4000:]}")
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    run["process_s"] = wall
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--case", action="append", choices=sorted([*CASES, "cli", "cli-128k"]),
                        help="a case to run (repeatable); `cli` runs cli-cold and cli-warm, "
                             "`cli-128k` the same pair for the 128K-token command")
    parser.add_argument("--worker", choices=sorted(CASES), help=argparse.SUPPRESS)
    parser.add_argument("-o", "--out", type=Path, default=RESULT)
    parser.add_argument("--merge", action="store_true",
                        help="with --case: replace those cases in the results file (-o), "
                             "keeping the others, and recompute the bars; each merged case "
                             "records the load average it ran at")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return 0
    cases = args.case or [*CASES, "cli", "cli-128k"]
    results: dict[str, dict] = {}
    if "cli" in cases:
        results.update(_cli_cases(args.runs))
    if "cli-128k" in cases:
        results.update(_cli_cases(args.runs, CLI_128K_ARGS, "cli-128k"))
    for case in (c for c in cases if c not in ("cli", "cli-128k")):
        runs = [_measure(case) for _ in range(args.runs)]
        medians = {k: statistics.median(r[k] for r in runs)
                   for k in ("import_s", "build_s", "capture_s", "solve_s", "report_s",
                             "plan_s", "process_s") if runs[0].get(k) is not None}
        results[case] = {"config": dict(zip(("model", "cluster", "nodes", "global_batch",
                                             "seq_len", "total_layers", "captured_layers"),
                                            CASES[case])),
                         "runs": runs, "median": medians, "plan": runs[0]["plan"]}
        print(f"{case}: plan {medians['plan_s']:.2f} s", file=sys.stderr)
    machine = {"platform": platform.platform(), "python": platform.python_version(),
               "cpus": _cpus(), "load_average_1_5_15": list(os.getloadavg())}
    if args.merge and args.case:
        return _merge(results, machine, args.runs, args.out)
    bars = _bars(results)
    report = {"machine": machine, "runs_per_case": args.runs, "cases": results, "bars": bars,
              "info": _info(results)}
    if args.case is None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, report)
    _print_table(results, bars, report["info"])
    return 0 if all(b["ok"] for b in bars) else 1


def _merge(results: dict, machine: dict, runs: int, out: Path) -> int:
    """`--case ... --merge`: these cases replace their entries in `out` (each with the
    machine and load average it ran at, and its number of runs), the others are kept, and
    the bars and info are recomputed over the merged cases."""
    report = json.loads(out.read_text())
    for case, result in results.items():
        report["cases"][case] = {**result, "machine": machine, "runs_per_case": runs}
    report["bars"], report["info"] = _bars(report["cases"]), _info(report["cases"])
    write_json(out, report)
    _print_table(results, [b for b in report["bars"] if b["bar"].split()[0] in results],
                 [])
    return 0 if all(b["ok"] for b in report["bars"]) else 1


def _cli_argv() -> list[str]:
    """The CLI as the tests run it (tests/test_cli.py): the venv's script, else the module."""
    script = Path(sys.executable).parent / "autoplan"
    return [str(script)] if script.exists() else [sys.executable, "-m", "autoplan.cli"]


def _cli_run(cache_dir: Path, out_dir: Path, argv: tuple = CLI_ARGS) -> dict:
    """One whole `autoplan plan ... -o out_dir -q` process: wall and CPU seconds, and whether
    it said the plan came from the cache."""
    env = {**os.environ, "AUTOPLAN_CACHE_DIR": str(cache_dir),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([*_cli_argv(), *argv, "-o", str(out_dir)], capture_output=True,
                          text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"autoplan plan failed:\n{proc.stderr[-4000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"process_s": wall, "cpu_s": cpu, "from_cache": "read from the plan cache" in
            proc.stderr, "load_average_1": os.getloadavg()[0]}


def _cli_cases(runs: int, argv: tuple = CLI_ARGS, name: str = "cli") -> dict[str, dict]:
    """cli-cold / cli-warm pairs (module docstring): each cold run on an empty cache of its
    own, then the same command from that cache. Raises RuntimeError when a cold run was served
    from a cache, a warm one was not, or the two wrote different plans."""
    cold, warm = [], []
    for _ in range(runs):
        tmp = Path(tempfile.mkdtemp(prefix="plan-speed-cli-"))
        try:
            cold.append(_cli_run(tmp / "cache", tmp / "cold", argv))
            warm.append(_cli_run(tmp / "cache", tmp / "warm", argv))
            plans = [(tmp / d / "plan.json").read_text() for d in ("cold", "warm")]
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if cold[-1]["from_cache"] or not warm[-1]["from_cache"] or plans[0] != plans[1]:
            raise RuntimeError(f"cli runs: cold from cache {cold[-1]['from_cache']}, warm from "
                               f"cache {warm[-1]['from_cache']}, same plan.json "
                               f"{plans[0] == plans[1]}")
        plan = json.loads(plans[0])
        cold[-1]["plan"] = warm[-1]["plan"] = (f"{plan['mesh']}, zero{plan['zero_stage']}, "
                                               f"{plan['schedule']}")
    results = {}
    for case, case_runs in ((f"{name}-cold", cold), (f"{name}-warm", warm)):
        medians = {k: statistics.median(r[k] for r in case_runs) for k in ("process_s", "cpu_s")}
        results[case] = {"config": {"argv": ["autoplan", *argv, "-o", "DIR"],
                                    "cache": "empty" if case.endswith("-cold") else "warm"},
                         "runs": case_runs, "median": medians, "plan": case_runs[0]["plan"]}
        print(f"{case}: process {medians['process_s']:.2f} s (cpu {medians['cpu_s']:.2f} s)",
              file=sys.stderr)
    return results


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _bars(results: dict) -> list[dict]:
    bars = []
    for case, limit in CLI_BARS_S.items():
        if case in results:
            value = results[case]["median"]["process_s"]
            bars.append({"bar": f"{case} process_s (autoplan plan llama3-405b, 2048 dgx-h100 "
                                f"nodes, -o DIR) <= {limit} s", "value": value,
                         "ok": value <= limit})
    for case, limit in CLI_128K_BARS_S.items():
        if case in results:
            value = results[case]["median"]["process_s"]
            cp = results[case]["plan"].split("'cp': ")[1].split(",")[0] \
                if "'cp': " in results[case]["plan"] else "1"
            bars.append({"bar": f"{case} process_s (autoplan plan llama3.1-405b, 2048 dgx-h100 "
                                f"nodes, --seq 131072, -o DIR) <= {limit} s, a plan with cp > 1",
                         "value": value, "ok": value <= limit and int(cp) > 1})
    for case, limit in BARS_S.items():
        if case in results:
            value = results[case]["median"]["plan_s"]
            cp = results[case]["runs"][0].get("cp", 1) if case == CP_BAR else None
            bars.append({"bar": f"{case} plan_s <= {limit} s" + (
                ", a plan with cp > 1" if cp is not None else ""), "value": value,
                "ok": value <= limit and (cp is None or cp > 1)})
    preset_, instance = results.get("llama-6.7b"), results.get("llama-6.7b-instance")
    if preset_ and instance:
        ratio = instance["median"]["plan_s"] / preset_["median"]["plan_s"]
        same = instance["runs"][0]["decisions"] == preset_["runs"][0]["decisions"]
        bars.append({"bar": f"llama-6.7b-instance plan_s <= {INSTANCE_RATIO_BAR} x llama-6.7b "
                            "(the config file's), the same plan", "value": ratio,
                     "ok": ratio <= INSTANCE_RATIO_BAR and same})
    lo, hi = results.get("depth-8"), results.get("depth-128")
    if lo and hi:
        ratio = hi["median"]["plan_s"] / lo["median"]["plan_s"]
        bars.append({"bar": f"depth-128 plan_s <= {DEPTH_RATIO_BAR} x depth-8", "value": ratio,
                     "ok": ratio <= DEPTH_RATIO_BAR})
    return bars


def _info(results: dict) -> list[dict]:
    """Ratios of the full-capture cases (not bars: capture_s is torch.export's)."""
    lo, hi = results.get("full-8"), results.get("full-128")
    if not (lo and hi):
        return []
    return [{"ratio": f"full-128 / full-8 {key}", "value": hi["median"][key] / lo["median"][key]}
            for key in ("capture_s", "solve_s", "plan_s")]


def _print_table(results: dict, bars: list[dict], info: list[dict]) -> None:
    head = f"{'case':<12} {'import':>7} {'capture':>8} {'solve':>7} {'report':>7} " \
           f"{'plan':>7} {'process':>8}  plan"
    print(head)
    print("-" * len(head))
    for case, r in results.items():
        m = r["median"]
        if case.startswith("cli-"):
            print(f"{case:<12} {'':>7} {'':>8} {'':>7} {'':>7} {'':>7} {m['process_s']:8.2f}  "
                  f"{r['plan']} (cpu {m['cpu_s']:.2f} s)")
            continue
        capture_s = f"{m['capture_s']:8.2f}" if "capture_s" in m else f"{'(in solve)':>8}"
        print(f"{case:<12} {m['import_s']:7.2f} {capture_s} {m['solve_s']:7.2f} "
              f"{m['report_s']:7.2f} {m['plan_s']:7.2f} {m['process_s']:8.2f}  {r['plan']}")
    print()
    for b in bars:
        print(f"{'ok  ' if b['ok'] else 'FAIL'} {b['bar']}: {b['value']:.2f}")
    for i in info:
        print(f"info {i['ratio']}: {i['value']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
