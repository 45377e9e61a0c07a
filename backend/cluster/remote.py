"""The ingress's view of one worker actor: calls and streams through Ray, its liveness, its load.

A call waits for the actor's answer (``("ok", value)`` or a typed error, see :mod:`.worker`); the
actor dying under it (Ray's ``RayActorError`` and kin) marks the worker down and raises
:class:`WorkerLost`, which the router answers by running the request elsewhere. A worker that is down
gets no new requests until the liveness check (:mod:`.liveness`) sees Ray's restarted actor answer
again. Placement balances by the router's count of requests in flight on each worker
(:mod:`.routing`), whichever ingress runs them.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import ray
from kvbaton.errors import ServerError, error_from_code
from kvbaton.types import Result, StreamChunk
from ray.exceptions import GetTimeoutError, RayActorError

from ..tenants import AgentRef

try:  # raised for a call in flight on an actor being restarted (Ray >= 2.35)
    from ray.exceptions import ActorUnavailableError
except ImportError:  # pragma: no cover
    ActorUnavailableError = RayActorError  # type: ignore[misc,assignment]

log = logging.getLogger(__name__)

LOST_ERRORS: tuple[type[BaseException], ...] = (RayActorError, ActorUnavailableError)
STREAM_BACKPRESSURE = 64  # chunks a stream may run ahead of its reader


class WorkerLost(Exception):
    """The worker's actor died or is being restarted (internal: the router retries elsewhere)."""


def answer(reply: tuple[Any, ...]) -> Any:
    """The value of a worker's reply, or its typed error raised."""
    if reply[0] == "ok":
        return reply[1]
    if reply[0] == "err":
        raise error_from_code(reply[1], reply[2])
    raise ServerError(f"unexpected worker reply {reply[0]!r}")


def _caller_agent(kwargs: dict[str, Any]) -> dict[str, Any]:
    """An operator's ``agent`` resolved here, in the caller's context (its reuse scope's session), not in the
    worker's, which has none."""
    return {**kwargs, "agent": AgentRef.of(kwargs["agent"])} if "agent" in kwargs else kwargs


class WorkerRef:
    """One worker actor of rank ``rank`` on ``device``; ``on_lost`` is called once per death."""

    def __init__(self, rank: int, device: str, actor: Any, on_lost: Callable[[WorkerRef], None]) -> None:
        self.rank = rank
        self.device = device
        self.actor = actor
        self.info: dict[str, Any] = {}
        self.alive = False
        self.lost_reason: str | None = None  # why it is down, for /health (None: it died)
        self.closing = False  # the cluster is closing: its end is no loss
        self._on_lost = on_lost
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self.info.get("pid")

    @property
    def host(self) -> str | None:
        return self.info.get("host")

    def joined(self, info: dict[str, Any]) -> None:
        self.info = info
        self.revive()

    def revive(self) -> None:
        """Alive again (the control, which watches the workers, placed a request on it)."""
        self.lost_reason = None
        self.alive = True

    def lost(self, reason: str | None = None) -> None:
        """The worker is down from now on (once per death)."""
        with self._lock:
            if not self.alive:
                return
            self.alive = False
            self.lost_reason = reason
            if self.closing:
                return
        log.error("worker %d (%s, pid %s) is lost%s", self.rank, self.device, self.pid, f": {reason}" if reason else "")
        self._on_lost(self)

    def _get(self, ref: Any, timeout: float | None = None) -> Any:
        try:
            return ray.get(ref, timeout=timeout)
        except LOST_ERRORS as exc:
            self.lost()
            raise WorkerLost(f"worker {self.rank} died") from exc

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.invoke("call", method, args, _caller_agent(kwargs))

    def invoke(self, actor_method: str, *args: Any) -> Any:
        """An actor method answering ``("ok", value)`` / ``("err", ...)``: its value, or its error raised."""
        if not self.alive:
            raise WorkerLost(f"worker {self.rank} is down")
        return answer(self._get(getattr(self.actor, actor_method).remote(*args)))

    def raw(self, actor_method: str, *args: Any, timeout: float | None = None) -> Any:
        """An actor method's plain answer (probes)."""
        return self._get(getattr(self.actor, actor_method).remote(*args), timeout)

    def ping(self, timeout: float) -> int | None:
        """The actor's pid if it answers within ``timeout`` seconds; None if it does not (yet)."""
        try:
            return int(ray.get(self.actor.ping.remote(), timeout=timeout))
        except (GetTimeoutError, *LOST_ERRORS):
            return None

    def stream(self, method: str, *args: Any, **kwargs: Any) -> Iterator[StreamChunk | Result]:
        """Start a stream; returns once the worker admitted it (or raises its error). The iterator
        yields chunks and, last, the :class:`Result`; closing it early cancels it on the worker."""
        if not self.alive:
            raise WorkerLost(f"worker {self.rank} is down")
        sid = uuid.uuid4().hex  # unique across the ingresses that share the worker
        gen = self.actor.stream.options(
            num_returns="streaming", _generator_backpressure_num_objects=STREAM_BACKPRESSURE,
        ).remote(sid, method, args, _caller_agent(kwargs))
        items = _StreamItems(self, sid, gen)
        try:
            first = items.item()
        except BaseException:
            items.finish()
            raise
        if first[0] != "started":
            items.finish()
            answer(first)
        return items


class _StreamItems(Iterator[StreamChunk | Result]):
    """The chunks of one stream, then its :class:`Result`; closed before its end, it cancels the
    stream on the worker (which releases what the generation made)."""

    def __init__(self, worker: WorkerRef, sid: str, gen: Any) -> None:
        self._worker, self._sid, self._gen = worker, sid, gen
        self._ended = False

    def item(self) -> tuple[Any, ...]:
        try:
            ref = next(self._gen)
        except StopIteration:
            raise ServerError(f"worker {self._worker.rank} ended a stream without its result") from None
        except LOST_ERRORS as exc:
            self._worker.lost()
            raise WorkerLost(f"worker {self._worker.rank} died") from exc
        return self._worker._get(ref)  # type: ignore[no-any-return]

    def finish(self) -> None:
        self._ended = True

    def __next__(self) -> StreamChunk | Result:
        if self._ended:
            raise StopIteration
        try:
            item = self.item()
        except BaseException:
            self.finish()
            raise
        if item[0] == "chunk":
            return item[1]  # type: ignore[no-any-return]
        self.finish()
        if item[0] == "done":
            return item[1]  # type: ignore[no-any-return]
        if item[0] == "cancelled":
            raise ServerError("the stream was cancelled")
        answer(item)
        raise ServerError(f"unexpected stream item {item[0]!r}")

    def close(self) -> None:
        if self._ended:
            return
        self.finish()
        if not self._worker.alive:
            return
        # The generator runs on: tell it to stop, and read it to its end off this thread; a result it
        # had already made (the generation finished as the consumer left) is released on the worker.
        self._worker.actor.cancel.remote(self._sid)
        threading.Thread(target=self._drain, name="kvbaton-stream-drain", daemon=True).start()

    def _drain(self) -> None:
        try:
            for ref in self._gen:
                item = ray.get(ref)
                if item[0] == "done" and item[1].handle is not None:
                    self._worker.actor.call.remote("release", ([item[1].handle.id],))
        except Exception:  # noqa: BLE001 - a worker lost meanwhile holds nothing any more
            pass
