"""The OpenAI-compatible routes (``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses``, ``DELETE /v1/sessions/{id}``): each hands its body to its serving class
(:mod:`.openai`, :mod:`.openai_responses`), which talk to the engine."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from . import protocol as p
from .errors import ERROR_RESPONSES, stream_responses
from .openai import ChatServing, CompletionServing, check_model
from .openai_responses import ResponsesServing
from .state import ServerState
from .tenancy import request_tenant


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "kvbaton"}
    if state.max_context:
        card["max_model_len"] = state.max_context
    return card


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    oa: dict[str, Any] = {"tags": ["openai"], "response_model": None}

    chat, completion, responses = ChatServing(state), CompletionServing(state), ResponsesServing(state)

    @app.get("/v1/models", tags=["openai"], response_model=p.ModelList)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state, name) for name in state.model_names]}

    @app.get("/v1/models/{model_id:path}", tags=["openai"], responses=ERROR_RESPONSES, response_model=p.ModelCard,
             response_model_exclude_none=True)
    async def model(model_id: str) -> dict[str, Any]:
        check_model(state, model_id)
        return _model_card(state, model_id)

    @app.post("/v1/chat/completions", **oa, responses=stream_responses(p.ChatCompletion, p.ChatCompletionChunk))
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Any:
        return await chat.handle(body, request)

    @app.post("/v1/completions", **oa, responses=stream_responses(p.Completion, p.Completion))
    async def completions(body: p.CompletionRequest, request: Request) -> Any:
        return await completion.handle(body, request)

    @app.delete("/v1/sessions/{session_id:path}", tags=["openai"], responses=ERROR_RESPONSES)
    async def delete_session(session_id: str, request: Request) -> p.SessionReleased:
        """Release the handles the tenant's agents retain in this session (its turns' K/V); the count
        says whether there were any."""
        released = await state.run(state.release_session, request_tenant(request), session_id)
        return p.SessionReleased(session=session_id, released=released)

    events = ("With `stream: true`: the Responses API's events (`response.created` ... `response.output_text.delta` "
              "... `response.completed` or `response.incomplete`), each `event: <type>` with its JSON.")

    @app.post("/v1/responses", **oa, responses={**ERROR_RESPONSES, 200: {
        "model": p.ResponseObject, "content": {"text/event-stream": {"schema": {"type": "string", "description": events}}},
        "description": "A `ResponseObject`, or with `stream: true` the Responses API's server-sent events."}})
    async def create_response(body: p.ResponsesRequest, request: Request) -> Any:
        """The Responses API, text only, whole or streamed (``docs/server.md#responses-api``)."""
        return await responses.handle(body, request)
