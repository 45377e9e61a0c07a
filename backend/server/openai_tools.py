"""Tool calls of a streamed chat choice, as OpenAI deltas while the model writes them.

A choice's text is fed piece by piece; :class:`ToolCallStream` says, after each piece, what can be
sent already: content (text outside any call), a call's opening delta (its ``id``, ``type`` and
``function.name``, once the name is complete and names a tool) and pieces of its
``function.arguments``, as vLLM's tool parsers stream them. The formats are those of
:func:`kvbaton.tools.parse_tool_calls`: Hermes blocks (``<tool_call>{...}</tool_call>``: kvbaton's
own convention, Qwen's), and a reply that starts with JSON calls (Llama 3's ``{"name": ...,
"parameters": ...}``, several separated by ``;``, after an optional ``<|python_tag|>``; Mistral's
``[TOOL_CALLS] [{...}, ...]``; a bare object or a list of them).

Invariants: arguments are streamed as the growing prefix of ``json.dumps(arguments)`` that no later
text can change (partial JSON parsed by ``jiter``; the tail that a string, a number or a closing
bracket may still change is held back), so the pieces of a call add up to the whole answer's
``arguments``; content is never a piece of a ``<tool_call>`` tag, and whitespace next to a call is
held back (the whole answer strips it); what is undecided while streaming (a reply whose first
object does not start with its ``name``, a block that names no tool) waits for the end, where
:func:`kvbaton.tools.parse_tool_calls` of the whole text settles it: a stream ends with the calls
of the whole answer.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import jiter
from kvbaton.tools import CALL_MARKERS, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCall, parse_tool_calls

Delta = dict[str, Any]
_HELD_TAIL = '"}]0123456789.eE+-'  # what a partial value's JSON may still change at its end


def stable_prefix(value: Any) -> str:
    """The part of ``json.dumps(value)`` (of a partially parsed value) that the rest of its text
    cannot change: the closers the parser added and a number or string that may still grow cut off."""
    return json.dumps(value).rstrip(_HELD_TAIL)


def _partial(text: str, mode: str) -> Any:
    """The JSON value ``text`` starts, complete or not (``trailing-strings``: an unfinished string is
    kept as far as it goes; ``on``: dropped), or None when nothing parses yet."""
    try:
        return jiter.from_json(text.encode(), partial_mode=mode)
    except ValueError:
        return None


def json_calls(text: str, mode: str = "trailing-strings") -> tuple[list[tuple[Any, bool]], bool]:
    """The items of the JSON calls ``text`` starts with, as :func:`kvbaton.tools.leading_calls` reads
    them but while they are written: ``(value, complete)`` each (lists flattened); and whether
    other text follows them."""
    decoder, items, at = json.JSONDecoder(), [], 0
    while True:
        at = len(text) - len(text[at:].lstrip())
        if at >= len(text):
            return items, False
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            value = _partial(text[at:], mode)
            if isinstance(value, list):
                items += [(v, k < len(value) - 1) for k, v in enumerate(value)]
            elif value is not None:
                items.append((value, False))
            return items, False
        items += [(v, True) for v in value] if isinstance(value, list) else [(value, True)]
        after = len(text) - len(text[at:].lstrip())
        if text[after:after + 1] != ";":
            return items, after < len(text)
        at = after + 1


def _arguments(obj: Any) -> Any:
    return obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None


@dataclass
class _Call:
    name: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    sent: str = ""  # of json.dumps(arguments)


class ToolCallStream:
    """The OpenAI deltas of one streamed choice that may call the tools ``names`` (module docstring)."""

    def __init__(self, names: list[str], forced: str | None = None) -> None:
        self.names, self.forced = list(names), forced
        self.text = ""
        self._mode = "start"  # start | text | block | json | held
        self._pos = 0  # the text before this is said (content, or a call's block)
        self._calls: list[_Call] = []
        self._block_calls = 0  # calls of the blocks that ended
        self._content = ""  # the content sent

    @property
    def called(self) -> bool:
        """Whether the choice has called a tool so far."""
        return bool(self._calls)

    def finish_reason(self, engine_reason: str) -> str:
        """``tool_calls`` once the choice called a tool, else the engine's."""
        return "tool_calls" if self.called else engine_reason

    def feed(self, piece: str) -> list[Delta]:
        """The deltas that ``piece``, the choice's next text, makes sendable: ``{"content": ...}`` or
        ``{"tool_calls": [...]}``."""
        self.text += piece
        out: list[Delta] = []
        while True:
            before = (self._mode, self._pos, len(self._calls))
            out += self._step()
            if (self._mode, self._pos, len(self._calls)) == before:
                return out

    def finish(self) -> list[Delta]:
        """The last deltas, once the choice has ended: what was held back, settled by the whole
        text's parse (:func:`kvbaton.tools.parse_tool_calls`)."""
        out: list[Delta] = []
        if self._mode == "block":  # an unterminated last block counts, as in the whole answer
            out += self._block(ended=True)
        content, calls = parse_tool_calls(self.text, self.names, self.forced)
        if not calls and not self._calls:  # no call: the whole text is content
            return out + self._say(content[len(self._content):] if content.startswith(self._content)
                                   else self.text[self._pos:])
        for k, call in enumerate(calls):
            if k >= len(self._calls):
                out += self._open(call.name, call.id)
            out += self._close(self._calls[k], call)
        for extra in self._calls[len(calls):]:  # started, but the whole text does not have it
            out += self._close(extra, None)
        if content.startswith(self._content):
            out += self._say(content[len(self._content):])
        return out

    # -- what each mode can say -----------------------------------------------------------------------

    def _step(self) -> list[Delta]:
        rest = self.text[self._pos:]
        if self._mode == "start":
            head = rest.lstrip()
            if head:
                is_json = head[0] in "{[" or any(m.startswith(head[:len(m)]) for m in CALL_MARKERS)
                self._mode = "json" if is_json else "text"
            return []
        if self._mode == "text":
            return self._text(rest)
        if self._mode == "block":
            return self._block(ended=False)
        if self._mode == "json":
            return self._json(rest)
        return []  # held: the end decides

    def _text(self, rest: str) -> list[Delta]:
        at = rest.find(TOOL_CALL_OPEN)
        if at != -1:
            out = self._say(rest[:at].rstrip())  # whitespace next to a call is not content
            self._pos += at + len(TOOL_CALL_OPEN)
            self._mode = "block"
            return out
        tag = next((k for k in range(min(len(rest), len(TOOL_CALL_OPEN) - 1), 0, -1)
                    if TOOL_CALL_OPEN.startswith(rest[-k:])), 0)  # the start of a tag being written
        ready = rest[:len(rest) - tag].rstrip()
        if not ready.strip():
            return []
        self._pos += len(ready)
        return self._say(ready)

    def _block(self, ended: bool) -> list[Delta]:
        body = self.text[self._pos:]
        close = body.find(TOOL_CALL_CLOSE)
        done = ended or close != -1
        body = (body[:close] if close != -1 else body).strip()
        out = self._item(body, done, self._block_calls, lenient=not done)
        if self._mode == "held":
            return out
        if done:
            self._pos += close + len(TOOL_CALL_CLOSE) if close != -1 else len(self.text) - self._pos
            self._block_calls = len(self._calls)
            self._mode = "text"
        return out

    def _json(self, rest: str) -> list[Delta]:
        head = rest.lstrip()
        for marker in CALL_MARKERS:
            if len(head) < len(marker) and marker.startswith(head):
                return []  # a marker being written
            head = head.removeprefix(marker).lstrip()
        items, _ = json_calls(head)
        named, _ = json_calls(head, "on")
        out: list[Delta] = []
        for k, (item, complete) in enumerate(items):
            name = named[k][0].get("name") if k < len(named) and isinstance(named[k][0], dict) else None
            out += self._call_item(k, item, name, complete)
            if self._mode == "held" or k >= len(self._calls):
                break
        return out

    def _item(self, body: str, done: bool, k: int, lenient: bool) -> list[Delta]:
        """A block's one call (call ``k``), as far as ``body`` goes."""
        complete = None
        if done:
            try:
                complete = json.loads(body)
            except ValueError:
                complete = None
        item = complete if complete is not None else _partial(body, "trailing-strings")
        named = complete if complete is not None else _partial(body, "on")
        name = named.get("name") if isinstance(named, dict) else None
        if item is None and lenient and (not body or body.startswith("{")):
            return []  # nothing to read yet
        return self._call_item(k, item, name, complete is not None)

    def _call_item(self, k: int, item: Any, name: Any, complete: bool) -> list[Delta]:
        """Call ``k`` from one parsed object: opened once its ``name`` is complete and a tool's;
        its arguments as far as they are certain."""
        out: list[Delta] = []
        if k >= len(self._calls):
            if isinstance(name, str) and name in self.names:
                out += self._open(name, None)
            elif not complete and isinstance(item, dict) and name is None and next(iter(item), "name") == "name":
                return out  # its name is still being written
            else:
                self._mode = "held"  # no call of a tool, as far as it goes: the end decides
                return out
        args = _arguments(item)
        if isinstance(args, dict):
            out += self._args(self._calls[k], json.dumps(args) if complete else stable_prefix(args))
        return out

    # -- deltas ---------------------------------------------------------------------------------------

    def _say(self, text: str) -> list[Delta]:
        if not text:
            return []
        self._content += text
        return [{"content": text}]

    def _open(self, name: str, call_id: str | None) -> list[Delta]:
        call = _Call(name) if call_id is None else _Call(name, call_id)
        self._calls.append(call)
        return [{"tool_calls": [{"index": len(self._calls) - 1, "id": call.id, "type": "function",
                                 "function": {"name": name, "arguments": ""}}]}]

    def _args(self, call: _Call, prefix: str) -> list[Delta]:
        if len(prefix) <= len(call.sent) or not prefix.startswith(call.sent):
            return []
        piece, call.sent = prefix[len(call.sent):], prefix
        return [{"tool_calls": [{"index": self._calls.index(call), "function": {"arguments": piece}}]}]

    def _close(self, call: _Call, parsed: ToolCall | None) -> list[Delta]:
        """The rest of a call's arguments: the whole answer's, or (it has none such) what was sent, closed."""
        final = json.dumps(parsed.arguments) if parsed is not None and parsed.name == call.name else None
        if final is None or not final.startswith(call.sent):
            final = (call.sent or "{") + "}" * ((call.sent or "{").count("{") - call.sent.count("}"))
        return self._args(call, final)


