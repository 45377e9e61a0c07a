"""HTTP clients of a ``kvbaton serve`` server: the :class:`~kvbaton.Client` interface over its native API.

``kvbaton.connect("http://127.0.0.1:8470", token=...)`` returns :class:`HttpClient`;
``await kvbaton.aconnect(...)`` returns :class:`AsyncHttpClient`. The methods, arguments, return
types and exceptions are those of the embedded client: server error bodies map back to the same
typed exceptions (``ERRORS_BY_CODE``), and a server that cannot be reached, or drops the connection
mid-request, raises :class:`~kvbaton.errors.ServerUnavailable`.

Every operator is one row of :data:`kvbaton.wire.OPERATIONS` (HTTP method, path, request and
answer models), the table the server registers its routes from. :class:`HttpOps` (httpx.Client)
and :class:`AsyncHttpOps` (httpx.AsyncClient) implement :class:`~kvbaton.ops.KVOps` and
:class:`~kvbaton.ops.AsyncKVOps` from that one table and differ only in their I/O, as httpx's own
sync and async clients do.
"""

from __future__ import annotations

import contextlib
import email.utils
import inspect
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypedDict, TypeVar, Unpack, cast

import anyio
import httpx

from .client import AsyncClient, Client
from .errors import (
    InvalidRequest,
    KvbatonError,
    PayloadTooLarge,
    ServerError,
    ServerUnavailable,
    Unauthorized,
    error_from_code,
)
from .ops import AsyncKVOps, KVOps
from .scope import current_session
from .stream import AsyncTokenStream, TokenStream
from .types import Result, StreamChunk
from .wire import OPERATIONS, Operation

C = TypeVar("C", httpx.Client, httpx.AsyncClient)


class HttpOptions(TypedDict, total=False):
    """The clients' connection options besides the URL, token, read timeout and transport."""

    connect_timeout: float | None
    headers: dict[str, str] | None
    max_retries: int
    max_retry_wait: float


DEFAULT_TIMEOUT = 120.0
DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_MAX_RETRIES = 3
DEFAULT_MAX_RETRY_WAIT = 30.0  # seconds of waiting between retries, all of them together


@dataclass(frozen=True)
class Retries:
    """When to retry a call: an idempotent one (:attr:`kvbaton.wire.Operation.idempotent`) answered
    with a transient 503 (``pool_exhausted``, ``server_unavailable``: the ones that carry
    ``Retry-After``), at most ``max_retries`` times, waiting what ``Retry-After`` says and at most
    ``max_retry_wait`` seconds in all; never a call that makes handles (its first answer may have
    been lost after the server made them), nor a 429 quota (retrying does not help until handles
    are released), nor a stream."""

    max_retries: int = DEFAULT_MAX_RETRIES
    max_retry_wait: float = DEFAULT_MAX_RETRY_WAIT

    def wait(self, response: httpx.Response, idempotent: bool, attempt: int, waited: float) -> float | None:
        """Seconds to wait before retrying after ``response`` (the ``attempt``-th retry would be next,
        ``waited`` seconds waited so far), or None: answer with it."""
        if not idempotent or response.status_code != 503 or attempt > self.max_retries:
            return None
        seconds = _retry_after(response.headers.get("retry-after"))
        if seconds is None or waited + seconds > self.max_retry_wait:
            return None
        return seconds


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (delta-seconds or an HTTP date); None without a usable one."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


# -- responses and errors -----------------------------------------------------------------------

_STATUS_ERRORS: dict[int, type[KvbatonError]] = {
    401: Unauthorized,
    413: PayloadTooLarge,
}


def _error_from_body(status: int, body: bytes) -> KvbatonError:
    try:
        err = json.loads(body)["error"]
        return error_from_code(str(err["code"]), str(err["message"]), err.get("param"))
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    text = body.decode("utf-8", "replace")[:500]
    if status in _STATUS_ERRORS:
        return _STATUS_ERRORS[status](text or f"HTTP {status}")
    if status >= 500:
        return ServerError(f"HTTP {status}: {text}")
    return InvalidRequest(f"HTTP {status}: {text}")


@contextlib.contextmanager
def _reaching(base_url: str) -> Iterator[None]:
    """A transport failure (no connection, a timeout, a dropped connection) is ServerUnavailable."""
    try:
        yield
    except httpx.TransportError as exc:
        detail = str(exc) or type(exc).__name__
        raise ServerUnavailable(f"kvbaton server at {base_url} is unavailable: {detail}") from exc


def _answer(response: httpx.Response, content: bytes | None = None) -> Any:
    """The JSON of a response; an error answer raises the SDK's typed exception."""
    if response.status_code >= 400:
        raise _error_from_body(response.status_code, response.content if content is None else content)
    return response.json()


class _SSE:
    """Incremental parser of a ``text/event-stream``: feed lines, get the stream's items."""

    def __init__(self) -> None:
        self.event = "message"
        self.data: list[str] = []

    def item(self, line: str) -> StreamChunk | Result | None:
        """The chunk or result an event ends with at ``line``; an ``error`` event raises it."""
        event = self._feed(line)
        return None if event is None else _stream_item(*event)

    def _feed(self, line: str) -> tuple[str, str] | None:
        if not line:
            if not self.data:
                self.event = "message"
                return None
            out = (self.event, "\n".join(self.data))
            self.event, self.data = "message", []
            return out
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self.event = value
        elif name == "data":
            self.data.append(value)
        return None


