"""The block file: one K/V block (all layers' K and V of one block) stored as a checksummed file.

One format for every block that goes to disk — a disk tier's evicted blocks (:mod:`.tiers`) and the
saved blocks of persisted handles (:mod:`.persist`): a safetensors file holding ``{"k", "v"}``, whose
CRC-32 over the K and V bytes the caller keeps (in memory, or in an index of its own) and hands back
to :func:`read`. A block that is missing, truncated, garbled or fails its checksum raises
:class:`BlockDataError`, so a caller recomputes those tokens instead of ever using wrong K/V.

:func:`write` is atomic: it writes a temporary file next to the block and renames it into place, so a
failed write (a full disk, a removed directory) leaves neither a partial block nor its temporary, and
raises an ``OSError`` with its ``errno`` (``ENOSPC`` for a full volume: the caller may give space
back and retry). :func:`size` is the space a block file takes, for callers that check for room first.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from .volume import on_disk, replace

SUFFIX = ".safetensors"
HEADER_BYTES = 1024  # safetensors' header of {"k", "v"}: their dtype, shape and offsets, padded (about 150 bytes)


class BlockDataError(Exception):
    """A block could not be returned intact (missing, unreadable or corrupted)."""


def checksum(k: torch.Tensor, v: torch.Tensor) -> int:
    """CRC-32 of a block's K bytes then V bytes."""
    crc = zlib.crc32(k.contiguous().view(torch.uint8).numpy())
    return zlib.crc32(v.contiguous().view(torch.uint8).numpy(), crc)


def size(block_bytes: int) -> int:
    """The most space the file of a block of ``block_bytes`` (its K and V) takes on disk."""
    return on_disk(block_bytes + HEADER_BYTES)


def write(path: Path, k: torch.Tensor, v: torch.Tensor) -> int:
    """Write a block to ``path`` whole or not at all, and return its checksum. Serialized in memory and
    written by the caller's own writes, so a full disk is an ``OSError`` (ENOSPC), not a library error."""
    k, v = k.to("cpu").contiguous(), v.to("cpu").contiguous()
    replace(path, save({"k": k, "v": v}), durable=False)  # a cache's block: a crash loses it, its checksum tells
    return checksum(k, v)


def read(path: Path, crc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the block at ``path`` and check it against ``crc``; :class:`BlockDataError` if it is not intact."""
    try:
        data = load_file(str(path))
        k, v = data["k"], data["v"]
    except Exception as exc:  # missing, truncated or garbled (safetensors' own error types)
        raise BlockDataError(f"block file {path} could not be read: {exc}") from exc
    if checksum(k, v) != crc:
        raise BlockDataError(f"block file {path} is corrupted (checksum mismatch)")
    return k, v
