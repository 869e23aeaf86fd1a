"""The keyed random ops: what the graph pass and the eager mode of autoplan/passes/rng.py put in
place of torch's random ops, and the state they read. Every value is drawn as a function of
(seed, step, k, b, position in the row) ([Note: RNG contract] in autoplan/passes/rng.py): per-row
CPU generators seeded with `sample_seed`, the rank keeping the part of each row it holds. A draw
that holds no samples (rows_per_sample 0) keys its rows by their index alone: every rank and
every microbatch draws the values one process draws once.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx
from torch.distributed.tensor import DTensor

from autoplan._torch_compat import local_shard_offset
from autoplan.passes.sharding import sdpa_local

__all__ = ["RandomState", "RandomOp", "sample_seed", "check_p", "keyed_dropout",
           "keyed_native_dropout", "keyed_bernoulli", "keyed_bernoulli_", "keyed_rand_like",
           "keyed_rand", "keyed_bernoulli_tensor", "keyed_bernoulli_tensor_", "keyed_sdpa",
           "random_ops_eager"]

aten = torch.ops.aten


class RandomState(torch.nn.Module):
    """Where a stage is in training, as the random ops of [Note: RNG contract] read it.

    Mutable on purpose: one instance lives on each stage GraphModule (`gm.random_state`, read by
    a get_attr node) and the engine moves it on per step and per microbatch, while the graph
    stays the same. Checkpointed blocks `snapshot()` it at forward time and `restore()` it around
    the recompute (autoplan/passes/checkpointing.py). An nn.Module only so that the get_attr
    node targets a submodule, as FX expects (lint warns on any other attribute); it holds no
    parameters or buffers.

    Attributes:
        seed: the run's seed.
        step: the training step (optimizer step), from 0.
        sample_offset: global sample index of local row 0 of the microbatch now running on this
            rank, before any tp batch sharding: dp_rank * local_batch + microbatch * mb_size.
        drawing: False while evaluating: dropout and attention dropout keep everything, as
            `model.eval()` makes them (other random ops still draw).
    """

    def __init__(self, seed: int, step: int = 0, sample_offset: int = 0):
        super().__init__()
        self.seed, self.step, self.sample_offset = seed, step, sample_offset
        self.drawing = True  # False: evaluation, dropout is the identity (as in model.eval())

    def extra_repr(self) -> str:
        return f"seed={self.seed}, step={self.step}, sample_offset={self.sample_offset}"

    def snapshot(self) -> tuple[int, int, int]:
        """(seed, step, sample_offset) now."""
        return (self.seed, self.step, self.sample_offset)

    def restore(self, snap: tuple[int, int, int]) -> None:
        """Go back to a `snapshot()`."""
        self.seed, self.step, self.sample_offset = snap


@dataclasses.dataclass(frozen=True)
class RandomOp:
    """How a random op of the captured graph is keyed ([Note: RNG contract]).

    Attributes:
        k: its index among the random ops of the full graph, in topological order.
        rows_per_sample: R, rows of its input's dim 0 per sample (1 for a (B, ...) input,
            T for a (B*T, C) one); 0 for a draw that holds no samples (a (C,) noise broadcast
            over the batch, a dropout of a weight): its rows are keyed by their index alone.
    """

    k: int
    rows_per_sample: int = 1

    def __str__(self) -> str:
        return f"k={self.k}" + (f" R={self.rows_per_sample}" if self.rows_per_sample != 1 else "")


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # SplitMix64 (Steele, Lea, Flood, "Fast splittable pseudorandom number generators",
    # OOPSLA 2014); constants from Vigna's splitmix64.c (prng.di.unimi.it).
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample_seed(seed: int, step: int, k: int, b: int) -> int:
    """The 63-bit generator seed of sample b of random op k at `step`: h = 0, then
    h = splitmix64(h XOR v) for v in (seed, step, k, b) (each taken mod 2**64), then h >> 1.
    Pure Python ints, so every rank and device computes the same number."""
    h = 0
    for v in (seed, step, k, b):
        h = _splitmix64(h ^ (v & _MASK64))
    return h >> 1


def _draw(state: RandomState, k: int, global_shape, offset, local_shape,
          normal: bool = False, rows_per_sample: int = 1) -> torch.Tensor:
    """Keyed values of the block `local_shape` at `offset` of a `global_shape` tensor whose
    dim 0 holds `rows_per_sample` rows per sample (0: no samples, the same rows for every
    sample_offset): float32 on the CPU, uniform [0, 1) or standard normal."""
    sample_shape = tuple(global_shape[1:])
    index = tuple(slice(o, o + n) for o, n in zip(offset[1:], local_shape[1:]))
    whole = tuple(local_shape[1:]) == sample_shape
    out = torch.empty(tuple(local_shape), dtype=torch.float32)
    draw = torch.randn if normal else torch.rand
    first = state.sample_offset * rows_per_sample + offset[0]  # global row of local row 0
    for i in range(local_shape[0]):
        gen = torch.Generator().manual_seed(sample_seed(state.seed, state.step, k, first + i))
        values = draw(sample_shape, generator=gen, dtype=torch.float32)
        out[i] = values if whole else values[index]
    return out


def _split(x: torch.Tensor, op: str):
    """(local tensor, global shape, global offset of the local block) of a plain tensor (the
    whole tensor, offset 0) or a DTensor (its shard)."""
    if x.dim() == 0:
        raise ValueError(f"{op}: input is 0-d; the RNG contract keys dim 0 as the batch dim")
    if not isinstance(x, DTensor):
        return x, tuple(x.shape), (0,) * x.dim()
    if any(p.is_partial() for p in x.placements):
        raise ValueError(
            f"{op}: input has placements {tuple(x.placements)}; reduce the Partial first (the "
            "dropout of a partial sum is not the dropout of the sum)")
    local_shape, offset = local_shard_offset(x.shape, x.device_mesh, x.placements)
    local = x.to_local()
    assert tuple(local.shape) == local_shape, (op, local.shape, local_shape)
    return local, tuple(x.shape), offset


def _like(local: torch.Tensor, x: torch.Tensor, shape=None, stride=None) -> torch.Tensor:
    """`local` as the same kind of tensor as `x` (a DTensor with x's placements)."""
    if not isinstance(x, DTensor):
        return local
    return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False,
                              shape=x.shape if shape is None else shape,
                              stride=x.stride() if stride is None else stride)


