"""Batches that are not token ids: a seq2seq model (T5) and an image classifier (ViT) trained
from dict batches with their own loss, evaluated with `eval_step`, checked against one process.

    python examples/any_batch.py                   # 4 local CPU ranks, dp=2 x tp=2
    python examples/any_batch.py --ranks 2 --overrides tp=2 --steps 2

`model.step(batch)` takes the dict a Hugging Face model takes (`model(**batch)`): T5 gets
`input_ids`, `attention_mask` and `labels` and returns its own `.loss`; ViT gets
`pixel_values` and class `labels`. The first batch fixes the plan's inputs (shapes and dtypes;
dim 0 is the batch, split over dp ranks and microbatches). `model.eval_step(batch,
return_outputs=True)` gives the loss and the whole batch's outputs on every rank, without
training. The script prints each step's loss on the ranks and on one process (same weights,
same batches, the batch cut into the same dp x microbatch parts) and exits non-zero if they
differ by more than the fp32 contract's rtol 1e-5.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist


def make_model(kind: str):
    """A tiny T5 or ViT from a config (nothing downloaded), seeded."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "t5":
        config = tf.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                             num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                             pad_token_id=0)
        return tf.T5ForConditionalGeneration(config)
    config = tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                          num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                          num_labels=10)
    return tf.ViTForImageClassification(config)


def batches(kind: str, steps: int, batch: int, seq: int) -> list[dict]:
    """Seeded dict batches: T5 source ids (sample i padded by i tokens) and target ids; ViT
    images and class ids."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        if kind == "vit":
            out.append({"pixel_values": torch.randn(batch, 3, 16, 16, generator=g),
                        "labels": torch.randint(0, 10, (batch,), generator=g)})
            continue
        mask = torch.ones(batch, seq, dtype=torch.long)
        for i in range(1, batch):
            mask[i, -min(i, seq - 1):] = 0
        out.append({"input_ids": torch.randint(1, 128, (batch, seq), generator=g),
                    "attention_mask": mask,
                    "labels": torch.randint(1, 128, (batch, seq // 2), generator=g)})
    return out


def optimizer(named_params):
    return torch.optim.AdamW([p for _, p in named_params], lr=1e-3, eps=1e-6)


def train(kind: str, steps: int, batch: int, seq: int, overrides: dict):
    """On every rank: train, then evaluate the first batch."""
    from autoplan import autoparallel

    data = batches(kind, steps, batch, seq)
    model = autoparallel(make_model(kind), global_batch=batch, optimizer=optimizer,
                         **overrides)
    losses = [model.step(b) for b in data]
    loss, out = model.eval_step(data[0], return_outputs=True)
    if dist.get_rank() == 0:
        print(f"{kind} plan: {model.plan}; inputs: {model.inputs.describe()}", flush=True)
    return losses, loss, tuple(out.logits.shape), model.plan.mesh.dp * \
        model.plan.num_microbatches


def one_process(kind: str, steps: int, batch: int, seq: int, parts: int) -> list[float]:
    """The same training on one process: each step's loss the mean of its parts' losses."""
    model = make_model(kind)
    opt = optimizer(model.named_parameters())
    losses = []
    for b in batches(kind, steps, batch, seq):
        opt.zero_grad()
        total = 0.0
        for j in range(parts):
            loss = model(**{k: v.chunk(parts)[j] for k, v in b.items()}).loss / parts
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses


def parse_overrides(items: list[str]) -> dict:
    return {k: int(v) if v.isdigit() else v for k, _, v in (i.partition("=") for i in items)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="global batch (samples)")
    parser.add_argument("--seq", type=int, default=16, help="T5 source tokens per sample")
    parser.add_argument("--overrides", nargs="*", default=["dp=2", "tp=2"],
                        help="planner choices to fix, KEY=VALUE (tp, dp, pp, ...)")
    args = parser.parse_args()
    from autoplan.runtime import LocalCluster

    overrides = parse_overrides(args.overrides)
    ok = True
    with LocalCluster(args.ranks) as cluster:
        for kind in ("t5", "vit"):
            losses, eval_loss, shape, parts = cluster.run(
                train, kind, args.steps, args.batch, args.seq, overrides, timeout_s=1800)[0]
            reference = one_process(kind, args.steps, args.batch, args.seq, parts)
            for step, (a, b) in enumerate(zip(losses, reference), 1):
                close = abs(a - b) <= 1e-5 * abs(b)
                ok &= close
                print(f"{kind} step {step}: {args.ranks} ranks {a:.6f}   one process {b:.6f}"
                      f"{'' if close else '   DIFFERENT'}")
            print(f"{kind} eval_step: loss {eval_loss:.6f}, logits {shape}")
    print("equal to one process (fp32 contract: rtol 1e-5)" if ok else "DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
