"""Where each handle of a cluster lives, and which worker runs a request.

:class:`Router` keeps, for every live handle of the cluster, its latest metadata (lineage included),
the worker holding its KV and the tenant that made it, and places each request on a worker. A request
is a :class:`Ticket`, opened by one of:

- :meth:`Router.begin_on_handle`: the handle's worker, after moving the handle when placement
  (:mod:`.placement`) prefers a less loaded worker;
- :meth:`Router.begin_on_handles`: the worker already holding most of several handles' tokens
  (compose, merge and fidelity read several handles' K/V at once), the others brought there first;
- :meth:`Router.begin_anywhere`: the worker with the longest cached prefix, balanced by load;

then the ingress that opened it calls the worker itself (the request and its stream never pass
through the router) and ends the ticket: :meth:`started` once the worker admitted it, :meth:`done`
with the handles it made, or :meth:`failed` (its worker died: the ingress opens another). A move goes
by KV transfer or recompute from lineage, whichever :mod:`.moves` predicts cheaper.

The tickets are plain data, so the router runs in the ingress's process (one ingress) or in a Ray
actor that several ingresses share (:mod:`.control`).

Invariants: a handle is **leased** to one ticket at a time, from its placement (moves included) until
the worker admitted the request (``started``): so no move takes a handle away under a request being
started on it; a ticket leasing several handles takes them all at once (no lock order, no deadlock).
Every wait is bounded: a lease is waited for at most ``LEASE_WAIT_S``, and one older than
``LEASE_TTL_S`` (its ingress died mid-request) is broken. A handle whose worker died has no worker
(``rank`` None) and is recomputed from its lineage on next use; placement attempts are bounded (one
more than the number of workers), then ``ServerError``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvbaton.errors import HandleNotFound, HandleReleased, InvalidRequest, ServerError, ServerUnavailable
from kvbaton.handle import Handle
from kvbaton.ops import HandleLike

from ..handles import HandleTable
from .moves import Mover
from .placement import Placer
from .remote import WorkerLost, WorkerRef

log = logging.getLogger(__name__)

LEASE_WAIT_S = 300.0  # the longest a request waits for a handle another request is moving or starting on
LEASE_TTL_S = 300.0  # a lease older than this is broken: the ingress holding it died before starting its request
TICKET_TTL_S = 3600.0  # a ticket not ended after this long no longer counts in its worker's load (its ingress died)


@dataclass(eq=False)
class Placed:
    """A live handle of the cluster: its latest metadata (lineage included), the worker holding its
    KV (None: lost with its worker, recomputed from lineage on next use), the tenant that made it
    (None: not named), and the ticket it is leased to (None: free) since when."""

    meta: Handle
    rank: int | None
    owner: str | None = None
    lease: int | None = None
    leased_at: float = 0.0


@dataclass(frozen=True)
class Ticket:
    """A request placed on worker ``rank``, holding the leases of ``hids`` until it started."""

    id: int
    rank: int
    hids: tuple[str, ...] = ()


@dataclass
class _Open:
    ticket: Ticket
    opened: float
    leased: bool


class Router:
    """The cluster's handles by worker, and the choice of worker for each request (see the module
    docstring). ``workers`` is the cluster's own list, by rank; ``mover`` is set once the workers
    have said their block geometry."""

    def __init__(self, placer: Placer, workers: list[WorkerRef]) -> None:
        self.placer = placer
        self.workers = workers
        self.table: HandleTable[Placed] = HandleTable()  # its identity is known once the workers joined
        self.lock = threading.RLock()  # guards every Placed's fields and the open tickets
        self._free = threading.Condition(self.lock)  # a lease was given back
        self.mover: Mover | None = None
        self.retries = 0  # requests re-run because a worker died under them
        self._ids = itertools.count(1)
        self._open: dict[int, _Open] = {}
        self._reaped = time.monotonic()

    # -- workers --------------------------------------------------------------------------------
    def live_workers(self) -> list[WorkerRef]:
        live = [w for w in self.workers if w.alive]
        if not live:
            raise ServerError("every worker is down")
        return live

    def worker(self, device: int | str) -> WorkerRef:
        """The live worker a rank (or ``worker:R``) or a device name unique among the workers names."""
        if isinstance(device, bool):
            raise InvalidRequest(f"invalid device {device!r}")
        if isinstance(device, str) and device.removeprefix("worker:").isdigit():
            device = int(device.removeprefix("worker:"))
        if isinstance(device, int):
            if not 0 <= device < len(self.workers):
                raise InvalidRequest(f"no worker {device}: this server has workers 0..{len(self.workers) - 1}")
            worker = self.workers[device]
        else:
            matches = [w for w in self.workers if w.device == device]
            if len(matches) != 1:
                raise InvalidRequest(
                    f"device {device!r} names {len(matches)} workers ({', '.join(w.device for w in self.workers)}): "
                    "use the worker rank (an integer) instead"
                )
            worker = matches[0]
        if not worker.alive:
            raise InvalidRequest(f"worker {worker.rank} ({worker.device}) is down")
        return worker

    def worker_lost(self, worker: WorkerRef) -> None:
        """Handles that lived only on ``worker`` are recomputed from their lineage on next use."""
        with self.lock:
            lost = [placed for placed in self.table.states() if placed.rank == worker.rank]
            for placed in lost:
                placed.rank = None
        self.placer.forget_worker(worker.rank)
        log.error("worker %d lost: %d handles will be recomputed from lineage on next use", worker.rank, len(lost))

    def rejoined(self, rank: int, held: Iterable[Handle]) -> list[str]:
        """Worker ``rank`` came back (Ray restarted it) holding ``held`` (its journal's handles, with
        persistence): those nobody has brought elsewhere meanwhile live there again, and unknown ones
        (an ingress that restarted) join the table; the ids it should release (moved or released since)."""
        stale = []
        with self.lock:
            for h in held:
                placed = self.table.find(h.id)
                if placed is None:
                    try:
                        self.table.get(h.id)
                    except HandleReleased:  # released while the worker was down: not to come back
                        stale.append(h.id)
                    except HandleNotFound:
                        self.table.add(h.id, Placed(h, rank))
                elif placed.rank is None:
                    placed.rank = rank
                elif placed.rank != rank:
                    stale.append(h.id)
        return stale

    # -- handles --------------------------------------------------------------------------------
    def hid(self, handle: HandleLike) -> str:
        return self.table.id_of(handle)

    def known(self, hid: str) -> Placed:
        return self.table.get(hid)

    def describe(self, handle: HandleLike) -> Handle:
        placed = self.known(self.hid(handle))
        with self.lock:
            return placed.meta

    def owner_of(self, hid: str) -> tuple[str | None, int] | None:
        """(the tenant that made it, its tokens) of a live handle; None for an id not live here."""
        placed = self.table.find(hid)
        if placed is None:
            return None
        with self.lock:
            return placed.owner, placed.meta.num_tokens

    def record(self, rank: int, handles: Iterable[Handle], owner: str | None = None) -> None:
        """``handles`` now live on worker ``rank`` (new ones, made by tenant ``owner``; or moved: new
        metadata and worker, same owner)."""
        handles = list(handles)
        with self.lock:
            for h in handles:
                placed = self.table.find(h.id)
                if placed is None:
                    self.table.add(h.id, Placed(h, rank, owner))
                else:
                    placed.meta, placed.rank = h, rank
        for h in handles:
            self.placer.remember(rank, h.token_ids())

    def release(self, handles: HandleLike | Iterable[HandleLike]) -> dict[int, list[str]]:
        """Forget ``handles`` (all or nothing); their ids by the worker still holding them."""
        by_worker: dict[int, list[str]] = {}
        with self._free:
            for hid, placed in self.table.release(handles):
                if placed.rank is not None:
                    by_worker.setdefault(placed.rank, []).append(hid)
            self._free.notify_all()  # a request waiting for one of them learns it is gone
        return by_worker

    def held(self) -> dict[int, int]:
        """How many live handles each worker holds."""
        with self.lock:
            held = {w.rank: 0 for w in self.workers}
            for placed in self.table.states():
                if placed.rank is not None:
                    held[placed.rank] += 1
        return held

    # -- leases ---------------------------------------------------------------------------------
    def _lease(self, hids: Sequence[str], tid: int) -> None:
        """Lease every handle of ``hids`` to ticket ``tid`` at once (waiting, bounded, for the others)."""
        deadline = time.monotonic() + LEASE_WAIT_S
        with self._free:
            while True:
                now = time.monotonic()
                placed = [self.known(hid) for hid in hids]  # released meanwhile: its typed error
                busy = [p.leased_at + LEASE_TTL_S - now for p in placed
                        if p.lease is not None and now - p.leased_at < LEASE_TTL_S]
                if not busy:
                    for hid, p in zip(hids, placed, strict=True):
                        if p.lease is not None:
                            log.warning("handle %s: breaking the lease of request %d, open for %.0f s (its ingress "
                                        "is gone?)", hid[:8], p.lease, now - p.leased_at)
                        p.lease, p.leased_at = tid, now
                    return
                if now >= deadline:
                    raise ServerUnavailable(f"handle(s) {', '.join(h[:8] for h in hids)} stayed busy (being moved or "
                                            f"started on) for {LEASE_WAIT_S:.0f} s: retry later")
                self._free.wait(min(deadline - now, *busy))

    def _unlease(self, tid: int, hids: Iterable[str]) -> None:
        with self._free:
            for hid in hids:
                placed = self.table.find(hid)
                if placed is not None and placed.lease == tid:
                    placed.lease = None
            self._free.notify_all()

    # -- tickets: where a request runs ----------------------------------------------------------------
    def _opened(self, tid: int, rank: int, hids: tuple[str, ...]) -> Ticket:
        ticket = Ticket(tid, rank, hids)
        now = time.monotonic()
        with self.lock:
            self._open[tid] = _Open(ticket, now, bool(hids))
            if now - self._reaped > 60:  # tickets whose ingress never ended them stop counting as load
                self._reaped = now
                for old in [o for o in self._open.values() if now - o.opened > TICKET_TTL_S]:
                    del self._open[old.ticket.id]
                    self.placer.done(old.ticket.rank)
        return ticket

    def begin_on_handle(self, handle: HandleLike) -> Ticket:
        """A ticket on the worker that should serve a request on ``handle``, the handle moved or
        recomputed there first when placement says so; the handle stays leased until it started."""
        hid = self.hid(handle)

        def target(where: dict[str, int | None], sizes: dict[str, int]) -> WorkerRef:
            rank = where[hid]
            return self.placer.for_handle(self.workers[rank] if rank is not None else None, self.workers)

        return self._begin((hid,), target, "balance")

    def begin_on_handles(self, handles: Sequence[HandleLike]) -> Ticket:
        """A ticket on one worker holding every handle of ``handles``: the one already holding the most
        tokens; the others are brought there first (transfer or recompute, as the cost model says)."""

        def target(where: dict[str, int | None], sizes: dict[str, int]) -> WorkerRef:
            held: dict[int, int] = {}
            for hid, rank in where.items():
                if rank is not None and self.workers[rank].alive:
                    held[rank] = held.get(rank, 0) + sizes[hid]
            if not held:
                return self.placer.least_loaded(self.workers)
            return self.workers[max(held, key=lambda r: (held[r], -r))]

        return self._begin(tuple(sorted({self.hid(h) for h in handles})), target, "colocate")

    def _begin(self, hids: tuple[str, ...], target: Callable[[dict[str, int | None], dict[str, int]], WorkerRef],
               reason: str) -> Ticket:
        """A ticket on the worker ``target(where, sizes)`` picks from each handle's worker and tokens, every
        handle of ``hids`` leased and brought there first (``reason`` the move's; ``lost`` for a handle whose
        worker died), again when a worker dies during a move."""
        tid = next(self._ids)
        self._lease(hids, tid)
        try:
            for _ in range(len(self.workers) + 1):
                with self.lock:  # read here: ``place`` runs ``target`` under the placer's lock
                    where = {hid: self.known(hid).rank for hid in hids}
                    sizes = {hid: self.known(hid).meta.num_tokens for hid in hids}
                chosen = self.placer.place(lambda where=where, sizes=sizes: target(where, sizes))
                try:
                    for hid, rank in where.items():
                        holder = self.workers[rank] if rank is not None else None
                        if holder is not chosen:
                            self.move(hid, holder, chosen, reason if holder is not None and holder.alive else "lost")
                except WorkerLost:
                    self.placer.done(chosen.rank)
                    self.retries += 1
                    continue
                except BaseException:
                    self.placer.done(chosen.rank)
                    raise
                return self._opened(tid, chosen.rank, hids)
            raise ServerError("no worker could serve the request")
        except BaseException:
            self._unlease(tid, hids)
            raise

    def begin_anywhere(self, tokens: Sequence[int] | None) -> Ticket:
        """A ticket on the worker placement picks for a prompt of ``tokens`` (None: no prompt)."""
        if not any(w.info.get("prefix_cache", True) for w in self.workers):
            tokens = None  # no prefix cache anywhere: locality of prompts means nothing
        target = self.placer.place(lambda: self.placer.for_tokens(tokens, self.live_workers()))
        return self._opened(next(self._ids), target.rank, ())

    def started(self, ticket: Ticket) -> None:
        """The worker admitted the request: its handles may move again."""
        with self.lock:
            opened = self._open.get(ticket.id)
            leased = opened is not None and opened.leased
            if leased:
                opened.leased = False  # type: ignore[union-attr]
        if leased:
            self._unlease(ticket.id, ticket.hids)

    def done(self, ticket: Ticket, handles: Iterable[Handle] = (), owner: str | None = None) -> None:
        """The request ended, making ``handles`` on its worker (their tenant: ``owner``, else the
        tenant of the handle it ran on)."""
        if owner is None and ticket.hids:
            placed = self.table.find(ticket.hids[0])
            owner = placed.owner if placed is not None else None
        self.record(ticket.rank, handles, owner)
        self._end(ticket)

    def failed(self, ticket: Ticket, lost: bool) -> None:
        """The request failed; ``lost``: its worker died under it (the ingress runs it again elsewhere)."""
        self._end(ticket)
        if lost:
            self.retries += 1
            self.workers[ticket.rank].lost()

    def _end(self, ticket: Ticket) -> None:
        with self.lock:
            opened = self._open.pop(ticket.id, None)
        self._unlease(ticket.id, ticket.hids)
        if opened is not None:
            self.placer.done(ticket.rank)

    # -- moves ----------------------------------------------------------------------------------
    def transfer(self, handle: HandleLike, device: int | str, method: str) -> Handle:
        """Move ``handle`` to the worker ``device`` names, by ``method`` (``auto``: as the cost model says)."""
        hid = self.hid(handle)
        dst = self.worker(device)
        tid = next(self._ids)
        self._lease([hid], tid)
        try:
            for _ in range(len(self.workers) + 1):
                with self.lock:
                    placed = self.known(hid)
                    rank, current = placed.rank, placed.meta
                holder = self.workers[rank] if rank is not None else None
                if holder is dst:
                    return current
                try:
                    return self.move(hid, holder, dst, "explicit" if holder is not None else "lost", method)
                except WorkerLost:
                    self.retries += 1
                    if not dst.alive:
                        raise InvalidRequest(f"worker {dst.rank} ({dst.device}) went down") from None
            raise ServerError("the transfer could not be completed")
        finally:
            self._unlease(tid, [hid])

    def move(self, hid: str, src: WorkerRef | None, dst: WorkerRef, reason: str, method: str = "auto") -> Handle:
        """Bring ``hid`` to ``dst`` (its lease held), as :meth:`.moves.Mover.move` does; record where it is."""
        assert self.mover is not None, "the workers have not joined yet"
        new = self.mover.move(self.known(hid).meta, src, dst, reason, method)
        self.record(dst.rank, [new])
        return new
