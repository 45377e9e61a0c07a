"""AutoGen messages and tools as kvbaton chat, in the adapters' one tool-call convention.

Owns the translation between autogen-core's ``LLMMessage``/``Tool``/``FunctionCall`` and kvbaton's
chat messages; the convention itself (the tool block, ``<tool_call>`` lines, ``<tool_response>``
results, the parser) is :mod:`kvbaton.adapters.core`'s. Invariant: :func:`message_text` of a reply
is exactly the text the model produced for it, so it can key the side table of handles.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from autogen_core import FunctionCall, Image
from autogen_core.models import (
    AssistantMessage,
    FunctionExecutionResultMessage,
    LLMMessage,
    SystemMessage,
    UserMessage,
)
from autogen_core.tools import Tool, ToolSchema

from ..core import parse_tool_calls, render_tool_calls, tool_result, with_tool_prompt


def tool_schema(tool: Tool | ToolSchema | Mapping[str, Any]) -> dict[str, Any]:
    """An autogen tool as an OpenAI-style function schema."""
    schema: Mapping[str, Any] = tool.schema if isinstance(tool, Tool) else tool  # type: ignore[assignment]
    function: dict[str, Any] = {"name": schema["name"]}
    if schema.get("description"):
        function["description"] = schema["description"]
    function["parameters"] = dict(schema.get("parameters") or {"type": "object", "properties": {}})
    return {"type": "function", "function": function}


def _text(content: str | Sequence[str | Image]) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        else:
            raise TypeError("kvbaton models take text only: image content is not supported (vision=False)")
    return "\n".join(parts)


def _arguments(call: FunctionCall) -> Any:
    try:
        return json.loads(call.arguments) if call.arguments else {}
    except json.JSONDecodeError:
        return call.arguments


def message_text(message: LLMMessage) -> str:
    """The text a message is rendered with (also the side-table key of AutoGen replies)."""
    if isinstance(message, AssistantMessage) and not isinstance(message.content, str):
        return render_tool_calls(message.thought or "", [(c.name, _arguments(c)) for c in message.content])
    if isinstance(message, FunctionExecutionResultMessage):
        return "\n".join(r.content for r in message.content)
    return _text(message.content)  # type: ignore[arg-type]


def render_messages(
    messages: Sequence[LLMMessage], tools: Sequence[dict[str, Any]] = (), tools_in_system: bool = False
) -> list[dict[str, str]]:
    """``LLMMessage``s as kvbaton chat messages (``role``/``content``).

    Function results become ``tool`` messages wrapped in ``<tool_response>``; assistant function
    calls become ``<tool_call>`` text. With ``tools_in_system`` the tool block is appended to the
    first system message (one is added if there is none)."""
    out: list[dict[str, str]] = []
    for message in messages:
        if isinstance(message, SystemMessage):
            out.append({"role": "system", "content": message.content})
        elif isinstance(message, UserMessage):
            out.append({"role": "user", "content": _text(message.content)})
        elif isinstance(message, AssistantMessage):
            out.append({"role": "assistant", "content": message_text(message)})
        elif isinstance(message, FunctionExecutionResultMessage):
            out.extend(tool_result(result.content) for result in message.content)
        else:  # pragma: no cover - LLMMessage is a closed union
            raise TypeError(f"unsupported message type {type(message).__name__}")
    return with_tool_prompt(out, tools) if tools_in_system else out


def function_calls(text: str, tool_names: Sequence[str]) -> tuple[str, list[FunctionCall]]:
    """:func:`kvbaton.adapters.core.parse_tool_calls` with AutoGen ``FunctionCall``\\ s: the text
    outside the calls (the "thought") and the calls."""
    thought, calls = parse_tool_calls(text, tool_names)
    return thought, [FunctionCall(id=c.id, name=c.name, arguments=json.dumps(c.arguments)) for c in calls]


__all__ = ["function_calls", "message_text", "render_messages", "tool_schema"]
