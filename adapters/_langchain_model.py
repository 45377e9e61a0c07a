"""``KvbatonChatModel``: a langchain-core chat model backed by any kvbaton client.

It is the LLM half of the LangGraph adapter (:mod:`kvbaton.adapters.langgraph`) and also works on
its own. Every AIMessage it produces carries its KV handle in ``additional_kwargs["kvbaton"]``; a
later call whose prompt contains such messages passes one of their handles, so the engine reuses
that KV for the longest common token prefix instead of prefilling the text again. See
docs/langgraph.md.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from types import SimpleNamespace
from typing import Any

from kvbaton.client import AsyncClient, Client
from kvbaton.errors import HandleNotFound, HandleReleased, IncompatibleHandle
from kvbaton.handle import Handle, common_prefix_length
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages import (
    ChatMessage as LcChatMessage,
)
from langchain_core.messages.tool import tool_call, tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field

log = logging.getLogger("kvbaton.adapters.langchain")

KVBATON_KEY = "kvbaton"
"""Key of ``AIMessage.additional_kwargs`` that holds ``{"handle": <Handle as JSON dict>, "agent": str}``."""

# -- agent identity ---------------------------------------------------------------------------------

# The LangGraph wrapper's per-invocation run state (see langgraph.py); None outside wrapped calls.
ACTIVE_RUN: ContextVar[Any] = ContextVar("kvbaton_langgraph_run", default=None)


def agent_from_metadata(metadata: Mapping[str, Any] | None) -> str | None:
    """The agent a LangGraph call belongs to: the outermost node of its checkpoint namespace
    (``outer:task|inner:task`` -> ``outer``), so calls inside subgraphs count for the outer node."""
    if not metadata:
        return None
    ns = metadata.get("langgraph_checkpoint_ns")
    if isinstance(ns, str) and ns:
        return ns.split("|", 1)[0].split(":", 1)[0] or None
    node = metadata.get("langgraph_node")
    return node if isinstance(node, str) and node else None


# -- fixed prompts: registered once per (client, agent) ---------------------------------------------

_registered: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
_registered_lock = threading.Lock()


def _claim_registration(client: Any, agent: str) -> bool:
    """True the first time ``agent`` is seen for ``client`` (the caller then registers it)."""
    with _registered_lock:
        try:
            seen = _registered.setdefault(client, set())
        except TypeError:  # not weak-referenceable: register every time rather than never
            return True
        if agent in seen:
            return False
        seen.add(agent)
        return True


def leading_system(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The leading system message(s) of a chat: an agent's fixed prompt."""
    out = []
    for m in messages:
        if m.get("role") != "system":
            break
        out.append(m)
    return out


def engine_supports(client: Any, feature: str) -> bool:
    """Whether the engine behind ``client`` reports ``feature`` (a :class:`kvbaton.Capabilities`
    field; "exact"/"corrected" levels count as support). Clients that do not say are assumed able."""
    describe = getattr(client, "capabilities", None)
    try:
        caps = describe() if describe is not None else None
    except Exception:  # noqa: BLE001 - e.g. a server older than the endpoint: assume it can
        return True
    if inspect.isawaitable(caps):  # an async client: not worth a round trip here
        caps.close()
        return True
    value = getattr(caps, feature, True)
    return value in ("exact", "corrected") if isinstance(value, str) else bool(value)


def register_fixed_prompt(client: Any, agent: str | None, messages: Sequence[dict[str, Any]]) -> None:
    """Register ``agent``'s fixed prompt (its leading system messages) with ``client``, once."""
    if not agent or client is None or not hasattr(client, "register_agent"):
        return
    fixed = leading_system(messages)
    if not fixed or not _claim_registration(client, agent):
        return
    if not engine_supports(client, "workflow_eviction"):  # asked once per agent, after the claim
        return
    try:
        client.register_agent(agent, fixed)
    except Exception as exc:  # noqa: BLE001 - a cache hint must never break the app
        log.warning("kvbaton: registering agent %r failed: %s", agent, exc)


def sync_client(client: Any) -> Any:
    """A synchronous client for control calls (hints, registration): ``client`` itself unless it
    is an :class:`~kvbaton.AsyncClient` (then the sync client it wraps, if any, else None)."""
    if client is None or not isinstance(client, AsyncClient):
        return client
    inner = getattr(client, "client", None)  # AsyncEmbeddedClient wraps an EmbeddedClient
    return inner if inner is not None and not isinstance(inner, AsyncClient) else None


_kw_cache: dict[tuple[type, str], bool] = {}


