"""Where a rank's weights come from, and how a full tensor becomes this rank's shard.

[Note: sharded construction] The engine builds every stage on the meta device, applies the
plan (tp placements as DTensors, FSDP2 by ZeRO stage), and only then allocates: `to_empty`
gives each rank exactly its shards, uninitialised. A `WeightSource` then fills them, one full
tensor at a time: the source produces (or reads) a tensor, `fill_shard` copies the part this
rank owns (DTensor's own slicing: `distribute_tensor(..., src_data_rank=None)` cuts locally,
without communication, for any placements FSDP2 and tp compose to) and the full tensor is
dropped. No rank ever holds the model; the peak is its shards plus about one full tensor.

Sources:
- `ModuleWeights`: a model (or state dict) that already holds real weights -- slices of its
  tensors, nothing copied whole.
- `InitReplay`: the model's own construction / init recorded on meta and replayed
  (autoplan.runtime.deferred_init, [Note: RNG contract for initialisation]).
- `HFWeights`: a Hugging Face safetensors checkpoint, each rank reading only its slices
  (autoplan.runtime.hf_checkpoint); buffers (rotary tables) come from an `InitReplay`.
- `PartedWeights`: several of these, each for the tensors it names (a PEFT model: base
  weights from the checkpoint, adapters from their init or an adapter file).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autoplan._torch_compat import local_shard_slices

from autoplan.runtime.deferred_init import InitTrace, module_tensors, module_views, replay

__all__ = ["WeightSource", "Targets", "ModuleWeights", "InitReplay", "HFWeights",
           "PartedWeights", "fill_shard", "weights_to_meta", "allocate", "LostConstantError"]


class Targets:
    """The tensors this rank must fill, by FQN.

    Attributes:
        params: fqn -> this rank's parameters of that name (a tied weight held by two stages of
            this rank has two), plain or DTensor shards, allocated and uninitialised.
        buffers: fqn -> (module, attribute name) pairs whose buffer gets the full tensor.
        device: where the shards live.
    """

    def __init__(self, params: dict[str, list[torch.Tensor]],
                 buffers: dict[str, list[tuple[nn.Module, str]]], device: torch.device):
        self.params = params
        self.buffers = buffers
        self.device = device

    def names(self) -> set[str]:
        return set(self.params) | set(self.buffers)

    def split(self, names: Collection[str] | None) -> tuple["Targets", "Targets"]:
        """(the targets named in `names`, the others); None names them all."""
        if names is None:
            return self, Targets({}, {}, self.device)
        names = set(names)
        mine = Targets({k: v for k, v in self.params.items() if k in names},
                       {k: v for k, v in self.buffers.items() if k in names}, self.device)
        rest = Targets({k: v for k, v in self.params.items() if k not in names},
                       {k: v for k, v in self.buffers.items() if k not in names}, self.device)
        return mine, rest

    def put(self, fqn: str, full: torch.Tensor) -> None:
        """Give every target named `fqn` its part of the full tensor `full`."""
        for p in self.params.get(fqn, ()):
            fill_shard(p, full)
        for module, leaf in self.buffers.get(fqn, ()):
            persistent = leaf not in module._non_persistent_buffers_set
            old = module._buffers[leaf]
            module.register_buffer(leaf, full.detach().to(self.device, old.dtype, copy=True),
                                   persistent=persistent)


@torch.no_grad()
def fill_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` (the whole tensor, global shape) into `param`.

    `param` is a plain tensor (this rank holds it whole) or a DTensor shard (tp placements,
    FSDP2's Shard / _StridedShard on the dp axis); its dtype wins (fp32 master weights from a
    bf16 file, for instance). Raises ValueError when the shapes differ.
    """
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"fill_shard: source shape {tuple(full.shape)} != parameter shape "
                         f"{tuple(param.shape)}")
    full = full.detach().to(param.device)
    if not isinstance(param, DTensor):
        param.copy_(full)
        return
    local = param.to_local()
    if local.numel() == 0:
        return  # FSDP2 gives an empty shard a placeholder shape
    # A view of the full tensor, copied straight into the shard: no shard-sized temporary.
    slices = local_shard_slices(param.shape, param.device_mesh, param.placements)
    local.copy_(full[slices])


class WeightSource(Protocol):
    """Fills a rank's `Targets` (every name in `targets.names()`)."""

    def fill(self, targets: Targets) -> None: ...


