"""The OpenAI-compatible API: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses`` (text, not streamed), and kvbaton's ``DELETE /v1/sessions/{id}``.

One template method serves both completion endpoints, in the spirit of SGLang's
``OpenAIServingBase.handle_request``: ``OpenAIServing.handle`` parses the request into a ``Plan``,
runs it whole or streams it through the one SSE driver, and builds the answer; ``ChatServing`` and
``CompletionServing`` fill in only what differs (the prompt, how streams open, which handles are
kept, the shape of a choice). Also here: OpenAI chat messages translated for the chat template.

Invariants: choice ``i`` samples with ``seed + i`` (choices differ, a request is reproducible);
a request is admitted for its ``n`` result handles within the tenant's quotas; an agent's latest
chat result stays in its slot and the one before is released (unless the caller ``keep``s every
handle); a full pool first evicts the same tenant's other agents' idle slots (never another
tenant's), then answers 503; streams own their handles as every stream does (``sse``). Reuse: a
request runs with its own policy (``kvbaton.reuse`` / ``X-Kvbaton-Reuse``), else the server's; an
answer says whether it is exact (``kvbaton.exact``, and ``X-Kvbaton-Approximate: true`` on a whole
answer that is not), ``cached_tokens`` counts exact reuse only, and an ``"exact"`` request never
resumes an agent's retained approximate handle.
"""

from __future__ import annotations

import functools
import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from kvbaton.errors import (
    OPENAI_CODES,
    HandleNotFound,
    HandleReleased,
    InvalidRequest,
    ModelNotFound,
    PoolExhausted,
)
from kvbaton.stream import TokenStream
from kvbaton.tools import parse_tool_calls, required_tools, tool_call_format, tool_names
from kvbaton.types import Result, Reuse, SamplingParams, StreamChunk, TokenLogprob

from .. import protocol as p
from .accesslog import note_tokens
from .errors import ERROR_RESPONSES, STREAM_RESPONSES, template_errors
from .openai_fields import COMPLETION_FIELDS, RESPONSES_FIELDS, FieldTable, check_fields
from .sse import Streams, StreamEvents, close_all, open_primed, prime_all, sse, stream_response
from .state import ServerState
from .tenancy import SlotKey, request_agent, request_reuse, request_session, request_tenant

APPROXIMATE_HEADER = "X-Kvbaton-Approximate"
"""Response header, ``true`` on a (non-streamed) answer whose prompt K/V were partly reused approximately."""


# -- messages ------------------------------------------------------------------------------------

_ROLES = {"developer": "system", "function": "tool"}


def _text_content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif (isinstance(part, dict) and part.get("type") in ("text", "input_text")
                  and isinstance(part.get("text"), str)):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(f"only text content is supported, got a {kind!r} part")
        return "".join(parts)
    raise InvalidRequest(f"message content must be text or a list of text parts, got {type(content).__name__}")


def openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as the chat template takes them: text content, template roles."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise InvalidRequest("each message must be an object with role and content")
        role = m.get("role")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["role"] = _ROLES.get(role, role) if isinstance(role, str) else role
        msg["content"] = _text_content(m.get("content"))
        out.append(msg)
    return out