def _accepts_agent(fn: Callable[..., Any]) -> bool:
    key = (type(getattr(fn, "__self__", fn)), getattr(fn, "__name__", ""))
    if key not in _kw_cache:
        try:
            _kw_cache[key] = "agent" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            _kw_cache[key] = False
    return _kw_cache[key]


# -- tools: a documented JSON convention ------------------------------------------------------------

TOOL_PROMPT = (
    "You can call these tools:\n{tools}\n\n"
    "To call a tool, answer with one line per call, exactly:\n"
    '<tool_call>{{"name": "<tool name>", "arguments": {{...}}}}</tool_call>'
)
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def render_tools(tools: Sequence[dict[str, Any]]) -> str:
    lines = []
    for t in tools:
        fn = t.get("function", t)
        lines.append(json.dumps({"name": fn.get("name"), "description": fn.get("description", ""),
                                 "parameters": fn.get("parameters", {})}, separators=(",", ":")))
    return TOOL_PROMPT.format(tools="\n".join(lines))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return None


def parse_tool_calls(
    text: str, tool_names: Sequence[str], forced: str | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """Tool calls in model output: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
    (Hermes/Qwen style), or a whole-output JSON object ``{"name": ..., "arguments": ...}``. With a
    forced single tool (``tool_choice``), a bare JSON object is taken as that tool's arguments.
    Returns the text without the calls, and LangChain tool calls."""
    calls: list[dict[str, Any]] = []
    for body in _TOOL_CALL_RE.findall(text):
        obj = _loads(body)
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                args = _loads(args) or {}
            calls.append(tool_call(name=obj["name"], args=args if isinstance(args, dict) else {},
                                   id=f"call_{uuid.uuid4().hex[:24]}"))
    if calls:
        return _TOOL_CALL_RE.sub("", text).strip(), calls
    obj = _loads(text.strip())
    if isinstance(obj, dict):
        if isinstance(obj.get("name"), str) and obj["name"] in tool_names and "arguments" in obj:
            args = obj["arguments"] if isinstance(obj["arguments"], dict) else {}
            return "", [tool_call(name=obj["name"], args=args, id=f"call_{uuid.uuid4().hex[:24]}")]
        if forced is not None:
            return "", [tool_call(name=forced, args=obj, id=f"call_{uuid.uuid4().hex[:24]}")]
    return text, []


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
    """LangChain messages as kvbaton chat messages. Tool calls of AI messages are rendered in the
    tool convention above, so a conversation re-renders to the tokens the model produced."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if isinstance(m, LcChatMessage):
            role = m.role if m.role in ("system", "user", "assistant", "tool") else "user"
        else:
            role = _ROLES.get(m.type, "user")
        content = _text(m.content)
        if isinstance(m, AIMessage) and m.tool_calls:
            rendered = "\n".join(
                "<tool_call>" + json.dumps({"name": c["name"], "arguments": c["args"]}) + "</tool_call>"
                for c in m.tool_calls
            )
            content = f"{content}\n{rendered}" if content else rendered
        out.append({"role": role, "content": content})
    return out


def handle_of(message: BaseMessage) -> dict[str, Any] | None:
    """The kvbaton handle (JSON dict) an AI message carries, if any."""
    data = message.additional_kwargs.get(KVBATON_KEY) if isinstance(message, AIMessage) else None
    handle = data.get("handle") if isinstance(data, dict) else None
    return handle if isinstance(handle, dict) and "id" in handle else None


def _dict_tokens(data: dict[str, Any]) -> list[int]:
    """``Handle.token_ids()`` of a handle's JSON dict, without validating the whole handle."""
    tokens: list[int] = []
    for step in data.get("lineage") or ():
        keep = step.get("keep")
        if keep is not None:
            del tokens[keep:]
        tokens.extend(step.get("token_ids") or ())
    return tokens


def pick_handle(
    candidates: list[dict[str, Any]], prompt_tokens: Callable[[], list[int]] | None
) -> Handle | None:
    """The most useful handle for a prompt: the one sharing the longest token prefix with it (the
    latest on ties); the latest when tokens are not available. One candidate costs no tokenization;
    only the chosen handle is validated."""
    order = list(reversed(candidates))
    if len(order) > 1 and prompt_tokens is not None:
        tokens = prompt_tokens()
        lengths = []
        for data in order:
            try:
                lengths.append(common_prefix_length(_dict_tokens(data), tokens))
            except (TypeError, AttributeError):
                lengths.append(-1)
        best = max(range(len(order)), key=lambda i: (lengths[i], -i))
        order.insert(0, order.pop(best))
    for data in order:
        try:
            return Handle.model_validate(data)
        except Exception:  # noqa: BLE001 - a foreign or stale dict is just not reusable
            log.debug("kvbaton: ignoring a malformed handle on a message")
    return None


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


_STALE = (HandleNotFound, HandleReleased, IncompatibleHandle)


# -- the chat model ---------------------------------------------------------------------------------


class KvbatonChatModel(BaseChatModel):
    """A chat model on a kvbaton client (embedded or HTTP; :class:`kvbaton.Client` or
    :class:`kvbaton.AsyncClient`). Greedy by default.

    - tags each call with its agent: ``agent`` if set, else the LangGraph node running it (the
      outermost node for calls inside subgraphs);
    - registers each agent's fixed prompt (leading system messages) on its first call;
    - puts ``{"handle": ..., "agent": ...}`` on every AIMessage's ``additional_kwargs["kvbaton"]``
      and passes the best handle found on the prompt's messages (``pass_handles=False`` disables it);
    - ``usage_metadata.input_token_details.cache_read`` = prompt tokens whose KV was reused.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    client: Any = Field(description="A kvbaton Client or AsyncClient.")
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    agent: str | None = Field(default=None, description="Fixed agent name; default: the LangGraph node.")
    pass_handles: bool = True
    register_agents: bool = True
    model_name: str = "kvbaton"

    @property
    def _llm_type(self) -> str:
        return "kvbaton"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "max_tokens": self.max_tokens, "temperature": self.temperature}

    # -- tools ------------------------------------------------------------------------------------

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: str | dict[str, Any] | bool | None = None,
                   **kwargs: Any) -> Any:
        """Bind tools (anything ``convert_to_openai_tool`` accepts). They are described in the system
        prompt and calls are parsed from the output (see :data:`TOOL_PROMPT`). ``tool_choice`` may
        be a tool name, ``"any"``/``"required"``/``True`` (with one tool: forced) or ``"auto"``."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

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
        chat = to_chat(messages)
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
        if tools:
            prompt = render_tools(tools)
            if chat and chat[0]["role"] == "system":
                chat[0] = {**chat[0], "content": f"{chat[0]['content']}\n\n{prompt}"}
            else:
                chat.insert(0, {"role": "system", "content": prompt})
        metadata = getattr(run_manager, "metadata", None) if run_manager is not None else None
        agent = self.agent or agent_from_metadata(metadata)
        candidates = [h for m in messages if (h := handle_of(m)) is not None] if self.pass_handles else []
        return {"chat": chat, "agent": agent, "candidates": candidates, "tool_names": names, "forced": forced,
                "sampling": self._sampling(stop, kwargs)}

    def _bind_run(self, req: dict[str, Any], client: Any) -> None:
        run = ACTIVE_RUN.get()
        if run is not None:
            run.bind_client(client)
        if self.register_agents:
            register_fixed_prompt(client, req["agent"], req["chat"])

    def _options(self, fn: Callable[..., Any], req: dict[str, Any]) -> dict[str, Any]:
        opts = dict(req["sampling"])
        if req["agent"] and _accepts_agent(fn):
            opts["agent"] = req["agent"]
        return opts

    def _message(self, req: dict[str, Any], result: Any, chunk: bool = False) -> AIMessage:
        text = result.text
        calls: list[dict[str, Any]] = []
        if req["tool_names"]:
            text, calls = parse_tool_calls(text, req["tool_names"], req["forced"])
        timings = result.timings
        prompt_tokens = timings.tokens_reused + timings.tokens_prefilled
        kv: dict[str, Any] = {"handle": result.handle.model_dump(mode="json")}
        if req["agent"]:
            kv["agent"] = req["agent"]
        usage = {
            "input_tokens": prompt_tokens,
            "output_tokens": timings.tokens_generated,
            "total_tokens": prompt_tokens + timings.tokens_generated,
            "input_token_details": {"cache_read": timings.tokens_reused},
        }
        meta = {"model_name": self.model_name, "finish_reason": result.finish_reason,
                "kvbaton_timings": timings.model_dump()}
        if chunk:
            return AIMessageChunk(  # type: ignore[return-value]
                content=text, additional_kwargs={KVBATON_KEY: kv}, response_metadata=meta, usage_metadata=usage,
                tool_call_chunks=[tool_call_chunk(name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i)
                                  for i, c in enumerate(calls)],
                chunk_position="last",
            )
        return AIMessage(content=text, additional_kwargs={KVBATON_KEY: kv}, response_metadata=meta,
                         usage_metadata=usage, tool_calls=calls)  # type: ignore[arg-type]

    # -- sync ------------------------------------------------------------------------------------

    def _sync(self) -> Client:
        client = sync_client(self.client)
        if client is None:
            raise TypeError("this KvbatonChatModel has an async-only client: use ainvoke/astream")
        return client

    def _handle(self, client: Client, req: dict[str, Any]) -> Handle | None:
        return pick_handle(req["candidates"], lambda: client.chat_tokens(req["chat"]))

    def _call(self, client: Client, method: str, req: dict[str, Any]) -> Any:
        fn = getattr(client, method)
        handle = self._handle(client, req) if req["candidates"] else None
        opts = self._options(fn, req)
        try:
            return fn(req["chat"], handle=handle, **opts)
        except _STALE:
            if handle is None:
                raise
            return fn(req["chat"], **opts)  # a released/foreign handle: plain prefill

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        client = self._sync()
        req = self._prepare(messages, stop, run_manager, kwargs)
        self._bind_run(req, client)
        result = self._call(client, "generate", req)
        return ChatResult(generations=[ChatGeneration(message=self._message(req, result))])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        client = self._sync()
        req = self._prepare(messages, stop, run_manager, kwargs)
        self._bind_run(req, client)
        stream = self._call(client, "generate_stream", req)
        try:
            if not req["tool_names"]:  # with tools bound the output is parsed as a whole
                for piece in stream:
                    if piece.text:
                        chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece.text))
                        if run_manager is not None:
                            run_manager.on_llm_new_token(piece.text, chunk=chunk)
                        yield chunk
            else:
                for _ in stream:
                    pass
        finally:
            stream.close()
        final = self._message(req, stream.result, chunk=True)
        if not req["tool_names"]:
            final.content = ""
        yield ChatGenerationChunk(message=final)  # type: ignore[arg-type]

    # -- async -----------------------------------------------------------------------------------

    async def _acall(self, method: str, req: dict[str, Any]) -> Any:
        client = self.client
        if not isinstance(client, AsyncClient):
            sync = self._sync()
            return await asyncio.to_thread(self._call, sync, method, req)
        fn = getattr(client, method)
        handle = None
        if req["candidates"]:
            handle = pick_handle(req["candidates"], None)
            if len(req["candidates"]) > 1:
                tokens = await client.chat_tokens(req["chat"])
                handle = pick_handle(req["candidates"], lambda: tokens)
        opts = self._options(fn, req)
        try:
            return await fn(req["chat"], handle=handle, **opts)
        except _STALE:
            if handle is None:
                raise
            return await fn(req["chat"], **opts)

    async def _abind_run(self, req: dict[str, Any]) -> None:
        control = sync_client(self.client)
        run = ACTIVE_RUN.get()
        if run is not None and control is not None:
            run.bind_client(control)
        if self.register_agents and req["agent"] and leading_system(req["chat"]):
            if control is not None:
                await asyncio.to_thread(register_fixed_prompt, control, req["agent"], req["chat"])
            elif hasattr(self.client, "register_agent") and _claim_registration(self.client, req["agent"]):
                try:
                    await self.client.register_agent(req["agent"], leading_system(req["chat"]))
                except Exception as exc:  # noqa: BLE001
                    log.warning("kvbaton: registering agent %r failed: %s", req["agent"], exc)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        req = self._prepare(messages, stop, run_manager, kwargs)
        await self._abind_run(req)
        result = await self._acall("generate", req)
        return ChatResult(generations=[ChatGeneration(message=self._message(req, result))])

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        if not isinstance(self.client, AsyncClient):
            # a sync client: stream from a worker thread, one chunk per await
            shim = SimpleNamespace(metadata=getattr(run_manager, "metadata", None), on_llm_new_token=_ignore)
            iterator = self._stream(messages, stop, shim, **kwargs)  # type: ignore[arg-type]
            done = object()
            while True:
                chunk = await asyncio.to_thread(next, iterator, done)
                if chunk is done:
                    return
                if run_manager is not None and chunk.message.content:
                    await run_manager.on_llm_new_token(chunk.message.content, chunk=chunk)
                yield chunk
        req = self._prepare(messages, stop, run_manager, kwargs)
        await self._abind_run(req)
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
        final = self._message(req, stream.result, chunk=True)
        if not req["tool_names"]:
            final.content = ""
        yield ChatGenerationChunk(message=final)  # type: ignore[arg-type]


__all__ = ["KVBATON_KEY", "KvbatonChatModel", "agent_from_metadata", "handle_of", "parse_tool_calls", "to_chat"]

# keep a reference: these are part of the message conversion's public surface
_ = (HumanMessage, SystemMessage, ToolMessage)
