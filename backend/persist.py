"""Persistence: live handles that outlive their process, in the state directory of a disk tier.

With persistence on (``Engine(persist=True)``, ``kvbaton serve --persist``), the first disk tier's
directory (owned by its configuration, :mod:`.tierdirs`) holds a ``state/`` directory:

- ``salt`` (0600): the secret of the server's tenant ids, so the same token is the same tenant after
  a restart. It is never sent anywhere;
- ``handles.jsonl``: the handle journal. One line per event, ``<crc32> <json>``: a header (model
  fingerprint, dtype, block size), ``add`` (an exact handle with its lineage, its owner and agent),
  ``slot`` (an OpenAI agent's slot retains the handle), ``release`` (ids). Each line is appended
  with ``O_APPEND`` and ``fsync``'d before the caller goes on, so a kill at any point leaves whole lines plus at most one torn last line, which its checksum
  rejects (and which is cut off on open). On open the journal is rewritten with its live handles
  only (temporary file, ``fsync``, ``rename``): it never grows beyond the live handles for long;
- ``blocks/<key>.safetensors`` + ``blocks.json``: K/V blocks of live handles, saved at a clean exit as
  block files (:mod:`.blockfile`, the disk tier's format).
  A block's key hashes the block size and every token up to its end, so the same prefix is stored
  once whoever holds it; ``blocks.json`` (replaced atomically) holds each block's CRC-32, checked on
  every read. A block that is missing, unreadable or fails its checksum is recomputed, never used.

Invariants: a journal of another model, dtype or block size is dropped whole at open (with a
warning); only exact handles are journaled (approximate K/V cannot be recomputed identically);
a released handle's ``release`` line is durable before the release is answered, so released
handles never come back; blocks no live handle needs are deleted at open and at a clean exit.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
import threading
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from kvbaton.handle import Handle

from . import blockfile
from .blockfile import BlockDataError

log = logging.getLogger(__name__)

STATE_DIR = "state"
SALT_BYTES = 32
JOURNAL_VERSION = 1


@dataclass(frozen=True)
class Entry:
    """A live handle of the journal: the handle (with its lineage), who owns it, its agent."""

    handle: Handle
    owner: str | None
    agent: str | None
    slot: str | None = None  # the agent whose OpenAI slot retains it (server/tenancy.AgentSlots)
    session: str = ""  # that slot's session ("" the default one)


def state_dir(tier_dir: Path) -> Path:
    return tier_dir / STATE_DIR


def block_keys(tokens: Sequence[int], block_size: int, n: int) -> list[str]:
    """Keys of the first ``n`` full blocks of ``tokens``: a chained hash of each block's whole prefix."""
    h = hashlib.sha256(f"kvbaton-block:{block_size}".encode())
    keys = []
    for i in range(n):
        h.update(json.dumps(list(tokens[i * block_size:(i + 1) * block_size])).encode())
        keys.append(h.copy().hexdigest()[:40])
    return keys


