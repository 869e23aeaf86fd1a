"""Hugging Face checkpoints (safetensors) in and out of a model sharded across ranks.

`load_hf_weights` (autoplan/runtime/hf_load.py, re-exported here) fills this rank's parameters,
reading from the files only the block each shard covers.

`save_hf_weights` writes one consolidated checkpoint that `from_pretrained` loads: every tensor
is gathered (`DTensor.full_tensor()`) to the rank that writes it, streamed into its file and
dropped, so no rank holds more than its shards plus one full tensor (plus a write buffer of at
most `_CHUNK_BYTES`). Files are written in the safetensors format directly, tensor by tensor
(the safetensors library only writes from a dict that holds a whole file in memory):

    [8 bytes: N, little-endian u64][N bytes: JSON header, space-padded][raw tensor bytes]

header = {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
"__metadata__": {"format": "pt"}}, offsets relative to the first data byte, data little-endian
and C-contiguous (https://github.com/huggingface/safetensors, README "Format"). Several files
are indexed by `model.safetensors.index.json` (`{"metadata": {"total_size": ...},
"weight_map": {name: file}}`), as `transformers` writes them.

[Note: atomic HF save] Files go to a sibling `{path}.tmp-{token}`; a gather of every rank's
status (it doubles as the barrier) tells rank 0 whether all files are complete; only then does
it move the directory to `path` (replacing an old one after the new one is complete) and tell
the others. A failure on any rank -- including a write error, after which that rank still takes
part in the remaining gathers so nobody hangs -- removes the temporary directory and raises on
every rank; a crashed process leaves at most a `*.tmp-*` sibling, never a partial `path`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autoplan.runtime.hf_load import (INDEX_FILE, SAFETENSORS_DTYPES, SINGLE_FILE, LoadStats,
                                       checkpoint_dtypes, load_hf_weights)

__all__ = ["HFTensor", "LoadStats", "checkpoint_dtypes", "load_hf_weights", "save_hf_weights",
           "save_pretrained", "plan_hf_files"]

_CHUNK_BYTES = 64 * 2**20  # write buffer: a tensor is converted and written in pieces this big


# --- saving ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class HFTensor:
    """One tensor of a checkpoint to write.

    Attributes:
        fqn: its name in the files (the HF state-dict key).
        shape: global shape.
        dtype: dtype in the files (the rank's tensor is cast to it while writing).
        writer_rank: global rank that writes it; it must hold the tensor or a DTensor shard of
            it (and so take part in gathering it), unless `source_rank` is given.
        source_rank: global rank that holds it (a piece of it: it takes part in gathering it)
            and sends the whole tensor, in the file's dtype, to `writer_rank`, which need not
            hold it (a pipeline stage's tensor written into rank 0's one file); None: the
            writer holds it.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    writer_rank: int
    source_rank: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        if self.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"HFTensor {self.fqn!r}: dtype {self.dtype} has no safetensors "
                             f"name (supported: {sorted(SAFETENSORS_DTYPES.values())})")

    @property
    def num_bytes(self) -> int:
        """Bytes in the file: elements x element size."""
        return math.prod(self.shape) * self.dtype.itemsize


def plan_hf_files(entries: Sequence[HFTensor], max_shard_bytes: int,
                  file_name: str = SINGLE_FILE) -> list[tuple[str, list[HFTensor]]]:
    """Split `entries`, in order, into (file name, tensors) as `save_hf_weights` writes them.

    A file holds at most `max_shard_bytes` of tensor data (a bigger tensor gets a file of its
    own) and tensors of one writer only: a new file starts when the writer changes. One file is
    `file_name` (`model.safetensors`); n files are `model-0000k-of-0000n.safetensors`
    (transformers' names).
    """
    groups: list[list[HFTensor]] = []
    size = 0
    for e in entries:
        if (not groups or groups[-1][-1].writer_rank != e.writer_rank
                or size + e.num_bytes > max_shard_bytes):
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.num_bytes
    if len(groups) == 1:
        return [(file_name, groups[0])]
    n = len(groups)
    return [(f"model-{k + 1:05d}-of-{n:05d}.safetensors", g) for k, g in enumerate(groups)]


