"""Plan a model for a cluster you do not have, from Python: the plan, its predictions, what-if
questions over the node count, and the report (Markdown + a self-contained HTML page).

    python examples/plan_cluster.py                     # Llama-3-70B on 8 DGX H100 nodes
    python examples/plan_cluster.py --model llama3-8b --nodes 1 --global-batch 32 --seq 2048
    python examples/plan_cluster.py --model path/to/config.json --cluster examples/topology.yaml
    python examples/plan_cluster.py --what-if 4 8 16    # the same job on 4, 8 and 16 nodes

The model is a preset (`autoplan.models.PRESETS`: llama3-8b, llama3-70b, llama3-405b,
gpt3-175b, ...) or a Hugging Face `config.json` (GPT-2 or Llama), built on the meta device:
nothing is allocated or downloaded, so a 70B model plans on a laptop. The cluster is a preset
(dgx-h100, dgx-a100, h200-node) or a topology YAML (examples/topology.yaml explains every
field). Planning happens outside any process group, so `@autoparallel` only plans: `.plan` is
the frozen Plan (mesh, ZeRO stage, microbatches, schedule, per-parameter placements and the
predicted step time, memory per device and MFU), `.report(dir)` writes plan.json, report.md
and report.html. The command-line equivalent is `autoplan plan` (README).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def plan_for(model_name: str, cluster: str, nodes: int, global_batch: int, seq: int,
             dtype: str):
    """An AutoParallel that plans `model_name` for `nodes` nodes of `cluster` (nothing built)."""
    from autoplan import autoparallel
    from autoplan.models import build_model

    model = build_model(model_name, device="meta")
    return autoparallel(model, global_batch=global_batch, seq_len=seq, cluster=cluster,
                        num_nodes=nodes, dtype=dtype)


def describe(plan) -> str:
    """One line: the configuration and its predicted step time, memory per device, MFU."""
    from autoplan.units import fmt_bytes, fmt_pct, fmt_time

    p = plan.prediction
    return (f"{plan.mesh}, ZeRO-{plan.zero_stage}, {plan.num_microbatches} microbatches, "
            f"{plan.schedule}: step {fmt_time(p.step_time_s)}, {fmt_bytes(p.memory_bytes)} per "
            f"device, MFU {fmt_pct(p.mfu)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-70b", help="preset or HF config.json")
    parser.add_argument("--cluster", default="dgx-h100", help="preset or topology YAML")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=512, help="samples per step")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sample")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--what-if", type=int, nargs="*", default=[], metavar="NODES",
                        help="also plan the same job on these node counts")
    parser.add_argument("-o", "--out", default="out/plan_cluster")
    args = parser.parse_args()

    model = plan_for(args.model, args.cluster, args.nodes, args.global_batch, args.seq,
                     args.dtype)
    plan = model.plan
    print(f"{args.model} on {args.nodes} x {args.cluster}: {describe(plan)}")
    model.report(args.out)
    print(f"report: {Path(args.out) / 'report.md'}, {Path(args.out) / 'report.html'}")
    for nodes in args.what_if:
        other = plan_for(args.model, args.cluster, nodes, args.global_batch, args.seq,
                         args.dtype).plan
        print(f"  on {nodes} nodes: {describe(other)}")


if __name__ == "__main__":
    main()