class Journal:
    """The append-only, checksummed, fsync'd handle journal (see the module docstring)."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.header = header
        self._lock = threading.Lock()
        self._live: dict[str, Entry] = {}
        self.dropped = 0  # entries of another model/dtype/block size dropped at open
        self._load()
        try:
            self._rewrite()
        except OSError as exc:  # a full disk: the appended journal is valid as it is (rewritten at the next start)
            log.error("handle journal %s could not be rewritten: %s", self.path, exc)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def live(self) -> list[Entry]:
        with self._lock:
            return list(self._live.values())

    def add(self, owner: str | None, handles: Iterable[Handle], agent: str | None = None) -> None:
        """Journal live exact handles of ``owner`` (durable on return); approximate ones are skipped."""
        entries = [Entry(h, owner, agent) for h in handles if h.exact]
        if not entries:
            return
        lines = [_add_line(e) for e in entries]
        with self._lock:
            self._append(lines)
            for e in entries:
                self._live[e.handle.id] = e

    def retain(self, handle_id: str, agent: str, session: str = "") -> None:
        """Journal that ``agent``'s OpenAI slot in ``session`` (of the handle's owner) retains the handle
        (durable on return)."""
        with self._lock:
            entry = self._live.get(handle_id)
            if entry is None:
                return
            self._append([_line({"slot": handle_id, "agent": agent, "session": session})])
            self._live[handle_id] = Entry(entry.handle, entry.owner, entry.agent, agent, session)

    def release(self, handle_ids: Iterable[str]) -> None:
        """Journal that these handles are gone (durable on return); ids not journaled are ignored."""
        with self._lock:
            ids = [hid for hid in handle_ids if hid in self._live]
            if not ids:
                return
            for hid in ids:
                del self._live[hid]
            try:
                self._append([_line({"release": ids})])
            except OSError as exc:  # the release stands; only a crash before the next rewrite could bring them back
                log.error("handle journal %s: could not record the release of %d handle(s): %s",
                          self.path, len(ids), exc)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        try:
            self._rewrite()
        except OSError as exc:  # the appended journal stays valid; it is rewritten at the next start
            log.error("handle journal %s could not be rewritten: %s", self.path, exc)

    def _append(self, lines: list[bytes]) -> None:
        if self._fd is None:
            raise RuntimeError("the handle journal is closed")
        end = os.lseek(self._fd, 0, os.SEEK_END)
        data = b"".join(lines)
        try:
            _write_all(self._fd, data)
            os.fsync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):  # a partial line of a full disk must not stay in the middle
                os.ftruncate(self._fd, end)
            raise

    def _load(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        header: dict[str, Any] | None = None
        for raw in data.split(b"\n"):
            record = _parse(raw)
            if record is None:
                if raw:  # a kill mid-append leaves at most the last line torn
                    log.warning("handle journal %s: a torn or corrupted line was ignored", self.path)
                continue
            if header is None:
                header = record.get("header")
                if header != self.header:
                    log.warning(
                        "handle journal %s was written by %s, this engine runs %s: its handles are dropped",
                        self.path, header, self.header,
                    )
                    self.dropped = sum(1 for r in data.split(b"\n") if (p := _parse(r)) is not None and "add" in p)
                    return
                continue
            if "add" in record:
                try:
                    handle = Handle.model_validate(record["add"])
                except ValueError:
                    log.warning("handle journal %s: an unreadable handle record was skipped", self.path)
                    continue
                self._live[handle.id] = Entry(handle, record.get("owner"), record.get("agent"), record.get("slot"),
                                              record.get("session", ""))
            elif "slot" in record:
                entry = self._live.get(record["slot"])
                if entry is not None:
                    self._live[record["slot"]] = Entry(entry.handle, entry.owner, entry.agent, record.get("agent"),
                                                       record.get("session", ""))
            elif "release" in record:
                for hid in record["release"]:
                    self._live.pop(hid, None)

    def _rewrite(self) -> None:
        """Replace the journal by its header and live handles, atomically."""
        with self._lock:
            lines = [_line({"header": self.header})] + [_add_line(e) for e in self._live.values()]
        _atomic_write(self.path, b"".join(lines))


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
        self.loaded = 0
        self.failed = 0

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

    def keep_only(self, keys: set[str]) -> None:
        """Delete every block not in ``keys`` (and any stray file), then write the index."""
        self._crc = {k: c for k, c in self._crc.items() if k in keys}
        for file in self.dir.iterdir():
            if file.suffix != blockfile.SUFFIX or file.stem not in self._crc:
                with contextlib.suppress(OSError):
                    file.unlink()
        self.flush()

    def flush(self) -> None:
        _atomic_write(self.index_path, json.dumps(self._crc, sort_keys=True).encode())


class Persistence:
    """The state directory of one engine configuration: salt, handle journal, saved blocks."""

    def __init__(self, root: Path, *, fingerprint: str, dtype: str, block_size: int) -> None:
        self.root = root
        root.mkdir(mode=0o700, exist_ok=True)
        self.salt = _salt(root / "salt")
        header = {"version": JOURNAL_VERSION, "model_fingerprint": fingerprint, "dtype": dtype,
                  "block_size": block_size}
        self.journal = Journal(root / "handles.jsonl", header)
        self.blocks = BlockStore(root)
        if self.journal.dropped:
            self.blocks.keep_only(set())  # the blocks of another model or layout are of no use either

    def close(self) -> None:
        self.journal.close()


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
        os.write(fd, salt)
        os.fsync(fd)
    finally:
        os.close(fd)
    return salt


def _add_line(e: Entry) -> bytes:
    record = {"add": e.handle.model_dump(mode="json"), "owner": e.owner, "agent": e.agent}
    return _line({**record, "slot": e.slot, "session": e.session} if e.slot is not None else record)


def _line(record: dict[str, Any]) -> bytes:
    body = json.dumps(record, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _parse(raw: bytes) -> dict[str, Any] | None:
    crc, _, body = raw.partition(b" ")
    try:
        if len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
            return None
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` or raise. A nearly full disk takes part of a write and says so only by the
    count; the write after it raises ENOSPC. A short write taken for a whole one would leave a torn
    journal line (swallowing the next record) or, renamed over the journal, cut off its tail."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, "no space left: the write made no progress")
        view = view[n:]


def _atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` whole, or leave it as it was (a failed write never replaces it)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    os.close(fd)
    os.replace(tmp, path)
    dirfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dirfd)  # the rename itself survives a crash
    finally:
        os.close(dirfd)