def _header(tensors: Sequence[HFTensor]) -> bytes:
    """The first 8 + N bytes of a safetensors file: N, then the space-padded JSON header."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in tensors:
        header[e.fqn] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                         "data_offsets": [offset, offset + e.num_bytes]}
        offset += e.num_bytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data then starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text


def _write_tensor(f, full: torch.Tensor, dtype: torch.dtype) -> None:
    """Append `full` to `f` as C-contiguous little-endian `dtype` bytes, `_CHUNK_BYTES` of
    rows at a time (no second full copy for a cast or a device move)."""
    rows = full.reshape(1, -1) if full.dim() == 0 else full
    row_bytes = max(1, math.prod(rows.shape[1:]) * dtype.itemsize)
    step = max(1, _CHUNK_BYTES // row_bytes)
    for i in range(0, rows.shape[0], step):
        chunk = rows[i:i + step].to(device="cpu", dtype=dtype).contiguous()
        f.write(chunk.reshape(-1).view(torch.uint8).numpy().data)


class _Group:
    """The ranks taking part in a save; collectives are skipped when they are alone."""

    def __init__(self, group) -> None:
        self.group = group
        on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if on else 0
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if on else [0]
        self.active = len(self.ranks) > 1
        self.is_first = self.rank == self.ranks[0]

    def all_gather(self, obj) -> list:
        if not self.active:
            return [obj]
        out: list = [None] * len(self.ranks)
        dist.all_gather_object(out, obj, group=self.group)  # the group's default timeout
        return out


def _check_save(entries: Sequence[HFTensor], local: Mapping[str, torch.Tensor], group: _Group,
                config, max_shard_bytes: int) -> list[str]:
    """This rank's complaints about the inputs of `save_hf_weights`."""
    errors = []
    if max_shard_bytes < 1:
        errors.append(f"max_shard_bytes={max_shard_bytes} must be >= 1")
    seen: set[str] = set()
    for e in entries:
        if e.fqn in seen:
            errors.append(f"{e.fqn!r} appears twice in entries")
        seen.add(e.fqn)
        for what, r in (("writer_rank", e.writer_rank), ("source_rank", e.source_rank)):
            if r is not None and r not in group.ranks:
                errors.append(f"{e.fqn!r}: {what} {r} is not in the group (ranks "
                              f"{group.ranks[:8]}{'...' if len(group.ranks) > 8 else ''})")
        piece = local.get(e.fqn)
        if piece is not None and tuple(piece.shape) != e.shape:
            errors.append(f"{e.fqn!r}: this rank's tensor has global shape "
                          f"{tuple(piece.shape)}, entries say {e.shape}")
        holder = e.writer_rank if e.source_rank is None else e.source_rank
        if piece is None and holder == group.rank:
            role = "writer" if e.source_rank is None else "source"
            errors.append(f"{e.fqn!r}: rank {group.rank} is its {role} but holds no piece of it")
    if group.is_first and config is not None and not (
            isinstance(config, Mapping) or hasattr(config, "save_pretrained")):
        errors.append(f"config must be a dict or a transformers PretrainedConfig, got "
                      f"{type(config).__name__}")
    return errors


def _write_meta(tmp: Path, files, config, extra_files: Mapping[str, str]) -> None:
    """Rank 0's share: config.json, the extra files and, for several files, the index."""
    tmp.mkdir(parents=True, exist_ok=True)
    for name, text in extra_files.items():
        (tmp / name).write_text(text)
    if isinstance(config, Mapping):
        (tmp / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True))
    elif config is not None:
        config.save_pretrained(str(tmp))
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(e.num_bytes for _, g in files for e in g)},
                 "weight_map": {e.fqn: name for name, g in files for e in g}}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))


def _write_files(tmp: Path, files, local: Mapping[str, torch.Tensor], rank: int,
                 error: str | None) -> str | None:
    """Gather every tensor to its writer and stream it into its file, in `files` order.

    Every rank holding a DTensor piece takes part in its gather even after a write error here
    (returned, not raised), so that the other ranks never wait in a collective.
    """
    for name, tensors in files:
        f = None
        if tensors[0].writer_rank == rank and error is None:
            try:
                tmp.mkdir(parents=True, exist_ok=True)
                f = open(tmp / name, "wb")  # noqa: SIM115 - closed below, also on errors
                f.write(_header(tensors))
            except OSError as e:
                error = f"writing {name}: {e}"
        for e in tensors:
            full = _full(e, local.get(e.fqn), rank)
            if full is None:
                continue
            if f is not None and e.writer_rank == rank:
                try:
                    _write_tensor(f, full, e.dtype)
                except (OSError, RuntimeError) as ex:
                    error = f"writing {e.fqn!r} to {name}: {ex}"
                    f.close()
                    f = None
            del full  # the one full tensor: gone before the next gather
        if f is not None:
            try:
                f.flush()
                os.fsync(f.fileno())
                f.close()
            except OSError as e:
                error = f"closing {name}: {e}"
    return error


