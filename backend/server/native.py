"""The native handle API under ``/v1/kv/...``: one route per row of :data:`kvbaton.wire.OPERATIONS`.

The routes are registered from the SDK's own table (:func:`add_native_routes`), with its request and
answer models, so the HTTP client and the server cannot disagree on a path or a body. What the server
does beyond calling the engine is an operator's policy (:data:`POLICIES`: a function named for its
operator): check that the handles it is given are the caller's tenant's, admit the request within
the tenant's quotas, name agents for the engine, call the engine in a worker thread and record the
handles it made for the tenant. An operator without a policy is served by the generic route (the
engine's operator called with the body's fields, in a worker thread) — allowed only for an operator
that names no handle and no agent and answers none, checked when the app is built, so that no
operator can bypass tenancy by being new.

Generation answers a ``Result``, or with ``stream: true`` server-sent events: ``event: chunk`` per
``StreamChunk``, then ``event: result`` (or ``event: error``).
"""

from __future__ import annotations

import functools
import inspect
import json
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import FastAPI, Header, Query, Request
from fastapi.responses import Response
from kvbaton import wire
from kvbaton.capabilities import Capabilities
from kvbaton.errors import InvalidRequest
from kvbaton.handle import Handle, Segment
from kvbaton.stream import TokenStream
from kvbaton.types import Composition, Events, Fidelity, Result, SamplingParams, Stats, StreamChunk
from pydantic import BaseModel

from ..tenants import AgentRef
from .accesslog import note_result
from .concurrency import EVENTS
from .delivery import give, gone
from .errors import ERROR_RESPONSES, STREAM_RESPONSES, template_errors
from .eventviews import PUMP_INTERVAL_S
from .sse import EventStreamResponse, StreamEvents, open_primed, run_whole, sse, stream_response
from .state import ServerState
from .tenancy import request_agent, request_reuse, request_session, request_tenant

EVENT_STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    200: {"content": {"text/event-stream": {}}, "description": "`event: event` per `Event`, live."},
}
NATIVE_PREFIX = "/v1/kv/"  # the handle API; the table's other rows (capabilities) describe the server

T = TypeVar("T")
Policy = Callable[["Native", Any, Request], Awaitable[Any]]
POLICIES: dict[str, Policy] = {}


def policy(fn: Policy) -> Policy:
    """Register ``fn`` as the policy of the operator it is named for; its docstring describes the route."""
    POLICIES[fn.__name__] = fn
    return fn


class NativeEvents(StreamEvents):
    """``event: chunk`` per chunk, then ``event: result`` (the driver records the result handle for the tenant)."""

    def __init__(self, state: ServerState, tenant: str, endpoint: str, scope: dict[str, Any] | None = None) -> None:
        self.state, self.tenant, self.endpoint, self.scope = state, tenant, endpoint, scope

    def chunk(self, index: int, chunk: StreamChunk) -> list[str]:
        return [sse(chunk.model_dump_json(), "chunk")]

    def closing(self, index: int, result: Result, last: bool) -> list[str]:
        self.state.metrics.observe(self.tenant, self.endpoint, result)
        note_result(self.scope, result)
        return []

    def finish(self, results: list[Result]) -> list[str]:
        return [sse(results[0].model_dump_json(), "result")]

    def error(self, body: dict[str, Any]) -> str:
        return sse(json.dumps(body), "error")


