"""Slower KV tiers below the device pool: host RAM and disk.

A tier stores whole blocks (all layers' K and V of ``block_size`` tokens) under an integer key. The host
tier is one slab of block slots (:mod:`.host_tier`), the disk tier one block file per block.
Blocks evicted from the device go to the first tier instead of being dropped; the radix cache
decides what moves where (same priority order in every tier). A tier only stores and returns
bytes, and it checks them: a corrupted or missing block raises :class:`.blockfile.BlockDataError`, so the
engine recomputes those tokens instead of ever reading wrong K/V. A write may fail too (a full
disk, a removed directory): it raises, leaves no file behind, and the cache drops that block. The
disk tier's files are block files (:mod:`.blockfile`), the same format as persisted blocks.

A disk tier is ``full`` when it holds its configured number of blocks, or when one more block file
would leave less than its volume's reserve free (:mod:`.volume`: the volume may be shared with a
persistent engine's journal and with other processes): its effective capacity follows the free
space as it changes. A write that still meets ``ENOSPC`` raises it; the cache then gives the tier's
own space back and retries (:mod:`.radix`).

A tier is configured as ``"host:2GiB"``, ``"disk:8GiB"`` or ``"disk:8GiB:/path"``. :func:`claim_tiers`
parses the specs and claims the disk tiers' directories (:mod:`.tierdirs`) before the model loads,
so a bad spec, an unwritable directory or a persist directory another process holds fails fast;
:func:`make_tier` builds the tier once the block size in bytes is known.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from kvbaton.errors import InvalidRequest

from ..dirs import cache_dir
from . import blockfile
from .block_pool import blocks_for_budget
from .blockfile import BlockDataError
from .host_tier import HostTier
from .tierdirs import TierDir, claim, default_dir
from .volume import MIB

log = logging.getLogger(__name__)


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


# Host RAM: one slab of block slots, pinned on a GPU's host (host_tier.py); a Tier by its interface.
Tier.register(HostTier)


class DiskTier(Tier):
    """One block file (:mod:`.blockfile`) per block in a claimed tier directory, emptied on close."""

    name = "disk"

    def __init__(self, capacity: int, tier_dir: TierDir, bytes_per_block: int) -> None:
        super().__init__(capacity)
        self._dir = tier_dir
        self.volume = tier_dir.volume
        self.file_bytes = blockfile.size(bytes_per_block)  # what one more block takes on the volume
        self._crc: dict[int, int] = {}

    @property
    def dir(self) -> Path:
        return self._dir.path

    @property
    def full(self) -> bool:
        """At its configured capacity, or one more block would eat into the volume's reserve."""
        return len(self) >= self.capacity or not self.volume.room_for(self.file_bytes)

    def path(self, key: int) -> Path:
        return self.dir / f"{key}{blockfile.SUFFIX}"

    def put(self, key: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._crc[key] = blockfile.write(self.path(key), k, v)
        self.bytes_written += 2 * k.nbytes

    def get(self, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        crc = self._crc.get(key)
        if crc is None:
            raise BlockDataError(f"block {key} is not in the disk tier")
        k, v = blockfile.read(self.path(key), crc)
        self.bytes_read += 2 * k.nbytes
        return k, v

    def delete(self, key: int) -> None:
        if self._crc.pop(key, None) is not None:
            try:
                self.path(key).unlink(missing_ok=True)
            except OSError as exc:  # the block is forgotten either way; close or the next start removes the file
                log.warning("could not delete %s: %s", self.path(key), exc)

    def __len__(self) -> int:
        return len(self._crc)

    def close(self) -> None:
        self._crc.clear()
        self._dir.release()


@dataclass
class TierSpec:
    """A parsed tier spec; a disk tier's directory is claimed from parsing until close."""

    spec: str
    kind: str
    size: str
    dir: TierDir | None = None

    def release(self) -> None:
        """Give the directory back (an engine that failed to start, or a tier closed)."""
        if self.dir is not None:
            self.dir.release()


def tiers_root() -> Path:
    return cache_dir() / "tiers"


def claim_tiers(specs: Sequence[str], root: Path | None = None, *, persist: bool = False) -> list[TierSpec]:
    """Parse ``"host:2GiB"``, ``"disk:8GiB"``, ``"disk:500 blocks"`` or ``"disk:8GiB:/path"`` and claim
    each disk tier's directory (all or none: on error, those claimed already are given back). With
    ``persist`` the first disk tier's directory holds the persisted state: it is claimed exclusively
    (held by a live process, it is refused, never replaced by ``<dir>-1``)."""
    claimed: list[TierSpec] = []
    try:
        for spec in specs:
            first_disk = persist and not any(t.dir is not None for t in claimed)
            claimed.append(_claim(spec, root or tiers_root(), exclusive=first_disk))
    except BaseException:
        for tier in claimed:
            tier.release()
        raise
    return claimed


def parse_tier(spec: str) -> tuple[str, str, str]:
    """``(kind, size, path)`` of a tier spec ("" when it names no directory); claims nothing."""
    if not isinstance(spec, str):
        raise InvalidRequest(f"a tier is a string such as 'disk:4GiB', got {spec!r}")
    kind, _, rest = spec.partition(":")
    size, _, path = rest.partition(":")
    if not size:
        raise InvalidRequest(f"tier {spec!r} needs a capacity, e.g. 'disk:4GiB'")
    if kind not in ("host", "disk"):
        raise InvalidRequest(f"unknown tier kind {kind!r}: use 'host' or 'disk'")
    blocks_for_budget(size, 1)  # the syntax now; the block count once the block's size is known
    if kind == "host" and path:
        raise InvalidRequest(f"tier {spec!r}: a host tier has no directory")
    return kind, size, path


def _claim(spec: str, root: Path, exclusive: bool = False) -> TierSpec:
    kind, size, path = parse_tier(spec)
    if kind == "host":
        return TierSpec(spec, kind, size)
    base = Path(path).expanduser() if path else default_dir(root, kind, size)
    return TierSpec(spec, kind, size, claim(base, root, exclusive=exclusive))


def make_tier(spec: TierSpec, bytes_per_block: int, device: torch.device) -> Tier:
    """Build a claimed tier; its capacity is the blocks its size buys (a disk tier's, at most what its
    volume has room for as it fills: see the module docstring)."""
    capacity = blocks_for_budget(spec.size, bytes_per_block)
    if spec.kind == "host":
        return HostTier(capacity, pin=device.type == "cuda")
    assert spec.dir is not None
    tier = DiskTier(capacity, spec.dir, bytes_per_block)
    try:
        fits = max((tier.volume.free() - tier.volume.reserve()) // tier.file_bytes, 0)
    except OSError:
        fits = capacity
    if fits < capacity:
        log.warning("disk tier %r: its volume has room for %d of its %d blocks now (%.0f MiB free, %.0f MiB kept "
                    "free): it holds what the free space allows as it changes", spec.spec, fits, capacity,
                    tier.volume.free() / MIB, tier.volume.reserve() / MIB)
    return tier
