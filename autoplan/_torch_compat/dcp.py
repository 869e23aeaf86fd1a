"""What a torch.distributed.checkpoint (DCP) checkpoint holds, read from its metadata
(torch 2.13's `FileSystemReader` records).
"""

from __future__ import annotations

__all__ = ["checkpoint_keys", "checkpoint_extents"]


def checkpoint_keys(path) -> set[str]:
    """The (flattened) keys a DCP checkpoint holds, from its metadata (torch 2.13)."""
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def checkpoint_extents(path) -> dict[str, int]:
    """{file relative to `path`: bytes the DCP checkpoint's metadata says it holds at least}
    (the furthest offset + length of its records); torch 2.13's FileSystemReader storage
    records. Raises what `read_metadata` raises for a missing or unreadable `.metadata`."""
    from torch.distributed.checkpoint import FileSystemReader

    extents: dict[str, int] = {}
    for info in FileSystemReader(str(path)).read_metadata().storage_data.values():
        end = int(info.offset) + int(info.length)
        extents[info.relative_path] = max(extents.get(info.relative_path, 0), end)
    return extents
