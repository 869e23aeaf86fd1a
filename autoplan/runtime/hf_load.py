"""Hugging Face checkpoints (safetensors) into a model sharded across ranks, and the format's
names (autoplan/runtime/hf_checkpoint.py writes them).

`load_hf_weights` fills this rank's parameters -- plain tensors, tp DTensors, FSDP2 shards, the
stages a rank holds -- reading from the files only the block each shard covers
(`safe_open(...).get_slice(key)[slices]`, which copies just those bytes out of the memory map).
`checkpoint_dtypes` reads the dtypes of a checkpoint from its headers only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from autoplan._torch_compat import local_shard_slices

__all__ = ["SINGLE_FILE", "INDEX_FILE", "SAFETENSORS_DTYPES", "LoadStats", "load_hf_weights",
           "checkpoint_dtypes"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# torch dtype -> safetensors dtype name (safetensors README, "Format").
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class LoadStats:
    """What `load_hf_weights` read on this rank.

    Attributes:
        bytes_read: bytes of the slices read, at the file's dtype (before any cast).
        num_tensors: parameters filled (shards of zero elements included).
    """

    bytes_read: int
    num_tensors: int


def _key_files(path: Path) -> tuple[dict[str, Path] | None, list[Path]]:
    """(checkpoint key -> file from the index, or None for a single file; the files)."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"load_hf_weights: {path} is not a .safetensors file; only "
                             f"safetensors checkpoints are supported")
        return None, [path]
    if not path.is_dir():
        raise ValueError(f"load_hf_weights: checkpoint directory {path} does not exist")
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"load_hf_weights: cannot read the weight_map of {index}: "
                             f"{e}") from e
        keys = {k: path / f for k, f in weight_map.items()}
        return keys, sorted(set(keys.values()))
    if (path / SINGLE_FILE).exists():
        return None, [path / SINGLE_FILE]
    others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if others:
        raise ValueError(f"load_hf_weights: {path} holds {others[:3]} but no {SINGLE_FILE} or "
                         f"{INDEX_FILE}; only safetensors checkpoints are supported (convert "
                         f"with transformers' save_pretrained(safe_serialization=True))")
    raise ValueError(f"load_hf_weights: {path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")


def _open(stack: contextlib.ExitStack, file: Path):
    from safetensors import SafetensorError, safe_open

    try:  # safe_open reads and validates the header: a truncated file fails here
        return stack.enter_context(safe_open(str(file), framework="pt"))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"load_hf_weights: cannot read safetensors file {file}: {e}") from e


def _names(alias: str | Sequence[str]) -> list[str]:
    return [alias] if isinstance(alias, str) else list(alias)


def _resolve(fqns: Sequence[str], available,
             aliases: Mapping[str, str | Sequence[str]]) -> dict[str, str]:
    """fqn -> the checkpoint key holding it (itself, or an alias in either direction)."""
    reverse: dict[str, list[str]] = {}
    for a, b in aliases.items():
        for name in _names(b):
            reverse.setdefault(name, []).append(a)
    keys, missing = {}, []
    for fqn in fqns:
        candidates = [fqn, *_names(aliases.get(fqn, ())), *reverse.get(fqn, [])]
        found = next((c for c in candidates if c in available), None)
        if found is None:
            missing.append(fqn)
        else:
            keys[fqn] = found
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"load_hf_weights: {len(missing)} parameter(s) missing from the "
                         f"checkpoint (aliases tried): {missing[:8]}{more}")
    return keys


