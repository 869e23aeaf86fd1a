"""Your own nn.Module and your own loss under `@autoparallel`, checked against one process.

    python examples/own_module.py                 # 4 local CPU ranks, dp=2 x tp=2
    python examples/own_module.py --ranks 2 --overrides tp=2 --steps 5

The model is plain PyTorch: a small pre-norm transformer over bytes (token and position
embeddings, causal self-attention through `F.scaled_dot_product_attention`, a GELU MLP, a
tied output head). The loss is the user's: cross-entropy with label smoothing plus a
z-loss on the log-partition (PaLM, Chowdhery et al. 2022, sec. 5: 1e-4 * log(Z)^2), given as
`loss_fn=(logits, labels) -> scalar`, the mean over one microbatch.

The script trains the model on `--ranks` local gloo ranks (`autoplan.runtime.LocalCluster`)
with the planner's choices fixed by `--overrides` (default dp=2 tp=2; drop them and the solver
chooses), and the same model on one process with the same loss; it prints both losses per
step and exits non-zero if they differ by more than the contract's tolerance (fp32: rtol
1e-5). What autoplan needs from a model: `forward(input_ids)` returns logits
(batch, seq, vocab); it traces with torch.export (no data-dependent Python control flow).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256  # bytes


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class ByteLM(nn.Module):
    """A byte-level language model: forward(input_ids (B, T) int64) -> logits (B, T, 256)."""

    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2, max_seq: int = 128):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok(input_ids) + self.pos(positions)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def smoothed_loss_with_z(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean over the microbatch's tokens of cross-entropy with label smoothing 0.1, plus
    1e-4 * log(Z)^2 (z-loss). logits (B, T, V), labels (B, T) int64."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    ce = F.cross_entropy(flat, labels.reshape(-1), label_smoothing=0.1)
    return ce + 1e-4 * torch.logsumexp(flat, dim=-1).pow(2).mean()


def make_model(seed: int = 0) -> ByteLM:
    torch.manual_seed(seed)
    return ByteLM()


def batches(steps: int, batch: int, seq: int):
    """(input_ids, labels) pairs of bytes of this file, labels the next byte."""
    data = torch.tensor(list(open(__file__, "rb").read()))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g).tolist()
        window = torch.stack([data[s:s + seq + 1] for s in starts])
        yield window[:, :-1], window[:, 1:]


def optimizer(named_params):
    return torch.optim.AdamW([p for _, p in named_params], lr=1e-3, eps=1e-6)


def train(steps: int, batch: int, seq: int, overrides: dict) -> list[float]:
    """On every rank: the model under autoplan with the user's loss."""
    from autoplan import autoparallel

    model = autoparallel(make_model(), global_batch=batch, seq_len=seq, optimizer=optimizer,
                         loss_fn=smoothed_loss_with_z, **overrides)
    losses = [model.step(x, y) for x, y in batches(steps, batch, seq)]
    if dist.get_rank() == 0:
        print(f"plan: {model.plan}", flush=True)
    return losses


def one_process(steps: int, batch: int, seq: int) -> list[float]:
    model = make_model()
    opt = optimizer(model.named_parameters())
    losses = []
    for x, y in batches(steps, batch, seq):
        opt.zero_grad()
        loss = smoothed_loss_with_z(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def parse_overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = int(value) if value.isdigit() else value
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="global batch (samples)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sample")
    parser.add_argument("--overrides", nargs="*", default=["dp=2", "tp=2"],
                        help="planner choices to fix, KEY=VALUE (tp, dp, pp, zero_stage, ...)")
    args = parser.parse_args()
    from autoplan.runtime import LocalCluster

    overrides = parse_overrides(args.overrides)
    with LocalCluster(args.ranks) as cluster:
        planned = cluster.run(train, args.steps, args.batch, args.seq, overrides,
                              timeout_s=1800)[0]
    reference = one_process(args.steps, args.batch, args.seq)
    worst = 0.0
    for step, (a, b) in enumerate(zip(planned, reference), 1):
        worst = max(worst, abs(a - b) / abs(b))
        print(f"step {step}: {args.ranks} ranks {a:.6f}   one process {b:.6f}")
    ok = worst <= 1e-5 and not any(math.isnan(x) for x in planned)
    print(f"largest relative difference {worst:.1e}: {'equal' if ok else 'DIFFERENT'} "
          "(fp32 contract: rtol 1e-5)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