class Native:
    """What the policies share: the server state, its engine, and the steps most of them take."""

    def __init__(self, state: ServerState) -> None:
        self.state, self.engine = state, state.engine

    def agent(self, request: Request, tenant: str, given: str | None) -> AgentRef | None:
        """Whose the request is for the engine: its agent (body field, else header) for ``tenant``, and its
        session (``X-Kvbaton-Session``), which bounds its approximate reuse."""
        return self.state.agent(tenant, request_agent(request, given), request_session(request, None) or None)

    async def made(self, request: Request, tenant: str, run: Callable[[], T]) -> T:
        """``run()`` (it makes one handle, or a result or composition holding one) admitted within the
        tenant's quota, in a worker thread; what it made is the tenant's, given to the caller (released
        if the answer never reaches it: :mod:`.delivery`)."""
        with self.state.admit(tenant):
            out: Any = await self.state.run(run)
            handle = out.handle if isinstance(out, Result | Composition) else out
            await self.state.recorded(tenant, [handle])
        give(request.scope, [handle.id])
        return out  # type: ignore[no-any-return]

    def segments(self, parts: Sequence[wire.SegmentIn]) -> list[Segment]:
        return [Segment(handle=self.state.handle(part.handle), start=part.start, end=part.end, slot=part.slot)
                for part in parts]

    async def generation(
        self, endpoint: str, request: Request, body: wire.Generation, agent: str | None,
        handles: Sequence[wire.HandleRef | None], start: Callable[[AgentRef | None, SamplingParams], TokenStream],
    ) -> Result | Response:
        """A ``Result``, or its events with ``stream: true``; ``start(agent, sampling)`` opens the stream."""
        state = self.state
        tenant = request_tenant(request)
        state.check_owned(tenant, handles)
        fields = body.sampling_fields()
        if "max_tokens" not in body.model_fields_set:  # the server's one default, as on the OpenAI routes
            fields["max_tokens"] = state.default_max_tokens
        open_stream = functools.partial(start, self.agent(request, tenant, agent), state.sampling(fields))
        if not body.stream:
            with state.admit(tenant):  # run in rounds of tokens, so that a server shutting down ends it
                (result,) = await run_whole(state, lambda: open_primed([open_stream]), lambda: gone(request.scope))
                await state.recorded(tenant, [result.handle])
            give(request.scope, [result.handle.id])
            state.metrics.observe(tenant, endpoint, result)
            note_result(request.scope, result)
            return result
        return await stream_response(state, tenant, lambda: open_primed([open_stream]),
                                     NativeEvents(state, tenant, endpoint, request.scope), state.admit(tenant))


# -- the policies, one per operator that needs one ---------------------------------------------------


@policy
async def materialize(n: Native, body: wire.MaterializeRequest, request: Request) -> Handle:
    tenant = request_tenant(request)
    agent = n.agent(request, tenant, body.agent)
    return await n.made(request, tenant, lambda: n.engine.materialize(body.context, agent=agent))


@policy
async def extend(n: Native, body: wire.ExtendRequest, request: Request) -> Handle:
    tenant = request_tenant(request)
    n.state.check_owned(tenant, [body.handle])
    agent = n.agent(request, tenant, body.agent)
    return await n.made(request, tenant, lambda: n.engine.extend(body.handle, body.context, agent=agent))


@policy
async def fork(n: Native, body: wire.ForkRequest, request: Request) -> wire.ForkResponse:
    tenant = request_tenant(request)
    n.state.check_owned(tenant, [body.handle])
    n.state.check_fork(body.k)
    with n.state.admit_fork(tenant, body.handle, body.k):
        handles = await n.state.run(n.engine.fork, body.handle, body.k)
        await n.state.recorded(tenant, handles)
    give(request.scope, [h.id for h in handles])
    return wire.ForkResponse(handles=handles)


@policy
async def transfer(n: Native, body: wire.TransferRequest, request: Request) -> Handle:
    """Move a handle's KV to another worker of a multi-device server (transfer or recompute,
    whichever the cost model predicts cheaper); a no-op to the device it is on."""
    tenant = request_tenant(request)
    n.state.check_owned(tenant, [body.handle])
    handle = await n.state.run(n.engine.transfer, body.handle, body.device)
    await n.state.recorded(tenant, [handle])
    return handle


