"""Request inputs: text, token ids and chat messages turned into validated token ids.

Every operator validates its input completely here before it takes a block or runs the model, so
bad input never costs compute or leaks memory. Invariants: token ids are integers inside the
vocabulary; an empty context is refused unless the operator allows one; a prompt plus the tokens
it may generate fits the model's context (:class:`ContextTooLong` otherwise).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import torch
from kvbaton.errors import ContextTooLong, InvalidRequest, validation_error
from kvbaton.tools import template_messages
from kvbaton.types import ChatMessage
from pydantic import ValidationError

from .compute.loader import LoadedModel

Context = str | Sequence[int]


def _has_tool_parts(message: Any) -> bool:
    """An assistant message with tool calls, or a tool's result."""
    get = message.get if isinstance(message, dict) else lambda k, d=None: getattr(message, k, d)
    return bool(get("tool_calls")) or get("role") == "tool"


class Inputs:
    """Tokenizer, vocabulary, context length and chat template of one loaded model.

    ``chat_template`` (Jinja text) replaces the tokenizer's own for this engine only: every path that
    renders messages (generation, ``chat_tokens``, agents' fixed prompts, hence the spans indexed
    from them) goes through ``chat_tokens``, so they all see the same template."""

    def __init__(self, loaded: LoadedModel, chat_template: str | None = None) -> None:
        self._loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.chat_template = chat_template

    def tokenize(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequest(f"text must be a string, got {type(text).__name__}")
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except (TypeError, UnicodeError) as exc:  # e.g. lone surrogates, which no tokenizer can encode
            raise InvalidRequest(f"text cannot be tokenized: {exc}") from None

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(self.tokens(list(token_ids), "token_ids", allow_empty=True)))

    def chat_tokens(
        self, messages: Sequence[ChatMessage | dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the model's chat template.

        With ``add_generation_prompt`` (the default) they end ready for the assistant's reply;
        without, they are a prefix of any longer conversation, the shape to materialize shared context in.
        """
        if isinstance(messages, str | bytes) or not messages:
            raise InvalidRequest("messages must be a non-empty list of {role, content} messages")
        if not self._template_has_tools and (tools or any(_has_tool_parts(m) for m in messages)):
            # The template would drop the tools and the calls silently: kvbaton's convention writes them.
            messages = template_messages([m.model_dump(exclude_none=True) if isinstance(m, ChatMessage) else m
                                          for m in messages], tools)
            tools = None
        rendered = []
        for i, m in enumerate(messages):
            try:
                rendered.append((m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m))
                                .model_dump(exclude_none=True))
            except ValidationError as exc:
                raise validation_error([{**e, "loc": ("messages", i, *e["loc"])} for e in exc.errors()]) from None
        text = self.tokenizer.apply_chat_template(
            rendered, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False,
            chat_template=self.chat_template,
        )
        return self.tokenize(text)

    @functools.cached_property
    def _template_has_tools(self) -> bool:
        """Whether the chat template (the engine's own, else the tokenizer's) renders ``tools`` and
        assistant ``tool_calls`` itself."""
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None) or ""
        return "tools" in template and "tool_calls" in template

    def prompt_or_messages(self, value: Context | Sequence[ChatMessage | dict[str, Any]], what: str) -> list[int]:
        """Text, token ids, or chat messages (rendered without the generation prompt, so they are a
        prefix of later requests): an agent's fixed prompt."""
        if isinstance(value, Sequence) and value and isinstance(value[0], ChatMessage | dict):
            return self.chat_tokens(value, add_generation_prompt=False)  # type: ignore[arg-type]
        return self.tokens(value, what=what)  # type: ignore[arg-type]

    def tokens(self, value: Context, what: str, allow_empty: bool = False) -> list[int]:
        """Token ids of text or of a sequence of ids, validated against the vocabulary."""
        if isinstance(value, str):
            tokens = self.tokenize(value)
        elif isinstance(value, bytes) or not isinstance(value, Sequence | torch.Tensor):
            raise InvalidRequest(f"{what} must be text or a sequence of token ids, got {type(value).__name__}")
        else:
            try:
                tokens = [operator.index(t) for t in value]
            except TypeError:
                raise InvalidRequest(f"{what} token ids must be integers") from None
            vocab = self._loaded.vocab_size
            bad = next((t for t in tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequest(f"{what} has token id {bad} outside the vocabulary 0..{vocab - 1}")
        if not tokens and not allow_empty:
            raise InvalidRequest(f"{what} is empty")
        return tokens

    def check_context(self, prompt_tokens: int, max_new_tokens: int = 0) -> None:
        limit = self._loaded.max_context
        if prompt_tokens + max_new_tokens > limit:
            raise ContextTooLong(  # the field to lower: max_tokens where the prompt alone fits
                f"{prompt_tokens} prompt tokens + max_tokens {max_new_tokens} exceed the model's "
                f"context of {limit} tokens", param="max_tokens" if prompt_tokens < limit else "prompt",
            )
