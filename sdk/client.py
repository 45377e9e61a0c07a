"""The one client interface of kvbaton, and ``connect()``.

Every client (embedded today; HTTP with the server) implements :class:`Client`, so code written
against one runs against the other by changing only the ``connect`` target.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

from pydantic import ValidationError

from .errors import InvalidRequest
from .handle import Handle
from .stream import TokenStream
from .types import ChatMessage, Result, SamplingParams, Stats

HandleLike = Handle | str
Context = str | Sequence[int]
Messages = Sequence[ChatMessage | dict[str, Any]]


def sampling_params(sampling: SamplingParams | None, overrides: dict[str, Any]) -> SamplingParams:
    """Merge keyword overrides (``max_tokens=8, temperature=0.7``) into sampling parameters."""
    base = sampling.model_dump() if sampling is not None else {}
    try:
        return SamplingParams.model_validate({**base, **overrides})
    except ValidationError as exc:
        raise InvalidRequest(f"invalid sampling parameters: {exc}") from exc


class Client(abc.ABC):
    """Handle operators on one model. Sampling options may be given as a
    :class:`~kvbaton.SamplingParams` or as keywords (``max_tokens``, ``temperature``, ``top_p``,
    ``top_k``, ``seed``, ``stop``, ``ignore_eos``)."""

    @abc.abstractmethod
    def materialize(self, context: Context) -> Handle:
        """Prefill ``context`` (text or token ids) and return a handle to its KV."""

    @abc.abstractmethod
    def fork(self, handle: HandleLike, k: int = 2) -> list[Handle]:
        """``k`` new handles sharing every KV block of ``handle`` (zero copy)."""

    @abc.abstractmethod
    def extend(self, handle: HandleLike, context: Context) -> Handle:
        """A new handle: ``handle``'s context followed by ``context``, prefilled, nothing generated."""

    @abc.abstractmethod
    def resume(
        self, handle: HandleLike, suffix: Context = "", *, sampling: SamplingParams | None = None, **options: Any
    ) -> Result:
        """Prefill ``suffix`` behind ``handle`` and generate."""

    @abc.abstractmethod
    def resume_stream(
        self, handle: HandleLike, suffix: Context = "", *, sampling: SamplingParams | None = None, **options: Any
    ) -> TokenStream:
        """Like :meth:`resume`, yielding text as it is generated."""

    @abc.abstractmethod
    def complete(self, prompt: Context, *, sampling: SamplingParams | None = None, **options: Any) -> Result:
        """Plain completion of text or token ids, without a handle or chat template (text replay)."""

    @abc.abstractmethod
    def complete_stream(
        self, prompt: Context, *, sampling: SamplingParams | None = None, **options: Any
    ) -> TokenStream:
        """Like :meth:`complete`, yielding text as it is generated."""

    @abc.abstractmethod
    def generate(
        self,
        messages: Messages,
        *,
        handle: HandleLike | None = None,
        tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None,
        **options: Any,
    ) -> Result:
        """Chat generation; the KV of ``handle`` is reused for the longest common token prefix."""

    @abc.abstractmethod
    def generate_stream(
        self,
        messages: Messages,
        *,
        handle: HandleLike | None = None,
        tools: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None,
        **options: Any,
    ) -> TokenStream:
        """Like :meth:`generate`, yielding text as it is generated."""

    @abc.abstractmethod
    def release(self, handles: HandleLike | Iterable[HandleLike]) -> None:
        """Drop handles; their blocks are freed once no other handle shares them."""

    @abc.abstractmethod
    def stats(self) -> Stats:
        """Pool usage and reuse counters."""

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""

    @abc.abstractmethod
    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``."""

    @abc.abstractmethod
    def chat_tokens(
        self,
        messages: Messages,
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """``messages`` rendered by the model's chat template, as token ids. Without the generation
        prompt they are a prefix of any longer conversation: materialize shared context that way."""

    def close(self) -> None:
        """Free the client's resources. The client is unusable afterwards."""

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def connect(target: str | None = None, *, model: str | None = None, **options: Any) -> Client:
    """Open a kvbaton client.

    ``connect()`` starts an embedded engine with the default model in this process;
    ``connect(model="/path/to/hf-checkpoint")`` another local model. Engine options
    (``dtype``, ``device``, ``kv_budget``, ``block_size``, ``prefill_chunk``) pass through.
    """
    if target is None or target == "embedded":
        from .embedded import EmbeddedClient

        return EmbeddedClient(model=model, **options)
    raise InvalidRequest(
        f"unsupported connect target {target!r}: use connect() for the embedded engine"
    )
