"""OpenAI message shapes translated for the chat template: chat messages (text content, the
template's roles: ``developer`` is ``system``, ``function`` is ``tool``; an assistant's tool-call
``arguments`` as objects, which templates with tool support render, as vLLM gives them) and the
Responses API's ``instructions`` + ``input`` items. Anything but text is refused (400 naming the
field at fault).
"""

from __future__ import annotations

import json
from typing import Any

from kvbaton.errors import InvalidRequest

_ROLES = {"developer": "system", "function": "tool"}
_KNOWN = ("system", "user", "assistant", "tool", "developer", "function")


def _text_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif (isinstance(part, dict) and part.get("type") in ("text", "input_text")
                  and isinstance(part.get("text"), str)):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(f"Invalid value for '{where}[{k}]': only text content is supported, got a "
                                     f"{kind!r} part.", param=f"{where}[{k}]")
        return "".join(parts)
    raise InvalidRequest(f"Invalid type for '{where}': expected a string or an array of text parts, but got "
                         f"{type(content).__name__} instead.", param=where)


def _tool_calls(calls: Any) -> Any:
    """An assistant's ``tool_calls`` with each ``function.arguments`` an object where it is JSON text."""
    if not isinstance(calls, list):
        return calls  # the template path says what is wrong with it
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**fn, "arguments": parsed}}
        out.append(call)
    return out


def openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as the chat template takes them: text content, template roles."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"Invalid type for '{where}': expected an object with role and content.", param=where)
        role = m.get("role")
        if role not in _KNOWN:
            raise InvalidRequest(f"Invalid value for '{where}.role': expected one of {', '.join(_KNOWN)}, got "
                                 f"{json.dumps(role)}.", param=f"{where}.role")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["role"] = _ROLES.get(role, role)
        msg["content"] = _text_content(m.get("content"), f"{where}.content")
        if "tool_calls" in msg:
            msg["tool_calls"] = _tool_calls(msg["tool_calls"])
        out.append(msg)
    return out


def responses_messages(given: str | list[Any], instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages of a Responses request: ``instructions`` as the system message, then its
    ``input`` (``given``): text, one user message, or message items."""
    items: list[Any] = [{"role": "user", "content": given}] if isinstance(given, str) else given
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for k, item in enumerate(items):
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise InvalidRequest(f"Invalid value for 'input[{k}]': only message input items are supported, got "
                                 f"{kind!r}.", param="input")
        messages.append({"role": item.get("role"), "content": item.get("content")})
    return openai_messages(messages)
