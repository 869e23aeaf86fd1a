"""Train under torchrun: one script, any number of processes and nodes, no process-group code.

    torchrun --standalone --nproc_per_node 2 examples/torchrun_train.py
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-endpoint HOST:29500 \\
        examples/torchrun_train.py --cluster dgx-h100 --steps 1000      # on 2 GPU nodes
    python examples/torchrun_train.py                                 # one process

`@autoparallel` joins torchrun's process group itself (NCCL on `cuda:LOCAL_RANK` when CUDA is
available, gloo on the CPU otherwise), plans for the job's ranks -- WORLD_SIZE devices in
WORLD_SIZE / LOCAL_WORLD_SIZE nodes -- and destroys the group in order when the script exits,
so that a job that trained exits 0 ([Note: orderly exit] in autoplan/runtime/shutdown.py).
`--cluster local-cpu` (the default) sizes itself to the job; a GPU preset such as dgx-h100
must match it (an error names both sizes otherwise).

The model is a GPT-2-style HF model at byte level (vocabulary 256) built by a decorated factory:
every rank replays its recorded initialisation on its own shards only, so the weights equal
`torch.manual_seed(0); make_model()` on one process whatever the plan. The data are bytes of
the Python standard library's sources (the same global batch on every rank, as `model.step`
requires). Every `--save-every` steps the job writes a sharded checkpoint (`model.save`) that
`--resume` loads into any plan or world size. Rank 0 prints the step metrics and, at the end,
writes the plan report and the per-rank graphs to `--out`.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist


def byte_batches(steps: int, batch: int, seq: int, first_step: int = 0):
    """(input_ids, labels) pairs, (batch, seq) int64 bytes of the standard library's sources,
    labels the next byte; batch k is the same whatever step the job starts from."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:50]
    data = torch.tensor(list(b"".join(f.read_bytes() for f in files)))
    for step in range(first_step, first_step + steps):
        g = torch.Generator().manual_seed(step)
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g).tolist()
        window = torch.stack([data[s:s + seq + 1] for s in starts])
        yield window[:, :-1], window[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="local-cpu", help="preset or topology YAML")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=8, help="samples per step")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sample")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=0, help="0: no checkpoints")
    parser.add_argument("--resume", help="a checkpoint directory written by --save-every")
    parser.add_argument("--out", default="out/torchrun_train")
    args = parser.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel

    from autoplan import autoparallel

    config = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=64, n_layer=args.layers,
                        n_head=4, bos_token_id=0, eos_token_id=0)

    @autoparallel(global_batch=args.global_batch, seq_len=args.seq, cluster=args.cluster)
    def make_model():
        return GPT2LMHeadModel(config)

    torch.manual_seed(0)
    model = make_model()  # recorded on meta: nothing allocated until the first step
    first = 0
    if args.resume:
        model.load(args.resume)
        first = int(Path(args.resume).name.rsplit("-", 1)[-1])
    for step, (x, y) in enumerate(byte_batches(args.steps, args.global_batch, args.seq, first),
                                  first + 1):
        model.step(x, y)
        if dist.get_rank() == 0:
            print(f"rank 0 of {dist.get_world_size()}: {model.metrics}", flush=True)
        if args.save_every and step % args.save_every == 0:
            model.save(Path(args.out) / f"step-{step}")
    if dist.get_rank() == 0:
        model.report(args.out)
        model.export(Path(args.out) / "graphs")
        print(f"plan {model.plan}; report and graphs in {args.out}", flush=True)


if __name__ == "__main__":
    main()
