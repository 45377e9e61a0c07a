"""The one client interface of kvbaton, and ``connect()``.

Every client implements :class:`Client` (embedded: :class:`~kvbaton.embedded.EmbeddedClient`, HTTP:
:class:`~kvbaton.http.HttpClient`), so code written against one runs against the other by changing
only the ``connect`` target. :class:`AsyncClient` is the same interface with coroutines
(:class:`~kvbaton.embedded.AsyncEmbeddedClient`, :class:`~kvbaton.http.AsyncHttpClient`), opened by
``await aconnect(...)``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

from pydantic import ValidationError

from .capabilities import Capabilities
from .errors import InvalidRequest
from .handle import Handle, Segment
from .ops import Context, HandleLike, KVOps, Messages
from .scope import Scope, arecord_stream, keep, record, record_stream, released
from .stepgraph import StepGraph
from .stream import AsyncTokenStream, TokenStream
from .types import AgentInfo, Composition, Events, Fidelity, Result, Reuse, SamplingParams, Stats


def sampling_params(sampling: SamplingParams | None, overrides: dict[str, Any]) -> SamplingParams:
    """Merge keyword overrides (``max_tokens=8, temperature=0.7``) into sampling parameters."""
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise InvalidRequest(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if not overrides:
        return sampling if sampling is not None else SamplingParams()
    base = sampling.model_dump() if sampling is not None else {}
    try:
        return SamplingParams.model_validate({**base, **overrides})
    except ValidationError as exc:
        raise InvalidRequest(f"invalid sampling parameters: {exc}") from exc


def _mapping(value: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if value is None else dict(value)


def _items(handles: HandleLike | Iterable[HandleLike]) -> HandleLike | list[HandleLike]:
    """``handles`` as a single handle or a list (an iterable is read once: the backend and the
    ownership bookkeeping both see it)."""
    return handles if isinstance(handles, Handle | str) else list(handles)


def _inputs(prefix: Any, parts: Sequence[Any]) -> list[Handle]:
    """The handles a compose or merge reads (a result with one of their ids is not a new handle)."""
    found = [prefix] if isinstance(prefix, Handle) else []
    return found + [p if isinstance(p, Handle) else p.handle for p in parts if isinstance(p, Handle | Segment)]


class Client:
    """Handle operators on one model, over any backend of the :class:`~kvbaton.ops.KVOps` contract
    (``client.ops``): the embedded engine, a multi-device cluster, SGLang, or a server over HTTP.
    Sampling options may be given as a :class:`~kvbaton.SamplingParams` or as keywords
    (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``ignore_eos``, and what the
    output must be and report: ``response_format``, ``logprobs``, ``top_logprobs``).

    The client adds only that keyword convenience: every call goes to ``ops`` unchanged, so the
    same code runs against every backend. A client is itself a :class:`~kvbaton.ops.KVOps` (its
    signatures are the contract's plus ``**options``), so clients compose: an asynchronous client
    can wrap a synchronous one, and a subclass's overrides are what the wrapper calls."""

    ops: KVOps

    def __init__(self, ops: KVOps) -> None:
        self.ops = ops

    def materialize(self, context: Context, *, agent: str | None = None) -> Handle:
        """Prefill ``context`` (text or token ids) and return a handle to its KV."""
        return record(self, self.ops.materialize(context, agent=agent))

    def fork(self, handle: HandleLike, k: int = 2) -> list[Handle]:
        """``k`` new handles sharing every KV block of ``handle`` (zero copy)."""
        return record(self, self.ops.fork(handle, k), handle)

    def extend(self, handle: HandleLike, context: Context, *, agent: str | None = None) -> Handle:
        """A new handle: ``handle``'s context followed by ``context``, prefilled, nothing generated."""
        return record(self, self.ops.extend(handle, context, agent=agent), handle)

    def resume(
        self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None, *,
        agent: str | None = None, **options: Any,
    ) -> Result:
        """Prefill ``suffix`` behind ``handle`` and generate."""
        return record(self, self.ops.resume(handle, suffix, sampling_params(sampling, options), agent=agent), handle)

    def resume_stream(
        self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None, *,
        agent: str | None = None, **options: Any,
    ) -> TokenStream:
        """Like :meth:`resume`, yielding text as it is generated."""
        stream = self.ops.resume_stream(handle, suffix, sampling_params(sampling, options), agent=agent)
        return record_stream(self, stream, handle)

    def complete(
        self, prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None,
        reuse: Reuse | None = None, **options: Any,
    ) -> Result:
        """Plain completion of text or token ids, without a handle or chat template (text replay).
        ``reuse`` as for :meth:`generate`."""
        return record(self, self.ops.complete(prompt, sampling_params(sampling, options), agent=agent, reuse=reuse))

    def complete_stream(
        self, prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None,
        reuse: Reuse | None = None, **options: Any,
    ) -> TokenStream:
        """Like :meth:`complete`, yielding text as it is generated."""
        return record_stream(
            self, self.ops.complete_stream(prompt, sampling_params(sampling, options), agent=agent, reuse=reuse)
        )

    def generate(
        self, messages: Messages, *, handle: HandleLike | None = None, tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None, agent: str | None = None, reuse: Reuse | None = None,
        **options: Any,
    ) -> Result:
        """Chat generation; the KV of ``handle`` (or the prefix cache) is reused for the longest common
        token prefix. ``reuse="auto"`` or ``"rotate"`` also reuses spans other agents computed behind
        a different prefix, approximately (marked: ``Result.exact`` is False); ``"exact"`` never
        changes greedy output; ``None`` takes the engine's default (``connect(reuse=...)``, "exact")."""
        result = self.ops.generate(
            messages, handle=handle, sampling=sampling_params(sampling, options), tools=tools, agent=agent,
            reuse=reuse,
        )
        return record(self, result, *([handle] if handle is not None else []))

    def generate_stream(
        self, messages: Messages, *, handle: HandleLike | None = None, tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None, agent: str | None = None, reuse: Reuse | None = None,
        **options: Any,
    ) -> TokenStream:
        """Like :meth:`generate`, yielding text as it is generated."""
        stream = self.ops.generate_stream(
            messages, handle=handle, sampling=sampling_params(sampling, options), tools=tools, agent=agent,
            reuse=reuse,
        )
        return record_stream(self, stream, *([handle] if handle is not None else []))

    def compose(
        self, prefix: Handle | Context | None = None, segments: Sequence[Segment | Handle] = (),
        suffix: Context | None = None, *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        """Assemble ``prefix + segments + suffix`` from existing KV (see docs/segments.md): each segment
        (``handle.segment(start, end, slot=...)`` or a whole handle) is reused exactly when the tokens
        before it match its source, else re-aligned to its new positions and corrected for the new
        context (``mode="auto"``, gated, with dense fallback), only re-aligned (``"rotate"``), or
        recomputed (``"dense"``). The report says per segment what happened and why; approximate
        results have ``handle.exact == False``. ``correction`` overrides the anchor-pool settings."""
        out = self.ops.compose(prefix, segments, suffix, agent=agent, mode=mode, correction=_mapping(correction))
        return record(self, out, *_inputs(prefix, segments))

    def merge(
        self, parts: Sequence[Segment | Handle], *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        """Restricted merge: prefix-compatible handles give the longest; segments are concatenated
        through :meth:`compose`; divergent KV of the same positions raises MergeConflict."""
        return record(self, self.ops.merge(parts, agent=agent, mode=mode, correction=_mapping(correction)), *_inputs(None, parts))

    def fidelity(self, handle: HandleLike, max_tokens: int = 32, *, reference: HandleLike | None = None) -> Fidelity:
        """Measure a (composed) handle against dense prefill of its tokens: first-token agreement,
        greedy agreement over ``max_tokens`` tokens and mean KL of the next-token distribution."""
        return self.ops.fidelity(handle, max_tokens, reference=reference)

    def transfer(self, handle: HandleLike, device: int | str) -> Handle:
        """Move ``handle``'s KV to another device of a multi-device backend (a worker rank, or a
        device name such as ``"cuda:1"`` when it names one worker). The backend sends the blocks
        or recomputes them from lineage, whichever its cost model predicts faster; the returned
        handle (same id) carries the new placement and a ``transfer`` lineage step. With a single
        device, a transfer to that device is a no-op and any other target raises InvalidRequest."""
        return record(self, self.ops.transfer(handle, device), handle)

    def release(self, handles: HandleLike | Iterable[HandleLike]) -> None:
        """Drop handles; their blocks are freed once no other handle shares them."""
        items = _items(handles)
        self.ops.release(items)
        released(items)

    def stats(self) -> Stats:
        """Pool usage and reuse counters."""
        return self.ops.stats()

    def events(self, since: int = 0) -> Events:
        """What the engine did after event ``since`` (0: everything it still holds): one ``request``
        event per request with its phase times and token sources, and the cache's evictions and
        prefetches; pass the answer's ``next`` to read on (docs/dashboard.md)."""
        return self.ops.events(since)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.ops.tokenize(text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``."""
        return self.ops.detokenize(token_ids)

    def chat_tokens(
        self, messages: Messages, *, tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        """``messages`` rendered by the model's chat template, as token ids. Without the generation
        prompt they are a prefix of any longer conversation: materialize shared context that way."""
        return self.ops.chat_tokens(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def register_agent(self, name: str, fixed_prompt: Context | Messages, *, prefill: bool = False) -> AgentInfo:
        """Declare an agent's fixed prompt (text, token ids or chat messages) for workflow-aware
        caching: its cached KV takes the agent's steps-to-execution. ``prefill`` computes it now."""
        return self.ops.register_agent(name, fixed_prompt, prefill=prefill)

    def hints(
        self, steps: Mapping[str, float] | StepGraph, *, running: Iterable[str] = (), finished: Iterable[str] = ()
    ) -> dict[str, float]:
        """Tell the backend how many steps until each agent runs (a mapping, or a step graph with
        the agents running and finished now); agents due soon are prefetched. Returns the STE map."""
        return self.ops.hints(steps, running=running, finished=finished)

    def capabilities(self) -> Capabilities:
        """What the engine behind this client does exactly, corrects, recomputes or cannot do."""
        return self.ops.capabilities()

    def scope(self, *, name: str = "scope") -> Scope:
        """An ownership scope: ``with client.scope() as s:`` records every handle created through
        this client inside the block and releases, at its end, those not kept (``s.keep(h)``,
        :meth:`keep`) nor released already (see :mod:`kvbaton.scope`)."""
        return Scope(self, name=name)

    def keep(self, *handles: HandleLike) -> None:
        """Keep ``handles`` past the end of every scope (and adapter run) that created them; only
        :meth:`release` frees them."""
        keep(list(handles))

    def close(self) -> None:
        """Free the client's resources. The client is unusable afterwards."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncClient:
    """:class:`Client` with coroutines: the same methods, awaited, over an asynchronous backend
    (``client.ops``: :class:`~kvbaton.ops.ThreadedOps` around an in-process engine, or
    :class:`~kvbaton.http.AsyncHttpOps`). Streaming methods return an
    :class:`~kvbaton.stream.AsyncTokenStream` (``async for chunk in stream``; ``stream.result``)."""

    ops: Any

    def __init__(self, ops: Any = None) -> None:
        # None: a subclass that implements the methods itself (a test double, say) needs no backend.
        self.ops = ops

    async def materialize(self, context: Context, *, agent: str | None = None) -> Handle:
        return record(self, await self.ops.materialize(context, agent=agent))  # type: ignore[no-any-return]

    async def fork(self, handle: HandleLike, k: int = 2) -> list[Handle]:
        return record(self, await self.ops.fork(handle, k), handle)  # type: ignore[no-any-return]

    async def extend(self, handle: HandleLike, context: Context, *, agent: str | None = None) -> Handle:
        return record(self, await self.ops.extend(handle, context, agent=agent), handle)  # type: ignore[no-any-return]

    async def resume(
        self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None, *,
        agent: str | None = None, **options: Any,
    ) -> Result:
        result = await self.ops.resume(handle, suffix, sampling_params(sampling, options), agent=agent)
        return record(self, result, handle)  # type: ignore[no-any-return]

    async def resume_stream(
        self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None, *,
        agent: str | None = None, **options: Any,
    ) -> AsyncTokenStream:
        stream = await self.ops.resume_stream(handle, suffix, sampling_params(sampling, options), agent=agent)
        return arecord_stream(self, stream, handle)

    async def complete(
        self, prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None,
        reuse: Reuse | None = None, **options: Any,
    ) -> Result:
        result = await self.ops.complete(prompt, sampling_params(sampling, options), agent=agent, reuse=reuse)
        return record(self, result)  # type: ignore[no-any-return]

    async def complete_stream(
        self, prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None,
        reuse: Reuse | None = None, **options: Any,
    ) -> AsyncTokenStream:
        stream = await self.ops.complete_stream(prompt, sampling_params(sampling, options), agent=agent, reuse=reuse)
        return arecord_stream(self, stream)

    async def generate(
        self, messages: Messages, *, handle: HandleLike | None = None, tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None, agent: str | None = None, reuse: Reuse | None = None,
        **options: Any,
    ) -> Result:
        result = await self.ops.generate(
            messages, handle=handle, sampling=sampling_params(sampling, options), tools=tools, agent=agent,
            reuse=reuse,
        )
        return record(self, result, *([handle] if handle is not None else []))  # type: ignore[no-any-return]

    async def generate_stream(
        self, messages: Messages, *, handle: HandleLike | None = None, tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None, agent: str | None = None, reuse: Reuse | None = None,
        **options: Any,
    ) -> AsyncTokenStream:
        stream = await self.ops.generate_stream(
            messages, handle=handle, sampling=sampling_params(sampling, options), tools=tools, agent=agent,
            reuse=reuse,
        )
        return arecord_stream(self, stream, *([handle] if handle is not None else []))

    async def compose(
        self, prefix: Handle | Context | None = None, segments: Sequence[Segment | Handle] = (),
        suffix: Context | None = None, *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        """:meth:`Client.compose`, awaited."""
        out = await self.ops.compose(prefix, segments, suffix, agent=agent, mode=mode, correction=_mapping(correction))
        return record(self, out, *_inputs(prefix, segments))  # type: ignore[no-any-return]

    async def merge(
        self, parts: Sequence[Segment | Handle], *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        """:meth:`Client.merge`, awaited."""
        out = await self.ops.merge(parts, agent=agent, mode=mode, correction=_mapping(correction))
        return record(self, out, *_inputs(None, parts))  # type: ignore[no-any-return]

    async def fidelity(
        self, handle: HandleLike, max_tokens: int = 32, *, reference: HandleLike | None = None
    ) -> Fidelity:
        """:meth:`Client.fidelity`, awaited."""
        return await self.ops.fidelity(handle, max_tokens, reference=reference)  # type: ignore[no-any-return]

    async def transfer(self, handle: HandleLike, device: int | str) -> Handle:
        """:meth:`Client.transfer`, awaited."""
        return record(self, await self.ops.transfer(handle, device), handle)  # type: ignore[no-any-return]

    async def release(self, handles: HandleLike | Iterable[HandleLike]) -> None:
        items = _items(handles)
        await self.ops.release(items)
        released(items)

    async def stats(self) -> Stats:
        return await self.ops.stats()  # type: ignore[no-any-return]

    async def events(self, since: int = 0) -> Events:
        """:meth:`Client.events`, awaited."""
        return await self.ops.events(since)  # type: ignore[no-any-return]

    async def tokenize(self, text: str) -> list[int]:
        return await self.ops.tokenize(text)  # type: ignore[no-any-return]

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return await self.ops.detokenize(token_ids)  # type: ignore[no-any-return]

    async def chat_tokens(
        self, messages: Messages, *, tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        return await self.ops.chat_tokens(  # type: ignore[no-any-return]
            messages, tools=tools, add_generation_prompt=add_generation_prompt
        )

    async def register_agent(
        self, name: str, fixed_prompt: Context | Messages, *, prefill: bool = False
    ) -> AgentInfo:
        return await self.ops.register_agent(name, fixed_prompt, prefill=prefill)  # type: ignore[no-any-return]

    async def hints(
        self, steps: Mapping[str, float] | StepGraph, *, running: Iterable[str] = (), finished: Iterable[str] = ()
    ) -> dict[str, float]:
        return await self.ops.hints(steps, running=running, finished=finished)  # type: ignore[no-any-return]

    async def capabilities(self) -> Capabilities:
        """:meth:`Client.capabilities`, awaited."""
        return await self.ops.capabilities()  # type: ignore[no-any-return]

    def scope(self, *, name: str = "scope") -> Scope:
        """:meth:`Client.scope`: ``async with client.scope() as s:``."""
        return Scope(self, name=name)

    def keep(self, *handles: HandleLike) -> None:
        """:meth:`Client.keep` (no I/O: not a coroutine)."""
        keep(list(handles))

    async def close(self) -> None:
        """Free the client's resources. The client is unusable afterwards."""

    async def aclose(self) -> None:
        await self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


def _is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def _no_token(token: str | None) -> None:
    if token is not None:
        raise InvalidRequest("token applies to a server URL target, not to the embedded engine")


def _http_options(target: str, token: str | None, model: str | None, options: dict[str, Any]) -> dict[str, Any]:
    unknown = set(options) - {"timeout", "connect_timeout", "headers"}
    if model is not None or unknown:
        names = sorted(unknown | ({"model"} if model is not None else set()))
        raise InvalidRequest(
            f"options {names} configure an embedded engine; the server at {target} chose its model and engine options"
        )
    return {"token": token if token is not None else os.environ.get("KVBATON_TOKEN") or None, **options}


def _wants_sglang(target: str | None, token: str | None, options: dict[str, Any]) -> bool:
    """``engine="sglang"`` (a name; an engine object passes through to the embedded client)."""
    engine = options.get("engine")
    if not isinstance(engine, str):
        return False
    del options["engine"]
    if engine == "kvbaton":
        return False
    if engine != "sglang":
        raise InvalidRequest(f"unknown engine {engine!r}: use 'kvbaton' (default) or 'sglang'")
    if target not in (None, "embedded"):
        raise InvalidRequest("engine='sglang' runs in this process; a server at a URL chose its own engine")
    _no_token(token)
    return True


def connect(
    target: str | None = None, *, model: str | None = None, token: str | None = None, **options: Any
) -> Client:
    """Open a kvbaton client.

    ``connect()`` starts an embedded engine with the default model in this process;
    ``connect(model="/path/to/hf-checkpoint")`` another local model. Engine options
    (``dtype``, ``device``, ``kv_budget``, ``block_size``, ``prefill_chunk``, ``max_batch_tokens``)
    pass through.

    ``connect("http://host:8470", token=...)`` talks to a ``kvbaton serve`` server instead
    (token defaults to ``$KVBATON_TOKEN``; options ``timeout``, ``connect_timeout``, ``headers``).

    ``connect(engine="sglang", model="/path/to/hf-checkpoint")`` runs SGLang with the kvbaton plugin
    in this process instead of kvbaton's engine (needs sglang==0.5.23 and a GPU; docs/sglang.md).
    """
    if _wants_sglang(target, token, options):
        from .sglang_client import SglangClient

        return SglangClient(model=model, **options)
    if target is None or target == "embedded":
        from .embedded import EmbeddedClient

        _no_token(token)
        return EmbeddedClient(model=model, **options)
    if _is_url(target):
        from .http import HttpClient

        return HttpClient(target, **_http_options(target, token, model, options))
    raise InvalidRequest(
        f"unsupported connect target {target!r}: use connect() for the embedded engine or an http(s):// URL"
    )


async def aconnect(
    target: str | None = None, *, model: str | None = None, token: str | None = None, **options: Any
) -> AsyncClient:
    """The asynchronous :func:`connect`: ``client = await kvbaton.aconnect("http://host:8470")``.

    The embedded engine is built in a worker thread (loading the model blocks)."""
    if _wants_sglang(target, token, options):
        from .sglang_client import AsyncSglangClient

        return await AsyncSglangClient.start(model, **options)
    if target is None or target == "embedded":
        from .embedded import AsyncEmbeddedClient, EmbeddedClient

        _no_token(token)
        sync = await asyncio.to_thread(EmbeddedClient, model=model, **options)
        return AsyncEmbeddedClient(client=sync)
    if _is_url(target):
        from .http import AsyncHttpClient

        return AsyncHttpClient(target, **_http_options(target, token, model, options))
    raise InvalidRequest(
        f"unsupported connect target {target!r}: use aconnect() for the embedded engine or an http(s):// URL"
    )
