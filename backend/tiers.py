"""Slower KV tiers below the device pool: host RAM and disk.

A tier stores whole blocks (all layers' K and V of ``block_size`` tokens) under an integer key.
Blocks evicted from the device go to the first tier instead of being dropped; the radix cache
decides what moves where (same priority order in every tier). A tier only stores and returns
bytes, and it checks them: a corrupted or missing block raises :class:`TierDataError`, so the
engine recomputes those tokens instead of ever reading wrong K/V.
"""

from __future__ import annotations

import abc
import os
import shutil
import uuid
import zlib
from pathlib import Path

import torch
from kvbaton.errors import InvalidRequest
from safetensors.torch import load_file, save_file

from .block_pool import blocks_for_budget


class TierDataError(Exception):
    """A tier could not return a block intact."""


def _checksum(k: torch.Tensor, v: torch.Tensor) -> int:
    crc = zlib.crc32(k.contiguous().view(torch.uint8).numpy())
    return zlib.crc32(v.contiguous().view(torch.uint8).numpy(), crc)


class Tier(abc.ABC):
    """Bounded block storage. ``capacity`` is in blocks."""

    name: str

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise InvalidRequest(f"the {self.name} tier must hold at least one block")
        self.capacity = capacity
        self.bytes_written = 0
        self.bytes_read = 0

    @abc.abstractmethod
    def put(self, key: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def get(self, key: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abc.abstractmethod
    def delete(self, key: int) -> None: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @property
    def full(self) -> bool:
        return len(self) >= self.capacity

    def close(self) -> None:
        """Remove everything the tier stored."""


class HostTier(Tier):
    """Host RAM; pinned when the device is a GPU so copies back run at full bandwidth."""

    name = "host"

    def __init__(self, capacity: int, pin: bool = False) -> None:
        super().__init__(capacity)
        self._pin = pin
        self._blocks: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def put(self, key: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = k.to("cpu", copy=True), v.to("cpu", copy=True)
        if self._pin:
            k, v = k.pin_memory(), v.pin_memory()
        self._blocks[key] = (k, v, _checksum(k, v))
        self.bytes_written += 2 * k.nbytes

    def get(self, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            k, v, crc = self._blocks[key]
        except KeyError:
            raise TierDataError(f"block {key} is not in the host tier") from None
        if _checksum(k, v) != crc:
            raise TierDataError(f"block {key} in the host tier is corrupted")
        self.bytes_read += 2 * k.nbytes
        return k, v

    def delete(self, key: int) -> None:
        self._blocks.pop(key, None)

    def __len__(self) -> int:
        return len(self._blocks)

    def close(self) -> None:
        self._blocks.clear()


class DiskTier(Tier):
    """One safetensors file per block under a private directory, removed on close."""

    name = "disk"

    def __init__(self, capacity: int, root: Path) -> None:
        super().__init__(capacity)
        self.dir = Path(root) / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.dir.mkdir(parents=True, exist_ok=False)
        self._crc: dict[int, int] = {}

    def path(self, key: int) -> Path:
        return self.dir / f"{key}.safetensors"

    def put(self, key: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = k.to("cpu").contiguous(), v.to("cpu").contiguous()
        save_file({"k": k, "v": v}, str(self.path(key)))
        self._crc[key] = _checksum(k, v)
        self.bytes_written += 2 * k.nbytes

    def get(self, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        crc = self._crc.get(key)
        if crc is None:
            raise TierDataError(f"block {key} is not in the disk tier")
        try:
            data = load_file(str(self.path(key)))
            k, v = data["k"], data["v"]
        except Exception as exc:  # missing file, truncated or garbled header
            raise TierDataError(f"block {key} could not be read from {self.path(key)}: {exc}") from exc
        if _checksum(k, v) != crc:
            raise TierDataError(f"block {key} in {self.path(key)} is corrupted")
        self.bytes_read += 2 * k.nbytes
        return k, v

    def delete(self, key: int) -> None:
        if self._crc.pop(key, None) is not None:
            self.path(key).unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self._crc)

    def close(self) -> None:
        self._crc.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def make_tier(spec: str, bytes_per_block: int, device: torch.device, root: Path) -> Tier:
    """Build a tier from ``"host:2GiB"`` or ``"disk:8GiB"`` (also ``"disk:500 blocks"``)."""
    kind, _, size = spec.partition(":")
    if not size:
        raise InvalidRequest(f"tier {spec!r} needs a capacity, e.g. 'disk:4GiB'")
    capacity = blocks_for_budget(size, bytes_per_block)
    if kind == "host":
        return HostTier(capacity, pin=device.type == "cuda")
    if kind == "disk":
        return DiskTier(capacity, root)
    raise InvalidRequest(f"unknown tier kind {kind!r}: use 'host' or 'disk'")
