"""The OpenAI-compatible API: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses`` (text; :mod:`.openai_responses`), and kvbaton's ``DELETE /v1/sessions/{id}``. Answer bodies
are declared in the OpenAPI schema (``protocol``: the shapes of the ``openai`` package's models).

One template method serves both completion endpoints, in the spirit of SGLang's
``OpenAIServingBase.handle_request``: ``OpenAIServing.handle`` parses the request into a ``Plan``,
runs it whole or streams it through the one SSE driver, and builds the answer; ``ChatServing`` and
``CompletionServing`` fill in only what differs (the prompt, how streams open, which handles are
kept, the shape of a choice); ``ResponsesServing`` (:mod:`.openai_responses`) is chat with another answer. The messages they
render are translated by ``openai_messages``.

Invariants: a request's choices (``n`` per prompt; ``/v1/completions`` takes a list of prompts,
its choices prompt-major as vLLM's) run at once, so the engine batches them, and a stream says
their chunks as they come, interleaved; choice ``i`` of a prompt samples with ``seed + i`` (choices
differ, a request is reproducible); ``usage`` counts each prompt once and every choice's
completion, and the access log counts the same; a request is admitted for its result handles
(one per choice) within the tenant's quotas; an agent's latest
chat result stays in its slot and the one before is released (unless the caller ``keep``s every
handle); a full pool first evicts the same tenant's other agents' idle slots (never another
tenant's), then answers 503; streams own their handles as every stream does (``sse``). Reuse: a
request runs with its own policy (``kvbaton.reuse`` / ``X-Kvbaton-Reuse``), else the server's; an
answer says whether it is exact (``kvbaton.exact``, on a stream's last chunk too, and
``X-Kvbaton-Approximate: true`` on an answer that is not, streamed or whole), ``cached_tokens`` counts
exact reuse only, and an ``"exact"`` request never resumes an agent's retained approximate handle.
"""

from __future__ import annotations

import functools
import json
import secrets
import time
from collections.abc import Sequence
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse
from kvbaton.errors import (
    OPENAI_CODES,
    ContextTooLong,
    HandleNotFound,
    HandleReleased,
    InvalidRequest,
    ModelNotFound,
)
from kvbaton.stream import TokenStream
from kvbaton.tools import parse_tool_calls
from kvbaton.types import Result, SamplingParams, StreamChunk, TokenLogprob, TopLogprob

from . import protocol as p
from .accesslog import note_usage
from .delivery import give, gone
from .errors import template_errors
from .openai_fields import COMPLETION_FIELDS, FieldTable, check_fields
from .openai_messages import openai_messages
from .openai_plan import Plan, tool_plan
from .openai_tools import RequiredCallStream, ToolCallStream, required_call
from .sse import StreamEvents, Streams, close_all, open_primed, prime_all, run_whole, sse, stream_response
from .state import ServerState
from .tenancy import request_agent, request_reuse, request_session, request_tenant

APPROXIMATE_HEADER = "X-Kvbaton-Approximate"
"""Response header, ``true`` on an answer (whole or streamed) whose prompt K/V were partly reused approximately."""


def usage(results: Sequence[Result], n: int | None = None) -> dict[str, Any]:
    """OpenAI usage of the choices ``results`` (``n`` per prompt, prompt-major; default: all of one
    prompt): each prompt once, every choice's completion. ``cached_tokens`` counts exact reuse only:
    K/V reused approximately (``tokens_approximate``) is not what OpenAI clients take a cache hit to be."""
    firsts = [r.timings for r in results[:: n or len(results)]]  # each prompt's first choice
    prompt = sum(t.tokens_reused + t.tokens_prefilled for t in firsts)
    completion = sum(r.timings.tokens_generated for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(t.tokens_reused - t.tokens_approximate for t in firsts)},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def token_bytes(entry: TopLogprob) -> list[int]:
    """A log-probability entry's token bytes (an engine that does not say them: its text's)."""
    return list(entry.bytes) if entry.bytes else list(entry.token.encode())


def check_model(state: ServerState, name: str | None) -> None:
    """404 ``model_not_found`` (``param: "model"``) unless ``name`` is one the server serves
    (``--served-model-name``: the alias list is explicit, as vLLM's); no name is the served model."""
    if name is not None and name not in state.model_names:
        raise ModelNotFound(f"The model '{name}' does not exist: this server serves "
                            f"{', '.join(map(repr, state.model_names))} (--served-model-name).", param="model")


