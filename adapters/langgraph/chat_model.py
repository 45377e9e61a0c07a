"""``KvbatonChatModel``: a langchain-core chat model backed by any kvbaton client.

It is the LLM half of the LangGraph adapter (:mod:`kvbaton.adapters.langgraph`) and also works on
its own, built like ``ChatOpenAI``: ``KvbatonChatModel()`` (the embedded engine, or ``$KVBATON_URL``),
``KvbatonChatModel(base_url=..., api_key=..., model=...)``, or on a client (``client=``). Every
AIMessage it produces carries a compact reference to its KV handle in ``additional_kwargs["kvbaton"]``
(no lineage: a bounded size whatever the context); a later call whose prompt contains such messages
passes one of their handles, so the engine reuses that KV for the longest common token prefix
instead of prefilling the text again. Tokens are counted with the served model's tokenizer. This module is
the LangChain glue (messages, callbacks, chunks); the choice of that handle, the tool-call
convention, agent registration and sync/async dispatch are :mod:`kvbaton.adapters.core`'s. See
docs/langgraph.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextvars import ContextVar
from types import SimpleNamespace
from typing import Any

from kvbaton.client import AsyncClient, Client
from kvbaton.handle import Handle
from kvbaton.tools import tool_call_format
from kvbaton.types import Reuse
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ToolMessage,
)
from langchain_core.messages import (
    ChatMessage as LcChatMessage,
)
from langchain_core.messages.tool import tool_call, tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field, SecretStr, model_validator

from ..connections import default_target, served_model, shared_connection
from ..core import (
    arank_for_prompt,
    aregister_fixed_prompt,
    arun_with_handle,
    call,
    compact_handle,
    iterate_in_thread,
    parse_tool_calls,
    rank_for_prompt,
    register_fixed_prompt,
    render_tool_calls,
    reuse_report,
    run_with_handle,
    sync_client,
    tool_result,
    with_tool_prompt,
)

log = logging.getLogger("kvbaton.adapters.langchain")

KVBATON_KEY = "kvbaton"
"""Key of ``AIMessage.additional_kwargs`` that holds ``{"handle": <compact handle reference>, "agent": str}``
(:func:`kvbaton.adapters.core.compact_handle`: the handle's JSON without its lineage)."""

# -- agent identity ---------------------------------------------------------------------------------

# The LangGraph wrapper's per-invocation run state (see langgraph.py); None outside wrapped calls.
ACTIVE_RUN: ContextVar[Any] = ContextVar("kvbaton_langgraph_run", default=None)


def agent_from_metadata(metadata: Mapping[str, Any] | None, base: str = "") -> str | None:
    """The agent a LangGraph call belongs to: the outermost node of its checkpoint namespace
    (``outer:task|inner:task`` -> ``outer``), so calls inside subgraphs count for the outer node.
    ``base``: the namespace of the graph whose nodes are the agents (a wrapped graph running as a
    node of another: ``outer:task``), stripped first."""
    if not metadata:
        return None
    ns = metadata.get("langgraph_checkpoint_ns")
    if isinstance(ns, str) and base and ns.startswith(base + "|"):
        ns = ns[len(base) + 1:]
    if isinstance(ns, str) and ns:
        return ns.split("|", 1)[0].split(":", 1)[0] or None
    node = metadata.get("langgraph_node")
    return node if isinstance(node, str) and node else None


# -- messages ---------------------------------------------------------------------------------------

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content or ():
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
    return "".join(parts)


def to_chat(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as kvbaton chat messages, in the adapters' tool-call convention
    (:mod:`kvbaton.adapters.core`): an AI message's tool calls follow its text as ``<tool_call>``
    lines, so a conversation re-renders to the tokens the model produced; tool results are wrapped
    in ``<tool_response>``."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if isinstance(m, ToolMessage):
            out.append(tool_result(_text(m.content)))
            continue
        if isinstance(m, LcChatMessage):
            role = m.role if m.role in ("system", "user", "assistant", "tool") else "user"
        else:
            role = _ROLES.get(m.type, "user")
        content = _text(m.content)
        if isinstance(m, AIMessage) and m.tool_calls:
            content = render_tool_calls(content, [(c["name"], c["args"]) for c in m.tool_calls])
        out.append({"role": role, "content": content})
    return out


def _handle_data(message: BaseMessage) -> dict[str, Any] | None:
    """The handle (JSON dict) an AI message carries under :data:`KVBATON_KEY`, if any."""
    data = message.additional_kwargs.get(KVBATON_KEY) if isinstance(message, AIMessage) else None
    handle = data.get("handle") if isinstance(data, dict) else None
    return handle if isinstance(handle, dict) and isinstance(handle.get("id"), str) else None


def handle_of(message: BaseMessage) -> str | None:
    """The id of the kvbaton handle a message carries, if any (same shape as the AutoGen adapter's)."""
    data = _handle_data(message)
    return data["id"] if data is not None else None


def _first_valid(ranked: Sequence[dict[str, Any]]) -> Handle | None:
    """The first ranked handle dict that validates (only the chosen one is validated)."""
    for data in ranked:
        try:
            return Handle.model_validate(data)
        except Exception:  # noqa: BLE001 - a foreign or stale dict is just not reusable
            log.debug("kvbaton: ignoring a malformed handle on a message")
    return None


# -- the chat model ---------------------------------------------------------------------------------


class KvbatonChatModel(BaseChatModel):
    """A chat model on kvbaton (alias :data:`ChatKvbaton`). Greedy by default.

    Where it runs: ``client`` (a :class:`kvbaton.Client` or :class:`kvbaton.AsyncClient`, the
    caller's), else ``base_url`` (a ``kvbaton serve`` URL, with ``api_key`` its token, default
    ``$KVBATON_TOKEN``), else ``$KVBATON_URL``, else the embedded engine; the last three are
    process-wide connections (:func:`kvbaton.adapters.connections.shared_connection`) shared by every model
    naming the same target. ``model`` is the served model (embedded: the checkpoint to load;
    default: the server's or kvbaton's default model); ``model_name`` reports it.

    - tags each call with its agent: ``agent`` if set, else the LangGraph node running it (the
      outermost node for calls inside subgraphs);
    - registers each agent's fixed prompt (leading system messages) on its first call;
    - puts ``{"handle": ..., "agent": ...}`` on every AIMessage's ``additional_kwargs["kvbaton"]``
      (a compact reference: id, fingerprints, length — no lineage) and passes the best handle found
      on the prompt's messages (``pass_handles=False`` disables it);
    - counts tokens with kvbaton's tokenizer (``get_num_tokens``, ``get_token_ids``,
      ``get_num_tokens_from_messages``: the chat template's tokens), so ``trim_messages`` works;
    - reuses, by default (``reuse="auto"``), also spans other agents computed behind their own
      system prompt; ``response_metadata["kvbaton"]`` says how each reply was served (``exact``,
      tokens reused / approximate / prefilled, the spans placed);
    - ``usage_metadata.input_token_details.cache_read`` = prompt tokens whose KV was reused exactly.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    client: Any = Field(default=None, description="A kvbaton Client or AsyncClient; default: a shared connection "
                        "to base_url, $KVBATON_URL or the embedded engine.")
    base_url: str | None = Field(default=None,
                                 description="A kvbaton serve URL (default: $KVBATON_URL, else embedded).")
    api_key: SecretStr | None = Field(default=None, description="The kvbaton server's token (default: $KVBATON_TOKEN).")
    model_name: str | None = Field(default=None, alias="model",
                                   description="The served model (default: the engine's); embedded: the model to load.")
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    agent: str | None = Field(default=None, description="Fixed agent name; default: the LangGraph node.")
    pass_handles: bool = True
    register_agents: bool = True
    reuse: Reuse | None = Field(
        default="auto",
        description="Reuse policy of each call (kvbaton.types.Reuse): 'auto' (default) also reuses spans other "
        "agents computed behind their own system prompt, approximately, and marks such replies "
        "(response_metadata['kvbaton']['exact'] is False); 'rotate' and 'correct' (KVCMAS's anchor correction) "
        "likewise; 'exact' keeps greedy output identical to dense prefill; None: the engine's or server's default. "
        "A call may override it (invoke(..., reuse='exact')).",
    )

    @model_validator(mode="after")
    def _connect(self) -> KvbatonChatModel:
        if self.client is None:
            target = default_target(self.base_url)
            token = self.api_key.get_secret_value() if self.api_key is not None else None
            if target == "embedded" and token is not None:
                raise ValueError("api_key is the token of a kvbaton server: give base_url (or $KVBATON_URL) with it")
            self.client = shared_connection(target, self.model_name, token)
        elif self.base_url is not None or self.api_key is not None:
            raise ValueError("give either client or base_url/api_key, not both: the client already says where it runs")
        if self.model_name is None:
            self.model_name = served_model(self.client)
        return self

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"api_key": "KVBATON_TOKEN"}  # LangChain serialization never writes the token

    @property
    def _llm_type(self) -> str:
        return "kvbaton"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "max_tokens": self.max_tokens, "temperature": self.temperature,
                "reuse": self.reuse}

    # -- tools ------------------------------------------------------------------------------------

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: str | dict[str, Any] | bool | None = None,
                   **kwargs: Any) -> Any:
        """Bind tools (anything ``convert_to_openai_tool`` accepts). They are described in the system
        prompt and calls are parsed from the output (the convention of :mod:`kvbaton.adapters.core`).
        ``tool_choice`` may be a tool name, ``"any"``/``"required"``/``True`` (with one tool: forced)
        or ``"auto"``."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    # -- token counting ---------------------------------------------------------------------------
    # kvbaton's own tokenizer, never LangChain's GPT-2 fallback (a download, and another model's counts).

    def get_token_ids(self, text: str) -> list[int]:
        """The token ids of ``text`` with the served model's tokenizer (no special tokens added)."""
        return list(call(self.client, "tokenize", text))

    def get_num_tokens(self, text: str) -> int:
        return len(self.get_token_ids(text))

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Tokens of ``messages`` as the model reads them: the chat template's rendering (tool calls
        and results in the adapters' convention, ``tools`` in the system prompt), without the
        generation prompt."""
        chat = with_tool_prompt(to_chat(messages), [convert_to_openai_tool(t) for t in tools or ()])
        return len(call(self.client, "chat_tokens", chat, add_generation_prompt=False))

    # -- request building -------------------------------------------------------------------------

    def _sampling(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        stops = list(stop or self.stop or ())
        return {
            "max_tokens": kwargs.get("max_tokens", self.max_tokens),
            "temperature": kwargs.get("temperature", self.temperature),
            "top_p": kwargs.get("top_p", self.top_p),
            "top_k": kwargs.get("top_k", self.top_k),
            "seed": kwargs.get("seed", self.seed),
            **({"stop": stops} if stops else {}),
        }

    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any,
                 kwargs: dict[str, Any]) -> dict[str, Any]:
        tools = kwargs.get("tools") or []
        names = [t.get("function", t).get("name") for t in tools]
        forced = None
        choice = kwargs.get("tool_choice")
        if isinstance(choice, dict):
            choice = choice.get("function", {}).get("name") or choice.get("name")
        if isinstance(choice, str) and choice in names:
            forced = choice
        elif choice in ("any", "required", True) and len(names) == 1:
            forced = names[0]
        sampling = self._sampling(stop, kwargs)
        # A required call is enforced by constrained decoding: exactly one call of the allowed tools.
        required = [t for t in tools if t.get("function", t).get("name") == forced] if forced else (
            tools if choice in ("any", "required", True) else [])
        if required:
            sampling["response_format"] = tool_call_format(required)
        metadata = getattr(run_manager, "metadata", None) if run_manager is not None else None
        candidates = [h for m in messages if (h := _handle_data(m)) is not None] if self.pass_handles else []
        return {"chat": with_tool_prompt(to_chat(messages), tools), "candidates": candidates,
                "agent": self.agent or agent_from_metadata(metadata, getattr(ACTIVE_RUN.get(), "base_ns", "")),
                "tool_names": names, "forced": forced,
                "sampling": sampling, "reuse": kwargs.get("reuse", self.reuse)}

    def _message(self, req: dict[str, Any], result: Any, chunk: bool = False) -> AIMessage:
        text = result.text
        calls: list[dict[str, Any]] = []
        if req["tool_names"]:
            text, parsed = parse_tool_calls(text, req["tool_names"], req["forced"])
            calls = [tool_call(name=c.name, args=c.arguments, id=c.id) for c in parsed]
        timings = result.timings
        prompt_tokens = timings.tokens_reused + timings.tokens_prefilled
        kv: dict[str, Any] = {"handle": compact_handle(result.handle)}
        if req["agent"]:
            kv["agent"] = req["agent"]
        report = reuse_report(result)
        usage = {
            "input_tokens": prompt_tokens,
            "output_tokens": timings.tokens_generated,
            "total_tokens": prompt_tokens + timings.tokens_generated,
            # exact reuse only, as the server's OpenAI cached_tokens
            "input_token_details": {"cache_read": timings.tokens_reused - report["tokens_approximate"]},
        }
        meta = {"model_name": self.model_name, "finish_reason": result.finish_reason,
                "kvbaton_timings": timings.model_dump(), KVBATON_KEY: report}
        if chunk:
            return AIMessageChunk(  # type: ignore[return-value]
                content=text, additional_kwargs={KVBATON_KEY: kv}, response_metadata=meta, usage_metadata=usage,
                tool_call_chunks=[tool_call_chunk(name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i)
                                  for i, c in enumerate(calls)],
                chunk_position="last",
            )
        return AIMessage(content=text, additional_kwargs={KVBATON_KEY: kv}, response_metadata=meta,
                         usage_metadata=usage, tool_calls=calls)  # type: ignore[arg-type]

    def _final(self, req: dict[str, Any], result: Any) -> ChatGenerationChunk:
        """The last chunk of a stream: the handle and usage (and, with tools, the parsed output)."""
        final = self._message(req, result, chunk=True)
        if not req["tool_names"]:
            final.content = ""  # the text went out chunk by chunk
        return ChatGenerationChunk(message=final)  # type: ignore[arg-type]

    # -- sync ------------------------------------------------------------------------------------

    def _sync(self) -> Client:
        client = sync_client(self.client)
        if client is None:
            raise TypeError("this KvbatonChatModel has an async-only client: use ainvoke/astream")
        return client

    def _call(self, client: Client, method: str, req: dict[str, Any]) -> Any:
        run = ACTIVE_RUN.get()
        if run is not None:
            run.bind_client(client)
        if self.register_agents:
            register_fixed_prompt(client, req["agent"], req["chat"])
        ranked = rank_for_prompt(client, req["candidates"], req["chat"]) if req["candidates"] else []
        return run_with_handle(client, method, req["chat"], _first_valid(ranked), agent=req["agent"],
                               reuse=req["reuse"], **req["sampling"])

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        req = self._prepare(messages, stop, run_manager, kwargs)
        result = self._call(self._sync(), "generate", req)
        return ChatResult(generations=[ChatGeneration(message=self._message(req, result))])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        req = self._prepare(messages, stop, run_manager, kwargs)
        stream = self._call(self._sync(), "generate_stream", req)
        try:
            for piece in stream:
                if piece.text and not req["tool_names"]:  # with tools bound the output is parsed as a whole
                    chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece.text))
                    if run_manager is not None:
                        run_manager.on_llm_new_token(piece.text, chunk=chunk)
                    yield chunk
        finally:
            stream.close()
        yield self._final(req, stream.result)

    # -- async -----------------------------------------------------------------------------------

    async def _acall(self, method: str, req: dict[str, Any]) -> Any:
        client = self.client
        control = sync_client(client)
        run = ACTIVE_RUN.get()
        if run is not None and control is not None:
            run.bind_client(control)
        if self.register_agents:
            await aregister_fixed_prompt(client, req["agent"], req["chat"])
        ranked = await arank_for_prompt(client, req["candidates"], req["chat"]) if req["candidates"] else []
        return await arun_with_handle(client, method, req["chat"], _first_valid(ranked), agent=req["agent"],
                                      reuse=req["reuse"], **req["sampling"])

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        req = self._prepare(messages, stop, run_manager, kwargs)
        result = await self._acall("generate", req)
        return ChatResult(generations=[ChatGeneration(message=self._message(req, result))])

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        if not isinstance(self.client, AsyncClient):
            # a sync client: its stream runs in worker threads, one chunk per await
            shim = SimpleNamespace(metadata=getattr(run_manager, "metadata", None),
                                   on_llm_new_token=lambda *a, **k: None)
            chunks = self._stream(messages, stop, shim, **kwargs)  # type: ignore[arg-type]
            async for chunk in iterate_in_thread(chunks):
                if run_manager is not None and chunk.message.content:
                    await run_manager.on_llm_new_token(chunk.message.content, chunk=chunk)
                yield chunk
            return
        req = self._prepare(messages, stop, run_manager, kwargs)
        stream = await self._acall("generate_stream", req)
        try:
            async for piece in stream:
                if piece.text and not req["tool_names"]:
                    chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece.text))
                    if run_manager is not None:
                        await run_manager.on_llm_new_token(piece.text, chunk=chunk)
                    yield chunk
        finally:
            await stream.aclose()
        yield self._final(req, stream.result)


ChatKvbaton = KvbatonChatModel
"""The conventional LangChain name (``ChatOpenAI``, ``ChatAnthropic``...) of :class:`KvbatonChatModel`."""

__all__ = ["KVBATON_KEY", "ChatKvbaton", "KvbatonChatModel", "agent_from_metadata", "handle_of", "to_chat"]