@policy
async def compose(n: Native, body: wire.ComposeRequest, request: Request) -> Composition:
    """Assemble prefix + segments + suffix from existing K/V (exact, re-aligned, corrected or
    recomputed per segment, as the report says)."""
    tenant = request_tenant(request)
    if body.prefix_handle is not None and body.prefix is not None:
        raise InvalidRequest("give prefix_handle or prefix, not both")
    n.state.check_owned(tenant, [*(s.handle for s in body.segments), body.prefix_handle])
    agent = n.agent(request, tenant, body.agent)

    def run() -> Composition:
        prefix: Any = body.prefix if body.prefix_handle is None else n.state.handle(body.prefix_handle)
        return n.engine.compose(
            prefix, n.segments(body.segments), body.suffix, agent=agent, mode=body.mode, correction=body.correction
        )

    return await n.made(request, tenant, run)


@policy
async def merge(n: Native, body: wire.MergeRequest, request: Request) -> Composition:
    """Restricted merge: prefix-compatible handles, or non-overlapping segments; never blending."""
    tenant = request_tenant(request)
    n.state.check_owned(tenant, [part.handle for part in body.parts])
    agent = n.agent(request, tenant, body.agent)

    def run() -> Composition:
        whole = all(part.start == 0 and part.end is None and part.slot is None for part in body.parts)
        segs = n.segments(body.parts)
        parts: list[Any] = [s.handle for s in segs] if whole else segs
        return n.engine.merge(parts, agent=agent, mode=body.mode, correction=body.correction)

    return await n.made(request, tenant, run)


@policy
async def fidelity(n: Native, body: wire.FidelityRequest, request: Request) -> Fidelity:
    """Compare a handle's continuation with dense prefill of its tokens: at most the server's
    ``max_fidelity_tokens`` tokens (it holds full logits of each), one check at a time."""
    n.state.check_owned(request_tenant(request), [body.handle, body.reference])
    n.state.sampling({"max_tokens": body.max_tokens})  # the server's max_tokens cap holds here too
    n.state.check_fidelity(body.max_tokens)
    async with n.state.concurrency.one_at_a_time("fidelity"):
        return await n.state.run(n.engine.fidelity, body.handle, body.max_tokens, reference=body.reference)


@policy
async def resume(n: Native, body: wire.ResumeRequest, request: Request) -> Result | Response:
    return await n.generation(
        "/v1/kv/resume", request, body, body.agent, [body.handle],
        lambda agent, params: n.engine.resume_stream(body.handle, body.suffix, params, agent=agent),
    )


@policy
async def complete(n: Native, body: wire.CompleteRequest, request: Request) -> Result | Response:
    reuse = n.state.reuse(request_reuse(request, body.reuse))
    return await n.generation(
        "/v1/kv/complete", request, body, body.agent, [],
        lambda agent, params: n.engine.complete_stream(body.prompt, params, agent=agent, reuse=reuse),
    )


@policy
async def generate(n: Native, body: wire.GenerateRequest, request: Request) -> Result | Response:
    reuse = n.state.reuse(request_reuse(request, body.reuse))
    return await n.generation(
        "/v1/kv/generate", request, body, body.agent, [body.handle],
        lambda agent, params: template_errors(lambda: n.engine.generate_stream(
            body.messages, handle=body.handle, tools=body.tools, sampling=params, agent=agent, reuse=reuse,
        )),
    )


@policy
async def release(n: Native, body: wire.ReleaseRequest, request: Request) -> wire.ReleaseResponse:
    await n.state.run(n.state.release, request_tenant(request), body.handles)
    return wire.ReleaseResponse(released=len(body.handles))


@policy
async def stats(n: Native, body: None, request: Request) -> Stats:
    return await n.state.run(n.state.stats, request_tenant(request))


@policy
async def events(n: Native, body: wire.EventsQuery, request: Request) -> Events:
    """What the engine did after event ``since``: requests (phase times, token sources), evictions
    and prefetches, the caller's tenant's only; pass ``next`` back as ``since`` to read on."""
    return await n.state.run(n.state.events, request_tenant(request), body.since)


