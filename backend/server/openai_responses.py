"""The Responses API (``POST /v1/responses``), text only: a chat completion of one choice in the
Responses shape, whole or streamed as the Responses API's typed events.

``ResponsesServing`` is :class:`.openai.ChatServing` with another request (``instructions`` + ``input``,
translated by :func:`.openai_messages.responses_messages`) and another answer; ``_ResponsesEvents``
says a stream as ``response.created`` ... ``response.output_text.delta`` ... ``response.completed``.
Invariants: the streamed events add up to the whole answer (the same ``response`` object closes the
stream); what the route cannot honour (tools, stored responses...) is refused by its field table.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import Request
from kvbaton.errors import OPENAI_CODES
from kvbaton.types import Result, StreamChunk

from . import protocol as p
from .accesslog import note_usage
from .openai import ChatServing, OpenAIServing, usage
from .openai_fields import RESPONSES_FIELDS
from .openai_messages import responses_messages
from .openai_plan import Plan
from .sse import StreamEvents, sse


class ResponsesServing(ChatServing):
    """``/v1/responses``, text only: ``instructions`` + ``input`` are chat messages, served exactly as
    a chat completion of one choice (the agent's retained handle, per session, included); the answer
    is a Responses ``response`` with one ``output_text``, or with ``stream: true`` the Responses
    API's typed events (``response.created`` ... ``response.output_text.delta`` ...
    ``response.completed``), as ``openai``'s ``responses.stream()`` and the Agents SDK read them."""

    endpoint = "/v1/responses"
    id_prefix = "resp_"
    object = "response"
    fields = RESPONSES_FIELDS
    prompt_field = "input"

    def plan(self, body: p.ResponsesRequest, request: Request) -> Plan:  # type: ignore[override]
        return OpenAIServing.plan(self, body, request)  # no tools here (refused by the field table)

    def prompt(self, body: p.ResponsesRequest,
               ext: p.KvbatonExtension) -> tuple[list[Any], list[dict[str, Any]] | None]:
        return [responses_messages(body.input, body.instructions)], None

    def stream_events(self, plan: Plan) -> StreamEvents:
        return _ResponsesEvents(self, plan)

    def item_id(self, plan: Plan) -> str:
        return "msg_" + plan.id[len(self.id_prefix):]

    def response(self, plan: Plan, result: Result | None, status: str, output: list[dict[str, Any]],
                 kept: list[str | None] | None = None) -> dict[str, Any]:
        """The ``response`` object: ``status`` ``in_progress`` (no result yet), ``completed`` or
        ``incomplete`` (cut by ``max_output_tokens``), with its usage and ``kvbaton`` field once done."""
        body: dict[str, Any] = {
            "id": plan.id, "object": self.object, "created_at": plan.created, "model": plan.model, "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None, "instructions": None, "metadata": {}, "parallel_tool_calls": False, "tool_choice": "none",
            "tools": [], "temperature": plan.params[0].temperature, "top_p": plan.params[0].top_p, "output": output,
            "usage": None,
        }
        if result is not None:
            counts = usage([result])  # one choice: what is returned is what is counted
            # cache_write_tokens: the prompt tokens prefilled now (their K/V are what the prefix cache keeps)
            details = {**counts["prompt_tokens_details"], "cache_write_tokens": result.timings.tokens_prefilled}
            body["usage"] = {
                "input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"],
                "total_tokens": counts["total_tokens"], "input_tokens_details": details,
                "output_tokens_details": counts["completion_tokens_details"],
            }
            body["kvbaton"] = self.extension(plan, kept or [None], [result])
        return body

    def message_item(self, plan: Plan, text: str | None, status: str) -> dict[str, Any]:
        """The output message item (``text`` None: no content part yet)."""
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
        return {"type": "message", "id": self.item_id(plan), "status": status, "role": "assistant",
                "content": content}

    def answer(self, plan: Plan, results: Sequence[Result], kept: list[str | None]) -> dict[str, Any]:
        result = results[0]
        status = "completed" if result.finish_reason == "stop" else "incomplete"
        return self.response(plan, result, status, [self.message_item(plan, result.text, "completed")], kept)


class _ResponsesEvents(StreamEvents):
    """A streamed Responses answer: ``response.created``, ``response.in_progress``, the message item
    and its text part added, ``response.output_text.delta`` per chunk, the text, part and item done,
    then ``response.completed`` (or ``response.incomplete``) with the whole response; every event
    named by its ``type`` (the SSE ``event:`` line too) and numbered (``sequence_number``)."""

    def __init__(self, serving: ResponsesServing, plan: Plan) -> None:
        self.serving, self.plan = serving, plan
        self.seq = 0
        self.text = ""
        self.status = "completed"

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(json.dumps(body), kind)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.serving.item_id(self.plan), "output_index": 0, "content_index": 0}

    def opening(self, index: int) -> list[str]:
        s, plan = self.serving, self.plan
        pending = s.response(plan, None, "in_progress", [])
        return [
            self._event("response.created", response=pending),
            self._event("response.in_progress", response=pending),
            self._event("response.output_item.added", output_index=0, item=s.message_item(plan, None, "in_progress")),
            self._event("response.content_part.added", **self._where(),
                        part={"type": "output_text", "text": "", "annotations": []}),
        ]

    def chunk(self, index: int, chunk: StreamChunk) -> list[str]:
        if not chunk.text:
            return []
        self.text += chunk.text
        return [self._event("response.output_text.delta", **self._where(), delta=chunk.text, logprobs=[])]

    def closing(self, index: int, result: Result, last: bool) -> list[str]:
        self.serving.observe(result, self.plan)
        self.status = "completed" if result.finish_reason == "stop" else "incomplete"
        part = {"type": "output_text", "text": result.text, "annotations": []}
        return [
            self._event("response.output_text.done", **self._where(), text=result.text, logprobs=[]),
            self._event("response.content_part.done", **self._where(), part=part),
            self._event("response.output_item.done", output_index=0,
                        item=self.serving.message_item(self.plan, result.text, "completed")),
        ]

    def finish(self, results: list[Result]) -> list[str]:
        kept = self.serving.finish(self.plan, results)
        note_usage(self.plan.scope, usage(results))
        result = results[0]
        whole = self.serving.response(self.plan, result, self.status,
                                      [self.serving.message_item(self.plan, result.text, "completed")], kept)
        return [self._event(f"response.{self.status}", response=whole)]

    def error(self, body: dict[str, Any]) -> str:
        err = body.get("error", {})
        return self._event("error", code=OPENAI_CODES.get(err.get("code"), err.get("code")),
                           message=err.get("message", ""), param=err.get("param"))
