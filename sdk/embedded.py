"""The embedded client: the engine runs in this process."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .client import Client, Context, HandleLike, Messages, sampling_params
from .handle import Handle
from .stream import TokenStream
from .types import Result, SamplingParams, Stats


class EmbeddedClient(Client):
    """A client over an in-process :class:`kvbaton.backend.Engine`."""

    def __init__(self, model: str | None = None, *, engine: Any = None, **engine_options: Any) -> None:
        if engine is None:
            from kvbaton.backend.engine import Engine

            engine = Engine(model, **engine_options)
        self.engine = engine

    def materialize(self, context: Context) -> Handle:
        return self.engine.materialize(context)

    def fork(self, handle: HandleLike, k: int = 2) -> list[Handle]:
        return self.engine.fork(handle, k)

    def extend(self, handle: HandleLike, context: Context) -> Handle:
        return self.engine.extend(handle, context)

    def resume(
        self, handle: HandleLike, suffix: Context = "", *, sampling: SamplingParams | None = None, **options: Any
    ) -> Result:
        return self.engine.resume(handle, suffix, sampling_params(sampling, options))

    def resume_stream(
        self, handle: HandleLike, suffix: Context = "", *, sampling: SamplingParams | None = None, **options: Any
    ) -> TokenStream:
        return self.engine.resume_stream(handle, suffix, sampling_params(sampling, options))

    def complete(self, prompt: Context, *, sampling: SamplingParams | None = None, **options: Any) -> Result:
        return self.engine.complete(prompt, sampling_params(sampling, options))

    def complete_stream(
        self, prompt: Context, *, sampling: SamplingParams | None = None, **options: Any
    ) -> TokenStream:
        return self.engine.complete_stream(prompt, sampling_params(sampling, options))

    def generate(
        self,
        messages: Messages,
        *,
        handle: HandleLike | None = None,
        tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None,
        **options: Any,
    ) -> Result:
        return self.engine.generate(
            messages, handle=handle, sampling=sampling_params(sampling, options), tools=tools
        )

    def generate_stream(
        self,
        messages: Messages,
        *,
        handle: HandleLike | None = None,
        tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None,
        **options: Any,
    ) -> TokenStream:
        return self.engine.generate_stream(
            messages, handle=handle, sampling=sampling_params(sampling, options), tools=tools
        )

    def release(self, handles: HandleLike | Iterable[HandleLike]) -> None:
        self.engine.release(handles)

    def stats(self) -> Stats:
        return self.engine.stats()

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
