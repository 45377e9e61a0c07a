"""Which fields of an OpenAI request the server honours, ignores or refuses.

OpenAI itself answers 400 to an argument it does not know, and a client that sets a penalty or a
``logit_bias`` expects it to change the output: so a field the server cannot honour is a 400 naming
it (``param``), never dropped. A refused field at its no-op value (``presence_penalty: 0``,
``logit_bias: {}``, ``echo: false``, ``best_of: 1``, vLLM's ``skip_special_tokens: true``...)
changes nothing and is accepted, since some clients send the defaults explicitly: every extra of
vLLM's and SGLang's OpenAI servers is accepted at its default. Fields that do not change what is
generated (``user``, ``metadata``, ``store``, a request id...) are accepted and ignored, as
OpenAI-compatible servers do. The Responses API refuses the chat API's fields it does not have
(``n``, ``stop``, ``seed``, ``max_tokens``...), as OpenAI's does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvbaton.errors import InvalidRequest

# Accepted and ignored: they do not change the output (``user`` also names a session, see tenancy).
IGNORED: frozenset[str] = frozenset({
    "user", "metadata", "store", "service_tier", "prediction", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "safety_identifier",
    "request_id", "rid",  # vLLM's and SGLang's request ids (kvbaton makes its own)
})

# Honoured through the request model (tools, response formats, log probabilities).
DECLARED: frozenset[str] = frozenset({
    "tools", "tool_choice", "parallel_tool_calls", "response_format", "logprobs", "top_logprobs",
})

# Refused unless at their no-op value: OpenAI fields, and vLLM's and SGLang's extras, that this server
# does not implement. ``_ABSENT`` marks a field refused at any value but null.
_ABSENT = object()
UNSUPPORTED: dict[str, Any] = {
    # OpenAI
    "presence_penalty": 0,
    "frequency_penalty": 0,
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
    "moderation": _ABSENT,
    # vLLM's sampling and extra parameters (vllm/entrypoints/openai/protocol.py), at their defaults
    "repetition_penalty": 1,
    "min_p": 0,
    "length_penalty": 1,
    "use_beam_search": False,
    "stop_token_ids": [],
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,  # the engine's detokenizer skips them
    "spaces_between_special_tokens": True,
    "truncate_prompt_tokens": _ABSENT,
    "prompt_logprobs": _ABSENT,
    "allowed_token_ids": _ABSENT,
    "bad_words": [],
    "add_generation_prompt": True,
    "continue_final_message": False,
    "add_special_tokens": False,  # the engine adds no special token its chat template does not write
    "documents": _ABSENT,
    "chat_template": _ABSENT,
    "chat_template_kwargs": _ABSENT,
    "mm_processor_kwargs": _ABSENT,
    "guided_json": _ABSENT,
    "guided_regex": _ABSENT,
    "guided_choice": _ABSENT,
    "guided_grammar": _ABSENT,
    "structural_tag": _ABSENT,
    "guided_decoding_backend": _ABSENT,
    "guided_whitespace_pattern": _ABSENT,
    "priority": 0,
    "logits_processors": _ABSENT,
    "return_tokens_as_token_ids": False,
    "cache_salt": _ABSENT,
    "kv_transfer_params": _ABSENT,
    "vllm_xargs": _ABSENT,
    "include_reasoning": True,
    "prompt_embeds": _ABSENT,
    # SGLang's extras (sglang/srt/entrypoints/openai/protocol.py), at their defaults
    "json_schema": _ABSENT,
    "regex": _ABSENT,
    "ebnf": _ABSENT,
    "stop_regex": _ABSENT,
    "no_stop_trim": False,
    "lora_path": _ABSENT,
    "session_params": _ABSENT,
    "custom_params": _ABSENT,
    "custom_logit_processor": _ABSENT,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "return_cached_tokens_details": False,
    "return_token_ids": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "bootstrap_host": _ABSENT,
    "bootstrap_port": _ABSENT,
    "bootstrap_room": _ABSENT,
    "routed_dp_rank": _ABSENT,
    "data_parallel_rank": _ABSENT,
    "extra_key": _ABSENT,
    "custom_labels": _ABSENT,
}

# The chat API's fields that the Responses API does not have: refused at any value, as OpenAI does.
NOT_IN_RESPONSES: frozenset[str] = frozenset({
    "n", "stop", "seed", "max_tokens", "max_completion_tokens", "messages", "response_format", "logprobs",
    "presence_penalty", "frequency_penalty", "logit_bias", "modalities", "audio", "functions", "function_call",
    "reasoning_effort", "verbosity", "web_search_options", "prediction",
})

# The Responses API's own fields the server cannot honour (tools and structured output included:
# that route is text only), refused unless at their no-op value.
RESPONSES_UNSUPPORTED: dict[str, Any] = {
    **{k: v for k, v in UNSUPPORTED.items() if k not in NOT_IN_RESPONSES | {"echo", "best_of", "suffix"}},
    "previous_response_id": _ABSENT,
    "conversation": _ABSENT,
    "context_management": _ABSENT,
    "reasoning": _ABSENT,
    "background": False,
    "background_options": _ABSENT,
    "include": [],
    "truncation": "disabled",
    "text": {"format": {"type": "text"}},
    "tools": [],
    "tool_choice": "none",
    "max_tool_calls": _ABSENT,
    "prompt": _ABSENT,
    "top_logprobs": 0,
    "image": _ABSENT,
    "access_programs": _ABSENT,
}

@dataclass(frozen=True)
class FieldTable:
    """One route's treatment of undeclared fields: ignored, honoured elsewhere, refused unless at
    their no-op value, or refused as not the route's (``foreign``, with the route to use instead)."""

    ignored: frozenset[str]
    declared: frozenset[str]
    unsupported: dict[str, Any]
    foreign: frozenset[str] = frozenset()
    foreign_hint: str = ""


COMPLETION_FIELDS = FieldTable(IGNORED, DECLARED, UNSUPPORTED)
RESPONSES_FIELDS = FieldTable(IGNORED | {"parallel_tool_calls"}, frozenset(), RESPONSES_UNSUPPORTED,
                              NOT_IN_RESPONSES, "the Responses API has no such parameter; /v1/chat/completions has")

# vLLM/SGLang extras honoured as top-level fields (also inside the ``kvbaton`` field): declared on
# the request model, listed here for the docs.
EXTRAS: tuple[str, ...] = ("top_k", "ignore_eos", "min_tokens")


def no_op(value: Any, default: Any) -> bool:
    """Whether ``value`` is the no-op ``default`` of a refused field (null always is)."""
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
        if name in table.ignored or name in table.declared:
            continue
        if name in table.foreign:
            raise InvalidRequest(f"Unsupported parameter: '{name}': {table.foreign_hint}.", param=name)
        if name in table.unsupported:
            if no_op(value, table.unsupported[name]):
                continue
            default = table.unsupported[name]
            accepted = "" if default is _ABSENT else f" (only its default, {json.dumps(default)}, is accepted)"
            raise InvalidRequest(f"Unsupported value for '{name}': this server does not implement it{accepted}; "
                                 "see docs/server.md#openai-fields.", param=name)
        raise InvalidRequest(f"Unrecognized request argument supplied: '{name}' (docs/server.md#openai-fields).",
                             param=name)
