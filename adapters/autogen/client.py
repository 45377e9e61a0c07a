"""``KvbatonChatCompletionClient``: an AutoGen (autogen-core 0.7) model client backed by kvbaton.

The client renders AutoGen's ``LLMMessage``s into chat messages, runs them through a kvbaton
:class:`~kvbaton.Client` (embedded engine or ``kvbaton serve`` over HTTP; synchronous clients run in
worker threads, :class:`~kvbaton.AsyncClient`\\ s are awaited) and turns the
:class:`~kvbaton.Result` back into a ``CreateResult``. Every reply's KV handle is kept in a side
table keyed by ``(source agent, content)``, because AutoGen drops message metadata before a model
client sees the messages; a later request looks up the messages of its prompt there and passes the
handle sharing the longest token prefix with its prompt to ``generate(handle=...)``.

Tools: autogen tools are converted to OpenAI-style ``{"type": "function", "function": {...}}``
schemas. If the model's chat template renders tools they go through ``chat_tokens(tools=...)``;
otherwise (SmolLM2's template ignores them) they are described in the system prompt in the
adapters' one tool-call convention (:mod:`kvbaton.adapters.core`; messages in :mod:`.messages`).

Reuse: requests run with the client's ``reuse`` policy (default ``"auto"``: spans other agents
computed behind their own system prompt are reused too, approximately); every ``CreateResult`` is a
:class:`KvbatonCreateResult` whose ``kvbaton`` field says whether the reply is exact.

This module is the AutoGen glue; the side table is :mod:`.handle_table`, shared connections are
:mod:`kvbaton.adapters.connections`', and the best handle, agent registration and sync/async
dispatch are :mod:`kvbaton.adapters.core`'s.

Ownership: each client records the handles it created (a :class:`kvbaton.scope.Scope` used as a
ledger) and holds at most ``max_retained_handles`` of them (default 16, the oldest released first: retained
handles are a cache, :mod:`kvbaton.adapters.ownership`); :meth:`KvbatonChatCompletionClient.close` releases
those still live, an instrumented team's run end releases all but each agent's latest reply
(:meth:`~KvbatonChatCompletionClient.release_run_handles`), ``team.reset()`` all of them
(:meth:`~KvbatonChatCompletionClient.release_owned_handles`), and a handle the user kept (``client.keep``)
is never released.

See docs/autogen.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal, Self

try:
    from autogen_core import CancellationToken, Component, FunctionCall
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("the AutoGen adapter needs autogen-core: pip install 'kvbaton[autogen]'") from exc
from autogen_core.models import (
    AssistantMessage,
    ChatCompletionClient,
    CreateResult,
    LLMMessage,
    ModelCapabilities,  # type: ignore[attr-defined]
    ModelFamily,
    ModelInfo,
    RequestUsage,
)
from autogen_core.tools import Tool, ToolSchema
from kvbaton.client import AsyncClient, Client
from kvbaton.errors import KvbatonError
from kvbaton.handle import Handle
from kvbaton.scope import Scope, arelease_quietly, is_kept
from kvbaton.tools import tool_call_format
from kvbaton.types import ResponseFormat, Result, Reuse
from pydantic import BaseModel, Field

from .. import core
from ..connections import shared_connection, target_of
from ..ownership import MAX_RETAINED_HANDLES, check_limit
from .handle_table import HandleTable, handle_table
from .messages import function_calls, message_text, render_messages, tool_schema

logger = logging.getLogger("kvbaton.adapters.autogen")

METADATA_KEY = "kvbaton_handle"
"""``BaseChatMessage.metadata`` key under which instrumented agents stamp the id of their reply's handle."""

class KvbatonCreateResult(CreateResult):
    """A ``CreateResult`` that also says how kvbaton served the prompt (AutoGen's own fields unchanged)."""

    kvbaton: dict[str, Any] = Field(
        default_factory=dict,
        description="How the prompt was served (kvbaton.adapters.core.reuse_report): exact (False: part of its "
        "K/V was reused approximately from another agent's context), tokens_reused, tokens_approximate, "
        "tokens_prefilled, segments.",
    )


SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")
CREATE_ARGS = (*SAMPLING_KEYS, "reuse")
"""Keys ``extra_create_args`` may set: the sampling options and the reuse policy."""

def _response_format(json_output: Any, tools: Sequence[Any], tool_choice: Any,
                     schemas: Sequence[dict[str, Any]]) -> ResponseFormat | None:
    """What constrained decoding enforces: one call of the allowed tools when ``tool_choice`` requires
    one (a ``Tool`` or ``"required"``), else JSON for ``json_output`` (True: any object; a pydantic
    model: its schema, strict)."""
    if schemas and (tool_choice == "required" or isinstance(tool_choice, Tool)):
        return tool_call_format(schemas)
    if json_output is True:
        return ResponseFormat(type="json_object")
    if isinstance(json_output, type) and issubclass(json_output, BaseModel):
        # Strict, as OpenAI's structured output: only the model's fields (a small model invents more).
        schema = {**json_output.model_json_schema(), "additionalProperties": False}
        return ResponseFormat(type="json_schema", json_schema={"name": json_output.__name__, "schema": schema,
                                                               "strict": True})
    return None


DEFAULT_MODEL_INFO: ModelInfo = {
    "vision": False,
    "function_calling": True,
    "json_output": True,  # enforced by constrained decoding (response_format)
    "family": ModelFamily.UNKNOWN,
    "structured_output": True,
    "multiple_system_messages": True,
}

# what "auto" tool_prompt renders once with and without a tool, and with the tool in the system block, to learn
# whether the template shows tools its own way (kvbaton's engine writes that same block for a template that
# ignores tools: kvbaton.tools)
_PROBE_CHAT = [{"role": "user", "content": "x"}]
_PROBE_TOOL = {"type": "function", "function": {"name": "kvbaton_probe", "parameters": {"type": "object"}}}
_PROBE_IN_SYSTEM = core.with_tool_prompt(_PROBE_CHAT, [_PROBE_TOOL])


@asynccontextmanager
async def _chunks(stream: Any) -> AsyncIterator[Any]:
    """The chunks of a ``generate_stream`` from either kind of client: an async stream is entered
    (closed on exit); a sync one is iterated in a worker thread and closed on exit unless it ended."""
    if hasattr(stream, "__aiter__"):
        async with stream:
            yield stream
        return
    try:
        yield core.iterate_in_thread(stream)
    finally:
        if stream.result is None:
            await asyncio.to_thread(stream.close)


class KvbatonChatCompletionClientConfig(BaseModel):
    """The serializable configuration: where the engine is, never a live client."""

    target: str = Field(default="embedded", description='"embedded" or a kvbaton server URL (http(s)://...).')
    model: str | None = Field(default=None, description="Model of an embedded engine (None: the default model).")
    agent: str | None = Field(default=None, description="Agent name the requests are tagged with.")
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    reuse_handles: bool = Field(default=True, description="Pass the best side-table handle to generate().")
    reuse: Reuse | None = Field(
        default="auto",
        description="Reuse policy of generate() (kvbaton.types.Reuse): 'auto' also reuses spans other agents "
        "computed behind their own system prompt, approximately (such replies are marked); 'rotate' and "
        "'correct' likewise; 'exact' keeps greedy output identical to dense prefill; None: the engine's or "
        "server's default.",
    )
    tool_prompt: Literal["auto", "template", "system"] = "auto"
    register_prompt: bool = Field(
        default=True, description="Register the leading system messages as the agent's fixed prompt."
    )
    max_retained_handles: int | None = Field(
        default=MAX_RETAINED_HANDLES, ge=1,
        description="The most reply handles this client holds (the oldest are released first); None: no bound.",
    )
    context_length: int | None = None
    model_info: dict[str, Any] | None = None