def _full(e: HFTensor, piece: torch.Tensor | None, rank: int) -> torch.Tensor | None:
    """The whole tensor of entry `e` on this rank, or None where this rank neither writes nor
    holds it: gathered from this rank's DTensor piece (every holder takes part), and sent by
    `e.source_rank` to `e.writer_rank` when they differ (through the collective device: NCCL
    sends CUDA tensors). The writer receives even after a write error of its own, so that the
    sender never waits."""
    full = None
    if piece is not None:
        full = piece.full_tensor() if isinstance(piece, DTensor) else piece
    if e.source_rank is None or e.source_rank == e.writer_rank:
        return full
    from autoplan.runtime.job import comm_device

    if rank == e.source_rank:
        dist.send(full.detach().to(comm_device(), e.dtype).contiguous(), dst=e.writer_rank)
        return None
    if rank == e.writer_rank:
        received = torch.empty(e.shape, dtype=e.dtype, device=comm_device())
        dist.recv(received, src=e.source_rank)
        return received
    return None


def _replace(tmp: Path, path: Path, token: str) -> None:
    """Move the finished `tmp` to `path`; an existing `path` goes only once `tmp` is there."""
    if not path.exists():
        os.rename(tmp, path)
        return
    old = path.with_name(f"{path.name}.old-{token}")
    os.rename(path, old)
    try:
        os.rename(tmp, path)
    except OSError:
        os.rename(old, path)
        raise
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink()


