"""Saved K/V blocks of a persistent engine's live handles (``state/blocks/`` and ``blocks.json``, :mod:`.persist`).

Blocks are block files (:mod:`.blockfile`, the disk tier's format), saved at a clean exit. A block's
key hashes the block size and every token up to its end (:func:`block_keys`), so the same prefix is
stored once whoever holds it; ``blocks.json`` (replaced atomically) holds each block's CRC-32,
checked on every read. A block that is missing, unreadable or fails its checksum is recomputed,
never used.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from . import blockfile
from .blockfile import BlockDataError
from .volume import replace

log = logging.getLogger(__name__)


def block_keys(tokens: Sequence[int], block_size: int, n: int) -> list[str]:
    """Keys of the first ``n`` full blocks of ``tokens``: a chained hash of each block's whole prefix."""
    h = hashlib.sha256(f"kvbaton-block:{block_size}".encode())
    keys = []
    for i in range(n):
        h.update(json.dumps(list(tokens[i * block_size:(i + 1) * block_size])).encode())
        keys.append(h.copy().hexdigest()[:40])
    return keys


class BlockStore:
    """Content-addressed, checksummed K/V blocks of live handles (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "blocks"
        self.index_path = root / "blocks.json"
        self.dir.mkdir(exist_ok=True)
        try:
            self._crc: dict[str, int] = {str(k): int(v) for k, v in json.loads(self.index_path.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            self._crc = {}

    def __contains__(self, key: str) -> bool:
        return key in self._crc

    def __len__(self) -> int:
        return len(self._crc)

    def path(self, key: str) -> Path:
        return self.dir / f"{key}{blockfile.SUFFIX}"

    def put(self, key: str, k: torch.Tensor, v: torch.Tensor) -> None:
        self._crc[key] = blockfile.write(self.path(key), k, v)

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        crc = self._crc.get(key)
        if crc is None:
            raise BlockDataError(f"block {key} was not saved")
        try:
            return blockfile.read(self.path(key), crc)
        except BlockDataError:
            self._crc.pop(key, None)  # told once; the block is deleted by the next keep_only
            raise

    def discard(self, key: str) -> None:
        """Delete one block (the index is written by the next ``flush``)."""
        if self._crc.pop(key, None) is not None:
            with contextlib.suppress(OSError):
                self.path(key).unlink()

    def keep_only(self, keys: set[str]) -> None:
        """Delete every block not in ``keys`` (and any stray file); the index is written by ``flush``."""
        self._crc = {k: c for k, c in self._crc.items() if k in keys}
        for file in self.dir.iterdir():
            if file.suffix != blockfile.SUFFIX or file.stem not in self._crc:
                with contextlib.suppress(OSError):
                    file.unlink()

    def flush(self, give_back: Callable[[int], int] | None = None) -> None:
        """Write the index. It cannot be written (a full volume, after ``give_back`` freed what it could):
        logged, never fatal: an entry of a deleted block fails its read and a block missing from it is
        unused, so either way those tokens are recomputed."""
        data = json.dumps(self._crc, sort_keys=True).encode()
        try:
            try:
                replace(self.index_path, data, durable=True)
            except OSError as exc:
                if exc.errno != errno.ENOSPC or give_back is None or not give_back(len(data)):
                    raise
                replace(self.index_path, data, durable=True)
        except OSError as exc:
            log.warning("%s could not be written (%s): the blocks saved since the last time it was are recomputed "
                        "after the restart", self.index_path, exc)
