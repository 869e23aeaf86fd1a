"""The README's torchrun script, run again and again: how many runs exit 0 (issue 29, "The user
in control"; [Note: orderly exit] in autoplan/runtime/shutdown.py).

    python bench/torchrun_exit.py                        # -> bench/results/torchrun_exit.json
    python bench/torchrun_exit.py --baseline ../parent   # also the script on another checkout
    python bench/torchrun_exit.py --runs 3 --out /tmp/x.json   # to try the bench

Each round runs, one after the other so that each sees the same machine load:
- `readme`: README.md's `train.py` (the `@autoparallel` script, gpt2 at byte level, 3 steps,
  rank 0 then writes the report and the graphs) under `torchrun --standalone
  --nproc_per_node 2` on gloo, importing this checkout's autoplan;
- `readme at the baseline` (with `--baseline PATH`): the same script importing the autoplan of
  the checkout at PATH (the commit before the fix, say);
- `plain gloo`: the control, no autoplan: a gloo group, 20 all_reduces of 1,000 floats
  (one of them async, waited), a print, exit -- what torch does on this machine at the time;
- `plain gloo, autoplan's group`: the same loop in the group autoplan creates
  (`autoplan.runtime.launcher.init_from_env`), so the exit that ends it is autoplan's: the
  abort this loop provokes far more often than the README's script, with the fix in place.
Per run: torchrun's exit status, its wall time, and every rank's exit code from torchrun's
failure report (-6: SIGABRT, "terminate called without an active exception"); a run past
`--timeout` (600 s) is killed and counted as hung. Bar: `readme` exits 0 in every run (20 of
20). Measured on this 2-core machine, shared: the load average goes into the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for _results.py
from _results import ROOT, replace_section, table_head, table_row, write_json  # noqa: E402

PLAIN_GLOO = '''import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1000)
for _ in range(20):
    dist.all_reduce(t)
dist.all_reduce(torch.ones(1000), async_op=True).wait()
print("rank", dist.get_rank(), "done", flush=True)
'''
PLAIN_GLOO_AUTOPLAN = PLAIN_GLOO.replace(
    'dist.init_process_group("gloo")',
    "from autoplan.runtime.launcher import init_from_env\ninit_from_env()")
SIGABRT = -6
HEAD = "## Exit under torchrun"


def readme_train_script() -> str:
    """The README's Python block that starts `# train.py`."""
    blocks, body, inside = [], [], False
    for line in (ROOT / "README.md").read_text().splitlines(keepends=True):
        if line.startswith("```"):
            if inside and body and body[0].startswith("# train.py"):
                blocks.append("".join(body))
            inside, body = not inside and line.strip() == "```python", []
        elif inside:
            body.append(line)
    if len(blocks) != 1:
        raise SystemExit(f"README.md has {len(blocks)} python blocks starting '# train.py'")
    return blocks[0]


