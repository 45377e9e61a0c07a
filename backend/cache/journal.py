"""The handle journal (``state/handles.jsonl`` of a persistent engine, :mod:`.persist`): what a
restart brings back. Its lines are :mod:`.journal_format`'s.

The journal is written by one writer thread (:class:`Journal`): callers queue their records (a
bounded queue) and wait for them to be durable; the writer appends every queued record in one
write and one ``fsync`` (group commit), so a server's event loop never waits on the disk (it
awaits the commit's future) and many concurrent requests cost one ``fsync``. It compacts the
journal while running (its live handles only: temporary file, ``fsync``, ``rename``) whenever its
dead lines outnumber its live handles, so it stays within a small multiple of its live handles'
size. Each owner (a server's tenant) has at most ``MAX_HANDLES_PER_OWNER`` journaled handles and
``MAX_BYTES_PER_OWNER`` bytes of their lines: beyond either, its oldest handles are released from
the journal (they stay live in this process, and do not come back after a restart).

Space: the journal shares its volume with the tier's block files (:mod:`.volume`). It keeps a
reserve there that the cache's writes leave free (``JOURNAL_RESERVE_BYTES`` plus twice its size),
so a tier that fills the volume cannot stop it; when it still meets ``ENOSPC`` (another process
filled the volume) it has the disk tier give its blocks back and retries. When it cannot write
even so, it is ``failure`` (a message naming it): the records that needed it fail with that error,
releases stand in memory and are written with the next record that succeeds; the writer retries
every ``RETRY_S`` seconds while idle and clears ``failure`` by itself once a write succeeds.

Invariants: only exact handles are journaled (approximate K/V cannot be recomputed identically);
an ``add`` is durable before it is acknowledged, and a release's ``release`` line is durable
before the release is answered unless the journal cannot be written (then it is written with the
next record that can be, and the compaction drops it all the same), so released handles do not
come back; every wait on the writer has a deadline (``COMMIT_TIMEOUT_S``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbaton.handle import Handle

from . import journal_format
from .journal_format import Entry, add_line, encode
from .volume import MIB, Volume, replace, write_all

log = logging.getLogger(__name__)

MAX_HANDLES_PER_OWNER = 4096  # journaled live handles of one owner (a tenant); the oldest go beyond
MAX_BYTES_PER_OWNER = 64 * MIB  # bytes of one owner's journal lines; the oldest go beyond
COMPACT_MIN_DEAD = 256  # a journal with fewer dead lines is not worth rewriting while running
MAX_PENDING = 4096  # records queued for the writer; beyond, a record fails at once (503 on a server)
MAX_BATCH = 512  # records in one group commit
COMMIT_TIMEOUT_S = 60.0  # the longest a caller waits for its record to be durable
RETRY_S = 0.5  # while the journal cannot write: how often the idle writer tries again
PROBE_BYTES = 64 * 1024  # what an idle retry writes (and deletes) to learn the volume takes writes again


@dataclass
class _Record:
    """What a caller asks of the journal's writer, and the future it waits on."""

    kind: str  # "add", "retain", "release", "sync" or "stop"
    entries: Sequence[Entry] = ()
    ids: Sequence[str] = ()
    agent: str | None = None
    session: str = ""
    done: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


_Undo = tuple[str, Entry | None, int]  # a handle id, its entry before the batch (None: none), that entry's cost


