"""The tool-call convention of kvbaton: how tools are described to a model whose chat template has
no tool support, how earlier calls and results are written back, and how calls are parsed.

The convention is Hermes style: the tools as JSON lines in a ``<tools>`` block of the system
prompt, a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, a tool's result as
``<tool_response>...</tool_response>``. The engine renders chat requests with tools through it when
the chat template ignores ``tools`` (SmolLM2's does), the framework adapters use it for their own
prompts, and the OpenAI route parses answers with it — and with the formats of the models whose
templates render tools themselves (:func:`parse_tool_calls`: Llama 3's JSON calls, Mistral's
``[TOOL_CALLS]``). :func:`tool_call_format` turns a
``tool_choice`` that requires a call into a :class:`~kvbaton.ResponseFormat`, so that constrained
decoding makes even a small model emit a valid call.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequest
from .types import ResponseFormat

TOOL_PROMPT = (
    "You can call these tools:\n<tools>\n{tools}\n</tools>\n"
    'To call a tool, reply with <tool_call>{{"name": <tool name>, "arguments": <JSON object>}}</tool_call>.'
)
"""The tool block appended to the system prompt (Hermes style); ``{tools}``: one JSON line per tool."""

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_MARKERS = ("[TOOL_CALLS]", "<|python_tag|>")
"""What Mistral's and Llama 3's models write before JSON calls (gone when the tokenizer's special
tokens are skipped, as they are in answers; read when they are text)."""

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """A tool call parsed from model output."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    fn = tool.get("function", tool)
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise InvalidRequest("each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}",
                             param="tools")
    return fn


def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The function names of OpenAI-style tools."""
    return [_function(t)["name"] for t in tools]


def render_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool block for OpenAI-style schemas (``{"type": "function", "function": {...}}`` or the
    bare function dicts): each tool's name, description and parameters as one JSON line."""
    lines = []
    for tool in tools:
        fn = _function(tool)
        lines.append(json.dumps({k: fn[k] for k in ("name", "description", "parameters") if k in fn}, sort_keys=True))
    return TOOL_PROMPT.format(tools="\n".join(lines))


