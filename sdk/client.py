"""The one client interface of kvbaton: :class:`Client` and its asynchronous twin :class:`AsyncClient`.

Every client implements them (embedded: :class:`~kvbaton.embedded.EmbeddedClient`, HTTP:
:class:`~kvbaton.http.HttpClient`, SGLang), so code written against one runs against the other by
changing only the target of :func:`kvbaton.connect` (:mod:`kvbaton.connect`). :class:`AsyncClient`
is the same interface with coroutines, opened by ``await kvbaton.aconnect(...)``.

As httpx's clients, the twins stand side by side over an I/O-free base, :class:`BaseClient`: what is
not I/O (sampling options merged into :class:`~kvbaton.SamplingParams`, arguments normalized, the
handles a call creates recorded in the active ownership scopes) is written there once, and the
operators a client passes through unchanged are declared there once (:class:`_Forward`, typed from
the contract). Each twin adds only its I/O: a call of ``ops`` — a :class:`~kvbaton.ops.KVOps`, or an
:class:`~kvbaton.ops.AsyncKVOps` awaited.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypedDict, TypeVar, overload

from pydantic import ValidationError

from .errors import InvalidRequest, validation_error
from .handle import Handle, HandleLike, Segment
from .ops import AsyncKVOps, Context, KVOps, Messages
from .scope import Scope, arecord_stream, keep, record, record_stream, released
from .stream import AsyncTokenStream, TokenStream
from .threaded import ThreadedOps
from .types import Composition, Result, Reuse, SamplingParams

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["AsyncClient", "BaseClient", "Client", "Context", "HandleLike", "Messages", "sampling_params"]


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
        raise validation_error(exc.errors()) from None  # type: ignore[arg-type]


def _mapping(value: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if value is None else dict(value)


def _items(handles: HandleLike | Iterable[HandleLike]) -> HandleLike | list[HandleLike]:
    """``handles`` as a single handle or a list (an iterable is read once: the backend and the
    ownership bookkeeping both see it)."""
    return handles if isinstance(handles, Handle | str) else list(handles)


class _GenerateArgs(TypedDict):
    messages: Messages
    handle: HandleLike | None
    sampling: SamplingParams
    tools: list[dict[str, Any]] | None
    agent: str | None
    reuse: Reuse | None


def _inputs(prefix: Any, parts: Sequence[Any]) -> list[Handle]:
    """The handles a compose or merge reads (a result with one of their ids is not a new handle)."""
    found = [prefix] if isinstance(prefix, Handle) else []
    return found + [p if isinstance(p, Handle) else p.handle for p in parts if isinstance(p, Handle | Segment)]


def _like(fn: F, operator: Callable[..., Any]) -> F:
    """``fn`` named, documented and signed as ``operator`` (what ``inspect`` and ``help`` show)."""
    functools.update_wrapper(fn, operator, assigned=("__name__", "__qualname__", "__doc__"), updated=())
    fn.__signature__ = inspect.signature(operator)  # type: ignore[attr-defined]
    return fn


class _Forward(Generic[P, R]):
    """A client method that passes its call to ``client.ops`` unchanged: an operator that creates no
    handle and takes no sampling options. Typed from the contract's method (``_Forward(KVOps.stats)``):
    on a :class:`Client` it is that method, on an :class:`AsyncClient` the same as a coroutine."""

    def __init__(self, operator: Callable[Concatenate[Any, P], R]) -> None:
        name = operator.__name__

        def call(client: Client, *args: Any, **kwargs: Any) -> Any:
            return getattr(client.ops, name)(*args, **kwargs)

        async def acall(client: AsyncClient, *args: Any, **kwargs: Any) -> Any:
            return await getattr(client.ops, name)(*args, **kwargs)

        self._call, self._acall = _like(call, operator), _like(acall, operator)

    @overload
    def __get__(self, client: None, owner: type) -> Callable[..., Any]: ...

    @overload
    def __get__(self, client: Client, owner: type) -> Callable[P, R]: ...

    @overload
    def __get__(self, client: AsyncClient, owner: type) -> Callable[P, Coroutine[Any, Any, R]]: ...

    def __get__(self, client: BaseClient | None, owner: type) -> Callable[..., Any]:
        fn = self._acall if issubclass(owner, AsyncClient) else self._call
        return fn if client is None else types.MethodType(fn, client)


class BaseClient:
    """What :class:`Client` and :class:`AsyncClient` share; none of it is I/O."""

    fidelity = _Forward(KVOps.fidelity)
    stats = _Forward(KVOps.stats)
    events = _Forward(KVOps.events)
    tokenize = _Forward(KVOps.tokenize)
    detokenize = _Forward(KVOps.detokenize)
    chat_tokens = _Forward(KVOps.chat_tokens)
    register_agent = _Forward(KVOps.register_agent)
    unregister_agent = _Forward(KVOps.unregister_agent)
    hints = _Forward(KVOps.hints)
    capabilities = _Forward(KVOps.capabilities)

    def _releaser(self) -> object:
        """Whom the scopes release this client's handles through (a blocking one can do so from any code)."""
        return self

    def _made(self, out: T, *inputs: HandleLike | None) -> T:
        """``out``, the handles a call made from ``inputs``, recorded in the active ownership scopes."""
        return record(self, out, *(i for i in inputs if i is not None), via=self._releaser())

    @staticmethod
    def _generate_args(
        messages: Messages, handle: HandleLike | None, tools: list[dict[str, Any]] | None,
        sampling: SamplingParams | None, agent: str | None, reuse: Reuse | None, options: dict[str, Any],
    ) -> _GenerateArgs:
        """The arguments of ``ops.generate`` / ``ops.generate_stream``: the options merged into ``sampling``."""
        return _GenerateArgs(messages=messages, handle=handle, sampling=sampling_params(sampling, options),
                             tools=tools, agent=agent, reuse=reuse)

    def scope(self, *, name: str = "scope") -> Scope:
        """An ownership scope: ``with client.scope() as s:`` (``async with`` for an
        :class:`AsyncClient`) records every handle created through this client inside the block and
        releases, at its end, those not kept (``s.keep(h)``, :meth:`keep`) nor released already (see
        :mod:`kvbaton.scope`)."""
        return Scope(self, name=name)

    def keep(self, *handles: HandleLike) -> None:
        """Keep ``handles`` past the end of every scope (and adapter run) that created them; only
        ``release`` frees them (no I/O: not a coroutine on an :class:`AsyncClient`)."""
        keep(list(handles))


