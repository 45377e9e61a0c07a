"""Whether an answer reached its client, and what happens to the handles it carried when it did not.

A request that makes handles for its caller (``materialize``, ``fork``, a native generation's result,
an OpenAI request with ``kvbaton.keep``...) hands their ids over in its answer. A client that is gone
before that answer is sent — its timeout fired, it was killed — would leave those handles live with
no one knowing their ids (only ``release_all`` or the TTL would free them, and a persistent server
would journal them). :class:`DeliveryMiddleware` sees whether the connection was lost by the time the
answer is sent (the connection's own flag, which ``listener.GuardedH11Protocol`` exposes in the scope
as :data:`GONE`: uvicorn drops an answer to a gone client) and then releases every handle the request
gave (:func:`give`).

A whole (not streamed) generation also stops at its next round once its client is gone
(:func:`gone`, read by ``sse.run_whole``), instead of computing an answer nobody reads. Streams own
their handles already (``sse``); a request whose client left before it was answered is logged and
counted as 499 ("client closed request", as nginx names it), never as the server's 500.

Invariant: only an answer that was never sent releases anything: a client that received its answer
keeps its handles whatever it does next.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

GIVEN = "kvbaton.given"  # scope key: ids of the handles the request's answer hands to its caller
GONE = "kvbaton.gone"  # scope key: a callable, whether the client's connection is lost
CLIENT_CLOSED = 499  # the status of a request whose client left before it was answered


def give(scope: dict[str, Any] | None, handle_ids: Iterable[str | None]) -> None:
    """The answer of this request hands these handles to its caller (released if it never arrives)."""
    if scope is not None:
        scope.setdefault(GIVEN, []).extend(h for h in handle_ids if h is not None)


def gone(scope: dict[str, Any] | None) -> bool:
    """Whether the request's client has gone (its connection is lost)."""
    check = scope.get(GONE) if scope is not None else None
    return bool(check()) if check is not None else False


class DeliveryMiddleware:
    """Releases the handles a request gave (``release(ids)``, awaited) when its answer could not be
    sent: the client was gone (:data:`GONE`, which the server's connection protocol puts in the scope:
    ``listener.GuardedH11Protocol``) when the answer started, or before any answer."""

    def __init__(self, app: ASGIApp, release: Callable[[list[str]], Awaitable[None]]) -> None:
        self.app = app
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = undelivered = False

        async def deliver(message: Message) -> None:
            nonlocal started, undelivered
            if message["type"] == "http.response.start":
                started = True
                undelivered = gone(scope)  # the server drops what it would send to a gone client: it never arrives
            await send(message)

        try:
            await self.app(scope, receive, deliver)
        finally:
            given = scope.get(GIVEN) or []
            if given and (undelivered or (not started and gone(scope))):
                with anyio.CancelScope(shield=True):
                    await self.release(list(given))
