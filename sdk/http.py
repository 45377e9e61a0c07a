"""HTTP clients of a ``kvbaton serve`` server: the :class:`~kvbaton.Client` interface over its native API.

``kvbaton.connect("http://127.0.0.1:8470", token=...)`` returns :class:`HttpClient`;
``await kvbaton.aconnect(...)`` returns :class:`AsyncHttpClient`. The methods, arguments, return
types and exceptions are those of the embedded client: server error bodies map back to the same
typed exceptions (``ERRORS_BY_CODE``), and a server that cannot be reached, or drops the connection
mid-request, raises :class:`~kvbaton.errors.ServerUnavailable`.
"""

from __future__ import annotations

import json
import operator
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import httpx

from .capabilities import Capabilities
from .client import AsyncClient, Client, Context, HandleLike, Messages, sampling_params, steps_map
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
from .stepgraph import StepGraph
from .stream import AsyncTokenStream, TokenStream
from .types import AgentInfo, ChatMessage, Composition, Fidelity, Result, SamplingParams, Stats, StreamChunk

DEFAULT_TIMEOUT = 120.0
DEFAULT_CONNECT_TIMEOUT = 5.0

# -- request bodies ---------------------------------------------------------------------------


def _tagged(body: dict[str, Any], agent: str | None) -> dict[str, Any]:
    if agent is not None:
        body["agent"] = agent
    return body


def _hints_body(steps: Any, running: Iterable[str], finished: Iterable[str]) -> dict[str, Any]:
    # JSON has no infinity: an agent missing from the map counts as never running.
    ste = steps_map(steps, running, finished)
    return {"steps": {a: v for a, v in ste.items() if v != float("inf")}}


def _agent_body(name: str, fixed_prompt: Any, prefill: bool) -> dict[str, Any]:
    if isinstance(fixed_prompt, str):
        prompt: Any = fixed_prompt
    elif fixed_prompt and isinstance(fixed_prompt[0], ChatMessage | dict):
        prompt = _messages(fixed_prompt)
    else:
        prompt = _context(fixed_prompt, "fixed_prompt")
    return {"name": name, "fixed_prompt": prompt, "prefill": prefill}


def _resume_body(
    handle: HandleLike, suffix: Context, sampling: SamplingParams | None, options: dict[str, Any], agent: str | None
) -> dict[str, Any]:
    body = {"handle": _handle_ref(handle), "suffix": _context(suffix, "suffix"), **_sampling(sampling, options)}
    return _tagged(body, agent)


def _complete_body(
    prompt: Context, sampling: SamplingParams | None, options: dict[str, Any], agent: str | None
) -> dict[str, Any]:
    return _tagged({"prompt": _context(prompt, "prompt"), **_sampling(sampling, options)}, agent)