def check_p(p: float, name: str, op: str) -> None:
    if not isinstance(p, (int, float)) or not 0 <= p <= 1:
        raise ValueError(f"{op}: {name}={p!r} must be a number in [0, 1]")


class _Dropped(torch.autograd.Function):
    """x * keep / (1 - p) in x's dtype (aten's CPU dropout arithmetic), saving the bool
    `keep` (1 byte per element, as aten's native_dropout does) instead of the scaled mask in
    x's dtype that autograd's mul would save ([Note: saved tensors] in cost_model/activations.py
    prices 1 byte). The gradient is grad * (keep / (1 - p)), mul's own."""

    @staticmethod
    def forward(ctx, x, keep, p):
        ctx.save_for_backward(keep)
        ctx.p = p
        return x * keep.to(x.dtype).div_(1 - p)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * keep.to(grad.dtype).div_(1 - ctx.p), None, None


def _keep(state: RandomState, x: torch.Tensor, q: float, k: int, op: str, rows: int):
    """(local tensor, bool mask `u < q` of the local block: True with probability q)."""
    local, shape, offset = _split(x, op)
    u = _draw(state, k, shape, offset, local.shape, rows_per_sample=rows)
    return local, (u < q).to(local.device)


def keyed_dropout(state: RandomState, x: torch.Tensor, p: float, train: bool,
                  k: int, *, rows_per_sample: int = 1) -> torch.Tensor:
    """aten.dropout under [Note: RNG contract]: x * keep / (1 - p), keep ~ Bernoulli(1 - p).

    Args:
        state: seed, step and the global sample of local row 0.
        x: (B * R, ...) plain tensor (row r is global row state.sample_offset * R + r) or
            DTensor at Replicate / Shard(d) on its mesh (global shape (B * R, ...)).
        p: drop probability in [0, 1]; train: False is the identity.
        k: the op's index (`random_op_indices`); rows_per_sample: R.
    Returns the same kind of tensor as x (same placements); differentiable in x.

    Raises:
        ValueError: p outside [0, 1], a 0-d x, or a Partial placement.
    """
    check_p(p, "p", "dropout")
    if not train or p == 0 or not state.drawing:
        return x
    if p == 1:
        return x * 0  # what aten's dropout returns for p == 1 (no draws)
    local, keep = _keep(state, x, 1 - p, k, "dropout", rows_per_sample)
    return _like(_Dropped.apply(local, keep, p), x)