@torch.no_grad()
def save_hf_weights(path: str | os.PathLike, entries: Sequence[HFTensor],
                    local: Mapping[str, torch.Tensor], *, config=None,
                    max_shard_bytes: int = 5_000_000_000, group=None,
                    file_name: str = SINGLE_FILE,
                    extra_files: Mapping[str, str] | None = None) -> None:
    """Write a consolidated HF safetensors checkpoint of a sharded model to directory `path`
    (collective over `group`; see [Note: atomic HF save]).

    Args:
        path: output directory; replaced if it exists, only once the new one is complete.
        entries: every tensor to write, in file order, identical on every rank.
        local: fqn -> this rank's piece: a plain tensor (the whole tensor, e.g. a pipeline
            stage's) or a DTensor shard. For every DTensor entry, in `entries` order, each rank
            holding a piece calls `full_tensor()` (collective over its mesh); ranks holding
            nothing skip it, plain tensors of non-writers are not touched. Keys not in
            `entries` are ignored.
        config: written as `config.json` by the group's first rank: a dict, or a transformers
            PretrainedConfig (`save_pretrained`).
        extra_files: file name -> text the group's first rank writes beside them (the
            model's `generation_config.json`).
        max_shard_bytes: most tensor bytes per file (`plan_hf_files`), bytes.
        file_name: the name of a checkpoint that fits one file (PEFT's adapter:
            `adapter_model.safetensors`).
        group: process group of the ranks taking part (default: world). Collectives are skipped
            when torch.distributed is not initialised or the group has one rank.

    Memory: a rank holds its shards plus one full tensor at a time (DTensor's gather over a 2-D
    mesh runs one all-gather per mesh axis, briefly adding the partly gathered tensor), plus a
    write buffer of at most 64 MiB for a cast or device move.

    Raises:
        ValueError: on every rank, for bad inputs on any rank (duplicate fqns, a writer rank
            outside the group or not holding its tensor, a shape that disagrees with
            `entries`, `entries` differing between ranks, an unsupported dtype or config).
        RuntimeError: on every rank, when any rank failed to write its files or rank 0 failed
            to move the directory into place; `path` is then left as it was.
    """
    if sys.byteorder != "little":
        raise RuntimeError("save_hf_weights writes safetensors (little-endian) by viewing "
                           "tensor memory as bytes; this host is big-endian")
    entries, path, ranks = tuple(entries), Path(path), _Group(group)
    digest = hashlib.sha256(repr([(e.fqn, e.shape, str(e.dtype), e.writer_rank, e.source_rank)
                                  for e in entries]).encode()).hexdigest()
    token = uuid.uuid4().hex[:12]
    status = ranks.all_gather((_check_save(entries, local, ranks, config, max_shard_bytes),
                               digest, token))
    errors = [f"rank {r}: {m}" for r, (msgs, _, _) in zip(ranks.ranks, status) for m in msgs]
    errors += [f"rank {r}: entries differ from rank {ranks.ranks[0]}'s"
               for r, (_, d, _) in zip(ranks.ranks, status) if d != status[0][1]]
    if errors:
        raise ValueError(f"save_hf_weights({path}): {len(errors)} problem(s): "
                         + "; ".join(errors[:8]))
    token = status[0][2]
    tmp = path.with_name(f"{path.name}.tmp-{token}")
    files = plan_hf_files(entries, max_shard_bytes, file_name)
    error = None
    if ranks.is_first:
        try:
            _write_meta(tmp, files, config, extra_files or {})
        except OSError as e:
            error = f"writing config/index: {e}"
    error = _write_files(tmp, files, local, ranks.rank, error)
    failures = [f"rank {r}: {m}" for r, m in zip(ranks.ranks, ranks.all_gather(error)) if m]
    if ranks.is_first:
        try:
            if not failures:
                _replace(tmp, path, token)
        except OSError as e:
            failures.append(f"rank {ranks.rank}: moving {tmp} to {path}: {e}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    failures = ranks.all_gather(failures)[0]  # rank 0's verdict, and every rank waits for it
    if failures:
        raise RuntimeError(f"save_hf_weights({path}) failed, nothing written: "
                           + "; ".join(failures[:8]))


def save_pretrained(engine, path, *, config=None, max_shard_bytes: int = 5_000_000_000,
                    keys: Mapping[str, str] | None = None, writer_rank: int | None = None,
                    file_name: str = SINGLE_FILE,
                    extra_files: Mapping[str, str] | None = None) -> None:
    """A consolidated Hugging Face checkpoint (safetensors, sharded files + index above
    `max_shard_bytes`, `config.json` from `config`) that `from_pretrained` loads; gathered
    tensor by tensor, so no rank holds more than its shards plus one full tensor
    (collective, `engine`: a DistributedModel). Weights are written in the master
    dtype (fp32 under mixed precision); a tied weight once, under its first name.

    `keys`: FQN -> name in the files of the tensors to write, in that order (default: every
    parameter under its FQN, in the model's order); `writer_rank`: the global rank that writes
    every file, the others sending it what they hold (default: each tensor written by the first
    rank of the first pp stage that holds it); `file_name`: the name of one file
    (`save_hf_weights`). A PEFT adapter is all three ([Note: PEFT names] in
    runtime/adapters.py). `extra_files`: name -> text written beside them (the model's
    `generation_config.json`)."""
    pp = engine.plan.mesh.pp
    # the global ranks of each pp stage: one row per pp rank (the other axes flattened)
    mesh = engine.mesh.mesh.movedim(engine.mesh.mesh_dim_names.index("pp"), 0).reshape(pp, -1)
    first_stage = {}
    for idx in sorted(engine._stage_param_fqns):
        for fqn in engine._stage_param_fqns[idx]:
            first_stage.setdefault(fqn, idx)
    dtype = engine.precision.master_dtype
    params = engine.graph.params
    if keys is None:
        keys = {fqn: fqn for fqn, info in params.items()
                if not info.is_buffer and fqn in first_stage}
    # a tied weight's other names are its first name's tensor
    canonical = {a: fqn for fqn, info in params.items() for a in info.aliases}
    missing = [fqn for fqn in keys if canonical.get(fqn, fqn) not in first_stage]
    if missing:
        raise ValueError(f"save_pretrained: {len(missing)} tensor(s) to write are no parameter "
                         f"of the planned model: {missing[:8]}")
    entries, files_of = [], defaultdict(list)
    for fqn, key in keys.items():
        fqn = canonical.get(fqn, fqn)
        files_of[fqn].append(key)
        info = params[fqn]
        holder = int(mesh[first_stage[fqn] % pp, 0])
        writer = holder if writer_rank is None else writer_rank
        entries.append(HFTensor(key, tuple(info.shape), dtype or getattr(torch, info.dtype),
                                writer, None if writer == holder else holder))
    local = {}
    for idx, module in engine.stages:
        for fqn, p in module.named_parameters():
            if first_stage.get(fqn) == idx:
                for key in files_of.get(fqn, ()):
                    local[key] = p
    save_hf_weights(path, entries, local, config=config, max_shard_bytes=max_shard_bytes,
                    file_name=file_name, extra_files=extra_files)