class ModuleWeights:
    """Real weights already in memory: a module (its parameters and all buffers, non-persistent
    ones included) or a mapping fqn -> tensor.

    When the ranks were given different weights (an unseeded random init on each rank), rank
    0's are broadcast, one tensor at a time, so that every rank trains one model.
    """

    def __init__(self, source: nn.Module | Mapping[str, torch.Tensor]):
        if isinstance(source, nn.Module):
            tensors = dict(source.named_parameters(remove_duplicate=False))
            tensors.update(source.named_buffers(remove_duplicate=False))
        else:
            tensors = dict(source)
        self.tensors = tensors

    def fill(self, targets: Targets) -> None:
        missing = sorted(n for n in targets.names() if n not in self.tensors)
        if missing:
            raise ValueError(f"the model's weights lack {len(missing)} tensors the plan needs: "
                             f"{missing[:8]}")
        # Every rank walks the same names (the collectives below must match across ranks).
        names = sorted(self.tensors)
        same = _ranks_agree([self.tensors[n] for n in names])
        wanted = targets.names()
        for n in names:
            full = self.tensors[n]
            if not same:
                full = _broadcast(full.detach())
            if n in wanted:
                targets.put(n, full)


def _broadcast(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's `t` on every rank, a new tensor where `t` is (through the collective device:
    NCCL needs CUDA tensors)."""
    from autoplan.runtime.job import comm_device

    buf = t.to(comm_device(), copy=True)
    dist.broadcast(buf, src=0)
    return buf.to(t.device)


def _ranks_agree(tensors: list[torch.Tensor]) -> bool:
    """True when every rank holds the same values (a checksum per tensor, compared)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    sums = torch.stack([t.detach().double().sum() for t in tensors]) if tensors \
        else torch.zeros(1, dtype=torch.float64)
    from autoplan.runtime.job import comm_device

    lo, hi = sums.to(comm_device()), sums.to(comm_device(), copy=True)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


class InitReplay:
    """The model's construction or init, recorded on meta, replayed tensor by tensor.

    Args:
        trace: from `deferred_init.record`.
        module: the meta module the trace built (names its tensors).
        params: fill parameters too (False: only buffers, when weights come from elsewhere).
    """

    def __init__(self, trace: InitTrace, module: nn.Module, *, params: bool = True):
        self.trace = trace
        self.names = module_tensors(module)
        self.views = module_views(module)
        self.buffer_names = {n for n, _ in module.named_buffers(remove_duplicate=False)}
        self.params = params
        self.peak_bytes = 0

    def fill(self, targets: Targets) -> None:
        # Rank 0's generator state for every rank: ranks seeded differently (a per-rank data
        # seed before the factory ran) must still cut their shards from one model.
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.trace.rng_state = _broadcast(self.trace.rng_state)
        want = targets.names() if self.params else set(targets.buffers)
        wanted = {k: [n for n in names if n in want] for k, names in self.names.items()}
        wanted = {k: v for k, v in wanted.items() if v}
        self.peak_bytes = replay(self.trace, wanted, targets.put, device=targets.device,
                                 views=self.views)


class HFWeights:
    """A Hugging Face checkpoint directory (safetensors): parameters read slice by slice;
    buffers from `buffers` (an InitReplay, params=False).

    Args:
        path: the directory (or one .safetensors file).
        buffers: fills the buffers (None: no buffer is asked of this source).
        aliases: fqn -> the name, or names tried in order, that the files may hold it under
            (hf_checkpoint.load_hf_weights).

    Attributes:
        bytes_read: bytes this rank read from the files (after `fill`).
    """

    def __init__(self, path, buffers: WeightSource | None,
                 aliases: Mapping[str, str | Sequence[str]]):
        self.path = path
        self.buffers = buffers
        self.aliases = dict(aliases)
        self.bytes_read = 0

    def fill(self, targets: Targets) -> None:
        from autoplan.runtime.hf_checkpoint import load_hf_weights

        flat = {}
        for fqn, params in targets.params.items():
            for i, p in enumerate(params):
                flat[fqn if i == 0 else f"{fqn}#copy{i}"] = p
        copies = {k: k.split("#")[0] for k in flat if "#" in k}
        first = {k: flat[k] for k in flat if "#" not in k}
        stats = load_hf_weights(self.path, first, aliases=self.aliases)
        self.bytes_read = stats.bytes_read
        for k, fqn in copies.items():
            with torch.no_grad():
                _local(flat[k]).copy_(_local(first[fqn]))
        if self.buffers is not None and targets.buffers:
            self.buffers.fill(Targets({}, targets.buffers, targets.device))