def _stream_item(event: str, data: str) -> StreamChunk | Result:
    if event == "chunk":
        return StreamChunk.model_validate_json(data)
    if event == "result":
        return Result.model_validate_json(data)
    if event == "error":
        raise _error_from_body(500, data.encode())
    raise ServerError(f"unexpected stream event {event!r}")


def _headers(token: str | None, headers: dict[str, str] | None) -> dict[str, str]:
    out = {"Accept": "application/json", **(headers or {})}
    if token:
        out["Authorization"] = f"Bearer {token}"
    return out


def _session_header(request: httpx.Request) -> None:
    """A request made inside a scope with a reuse session carries it (``X-Kvbaton-Session``), unless it names
    one already (:func:`kvbaton.scope.current_session`)."""
    session = current_session()
    if session is not None and "x-kvbaton-session" not in request.headers:
        request.headers["x-kvbaton-session"] = session


async def _asession_header(request: httpx.Request) -> None:
    _session_header(request)


def _payload(method: str, body: Any) -> dict[str, Any]:
    """httpx arguments of a body: a GET's or a DELETE's fields go in the query string, anything else is JSON."""
    return {"params": body} if method in ("GET", "DELETE") and body is not None else {"json": body}


def _timeout(timeout: float | None, connect_timeout: float | None) -> httpx.Timeout:
    return httpx.Timeout(timeout, connect=connect_timeout if connect_timeout is not None else timeout)


# -- the operations over httpx: sync and async differ only in their I/O ----------------------------


