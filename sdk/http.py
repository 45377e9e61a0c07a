"""HTTP clients of a ``kvbaton serve`` server: the :class:`~kvbaton.Client` interface over its native API.

``kvbaton.connect("http://127.0.0.1:8470", token=...)`` returns :class:`HttpClient`;
``await kvbaton.aconnect(...)`` returns :class:`AsyncHttpClient`. The methods, arguments, return
types and exceptions are those of the embedded client: server error bodies map back to the same
typed exceptions (``ERRORS_BY_CODE``), and a server that cannot be reached, or drops the connection
mid-request, raises :class:`~kvbaton.errors.ServerUnavailable`.

Every operator is one row of :data:`OPERATIONS` (HTTP method, path, a pure function building the
JSON body from the operator's arguments, and one reading the answer). :class:`HttpOps` (httpx.Client)
and :class:`AsyncHttpOps` (httpx.AsyncClient) implement :class:`~kvbaton.ops.KVOps` from that one
table and differ only in their I/O, as httpx's own sync and async clients do.
"""

from __future__ import annotations

import inspect
import json
import math
import operator
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from .capabilities import Capabilities
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
from .handle import Handle, Segment
from .ops import Context, HandleLike, Messages, check_reuse, ste_map
from .stepgraph import StepGraph
from .stream import AsyncTokenStream, TokenStream
from .types import AgentInfo, ChatMessage, Composition, Events, Fidelity, Result, SamplingParams, Stats, StreamChunk

DEFAULT_TIMEOUT = 120.0
DEFAULT_CONNECT_TIMEOUT = 5.0

# -- request bodies: one pure function per operator, with the operator's own signature ----------


def _tagged(body: dict[str, Any], agent: str | None) -> dict[str, Any]:
    if agent is not None:
        body["agent"] = agent
    return body


def _with_reuse(body: dict[str, Any], reuse: str | None) -> dict[str, Any]:
    check_reuse(reuse)  # a bad policy fails here, before any request is sent
    if reuse is not None:
        body["reuse"] = reuse
    return body


def _handle_ref(handle: HandleLike) -> Any:
    """A handle as the server takes it: the whole handle (checked for compatibility) or its id."""
    if isinstance(handle, Handle):
        return handle.model_dump(mode="json")
    if isinstance(handle, str):
        return handle
    raise InvalidRequest(f"expected a Handle or a handle id, got {type(handle).__name__}")


def _handle_refs(handles: HandleLike | Iterable[HandleLike]) -> list[Any]:
    items = [handles] if isinstance(handles, Handle | str) else list(handles)
    return [_handle_ref(h) for h in items]


def _segments(parts: Sequence[Segment | Handle]) -> list[dict[str, Any]]:
    out = []
    for part in parts:
        if isinstance(part, Handle):
            out.append({"handle": _handle_ref(part)})
        elif isinstance(part, Segment):
            out.append({"handle": _handle_ref(part.handle), "start": part.start, "end": part.end, "slot": part.slot})
        else:
            raise InvalidRequest(f"segments must be Segment or Handle objects, got {type(part).__name__}")
    return out


def _context(value: Context, what: str) -> str | list[int]:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes) or not hasattr(value, "__iter__"):
        raise InvalidRequest(f"{what} must be text or a sequence of token ids, got {type(value).__name__}")
    try:
        return [operator.index(t) for t in value]
    except TypeError:
        raise InvalidRequest(f"{what} token ids must be integers") from None


def _messages(messages: Messages) -> list[dict[str, Any]]:
    if isinstance(messages, str | bytes):
        raise InvalidRequest("messages must be a non-empty list of {role, content} messages")
    return [m.model_dump(exclude_none=True) if isinstance(m, ChatMessage) else m for m in messages]


def _sampling(sampling: SamplingParams | None) -> dict[str, Any]:
    return (sampling if sampling is not None else SamplingParams()).model_dump(mode="json")