class Client(BaseClient):
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
        return self._made(self.ops.materialize(context, agent=agent))

    def fork(self, handle: HandleLike, k: int = 2) -> list[Handle]:
        """``k`` new handles sharing every KV block of ``handle`` (zero copy)."""
        return self._made(self.ops.fork(handle, k), handle)

    def extend(self, handle: HandleLike, context: Context, *, agent: str | None = None) -> Handle:
        """A new handle: ``handle``'s context followed by ``context``, prefilled, nothing generated."""
        return self._made(self.ops.extend(handle, context, agent=agent), handle)

    def resume(
        self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None, *,
        agent: str | None = None, **options: Any,
    ) -> Result:
        """Prefill ``suffix`` behind ``handle`` and generate."""
        return self._made(self.ops.resume(handle, suffix, sampling_params(sampling, options), agent=agent), handle)

    def resume_stream(
        self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None, *,
        agent: str | None = None, **options: Any,
    ) -> TokenStream:
        """Like :meth:`resume`, yielding text as it is generated."""
        params = sampling_params(sampling, options)
        return self._stream(self.ops.resume_stream(handle, suffix, params, agent=agent), handle)

    def complete(
        self, prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None,
        reuse: Reuse | None = None, **options: Any,
    ) -> Result:
        """Plain completion of text or token ids, without a handle or chat template (text replay).
        ``reuse`` as for :meth:`generate`."""
        return self._made(self.ops.complete(prompt, sampling_params(sampling, options), agent=agent, reuse=reuse))

    def complete_stream(
        self, prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None,
        reuse: Reuse | None = None, **options: Any,
    ) -> TokenStream:
        """Like :meth:`complete`, yielding text as it is generated."""
        return self._stream(self.ops.complete_stream(prompt, sampling_params(sampling, options), agent=agent,
                                                     reuse=reuse))

    def generate(
        self, messages: Messages, *, handle: HandleLike | None = None, tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None, agent: str | None = None, reuse: Reuse | None = None,
        **options: Any,
    ) -> Result:
        """Chat generation; the KV of ``handle`` (or the prefix cache) is reused for the longest common
        token prefix. ``reuse="auto"`` or ``"rotate"`` also reuses spans other agents computed behind
        a different prefix, approximately (marked: ``Result.exact`` is False); ``"exact"`` never
        changes greedy output; ``None`` takes the engine's default (``connect(reuse=...)``, "exact")."""
        args = self._generate_args(messages, handle, tools, sampling, agent, reuse, options)
        return self._made(self.ops.generate(**args), handle)

    def generate_stream(
        self, messages: Messages, *, handle: HandleLike | None = None, tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None, agent: str | None = None, reuse: Reuse | None = None,
        **options: Any,
    ) -> TokenStream:
        """Like :meth:`generate`, yielding text as it is generated."""
        stream = self.ops.generate_stream(**self._generate_args(messages, handle, tools, sampling, agent, reuse,
                                                                options))
        return self._stream(stream, handle)

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
        return self._made(out, *_inputs(prefix, segments))

    def merge(
        self, parts: Sequence[Segment | Handle], *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        """Restricted merge: prefix-compatible handles give the longest; segments are concatenated
        through :meth:`compose`; divergent KV of the same positions raises MergeConflict."""
        out = self.ops.merge(parts, agent=agent, mode=mode, correction=_mapping(correction))
        return self._made(out, *_inputs(None, parts))

    def transfer(self, handle: HandleLike, device: int | str) -> Handle:
        """Move ``handle``'s KV to another device of a multi-device backend (a worker rank, or a
        device name such as ``"cuda:1"`` when it names one worker). The backend sends the blocks
        or recomputes them from lineage, whichever its cost model predicts faster; the returned
        handle (same id) carries the new placement and a ``transfer`` lineage step. With a single
        device, a transfer to that device is a no-op and any other target raises InvalidRequest."""
        return self._made(self.ops.transfer(handle, device), handle)

    def release(self, handles: HandleLike | Iterable[HandleLike]) -> None:
        """Drop handles; their blocks are freed once no other handle shares them."""
        items = _items(handles)
        self.ops.release(items)
        released(items)

    def close(self) -> None:
        """Free the client's resources. The client is unusable afterwards."""

    def _stream(self, stream: TokenStream, *inputs: HandleLike | None) -> TokenStream:
        return record_stream(self, stream, *(i for i in inputs if i is not None), via=self._releaser())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClient(BaseClient):
    """:class:`Client` with coroutines: the same methods, awaited, over an asynchronous backend
    (``client.ops``, an :class:`~kvbaton.ops.AsyncKVOps`: :class:`~kvbaton.threaded.ThreadedOps`
    around an in-process engine, or :class:`~kvbaton.http.AsyncHttpOps`). Streaming methods return an
    :class:`~kvbaton.stream.AsyncTokenStream` (``async for chunk in stream``; ``stream.result``).
    Each method is :class:`Client`'s, awaited (see its docstrings)."""

    ops: AsyncKVOps

    def __init__(self, ops: AsyncKVOps | None = None) -> None:
        if ops is not None:  # None: a subclass that implements the methods itself (a test double) needs no backend
            self.ops = ops
        self.blocking: KVOps | None = ops.sync if isinstance(ops, ThreadedOps) else None
        """The blocking client this one runs in worker threads (an ``AsyncEmbeddedClient``'s
        ``EmbeddedClient``); None for a natively asynchronous one (over HTTP, say)."""

    def _releaser(self) -> object:
        # through the blocking client where there is one: then a scope releases from synchronous code too
        return self.blocking if self.blocking is not None else super()._releaser()

    async def materialize(self, context: Context, *, agent: str | None = None) -> Handle:
        return self._made(await self.ops.materialize(context, agent=agent))

    async def fork(self, handle: HandleLike, k: int = 2) -> list[Handle]:
        return self._made(await self.ops.fork(handle, k), handle)

    async def extend(self, handle: HandleLike, context: Context, *, agent: str | None = None) -> Handle:
        return self._made(await self.ops.extend(handle, context, agent=agent), handle)

    async def resume(
        self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None, *,
        agent: str | None = None, **options: Any,
    ) -> Result:
        result = await self.ops.resume(handle, suffix, sampling_params(sampling, options), agent=agent)
        return self._made(result, handle)

    async def resume_stream(
        self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None, *,
        agent: str | None = None, **options: Any,
    ) -> AsyncTokenStream:
        params = sampling_params(sampling, options)
        return self._stream(await self.ops.resume_stream(handle, suffix, params, agent=agent), handle)

    async def complete(
        self, prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None,
        reuse: Reuse | None = None, **options: Any,
    ) -> Result:
        return self._made(await self.ops.complete(prompt, sampling_params(sampling, options), agent=agent,
                                                  reuse=reuse))

    async def complete_stream(
        self, prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None,
        reuse: Reuse | None = None, **options: Any,
    ) -> AsyncTokenStream:
        params = sampling_params(sampling, options)
        return self._stream(await self.ops.complete_stream(prompt, params, agent=agent, reuse=reuse))

    async def generate(
        self, messages: Messages, *, handle: HandleLike | None = None, tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None, agent: str | None = None, reuse: Reuse | None = None,
        **options: Any,
    ) -> Result:
        args = self._generate_args(messages, handle, tools, sampling, agent, reuse, options)
        return self._made(await self.ops.generate(**args), handle)

    async def generate_stream(
        self, messages: Messages, *, handle: HandleLike | None = None, tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None, agent: str | None = None, reuse: Reuse | None = None,
        **options: Any,
    ) -> AsyncTokenStream:
        stream = await self.ops.generate_stream(**self._generate_args(messages, handle, tools, sampling, agent,
                                                                      reuse, options))
        return self._stream(stream, handle)

    async def compose(
        self, prefix: Handle | Context | None = None, segments: Sequence[Segment | Handle] = (),
        suffix: Context | None = None, *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        out = await self.ops.compose(prefix, segments, suffix, agent=agent, mode=mode, correction=_mapping(correction))
        return self._made(out, *_inputs(prefix, segments))

    async def merge(
        self, parts: Sequence[Segment | Handle], *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        out = await self.ops.merge(parts, agent=agent, mode=mode, correction=_mapping(correction))
        return self._made(out, *_inputs(None, parts))

    async def transfer(self, handle: HandleLike, device: int | str) -> Handle:
        return self._made(await self.ops.transfer(handle, device), handle)

    async def release(self, handles: HandleLike | Iterable[HandleLike]) -> None:
        items = _items(handles)
        await self.ops.release(items)
        released(items)

    async def close(self) -> None:
        """Free the client's resources. The client is unusable afterwards."""

    async def aclose(self) -> None:
        await self.close()

    def _stream(self, stream: AsyncTokenStream, *inputs: HandleLike | None) -> AsyncTokenStream:
        return arecord_stream(self, stream, *(i for i in inputs if i is not None), via=self._releaser())

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
