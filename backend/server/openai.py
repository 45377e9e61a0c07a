"""The OpenAI-compatible API: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

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
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from kvbaton.errors import HandleNotFound, HandleReleased, InvalidRequest, ModelNotFound, PoolExhausted
from kvbaton.stream import TokenStream
from kvbaton.types import Result, Reuse, SamplingParams, StreamChunk

from .. import protocol as p
from .errors import ERROR_RESPONSES, STREAM_RESPONSES, template_errors
from .sse import Streams, StreamEvents, close_all, open_primed, prime_all, sse, stream_response
from .state import ServerState
from .tenancy import SlotKey, request_agent, request_reuse, request_tenant

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

    @property
    def key(self) -> SlotKey:
        return (self.tenant, self.agent)


class OpenAIServing:
    """The template of an OpenAI completion endpoint; subclasses fill in the hooks below ``handle``."""

    endpoint: str
    id_prefix: str
    object: str  # of the whole answer
    chunk_object: str  # of a streamed chunk
    head: ClassVar[dict[str, Any]] = {}  # more fields after id/object/created/model

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def handle(self, body: p.OpenAIRequest, request: Request) -> Any:
        plan = self.plan(body, request)
        admission = self.state.admit(plan.tenant, len(plan.params))
        if body.stream:
            return await stream_response(self.state, plan.tenant, functools.partial(self.open_streams, plan),
                                         _OpenAIEvents(self, plan), admission)
        with admission:
            results, kept = await self.state.run(self.run_all, plan)
        for r in results:
            self.observe(r)
        payload = {
            **self.header(plan, self.object),
            "choices": [self.choice(i, self.message(r.text), r.finish_reason) for i, r in enumerate(results)],
            "usage": usage(results),
            "kvbaton": self.extension(plan, kept, results),
        }
        headers = {"X-Kvbaton-Handle": kept[0]} if kept[0] else {}
        if not all(r.exact for r in results):
            headers[APPROXIMATE_HEADER] = "true"
        return JSONResponse(payload, headers=headers or None)

    def plan(self, body: p.OpenAIRequest, request: Request) -> Plan:
        state = self.state
        tenant = request_tenant(request)
        ext = body.kvbaton or p.KvbatonExtension()
        agent = request_agent(request, ext.agent) or ""
        engine_agent = state.agent(tenant, agent)
        if body.n > state.max_n:
            raise InvalidRequest(f"n {body.n} exceeds the server's limit of {state.max_n}")
        state.check_owned(tenant, [ext.handle])
        policy = state.reuse(request_reuse(request, ext.reuse))
        fields = {k: v for k, v in body.sampling_fields().items() if v is not None}
        fields.setdefault("max_tokens", state.default_max_tokens)
        seeds = [None if body.seed is None else (body.seed + i) % 2**63 for i in range(body.n)]
        params = [state.sampling({**fields, "seed": seed}) for seed in seeds]
        prompt, tools = self.prompt(body, ext)
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return Plan(
            tenant=tenant, agent=agent, engine_agent=engine_agent, reuse=ext.handle, policy=policy, keep=ext.keep,
            step=ext.step,
            params=params, prompt=prompt, tools=tools, include_usage=include_usage,
            id=self.id_prefix + secrets.token_hex(12), created=int(time.time()),
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

    def observe(self, result: Result) -> None:
        self.state.metrics.observe(self.endpoint, result)

    def header(self, plan: Plan, obj: str) -> dict[str, Any]:
        return {"id": plan.id, "object": obj, "created": plan.created, "model": self.state.model, **self.head}

    @staticmethod
    def choice(index: int, part: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, **part, "logprobs": None, "finish_reason": finish_reason}

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

    def _chunk(self, choices: list[dict[str, Any]], **more: Any) -> str:
        head = self.serving.header(self.plan, self.serving.chunk_object)
        return sse(json.dumps({**head, "choices": choices, **more}))

    def opening(self, index: int) -> list[str]:
        part = self.serving.opening()
        return [self._chunk([self.serving.choice(index, part, None)])] if part is not None else []

    def chunk(self, index: int, chunk: StreamChunk) -> list[str]:
        return [self._chunk([self.serving.choice(index, self.serving.delta(chunk.text), None)])] if chunk.text else []

    def closing(self, index: int, result: Result, last: bool) -> list[str]:
        self.serving.observe(result)
        if last:
            return []  # the last choice closes with the kvbaton field, in finish
        return [self._chunk([self.serving.choice(index, self.serving.delta(None), result.finish_reason)])]

    def finish(self, results: list[Result]) -> list[str]:
        kept = self.serving.finish(self.plan, results)
        ext = self.serving.extension(self.plan, kept, results)
        last = self.serving.choice(len(results) - 1, self.serving.delta(None), results[-1].finish_reason)
        out = [self._chunk([last], kvbaton=ext)]
        if self.plan.include_usage:
            out.append(self._chunk([], usage=usage(results), kvbaton=ext))
        return [*out, sse("[DONE]")]

    def error(self, body: dict[str, Any]) -> str:
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
        return openai_messages(body.messages), body.tools

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

    def delta(self, text: str | None) -> dict[str, Any]:
        return {"text": text or ""}


# -- routes ----------------------------------------------------------------------------------------


def _model_card(state: ServerState) -> dict[str, Any]:
    card: dict[str, Any] = {"id": state.model, "object": "model", "created": 0, "owned_by": "kvbaton"}
    if state.max_context:
        card["max_model_len"] = state.max_context
    return card


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    oa: dict[str, Any] = {"tags": ["openai"], "responses": STREAM_RESPONSES}
    chat, completion = ChatServing(state), CompletionServing(state)

    @app.get("/v1/models", tags=["openai"])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}", tags=["openai"], responses=ERROR_RESPONSES)
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != state.model:
            raise ModelNotFound(f"this server runs {state.model!r}, not {model_id!r}")
        return _model_card(state)

    @app.post("/v1/chat/completions", **oa)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Any:
        return await chat.handle(body, request)

    @app.post("/v1/completions", **oa)
    async def completions(body: p.CompletionRequest, request: Request) -> Any:
        return await completion.handle(body, request)
