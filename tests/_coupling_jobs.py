"""Models of the batch-coupling audit ([Note: batch coupling] in autoplan/batch_coupling.py) and of
the keyed per-sample draws ([Note: RNG contract]), and the job that trains one on the ranks of a
gloo cluster or on one process (tests/test_batch_coupling.py, tests/test_rng.py).

Each model takes a batch {"x": (B, T, 8), "labels": (B,)} and returns its own loss, the mean
cross-entropy of its (B, 10) logits; `train` steps AdamW (autoplan.testing.adamw) on it, random
ops keyed by autoplan.testing.SEED on both sides."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MODELS", "batch", "train", "swin", "swin_batches"]


class _Net(nn.Module):
    """Linear(8, 16) -> ReLU -> `mix` (the part under test) -> Linear(16, 10), mean over T."""

    def __init__(self):
        super().__init__()
        self.a, self.c = nn.Linear(8, 16), nn.Linear(16, 10)

    def mix(self, h):  # (B, T, 16)
        return h

    def forward(self, x, labels):
        h = self.mix(torch.relu(self.a(x)))  # (B, T, 16)
        return F.cross_entropy(self.c(h).mean(1), labels)


class TimmDropPath(nn.Module):
    """Stochastic depth as timm writes it: `x.new_empty((B, 1, 1)).bernoulli_(keep)`."""

    def __init__(self, drop_prob: float):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        keep = 1 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask.div_(keep)


class DropPath(_Net):
    """Residual blocks with stochastic depth: HF Swin's SwinDropPath (`torch.rand((B, 1, 1))`,
    floor), timm's (bernoulli_ of a new (B, 1, 1) tensor) and `torch.bernoulli` of a tensor
    of probabilities, 0.5 each."""

    def __init__(self):
        super().__init__()
        from transformers.models.swin.modeling_swin import SwinDropPath

        self.b1, self.b2, self.b3 = (nn.Linear(16, 16) for _ in range(3))
        self.swin, self.timm = SwinDropPath(0.5), TimmDropPath(0.5)

    def mix(self, h):
        h = h + self.swin(self.b1(h))
        h = h + self.timm(self.b2(h))
        keep = torch.bernoulli(torch.full((h.shape[0], 1, 1), 0.5, device=h.device))
        return h + self.b3(h) * keep * 2


class Noise(_Net):
    """Draws without samples: (16,) noise added to every sample, and dropout of a weight
    (DropConnect)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 16)

    def mix(self, h):
        h = h + 0.1 * torch.randn(16, device=h.device)
        return h + F.linear(h, F.dropout(self.w.weight, 0.3), self.w.bias)


class BatchNorm(_Net):
    """BatchNorm1d over the channels, in training mode (its running statistics too)."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(16)

    def mix(self, h):
        return self.bn(h.transpose(1, 2)).transpose(1, 2)


class EvalBatchNorm(BatchNorm):
    """BatchNorm1d in eval mode: each sample normalised by the running statistics."""

    def __init__(self):
        super().__init__()
        self.bn.eval()


class Ema(_Net):
    """A buffer of the activations' running mean over the batch, updated in forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(16))

    def mix(self, h):
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean((0, 1)))
        return h


class Counter(_Net):
    """A buffer counting the forwards, updated in place and read by forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def mix(self, h):
        self.calls.add_(1)
        return h * (1 + 0.1 * self.calls)


class Centered(_Net):
    """Activations centred by their mean over the batch."""

    def mix(self, h):
        return h - h.mean(0, keepdim=True)


class BroadcastNoise(_Net):
    """(1, T, 16) noise broadcast over the samples."""

    def mix(self, h):
        return h + 0.1 * torch.randn(1, h.shape[1], 16, device=h.device)


def swin():
    """A tiny Hugging Face Swin (2 stages of 2 blocks, 32 x 32 images) with stochastic depth
    0.3: a factory for autoplan.testing (build on torch's default device)."""
    import transformers

    config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2],
                                     num_heads=[2, 2], window_size=4, drop_path_rate=0.3,
                                     num_labels=10)
    return transformers.SwinForImageClassification(config)


def swin_batches(steps: int = 3) -> list[dict]:
    """Seeded image batches for `swin`: pixel_values (4, 3, 32, 32), labels (4,)."""
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1 + step)
        out.append({"pixel_values": torch.randn(4, 3, 32, 32, generator=g),
                    "labels": torch.randint(0, 10, (4,), generator=g)})
    return out


MODELS = {m.__name__: m for m in (DropPath, Noise, BatchNorm, EvalBatchNorm, Ema, Counter,
                                  Centered, BroadcastNoise)}


def batch(step: int, size: int = 4) -> dict:
    g = torch.Generator().manual_seed(1 + step)
    return {"x": torch.randn(size, 6, 8, generator=g),
            "labels": torch.randint(0, 10, (size,), generator=g)}


def train(name: str, overrides: dict | None, steps: int = 3):
    """MODELS[name] trained `steps` AdamW steps: planned with `overrides` on this job's ranks,
    or on one process (None), random ops keyed by (SEED, step) either way. Returns (losses,
    parameters by FQN, buffers by FQN, the plan as JSON or None)."""
    from torch.distributed.tensor import DTensor

    from autoplan import testing
    from autoplan.passes.rng import keyed_random_ops

    torch.manual_seed(testing.SEED)
    model = MODELS[name]()
    if overrides is None:
        opt = testing.adamw(model.parameters())
        losses = []
        for step in range(steps):
            opt.zero_grad()
            b = batch(step)
            with keyed_random_ops(testing.SEED, step=step):
                loss = model(**b)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return (losses, {k: v.detach().clone() for k, v in model.named_parameters()},
                {k: v.clone() for k, v in model.named_buffers()}, None)
    from autoplan.api import autoparallel

    ap = autoparallel(model, global_batch=4, example_batch=batch(0), seed=testing.SEED,
                      optimizer=testing.adamw, loss_fn=lambda out, b: out, **overrides)
    losses = [ap.step(batch(step)) for step in range(steps)]
    buffers = {fqn: (b.full_tensor() if isinstance(b, DTensor) else b).clone()
               for _, stage in ap._engine.stages for fqn, b in stage.named_buffers()}
    return losses, ap.state_dict(), buffers, ap.plan.to_json()
