"""The embedded clients: the engine runs in this process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from typing import Any

import anyio

from .capabilities import KVBATON, Capabilities
from .client import AsyncClient, Client, Context, HandleLike, Messages, sampling_params, steps_map
from .handle import Handle, Segment
from .stepgraph import StepGraph
from .stream import AsyncTokenStream, TokenStream
from .types import AgentInfo, Composition, Fidelity, Result, SamplingParams, Stats


class EmbeddedClient(Client):
    """A client over an in-process :class:`kvbaton.backend.Engine`."""

    def __init__(self, model: str | None = None, *, engine: Any = None, **engine_options: Any) -> None:
        if engine is None:
            from kvbaton.backend.engine import Engine

            engine = Engine(model, **engine_options)
        self.engine = engine

    def materialize(self, context: Context, *, agent: str | None = None) -> Handle:
        return self.engine.materialize(context, agent=agent)

    def fork(self, handle: HandleLike, k: int = 2) -> list[Handle]:
        return self.engine.fork(handle, k)

    def extend(self, handle: HandleLike, context: Context, *, agent: str | None = None) -> Handle:
        return self.engine.extend(handle, context, agent=agent)

    def transfer(self, handle: HandleLike, device: int | str) -> Handle:
        return self.engine.transfer(handle, device)

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
        return self.engine.compose(
            prefix, segments, suffix, agent=agent, mode=mode, correction=_mapping(correction)
        )

    def merge(
        self, parts: Sequence[Segment | Handle], *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        return self.engine.merge(parts, agent=agent, mode=mode, correction=_mapping(correction))

    def fidelity(self, handle: HandleLike, max_tokens: int = 32, *, reference: HandleLike | None = None) -> Fidelity:
        return self.engine.fidelity(handle, max_tokens, reference=reference)

    def resume(
        self,
        handle: HandleLike,
        suffix: Context = "",
        *,
        sampling: SamplingParams | None = None,
        agent: str | None = None,
        **options: Any,
    ) -> Result:
        return self.engine.resume(handle, suffix, sampling_params(sampling, options), agent=agent)

    def resume_stream(
        self,
        handle: HandleLike,
        suffix: Context = "",
        *,
        sampling: SamplingParams | None = None,
        agent: str | None = None,
        **options: Any,
    ) -> TokenStream:
        return self.engine.resume_stream(handle, suffix, sampling_params(sampling, options), agent=agent)

    def complete(
        self, prompt: Context, *, sampling: SamplingParams | None = None, agent: str | None = None, **options: Any
    ) -> Result:
        return self.engine.complete(prompt, sampling_params(sampling, options), agent=agent)

    def complete_stream(
        self, prompt: Context, *, sampling: SamplingParams | None = None, agent: str | None = None, **options: Any
    ) -> TokenStream:
        return self.engine.complete_stream(prompt, sampling_params(sampling, options), agent=agent)

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
        return self.engine.generate(
            messages, handle=handle, sampling=sampling_params(sampling, options), tools=tools, agent=agent
        )

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
        return self.engine.generate_stream(
            messages, handle=handle, sampling=sampling_params(sampling, options), tools=tools, agent=agent
        )

    def register_agent(self, name: str, fixed_prompt: Context | Messages, *, prefill: bool = False) -> AgentInfo:
        return self.engine.register_agent(name, fixed_prompt, prefill=prefill)

    def hints(
        self, steps: Mapping[str, float] | StepGraph, *, running: Iterable[str] = (), finished: Iterable[str] = ()
    ) -> dict[str, float]:
        return self.engine.hints(steps_map(steps, running, finished))

    def release(self, handles: HandleLike | Iterable[HandleLike]) -> None:
        self.engine.release(handles)

    def stats(self) -> Stats:
        return self.engine.stats()

    def capabilities(self) -> Capabilities:
        # An engine other than kvbaton's own (the SGLang one) describes itself.
        describe = getattr(self.engine, "capabilities", None)
        return describe() if describe is not None else KVBATON

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenize(text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.engine.detokenize(token_ids)

    def chat_tokens(
        self,
        messages: Messages,
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        return self.engine.chat_tokens(messages, tools=tools, add_generation_prompt=add_generation_prompt)


_END = object()


def _async_stream(stream: TokenStream) -> AsyncTokenStream:
    """An engine stream consumed from worker threads, one step per ``await``."""

    async def items() -> AsyncGenerator[Any, None]:
        try:
            while True:
                # anyio (not asyncio.to_thread): a cancelled await waits for the step in flight, so
                # the close below never meets a running generator.
                chunk = await anyio.to_thread.run_sync(next, stream, _END)
                if chunk is _END:
                    break
                yield chunk
            assert stream.result is not None
            yield stream.result
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(stream.close)

    return AsyncTokenStream(items())


class AsyncEmbeddedClient(AsyncClient):
    """:class:`EmbeddedClient` with coroutines: each call runs in a worker thread
    (``asyncio.to_thread``) so the event loop never blocks on the model."""

    def __init__(
        self, model: str | None = None, *, client: EmbeddedClient | None = None, engine: Any = None,
        **engine_options: Any,
    ) -> None:
        self.client = client if client is not None else EmbeddedClient(model, engine=engine, **engine_options)
        self.engine = self.client.engine

    async def materialize(self, context: Context, *, agent: str | None = None) -> Handle:
        return await asyncio.to_thread(self.client.materialize, context, agent=agent)

    async def fork(self, handle: HandleLike, k: int = 2) -> list[Handle]:
        return await asyncio.to_thread(self.client.fork, handle, k)

    async def extend(self, handle: HandleLike, context: Context, *, agent: str | None = None) -> Handle:
        return await asyncio.to_thread(self.client.extend, handle, context, agent=agent)

    async def transfer(self, handle: HandleLike, device: int | str) -> Handle:
        return await asyncio.to_thread(self.client.transfer, handle, device)

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
        return await asyncio.to_thread(
            self.client.compose, prefix, segments, suffix, agent=agent, mode=mode, correction=correction
        )

    async def merge(
        self, parts: Sequence[Segment | Handle], *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        return await asyncio.to_thread(self.client.merge, parts, agent=agent, mode=mode, correction=correction)

    async def fidelity(
        self, handle: HandleLike, max_tokens: int = 32, *, reference: HandleLike | None = None
    ) -> Fidelity:
        return await asyncio.to_thread(self.client.fidelity, handle, max_tokens, reference=reference)

    async def resume(
        self,
        handle: HandleLike,
        suffix: Context = "",
        *,
        sampling: SamplingParams | None = None,
        agent: str | None = None,
        **options: Any,
    ) -> Result:
        return await asyncio.to_thread(self.client.resume, handle, suffix, sampling=sampling, agent=agent, **options)

    async def resume_stream(
        self,
        handle: HandleLike,
        suffix: Context = "",
        *,
        sampling: SamplingParams | None = None,
        agent: str | None = None,
        **options: Any,
    ) -> AsyncTokenStream:
        stream = await asyncio.to_thread(
            self.client.resume_stream, handle, suffix, sampling=sampling, agent=agent, **options
        )
        return _async_stream(stream)

    async def complete(
        self, prompt: Context, *, sampling: SamplingParams | None = None, agent: str | None = None, **options: Any
    ) -> Result:
        return await asyncio.to_thread(self.client.complete, prompt, sampling=sampling, agent=agent, **options)

    async def complete_stream(
        self, prompt: Context, *, sampling: SamplingParams | None = None, agent: str | None = None, **options: Any
    ) -> AsyncTokenStream:
        stream = await asyncio.to_thread(
            self.client.complete_stream, prompt, sampling=sampling, agent=agent, **options
        )
        return _async_stream(stream)

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
        return await asyncio.to_thread(
            self.client.generate, messages, handle=handle, tools=tools, sampling=sampling, agent=agent, **options
        )

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
        stream = await asyncio.to_thread(
            self.client.generate_stream, messages, handle=handle, tools=tools, sampling=sampling, agent=agent,
            **options,
        )
        return _async_stream(stream)

    async def release(self, handles: HandleLike | Iterable[HandleLike]) -> None:
        await asyncio.to_thread(self.client.release, handles)

    async def stats(self) -> Stats:
        return await asyncio.to_thread(self.client.stats)

    async def capabilities(self) -> Capabilities:
        return self.client.capabilities()

    async def tokenize(self, text: str) -> list[int]:
        return await asyncio.to_thread(self.client.tokenize, text)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return await asyncio.to_thread(self.client.detokenize, token_ids)

    async def chat_tokens(
        self,
        messages: Messages,
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        return await asyncio.to_thread(
            self.client.chat_tokens, messages, tools=tools, add_generation_prompt=add_generation_prompt
        )

    async def register_agent(
        self, name: str, fixed_prompt: Context | Messages, *, prefill: bool = False
    ) -> AgentInfo:
        return await asyncio.to_thread(self.client.register_agent, name, fixed_prompt, prefill=prefill)

    async def hints(
        self, steps: Mapping[str, float] | StepGraph, *, running: Iterable[str] = (), finished: Iterable[str] = ()
    ) -> dict[str, float]:
        return await asyncio.to_thread(self.client.hints, steps, running=running, finished=finished)

    async def close(self) -> None:
        self.client.close()


def _mapping(value: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if value is None else dict(value)