def git_commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty", "--abbrev=7"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def run_once(script: str, autoplan_tree: Path | None, timeout_s: float) -> dict:
    """One `torchrun --standalone --nproc_per_node 2` of `script` in a fresh directory: exit
    status, wall time, each failed rank's exit code, whether it hung."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"):
        env.pop(k, None)
    if autoplan_tree is not None:
        env["PYTHONPATH"] = str(autoplan_tree) + os.pathsep + env.get("PYTHONPATH", "")
    torchrun = Path(sys.executable).parent / "torchrun"
    with tempfile.TemporaryDirectory(prefix="torchrun-exit-") as tmp:
        path = Path(tmp) / "train.py"
        path.write_text(script)
        start = time.perf_counter()
        try:
            run = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2",
                                  str(path)], cwd=tmp, env=env, capture_output=True, text=True,
                                 timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"exit": None, "hung": True, "wall_s": time.perf_counter() - start,
                    "rank_exits": {}}
    ranks = re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\s+exitcode\s+: (-?\d+)",
                       run.stderr)
    return {"exit": run.returncode, "hung": False, "wall_s": time.perf_counter() - start,
            "rank_exits": {int(r): int(code) for r, code in ranks},
            "terminate_called": "terminate called" in run.stderr}


def summary(runs: list[dict]) -> dict:
    return {"runs": len(runs), "exit_0": sum(r["exit"] == 0 for r in runs),
            "a_rank_aborted": sum(SIGABRT in r["rank_exits"].values() for r in runs),
            "hung": sum(r["hung"] for r in runs),
            "median_wall_s": statistics.median(r["wall_s"] for r in runs)}


def markdown(doc: dict) -> str:
    """The results table, one row per script."""
    lines = table_head(["script", "autoplan", "runs", "exit 0", "a rank SIGABRT", "hung",
                        "median s"])
    for name, entry in doc["scripts"].items():
        s = entry["summary"]
        lines.append(table_row([name, entry["autoplan"], str(s["runs"]), str(s["exit_0"]),
                                str(s["a_rank_aborted"]), str(s["hung"]),
                                f"{s['median_wall_s']:.0f}"]))
    return "\n".join(lines)


def docs_section(doc: dict) -> str:
    """Its section of docs/benchmarks.md: what it runs, when, and the table."""
    load = ", ".join(f"{x:.1f}" for x in doc["load_average"])
    prose = textwrap.fill(
        "`python bench/torchrun_exit.py` runs README.md's `train.py` under `torchrun "
        "--standalone --nproc_per_node 2` (gloo) again and again and counts the runs that exit "
        "0 ([Note: orderly exit] in autoplan/runtime/shutdown.py); bar: every run of the "
        "README's script. By turns with it: with `--baseline`, the same script on another "
        "checkout; a plain gloo all_reduce loop in a group of its own (torch's behaviour on "
        "this machine at the time) and in the group autoplan creates; `--docs` writes this "
        "section. Run "
        f"{doc['date'][:10]}, load average {load} (2 cores, shared), torch {doc['torch']}:",
        width=96, break_on_hyphens=False, break_long_words=False)
    return f"{HEAD}\n\n{prose}\n\n{markdown(doc)}\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="rounds (default 20)")
    parser.add_argument("--baseline", type=Path, help="another checkout to run the script on")
    parser.add_argument("--no-control", action="store_true", help="skip the plain gloo loops")
    parser.add_argument("--timeout", type=float, default=600.0, help="per run, s")
    parser.add_argument("--docs", action="store_true", help="write its section of "
                        "docs/benchmarks.md")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "torchrun_exit.json")
    args = parser.parse_args(argv)
    readme = readme_train_script()
    scripts = {"readme train.py": (readme, ROOT, git_commit(ROOT))}
    if args.baseline is not None:
        tree = args.baseline.resolve()
        scripts["readme train.py, baseline"] = (readme, tree, git_commit(tree))
    if not args.no_control:
        scripts["plain gloo, no autoplan"] = (PLAIN_GLOO, None, "-")
        scripts["plain gloo, autoplan's group"] = (PLAIN_GLOO_AUTOPLAN, ROOT, scripts[
            "readme train.py"][2])
    load_before = os.getloadavg()
    runs = {name: [] for name in scripts}
    for i in range(args.runs):
        for name, (script, tree, _) in scripts.items():
            r = run_once(script, tree, args.timeout)
            runs[name].append(r)
            print(f"round {i + 1}/{args.runs} {name}: exit {r['exit']}"
                  + (f", ranks {r['rank_exits']}" if r["rank_exits"] else "")
                  + (", hung" if r["hung"] else "") + f", {r['wall_s']:.0f} s", flush=True)
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average": os.getloadavg(), "load_average_at_start": load_before,
        "torch": torch.__version__, "python": sys.version.split()[0], "ranks": 2,
        "backend": "gloo", "bar": "readme train.py exits 0 in every run",
        "scripts": {name: {"autoplan": commit, "summary": summary(runs[name]),
                           "runs": runs[name]}
                    for name, (_, _, commit) in scripts.items()},
    }
    write_json(args.out, doc)
    print(markdown(doc))
    print(f"-> {args.out}")
    if args.docs:
        replace_section(HEAD, docs_section(doc))
    ok = doc["scripts"]["readme train.py"]["summary"]
    return 0 if ok["exit_0"] == ok["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
