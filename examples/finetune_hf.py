"""Fine-tune a Hugging Face causal LM from a local checkpoint on N ranks, then save it back as
a checkpoint that `transformers` loads.

    python examples/finetune_hf.py                          # writes a tiny random Llama first
    python examples/finetune_hf.py --checkpoint DIR --ranks 4 --steps 50 --seq 256
    torchrun --nproc_per_node 4 examples/finetune_hf.py --checkpoint DIR   # a real job

DIR holds `config.json` and `model.safetensors` (or sharded `model-0000k-of-0000n.safetensors`
and their index), as `save_pretrained` writes them; nothing is downloaded. Without
`--checkpoint` the script writes a tiny random Llama (byte-level vocabulary, 2 layers) to
`OUT/initial` with `save_pretrained` and fine-tunes that.

What it shows. `autoplan.from_pretrained(DIR, ...)` builds the model from `DIR/config.json` on
the meta device, plans it for the job's ranks, and each rank reads only the slices of the
weights its shards hold. The training text is bytes (ids 0-255) of this file and its
neighbours, so no tokenizer is needed; with a real model, feed your tokenizer's ids instead
(`batches`). After training, `save_pretrained(OUT/finetuned)` writes a consolidated checkpoint
(tensor by tensor) and rank 0 checks that `AutoModelForCausalLM.from_pretrained` reads it.

Outside torchrun the script starts `--ranks` local CPU ranks itself (gloo,
`autoplan.runtime.LocalCluster`); under torchrun each process is one rank.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def write_tiny_checkpoint(path: Path) -> Path:
    """A random Llama with a byte-level vocabulary (256), 2 layers, width 64, written by
    `save_pretrained` (config.json + model.safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def batches(steps: int, batch: int, seq: int, vocab: int):
    """`steps` (input_ids, labels) pairs, each (batch, seq) int64: windows of the bytes of the
    example scripts (ids below 256, so below any vocabulary of 256 or more), labels the next
    byte. The same on every rank, as `model.step` requires."""
    data = torch.tensor(list(b"".join(p.read_bytes() for p in sorted(HERE.glob("*.py")))))
    data = data % vocab
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        window = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def finetune(checkpoint: str, out: str, steps: int, batch: int, seq: int) -> list[float]:
    """On every rank: load, train `steps` steps, save; returns the losses."""
    import torch.distributed as dist

    import autoplan

    model = autoplan.from_pretrained(checkpoint, global_batch=batch, seq_len=seq,
                                     cluster="local-cpu")
    vocab = model.module.config.vocab_size
    losses = []
    for input_ids, labels in batches(steps, batch, seq, vocab):
        losses.append(model.step(input_ids, labels))
        if dist.get_rank() == 0:
            print(f"step {len(losses)}: loss {losses[-1]:.4f}  ({model.metrics.tokens_per_s:.0f} "
                  f"tokens/s)", flush=True)
    if dist.get_rank() == 0:
        print(f"plan: {model.plan}", flush=True)
    model.save_pretrained(Path(out) / "finetuned")
    return losses


def check_saved(out: str) -> None:
    """The fine-tuned checkpoint loads with plain transformers and predicts."""
    from transformers import AutoModelForCausalLM

    path = Path(out) / "finetuned"
    loaded = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.arange(16).unsqueeze(0)
    logits = loaded(ids, use_cache=False).logits
    print(f"{path} loads with transformers: logits {tuple(logits.shape)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="HF checkpoint directory (default: write a tiny "
                                             "random one to OUT/initial)")
    parser.add_argument("--out", default="out/finetune", help="where checkpoints go")
    parser.add_argument("--ranks", type=int, default=2, help="local ranks outside torchrun")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="global batch (samples)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sample")
    args = parser.parse_args()
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = str(Path(args.out) / "initial")
        if not under_torchrun or os.environ["RANK"] == "0":
            write_tiny_checkpoint(Path(checkpoint))
            print(f"wrote a tiny random Llama to {checkpoint}")
        if under_torchrun:  # the other ranks wait until rank 0 wrote it
            import torch.distributed as dist

            from autoplan.runtime.job import join
            join()  # torchrun's process group, as @autoparallel would join it
            dist.barrier()
    if under_torchrun:
        losses = finetune(checkpoint, args.out, args.steps, args.batch, args.seq)
        if os.environ["RANK"] == "0":
            check_saved(args.out)
        return
    from autoplan.runtime import LocalCluster

    with LocalCluster(args.ranks) as cluster:
        losses = cluster.run(finetune, checkpoint, args.out, args.steps, args.batch, args.seq,
                             timeout_s=1800)[0]
    print(f"losses: {' '.join(f'{x:.4f}' for x in losses)}")
    check_saved(args.out)


if __name__ == "__main__":
    main()