# -- a required call (constrained decoding) ----------------------------------------------------------------

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)("?)')
_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*')


class RequiredCallStream:
    """The deltas of a choice whose output is constrained to one call (``tool_choice`` required or
    named: :func:`kvbaton.tools.tool_call_format`, the JSON ``{"name": ..., "arguments": {...}}``).

    The call opens once its name is written; its ``arguments`` are the text the model writes for
    them, streamed as it comes (the closing brace of the whole object held back until the next
    piece shows it was the arguments' own). A choice cut by ``max_tokens`` keeps its partial call
    — as OpenAI and vLLM answer: the call in ``tool_calls`` with the arguments as far as they were
    written (not valid JSON), no content, and ``finish_reason: "length"``. The whole answer is this
    stream's deltas added up (:func:`required_call`), so streamed and whole answers agree."""

    def __init__(self, names: list[str], forced: str | None = None) -> None:
        self.names, self.forced = list(names), forced
        self.text = ""
        self._name_end = 0
        self._call: _Call | None = None
        self._args_at: int | None = None  # where the arguments' text starts
        self.complete = False

    @property
    def called(self) -> bool:
        return self._call is not None

    def finish_reason(self, engine_reason: str) -> str:
        """``tool_calls`` for a whole call; the engine's (``length``) for one cut short."""
        return "tool_calls" if self.complete else engine_reason

    def feed(self, piece: str) -> list[Delta]:
        self.text += piece
        out = self._open(ended=False)
        if self._args_at is None and self._call is not None:
            m = _ARGUMENTS.match(self.text, self._name_end)
            if m is not None:
                self._args_at = m.end()
        if self._args_at is not None:
            body = self.text[self._args_at:].rstrip()
            out += self._send(body[:-1] if body.endswith("}") else body)  # the whole object's closer, maybe
        return out

    def finish(self) -> list[Delta]:
        out = self._open(ended=True)
        if self._call is None:
            return out
        try:
            whole = json.loads(self.text)
        except ValueError:
            whole = None
        self.complete = isinstance(whole, dict) and whole.get("name") == self._call.name and "arguments" in whole
        if self._args_at is None:
            return out
        body = self.text[self._args_at:].rstrip()
        if self.complete:  # the arguments end where the whole object's closing brace starts
            body = body[:-1].rstrip()
        return out + self._send(body)

    def _open(self, ended: bool) -> list[Delta]:
        if self._call is not None:
            return []
        m = _NAME.match(self.text)
        if m is None:
            if not ended or not self.forced:
                return []
            name, self._name_end = self.forced, len(self.text)  # cut before its name: the one tool it must call
        elif m.group(2):  # the name's closing quote: the name is whole
            name, self._name_end = m.group(1), m.end()
        elif ended:  # cut inside the name: the tool it was naming, when only one fits
            fits = [n for n in self.names if n.startswith(m.group(1))]
            name, self._name_end = (fits[0] if len(fits) == 1 else m.group(1)), m.end()
        else:
            return []
        self._call = _Call(name)
        return [{"tool_calls": [{"index": 0, "id": self._call.id, "type": "function",
                                 "function": {"name": name, "arguments": ""}}]}]

    def _send(self, text: str) -> list[Delta]:
        call = self._call
        assert call is not None
        if len(text) <= len(call.sent) or not text.startswith(call.sent):
            return []
        piece, call.sent = text[len(call.sent):], text
        return [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}]


def required_call(text: str, names: list[str], forced: str | None = None) -> tuple[dict[str, Any] | None, bool]:
    """The one call of a constrained choice's whole ``text`` (:class:`RequiredCallStream`'s deltas
    added up): ``(call, complete)``; None when the text names no call at all."""
    stream = RequiredCallStream(names, forced)
    deltas = [*stream.feed(text), *stream.finish()]
    call: dict[str, Any] | None = None
    for delta in deltas:
        for item in delta.get("tool_calls", ()):
            if "id" in item:
                call = {"id": item["id"], "type": "function",
                        "function": {"name": item["function"]["name"], "arguments": ""}}
            elif call is not None:
                call["function"]["arguments"] += item["function"]["arguments"]
    return call, stream.complete