class PartedWeights:
    """Several sources, each filling the targets its names select, in order; the last part's
    names may be None: every target left. A PEFT model's base weights from the base model's
    checkpoint, its adapters from an adapter file or their recorded init, its buffers from the
    init (runtime/construction.py).

    Every part's `fill` runs on every rank, even with nothing to fill there (an InitReplay
    broadcasts its generator state: a collective).

    Attributes:
        bytes_read: bytes this rank read from checkpoint files (after `fill`).
    """

    def __init__(self, parts: Sequence[tuple[Collection[str] | None, WeightSource]]):
        self.parts = list(parts)
        self.bytes_read = 0

    def fill(self, targets: Targets) -> None:
        left = targets
        for names, source in self.parts:
            mine, left = left.split(names)
            source.fill(mine)
        if left.names():
            raise ValueError(f"no weight source for {len(left.names())} tensors: "
                             f"{sorted(left.names())[:8]}")
        self.bytes_read = sum(getattr(s, "bytes_read", 0) for _, s in self.parts)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class LostConstantError(ValueError):
    """A constant the model's code creates (an index list, a tensor from a Python number) was
    captured without its value: the graph cannot compute what the model does."""


def weights_to_meta(gm: torch.fx.GraphModule, master_dtype: torch.dtype | None,
                    frozen_dtype: torch.dtype | None = None) -> None:
    """Every parameter of `gm` becomes a meta tensor of its shape (in `master_dtype` when
    given: fp32 masters of a 16-bit graph; a frozen one, `requires_grad=False`, in
    `frozen_dtype` when given: the compute dtype, [Note: precision recipe]), and every buffer
    not owned by the graph (lifted constants keep their captured values) a meta tensor;
    nothing is allocated.

    Raises LostConstantError for a lifted constant that is itself a meta tensor: no weight
    source has its value, and building on would leave uninitialised memory in its place
    (Falcon trained on NaN so); see [Note: lifted constants on meta] in
    autoplan/capture/constants.py."""
    lost = [fqn for fqn, b in gm.named_buffers()
            if fqn.rpartition(".")[2].startswith("lifted_tensor") and b.is_meta]
    if lost:
        raise LostConstantError(
            f"{len(lost)} constant(s) that the model's code creates were captured on the meta "
            f"device without their values: {lost[:4]} (used by "
            f"{_users(gm, lost[0])}); capture the model with real fp32 weights (pass the "
            "model instance) or trace it inside autoplan.capture.constants.fake_cpu")
    for fqn, p in list(gm.named_parameters()):
        owner_path, _, leaf = fqn.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        dtype = p.dtype
        if p.is_floating_point():
            held = frozen_dtype if not p.requires_grad else None
            dtype = held or master_dtype or p.dtype
        owner._parameters[leaf] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta"),
                                               requires_grad=p.requires_grad)
    for fqn, b in list(gm.named_buffers()):
        if fqn.rpartition(".")[2].startswith("lifted_tensor") and not b.is_meta:
            continue
        owner_path, _, leaf = fqn.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        owner._buffers[leaf] = torch.empty(b.shape, dtype=b.dtype, device="meta")


def _users(gm: torch.fx.GraphModule, fqn: str) -> str:
    """The ops that read attribute `fqn` and the model code they came from, briefly."""
    out = []
    for node in gm.graph.find_nodes(op="get_attr", target=fqn):
        for user in node.users:
            line = (user.meta.get("stack_trace") or "").strip().splitlines()[-1:]
            out.append(f"{user.target}" + (f" at `{line[0].strip()}`" if line else ""))
    return ", ".join(out) or "no op"


def allocate(module: nn.Module, device: torch.device) -> None:
    """Allocate the (sharded) parameters on `device`, uninitialised (FSDP2 re-points its
    sharded parameters under `to_empty`); buffers stay as they are: meta ones are filled by
    the weight source, real ones (lifted constants) keep their values."""
    buffers = [(m, name, b) for m in module.modules() for name, b in m._buffers.items()]
    module.to_empty(device=device)
    for m, name, b in buffers:
        m._buffers[name] = b