def _method(operation: Operation, run: Callable[..., Any]) -> Callable[..., Any]:
    """The ops method of ``operation``, with its operator's signature: builds the body, then ``run``s it."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return run(self, operation, operation.body(*args, **kwargs))

    method.__name__ = method.__qualname__ = operation.name
    method.__signature__ = inspect.signature(getattr(KVOps, operation.name))  # type: ignore[attr-defined]
    return method


def _client_options(
    base_url: str, token: str | None, headers: dict[str, str] | None, timeout: float | None,
    connect_timeout: float | None, transport: Any,
) -> dict[str, Any]:
    return {
        "base_url": base_url.rstrip("/"),
        "headers": _headers(token, headers),
        "timeout": _timeout(timeout, connect_timeout),
        "limits": httpx.Limits(max_connections=256, max_keepalive_connections=64),
        "transport": transport,
    }


class _Connection(Generic[C]):
    """What both twins hold: the server's URL and an httpx client to it (``_open``)."""

    def __init__(
        self, base_url: str, token: str | None = None, timeout: float | None = DEFAULT_TIMEOUT, *,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT, headers: dict[str, str] | None = None,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
        max_retries: int = DEFAULT_MAX_RETRIES, max_retry_wait: float = DEFAULT_MAX_RETRY_WAIT,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = Retries(max_retries, max_retry_wait)
        self._http: C = self._open(_client_options(base_url, token, headers, timeout, connect_timeout, transport))

    def _open(self, options: dict[str, Any]) -> C:
        raise NotImplementedError


class HttpOps(_Connection[httpx.Client]):
    """:class:`~kvbaton.ops.KVOps` over HTTP (httpx.Client), generated from :data:`~kvbaton.wire.OPERATIONS`;
    thread-safe: one instance may serve many threads."""

    def _open(self, options: dict[str, Any]) -> httpx.Client:
        return httpx.Client(**options, event_hooks={"request": [_session_header]})

    def _run(self, operation: Operation, body: Any) -> Any:
        if operation.stream:
            return self._stream(operation.path, body)
        return operation.read(self.request(operation.method, operation.path, body, idempotent=operation.idempotent))

    def request(self, method: str, path: str, body: Any = None, *, idempotent: bool | None = None) -> Any:
        """One JSON request; error answers raise the SDK's typed exceptions. ``idempotent`` (default:
        a GET is) lets a transient 503 be retried (:class:`Retries`)."""
        attempt, waited = 1, 0.0
        with _reaching(self.base_url):
            while True:
                response = self._http.request(method, path, **_payload(method, body))
                wait = self.retries.wait(response, method == "GET" if idempotent is None else idempotent,
                                         attempt, waited)
                if wait is None:
                    return _answer(response)
                response.close()
                time.sleep(wait)
                attempt, waited = attempt + 1, waited + wait

    def _stream(self, path: str, body: dict[str, Any]) -> TokenStream:
        with _reaching(self.base_url):
            response = self._http.send(self._http.build_request("POST", path, json=body), stream=True)
            if response.status_code >= 400:
                with contextlib.closing(response):
                    _answer(response, response.read())
        return TokenStream(self._events(response))

    def _events(self, response: httpx.Response) -> Generator[StreamChunk, None, Result]:
        parser = _SSE()
        with contextlib.closing(response), _reaching(self.base_url):
            lines: Iterator[str] = response.iter_lines()
            for line in lines:
                item = parser.item(line)
                if isinstance(item, Result):
                    return item
                if item is not None:
                    yield item
        raise ServerUnavailable(f"kvbaton server at {self.base_url} ended the stream before its result")

    def close(self) -> None:
        self._http.close()


class AsyncHttpOps(_Connection[httpx.AsyncClient]):
    """:class:`HttpOps` with coroutines (httpx.AsyncClient): :class:`~kvbaton.ops.AsyncKVOps`, generated
    from the same table."""

    def _open(self, options: dict[str, Any]) -> httpx.AsyncClient:
        return httpx.AsyncClient(**options, event_hooks={"request": [_asession_header]})

    async def _run(self, operation: Operation, body: Any) -> Any:
        if operation.stream:
            return await self._stream(operation.path, body)
        return operation.read(await self.request(operation.method, operation.path, body,
                                                 idempotent=operation.idempotent))

    async def request(self, method: str, path: str, body: Any = None, *, idempotent: bool | None = None) -> Any:
        """One JSON request; error answers raise the SDK's typed exceptions. ``idempotent`` (default:
        a GET is) lets a transient 503 be retried (:class:`Retries`)."""
        attempt, waited = 1, 0.0
        with _reaching(self.base_url):
            while True:
                response = await self._http.request(method, path, **_payload(method, body))
                wait = self.retries.wait(response, method == "GET" if idempotent is None else idempotent,
                                         attempt, waited)
                if wait is None:
                    return _answer(response)
                await response.aclose()
                await anyio.sleep(wait)
                attempt, waited = attempt + 1, waited + wait

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncTokenStream:
        with _reaching(self.base_url):
            response = await self._http.send(self._http.build_request("POST", path, json=body), stream=True)
            if response.status_code >= 400:
                async with contextlib.aclosing(response):
                    _answer(response, await response.aread())
        return AsyncTokenStream(self._events(response))

    async def _events(self, response: httpx.Response) -> AsyncGenerator[StreamChunk | Result, None]:
        parser = _SSE()
        async with contextlib.aclosing(response):
            with _reaching(self.base_url):
                lines: AsyncIterator[str] = response.aiter_lines()
                async for line in lines:
                    item = parser.item(line)
                    if item is not None:
                        yield item
                    if isinstance(item, Result):
                        return
        raise ServerUnavailable(f"kvbaton server at {self.base_url} ended the stream before its result")

    async def close(self) -> None:
        await self._http.aclose()


for _operation in OPERATIONS.values():
    setattr(HttpOps, _operation.name, _method(_operation, HttpOps._run))
    setattr(AsyncHttpOps, _operation.name, _method(_operation, AsyncHttpOps._run))


# -- the clients ----------------------------------------------------------------------------------


class HttpClient(Client):
    """:class:`~kvbaton.Client` over HTTP. Thread-safe: one client may serve many threads.

    ``timeout`` bounds each read (for streams: the gap between two chunks), ``connect_timeout`` the
    connection (default 5 s); both raise :class:`~kvbaton.errors.ServerUnavailable` when exceeded.
    ``headers`` go with every request. Idempotent operations (reads, ``release``, ``register_agent``,
    ``hints``, ``transfer``, ``fidelity``: :attr:`kvbaton.wire.Operation.idempotent`) answered with
    a transient 503 are retried, honouring ``Retry-After``: at most ``max_retries`` times (default
    3) and ``max_retry_wait`` seconds of waiting in all (default 30); the operations that make
    handles, and streams, never are (:class:`Retries`).
    """

    def __init__(
        self, base_url: str, token: str | None = None, timeout: float | None = DEFAULT_TIMEOUT, *,
        transport: httpx.BaseTransport | None = None, **options: Unpack[HttpOptions],
    ) -> None:
        self.http = HttpOps(base_url, token, timeout, transport=transport, **options)
        super().__init__(cast(KVOps, self.http))  # its operators are generated from the table (see above)
        self.base_url = self.http.base_url

    def health(self) -> dict[str, Any]:
        """The server's ``/health`` answer (model, status)."""
        return dict(self.http.request("GET", "/health"))

    def close(self) -> None:
        self.http.close()


class AsyncHttpClient(AsyncClient):
    """:class:`~kvbaton.AsyncClient` over HTTP (httpx.AsyncClient); see :class:`HttpClient`."""

    def __init__(
        self, base_url: str, token: str | None = None, timeout: float | None = DEFAULT_TIMEOUT, *,
        transport: httpx.AsyncBaseTransport | None = None, **options: Unpack[HttpOptions],
    ) -> None:
        self.http = AsyncHttpOps(base_url, token, timeout, transport=transport, **options)
        super().__init__(cast(AsyncKVOps, self.http))  # its operators are generated from the table (see above)
        self.base_url = self.http.base_url

    async def health(self) -> dict[str, Any]:
        """The server's ``/health`` answer (model, status)."""
        return dict(await self.http.request("GET", "/health"))

    async def close(self) -> None:
        await self.http.close()
