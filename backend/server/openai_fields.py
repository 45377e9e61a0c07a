"""Which fields of an OpenAI request the server honours, ignores or refuses.

OpenAI itself answers 400 to an argument it does not know, and a client that sets a penalty or a
``logit_bias`` expects it to change the output: so a field the server cannot honour is a 400 naming
it (``param``), never dropped. A refused field at its no-op value (``presence_penalty: 0``,
``logit_bias: {}``, ``echo: false``, ``best_of: 1``...) changes nothing and is accepted, since some
clients send the defaults explicitly. Fields that do not change what is generated (``user``,
``metadata``, ``store``...) are accepted and ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbaton.errors import InvalidRequest

# Accepted and ignored: they do not change the output (``user`` also names a session, see tenancy).
IGNORED: frozenset[str] = frozenset({
    "user", "metadata", "store", "service_tier", "prediction", "prompt_cache_key", "safety_identifier",
})

# Left as they are today for the structured-output work (tools, response formats, log probabilities).
DEFERRED: frozenset[str] = frozenset({
    "tools", "tool_choice", "parallel_tool_calls", "response_format", "logprobs", "top_logprobs",
})

# Refused unless at their no-op value: OpenAI fields (and vLLM extras) this server does not implement.
# ``_ABSENT`` marks a field refused at any value.
_ABSENT = object()
UNSUPPORTED: dict[str, Any] = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "logit_bias": {},
    "echo": False,
    "best_of": 1,
    "suffix": "",
    "modalities": ["text"],
    "audio": _ABSENT,
    "functions": _ABSENT,
    "function_call": _ABSENT,
    "reasoning_effort": _ABSENT,
    "verbosity": _ABSENT,
    "web_search_options": _ABSENT,
    "min_p": 0,
    "length_penalty": 1,
    "use_beam_search": False,
    "prompt_logprobs": _ABSENT,
    "guided_json": _ABSENT,
    "guided_regex": _ABSENT,
    "guided_choice": _ABSENT,
    "guided_grammar": _ABSENT,
    "chat_template": _ABSENT,
    "chat_template_kwargs": _ABSENT,
}

# The Responses API's own fields the server cannot honour (tools and structured output included:
# that route is text only), refused unless at their no-op value.
RESPONSES_UNSUPPORTED: dict[str, Any] = {
    **{k: v for k, v in UNSUPPORTED.items() if k not in ("echo", "best_of", "suffix")},
    "previous_response_id": _ABSENT,
    "conversation": _ABSENT,
    "reasoning": _ABSENT,
    "background": False,
    "include": [],
    "truncation": "disabled",
    "text": {"format": {"type": "text"}},
    "tools": [],
    "tool_choice": "none",
    "max_tool_calls": _ABSENT,
    "prompt": _ABSENT,
    "top_logprobs": 0,
}


@dataclass(frozen=True)
class FieldTable:
    """One route's treatment of undeclared fields: ignored, left as they are, or refused."""

    ignored: frozenset[str]
    deferred: frozenset[str]
    unsupported: dict[str, Any]


COMPLETION_FIELDS = FieldTable(IGNORED, DEFERRED, UNSUPPORTED)
RESPONSES_FIELDS = FieldTable(IGNORED | {"parallel_tool_calls"}, frozenset(), RESPONSES_UNSUPPORTED)

# vLLM/SGLang extras honoured as top-level fields (also inside the ``kvbaton`` field): declared on
# the request model, listed here for the docs.
EXTRAS: tuple[str, ...] = ("top_k", "ignore_eos", "min_tokens")


def _no_op(value: Any, default: Any) -> bool:
    if value is None:
        return True
    if default is _ABSENT:
        return False
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    return bool(value == default)


def check_fields(extra: dict[str, Any] | None, table: FieldTable = COMPLETION_FIELDS) -> None:
    """400 ``invalid_request`` naming the first field of ``extra`` (the body's undeclared fields)
    that the server would otherwise have to drop."""
    for name, value in (extra or {}).items():
        if name in table.ignored or name in table.deferred:
            continue
        if name in table.unsupported:
            if _no_op(value, table.unsupported[name]):
                continue
            raise InvalidRequest(f"{name!r} is not supported by this server (docs/server.md#openai-fields)", param=name)
        raise InvalidRequest(f"unrecognized request argument {name!r} (docs/server.md#openai-fields)", param=name)