def _opt_mapping(value: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if value is None else dict(value)


def materialize_body(context: Context, *, agent: str | None = None) -> dict[str, Any]:
    return _tagged({"context": _context(context, "context")}, agent)


def fork_body(handle: HandleLike, k: int = 2) -> dict[str, Any]:
    return {"handle": _handle_ref(handle), "k": k}


def extend_body(handle: HandleLike, context: Context, *, agent: str | None = None) -> dict[str, Any]:
    return _tagged({"handle": _handle_ref(handle), "context": _context(context, "context")}, agent)


def resume_body(
    handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None, *, agent: str | None = None
) -> dict[str, Any]:
    return _tagged({"handle": _handle_ref(handle), "suffix": _context(suffix, "suffix"), **_sampling(sampling)}, agent)


def complete_body(
    prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None, reuse: str | None = None,
) -> dict[str, Any]:
    return _with_reuse(_tagged({"prompt": _context(prompt, "prompt"), **_sampling(sampling)}, agent), reuse)


def generate_body(
    messages: Messages, *, handle: HandleLike | None = None, sampling: SamplingParams | None = None,
    tools: list[dict[str, Any]] | None = None, agent: str | None = None, reuse: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": _messages(messages), **_sampling(sampling)}
    if handle is not None:
        body["handle"] = _handle_ref(handle)
    if tools is not None:
        body["tools"] = tools
    return _with_reuse(_tagged(body, agent), reuse)


def compose_body(
    prefix: Handle | Context | None = None, segments: Sequence[Segment | Handle] = (), suffix: Context | None = None,
    *, agent: str | None = None, mode: str = "auto", correction: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"segments": _segments(segments), "mode": mode, "correction": _opt_mapping(correction)}
    if isinstance(prefix, Handle):
        body["prefix_handle"] = _handle_ref(prefix)
    elif prefix is not None:
        body["prefix"] = _context(prefix, "prefix")
    if suffix is not None:
        body["suffix"] = _context(suffix, "suffix")
    return _tagged(body, agent)


def merge_body(
    parts: Sequence[Segment | Handle], *, agent: str | None = None, mode: str = "auto",
    correction: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    return _tagged({"parts": _segments(parts), "mode": mode, "correction": _opt_mapping(correction)}, agent)


def fidelity_body(handle: HandleLike, max_tokens: int = 32, *, reference: HandleLike | None = None) -> dict[str, Any]:
    return {"handle": _handle_ref(handle), "max_tokens": max_tokens,
            "reference": None if reference is None else _handle_ref(reference)}


def transfer_body(handle: HandleLike, device: int | str) -> dict[str, Any]:
    return {"handle": _handle_ref(handle), "device": device}


def release_body(handles: HandleLike | Iterable[HandleLike]) -> dict[str, Any]:
    return {"handles": _handle_refs(handles)}


def tokenize_body(text: str) -> dict[str, Any]:
    if not isinstance(text, str):
        raise InvalidRequest(f"text must be a string, got {type(text).__name__}")
    return {"text": text}


def detokenize_body(token_ids: Sequence[int]) -> dict[str, Any]:
    return {"token_ids": _context(token_ids, "token_ids")}


def chat_tokens_body(
    messages: Messages, *, tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True
) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": _messages(messages), "add_generation_prompt": add_generation_prompt}
    if tools is not None:
        body["tools"] = tools
    return body


def register_agent_body(name: str, fixed_prompt: Context | Messages, *, prefill: bool = False) -> dict[str, Any]:
    if isinstance(fixed_prompt, str):
        prompt: Any = fixed_prompt
    elif fixed_prompt and isinstance(fixed_prompt[0], ChatMessage | dict):
        prompt = _messages(fixed_prompt)  # type: ignore[arg-type]
    else:
        prompt = _context(fixed_prompt, "fixed_prompt")  # type: ignore[arg-type]
    return {"name": name, "fixed_prompt": prompt, "prefill": prefill}


def hints_body(
    steps: Mapping[str, float] | StepGraph, *, running: Iterable[str] = (), finished: Iterable[str] = ()
) -> dict[str, Any]:
    # JSON has no infinity: an agent missing from the map counts as never running.
    return {"steps": {a: v for a, v in ste_map(steps, running, finished).items() if v != math.inf}}


def stats_body() -> None:
    return None


def capabilities_body() -> None:
    return None


def events_body(since: int = 0) -> dict[str, Any]:
    # A GET: sent as the query string (?since=N).
    if isinstance(since, bool) or not isinstance(since, int) or since < 0:
        raise InvalidRequest(f"since must be an integer >= 0, got {since!r}")
    return {"since": since}


# -- the operation table --------------------------------------------------------------------------


@dataclass(frozen=True)
class Operation:
    """One operator over HTTP: ``body(*args)`` is the JSON sent (None for a GET), ``read(json)``
    the value returned; a streaming operation answers with server-sent events instead."""

    method: str
    path: str
    body: Callable[..., Any]
    read: Callable[[Any], Any] | None = None
    stream: bool = False


def _handles(out: Any) -> list[Handle]:
    return [Handle.model_validate(h) for h in out["handles"]]


OPERATIONS: dict[str, Operation] = {
    "materialize": Operation("POST", "/v1/kv/materialize", materialize_body, Handle.model_validate),
    "fork": Operation("POST", "/v1/kv/fork", fork_body, _handles),
    "extend": Operation("POST", "/v1/kv/extend", extend_body, Handle.model_validate),
    "resume": Operation("POST", "/v1/kv/resume", resume_body, Result.model_validate),
    "resume_stream": Operation("POST", "/v1/kv/resume", resume_body, stream=True),
    "complete": Operation("POST", "/v1/kv/complete", complete_body, Result.model_validate),
    "complete_stream": Operation("POST", "/v1/kv/complete", complete_body, stream=True),
    "generate": Operation("POST", "/v1/kv/generate", generate_body, Result.model_validate),
    "generate_stream": Operation("POST", "/v1/kv/generate", generate_body, stream=True),
    "compose": Operation("POST", "/v1/kv/compose", compose_body, Composition.model_validate),
    "merge": Operation("POST", "/v1/kv/merge", merge_body, Composition.model_validate),
    "fidelity": Operation("POST", "/v1/kv/fidelity", fidelity_body, Fidelity.model_validate),
    "transfer": Operation("POST", "/v1/kv/transfer", transfer_body, Handle.model_validate),
    "release": Operation("POST", "/v1/kv/release", release_body, lambda out: None),
    "stats": Operation("GET", "/v1/kv/stats", stats_body, Stats.model_validate),
    "capabilities": Operation("GET", "/v1/capabilities", capabilities_body, Capabilities.model_validate),
    "events": Operation("GET", "/v1/kv/events", events_body, Events.model_validate),
    "tokenize": Operation("POST", "/v1/kv/tokenize", tokenize_body, lambda out: list(out["token_ids"])),
    "detokenize": Operation("POST", "/v1/kv/detokenize", detokenize_body, lambda out: str(out["text"])),
    "chat_tokens": Operation("POST", "/v1/kv/chat_tokens", chat_tokens_body, lambda out: list(out["token_ids"])),
    "register_agent": Operation("POST", "/v1/kv/agents", register_agent_body, AgentInfo.model_validate),
    "hints": Operation("POST", "/v1/kv/hints", hints_body, lambda out: dict(out["steps"])),
}


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


def _unavailable(base_url: str, exc: Exception) -> ServerUnavailable:
    detail = str(exc) or type(exc).__name__
    return ServerUnavailable(f"kvbaton server at {base_url} is unavailable: {detail}")


class _SSE:
    """Incremental parser of a ``text/event-stream``: feed lines, get ``(event, data)`` pairs."""

    def __init__(self) -> None:
        self.event = "message"
        self.data: list[str] = []

    def feed(self, line: str) -> tuple[str, str] | None:
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


def _payload(method: str, body: Any) -> dict[str, Any]:
    """httpx arguments of a body: a GET's fields go in the query string, anything else is JSON."""
    return {"params": body} if method == "GET" and body is not None else {"json": body}


def _timeout(timeout: float | None, connect_timeout: float | None) -> httpx.Timeout:
    return httpx.Timeout(timeout, connect=connect_timeout if connect_timeout is not None else timeout)


# -- the operations over httpx: sync and async differ only in their I/O ----------------------------


def _method(name: str, operation: Operation, run: Callable[..., Any]) -> Callable[..., Any]:
    """The ops method ``name``: builds the body with the operator's own signature, then ``run``s it."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return run(self, operation, operation.body(*args, **kwargs))

    method.__name__ = method.__qualname__ = name
    params = list(inspect.signature(operation.body).parameters.values())
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = inspect.Signature([self_param, *params])  # type: ignore[attr-defined]
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


class HttpOps:
    """:class:`~kvbaton.ops.KVOps` over HTTP (httpx.Client), generated from :data:`OPERATIONS`.
    Thread-safe: one instance may serve many threads."""

    def __init__(
        self, base_url: str, token: str | None = None, timeout: float | None = DEFAULT_TIMEOUT, *,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT, headers: dict[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(**_client_options(base_url, token, headers, timeout, connect_timeout, transport))

    def _run(self, operation: Operation, body: Any) -> Any:
        if operation.stream:
            return self._stream(operation.path, body)
        assert operation.read is not None
        return operation.read(self.request(operation.method, operation.path, body))

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """One JSON request; error answers raise the SDK's typed exceptions."""
        try:
            response = self._http.request(method, path, **_payload(method, body))
        except httpx.TransportError as exc:
            raise _unavailable(self.base_url, exc) from exc
        if response.status_code >= 400:
            raise _error_from_body(response.status_code, response.content)
        return response.json()

    def _stream(self, path: str, body: dict[str, Any]) -> TokenStream:
        request = self._http.build_request("POST", path, json={**body, "stream": True})
        try:
            response = self._http.send(request, stream=True)
        except httpx.TransportError as exc:
            raise _unavailable(self.base_url, exc) from exc
        if response.status_code >= 400:
            try:
                content = response.read()
            except httpx.TransportError as exc:
                raise _unavailable(self.base_url, exc) from exc
            finally:
                response.close()
            raise _error_from_body(response.status_code, content)
        return TokenStream(self._events(response))

    def _events(self, response: httpx.Response) -> Generator[StreamChunk, None, Result]:
        parser = _SSE()
        try:
            lines: Iterator[str] = response.iter_lines()
            for line in lines:
                event = parser.feed(line)
                if event is None:
                    continue
                item = _stream_item(*event)
                if isinstance(item, Result):
                    return item
                yield item
        except httpx.TransportError as exc:
            raise _unavailable(self.base_url, exc) from exc
        finally:
            response.close()
        raise ServerUnavailable(f"kvbaton server at {self.base_url} ended the stream before its result")

    def close(self) -> None:
        self._http.close()


class AsyncHttpOps:
    """:class:`HttpOps` with coroutines (httpx.AsyncClient), generated from the same table."""

    def __init__(
        self, base_url: str, token: str | None = None, timeout: float | None = DEFAULT_TIMEOUT, *,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT, headers: dict[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(**_client_options(base_url, token, headers, timeout, connect_timeout, transport))

    async def _run(self, operation: Operation, body: Any) -> Any:
        if operation.stream:
            return await self._stream(operation.path, body)
        assert operation.read is not None
        return operation.read(await self.request(operation.method, operation.path, body))

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        """One JSON request; error answers raise the SDK's typed exceptions."""
        try:
            response = await self._http.request(method, path, **_payload(method, body))
        except httpx.TransportError as exc:
            raise _unavailable(self.base_url, exc) from exc
        if response.status_code >= 400:
            raise _error_from_body(response.status_code, response.content)
        return response.json()

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncTokenStream:
        request = self._http.build_request("POST", path, json={**body, "stream": True})
        try:
            response = await self._http.send(request, stream=True)
        except httpx.TransportError as exc:
            raise _unavailable(self.base_url, exc) from exc
        if response.status_code >= 400:
            try:
                content = await response.aread()
            except httpx.TransportError as exc:
                raise _unavailable(self.base_url, exc) from exc
            finally:
                await response.aclose()
            raise _error_from_body(response.status_code, content)
        return AsyncTokenStream(self._events(response))

    async def _events(self, response: httpx.Response) -> AsyncGenerator[StreamChunk | Result, None]:
        parser = _SSE()
        try:
            lines: AsyncIterator[str] = response.aiter_lines()
            async for line in lines:
                event = parser.feed(line)
                if event is None:
                    continue
                item = _stream_item(*event)
                yield item
                if isinstance(item, Result):
                    return
        except httpx.TransportError as exc:
            raise _unavailable(self.base_url, exc) from exc
        finally:
            await response.aclose()
        raise ServerUnavailable(f"kvbaton server at {self.base_url} ended the stream before its result")

    async def close(self) -> None:
        await self._http.aclose()


for _name, _operation in OPERATIONS.items():
    setattr(HttpOps, _name, _method(_name, _operation, HttpOps._run))
    setattr(AsyncHttpOps, _name, _method(_name, _operation, AsyncHttpOps._run))


# -- the clients ----------------------------------------------------------------------------------


class HttpClient(Client):
    """:class:`~kvbaton.Client` over HTTP. Thread-safe: one client may serve many threads.

    ``timeout`` bounds each read (for streams: the gap between two chunks), ``connect_timeout`` the
    connection; both raise :class:`~kvbaton.errors.ServerUnavailable` when exceeded.
    """

    ops: HttpOps

    def __init__(
        self, base_url: str, token: str | None = None, timeout: float | None = DEFAULT_TIMEOUT, *,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT, headers: dict[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(HttpOps(  # type: ignore[arg-type]
            base_url, token, timeout, connect_timeout=connect_timeout, headers=headers, transport=transport
        ))
        self.base_url = self.ops.base_url

    def health(self) -> dict[str, Any]:
        """The server's ``/health`` answer (model, status)."""
        return dict(self.ops.request("GET", "/health"))

    def close(self) -> None:
        self.ops.close()


class AsyncHttpClient(AsyncClient):
    """:class:`~kvbaton.client.AsyncClient` over HTTP (httpx.AsyncClient); see :class:`HttpClient`."""

    ops: AsyncHttpOps

    def __init__(
        self, base_url: str, token: str | None = None, timeout: float | None = DEFAULT_TIMEOUT, *,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT, headers: dict[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(AsyncHttpOps(
            base_url, token, timeout, connect_timeout=connect_timeout, headers=headers, transport=transport
        ))
        self.base_url = self.ops.base_url

    async def health(self) -> dict[str, Any]:
        """The server's ``/health`` answer (model, status)."""
        return dict(await self.ops.request("GET", "/health"))

    async def close(self) -> None:
        await self.ops.close()