class Journal:
    """The handle journal (see the module docstring): an append-only, checksummed file with one writer
    thread that group-commits, compacts while running, bounds each owner and keeps a reserve."""

    def __init__(
        self, path: Path, header: dict[str, Any], *, volume: Volume | None = None,
        reclaim: Callable[[int], int] | None = None, max_handles_per_owner: int = MAX_HANDLES_PER_OWNER,
        max_bytes_per_owner: int = MAX_BYTES_PER_OWNER,
    ) -> None:
        """``reclaim(nbytes)``: give back up to that much of the volume's cache (the disk tier's blocks),
        returning the bytes it freed; called when a write meets ``ENOSPC``."""
        self.path = path
        self.header = header
        self.volume = volume or Volume(path.parent)
        self._reclaim = reclaim
        self._max_handles, self._max_bytes = max_handles_per_owner, max_bytes_per_owner
        self._lock = threading.Lock()  # the live entries, for readers in other threads (the writer alone changes them)
        self._live: dict[str, Entry] = {}
        self._known: set[str] = set()  # ids live or queued to be (a release of any other id needs no write)
        self._cost: dict[str, int] = {}  # handle id -> bytes of its add line (what the per-owner bound counts)
        self._owned: dict[str | None, dict[str, None]] = {}  # owner -> its journaled ids, oldest first
        self._owner_bytes: dict[str | None, int] = {}
        self.dropped = 0  # entries of another model/dtype/block size dropped at open
        self.orphans = 0  # entries dropped at open because the line of the handle they build on is missing
        self.forgotten = 0  # entries released from the journal by the per-owner bound
        self.compactions = 0
        self._lines = 0  # lines after the header
        self._size = 0  # bytes of the file
        self._compact_at = COMPACT_MIN_DEAD  # dead lines that make the next compaction worth it
        self._failure: str | None = None
        self._owed: list[str] = []  # released ids whose release line could not be written yet
        self._forgotten_logged = 0
        self._closed = False
        self._fd: int | None = None
        self._load()
        self._known = set(self._live)
        try:
            self._compact()
        except OSError as exc:  # a full disk: the appended journal is valid as it is (compacted later)
            log.error("handle journal %s could not be rewritten: %s", self.path, exc)
            self._reopen()
        self.volume.keep(self.reserve)
        self._queue: queue.Queue[_Record] = queue.Queue(MAX_PENDING)
        self._writer = threading.Thread(target=self._run, name="kvbaton-journal", daemon=True)
        self._writer.start()

    # -- what callers see ----------------------------------------------------------------------
    @property
    def failure(self) -> str | None:
        """Why the journal cannot be written now (names it and the error); None while it can."""
        return self._failure

    @property
    def size(self) -> int:
        """The journal file's size in bytes."""
        return self._size

    def reserve(self) -> int:
        """The bytes the cache's writes leave free on the volume for the journal: its next appends and a
        compacted copy of it (see :mod:`.volume`)."""
        return self.volume.journal_reserve() + 2 * self._size

    def live(self) -> list[Entry]:
        with self._lock:
            return list(self._live.values())

    def submit_add(self, owner: str | None, handles: Iterable[Handle],
                   agent: str | None = None) -> concurrent.futures.Future[None]:
        """Queue live exact handles of ``owner`` (approximate ones are skipped); the future is done once
        they are durable, or fails with the ``OSError`` that kept them from being written. Never blocks."""
        entries = [Entry(h, owner, agent) for h in handles if h.exact]
        if not entries:
            done: concurrent.futures.Future[None] = concurrent.futures.Future()
            done.set_result(None)
            return done
        return self._submit(_Record("add", entries=entries))

    def add(self, owner: str | None, handles: Iterable[Handle], agent: str | None = None) -> None:
        """Journal live exact handles of ``owner`` (durable on return, else ``OSError``)."""
        self.wait(self.submit_add(owner, handles, agent))

    def retain(self, handle_id: str, agent: str, session: str = "") -> None:
        """Journal that ``agent``'s OpenAI slot in ``session`` (of the handle's owner) retains the handle
        (durable on return, else ``OSError``); a handle not journaled is ignored."""
        self.wait(self._submit(_Record("retain", ids=[handle_id], agent=agent, session=session)))

    def release(self, handle_ids: Iterable[str]) -> None:
        """Journal that these handles are gone; ids not journaled are ignored. Durable on return, unless
        the journal cannot be written (then logged: the release stands, its line follows later)."""
        with self._lock:
            ids = [hid for hid in handle_ids if hid in self._known]
            self._known.difference_update(ids)
        if not ids:
            return  # never journaled (a plain completion's handle, an approximate one): nothing to wait for
        try:
            self.wait(self._submit(_Record("release", ids=ids), block=True))
        except OSError as exc:
            log.error("handle journal %s: the release of %d handle(s) was not recorded: %s", self.path, len(ids), exc)

    def sync(self) -> None:
        """Return once everything queued before is written (or has failed)."""
        with contextlib.suppress(OSError):
            self.wait(self._submit(_Record("sync"), block=True))

    def wait(self, done: concurrent.futures.Future[None]) -> None:
        """Wait for a record's future, at most ``COMMIT_TIMEOUT_S``."""
        try:
            done.result(timeout=COMMIT_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise OSError(errno.ETIMEDOUT, f"the handle journal {self.path} did not commit within "
                                           f"{COMMIT_TIMEOUT_S:g} s") from None

    def close(self) -> None:
        """Write what is queued, stop the writer, and compact the journal one last time."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._queue.put(_Record("stop"), timeout=COMMIT_TIMEOUT_S)
        except queue.Full:
            log.error("handle journal %s: its writer did not take the stop in time", self.path)
        self._writer.join(COMMIT_TIMEOUT_S)
        if self._writer.is_alive():  # stuck in a write: leave the file as it is (valid, compacted at the next start)
            log.error("handle journal %s: its writer did not stop within %g s", self.path, COMMIT_TIMEOUT_S)
            return
        try:
            self._compact()
        except OSError as exc:  # the appended journal stays valid; it is rewritten at the next start
            log.error("handle journal %s could not be rewritten: %s", self.path, exc)
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _submit(self, record: _Record, block: bool = False) -> concurrent.futures.Future[None]:
        with self._lock:
            closed = self._closed
            if not closed:
                try:
                    self._queue.put_nowait(record)
                    self._known.update(e.handle.id for e in record.entries)
                    return record.done
                except queue.Full:
                    if not block:
                        record.done.set_exception(OSError(
                            errno.EAGAIN, f"the handle journal {self.path} has {MAX_PENDING} records waiting"))
                        return record.done
        if closed:
            record.done.set_exception(OSError(errno.EBADF, f"the handle journal {self.path} is closed"))
            return record.done
        try:  # outside the lock: the writer needs it to drain the queue (only releases and syncs get here)
            self._queue.put(record, timeout=COMMIT_TIMEOUT_S)
        except queue.Full:
            record.done.set_exception(OSError(errno.EAGAIN, f"the handle journal {self.path} is not keeping up"))
        return record.done

    # -- the writer thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                first = self._queue.get(timeout=RETRY_S if (self._failure or self._owed) else None)
            except queue.Empty:
                try:
                    self._retry()
                except Exception:  # the writer outlives any one retry
                    log.exception("handle journal %s: a retry failed", self.path)
                continue
            batch = [first]
            while batch[-1].kind != "stop" and len(batch) < MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            # A record its caller gave up on (a timed-out or cancelled wait) is not written: its handles were released.
            batch = [r for r in batch if r.done.set_running_or_notify_cancel()]
            if not batch:
                continue
            try:
                self._commit([r for r in batch if r.kind != "stop"])
                self._maybe_compact()
            except BaseException as exc:  # never leave a caller waiting on a dead writer
                log.exception("handle journal %s: the writer failed", self.path)
                for record in batch:
                    if not record.done.done():
                        record.done.set_exception(OSError(errno.EIO, f"the handle journal's writer failed: {exc}"))
            if batch[-1].kind == "stop":
                batch[-1].done.set_result(None)
                while True:  # anything queued after the stop: closed
                    try:
                        late = self._queue.get_nowait()
                    except queue.Empty:
                        return
                    if late.done.set_running_or_notify_cancel():
                        late.done.set_exception(OSError(errno.EBADF, f"the handle journal {self.path} is closed"))

    def _commit(self, records: list[_Record]) -> None:
        """Write every record's lines in one append and one ``fsync``; on failure, undo the adds and
        slots (their callers are told) and keep the releases (their lines are owed)."""
        lines: list[bytes] = []
        undo: list[_Undo] = []
        released: list[str] = []
        forgotten: list[str] = []
        for record in records:
            if record.kind == "add":
                new = {e.handle.id for e in record.entries}
                for entry in record.entries:
                    if entry.handle.id in self._live:
                        continue  # journaled already (a transfer to the device it is on answers the same handle)
                    line = add_line(entry, self._live, self._live.__contains__)
                    undo.append((entry.handle.id, None, 0))
                    self._put(entry, len(line))
                    lines.append(line)
                forgotten += self._bound(record.entries[0].owner, new, undo)
            elif record.kind == "retain":
                (hid,) = record.ids
                entry = self._live.get(hid)
                if entry is None:
                    continue
                undo.append((hid, entry, self._cost[hid]))
                self._replace(hid, Entry(entry.handle, entry.owner, entry.agent, record.agent, record.session))
                lines.append(encode({"slot": hid, "agent": record.agent, "session": record.session}))
            elif record.kind == "release":
                for hid in record.ids:
                    if self._pop(hid) is not None:
                        released.append(hid)
        gone = self._owed + released + forgotten
        if gone:
            lines.append(encode({"release": gone}))
        try:
            if lines:
                self._write(b"".join(lines))
        except OSError as exc:
            self._failed(exc)
            for hid, before, cost in reversed(undo):  # the adds and slots did not happen; releases stand
                self._pop(hid)
                if before is not None:
                    self._put(before, cost)
            with self._lock:
                self._known.difference_update(e.handle.id for r in records if r.kind == "add" for e in r.entries
                                              if e.handle.id not in self._live)
            self._owed += released
            error = OSError(exc.errno, self._failure)
            for record in records:
                if record.kind in ("add", "retain"):
                    record.done.set_exception(error)
                else:
                    record.done.set_result(None)
            if released:
                log.error("handle journal %s: the release of %d handle(s) is written with the next record that can "
                          "be", self.path, len(released))
            return
        self._lines += len(lines)
        self._owed = []
        if lines:
            self._recovered()
        if forgotten:
            with self._lock:
                self._known.difference_update(forgotten)
            self._forgot(records, len(forgotten))
        for record in records:
            record.done.set_result(None)

    def _bound(self, owner: str | None, new: set[str], undo: list[_Undo]) -> list[str]:
        """Release ``owner``'s oldest entries (not those just added) while it is over its bounds."""
        ids = self._owned.get(owner, {})
        gone: list[str] = []
        while len(ids) > self._max_handles or self._owner_bytes.get(owner, 0) > self._max_bytes:
            oldest = next((hid for hid in ids if hid not in new), None)
            if oldest is None:
                break
            before = self._pop(oldest)
            assert before is not None
            undo.append((oldest, *before))
            gone.append(oldest)
        return gone

    def _forgot(self, records: list[_Record], n: int) -> None:
        self.forgotten += n
        if self.forgotten >= 2 * self._forgotten_logged:  # the 1st, then each doubling: a busy tenant cannot flood
            self._forgotten_logged = self.forgotten
            owner = next((r.entries[0].owner for r in records if r.kind == "add"), None)
            log.warning("handle journal %s: %s is over its %d journaled handles or %d bytes of them: its oldest "
                        "handles are no longer journaled (they stay live until released, but do not come back after "
                        "a restart) [%d so far]", self.path, f"tenant {owner}" if owner else "the engine's owner",
                        self._max_handles, self._max_bytes, self.forgotten)

    def _write(self, data: bytes) -> None:
        """Append ``data`` durably; on ``ENOSPC`` have the disk tier give space back and try once more."""
        try:
            self._append(data)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or not self._give_back(len(data)):
                raise
            self._append(data)

    def _append(self, data: bytes) -> None:
        if self._fd is None:
            self._reopen()
        assert self._fd is not None
        end = os.lseek(self._fd, 0, os.SEEK_END)
        if end == 0:  # a journal whose rewrite failed before it had a header: the header first
            data = encode({"header": self.header}) + data
        try:
            write_all(self._fd, data)
            os.fsync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):  # a partial line of a full disk must not stay in the middle
                os.ftruncate(self._fd, end)
            raise
        self._size = end + len(data)

    def _give_back(self, nbytes: int) -> bool:
        """Have the disk tier give back room for ``nbytes`` and then some; whether it freed any."""
        if self._reclaim is None:
            return False
        return self._reclaim(max(2 * nbytes, self.volume.journal_reserve())) > 0

    def _failed(self, exc: OSError) -> None:
        message = f"the handle journal {self.path} cannot be written ({exc.strerror or exc})"
        if self._failure is None:
            log.error("%s: requests that make handles fail until it can; retrying every %g s", message, RETRY_S)
        self._failure = message

    def _recovered(self) -> None:
        if self._failure is not None:
            log.warning("the handle journal %s can be written again", self.path)
            self._failure = None

    def _retry(self) -> None:
        """While the journal cannot write (or owes release lines) and nothing is queued: try again."""
        if self._owed:
            self._commit([])
            return
        probe = self.path.with_name(".probe")
        try:
            try:
                fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    write_all(fd, bytes(PROBE_BYTES))
                    os.fsync(fd)
                finally:
                    os.close(fd)
            finally:
                with contextlib.suppress(OSError):
                    probe.unlink()
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                self._give_back(PROBE_BYTES)
            self._failed(exc)
            return
        self._recovered()

    def _maybe_compact(self) -> None:
        """Rewrite the journal with its live handles once its dead lines outnumber them."""
        dead = self._lines - len(self._live)
        if dead <= len(self._live) or dead < self._compact_at:
            return
        try:
            self._compact()
        except OSError as exc:  # the appended journal is valid as it is: try again once it has grown by half
            self._compact_at = dead + max(dead // 2, COMPACT_MIN_DEAD)
            log.warning("handle journal %s could not be compacted (%s); tried again at %d dead lines", self.path, exc,
                        self._compact_at)
            return
        self._compact_at = COMPACT_MIN_DEAD

    def _compact(self) -> None:
        """Replace the journal by its header and live handles (each by reference to a live handle
        written before it where it can be), atomically, then append to the new file."""
        lines = [encode({"header": self.header})]
        written: set[str] = set()
        costs: dict[str, int] = {}
        for entry in list(self._live.values()):
            line = add_line(entry, self._live, written.__contains__)
            lines.append(line)
            written.add(entry.handle.id)
            costs[entry.handle.id] = len(line)
        data = b"".join(lines)
        try:
            replace(self.path, data, durable=True)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or not self._give_back(len(data)):
                raise
            replace(self.path, data, durable=True)
        with self._lock:
            for hid, cost in costs.items():
                owner = self._live[hid].owner
                self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + cost - self._cost[hid]
                self._cost[hid] = cost
        self._lines = len(lines) - 1
        self.compactions += 1
        self._reopen()

    def _reopen(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._size = os.fstat(self._fd).st_size

    # -- the live entries (changed by the writer, or before it starts and after it stops) ----------
    def _put(self, entry: Entry, cost: int) -> None:
        with self._lock:
            hid, owner = entry.handle.id, entry.owner
            self._live[hid] = entry
            self._cost[hid] = cost
            self._owned.setdefault(owner, {})[hid] = None
            self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + cost

    def _replace(self, hid: str, entry: Entry) -> None:
        with self._lock:
            self._live[hid] = entry  # the same owner: its place in the order and its cost stay

    def _pop(self, hid: str) -> tuple[Entry, int] | None:
        with self._lock:
            entry = self._live.pop(hid, None)
            if entry is None:
                return None
            cost = self._cost.pop(hid)
            owned = self._owned[entry.owner]
            del owned[hid]
            if not owned:
                del self._owned[entry.owner]
            self._owner_bytes[entry.owner] -= cost
            return entry, cost

    # -- reading the file at open ----------------------------------------------------------------
    def _load(self) -> None:
        found = journal_format.read(self.path, self.header)
        self._lines, self.dropped, self.orphans = found.lines, found.dropped, found.orphans
        for entry, cost in found.entries.values():
            self._put(entry, cost)