def _generate_body(
    messages: Messages,
    handle: HandleLike | None,
    tools: list[dict[str, Any]] | None,
    sampling: SamplingParams | None,
    options: dict[str, Any],
    agent: str | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": _messages(messages), **_sampling(sampling, options)}
    if handle is not None:
        body["handle"] = _handle_ref(handle)
    if tools is not None:
        body["tools"] = tools
    return _tagged(body, agent)


def _handle_ref(handle: HandleLike) -> Any:
    """A handle as the server takes it: the whole handle (checked for compatibility) or its id."""
    if isinstance(handle, Handle):
        return handle.model_dump(mode="json")
    if isinstance(handle, str):
        return handle
    raise InvalidRequest(f"expected a Handle or a handle id, got {type(handle).__name__}")


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


def _opt_mapping(value: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if value is None else dict(value)


def _compose_body(
    prefix: Handle | Context | None, segments: Sequence[Segment | Handle], suffix: Context | None,
    agent: str | None, mode: str, correction: Mapping[str, Any] | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"segments": _segments(segments), "mode": mode, "correction": _opt_mapping(correction)}
    if isinstance(prefix, Handle):
        body["prefix_handle"] = _handle_ref(prefix)
    elif prefix is not None:
        body["prefix"] = _context(prefix, "prefix")
    if suffix is not None:
        body["suffix"] = _context(suffix, "suffix")
    return _tagged(body, agent)


def _merge_body(
    parts: Sequence[Segment | Handle], agent: str | None, mode: str, correction: Mapping[str, Any] | None
) -> dict[str, Any]:
    return _tagged({"parts": _segments(parts), "mode": mode, "correction": _opt_mapping(correction)}, agent)


def _fidelity_body(handle: HandleLike, max_tokens: int, reference: HandleLike | None) -> dict[str, Any]:
    return {"handle": _handle_ref(handle), "max_tokens": max_tokens,
            "reference": None if reference is None else _handle_ref(reference)}


def _handle_refs(handles: HandleLike | Iterable[HandleLike]) -> list[Any]:
    items = [handles] if isinstance(handles, Handle | str) else list(handles)
    return [_handle_ref(h) for h in items]


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


def _sampling(sampling: SamplingParams | None, options: dict[str, Any]) -> dict[str, Any]:
    return sampling_params(sampling, options).model_dump(mode="json")


# -- responses and errors -----------------------------------------------------------------------

_STATUS_ERRORS: dict[int, type[KvbatonError]] = {
    401: Unauthorized,
    413: PayloadTooLarge,
}


def _error_from_body(status: int, body: bytes) -> KvbatonError:
    try:
        err = json.loads(body)["error"]
        return error_from_code(str(err["code"]), str(err["message"]))
    except (ValueError, KeyError, TypeError):
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


def _timeout(timeout: float | None, connect_timeout: float | None) -> httpx.Timeout:
    return httpx.Timeout(timeout, connect=connect_timeout if connect_timeout is not None else timeout)


# -- the synchronous client -------------------------------------------------------------------


class HttpClient(Client):
    """:class:`~kvbaton.Client` over HTTP. Thread-safe: one client may serve many threads.

    ``timeout`` bounds each read (for streams: the gap between two chunks), ``connect_timeout`` the
    connection; both raise :class:`~kvbaton.errors.ServerUnavailable` when exceeded.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        *,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
        headers: dict[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=_headers(token, headers),
            timeout=_timeout(timeout, connect_timeout),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            transport=transport,
        )

    # -- transport ----------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            response = self._http.request(method, path, json=body)
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

    # -- operators ----------------------------------------------------------------------------
    def materialize(self, context: Context, *, agent: str | None = None) -> Handle:
        body = _tagged({"context": _context(context, "context")}, agent)
        return Handle.model_validate(self._request("POST", "/v1/kv/materialize", body))

    def fork(self, handle: HandleLike, k: int = 2) -> list[Handle]:
        out = self._request("POST", "/v1/kv/fork", {"handle": _handle_ref(handle), "k": k})
        return [Handle.model_validate(h) for h in out["handles"]]

    def transfer(self, handle: HandleLike, device: int | str) -> Handle:
        return Handle.model_validate(
            self._request("POST", "/v1/kv/transfer", {"handle": _handle_ref(handle), "device": device})
        )

    def extend(self, handle: HandleLike, context: Context, *, agent: str | None = None) -> Handle:
        body = _tagged({"handle": _handle_ref(handle), "context": _context(context, "context")}, agent)
        return Handle.model_validate(self._request("POST", "/v1/kv/extend", body))

    def compose(
        self,
        prefix: Handle | Context | None = None,
        segments: Sequence[Segment | Handle] = (),
        suffix: Context | None = None,
        *,
        agent: str | None = None,
        mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        body = _compose_body(prefix, segments, suffix, agent, mode, correction)
        return Composition.model_validate(self._request("POST", "/v1/kv/compose", body))

    def merge(
        self, parts: Sequence[Segment | Handle], *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        body = _merge_body(parts, agent, mode, correction)
        return Composition.model_validate(self._request("POST", "/v1/kv/merge", body))

    def fidelity(self, handle: HandleLike, max_tokens: int = 32, *, reference: HandleLike | None = None) -> Fidelity:
        body = _fidelity_body(handle, max_tokens, reference)
        return Fidelity.model_validate(self._request("POST", "/v1/kv/fidelity", body))

    def resume(
        self,
        handle: HandleLike,
        suffix: Context = "",
        *,
        sampling: SamplingParams | None = None,
        agent: str | None = None,
        **options: Any,
    ) -> Result:
        body = _resume_body(handle, suffix, sampling, options, agent)
        return Result.model_validate(self._request("POST", "/v1/kv/resume", body))

    def resume_stream(
        self,
        handle: HandleLike,
        suffix: Context = "",
        *,
        sampling: SamplingParams | None = None,
        agent: str | None = None,
        **options: Any,
    ) -> TokenStream:
        return self._stream("/v1/kv/resume", _resume_body(handle, suffix, sampling, options, agent))

    def complete(
        self, prompt: Context, *, sampling: SamplingParams | None = None, agent: str | None = None, **options: Any
    ) -> Result:
        body = _complete_body(prompt, sampling, options, agent)
        return Result.model_validate(self._request("POST", "/v1/kv/complete", body))

    def complete_stream(
        self, prompt: Context, *, sampling: SamplingParams | None = None, agent: str | None = None, **options: Any
    ) -> TokenStream:
        return self._stream("/v1/kv/complete", _complete_body(prompt, sampling, options, agent))

    def generate(
        self,
        messages: Messages,
        *,
        handle: HandleLike | None = None,
        tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None,
        agent: str | None = None,
        **options: Any,
    ) -> Result:
        body = _generate_body(messages, handle, tools, sampling, options, agent)
        return Result.model_validate(self._request("POST", "/v1/kv/generate", body))

    def generate_stream(
        self,
        messages: Messages,
        *,
        handle: HandleLike | None = None,
        tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None,
        agent: str | None = None,
        **options: Any,
    ) -> TokenStream:
        return self._stream("/v1/kv/generate", _generate_body(messages, handle, tools, sampling, options, agent))

    def register_agent(self, name: str, fixed_prompt: Context | Messages, *, prefill: bool = False) -> AgentInfo:
        out = self._request("POST", "/v1/kv/agents", _agent_body(name, fixed_prompt, prefill))
        return AgentInfo.model_validate(out)

    def hints(
        self, steps: Mapping[str, float] | StepGraph, *, running: Iterable[str] = (), finished: Iterable[str] = ()
    ) -> dict[str, float]:
        out = self._request("POST", "/v1/kv/hints", _hints_body(steps, running, finished))
        return dict(out["steps"])

    def release(self, handles: HandleLike | Iterable[HandleLike]) -> None:
        self._request("POST", "/v1/kv/release", {"handles": _handle_refs(handles)})

    def stats(self) -> Stats:
        return Stats.model_validate(self._request("GET", "/v1/kv/stats"))

    def capabilities(self) -> Capabilities:
        return Capabilities.model_validate(self._request("GET", "/v1/capabilities"))

    def tokenize(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequest(f"text must be a string, got {type(text).__name__}")
        return list(self._request("POST", "/v1/kv/tokenize", {"text": text})["token_ids"])

    def detokenize(self, token_ids: Sequence[int]) -> str:
        body = {"token_ids": _context(token_ids, "token_ids")}
        return str(self._request("POST", "/v1/kv/detokenize", body)["text"])

    def chat_tokens(
        self,
        messages: Messages,
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        body: dict[str, Any] = {"messages": _messages(messages), "add_generation_prompt": add_generation_prompt}
        if tools is not None:
            body["tools"] = tools
        return list(self._request("POST", "/v1/kv/chat_tokens", body)["token_ids"])

    def health(self) -> dict[str, Any]:
        """The server's ``/health`` answer (model, status)."""
        return dict(self._request("GET", "/health"))

    def close(self) -> None:
        self._http.close()


# -- the asynchronous client ------------------------------------------------------------------


class AsyncHttpClient(AsyncClient):
    """:class:`~kvbaton.client.AsyncClient` over HTTP (httpx.AsyncClient); see :class:`HttpClient`."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        *,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
        headers: dict[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=_headers(token, headers),
            timeout=_timeout(timeout, connect_timeout),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            transport=transport,
        )

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            response = await self._http.request(method, path, json=body)
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

    async def materialize(self, context: Context, *, agent: str | None = None) -> Handle:
        body = _tagged({"context": _context(context, "context")}, agent)
        return Handle.model_validate(await self._request("POST", "/v1/kv/materialize", body))

    async def fork(self, handle: HandleLike, k: int = 2) -> list[Handle]:
        out = await self._request("POST", "/v1/kv/fork", {"handle": _handle_ref(handle), "k": k})
        return [Handle.model_validate(h) for h in out["handles"]]

    async def transfer(self, handle: HandleLike, device: int | str) -> Handle:
        return Handle.model_validate(
            await self._request("POST", "/v1/kv/transfer", {"handle": _handle_ref(handle), "device": device})
        )

    async def extend(self, handle: HandleLike, context: Context, *, agent: str | None = None) -> Handle:
        body = _tagged({"handle": _handle_ref(handle), "context": _context(context, "context")}, agent)
        return Handle.model_validate(await self._request("POST", "/v1/kv/extend", body))

    async def compose(
        self,
        prefix: Handle | Context | None = None,
        segments: Sequence[Segment | Handle] = (),
        suffix: Context | None = None,
        *,
        agent: str | None = None,
        mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        body = _compose_body(prefix, segments, suffix, agent, mode, correction)
        return Composition.model_validate(await self._request("POST", "/v1/kv/compose", body))

    async def merge(
        self, parts: Sequence[Segment | Handle], *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        body = _merge_body(parts, agent, mode, correction)
        return Composition.model_validate(await self._request("POST", "/v1/kv/merge", body))

    async def fidelity(
        self, handle: HandleLike, max_tokens: int = 32, *, reference: HandleLike | None = None
    ) -> Fidelity:
        body = _fidelity_body(handle, max_tokens, reference)
        return Fidelity.model_validate(await self._request("POST", "/v1/kv/fidelity", body))

    async def resume(
        self,
        handle: HandleLike,
        suffix: Context = "",
        *,
        sampling: SamplingParams | None = None,
        agent: str | None = None,
        **options: Any,
    ) -> Result:
        body = _resume_body(handle, suffix, sampling, options, agent)
        return Result.model_validate(await self._request("POST", "/v1/kv/resume", body))

    async def resume_stream(
        self,
        handle: HandleLike,
        suffix: Context = "",
        *,
        sampling: SamplingParams | None = None,
        agent: str | None = None,
        **options: Any,
    ) -> AsyncTokenStream:
        return await self._stream("/v1/kv/resume", _resume_body(handle, suffix, sampling, options, agent))

    async def complete(
        self, prompt: Context, *, sampling: SamplingParams | None = None, agent: str | None = None, **options: Any
    ) -> Result:
        body = _complete_body(prompt, sampling, options, agent)
        return Result.model_validate(await self._request("POST", "/v1/kv/complete", body))

    async def complete_stream(
        self, prompt: Context, *, sampling: SamplingParams | None = None, agent: str | None = None, **options: Any
    ) -> AsyncTokenStream:
        return await self._stream("/v1/kv/complete", _complete_body(prompt, sampling, options, agent))

    async def generate(
        self,
        messages: Messages,
        *,
        handle: HandleLike | None = None,
        tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None,
        agent: str | None = None,
        **options: Any,
    ) -> Result:
        body = _generate_body(messages, handle, tools, sampling, options, agent)
        return Result.model_validate(await self._request("POST", "/v1/kv/generate", body))

    async def generate_stream(
        self,
        messages: Messages,
        *,
        handle: HandleLike | None = None,
        tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None,
        agent: str | None = None,
        **options: Any,
    ) -> AsyncTokenStream:
        return await self._stream("/v1/kv/generate", _generate_body(messages, handle, tools, sampling, options, agent))

    async def register_agent(self, name: str, fixed_prompt: Context | Messages, *, prefill: bool = False) -> AgentInfo:
        out = await self._request("POST", "/v1/kv/agents", _agent_body(name, fixed_prompt, prefill))
        return AgentInfo.model_validate(out)

    async def hints(
        self, steps: Mapping[str, float] | StepGraph, *, running: Iterable[str] = (), finished: Iterable[str] = ()
    ) -> dict[str, float]:
        out = await self._request("POST", "/v1/kv/hints", _hints_body(steps, running, finished))
        return dict(out["steps"])

    async def release(self, handles: HandleLike | Iterable[HandleLike]) -> None:
        await self._request("POST", "/v1/kv/release", {"handles": _handle_refs(handles)})

    async def stats(self) -> Stats:
        return Stats.model_validate(await self._request("GET", "/v1/kv/stats"))

    async def capabilities(self) -> Capabilities:
        return Capabilities.model_validate(await self._request("GET", "/v1/capabilities"))

    async def tokenize(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequest(f"text must be a string, got {type(text).__name__}")
        return list((await self._request("POST", "/v1/kv/tokenize", {"text": text}))["token_ids"])

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        body = {"token_ids": _context(token_ids, "token_ids")}
        return str((await self._request("POST", "/v1/kv/detokenize", body))["text"])

    async def chat_tokens(
        self,
        messages: Messages,
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        body: dict[str, Any] = {"messages": _messages(messages), "add_generation_prompt": add_generation_prompt}
        if tools is not None:
            body["tools"] = tools
        return list((await self._request("POST", "/v1/kv/chat_tokens", body))["token_ids"])

    async def health(self) -> dict[str, Any]:
        return dict(await self._request("GET", "/health"))

    async def close(self) -> None:
        await self._http.aclose()

    aclose = close
