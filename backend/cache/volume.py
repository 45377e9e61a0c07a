"""The volume under a disk tier's directory: its free space, the reserve the cache leaves free, and
whole-or-nothing file writes.

A disk tier's block files, a persistent engine's saved blocks and its handle journal share one
directory (:mod:`.tierdirs`), so one filesystem, which other processes may share too. The tier's
files are a cache and the journal is not, so what may be written where is decided here:

- every write of the cache (a tier's block, a block saved at exit) leaves :meth:`Volume.reserve`
  bytes free: the tier's effective capacity is the smaller of its configured size and the
  volume's free space less the reserve (:meth:`Volume.room_for`, read from the filesystem at every
  write: nothing is cached, since others write to the volume too);
- the reserve is a margin (``MARGIN_BYTES``, at most a sixteenth of the volume) that keeps a cache
  from ever filling a shared volume, plus what the volume's other owners ask for
  (:meth:`Volume.keep`): a persistent engine's handle journal asks for ``JOURNAL_RESERVE_BYTES``
  (at most an eighth of the volume) and twice its own size, so it can always append a line and
  write a compacted copy of itself before the rename;
- the journal itself writes regardless of the reserve: it is what the reserve is for.

:func:`write_all` and :func:`replace` write a file whole or raise: a nearly full disk takes part of
a write and says so only by the count, and a short write taken for a whole one would leave a torn
file. Every failure is an ``OSError`` with its ``errno`` (``ENOSPC`` for a full volume).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from pathlib import Path

MIB = 2**20
MARGIN_BYTES = 4 * MIB  # always left free by a cache, at most 1/16 of the volume
JOURNAL_RESERVE_BYTES = 4 * MIB  # kept for a persistent engine's journal beyond twice its size, at most 1/8
FILE_ROUNDING = 4096  # a file takes whole filesystem blocks


class Volume:
    """The filesystem holding ``path``: free space and the reserve a cache must leave free."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._extra: list[Callable[[], int]] = []

    def free(self) -> int:
        """Bytes an unprivileged writer may still write on the volume."""
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def total(self) -> int:
        st = os.statvfs(self.path)
        return st.f_blocks * st.f_frsize

    def keep(self, extra: Callable[[], int]) -> None:
        """Also keep ``extra()`` bytes free from the cache's writes (read at every check)."""
        self._extra.append(extra)

    def reserve(self) -> int:
        """Bytes the cache leaves free: the margin plus what the volume's other owners keep."""
        return min(MARGIN_BYTES, self.total() // 16) + sum(extra() for extra in self._extra)

    def room_for(self, nbytes: int) -> bool:
        """Whether the cache may write ``nbytes`` more and still leave the reserve free. A volume that
        cannot be read (its directory removed) says yes: the write itself then fails and says why."""
        try:
            return self.free() - self.reserve() >= nbytes
        except OSError:
            return True

    def journal_reserve(self) -> int:
        """The fixed part of a journal's reserve on this volume."""
        try:
            return min(JOURNAL_RESERVE_BYTES, self.total() // 8)
        except OSError:
            return JOURNAL_RESERVE_BYTES


def on_disk(nbytes: int) -> int:
    """The space a file of ``nbytes`` takes (whole filesystem blocks)."""
    return -(-nbytes // FILE_ROUNDING) * FILE_ROUNDING


def full(what: str) -> OSError:
    """The ``ENOSPC`` of a write refused to keep the reserve free."""
    return OSError(errno.ENOSPC, f"no room for {what} beyond the space kept free on the volume")


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` to ``fd`` or raise (see the module docstring)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, "no space left: the write made no progress")
        view = view[n:]


def replace(path: Path, data: bytes, *, durable: bool) -> None:
    """Replace ``path`` by ``data`` whole, or leave it as it was: a temporary file next to it, then a
    rename. ``durable``: the data and the rename are ``fsync``'d (they survive a crash)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        write_all(fd, data)
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):  # a partial file of a full disk, if any
            tmp.unlink()
        raise
    os.close(fd)
    os.replace(tmp, path)
    if durable:
        sync_dir(path.parent)


def sync_dir(path: Path) -> None:
    """``fsync`` a directory: the renames and creations in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
