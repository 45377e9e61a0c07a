"""Where each handle of a cluster lives, and which worker runs a request.

:class:`Router` keeps, for every live handle of the cluster, its latest metadata (lineage included)
and the worker holding its KV, and starts each request on a worker:

- on a handle's worker (:meth:`Router.on_handle`), after moving the handle when placement
  (:mod:`.placement`) prefers a less loaded worker;
- on the worker already holding most of several handles' tokens (:meth:`Router.on_handles`:
  compose, merge and fidelity read several handles' K/V at once), the others brought there first;
- anywhere (:meth:`Router.anywhere`): the worker with the longest cached prefix, balanced by queue
  length;

retrying on another worker when one dies. A move goes by KV transfer or recompute from lineage,
whichever :mod:`.moves` predicts cheaper.

Invariants: a handle's moves are serialized by its own lock, and a call holding several handles'
locks takes them in sorted id order (two such calls cannot deadlock); a handle whose worker died
has no worker (``rank`` None) and is recomputed from its lineage on next use; every attempt is
bounded (one more than the number of workers), then ``ServerError``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvbaton.errors import HandleNotFound, HandleReleased, InvalidRequest, ServerError
from kvbaton.handle import Handle
from kvbaton.ops import HandleLike

from ..handles import HandleTable
from .moves import Mover
from .placement import Placer
from .remote import WorkerLost, WorkerRef

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(eq=False)
class Placed:
    """A live handle of the cluster: its latest metadata (lineage included), the worker holding its
    KV (None: lost with its worker, recomputed from lineage on next use), and the lock serializing
    moves of it."""

    meta: Handle
    rank: int | None
    lock: threading.Lock = field(default_factory=threading.Lock)


class Router:
    """The cluster's handles by worker, and the choice of worker for each request (see the module
    docstring). ``workers`` is the cluster's own list, by rank; ``mover`` is set once the workers
    have said their block geometry."""

    def __init__(self, placer: Placer, workers: list[WorkerRef]) -> None:
        self.placer = placer
        self.workers = workers
        self.table: HandleTable[Placed] = HandleTable()  # its identity is known once the workers joined
        self.lock = threading.RLock()  # guards every Placed's meta and rank
        self.mover: Mover | None = None
        self.retries = 0  # requests re-run because a worker died under them

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

    def record(self, rank: int, handles: Iterable[Handle]) -> None:
        """``handles`` now live on worker ``rank`` (new ones, or moved: same lock, new metadata and worker)."""
        with self.lock:
            for h in handles:
                placed = self.table.find(h.id)
                if placed is None:
                    self.table.add(h.id, Placed(h, rank))
                else:
                    placed.meta, placed.rank = h, rank
        for h in handles:
            self.placer.remember(rank, h.token_ids())

    def release(self, handles: HandleLike | Iterable[HandleLike]) -> dict[int, list[str]]:
        """Forget ``handles`` (all or nothing); their ids by the worker still holding them."""
        by_worker: dict[int, list[str]] = {}
        with self.lock:
            for hid, placed in self.table.release(handles):
                if placed.rank is not None:
                    by_worker.setdefault(placed.rank, []).append(hid)
        return by_worker

    def held(self) -> dict[int, int]:
        """How many live handles each worker holds."""
        with self.lock:
            held = {w.rank: 0 for w in self.workers}
            for placed in self.table.states():
                if placed.rank is not None:
                    held[placed.rank] += 1
        return held

    # -- where a request runs ---------------------------------------------------------------------
    def on_handle(self, handle: HandleLike, start: Callable[[WorkerRef, str], T]) -> T:
        """Run ``start`` on the worker that should serve a request on ``handle`` (moving or
        recomputing it there first when placement says so), retrying when a worker dies."""
        hid = self.hid(handle)
        for _ in range(len(self.workers) + 1):
            with self.known(hid).lock:
                placed = self.known(hid)
                with self.lock:
                    rank = placed.rank
                holder = self.workers[rank] if rank is not None else None
                try:
                    with self.placer.placing(lambda: self.placer.for_handle(holder, self.workers)) as target:
                        if target is not holder:
                            self.move(hid, holder, target, "lost" if holder is None or not holder.alive else "balance")
                        return start(target, hid)
                except WorkerLost:
                    self.retries += 1
                    continue
        raise ServerError("no worker could serve the request")

    def anywhere(self, tokens: Sequence[int] | None, start: Callable[[WorkerRef], T]) -> T:
        """Run ``start`` on the worker placement picks for a prompt of ``tokens`` (None: no prompt)."""
        if not any(w.info.get("prefix_cache", True) for w in self.workers):
            tokens = None  # no prefix cache anywhere: locality of prompts means nothing
        for _ in range(len(self.workers) + 1):
            try:
                with self.placer.placing(lambda: self.placer.for_tokens(tokens, self.live_workers())) as worker:
                    return start(worker)
            except WorkerLost:
                self.retries += 1
        raise ServerError("no worker could serve the request")

    def on_handles(self, handles: Sequence[HandleLike], start: Callable[[WorkerRef], T]) -> T:
        """Run ``start`` on one worker holding every handle in ``handles``: the one already holding
        the most tokens; the others are brought there first (transfer or recompute, as the cost model says)."""
        hids = sorted({self.hid(h) for h in handles})
        for _ in range(len(self.workers) + 1):
            locks = [self.known(hid).lock for hid in hids]
            for lock in locks:  # sorted ids: a fixed order, so two such calls cannot deadlock
                lock.acquire()
            try:
                placed = {hid: self.known(hid) for hid in hids}
                with self.lock:
                    where = {hid: p.rank for hid, p in placed.items()}
                    sizes = {hid: p.meta.num_tokens for hid, p in placed.items()}
                held: dict[int, int] = {}
                for hid, rank in where.items():
                    if rank is not None and self.workers[rank].alive:
                        held[rank] = held.get(rank, 0) + sizes[hid]
                target = (self.workers[max(held, key=lambda r: (held[r], -r))] if held
                          else self.placer.least_loaded(self.workers))
                try:
                    for hid, rank in where.items():
                        holder = self.workers[rank] if rank is not None else None
                        if holder is not target:
                            alive = holder is not None and holder.alive
                            self.move(hid, holder, target, "colocate" if alive else "lost")
                    return start(target)
                except WorkerLost:
                    self.retries += 1
            finally:
                for lock in reversed(locks):
                    lock.release()
        raise ServerError("no worker could serve the request")

    def transfer(self, handle: HandleLike, device: int | str, method: str) -> Handle:
        """Move ``handle`` to the worker ``device`` names, by ``method`` (``auto``: as the cost model says)."""
        hid = self.hid(handle)
        dst = self.worker(device)
        for _ in range(len(self.workers) + 1):
            placed = self.known(hid)
            with placed.lock:
                with self.lock:
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

    def move(self, hid: str, src: WorkerRef | None, dst: WorkerRef, reason: str, method: str = "auto") -> Handle:
        """Bring ``hid`` to ``dst`` (handle lock held), as :meth:`.moves.Mover.move` does; record where it is."""
        assert self.mover is not None, "the workers have not joined yet"
        new = self.mover.move(self.known(hid).meta, src, dst, reason, method)
        self.record(dst.rank, [new])
        return new
