"""Persistence: live handles that outlive their process, in the state directory of a disk tier.

With persistence on (``Engine(persist=True)``, ``kvbaton serve --persist``), the first disk tier's
directory (owned by its configuration, :mod:`.tierdirs`; claimed exclusively, so a second live
engine of it is refused) holds a ``state/`` directory:

- ``salt`` (0600): the secret of the server's tenant ids, so the same token is the same tenant after
  a restart. It is never sent anywhere;
- ``handles.jsonl``: the handle journal (:mod:`.journal`, its lines :mod:`.journal_format`): one
  checksummed line per event (``add``, ``slot``, ``release``), written by one writer thread with
  group commit, compacted while running, bounded per owner, with its own reserve on the volume;
- ``blocks/<key>.safetensors`` + ``blocks.json``: K/V blocks of live handles, saved at a clean exit
  (:mod:`.blockstore`), content-addressed and checksummed.

The engine's side is :class:`PersistentHandles`: at start the journal's handles come back as
spilled live handles (their K/V from the saved blocks on next use, else recomputed from lineage);
saved blocks beyond the volume's reserve are deleted, least valuable first. At a clean exit the
journaled live handles' full blocks are saved, the most recently used handles first, giving back
the tier's blocks for them if the volume is full; what does not fit is logged and recomputed after
the restart.

Invariants: a journal of another model, dtype or block size is dropped whole at open (with a
warning), and the saved blocks with it; only exact handles are journaled; released handles do not
come back; blocks no live handle needs are deleted at open and at a clean exit; a restored
handle's saved blocks go to its owner's prefix-cache partition (the owner is its tenant).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from kvbaton.errors import InvalidRequest
from kvbaton.handle import Handle

from ..tenants import AgentRef
from . import blockfile
from .blockstore import BlockStore, block_keys
from .journal import COMMIT_TIMEOUT_S, Journal  # noqa: F401 (re-exported: the server waits on commits this long)
from .journal_format import JOURNAL_VERSION
from .sequence import KVState
from .tiers import DiskTier
from .volume import MIB, Volume, full, sync_dir, write_all

if TYPE_CHECKING:
    from ..handles import HandleTable
    from .kv_manager import KVManager
    from .tierdirs import TierDir

log = logging.getLogger(__name__)

STATE_DIR = "state"
SALT_BYTES = 32
RECLAIM_LOCK_S = 2.0  # how long the writer waits for the engine lock to have the tier give space back


def state_dir(tier_dir: Path) -> Path:
    return tier_dir / STATE_DIR


class Persistence:
    """The state directory of one engine configuration: salt, handle journal, saved blocks, on a volume
    shared with the disk tier (``reclaim``: the tier gives space back, see :class:`.journal.Journal`)."""

    def __init__(self, root: Path, *, fingerprint: str, dtype: str, block_size: int, volume: Volume | None = None,
                 reclaim: Callable[[int], int] | None = None) -> None:
        self.root = root
        root.mkdir(mode=0o700, exist_ok=True)
        self.volume = volume or Volume(root)
        self.salt = _salt(root / "salt")
        header = {"version": JOURNAL_VERSION, "model_fingerprint": fingerprint, "dtype": dtype,
                  "block_size": block_size}
        self.journal = Journal(root / "handles.jsonl", header, volume=self.volume, reclaim=reclaim)
        self.blocks = BlockStore(root)
        if self.journal.dropped:
            self.blocks.keep_only(set())  # the blocks of another model or layout are of no use either
            self.blocks.flush()

    def close(self) -> None:
        self.journal.close()


class PersistentHandles:
    """A persistent engine's live handles across restarts (see the module docstring): ``restore`` at
    start, ``add``/``released`` as they are journaled and released, ``close`` at a clean exit."""

    def __init__(self, persistence: Persistence, handles: HandleTable[KVState], kv: KVManager,
                 reclaim: Callable[[int], int] | None = None) -> None:
        self.persistence = persistence
        self._handles, self._kv = handles, kv
        self._block_size = kv.block_size
        self._reclaim = reclaim

    @classmethod
    def open(
        cls, disk: TierDir | None, persist: bool, handles: HandleTable[KVState], kv: KVManager, *, fingerprint: str,
        dtype: str, tokens_of: Callable[[Handle], list[int]],
    ) -> PersistentHandles | None:
        """With ``persist``: the engine's persistent handles in the state directory of its first disk
        tier (``disk``), those of an earlier run of this configuration restored now. Without: None, and
        a state directory an earlier run left is kept, not served."""
        if not persist:
            if disk is not None and state_dir(disk.path).exists():
                log.warning("%s holds handles persisted by an earlier run: they are kept, not served (start with "
                            "persist on to serve them)", state_dir(disk.path))
            return None
        assert disk is not None, "persistence needs a disk tier (the engine's config checks it)"

        def reclaim(nbytes: int) -> int:
            return give_back_tier(kv, disk.path, nbytes)

        persistence = Persistence(state_dir(disk.path), fingerprint=fingerprint, dtype=dtype, block_size=kv.block_size,
                                  volume=disk.volume, reclaim=reclaim)
        kept = cls(persistence, handles, kv, reclaim)
        kept.restore(tokens_of)
        return kept

    def restore(self, tokens_of: Callable[[Handle], list[int]]) -> None:
        """Register the journal's handles as spilled, and put their saved blocks in the prefix cache.
        ``tokens_of``: a handle's validated lineage tokens (an ``InvalidRequest`` drops the handle)."""
        journal, store, bs = self.persistence.journal, self.persistence.blocks, self._block_size
        gone, needed = [], set()
        for entry in journal.live():
            handle = entry.handle
            try:
                self._handles.identity.check(handle)  # type: ignore[union-attr]
                tokens = tokens_of(handle)
                if len(tokens) != handle.num_tokens or handle.id in self._handles:
                    raise InvalidRequest(f"handle {handle.id} lineage does not spell its {handle.num_tokens} tokens")
            except Exception as exc:  # noqa: BLE001 - one bad record costs its handle, not the start
                log.warning("persisted handle %s is dropped: %s", handle.id, exc)
                gone.append(handle.id)
                continue
            # A server journals its tenant as the owner: the handle is that tenant's agentless request's, so its
            # blocks go to (and are found in) its tenant's prefix-cache partition.
            state = KVState(id=handle.id, token_ids=tokens, blocks=[], num_cached=0, lineage=handle.lineage,
                            agent=entry.agent or AgentRef(entry.owner).label, tenant=entry.owner)
            with self._kv.lock:
                self._handles.add(handle.id, state)
                self._kv.spiller.spilled.add(handle.id)
                self._kv.spiller.touch(state)  # the journal's order is their order of use
            needed.update(block_keys(tokens, bs, len(tokens) // bs))
            self.place_saved([state])
        journal.release(gone)
        store.keep_only(needed)
        self._trim()
        store.flush(self._reclaim)
        log.info("restored %d persisted handle(s)", len(journal.live()))

    def _trim(self) -> None:
        """Delete saved blocks, least valuable first, while the volume has less than its reserve free:
        they can be recomputed, the journal's appends cannot wait."""
        volume, store = self.persistence.volume, self.persistence.blocks
        if volume.room_for(0):
            return
        deleted = 0
        for key in reversed(self._ranked_keys()):
            if volume.room_for(0):
                break
            if key in store:
                store.discard(key)
                deleted += 1
        log.warning("the volume of %s had less than its reserve free (%.1f MiB): %d saved block(s) were deleted, least "
                    "recently used handles' first; their tokens are recomputed when used", self.persistence.root,
                    volume.reserve() / MIB, deleted)

    def _ranked(self) -> list[tuple[KVState, list[str]]]:
        """The journaled live handles' states and block keys, the most recently used first."""
        bs, ranked = self._block_size, []
        for entry in self.persistence.journal.live():
            state = self._handles.find(entry.handle.id)
            if state is not None:
                ranked.append((state, block_keys(state.token_ids, bs, len(state.token_ids) // bs)))
        ranked.sort(key=lambda sk: self._kv.spiller.last_used(sk[0]), reverse=True)
        return ranked

    def _ranked_keys(self) -> list[str]:
        """Every needed block key once, most valuable first: by handle (most recently used first), then
        along its prefix (a block is of use only after the ones before it)."""
        return list(dict.fromkeys(key for _, keys in self._ranked() for key in keys))

    def spilled(self) -> list[KVState]:
        """The live handles whose K/V are not in the pool (restored ones among them)."""
        with self._kv.lock:
            return [s for hid, s in self._handles.items() if hid in self._kv.spiller.spilled]

    def place_saved(self, states: Iterable[KVState]) -> None:
        """Put the saved blocks of restored (spilled) handles in the prefix cache, in each one's scope: its
        next use attaches them there. A block never saved or unreadable stops it: the rest is recomputed."""
        store, bs = self.persistence.blocks, self._block_size
        for state in states:
            keys = block_keys(state.token_ids, bs, len(state.token_ids) // bs)

            def read(i: int, keys: list[str] = keys) -> tuple[torch.Tensor, torch.Tensor] | None:
                if keys[i] not in store:
                    return None  # never saved (a crash, a full disk): recomputed from the lineage
                try:
                    return store.get(keys[i])
                except Exception as exc:  # noqa: BLE001 - missing or corrupted: recomputed, never used
                    log.warning("%s; those tokens will be recomputed", exc)
                    return None

            self._kv.cache_blocks(state.token_ids, len(keys), read, self._kv.partition(state))

    def add(self, handles: Iterable[Handle], owner: str | None) -> None:
        """Journal live exact handles of ``owner`` (each must be live here, else its typed error)."""
        handles = list(handles)
        for handle in handles:
            self._handles.get(handle)
        self.persistence.journal.add(owner, handles)

    def released(self, handle_ids: Iterable[str]) -> None:
        """Released handles never come back (durable on return)."""
        self.persistence.journal.release(handle_ids)

    def close(self) -> None:
        """Save what the journaled live handles need, then close the journal (call under the engine lock)."""
        try:
            self.persistence.journal.sync()  # what was queued is in the journal's live set before it is read
            self._save()
        finally:
            self.persistence.close()

    def _save(self) -> None:
        """Save the full blocks of the journaled live handles that the store lacks, the most recently used
        handles first, within the volume's reserve (the disk tier gives its blocks back for them); delete
        the blocks no live handle needs first. What does not fit is logged."""
        store = self.persistence.blocks
        ranked = self._ranked()
        store.keep_only({key for _, keys in ranked for key in keys})  # their space first
        saved, cut, stopped = 0, 0, None
        for state, keys in ranked:
            for i, key in enumerate(keys):
                if key in store:
                    continue
                if stopped is not None:
                    cut += 1
                    break
                data = self._kv.full_block(state, i)
                if data is None:
                    break  # held nowhere (a spilled handle's dropped block): recomputed from the lineage
                try:
                    self._put(key, *data)
                    saved += 1
                except Exception as exc:  # noqa: BLE001 - a full volume (any writer's error type)
                    stopped = exc
                    cut += 1
                    break
        store.flush(self._reclaim)
        if stopped is not None:
            log.warning("clean exit: %d block(s) of the live handles were saved, the most recently used handles "
                        "first; %d handle(s) could not be saved whole (%s): their other tokens are recomputed from "
                        "the lineage after the restart", saved, cut, stopped)

    def _put(self, key: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """Save one block within the volume's reserve, the disk tier's blocks given back for it if needed."""
        store, volume = self.persistence.blocks, self.persistence.volume
        size = blockfile.size(k.nbytes + v.nbytes)
        if not volume.room_for(size) and self._reclaim is not None:
            self._reclaim(size + volume.reserve() - volume.free())  # what is missing, the reserve kept
        if not volume.room_for(size):
            raise full(f"saved block {key}")
        try:
            store.put(key, k, v)
        except OSError as exc:  # the volume is shared: another writer took the room meanwhile
            if exc.errno != errno.ENOSPC or self._reclaim is None or not self._reclaim(size):
                raise
            store.put(key, k, v)


def give_back_tier(kv: KVManager, tier_dir: Path, nbytes: int, wait_s: float = RECLAIM_LOCK_S) -> int:
    """Have the disk tier in ``tier_dir`` give back at least ``nbytes`` of its blocks (lowest priority
    first; they are a cache) if it holds them: the bytes freed. Takes the engine lock, waiting at most
    ``wait_s`` (a thread that holds it may be waiting for the journal's writer)."""
    cache = kv.cache
    found = next(((i, t) for i, t in enumerate(cache.tiers) if isinstance(t, DiskTier) and t.dir == tier_dir),
                 None) if cache is not None else None
    if cache is None or found is None:
        return 0
    index, tier = found
    if not kv.lock.acquire(timeout=wait_s):
        return 0
    try:
        n = cache.shrink_tier(index, -(-nbytes // tier.file_bytes))
    finally:
        kv.lock.release()
    if n:
        log.info("the disk tier in %s gave back %d block(s) (%.1f MiB) to its volume's persisted state", tier_dir, n,
                 n * tier.file_bytes / MIB)
    return n * tier.file_bytes


def remove(root: Path) -> None:
    """Delete a state directory (persistence switched off for its configuration)."""
    shutil.rmtree(root, ignore_errors=True)


def _salt(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        salt = path.read_bytes()
        if len(salt) == SALT_BYTES:
            return salt
        log.warning("%s is damaged: a new tenant-id salt is made", path)
        path.unlink()
        return _salt(path)
    salt = secrets.token_bytes(SALT_BYTES)
    try:
        write_all(fd, salt)
        os.fsync(fd)
    finally:
        os.close(fd)
    sync_dir(path.parent)
    return salt