def usage(results: Sequence[Result]) -> dict[str, Any]:
    """OpenAI usage of ``n`` choices: their one prompt, every choice's completion. ``cached_tokens``
    counts exact reuse only: K/V reused approximately (``tokens_approximate``) is not what OpenAI
    clients take a cache hit to be."""
    first = results[0].timings
    prompt = first.tokens_reused + first.tokens_prefilled
    completion = sum(r.timings.tokens_generated for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": first.tokens_reused - first.tokens_approximate},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


# -- the template ----------------------------------------------------------------------------------


@dataclass
class Plan:
    """One parsed OpenAI request: who asks, what the engine gets, the sampling of each choice."""

    tenant: str
    session: str  # "" is the default session
    agent: str  # "" when none
    engine_agent: str | None
    reuse: p.HandleRef | None  # the caller's handle to reuse (else the agent's latest, for chat)
    policy: Reuse  # the reuse policy the engine runs it with
    keep: bool
    step: str | int | None
    params: list[SamplingParams]  # one per choice
    prompt: Any  # what the engine is given: chat messages, or the completion prompt
    tools: list[dict[str, Any]] | None
    include_usage: bool
    id: str
    created: int
    model: str = ""  # the name answers carry: the served name asked for, else the first
    scope: dict[str, Any] | None = None  # the request's ASGI scope: its access line counts the tokens
    tool_names: list[str] = field(default_factory=list)  # the tools an answer may call (chat)
    forced: str | None = None  # the one tool the answer must call, when tool_choice names it

    @property
    def parses_tools(self) -> bool:
        return bool(self.tool_names)

    @property
    def key(self) -> SlotKey:
        return (self.tenant, self.session, self.agent)


class OpenAIServing:
    """The template of an OpenAI completion endpoint; subclasses fill in the hooks below ``handle``."""

    endpoint: str
    id_prefix: str
    object: str  # of the whole answer
    chunk_object: str  # of a streamed chunk
    head: ClassVar[dict[str, Any]] = {}  # more fields after id/object/created/model
    fields: ClassVar[FieldTable] = COMPLETION_FIELDS  # which undeclared request fields are accepted

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def handle(self, body: p.OpenAIRequest, request: Request) -> Any:
        plan = self.plan(body, request)
        plan.scope = request.scope
        admission = self.state.admit(plan.tenant, len(plan.params))
        if body.stream:
            return await stream_response(self.state, plan.tenant, functools.partial(self.open_streams, plan),
                                         _OpenAIEvents(self, plan), admission)
        with admission:
            results, kept = await self.state.run(self.run_all, plan)
        for r in results:
            self.observe(r, plan)
        payload = self.answer(plan, results, kept)
        headers = {"X-Kvbaton-Handle": kept[0]} if kept[0] else {}
        if not all(r.exact for r in results):
            headers[APPROXIMATE_HEADER] = "true"
        return JSONResponse(payload, headers=headers or None)

    def answer(self, plan: Plan, results: Sequence[Result], kept: list[str | None]) -> dict[str, Any]:
        """The whole (not streamed) answer."""
        return {
            **self.header(plan, self.object),
            "choices": [self.whole_choice(plan, i, r) for i, r in enumerate(results)],
            "usage": usage(results),
            "kvbaton": self.extension(plan, kept, results),
        }

    def plan(self, body: p.OpenAIRequest, request: Request) -> Plan:
        state = self.state
        tenant = request_tenant(request)
        check_fields(body.model_extra, self.fields)
        ext = body.kvbaton or p.KvbatonExtension()
        agent = request_agent(request, ext.agent) or ""
        session = request_session(request, ext.session, (body.model_extra or {}).get("user"))
        engine_agent = state.agent(tenant, agent)
        if body.n > state.max_n:
            raise InvalidRequest(f"n {body.n} exceeds the server's limit of {state.max_n}")
        state.check_owned(tenant, [ext.handle])
        policy = state.reuse(request_reuse(request, ext.reuse))
        fields = {k: v for k, v in body.sampling_fields().items() if v is not None}
        fields.setdefault("max_tokens", state.default_max_tokens)
        if fields.get("min_tokens", 0) > fields["max_tokens"]:
            raise InvalidRequest(f"min_tokens {fields['min_tokens']} exceeds max_tokens {fields['max_tokens']}",
                                 param="min_tokens")
        seeds = [None if body.seed is None else (body.seed + i) % 2**63 for i in range(body.n)]
        params = [state.sampling({**fields, "seed": seed}) for seed in seeds]
        prompt, tools = self.prompt(body, ext)
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return Plan(
            tenant=tenant, session=session, agent=agent, engine_agent=engine_agent, reuse=ext.handle, policy=policy,
            keep=ext.keep, step=ext.step, params=params, prompt=prompt, tools=tools, include_usage=include_usage,
            id=self.id_prefix + secrets.token_hex(12), created=int(time.time()),
            model=body.model if body.model in state.model_names else state.model,
        )

    def run_all(self, plan: Plan) -> tuple[list[Result], list[str | None]]:
        """Every choice to its end (in a worker thread); the results and the handles kept for the caller."""
        streams, _ = self.open_streams(plan)
        try:
            results = [s.until_done() for s in streams]
        except BaseException:  # the choices that did end made handles nobody will get
            self.state.release_quietly([s.result.handle.id for s in streams if s.result is not None])
            raise
        finally:
            close_all(streams)
        return results, self.finish(plan, results)

    def observe(self, result: Result, plan: Plan) -> None:
        self.state.metrics.observe(self.endpoint, result)
        note_tokens(plan.scope, result)

    def header(self, plan: Plan, obj: str) -> dict[str, Any]:
        return {"id": plan.id, "object": obj, "created": plan.created, "model": plan.model, **self.head}

    @staticmethod
    def choice(index: int, part: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, **part, "logprobs": None, "finish_reason": finish_reason}

    def whole_choice(self, plan: Plan, index: int, result: Result) -> dict[str, Any]:
        """A whole choice: its output and, when asked for, its log probabilities."""
        part, finish = self.output(plan, result)
        return {**self.choice(index, part, finish), "logprobs": self.logprobs(result.logprobs)}

    def output(self, plan: Plan, result: Result) -> tuple[dict[str, Any], str]:
        """A whole choice's output part and finish reason."""
        return self.message(result.text), result.finish_reason

    def logprobs(self, entries: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
        """The choice's ``logprobs`` field (None when not asked for); ``offset``: of the first token's text."""
        return None

    @staticmethod
    def extension(plan: Plan, kept: list[str | None], results: Sequence[Result]) -> dict[str, Any]:
        """The ``kvbaton`` field of the answer: handles kept for the caller, agent, step, timings (one per
        choice), and whether the answer is exact: ``exact`` (every choice's prompt K/V equal dense
        prefill's), ``reuse`` (the policy it ran with), and choice 0's ``tokens_approximate`` and
        ``segments`` (the spans placed behind this prompt's prefix, and what was done with each)."""
        first = results[0]
        return {"handle": kept[0], "handles": kept, "agent": plan.agent or None, "step": plan.step,
                "timings": [r.timings.model_dump() for r in results],
                "exact": all(r.exact for r in results), "reuse": plan.policy,
                "tokens_approximate": first.timings.tokens_approximate,
                "segments": [s.model_dump(mode="json") for s in first.segments]}

    # -- hooks --------------------------------------------------------------------------------------
    def prompt(self, body: Any, ext: p.KvbatonExtension) -> tuple[Any, list[dict[str, Any]] | None]:
        """What the engine is given (validated), and the tools of the chat template."""
        raise NotImplementedError

    def open_streams(self, plan: Plan) -> Streams:
        """Open and prime one stream per choice (in a worker thread)."""
        raise NotImplementedError

    def finish(self, plan: Plan, results: Sequence[Result]) -> list[str | None]:
        """Record the result handles; the ones kept for the caller (None: released or retained)."""
        raise NotImplementedError

    def message(self, text: str) -> dict[str, Any]:
        """A whole choice's output."""
        raise NotImplementedError

    def delta(self, text: str | None) -> dict[str, Any]:
        """A streamed piece of a choice (None: its closing chunk)."""
        raise NotImplementedError

    def opening(self) -> dict[str, Any] | None:
        """What a streamed choice says before its first piece, if anything."""
        return None


class _OpenAIEvents(StreamEvents):
    """The chunks of an OpenAI stream: choices one after the other, the ``kvbaton`` field on the
    last chunk, usage when asked for, then ``[DONE]``."""

    def __init__(self, serving: OpenAIServing, plan: Plan) -> None:
        self.serving, self.plan = serving, plan
        self.offsets: dict[int, int] = {}  # per choice: characters streamed so far (legacy logprobs' text_offset)

    def _chunk(self, choices: list[dict[str, Any]], **more: Any) -> str:
        head = self.serving.header(self.plan, self.serving.chunk_object)
        return sse(json.dumps({**head, "choices": choices, **more}))

    def opening(self, index: int) -> list[str]:
        part = self.serving.opening()
        return [self._chunk([self.serving.choice(index, part, None)])] if part is not None else []

    def chunk(self, index: int, chunk: StreamChunk) -> list[str]:
        if self.plan.parses_tools or not (chunk.text or chunk.logprobs):
            return []  # with tools, a choice is parsed whole and sent as its closing delta
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(chunk.text)
        choice = self.serving.choice(index, self.serving.delta(chunk.text), None)
        return [self._chunk([{**choice, "logprobs": self.serving.logprobs(chunk.logprobs, offset)}])]

    def _closing(self, index: int, result: Result) -> dict[str, Any]:
        if not self.plan.parses_tools:
            return self.serving.choice(index, self.serving.delta(None), result.finish_reason)
        # The whole choice in one delta: its text and tool calls, and its logprobs.
        part, finish = self.serving.output(self.plan, result)
        delta = {k: v for k, v in part["message"].items() if k != "role" and v is not None}
        for i, call in enumerate(delta.get("tool_calls", [])):
            call["index"] = i
        choice = self.serving.choice(index, {"delta": delta}, finish)
        return {**choice, "logprobs": self.serving.logprobs(result.logprobs)}

    def closing(self, index: int, result: Result, last: bool) -> list[str]:
        self.serving.observe(result, self.plan)
        if last:
            return []  # the last choice closes with the kvbaton field, in finish
        return [self._chunk([self._closing(index, result)])]

    def finish(self, results: list[Result]) -> list[str]:
        kept = self.serving.finish(self.plan, results)
        ext = self.serving.extension(self.plan, kept, results)
        last = self._closing(len(results) - 1, results[-1])
        out = [self._chunk([last], kvbaton=ext)]
        if self.plan.include_usage:
            out.append(self._chunk([], usage=usage(results), kvbaton=ext))
        return [*out, sse("[DONE]")]

    def error(self, body: dict[str, Any]) -> str:
        err = body.get("error", {})
        if "code" in err:
            err["code"] = OPENAI_CODES.get(err["code"], err["code"])
        return sse(json.dumps(body))


# -- chat and completions ----------------------------------------------------------------------------


class ChatServing(OpenAIServing):
    """``/v1/chat/completions``: reuses the caller's handle or the agent's latest one, and retains
    choice 0's result handle in the agent's slot."""

    endpoint = "/v1/chat/completions"
    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    head: ClassVar[dict[str, Any]] = {"system_fingerprint": None}

    def prompt(self, body: p.ChatCompletionRequest, ext: p.KvbatonExtension) -> tuple[Any, list[dict[str, Any]] | None]:
        tools = None if body.tool_choice == "none" else body.tools  # "none": the model is not told of them
        return openai_messages(body.messages), tools or None

    def plan(self, body: p.ChatCompletionRequest, request: Request) -> Plan:  # type: ignore[override]
        plan = super().plan(body, request)
        return tool_plan(plan, body.tool_choice)

    def output(self, plan: Plan, result: Result) -> tuple[dict[str, Any], str]:
        if not plan.parses_tools:
            return self.message(result.text), result.finish_reason
        text, calls = parse_tool_calls(result.text, plan.tool_names, plan.forced)
        if not calls:
            return self.message(result.text), result.finish_reason
        message = {"role": "assistant", "content": text or None, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in calls]}
        return {"message": message}, "tool_calls"

    def logprobs(self, entries: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
        """OpenAI chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
        if entries is None:
            return None

        def item(e: Any) -> dict[str, Any]:
            return {"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode())}

        return {"content": [{**item(e), "top_logprobs": [item(t) for t in e.top_logprobs]} for e in entries]}

    def open_streams(self, plan: Plan) -> Streams:
        state = self.state

        def open_stream(handle: p.HandleRef | None, params: SamplingParams) -> TokenStream:
            return template_errors(functools.partial(
                state.engine.generate_stream, plan.prompt, handle=handle, tools=plan.tools, sampling=params,
                agent=plan.engine_agent, reuse=plan.policy,
            ))

        while True:
            slot = state.slots.slot(plan.key)
            streams: list[TokenStream] = []
            try:
                with slot.lock:
                    base: p.HandleRef | None = plan.reuse if plan.reuse is not None else slot.handle_id
                    if plan.reuse is None and not slot.exact and plan.policy == "exact":
                        # An exact request does not resume the agent's approximate turn; its exact
                        # prefix still comes from the prefix cache. (A handle the caller names is used.)
                        base = None
                    state.check_owned(plan.tenant, [base])  # the retained handle is used: its idle time restarts
                    for params in plan.params:
                        try:
                            streams.append(open_stream(base, params))
                        except (HandleNotFound, HandleReleased):
                            if plan.reuse is not None or base is None:
                                raise
                            slot.handle_id = base = None  # the retained handle was released meanwhile
                            streams.append(open_stream(None, params))
                return streams, prime_all(streams)
            except PoolExhausted:
                close_all(streams)
                victim = state.slots.oldest_idle(plan.tenant, exclude=plan.key)
                if victim is None:
                    raise
                state.release_quietly([victim.take()])
            except BaseException:
                close_all(streams)
                raise

    def finish(self, plan: Plan, results: Sequence[Result]) -> list[str | None]:
        state = self.state
        state.record(plan.tenant, [r.handle for r in results])
        handles = [r.handle.id for r in results]
        if plan.keep:
            return list(handles)
        old = state.slots.slot(plan.key).replace(handles[0], exact=results[0].exact)
        state.retained(plan.key, handles[0])
        state.release_quietly([*handles[1:], old if old != handles[0] else None])
        state.release_quietly([evicted.handle_id for evicted in state.slots.overflow(plan.tenant)])
        return [handles[0]] + [None] * (len(handles) - 1)

    def message(self, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}}

    def delta(self, text: str | None) -> dict[str, Any]:
        return {"delta": {} if text is None else {"content": text}}

    def opening(self) -> dict[str, Any] | None:
        return {"delta": {"role": "assistant", "content": ""}}


class CompletionServing(OpenAIServing):
    """``/v1/completions``: one prompt, no handle reuse; result handles are released unless kept."""

    endpoint = "/v1/completions"
    id_prefix = "cmpl-"
    object = chunk_object = "text_completion"

    def prompt(self, body: p.CompletionRequest, ext: p.KvbatonExtension) -> tuple[Any, list[dict[str, Any]] | None]:
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise InvalidRequest("only one prompt per request is supported")
            prompt = prompt[0]
        if ext.handle is not None:
            raise InvalidRequest("/v1/completions does not take a handle; use /v1/chat/completions or /v1/kv/resume")
        return prompt, None

    def open_streams(self, plan: Plan) -> Streams:
        engine = self.state.engine
        return open_primed(functools.partial(engine.complete_stream, plan.prompt, params, agent=plan.engine_agent,
                                             reuse=plan.policy)
                           for params in plan.params)

    def run_all(self, plan: Plan) -> tuple[list[Result], list[str | None]]:
        # One choice at a time: the pool holds one request of this call, not n.
        results: list[Result] = []
        try:
            for params in plan.params:
                results.append(self.state.engine.complete(plan.prompt, params, agent=plan.engine_agent,
                                                          reuse=plan.policy))
        except BaseException:  # the choices that did end made handles nobody will get
            self.state.release_quietly([r.handle.id for r in results])
            raise
        return results, self.finish(plan, results)

    def finish(self, plan: Plan, results: Sequence[Result]) -> list[str | None]:
        self.state.record(plan.tenant, [r.handle for r in results])
        handles = [r.handle.id for r in results]
        if plan.keep:
            return list(handles)
        self.state.release_quietly(handles)
        return [None] * len(handles)

    def message(self, text: str) -> dict[str, Any]:
        return {"text": text}

    def logprobs(self, entries: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
        """The legacy shape: tokens, their logprobs, the alternatives by token, each token's text offset."""
        if entries is None:
            return None
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(e.token)
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in entries],
                "text_offset": offsets}

    def delta(self, text: str | None) -> dict[str, Any]:
        return {"text": text or ""}