def _target(fqn: str, p: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """(the local tensor to fill, the global slices it covers; None: nothing to read)."""
    if not isinstance(p, DTensor):
        return p, tuple(slice(0, n) for n in p.shape)
    local = p.to_local()
    slices = local_shard_slices(p.shape, p.device_mesh, p.placements)
    if slices is None:
        return local, None
    want = tuple(s.stop - s.start for s in slices)
    if math.prod(want) == 0 and local.numel() == 0:
        # FSDP2 gives an empty shard of a tp shard the shape (0, 0), whatever the global shape.
        return local, None
    if tuple(local.shape) != want:
        raise ValueError(f"load_hf_weights: {fqn!r} with placements {tuple(p.placements)} on "
                         f"mesh {tuple(p.device_mesh.shape)}: local shard has shape "
                         f"{tuple(local.shape)}, torch computes {want} from global shape "
                         f"{tuple(p.shape)}")
    return local, slices


@torch.no_grad()
def load_hf_weights(path: str | os.PathLike, params: Mapping[str, torch.Tensor], *,
                    aliases: Mapping[str, str | Sequence[str]] | None = None) -> LoadStats:
    """Fill this rank's `params` in place from the HF safetensors checkpoint at `path`.

    Args:
        path: a directory with `model.safetensors`, or with `model-0000k-of-0000n.safetensors`
            files and `model.safetensors.index.json`; or one `.safetensors` file.
        params: fqn -> this rank's tensor of that parameter. A plain tensor is the whole tensor
            (shape = the file's shape); a DTensor is filled in its local shard (`to_local()`,
            copied into, never rebound: FSDP2's shard is a view of its padded storage) with
            the block its `device_mesh` and `placements` give this rank (`Shard`, `Replicate`,
            FSDP2's `_StridedShard`; see `_torch_compat.local_shard_slices`). Values are cast
            to the target's dtype and device.
        aliases: fqn -> another fqn naming the same tensor (tied weights: GPT-2 files hold
            `transformer.wte.weight` for `lm_head.weight`), or several tried in order (a PEFT
            model's base weight: its key in the base checkpoint, then its tied names' keys;
            [Note: PEFT names] in runtime/adapters.py); tried in both directions when a
            requested fqn is not in the files. Keys of the files nobody asks for are ignored.

    Returns:
        LoadStats; `bytes_read` counts only the slices read (per rank, well under the file size
        when the model is sharded).

    Raises:
        ValueError: no safetensors checkpoint at `path` (a `pytorch_model.bin` is refused),
            parameters missing from the checkpoint (up to 8 named), a shape mismatch (fqn, file
            shape, model shape), an unreadable or truncated file (named), or a DTensor whose
            local shard does not match its placements. Every check runs before any tensor is
            written, so a failed load leaves `params` untouched.
    """
    keys_to_files, files = _key_files(Path(path))
    with contextlib.ExitStack() as stack:
        handles = {f: _open(stack, f) for f in files}
        if keys_to_files is None:
            keys_to_files = {k: files[0] for k in handles[files[0]].keys()}
        keys = _resolve(list(params), keys_to_files, aliases or {})
        plan = []
        for fqn, p in params.items():  # check every shape before writing anything
            file = keys_to_files[keys[fqn]]
            try:
                view = handles[file].get_slice(keys[fqn])
            except Exception as e:  # noqa: BLE001 - safetensors raises bare errors per key
                raise ValueError(f"load_hf_weights: {file} does not hold {keys[fqn]!r} "
                                 f"(listed in its index): {e}") from e
            file_shape = tuple(view.get_shape())
            if file_shape != tuple(p.shape):
                raise ValueError(f"load_hf_weights: shape mismatch for {fqn!r}: file {file.name} "
                                 f"has {keys[fqn]!r} of shape {file_shape}, the model "
                                 f"{tuple(p.shape)}")
            plan.append((handles[file], keys[fqn], view, *_target(fqn, p)))
        bytes_read = 0
        for handle, key, view, local, slices in plan:
            if slices is None or local.numel() == 0:
                continue
            piece = view[slices] if slices else handle.get_tensor(key)  # () : a 0-d tensor
            local.copy_(piece)
            bytes_read += piece.numel() * piece.element_size()
    return LoadStats(bytes_read=bytes_read, num_tensors=len(plan))


def checkpoint_dtypes(path: str | os.PathLike) -> dict[str, list[str]]:
    """The dtypes of the floating tensors of the HF safetensors checkpoint at `path` (as
    `load_hf_weights` takes it), from the files' headers only (8 + N bytes per file, no tensor
    read): torch dtype name ("bfloat16", ...) -> the tensor names of that dtype, sorted.

    Raises ValueError as `load_hf_weights` does for no or an unreadable checkpoint."""
    _, files = _key_files(Path(path))
    names = {v: str(k).removeprefix("torch.") for k, v in SAFETENSORS_DTYPES.items() if k.is_floating_point}
    out: dict[str, list[str]] = {}
    for file in files:
        try:
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
        except (OSError, ValueError) as e:
            raise ValueError(f"load_hf_weights: cannot read the header of safetensors file "
                             f"{file}: {e}") from e
        for key, entry in header.items():
            if key != "__metadata__" and entry.get("dtype") in names:
                out.setdefault(names[entry["dtype"]], []).append(key)
    return {k: sorted(v) for k, v in sorted(out.items())}