@policy
async def capabilities(n: Native, body: None, request: Request) -> Capabilities:
    """What the engine behind this server does exactly, corrects, recomputes or cannot do."""
    return n.engine.capabilities()


@policy
async def chat_tokens(n: Native, body: wire.ChatTokensRequest, request: Request) -> wire.TokenIds:
    ids = await n.state.run(lambda: template_errors(lambda: n.engine.chat_tokens(
        body.messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt
    )))
    return wire.TokenIds(token_ids=ids)


@policy
async def register_agent(n: Native, body: wire.RegisterAgentRequest, request: Request) -> wire.AgentInfoOut:
    """Declare an agent's fixed prompt (system prompt, tools...) for workflow-aware caching."""
    tenant = request_tenant(request)
    name = n.state.agent(tenant, body.name)
    info = await n.state.run(lambda: template_errors(
        lambda: n.engine.register_agent(name, body.fixed_prompt, prefill=body.prefill)
    ))
    await n.state.run(n.state.registered_agent, tenant, name)
    return wire.AgentInfoOut(name=body.name, fixed_tokens=info.fixed_tokens)


@policy
async def unregister_agent(n: Native, body: wire.UnregisterAgentRequest, request: Request) -> wire.AgentUnregistered:
    """Forget an agent's registration (``DELETE /v1/kv/agents?name=...``): its fixed prompt is no
    longer kept; whether the caller's tenant had registered it."""
    gone = await n.state.run(n.state.unregister_agent, request_tenant(request), body.name)
    return wire.AgentUnregistered(unregistered=gone)


@policy
async def hints(n: Native, body: wire.HintsRequest, request: Request) -> wire.HintsResponse:
    """Steps-to-execution of the caller's agents (0 = running now); prefetches those due soon."""
    ste = await n.state.run(n.state.hints, request_tenant(request), body.steps, body.running)
    return wire.HintsResponse(steps=ste)


# -- routes from the table ---------------------------------------------------------------------------


def _holds_handles(annotation: Any, seen: set[Any] | None = None) -> bool:
    """Whether values of ``annotation`` can hold a handle (a handle id is one too)."""
    seen = set() if seen is None else seen
    if annotation in seen:
        return False
    seen.add(annotation)
    if annotation is Handle:
        return True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return any(_holds_handles(f.annotation, seen) for f in annotation.model_fields.values())
    return any(_holds_handles(arg, seen) for arg in typing.get_args(annotation))


def _generic(row: wire.Operation) -> Policy:
    """The route of an operator the engine answers alone: its body's fields are the operator's arguments."""
    fields = row.request.model_fields if row.request is not None else {}
    if "agent" in fields or _holds_handles(row.request) or _holds_handles(row.answer):
        raise TypeError(f"operator {row.name!r} names agents or handles: it needs a policy (native.POLICIES) "
                        "to keep tenants apart")

    async def call(n: Native, body: BaseModel | None, request: Request) -> Any:
        arguments = {name: getattr(body, name) for name in fields}
        value = await n.state.run(getattr(n.engine, row.name), **arguments)
        return row.answer.wrap(value) if issubclass(row.answer, wire.Answer) else value

    return call


def _endpoint(native: Native, row: wire.Operation) -> Callable[..., Awaitable[Any]]:
    """The FastAPI endpoint of ``row``: its request model as the body (a GET's: the query), then its policy."""
    run = POLICIES.get(row.name) or _generic(row)

    async def endpoint(request: Request, body: Any = None) -> Any:
        return await run(native, body, request)

    params = [inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request)]
    if row.request is not None:
        model = row.request if row.method == "POST" else Annotated[row.request, Query()]  # GET, DELETE: the query
        params.append(inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=model))
    endpoint.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    endpoint.__doc__ = run.__doc__
    return endpoint