class ResponsesServing(ChatServing):
    """``/v1/responses``, text only and whole (no stream): ``instructions`` + ``input`` are chat
    messages, served exactly as a chat completion of one choice (the agent's retained handle, per
    session, included); the answer is a Responses ``response`` with one ``output_text``."""

    endpoint = "/v1/responses"
    id_prefix = "resp_"
    object = "response"
    fields = RESPONSES_FIELDS

    async def handle(self, body: p.OpenAIRequest, request: Request) -> Any:
        if body.stream:
            raise InvalidRequest("/v1/responses does not stream here; use /v1/chat/completions with stream",
                                 param="stream")
        return await super().handle(body, request)

    def plan(self, body: p.ResponsesRequest, request: Request) -> Plan:  # type: ignore[override]
        return OpenAIServing.plan(self, body, request)  # no tools here (refused by the field table)

    def prompt(self, body: p.ResponsesRequest, ext: p.KvbatonExtension) -> tuple[Any, list[dict[str, Any]] | None]:
        items: list[Any] = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
        messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
        for item in items:
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                kind = item.get("type") if isinstance(item, dict) else type(item).__name__
                raise InvalidRequest(f"only message input items are supported, got {kind!r}", param="input")
            messages.append({"role": item.get("role"), "content": item.get("content")})
        return openai_messages(messages), None

    def answer(self, plan: Plan, results: Sequence[Result], kept: list[str | None]) -> dict[str, Any]:
        result, counts = results[0], usage(results)
        complete = result.finish_reason == "stop"
        return {
            "id": plan.id, "object": self.object, "created_at": plan.created, "model": plan.model,
            "status": "completed" if complete else "incomplete",
            "incomplete_details": None if complete else {"reason": "max_output_tokens"},
            "error": None, "instructions": None, "metadata": {}, "parallel_tool_calls": False, "tool_choice": "none",
            "tools": [], "temperature": plan.params[0].temperature, "top_p": plan.params[0].top_p,
            "output": [{
                "type": "message", "id": "msg_" + plan.id[len(self.id_prefix):], "status": "completed",
                "role": "assistant", "content": [{"type": "output_text", "text": result.text, "annotations": []}],
            }],
            "usage": {
                "input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"],
                "total_tokens": counts["total_tokens"], "input_tokens_details": counts["prompt_tokens_details"],
                "output_tokens_details": counts["completion_tokens_details"],
            },
            "kvbaton": self.extension(plan, kept, results),
        }


