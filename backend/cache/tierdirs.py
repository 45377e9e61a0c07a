"""Tier directories: where a disk tier keeps its files, who owns them, and when they go.

A disk tier's directory belongs to its configuration, not to a process: ``disk:8GiB`` lives in
``<cache_dir>/tiers/disk-<hash of the spec>/``, ``disk:8GiB:/path`` in ``/path``. Its owner holds an
exclusive ``flock`` on ``owner.lock`` inside it (the file also names the owner's pid, for people).
The kernel drops that lock when the process ends, however it ends, which gives the invariants:

- a directory whose lock can be taken has no live owner: a crash (SIGKILL, OOM kill) left it. The
  next engine of the same configuration clears and reuses it, and every such directory under
  ``<cache_dir>/tiers`` is garbage-collected whenever an engine claims a tier directory;
- a second live engine of the same configuration finds the lock held and takes ``<dir>-1``,
  ``<dir>-2``, ...: two engines never share a directory. Except with persistence: the directory
  that holds a persistent engine's ``state/`` is claimed ``exclusive``: held by a live process, it
  is refused (naming that process) instead, since ``<dir>-1`` would hold none of its handles;
- the owner removes its files on close and, failing that, at interpreter exit (``atexit``); at
  most one directory per configuration can outlive a crash, and only until the next start;
- only kvbaton's own files (``<int>.safetensors``, a write's ``<int>.safetensors.tmp``, ``owner.lock``) are ever
  deleted, so an explicit path that holds anything else is left with it. That includes ``state/``,
  the persisted handles of an engine with persistence on (:mod:`.persist`), which must outlive
  every exit; the directory itself then stays too.

Claims, releases and collections under one root run under ``<root>/.lock``, so a directory being
claimed is never collected half-made. Anything that cannot be created or written is an
:class:`~kvbaton.errors.InvalidRequest` naming the path, raised before the model loads. A claimed
directory's :class:`~.volume.Volume` says how much may still be written in it.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

from kvbaton.errors import InvalidRequest

from .volume import Volume

log = logging.getLogger(__name__)

LOCK_NAME = "owner.lock"
MAX_SUFFIX = 1000  # live engines of one configuration on one machine, far beyond any real count
_OWN_FILE = re.compile(r"^(\d+\.safetensors(\.tmp)?|\.probe-\d+)$")  # blocks (and a killed write\'s temporary), write probes
_LEGACY_DIR = re.compile(r"^(\d+)-[0-9a-f]{12}$")  # <pid>-<uuid>: one per process, as earlier versions made

_owned: set[TierDir] = set()  # released at interpreter exit if their engine never closed
_owned_lock = threading.Lock()


class TierDir:
    """A claimed tier directory: its path and the open, locked ``owner.lock``."""

    def __init__(self, path: Path, root: Path, fd: int) -> None:
        self.path = path
        self.volume = Volume(path)  # shared by the tier's files and a persistent engine's state/
        self._root = root
        self._fd: int | None = fd

    def release(self) -> None:
        """Remove kvbaton's files and the directory if nothing else is left in it (idempotent)."""
        with _owned_lock:
            _owned.discard(self)
        if self._fd is None:
            return
        with contextlib.suppress(OSError), _root_lock(self._root):
            _clear(self.path)
            (self.path / LOCK_NAME).unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None
            with contextlib.suppress(OSError):
                self.path.rmdir()
        if self._fd is not None:  # the root lock itself failed (its directory removed): still let go
            os.close(self._fd)
            self._fd = None


def default_dir(root: Path, kind: str, size: str) -> Path:
    """The directory of a tier given by kind and size only: named by a hash of that configuration."""
    digest = hashlib.sha256(f"{kind}:{size.strip().lower().replace(' ', '')}".encode()).hexdigest()[:12]
    return root / f"{kind}-{digest}"


def claim(base: Path, root: Path, *, exclusive: bool = False) -> TierDir:
    """Own ``base`` (or ``base-1``, ``base-2``... while a live engine holds it; ``exclusive``: only
    ``base``, else an ``InvalidRequest`` naming the process that holds it), emptied of kvbaton's
    block files; collect the directories crashed owners left under ``root`` first."""
    try:
        with _root_lock(root):
            collect(root)
            for n in range(1 if exclusive else MAX_SUFFIX):
                path = base if n == 0 else base.with_name(f"{base.name}-{n}")
                fd = _lock(path)
                if fd is None and exclusive:
                    raise _held(path)
                if fd is None:
                    continue  # a live engine of the same configuration has it
                try:
                    _clear(path)  # a crash's leftovers: their checksums died with it
                    os.ftruncate(fd, 0)
                    os.write(fd, f"{os.getpid()}\n".encode())
                except OSError:
                    os.close(fd)
                    raise
                owned = TierDir(path, root, fd)
                with _owned_lock:
                    _owned.add(owned)
                return owned
    except OSError as exc:
        where = exc.filename or base
        raise InvalidRequest(f"tier directory {where} is not usable: {exc.strerror or exc}") from exc
    raise InvalidRequest(f"tier directory {base}: {MAX_SUFFIX} live engines already use this configuration")


def collect(root: Path) -> int:
    """Remove the tier directories under ``root`` that no live process owns; how many (root lock held)."""
    removed = 0
    for path in sorted(root.iterdir()) if root.is_dir() else ():
        if not path.is_dir():
            continue
        legacy = _LEGACY_DIR.match(path.name)
        if legacy:  # one directory per process, never reused: gone once its process is
            if not _alive(int(legacy.group(1))):
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
            continue
        if not (path / LOCK_NAME).exists():
            continue  # not a tier directory of ours
        fd = _lock(path)
        if fd is None:
            continue
        _clear(path)
        (path / LOCK_NAME).unlink(missing_ok=True)
        os.close(fd)
        with contextlib.suppress(OSError):
            path.rmdir()
        removed += 1
        log.info("removed tier directory %s left by an engine that did not exit cleanly", path)
    return removed


def _held(path: Path) -> InvalidRequest:
    pid = owner_pid(path)
    who, stop = (f"process {pid}", f"Stop it (kill -TERM {pid})") if pid is not None else ("another process", "Stop it")
    return InvalidRequest(
        f"the persist directory {path} is locked by {who}, a live kvbaton engine of the same disk tier: its "
        f"handles are served there. {stop} and start again, or give this server a directory of its own "
        "(--tier disk:SIZE:PATH)"
    )


def owner_pid(path: Path) -> int | None:
    """The pid written in a tier directory's lock file, if any."""
    try:
        return int((path / LOCK_NAME).read_text().strip() or 0) or None
    except (OSError, ValueError):
        return None


def _lock(path: Path) -> int | None:
    """Create ``path`` if needed and take its owner lock: the open fd, or None when a live owner holds it."""
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    probe = path / f".probe-{os.getpid()}"
    try:  # the lock file may pre-exist in a directory that is no longer writable: check for real
        probe.touch()
        probe.unlink()
    except OSError:
        os.close(fd)
        raise
    return fd


def _clear(path: Path) -> None:
    for file in path.iterdir() if path.is_dir() else ():
        if _OWN_FILE.match(file.name):
            file.unlink(missing_ok=True)


@contextlib.contextmanager
def _root_lock(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for a few file operations only
        yield
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


@atexit.register
def _release_all() -> None:
    with _owned_lock:
        owned = list(_owned)
    for tier_dir in owned:
        tier_dir.release()
