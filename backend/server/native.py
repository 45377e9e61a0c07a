"""The native handle API under ``/v1/kv/...``: one route per operator of :class:`kvbaton.ops.KVOps`.

Each route checks that the handles it is given are the caller's tenant's, admits the request
within the tenant's quotas, names agents for the engine, calls the engine in a worker thread and
records the handles it made for the tenant.
Generation answers a ``Result``, or with ``stream: true`` server-sent events: ``event: chunk`` per
``StreamChunk``, then ``event: result`` (or ``event: error``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
from fastapi import FastAPI, Query, Request
from fastapi.responses import Response
from kvbaton.errors import InvalidRequest
from kvbaton.handle import Handle, Segment
from kvbaton.stream import TokenStream
from kvbaton.types import Composition, Events, Fidelity, Result, SamplingParams, Stats, StreamChunk

from .. import protocol as p
from .accesslog import note_tokens
from .errors import ERROR_RESPONSES, STREAM_RESPONSES, template_errors
from .sse import EventStreamResponse, StreamEvents, open_primed, sse, stream_response
from .state import ServerState
from .tenancy import request_agent, request_reuse, request_tenant

EVENT_POLL_S = 0.25  # how often an event stream looks for new events
EVENT_STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    200: {"content": {"text/event-stream": {}}, "description": "`event: event` per `Event`, live."},
}


class NativeEvents(StreamEvents):
    """``event: chunk`` per chunk, then ``event: result`` (the driver records the result handle for the tenant)."""

    def __init__(self, state: ServerState, tenant: str, endpoint: str, scope: dict[str, Any] | None = None) -> None:
        self.state, self.tenant, self.endpoint, self.scope = state, tenant, endpoint, scope

    def chunk(self, index: int, chunk: StreamChunk) -> list[str]:
        return [sse(chunk.model_dump_json(), "chunk")]

    def closing(self, index: int, result: Result, last: bool) -> list[str]:
        self.state.metrics.observe(self.endpoint, result)
        note_tokens(self.scope, result)
        return []

    def finish(self, results: list[Result]) -> list[str]:
        return [sse(results[0].model_dump_json(), "result")]

    def error(self, body: dict[str, Any]) -> str:
        return sse(json.dumps(body), "error")


def add_native_routes(app: FastAPI, state: ServerState) -> None:
    kv: dict[str, Any] = {"tags": ["native"], "responses": ERROR_RESPONSES}
    engine = state.engine

    def agent_of(request: Request, tenant: str, given: str | None) -> str | None:
        return state.agent(tenant, request_agent(request, given))

    @app.post("/v1/kv/materialize", response_model=Handle, **kv)
    async def materialize(body: p.MaterializeRequest, request: Request) -> Handle:
        tenant = request_tenant(request)
        agent = agent_of(request, tenant, body.agent)
        with state.admit(tenant):
            handle = await state.run(engine.materialize, body.context, agent=agent)
            state.record(tenant, [handle])
        return handle

    @app.post("/v1/kv/extend", response_model=Handle, **kv)
    async def extend(body: p.ExtendRequest, request: Request) -> Handle:
        tenant = request_tenant(request)
        state.check_owned(tenant, [body.handle])
        agent = agent_of(request, tenant, body.agent)
        with state.admit(tenant):
            handle = await state.run(engine.extend, body.handle, body.context, agent=agent)
            state.record(tenant, [handle])
        return handle

    @app.post("/v1/kv/fork", response_model=p.ForkResponse, **kv)
    async def fork(body: p.ForkRequest, request: Request) -> p.ForkResponse:
        tenant = request_tenant(request)
        state.check_owned(tenant, [body.handle])
        with state.admit_fork(tenant, body.handle, body.k):
            handles = await state.run(engine.fork, body.handle, body.k)
            state.record(tenant, handles)
        return p.ForkResponse(handles=handles)

    @app.post("/v1/kv/transfer", response_model=Handle, **kv)
    async def transfer(body: p.TransferRequest, request: Request) -> Handle:
        """Move a handle's KV to another worker of a multi-device server (transfer or recompute,
        whichever the cost model predicts cheaper); a no-op to the device it is on."""
        tenant = request_tenant(request)
        state.check_owned(tenant, [body.handle])
        handle = await state.run(engine.transfer, body.handle, body.device)
        state.record(tenant, [handle])
        return handle

    def segments(parts: Sequence[p.SegmentIn]) -> list[Segment]:
        return [Segment(handle=state.handle(part.handle), start=part.start, end=part.end, slot=part.slot)
                for part in parts]

    async def composed(tenant: str, run: Callable[[], Composition]) -> Composition:
        with state.admit(tenant):
            result = await state.run(run)
            state.record(tenant, [result.handle])
        return result

    @app.post("/v1/kv/compose", response_model=Composition, **kv)
    async def compose(body: p.ComposeRequest, request: Request) -> Composition:
        """Assemble prefix + segments + suffix from existing K/V (exact, re-aligned, corrected or
        recomputed per segment, as the report says)."""
        tenant = request_tenant(request)
        if body.prefix_handle is not None and body.prefix is not None:
            raise InvalidRequest("give prefix_handle or prefix, not both")
        state.check_owned(tenant, [*(s.handle for s in body.segments), body.prefix_handle])
        agent = agent_of(request, tenant, body.agent)

        def run() -> Composition:
            prefix: Any = body.prefix if body.prefix_handle is None else state.handle(body.prefix_handle)
            return engine.compose(
                prefix, segments(body.segments), body.suffix, agent=agent, mode=body.mode, correction=body.correction
            )

        return await composed(tenant, run)

    @app.post("/v1/kv/merge", response_model=Composition, **kv)
    async def merge(body: p.MergeRequest, request: Request) -> Composition:
        """Restricted merge: prefix-compatible handles, or non-overlapping segments; never blending."""
        tenant = request_tenant(request)
        state.check_owned(tenant, [part.handle for part in body.parts])
        agent = agent_of(request, tenant, body.agent)

        def run() -> Composition:
            whole = all(part.start == 0 and part.end is None and part.slot is None for part in body.parts)
            segs = segments(body.parts)
            parts: list[Any] = [s.handle for s in segs] if whole else segs
            return engine.merge(parts, agent=agent, mode=body.mode, correction=body.correction)

        return await composed(tenant, run)

    @app.post("/v1/kv/fidelity", response_model=Fidelity, **kv)
    async def fidelity(body: p.FidelityRequest, request: Request) -> Fidelity:
        """Compare a handle's continuation with dense prefill of its tokens."""
        tenant = request_tenant(request)
        state.check_owned(tenant, [body.handle, body.reference])
        state.sampling({"max_tokens": body.max_tokens})  # the server's max_tokens cap holds here too
        return await state.run(engine.fidelity, body.handle, body.max_tokens, reference=body.reference)

    async def generation(
        endpoint: str, request: Request, body: p.Sampling, agent: str | None, handles: Sequence[p.HandleRef | None],
        start: Callable[[str | None, SamplingParams], TokenStream],
    ) -> Result | Response:
        """A ``Result``, or its events with ``stream: true``; ``start(agent, sampling)`` opens the stream."""
        tenant = request_tenant(request)
        state.check_owned(tenant, handles)
        fields = body.sampling_fields()
        if "max_tokens" not in body.model_fields_set:  # the server's one default, as on the OpenAI routes
            fields["max_tokens"] = state.default_max_tokens
        open_stream = functools.partial(start, agent_of(request, tenant, agent), state.sampling(fields))
        if not body.stream:
            with state.admit(tenant):
                result = await state.run(lambda: open_stream().until_done())
                state.record(tenant, [result.handle])
            state.metrics.observe(endpoint, result)
            note_tokens(request.scope, result)
            return result
        return await stream_response(state, tenant, lambda: open_primed([open_stream]),
                                     NativeEvents(state, tenant, endpoint, request.scope), state.admit(tenant))

    @app.post("/v1/kv/resume", response_model=Result, **{**kv, "responses": STREAM_RESPONSES})
    async def resume(body: p.ResumeRequest, request: Request) -> Any:
        return await generation(
            "/v1/kv/resume", request, body, body.agent, [body.handle],
            lambda agent, params: engine.resume_stream(body.handle, body.suffix, params, agent=agent),
        )

    @app.post("/v1/kv/complete", response_model=Result, **{**kv, "responses": STREAM_RESPONSES})
    async def complete(body: p.CompleteRequest, request: Request) -> Any:
        reuse = state.reuse(request_reuse(request, body.reuse))
        return await generation(
            "/v1/kv/complete", request, body, body.agent, [],
            lambda agent, params: engine.complete_stream(body.prompt, params, agent=agent, reuse=reuse),
        )

    @app.post("/v1/kv/generate", response_model=Result, **{**kv, "responses": STREAM_RESPONSES})
    async def generate(body: p.GenerateRequest, request: Request) -> Any:
        reuse = state.reuse(request_reuse(request, body.reuse))
        return await generation(
            "/v1/kv/generate", request, body, body.agent, [body.handle],
            lambda agent, params: template_errors(lambda: engine.generate_stream(
                body.messages, handle=body.handle, tools=body.tools, sampling=params, agent=agent, reuse=reuse,
            )),
        )

    @app.post("/v1/kv/release", response_model=p.ReleaseResponse, **kv)
    async def release(body: p.ReleaseRequest, request: Request) -> p.ReleaseResponse:
        await state.run(state.release, request_tenant(request), body.handles)
        return p.ReleaseResponse(released=len(body.handles))

    @app.post("/v1/kv/release_all", response_model=p.ReleaseResponse, **kv)
    async def release_all(request: Request) -> p.ReleaseResponse:
        """Release every live handle of the caller's tenant, including the handles the OpenAI endpoints
        retain for its agents."""
        return p.ReleaseResponse(released=await state.run(state.release_all, request_tenant(request)))

    @app.get("/v1/kv/stats", response_model=Stats, **kv)
    async def stats(request: Request) -> Stats:
        return await state.run(state.stats, request_tenant(request))

    @app.get("/v1/kv/events", response_model=Events, **kv)
    async def events(request: Request, since: int = Query(0, ge=0)) -> Events:
        """What the engine did after event ``since``: requests (phase times, token sources), evictions
        and prefetches, the caller's tenant's only; pass ``next`` back as ``since`` to read on."""
        return await state.run(state.events, request_tenant(request), since)

    @app.get("/v1/kv/events/stream", response_model=None, **{**kv, "responses": EVENT_STREAM_RESPONSES})
    async def events_stream(request: Request, since: int = Query(0, ge=0)) -> EventStreamResponse:
        """The same events as server-sent events, live: ``event: event`` with one ``Event`` each (its
        ``id`` is the sequence number); a comment line every poll keeps idle connections open."""
        tenant = request_tenant(request)
        first = await state.run(state.events, tenant, since)  # a bad request fails before the stream starts

        async def lines() -> AsyncIterator[str]:
            page = first
            while True:
                for event in page.events:
                    yield f"id: {event.seq}\n" + sse(event.model_dump_json(), "event")
                if page.dropped:
                    yield sse(json.dumps({"dropped": page.dropped}), "dropped")
                if not page.events:
                    yield ": idle\n\n"
                if await request.is_disconnected():
                    return
                await anyio.sleep(EVENT_POLL_S)
                page = await state.run(state.events, tenant, page.next)

        return EventStreamResponse(lines())

    @app.post("/v1/kv/tokenize", response_model=p.TokenIds, **kv)
    async def tokenize(body: p.TokenizeRequest) -> p.TokenIds:
        return p.TokenIds(token_ids=await state.run(engine.tokenize, body.text))

    @app.post("/v1/kv/detokenize", response_model=p.Text, **kv)
    async def detokenize(body: p.DetokenizeRequest) -> p.Text:
        return p.Text(text=await state.run(engine.detokenize, body.token_ids))

    @app.post("/v1/kv/chat_tokens", response_model=p.TokenIds, **kv)
    async def chat_tokens(body: p.ChatTokensRequest) -> p.TokenIds:
        ids = await state.run(lambda: template_errors(lambda: engine.chat_tokens(
            body.messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt
        )))
        return p.TokenIds(token_ids=ids)

    @app.post("/v1/kv/agents", response_model=p.AgentInfoOut, **kv)
    async def register_agent(body: p.RegisterAgentRequest, request: Request) -> p.AgentInfoOut:
        """Declare an agent's fixed prompt (system prompt, tools...) for workflow-aware caching."""
        name = state.agent(request_tenant(request), body.name)
        info = await state.run(lambda: template_errors(
            lambda: engine.register_agent(name, body.fixed_prompt, prefill=body.prefill)
        ))
        return p.AgentInfoOut(name=body.name, fixed_tokens=info.fixed_tokens)

    @app.post("/v1/kv/hints", response_model=p.HintsResponse, **kv)
    async def hints(body: p.HintsRequest, request: Request) -> p.HintsResponse:
        """Steps-to-execution of the caller's agents (0 = running now); prefetches those due soon."""
        ste = await state.run(state.hints, request_tenant(request), body.steps, body.running)
        return p.HintsResponse(steps=ste)