class KvbatonChatCompletionClient(ChatCompletionClient, Component[KvbatonChatCompletionClientConfig]):
    """An autogen-core ``ChatCompletionClient`` running on kvbaton.

    ``KvbatonChatCompletionClient(client=kvbaton.connect(), agent="planner", max_tokens=64)``, or
    from configuration only: ``KvbatonChatCompletionClient(target="http://host:8470")`` /
    ``target="embedded"`` (the process-wide shared connection, see
    :func:`~kvbaton.adapters.connections.shared_connection`).
    ``dump_component()`` / ``load_component()`` round-trip the configuration, not the connection.
    """

    component_type = "model"
    component_config_schema = KvbatonChatCompletionClientConfig
    component_provider_override = "kvbaton.adapters.autogen.KvbatonChatCompletionClient"

    def __init__(
        self,
        client: Client | AsyncClient | None = None,
        *,
        target: str = "embedded",
        model: str | None = None,
        agent: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        reuse_handles: bool = True,
        reuse: Reuse | None = "auto",
        tool_prompt: Literal["auto", "template", "system"] = "auto",
        register_prompt: bool = True,
        context_length: int | None = None,
        model_info: ModelInfo | Mapping[str, Any] | None = None,
        max_retained_handles: int | None = MAX_RETAINED_HANDLES,
    ) -> None:
        if client is not None and target == "embedded":
            target = target_of(client)
        self._config = KvbatonChatCompletionClientConfig(
            target=target, model=model, agent=agent, max_tokens=max_tokens, temperature=temperature,
            top_p=top_p, top_k=top_k, seed=seed, stop=list(stop) if stop is not None else None,
            reuse_handles=reuse_handles, reuse=reuse, tool_prompt=tool_prompt, register_prompt=register_prompt,
            context_length=context_length, max_retained_handles=check_limit(max_retained_handles),
            model_info=dict(model_info) if model_info is not None else None,
        )
        if client is None:
            client = shared_connection(target, model)
        self._client = client
        self._model_info: ModelInfo = {**DEFAULT_MODEL_INFO, **(model_info or {})}  # type: ignore[typeddict-item]
        self._table = handle_table(client)
        self._total = RequestUsage(prompt_tokens=0, completion_tokens=0)
        self._actual = RequestUsage(prompt_tokens=0, completion_tokens=0)
        self._template_renders_tools: bool | None = None
        self.last_result: Result | None = None
        """The kvbaton :class:`~kvbaton.Result` of the latest request (timings, handle)."""
        self.last_handle: Handle | None = None
        self.results: list[Result] = []
        """Every kvbaton result of this client, oldest first (bounded to the latest 256)."""
        self._closed = False
        self._owned = Scope(client, name=f"autogen client {agent or ''}".rstrip())  # what it created

    # -- configuration ----------------------------------------------------------------------------
    @property
    def agent(self) -> str | None:
        return self._config.agent

    @property
    def kvbaton_client(self) -> Client | AsyncClient:
        """The kvbaton client requests go to."""
        return self._client

    @property
    def handle_table(self) -> HandleTable:
        return self._table

    @property
    def fixed_prompt(self) -> list[dict[str, Any]] | None:
        """The fixed prompt last registered for this client's agent on its kvbaton client."""
        return core.registered_prompt(self._client, self._config.agent) if self._config.agent else None

    def with_agent(self, agent: str) -> KvbatonChatCompletionClient:
        """A client on the same connection and settings, tagged with ``agent``."""
        options = self._config.model_dump()
        options["agent"] = agent
        return KvbatonChatCompletionClient(self._client, **options)

    def _to_config(self) -> KvbatonChatCompletionClientConfig:
        return self._config.model_copy()

    @classmethod
    def _from_config(cls, config: KvbatonChatCompletionClientConfig) -> Self:
        return cls(**config.model_dump())

    # -- backend calls --------------------------------------------------------------------------------
    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return await core.acall(self._client, name, *args, **kwargs)

    def _sampling(self, extra_create_args: Mapping[str, Any]) -> dict[str, Any]:
        """Sampling options and the reuse policy of one request (``extra_create_args`` override the config)."""
        unknown = set(extra_create_args) - set(CREATE_ARGS)
        if unknown:
            raise ValueError(f"unsupported extra_create_args {sorted(unknown)}; supported: {list(CREATE_ARGS)}")
        options = {k: getattr(self._config, k) for k in SAMPLING_KEYS if getattr(self._config, k, None) is not None}
        options["reuse"] = self._config.reuse
        options.update(extra_create_args)
        if "stop" in options and options["stop"] is not None:
            options["stop"] = tuple([options["stop"]] if isinstance(options["stop"], str) else options["stop"])
        return options

    def _tool_schemas(self, tools: Sequence[Tool | ToolSchema], tool_choice: Any) -> list[dict[str, Any]]:
        if tool_choice == "none":
            return []
        schemas = [tool_schema(t) for t in tools]
        if isinstance(tool_choice, Tool):
            schemas = [s for s in schemas if s["function"]["name"] == tool_choice.name]
        return schemas

    def _renders_tools_sync(self, backend: Client) -> bool:
        with_tools = backend.chat_tokens(_PROBE_CHAT, tools=[_PROBE_TOOL])
        return with_tools not in (backend.chat_tokens(_PROBE_CHAT), backend.chat_tokens(_PROBE_IN_SYSTEM))

    async def _tools_in_system(self, schemas: Sequence[dict[str, Any]]) -> bool:
        if not schemas or self._config.tool_prompt == "system":
            return bool(schemas)
        if self._config.tool_prompt == "template":
            return False
        if self._template_renders_tools is None:
            with_tools = await self._call("chat_tokens", _PROBE_CHAT, tools=[_PROBE_TOOL])
            self._template_renders_tools = with_tools not in (await self._call("chat_tokens", _PROBE_CHAT),
                                                              await self._call("chat_tokens", _PROBE_IN_SYSTEM))
        return not self._template_renders_tools

    async def _prepare(
        self,
        messages: Sequence[LLMMessage],
        tools: Sequence[Tool | ToolSchema],
        tool_choice: Any,
        json_output: Any,
        extra_create_args: Mapping[str, Any],
    ) -> tuple[list[dict[str, str]], list[dict[str, Any]] | None, dict[str, Any], Handle | None]:
        if self._closed:
            raise RuntimeError("the client is closed")
        if json_output is not None and json_output is not False:
            if json_output is True and not self._model_info.get("json_output"):
                raise ValueError("this model does not support JSON mode (model_info json_output=False)")
            if not isinstance(json_output, bool) and not self._model_info.get("structured_output"):
                raise ValueError("this model does not support structured output (model_info structured_output=False)")
        schemas = self._tool_schemas(tools, tool_choice)
        in_system = await self._tools_in_system(schemas)
        chat = render_messages(messages, schemas, tools_in_system=in_system)
        engine_tools = schemas if schemas and not in_system else None
        options = self._sampling(extra_create_args)
        fmt = _response_format(json_output, tools, tool_choice, schemas)
        if fmt is not None:
            options["response_format"] = fmt
        await self._register_fixed(chat, engine_tools)
        handle = await self._best_handle(messages, chat, engine_tools) if self._config.reuse_handles else None
        return chat, engine_tools, options, handle

    async def _register_fixed(self, chat: list[dict[str, str]], tools: list[dict[str, Any]] | None) -> None:
        """(Re-)register the agent's fixed prompt (its leading system messages, tools included)."""
        if self._config.agent is None or not self._config.register_prompt or tools:
            return  # (templated tools: the fixed part is the template's business)
        await core.aregister_fixed_prompt(self._client, self._config.agent, chat)

    def _agent_name(self) -> str:
        if self._config.agent is None:
            raise ValueError("register_agent needs a client tagged with an agent name")
        return self._config.agent

    async def register_agent(self, fixed_prompt: Sequence[Mapping[str, str]] | str, *, prefill: bool = False) -> Any:
        """Declare this client's agent and its fixed prompt (system messages) to kvbaton."""
        return await core.aregister_agent(self._client, self._agent_name(), fixed_prompt, prefill=prefill)

    def register_agent_sync(self, fixed_prompt: Sequence[Mapping[str, str]] | str, *, prefill: bool = False) -> Any:
        """:meth:`register_agent` for a synchronous kvbaton client, from synchronous code."""
        return core.register_agent(self._client, self._agent_name(), fixed_prompt, prefill=prefill)

    async def _best_handle(
        self, messages: Sequence[LLMMessage], chat: list[dict[str, str]], tools: list[dict[str, Any]] | None
    ) -> Handle | None:
        """Of the side-table handles of the prompt's messages, the one the prompt reuses most."""
        candidates: dict[str, Handle] = {}
        for message in messages:
            source = getattr(message, "source", None)
            if source is None:
                continue
            try:
                found = self._table.get(source, message_text(message))
            except TypeError:  # image content: never a reply of ours
                continue
            if found is not None:
                candidates[found.id] = found
        if not candidates:
            return None
        ranked = await core.arank_for_prompt(self._client, list(candidates.values()), chat, tools=tools)
        return ranked[0] if ranked else None

    def _forget(self, handle: Handle) -> None:
        self._table.discard(handle.id)

    async def _run(self, method: str, chat: Any, tools: Any, options: dict[str, Any], handle: Handle | None) -> Any:
        return await core.arun_with_handle(self._client, method, chat, handle, agent=self._config.agent,
                                           on_stale=self._forget, tools=tools, **options)

    async def _finish(
        self, result: Result, messages: Sequence[LLMMessage], schemas: list[str]
    ) -> CreateResult:
        self._owned.add(result.handle, via=self._client)
        self.last_result = result
        self.last_handle = result.handle
        self.results.append(result)
        del self.results[:-256]
        usage = RequestUsage(
            prompt_tokens=result.timings.tokens_reused + result.timings.tokens_prefilled,
            completion_tokens=len(result.token_ids),
        )
        for total in (self._total, self._actual):
            total.prompt_tokens += usage.prompt_tokens
            total.completion_tokens += usage.completion_tokens
        thought, calls = function_calls(result.text, schemas)
        content: str | list[FunctionCall]
        if calls:
            content = calls
            finish: Any = "function_calls"
            key_text = message_text(AssistantMessage(content=calls, thought=thought or None, source="x"))
        else:
            content, thought, finish = result.text, "", result.finish_reason
            key_text = result.text
        if self._config.agent is not None:
            dropped = [h.id for h in self._table.put(self._config.agent, key_text, result.handle)]
            if dropped:
                self._owned.forget(dropped)
                try:
                    await arelease_quietly(self._client, [i for i in dropped if not is_kept(i)])
                except KvbatonError:
                    logger.debug("release of dropped handles failed", exc_info=True)
        limit, owned = self._config.max_retained_handles, self._owned.owned()
        if limit is not None and len(owned) > limit:  # a long run: the oldest replies go first
            await self._release_owned(keep=set(owned[-limit:]))
        return KvbatonCreateResult(
            finish_reason=finish, content=content, usage=usage, cached=False,
            thought=thought or None, kvbaton=core.reuse_report(result),
        )

    # -- ChatCompletionClient -------------------------------------------------------------------------
    async def create(
        self,
        messages: Sequence[LLMMessage],
        *,
        tools: Sequence[Tool | ToolSchema] = [],
        tool_choice: Tool | Literal["auto", "required", "none"] = "auto",
        json_output: bool | type[BaseModel] | None = None,
        extra_create_args: Mapping[str, Any] = {},
        cancellation_token: CancellationToken | None = None,
    ) -> CreateResult:
        chat, engine_tools, options, handle = await self._prepare(
            messages, tools, tool_choice, json_output, extra_create_args
        )
        task = asyncio.ensure_future(self._run("generate", chat, engine_tools, options, handle))
        if cancellation_token is not None:
            cancellation_token.link_future(task)
        result = await task
        names = [t["function"]["name"] for t in self._tool_schemas(tools, tool_choice)]
        return await self._finish(result, messages, names)

    async def create_stream(
        self,
        messages: Sequence[LLMMessage],
        *,
        tools: Sequence[Tool | ToolSchema] = [],
        tool_choice: Tool | Literal["auto", "required", "none"] = "auto",
        json_output: bool | type[BaseModel] | None = None,
        extra_create_args: Mapping[str, Any] = {},
        cancellation_token: CancellationToken | None = None,
    ) -> AsyncGenerator[str | CreateResult, None]:
        chat, engine_tools, options, handle = await self._prepare(
            messages, tools, tool_choice, json_output, extra_create_args
        )
        names = [t["function"]["name"] for t in self._tool_schemas(tools, tool_choice)]
        stream = await self._run("generate_stream", chat, engine_tools, options, handle)
        async with _chunks(stream) as chunks:
            async for chunk in chunks:
                if cancellation_token is not None and cancellation_token.is_cancelled():
                    raise asyncio.CancelledError()
                if chunk.text:
                    yield chunk.text
        result = stream.result
        assert result is not None
        yield await self._finish(result, messages, names)

    async def close(self) -> None:
        """Close the client: every handle it created that is still live is released (unless kept
        with ``client.keep``) and leaves the side table. The shared connection stays;
        :meth:`release_handles` frees the whole side table (every agent's)."""
        self._closed = True
        await self._release_owned()

    @property
    def owned_handles(self) -> list[str]:
        """The ids of the handles this client created and would release on :meth:`close`."""
        return self._owned.owned()

    async def release_run_handles(self) -> int:
        """Release what this client created except its latest reply's handle (the one the agent's
        next turn reuses): an instrumented team calls it when a run ends. Returns how many."""
        return await self._release_owned(keep={self.last_handle.id} if self.last_handle is not None else set())

    async def release_owned_handles(self) -> int:
        """Release every handle this client created, its latest reply's too (kept ones excepted): the
        conversation starts over (an instrumented team's ``reset()``). Returns how many."""
        self.last_handle = None
        return await self._release_owned()

    async def _release_owned(self, keep: set[str] | None = None) -> int:
        keep = keep or set()
        for handle_id in self._owned.owned():
            if handle_id not in keep:
                self._table.discard(handle_id)
        try:
            return await self._owned.arelease(keep=keep)
        except KvbatonError as exc:  # the server is gone, say: nothing more to do here
            logger.warning("kvbaton: releasing the handles of %s failed: %s", self._owned.name, exc)
            return 0

    def actual_usage(self) -> RequestUsage:
        return RequestUsage(self._actual.prompt_tokens, self._actual.completion_tokens)

    def total_usage(self) -> RequestUsage:
        return RequestUsage(self._total.prompt_tokens, self._total.completion_tokens)

    def count_tokens(self, messages: Sequence[LLMMessage], *, tools: Sequence[Tool | ToolSchema] = []) -> int:
        """Prompt tokens of ``messages`` as kvbaton's tokenizer and chat template render them."""
        backend = core.sync_client(self._client)
        if backend is None:
            raise NotImplementedError("count_tokens needs a synchronous kvbaton client (or an embedded async one)")
        schemas = [tool_schema(t) for t in tools]
        in_system = bool(schemas)
        if schemas and self._config.tool_prompt != "system":
            if self._template_renders_tools is None and self._config.tool_prompt == "auto":
                self._template_renders_tools = self._renders_tools_sync(backend)
            in_system = self._config.tool_prompt == "auto" and not self._template_renders_tools
        chat = render_messages(messages, schemas, tools_in_system=in_system)
        return len(backend.chat_tokens(chat, tools=schemas if schemas and not in_system else None))

    def _context_length(self) -> int:
        if self._config.context_length is not None:
            return self._config.context_length
        limit = getattr(getattr(self._client, "engine", None), "max_context", None)  # an embedded engine's
        return int(limit) if limit else 8192

    def remaining_tokens(self, messages: Sequence[LLMMessage], *, tools: Sequence[Tool | ToolSchema] = []) -> int:
        return self._context_length() - self.count_tokens(messages, tools=tools)

    @property
    def capabilities(self) -> ModelCapabilities:  # type: ignore[override]
        return {  # type: ignore[typeddict-item,return-value]
            "vision": self._model_info["vision"],
            "function_calling": self._model_info["function_calling"],
            "json_output": self._model_info["json_output"],
        }

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    async def release_handles(self) -> None:
        """Release every handle of the side table (all agents on this connection) but kept ones."""
        ids = [h.id for h in self._table.handles()]
        for handle_id in ids:
            self._table.discard(handle_id)
        self._owned.forget(ids)
        # kept handles stay live; one released elsewhere does not stop the rest
        await arelease_quietly(self._client, [i for i in ids if not is_kept(i)])


__all__ = [
    "METADATA_KEY",
    "KvbatonChatCompletionClient",
    "KvbatonChatCompletionClientConfig",
    "KvbatonCreateResult",
]
