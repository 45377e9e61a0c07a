"""Concurrency, fair between tenants: requests in flight and open streams, each bounded per tenant
and for the whole server.

Every request that makes the engine work holds a *slot* while it runs, its response included (a
stream's slot is held until the stream ends). At most ``max_requests`` slots are held at once, at
most ``per_tenant`` by one tenant; a request that finds none free waits in its tenant's queue, and
each slot that comes back goes to the next tenant in turn (round robin) that has a request waiting
and is under its own limit, so that a tenant sending many requests at once delays its own requests,
not the other tenants'. A request waits at most ``wait_s`` seconds (then 503 ``server_unavailable``,
with ``Retry-After``), and a tenant's queue holds at most ``max_queued`` requests (429
``quota_exceeded`` beyond, at once).

Streams are counted apart, because they may last, and generation streams apart from event
streams (``/v1/kv/events/stream``), so that idle event streams can never keep another tenant's
generations out: at most ``max_streams`` generation streams open at once, ``max_streams_per_tenant``
of one tenant, and ``max_event_streams`` / ``max_event_streams_per_tenant`` event streams; one more
is refused at once (429 ``quota_exceeded``). An event stream holds no slot: it waits on the event
loop, not in a worker thread (and ends once idle for the server's ``event_stream_idle_timeout``).

Invariants: everything here runs on the event loop (no locks); a slot or stream is given back
exactly once, on every exit path (``async with``); a slot freed while requests wait is handed to
the chosen waiter directly, so a newcomer cannot overtake the queue.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
from kvbaton.errors import KvbatonError, QuotaExceeded, ServerUnavailable
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import exception_response

if TYPE_CHECKING:
    from .args import ServerArgs

DEFAULT_WAIT_S = 30.0


GENERATION, EVENTS = "generation", "events"  # the two kinds of streams, each with its own caps


@dataclass
class _Tenant:
    running: int = 0  # slots held
    waiting: deque[anyio.Event] = field(default_factory=deque)  # FIFO; an event is set when handed a slot
    streams: dict[str, int] = field(default_factory=lambda: {GENERATION: 0, EVENTS: 0})


class Concurrency:
    """The slots and stream counts of one server (see the module docstring). ``None`` limits: none."""

    def __init__(self, max_requests: int | None, per_tenant: int | None, max_streams: int | None,
                 max_streams_per_tenant: int | None, wait_s: float = DEFAULT_WAIT_S,
                 max_queued: int | None = None, max_event_streams: int | None = None,
                 max_event_streams_per_tenant: int | None = None) -> None:
        self.max_requests = max_requests or math.inf
        self.per_tenant = min(per_tenant or math.inf, self.max_requests)
        # Per kind of stream: (all of them, one tenant's).
        self.stream_caps: dict[str, tuple[float, float]] = {
            GENERATION: (max_streams or math.inf, max_streams_per_tenant or math.inf),
            EVENTS: (max_event_streams or math.inf, max_event_streams_per_tenant or math.inf),
        }
        self.wait_s = wait_s
        # Queued requests beyond this are refused at once: a client cannot park unbounded work here.
        self.max_queued = max_queued or (4 * int(self.per_tenant) if self.per_tenant != math.inf else math.inf)
        self._tenants: dict[str, _Tenant] = {}
        self._order: deque[str] = deque()  # tenants with requests waiting, in turn
        self._running = 0
        self._streams = {GENERATION: 0, EVENTS: 0}
        self._exclusive: dict[str, anyio.Lock] = {}

    @classmethod
    def of_server(cls, args: ServerArgs, *, tenants: int) -> Concurrency:
        """A server's (its ``ServerArgs``): ``max_requests`` slots (default: its ``threads``), and by
        default a tenant of several (``tenants`` > 1) may hold half the threads."""
        threads = args.threads
        per_tenant = args.max_requests_per_tenant or (max(1, threads // 2) if tenants > 1 else None)
        return cls(args.max_requests or threads, per_tenant, args.max_streams, args.max_streams_per_tenant,
                   wait_s=args.queue_timeout, max_event_streams=args.max_event_streams,
                   max_event_streams_per_tenant=args.max_event_streams_per_tenant)

    def _tenant(self, name: str) -> _Tenant:
        tenant = self._tenants.get(name)
        if tenant is None:
            tenant = self._tenants[name] = _Tenant()
        return tenant

    # -- request slots ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def slot(self, tenant: str) -> AsyncIterator[None]:
        """Hold one of the tenant's request slots for the duration of the block (waiting fairly for one)."""
        await self.acquire(tenant)
        try:
            yield
        finally:
            self.release(tenant)

    async def acquire(self, name: str) -> None:
        """Take one of the tenant's request slots, waiting fairly for one; give it back with :meth:`release`."""
        tenant = self._tenant(name)
        # Free slots while others wait means those wait for their own limit: a newcomer overtakes nobody.
        if not tenant.waiting and tenant.running < self.per_tenant and self._running < self.max_requests:
            tenant.running += 1
            self._running += 1
            return
        if len(tenant.waiting) >= self.max_queued:
            raise QuotaExceeded(
                f"the tenant has {tenant.running} requests running and {len(tenant.waiting)} waiting, its limit: "
                "wait for answers before sending more"
            )
        handed = anyio.Event()
        tenant.waiting.append(handed)
        if name not in self._order:
            self._order.append(name)
        try:
            with anyio.fail_after(self.wait_s):
                await handed.wait()
        except BaseException as exc:
            if handed.is_set():  # handed a slot as the wait ended: give it back
                self.release(name)
            else:
                tenant.waiting.remove(handed)
                if not tenant.waiting and name in self._order:
                    self._order.remove(name)
            if isinstance(exc, TimeoutError):
                raise ServerUnavailable(
                    f"the server is busy: no request slot came free within {self.wait_s:g} s; retry later"
                ) from None
            raise

    def release(self, name: str) -> None:
        tenant = self._tenants[name]
        tenant.running -= 1
        self._running -= 1
        self._hand_over()

    def _hand_over(self) -> None:
        """Give free slots to waiting requests, one tenant after the other."""
        while self._running < self.max_requests and self._order:
            for _ in range(len(self._order)):
                name = self._order[0]
                self._order.rotate(-1)  # this tenant's turn is taken: the next one is first now
                tenant = self._tenants[name]
                if tenant.running < self.per_tenant:
                    handed = tenant.waiting.popleft()
                    if not tenant.waiting:
                        self._order.remove(name)
                    tenant.running += 1
                    self._running += 1
                    handed.set()
                    break
            else:
                return  # every waiting tenant is at its own limit

    # -- memory-heavy calls ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def one_at_a_time(self, what: str) -> AsyncIterator[None]:
        """Run the block alone among the server's ``what`` calls (a memory-heavy diagnostic: their
        peaks must not add up), waiting at most ``wait_s`` for the one running (then 503)."""
        lock = self._exclusive.get(what)
        if lock is None:
            lock = self._exclusive[what] = anyio.Lock()
        try:
            with anyio.fail_after(self.wait_s):
                await lock.acquire()
        except TimeoutError:
            raise ServerUnavailable(f"another {what} call has been running for over {self.wait_s:g} s; retry later") \
                from None
        try:
            yield
        finally:
            lock.release()

    # -- streams --------------------------------------------------------------------------------
    def open_stream(self, tenant: str, kind: str = GENERATION) -> Callable[[], None]:
        """Count an open stream of the tenant (``kind``: a generation or an event stream, each with its
        own caps), ``QuotaExceeded`` at once beyond the tenant's or the server's limit; returns the
        stream's ``close`` (idempotent), which stops counting it."""
        held = self._tenant(tenant)
        cap, per_tenant = self.stream_caps[kind]
        what = "generation streams" if kind == GENERATION else "event streams"
        if held.streams[kind] >= per_tenant:
            raise QuotaExceeded(f"the tenant has {held.streams[kind]} open {what}, its limit: close one first")
        if self._streams[kind] >= cap:
            raise QuotaExceeded(f"the server has {self._streams[kind]} open {what}, its limit: retry later")
        held.streams[kind] += 1
        self._streams[kind] += 1
        closed = False

        def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                held.streams[kind] -= 1
                self._streams[kind] -= 1

        return close

    # -- what the metrics show ----------------------------------------------------------------------
    def usage(self, tenant: str) -> tuple[int, int, int]:
        """The tenant's requests running, requests waiting, and open streams (of both kinds)."""
        held = self._tenants.get(tenant) or _Tenant()
        return held.running, len(held.waiting), sum(held.streams.values())

    def tenants(self) -> list[str]:
        return list(self._tenants)


class ConcurrencyMiddleware:
    """Holds a request slot (:meth:`Concurrency.slot`) of the request's tenant while the app answers
    it, its response included; runs inside the auth middleware (it needs the tenant) and the body
    limit (a slow upload holds no slot). Requests that make the engine do nothing, and event streams
    (counted as streams instead), hold none."""

    FREE_PATHS = frozenset({"/v1/kv/events/stream", "/v1/models", "/v1/capabilities"})

    def __init__(self, app: ASGIApp, concurrency: Concurrency) -> None:
        self.app = app
        self.concurrency = concurrency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/") or path in self.FREE_PATHS \
                or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        tenant = scope.get("kvbaton.tenant")
        if tenant is None:  # not authenticated: the auth middleware answered already
            await self.app(scope, receive, send)
            return
        try:
            await self.concurrency.acquire(tenant)
        except KvbatonError as exc:  # refused or timed out: answered here, the app never ran
            await exception_response(exc, path)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.concurrency.release(tenant)