def keyed_native_dropout(state: RandomState, x: torch.Tensor, p: float, train: bool | None,
                         k: int, *, rows_per_sample: int = 1
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """aten.native_dropout under [Note: RNG contract]: (keyed_dropout's output, bool keep mask),
    both of x's kind. Cases that draw nothing (train False, p in {0, 1}) run aten's own op.
    Raises ValueError like `keyed_dropout`."""
    check_p(p, "p", "native_dropout")
    if train is False or p in (0, 1) or not state.drawing:
        return aten.native_dropout.default(x, p, train and state.drawing)
    local, keep = _keep(state, x, 1 - p, k, "native_dropout", rows_per_sample)
    return (_like(_Dropped.apply(local, keep, p), x),
            _like(keep, x, stride=x.stride()))


def keyed_bernoulli(state: RandomState, x: torch.Tensor, p: float, k: int, *,
                    rows_per_sample: int = 1) -> torch.Tensor:
    """aten.bernoulli.p under [Note: RNG contract]: `u < p` in x's dtype, x's shape and kind.
    Raises ValueError for p outside [0, 1], a 0-d x or a Partial x."""
    check_p(p, "p", "bernoulli")
    local, keep = _keep(state, x, p, k, "bernoulli", rows_per_sample)
    return _like(keep.to(local.dtype), x)


def keyed_bernoulli_(state: RandomState, x: torch.Tensor, p: float, k: int, *,
                     rows_per_sample: int = 1) -> torch.Tensor:
    """aten.bernoulli_.float under [Note: RNG contract]: fills x in place, returns x."""
    return x.copy_(keyed_bernoulli(state, x, p, k, rows_per_sample=rows_per_sample))


def keyed_rand_like(state: RandomState, x: torch.Tensor, k: int, *, normal: bool = False,
                    dtype: torch.dtype | None = None, rows_per_sample: int = 1) -> torch.Tensor:
    """aten.rand_like (normal=False) / randn_like (normal=True) under [Note: RNG contract]:
    drawn in float32, cast to `dtype` (default x's), x's shape, device and kind."""
    op = "randn_like" if normal else "rand_like"
    local, shape, offset = _split(x, op)
    values = _draw(state, k, shape, offset, local.shape, normal=normal,
                   rows_per_sample=rows_per_sample)
    return _like(values.to(device=local.device, dtype=dtype or local.dtype), x)


def keyed_rand(state: RandomState, size, k: int, *, normal: bool = False,
               dtype: torch.dtype | None = None, device=None,
               rows_per_sample: int = 1) -> torch.Tensor:
    """aten.rand (normal=False) / randn (normal=True) of `size` under [Note: RNG contract]: a
    plain tensor (a graph constant on every rank: the whole draw), drawn in float32 on the
    CPU, cast to `dtype` (default: torch's default dtype) on `device`. Stochastic depth draws
    (B, 1, ..., 1): one value per sample, keyed by the sample.

    Raises:
        ValueError: a 0-d `size` (dim 0 is the one keyed).
    """
    size = tuple(int(s) for s in size)
    if not size:
        raise ValueError(f"{'randn' if normal else 'rand'}: size () is 0-d; the RNG contract "
                         "keys dim 0 as the batch dim")
    values = _draw(state, k, size, (0,) * len(size), size, normal=normal,
                   rows_per_sample=rows_per_sample)
    return values.to(device=device, dtype=dtype or torch.get_default_dtype())


def keyed_bernoulli_tensor(state: RandomState, p: torch.Tensor, k: int, *,
                           rows_per_sample: int = 1) -> torch.Tensor:
    """aten.bernoulli.default (`torch.bernoulli(p)`, p a tensor of probabilities in [0, 1])
    under [Note: RNG contract]: `u < p` in p's dtype, shape and kind. Raises ValueError like
    `keyed_bernoulli` for a 0-d or Partial p."""
    local, shape, offset = _split(p, "bernoulli")
    u = _draw(state, k, shape, offset, local.shape, rows_per_sample=rows_per_sample)
    return _like((u.to(local.device) < local).to(local.dtype), p)


def keyed_bernoulli_tensor_(state: RandomState, x: torch.Tensor, p: torch.Tensor, k: int, *,
                            rows_per_sample: int = 1) -> torch.Tensor:
    """aten.bernoulli_.Tensor (`x.bernoulli_(p)`, p a tensor of probabilities broadcastable to
    x's local block: its own block where it is a DTensor) under [Note: RNG contract]: fills x
    with `u < p`, in place, returns x. Raises ValueError like `keyed_bernoulli`."""
    local, shape, offset = _split(x, "bernoulli_")
    u = _draw(state, k, shape, offset, local.shape, rows_per_sample=rows_per_sample)
    probs = p.to_local() if isinstance(p, DTensor) else p
    local.copy_(u.to(local.device) < probs)
    return x


def _local_mask(mask, query, local_shape, offset):
    """The part of `mask` (broadcastable to the scores (B, H, T, S)) that the local q sees."""
    if mask is None:
        return None
    if isinstance(mask, DTensor):
        if mask.placements == query.placements:
            return mask.to_local()
        if not all(p.is_replicate() for p in mask.placements):
            raise ValueError(
                f"scaled_dot_product_attention: attn_mask at {tuple(mask.placements)} with q "
                f"at {tuple(query.placements)}; give it q's placements or Replicate")
        mask = mask.to_local()
    lead = query.dim() - mask.dim()  # the mask's dims align with q's from the right
    for d in range(query.dim() - 2):
        md = d - lead
        if md >= 0 and mask.shape[md] != 1 and local_shape[d] != query.shape[d]:
            mask = mask.narrow(md, offset[d], local_shape[d])
    return mask


def _attention_probs(q, k, mask, is_causal: bool, scale, enable_gqa: bool) -> torch.Tensor:
    """softmax(q k^T * scale + mask) as torch's math SDPA computes it: q and k^T each scaled by
    sqrt(|scale|) (torch's `_scaled_dot_product_attention_math`, for stability), a bool mask
    sets -inf where False, softmax in float32 with fully masked rows set to 0 (torch's
    `_safe_softmax`), cast back to q's dtype. Formula: F.scaled_dot_product_attention docs.
    (b, h, L, E) x (b, h|hk, S, E) -> (b, h, L, S)."""
    L, S = q.size(-2), k.size(-2)
    scale = 1 / math.sqrt(q.size(-1)) if scale is None else scale
    if enable_gqa:
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
    if is_causal:
        if mask is not None:
            raise ValueError("scaled_dot_product_attention: is_causal=True with an attn_mask")
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
    root = math.sqrt(abs(scale))
    scores = (q * math.copysign(root, scale)) @ (k.transpose(-2, -1) * root)  # (b, h, L, S)
    if mask is not None:
        scores = (scores.masked_fill(mask.logical_not(), float("-inf"))
                  if mask.dtype == torch.bool else scores + mask)
    probs = torch.softmax(scores.float(), dim=-1)
    if mask is not None:
        probs = probs.masked_fill(scores.eq(float("-inf")).all(-1, keepdim=True), 0.0)
    return probs.to(q.dtype)


def _dropped_attention(q, k, v, mask, keep, p: float, is_causal: bool, scale,
                       enable_gqa: bool) -> torch.Tensor:
    """(softmax(q k^T * scale + mask) * keep / (1 - p)) @ v as torch's math SDPA computes it
    (`_attention_probs`), `keep` the bool mask of the kept probabilities."""
    probs = _attention_probs(q, k, mask, is_causal, scale, enable_gqa)
    probs = probs * keep.to(probs.dtype).div_(1 - p)
    if enable_gqa:
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    return probs @ v


class _DroppedAttention(torch.autograd.Function):
    """`_dropped_attention` saving q, k, v, the mask and the bool `keep` (1 byte per
    score), and recomputing the probabilities in its backward, as fused attention does
    (FlashAttention recomputes them from q, k and its dropout seed): autograd through the math
    path would save the fp32 probabilities, the scaled mask and the dropped probabilities,
    4 + 2 w bytes per score, which [Note: saved tensors] in cost_model/activations.py does not
    price. The gradients are the math path's own (the same ops, run again under autograd)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, keep, p, is_causal, scale, enable_gqa):
        ctx.save_for_backward(q, k, v, mask, keep)
        ctx.args = (p, is_causal, scale, enable_gqa)
        return _dropped_attention(q, k, v, mask, keep, p, is_causal, scale, enable_gqa)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, keep = ctx.saved_tensors
        # an additive mask is differentiable (T5's relative position bias trains through it)
        needs = ctx.needs_input_grad[:4]
        inputs = [None if t is None else t.detach().requires_grad_(n)
                  for t, n in zip((q, k, v, mask), needs)]
        with torch.enable_grad():
            out = _dropped_attention(*inputs, keep, *ctx.args)
        wanted = [t for t, n in zip(inputs, needs) if n]
        grads = iter(torch.autograd.grad(out, wanted, grad_out) if wanted else ())
        return (*(next(grads) if n else None for n in needs),
                None, None, None, None, None)


def keyed_sdpa(state: RandomState, query, key, value, attn_mask=None, dropout_p: float = 0.0,
               is_causal: bool = False, k: int = 0, *, scale: float | None = None,
               enable_gqa: bool = False, rows_per_sample: int = 1) -> torch.Tensor:
    """aten.scaled_dot_product_attention with attention dropout under [Note: RNG contract].

    Args:
        query: (B, H, T, E); key, value: (B, Hk, S, E), (B, Hk, S, Ev) -- plain tensors or
            DTensors with one common placement, Replicate or Shard(d) of a batch or head dim.
        attn_mask: bool (True = attend) or additive, broadcastable to (B, H, T, S); a plain
            mask is sliced like q along sharded dims where its size is not 1.
        dropout_p: in [0, 1]; outside (0, 1) nothing is drawn and `sdpa_local` runs.
        k: the op's index; rows_per_sample: R of [Note: RNG contract] (B * R rows in q's
            dim 0). scale, enable_gqa, is_causal: as in torch.
    Returns (B, H, T, Ev) of q's kind and placements; differentiable in q, k, v and an
        additive mask.

    Raises:
        ValueError: dropout_p outside [0, 1]; q, k, v placements that differ, are Partial or
            shard T, S or E; is_causal with a mask; a mask at another placement.
    """
    op = "scaled_dot_product_attention"
    check_p(dropout_p, "dropout_p", op)
    if not state.drawing:
        dropout_p = 0.0
    if not 0 < dropout_p < 1:
        return sdpa_local(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                          enable_gqa=enable_gqa)
    if isinstance(query, DTensor):
        places = tuple(query.placements)
        bad = [p for p in places if p.is_partial() or (p.is_shard()
                                                       and p.dim % query.dim() >= query.dim() - 2)]
        if bad or tuple(key.placements) != places or tuple(value.placements) != places:
            raise ValueError(
                f"{op}: q, k, v at {places}, {tuple(key.placements)}, "
                f"{tuple(value.placements)}; keyed attention dropout needs one common "
                "placement, Replicate or Shard of a batch or head dim")
    q, shape, offset = _split(query, op)
    kl, vl = (key.to_local(), value.to_local()) if isinstance(key, DTensor) else (key, value)
    S = key.shape[-2]
    u = _draw(state, k, (*shape[:-1], S), (*offset[:-1], 0), (*q.shape[:-1], S),
              rows_per_sample=rows_per_sample)
    keep = (u < 1 - dropout_p).to(q.device)  # (b, h, T, S) local, bool
    del u
    out = _DroppedAttention.apply(q, kl, vl, _local_mask(attn_mask, query, q.shape, offset),
                                  keep, dropout_p, is_causal, scale, enable_gqa)  # (b, h, T, Ev)
    global_shape = torch.Size((*shape[:-1], value.shape[-1]))
    stride = torch.empty(global_shape, device="meta").stride()  # contiguous, like `out`
    return _like(out, query, shape=global_shape, stride=stride)


def random_ops_eager(gm: torch.fx.GraphModule) -> None:
    """Point every call of a keyed random op ([Note: RNG contract]) in `gm` and its
    sub-GraphModules at a wrapper torch.compile runs eagerly (in place; recompiles). Each op
    draws from per-row CPU generators keyed by a mutable RandomState: traced, its step and
    sample offset would be constants guarded on, and every step would compile again ([Note:
    compiled stages] in runtime/compiled.py). Run before `install_blocks` and
    `wrap_checkpointing` (they move the calls into block modules and bind their forwards)."""
    keyed = {globals()[name] for name in __all__ if name.startswith("keyed_")}
    eager = {fn: torch.compiler.disable(fn) for fn in keyed}
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        found = [n for n in module.graph.nodes if n.op == "call_function" and n.target in eager]
        for node in found:
            node.target = eager[node.target]
        if found:
            module.recompile()