# -- the template ----------------------------------------------------------------------------------


class OpenAIServing:
    """The template of an OpenAI completion endpoint; subclasses fill in the hooks below ``handle``."""

    endpoint: str
    id_prefix: str
    object: str  # of the whole answer
    chunk_object: str  # of a streamed chunk
    head: ClassVar[dict[str, Any]] = {}  # more fields after id/object/created/model
    fields: ClassVar[FieldTable] = COMPLETION_FIELDS  # which undeclared request fields are accepted
    prompt_field: ClassVar[str] = "messages"  # the request field that holds the prompt

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def handle(self, body: p.SamplingRequest, request: Request) -> Any:
        plan = self.plan(body, request)
        plan.scope = request.scope
        admission = self.state.admit(plan.tenant, len(plan.params))
        try:
            if body.stream:
                approximate: list[bool] = []

                def opened() -> Streams:  # primed: each stream's first chunk says whether its prompt is exact
                    streams, firsts = self.open_streams(plan)
                    approximate.extend(first is not None and first.exact is False for first in firsts)
                    return streams, firsts

                response = await stream_response(self.state, plan.tenant, opened, self.stream_events(plan),
                                                 admission)
                if any(approximate):  # known before the first byte: streamed answers are marked like whole ones
                    response.headers[APPROXIMATE_HEADER] = "true"
                return response
            with admission:
                results, kept = await self.run_all(plan)
        except ContextTooLong as exc:  # name the request's own field: the one to lower
            field = body.max_field() if exc.param == "max_tokens" else self.prompt_field
            raise ContextTooLong(f"{exc.message}: lower '{field}'.", param=field) from None
        for r in results:
            self.observe(r, plan)
        note_usage(plan.scope, usage(results, plan.n))
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
            "usage": usage(results, plan.n),
            "kvbaton": self.extension(plan, kept, results),
        }

    def plan(self, body: p.SamplingRequest, request: Request) -> Plan:
        state = self.state
        tenant = request_tenant(request)
        check_fields(body.model_extra, self.fields)
        check_model(state, body.model)
        ext = body.kvbaton or p.KvbatonExtension()
        agent = request_agent(request, ext.agent) or ""
        session = request_session(request, ext.session, (body.model_extra or {}).get("user"))
        engine_agent = state.agent(tenant, agent, session or None)  # the session bounds approximate reuse
        prompts, tools = self.prompt(body, ext)
        n = body.choices()
        if n * len(prompts) > state.max_n:
            what = f"n {n}" if len(prompts) == 1 else f"{len(prompts)} prompts x n {n}"
            raise InvalidRequest(f"Invalid value for 'n': {what} choices exceed the server's limit of {state.max_n} "
                                 "choices per request (--max-n).", param="n" if len(prompts) == 1 else "prompt")
        state.check_owned(tenant, [ext.handle])
        policy = state.reuse(request_reuse(request, ext.reuse))
        fields = {**state.sampling_defaults, **{k: v for k, v in body.sampling_fields().items() if v is not None}}
        fields.setdefault("max_tokens", state.default_max_tokens)
        if fields.get("min_tokens", 0) > fields["max_tokens"]:
            raise InvalidRequest(f"Invalid value for 'min_tokens': {fields['min_tokens']} exceeds {body.max_field()} "
                                 f"{fields['max_tokens']}.", param="min_tokens")
        if fields["max_tokens"] > state.max_tokens:
            raise InvalidRequest(f"Invalid value for '{body.max_field()}': {fields['max_tokens']} exceeds the server's "
                                 f"limit of {state.max_tokens}.", param=body.max_field())
        seed = body.first_seed()
        seeds = [None if seed is None else (seed + i) % 2**63 for i in range(n)]
        params = [state.sampling({**fields, "seed": s}) for _ in prompts for s in seeds]
        return Plan(
            tenant=tenant, session=session, agent=agent, engine_agent=engine_agent, handle=ext.handle, policy=policy,
            keep=ext.keep, step=ext.step, params=params, prompts=prompts, n=n, tools=tools,
            include_usage=body.include_usage, id=self.id_prefix + secrets.token_hex(12), created=int(time.time()),
            model=body.model or state.model,
        )

    async def run_all(self, plan: Plan) -> tuple[list[Result], list[str | None]]:
        """Every choice to its end, all at once (each in its own worker call: the engine batches them);
        the results and the handles kept for the caller."""
        results = await run_whole(self.state, functools.partial(self.open_streams, plan), lambda: gone(plan.scope))
        kept = await self.state.run(self.finish, plan, results)
        if plan.keep:  # the caller's: released if the answer never reaches it (.delivery)
            give(plan.scope, kept)
        return results, kept

    def observe(self, result: Result, plan: Plan) -> None:
        self.state.metrics.observe(plan.tenant, self.endpoint, result)

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
        choice), and whether the answer is exact: ``exact`` (no choice's prompt K/V approximated),
        ``token_identical`` (what that promises: greedy output identical to dense prefill, float32 only),
        ``reuse`` (the policy it ran with), and choice 0's ``tokens_approximate`` and
        ``segments`` (the spans placed behind this prompt's prefix, and what was done with each)."""
        first = results[0]
        return {"handle": kept[0], "handles": kept, "agent": plan.agent or None, "step": plan.step,
                "timings": [r.timings.model_dump() for r in results],
                "exact": all(r.exact for r in results), "reuse": plan.policy,
                "token_identical": all(r.token_identical for r in results),
                "tokens_approximate": first.timings.tokens_approximate,
                "segments": [s.model_dump(mode="json") for s in first.segments]}

    # -- hooks --------------------------------------------------------------------------------------
    def stream_events(self, plan: Plan) -> StreamEvents:
        """What a streamed answer says (chat and completions: chunks, then ``[DONE]``)."""
        return _OpenAIEvents(self, plan)

    def prompt(self, body: Any, ext: p.KvbatonExtension) -> tuple[list[Any], list[dict[str, Any]] | None]:
        """What the engine is given (validated), one per prompt, and the tools of the chat template."""
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

    def opening(self, plan: Plan, index: int) -> dict[str, Any] | None:
        """What streamed choice ``index`` says before its first piece, if anything."""
        return None


class _OpenAIEvents(StreamEvents):
    """The chunks of an OpenAI stream: the choices' chunks as they come (interleaved), the ``kvbaton``
    field on the last chunk, usage when asked for, then ``[DONE]``. With tools, each choice's text
    goes through a :class:`.openai_tools.ToolCallStream`: content and tool-call deltas as the model
    writes them, log probabilities with the next delta that is sent."""

    def __init__(self, serving: OpenAIServing, plan: Plan) -> None:
        self.serving, self.plan = serving, plan
        self.offsets: dict[int, int] = {}  # per choice: characters streamed so far (legacy logprobs' text_offset)
        parser = RequiredCallStream if plan.required else ToolCallStream
        self.tools = [parser(plan.tool_names, plan.forced) for _ in plan.params] if plan.parses_tools else []
        self.pending: dict[int, list[TokenLogprob]] = {}  # per choice: log probabilities not sent yet (tools)
        self.last: dict[str, Any] = {}  # the closing choice of the last choice to end: sent with the kvbaton field

    def _chunk(self, choices: list[dict[str, Any]], **more: Any) -> str:
        head = self.serving.header(self.plan, self.serving.chunk_object)
        return sse(json.dumps({**head, "choices": choices, **more}))

    def _deltas(self, index: int, deltas: list[dict[str, Any]], finish_reason: str | None = None) -> list[dict[str, Any]]:
        """Chat choices of tool-parser deltas; the choice's pending log probabilities go with the first."""
        out = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            choice = self.serving.choice(index, {"delta": delta}, finish_reason if last else None)
            entries = self.pending.pop(index, None)
            out.append({**choice, "logprobs": self.serving.logprobs(entries)} if entries else choice)
        return out

    def opening(self, index: int) -> list[str]:
        part = self.serving.opening(self.plan, index)
        if part is None:
            return []
        self.offsets[index] = len(part.get("text", ""))  # an echoed prompt: the completion's text offsets follow it
        return [self._chunk([self.serving.choice(index, part, None)])]

    def chunk(self, index: int, chunk: StreamChunk) -> list[str]:
        if self.tools:
            if chunk.logprobs:
                self.pending.setdefault(index, []).extend(chunk.logprobs)
            return [self._chunk([c]) for c in self._deltas(index, self.tools[index].feed(chunk.text))]
        if not (chunk.text or chunk.logprobs):
            return []
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(chunk.text)
        choice = self.serving.choice(index, self.serving.delta(chunk.text), None)
        return [self._chunk([{**choice, "logprobs": self.serving.logprobs(chunk.logprobs, offset)}])]

    def _closing(self, index: int, result: Result) -> list[dict[str, Any]]:
        """A choice's last choices: with tools, what its parser held back; then its finish reason."""
        if not self.tools:
            return [self.serving.choice(index, self.serving.delta(None), result.finish_reason)]
        parser = self.tools[index]
        deltas = [*parser.finish(), {}]
        return self._deltas(index, deltas, parser.finish_reason(result.finish_reason))

    def closing(self, index: int, result: Result, last: bool) -> list[str]:
        self.serving.observe(result, self.plan)
        choices = self._closing(index, result)
        if last:  # the last choice to end closes with the kvbaton field, in finish
            self.last = choices.pop()
        return [self._chunk([c]) for c in choices]

    def finish(self, results: list[Result]) -> list[str]:
        kept = self.serving.finish(self.plan, results)
        ext = self.serving.extension(self.plan, kept, results)
        counts = usage(results, self.plan.n)
        note_usage(self.plan.scope, counts)
        out = [self._chunk([self.last], kvbaton=ext)]
        if self.plan.include_usage:
            out.append(self._chunk([], usage=counts, kvbaton=ext))
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

    def prompt(self, body: p.ChatCompletionRequest,
               ext: p.KvbatonExtension) -> tuple[list[Any], list[dict[str, Any]] | None]:
        tools = None if body.tool_choice == "none" else body.tool_dicts()  # "none": the model is not told of them
        return [openai_messages(body.messages)], tools or None

    def plan(self, body: p.ChatCompletionRequest, request: Request) -> Plan:  # type: ignore[override]
        plan = super().plan(body, request)
        return tool_plan(plan, body.tool_choice)

    def output(self, plan: Plan, result: Result) -> tuple[dict[str, Any], str]:
        if not plan.parses_tools:
            return self.message(result.text), result.finish_reason
        if plan.required:  # one call, constrained: whole, or cut short by max_tokens (finish_reason "length")
            call, complete = required_call(result.text, plan.tool_names, plan.forced)
            if call is not None:
                return ({"message": {"role": "assistant", "content": None, "tool_calls": [call]}},
                        "tool_calls" if complete else result.finish_reason)
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

        def item(e: TopLogprob) -> dict[str, Any]:
            return {"token": e.token, "logprob": e.logprob, "bytes": token_bytes(e)}

        return {"content": [{**item(e), "top_logprobs": [item(t) for t in e.top_logprobs]} for e in entries]}

    def open_streams(self, plan: Plan) -> Streams:
        state = self.state

        def open_stream(handle: p.HandleRef | None, params: SamplingParams) -> TokenStream:
            return template_errors(functools.partial(
                state.engine.generate_stream, plan.prompts[0], handle=handle, tools=plan.tools, sampling=params,
                agent=plan.engine_agent, reuse=plan.policy,
            ))

        # Other agents' slots are idle live handles: when the pool is short, the engine's one owner of kept KV
        # spills them in its eviction order (cache/store.py), so nothing here catches PoolExhausted to retry.
        slot = state.slots.slot(plan.key)
        streams: list[TokenStream] = []
        try:
            with slot.lock:
                base: p.HandleRef | None = plan.handle if plan.handle is not None else slot.handle_id
                if plan.handle is None and not slot.exact and plan.policy == "exact":
                    # An exact request does not resume the agent's approximate turn; its exact
                    # prefix still comes from the prefix cache. (A handle the caller names is used.)
                    base = None
                state.check_owned(plan.tenant, [base])  # the retained handle is used: its idle time restarts
                for params in plan.params:
                    try:
                        streams.append(open_stream(base, params))
                    except (HandleNotFound, HandleReleased):
                        if plan.handle is not None or base is None:
                            raise
                        slot.handle_id = base = None  # the retained handle was released meanwhile
                        streams.append(open_stream(None, params))
            return streams, prime_all(streams)
        except BaseException:
            close_all(streams)
            raise

    def finish(self, plan: Plan, results: Sequence[Result]) -> list[str | None]:
        state = self.state
        kept = len(results) if plan.keep else 1  # journaled: the handles the caller or the agent's slot keeps
        state.record(plan.tenant, [r.handle for r in results[:kept]])
        state.record(plan.tenant, [r.handle for r in results[kept:]], durable=False)  # released below
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

    def opening(self, plan: Plan, index: int) -> dict[str, Any] | None:
        return {"delta": {"role": "assistant", "content": ""}}


class CompletionServing(OpenAIServing):
    """``/v1/completions``: a prompt or a list of them (one batch, ``n`` choices per prompt), no
    handle reuse; result handles are released unless kept."""

    endpoint = "/v1/completions"
    id_prefix = "cmpl-"
    object = chunk_object = "text_completion"
    prompt_field = "prompt"

    def prompt(self, body: p.CompletionRequest,
               ext: p.KvbatonExtension) -> tuple[list[Any], list[dict[str, Any]] | None]:
        if ext.handle is not None:
            raise InvalidRequest("Unsupported parameter: 'kvbaton.handle': /v1/completions takes no handle; use "
                                 "/v1/chat/completions or /v1/kv/resume.", param="kvbaton.handle")
        return body.prompts(), None

    def plan(self, body: p.CompletionRequest, request: Request) -> Plan:  # type: ignore[override]
        plan = super().plan(body, request)
        if body.echo:
            if body.logprobs is not None:
                if body.stream:
                    raise InvalidRequest("Unsupported value for 'echo': with 'logprobs' (the prompt's log "
                                         "probabilities) the answer is served whole: set 'stream' to false.",
                                         param="echo")
                plan.echo_top = body.logprobs
            plan.echo = []  # the prompts' texts, filled in a worker thread (token ids are detokenized)
        return plan

    def open_streams(self, plan: Plan) -> Streams:
        engine = self.state.engine
        if plan.echo == []:
            plan.echo = [p if isinstance(p, str) else engine.detokenize(p) for p in plan.prompts]
        if plan.echo_top is not None and plan.echo_logprobs is None:  # lm-eval-style scoring
            plan.echo_logprobs = [engine.prompt_logprobs(p, plan.echo_top) for p in plan.prompts]
        return open_primed(functools.partial(engine.complete_stream, plan.prompt_of(c), params,
                                             agent=plan.engine_agent, reuse=plan.policy)
                           for c, params in enumerate(plan.params))

    def finish(self, plan: Plan, results: Sequence[Result]) -> list[str | None]:
        self.state.record(plan.tenant, [r.handle for r in results], durable=plan.keep)  # else released below
        handles = [r.handle.id for r in results]
        if plan.keep:
            return list(handles)
        self.state.release_quietly(handles)
        return [None] * len(handles)

    def message(self, text: str) -> dict[str, Any]:
        return {"text": text}

    def whole_choice(self, plan: Plan, index: int, result: Result) -> dict[str, Any]:
        part, finish = self.message(self.echoed(plan, index) + result.text), result.finish_reason
        if plan.echo_logprobs is not None:  # the prompt's tokens first, offsets from the echoed text's start
            entries = [*plan.echo_logprobs[index // plan.n], *(result.logprobs or [])]
            return {**self.choice(index, part, finish), "logprobs": self.logprobs(entries)}
        offset = len(self.echoed(plan, index))
        return {**self.choice(index, part, finish), "logprobs": self.logprobs(result.logprobs, offset)}

    @staticmethod
    def echoed(plan: Plan, index: int) -> str:
        """The prompt text choice ``index`` starts with (with ``echo``), else ``""``."""
        return plan.echo[index // plan.n] if plan.echo else ""

    def opening(self, plan: Plan, index: int) -> dict[str, Any] | None:
        return {"text": self.echoed(plan, index)} if plan.echo else None

    def logprobs(self, entries: Sequence[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
        """The legacy shape: tokens, their logprobs, the alternatives by token, each token's text offset
        (an echoed prompt's first token: null logprob and alternatives, as OpenAI answers)."""
        if entries is None:
            return None
        offsets, held = [], b""  # a token may end inside a character: its text starts where the character does
        for e in entries:
            offsets.append(offset)
            held += bytes(token_bytes(e))
            text = held.decode("utf-8", "ignore")
            if text:
                offset, held = offset + len(text), held[len(text.encode()):]
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.logprob is None else {t.token: t.logprob for t in e.top_logprobs}
                                 for e in entries],
                "text_offset": offsets}

    def delta(self, text: str | None) -> dict[str, Any]:
        return {"text": text or ""}