def with_tool_prompt(chat: Sequence[dict[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``chat`` with the tool block appended to its first system message (one is added if none)."""
    out = list(chat)
    if not tools:
        return out
    block = render_tools(tools)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def render_tool_calls(text: str, calls: Iterable[tuple[str, Any]]) -> str:
    """An assistant turn with tool calls as the model writes it: ``text``, then one
    ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` line per ``(name, arguments)``."""
    rendered = "\n".join("<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"
                         for name, args in calls)
    return f"{text}\n{rendered}" if text else rendered


def tool_result(content: str) -> dict[str, str]:
    """A tool's result as the chat message the model reads."""
    return {"role": "tool", "content": f"<tool_response>{content}</tool_response>"}


def _openai_call(call: Any) -> tuple[str, Any]:
    """``(name, arguments)`` of an OpenAI ``tool_calls`` item (arguments: a JSON string or an object)."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise InvalidRequest("each tool_calls item must be {'type': 'function', 'function': {'name', 'arguments'}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        parsed = _json(args)
        args = parsed if parsed is not None else args
    return fn["name"], args


def template_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """OpenAI-shaped chat messages written in this convention, for a chat template without tool
    support: the tool block in the system prompt, an assistant's ``tool_calls`` as ``<tool_call>``
    lines of its content, a ``tool`` message's content inside ``<tool_response>``."""
    out: list[dict[str, Any]] = []
    for m in messages:
        msg = dict(m)
        calls = msg.pop("tool_calls", None)
        if calls:
            msg["content"] = render_tool_calls(msg.get("content") or "", [_openai_call(c) for c in calls])
        if msg.get("role") == "tool" and "<tool_response>" not in (msg.get("content") or ""):
            msg = {**msg, **tool_result(msg.get("content") or "")}
        msg.pop("tool_call_id", None)
        msg.pop("name", None) if msg.get("role") == "tool" else None
        out.append(msg)
    return with_tool_prompt(out, tools or [])


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError, TypeError):
        return None


def _tool_call(item: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):
        args = _json(args)
    return ToolCall(item["name"], args if isinstance(args, dict) else {})


def leading_calls(text: str) -> tuple[list[Any], str] | None:
    """The JSON values ``text`` starts with, after a call marker (:data:`CALL_MARKERS`), several
    separated by ``;`` as Llama 3 writes them, lists flattened; and the text after them. None when
    it starts with none."""
    rest = text.strip()
    for marker in CALL_MARKERS:
        rest = rest.removeprefix(marker).lstrip()
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(rest):
        try:
            value, at = decoder.raw_decode(rest, at)
        except ValueError:
            break
        values += value if isinstance(value, list) else [value]
        after = len(rest) - len(rest[at:].lstrip())
        if rest[after:after + 1] != ";":
            break
        at = len(rest) - len(rest[after + 1:].lstrip())
    return (values, rest[at:].strip()) if values else None


def parse_tool_calls(
    text: str, tool_names: Sequence[str], forced: str | None = None
) -> tuple[str, list[ToolCall]]:
    """Tool calls in model output: every ``<tool_call>{json}</tool_call>`` block (an unterminated last
    block too), or, when there is none, the JSON a reply starts with (:func:`leading_calls`: an
    object, a list of them, Llama 3's ``;``-separated objects, after Mistral's ``[TOOL_CALLS]`` or
    Llama 3's ``<|python_tag|>``). Only objects naming one of ``tool_names`` count; ``arguments``
    (or ``parameters``) may be an object or a JSON string. With ``forced`` (a single tool the caller
    requires), a reply that is one bare JSON object that is no call is taken as that tool's arguments.

    Returns the text outside the calls and the calls; without calls, ``(text, [])``."""
    names = set(tool_names)
    if not names:
        return text, []
    whole = None
    if TOOL_CALL_OPEN in text:
        found, rest = [_json(body) for body in _TOOL_CALL.findall(text)], _TOOL_CALL.sub("", text).strip()
    else:
        values, rest = leading_calls(text) or ([], "")
        found, whole = values, values[0] if len(values) == 1 and not rest else None
    calls = [c for item in found if (c := _tool_call(item, names)) is not None]
    if calls:
        return rest, calls
    if forced is not None and isinstance(whole, dict):
        return "", [ToolCall(forced, whole)]
    return text, []


def required_tools(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any) -> list[Mapping[str, Any]] | None:
    """The tools one of which the answer must call under OpenAI's ``tool_choice`` (None: no call is
    required): ``"required"`` any of them, ``{"type": "function", "function": {"name": ...}}`` that one;
    ``"auto"``, ``"none"`` and no choice require none. An unknown choice or tool name is refused."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if not tools:
        raise InvalidRequest("Invalid value for 'tool_choice': it requires tools.", param="tool_choice")
    if tool_choice == "required":
        return list(tools)
    name = None
    if isinstance(tool_choice, Mapping) and tool_choice.get("type", "function") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise InvalidRequest("Invalid value for 'tool_choice': it must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}.", param="tool_choice")
    chosen = [t for t in tools if _function(t)["name"] == name]
    if not chosen:
        raise InvalidRequest(f"Invalid value for 'tool_choice': it names {name!r}, which is not one of the tools.",
                             param="tool_choice")
    return chosen


def tool_call_format(tools: Sequence[Mapping[str, Any]]) -> ResponseFormat:
    """The response format of exactly one call of one of ``tools``: the JSON object
    ``{"name": <tool name>, "arguments": <its parameters>}`` (what :func:`parse_tool_calls` reads);
    arguments hold only the declared parameters unless the tool's schema says otherwise."""
    options = []
    for tool in tools:
        fn = _function(tool)
        params = dict(fn.get("parameters") or {"type": "object", "properties": {}})
        # Only the declared parameters (as OpenAI's strict function calling): a small model otherwise
        # keeps inventing more until max_tokens.
        params.setdefault("additionalProperties", False)
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return ResponseFormat(type="json_schema", json_schema={"name": "tool_call", "schema": schema, "strict": True})