def add_native_routes(app: FastAPI, state: ServerState) -> None:
    native = Native(state)
    streamed = {row.path for row in wire.OPERATIONS.values() if row.stream}
    for row in wire.OPERATIONS.values():
        if row.stream:
            continue  # its route is the non-streaming twin's, answering `stream: true` with events
        app.add_api_route(
            row.path, _endpoint(native, row), methods=[row.method], name=row.name, response_model=row.answer,
            tags=["native" if row.path.startswith(NATIVE_PREFIX) else "server"],
            responses=STREAM_RESPONSES if row.path in streamed else ERROR_RESPONSES,
        )
    _add_tenant_routes(app, state)


def _last_event_id(value: str | None) -> int:
    """``since`` from a ``Last-Event-ID`` header (0 without one)."""
    if value is None or not value.strip():
        return 0
    try:
        since = int(value.strip())
    except ValueError:
        since = -1
    if since < 0:
        raise InvalidRequest(f"Invalid value for 'Last-Event-ID': expected an event id (a sequence number), got "
                             f"{value!r}.", param="Last-Event-ID")
    return since


def _add_tenant_routes(app: FastAPI, state: ServerState) -> None:
    """The native routes that are no operator: a tenant's release of everything, its live events."""
    kv: dict[str, Any] = {"tags": ["native"], "responses": ERROR_RESPONSES}

    @app.post("/v1/kv/release_all", response_model=wire.ReleaseResponse, **kv)
    async def release_all(request: Request) -> wire.ReleaseResponse:
        """Release every live handle of the caller's tenant, including the handles the OpenAI endpoints
        retain for its agents."""
        return wire.ReleaseResponse(released=await state.run(state.release_all, request_tenant(request)))

    @app.get("/v1/kv/events/stream", response_model=None, **{**kv, "responses": EVENT_STREAM_RESPONSES})
    async def events_stream(
        request: Request, since: int | None = Query(None, ge=0, description="Events after this sequence number "
                                                    "(default: the Last-Event-ID header, else 0)."),
        last_event_id: str | None = Header(None, description="Sent by a browser's EventSource when it reconnects: "
                                           "the id of the last event it got, read as `since` when no `since` is given."),
    ) -> EventStreamResponse:
        """The same events as server-sent events, live: ``event: event`` with one ``Event`` each (its
        ``id`` is the sequence number); a comment line every poll keeps idle connections open. A
        reconnecting ``EventSource`` (``Last-Event-ID``) gets no event twice. Event streams have caps
        of their own (``max_event_streams``, apart from generations'), and one that carried no event
        for ``event_stream_idle_timeout`` seconds ends (a browser reconnects, missing nothing)."""
        tenant = request_tenant(request)
        if since is None:
            since = _last_event_id(last_event_id)
        first = await state.run(state.events, tenant, since)  # a bad request fails before the stream starts
        closed = state.concurrency.open_stream(tenant, EVENTS)  # 429 beyond the event streams' limits
        idle_s = state.args.event_stream_idle_timeout

        async def lines() -> AsyncIterator[str]:
            page, last_event = first, anyio.current_time()
            while True:
                for event in page.events:
                    yield f"id: {event.seq}\n" + sse(event.model_dump_json(), "event")
                if page.dropped:
                    yield sse(json.dumps({"dropped": page.dropped}), "dropped")
                if page.events or page.dropped:
                    last_event = anyio.current_time()
                else:
                    yield ": idle\n\n"
                if state.draining or await request.is_disconnected():  # a server shutting down ends it
                    return
                if anyio.current_time() - last_event >= idle_s:
                    yield ": idle timeout\n\n"
                    return
                await anyio.sleep(PUMP_INTERVAL_S)
                page = state.views.page(tenant, page.next)  # in memory: the app's pump reads the engine

        return EventStreamResponse(lines(), closed=closed)