# -- tools -----------------------------------------------------------------------------------------


def tool_plan(plan: Plan, tool_choice: Any) -> Plan:
    """``plan`` with its tools' names to parse answers for, and, when ``tool_choice`` requires a call,
    every choice constrained to one call of the allowed tools (:func:`kvbaton.tools.tool_call_format`)."""
    tools = plan.tools or []
    required = required_tools(tools, tool_choice) if tool_choice != "none" else None
    plan.tool_names = tool_names(tools)
    if required is None:
        return plan
    if any(params.response_format is not None and params.response_format.type != "text" for params in plan.params):
        raise InvalidRequest("response_format cannot be combined with a tool_choice that requires a call")
    fmt = tool_call_format(required)
    plan.params = [params.model_copy(update={"response_format": fmt}) for params in plan.params]
    plan.forced = tool_names(required)[0] if len(required) == 1 else None
    return plan


# -- routes ----------------------------------------------------------------------------------------


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "kvbaton"}
    if state.max_context:
        card["max_model_len"] = state.max_context
    return card


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    oa: dict[str, Any] = {"tags": ["openai"], "responses": STREAM_RESPONSES}
    chat, completion, responses = ChatServing(state), CompletionServing(state), ResponsesServing(state)

    @app.get("/v1/models", tags=["openai"])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state, name) for name in state.model_names]}

    @app.get("/v1/models/{model_id:path}", tags=["openai"], responses=ERROR_RESPONSES)
    async def model(model_id: str) -> dict[str, Any]:
        if model_id not in state.model_names:
            raise ModelNotFound(f"the model {model_id!r} does not exist: this server serves "
                                f"{', '.join(map(repr, state.model_names))}", param="model")
        return _model_card(state, model_id)

    @app.post("/v1/chat/completions", **oa)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Any:
        return await chat.handle(body, request)

    @app.post("/v1/completions", **oa)
    async def completions(body: p.CompletionRequest, request: Request) -> Any:
        return await completion.handle(body, request)

    @app.delete("/v1/sessions/{session_id:path}", tags=["openai"], responses=ERROR_RESPONSES)
    async def delete_session(session_id: str, request: Request) -> p.SessionReleased:
        """Release the handles the tenant's agents retain in this session (its turns' K/V); the count
        says whether there were any."""
        released = await state.run(state.release_session, request_tenant(request), session_id)
        return p.SessionReleased(session=session_id, released=released)

    @app.post("/v1/responses", tags=["openai"], responses=ERROR_RESPONSES)
    async def create_response(body: p.ResponsesRequest, request: Request) -> Any:
        """The Responses API, text only, not streamed (``docs/server.md#responses-api``)."""
        return await responses.handle(body, request)
