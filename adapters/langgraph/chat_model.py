"""``KvbatonChatModel``: a langchain-core chat model backed by any kvbaton client.

It is the LLM half of the LangGraph adapter (:mod:`kvbaton.adapters.langgraph`) and also works on
its own, built like ``ChatOpenAI``: ``KvbatonChatModel()`` (the embedded engine, or ``$KVBATON_URL``),
``KvbatonChatModel(base_url=..., api_key=..., model=...)``, or on a client (``client=``). Building one
does no I/O (LangChain's convention): the connection opens, and the served model is asked for, on
first use. Messages are translated with LangChain's own ``convert_to_openai_messages``; content the
model cannot read (images, audio, files) is refused with a clear error, never dropped. A tool call
that ``tool_choice`` requires and ``max_tokens`` cuts short comes back as an invalid tool call with
``finish_reason`` ``"length"`` (so ``with_structured_output`` raises a parsing error). Every
AIMessage it produces carries a compact reference to its KV handle in ``additional_kwargs["kvbaton"]``
(no lineage: a bounded size whatever the context); a later call whose prompt contains such messages
passes one of their handles, so the engine reuses that KV for the longest common token prefix
instead of prefilling the text again. Tokens are counted with the served model's tokenizer. This module is
the LangChain glue (messages, callbacks, chunks); the choice of that handle, the tool-call
convention, agent registration and sync/async dispatch are :mod:`kvbaton.adapters.core`'s. See
docs/langgraph.md.
"""

from __future__ import annotations

import atexit
import json
import logging
import re
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextvars import ContextVar
from types import SimpleNamespace
from typing import Any

from kvbaton.client import AsyncClient, Client
from kvbaton.errors import InvalidRequest, ModelNotFound
from kvbaton.handle import Handle
from kvbaton.tools import tool_call_format
from kvbaton.types import ResponseFormat, Reuse
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, convert_to_openai_messages
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from ..connections import default_target, open_connection, served_model, shared_connection
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

_ROLES = ("system", "user", "assistant", "tool")


def _text(content: Any, where: str) -> str:
    """The text of an OpenAI-format message's content; any other block is refused (the served model
    reads text only): never dropped, so an answer never pretends to have seen an image."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for k, block in enumerate(content):
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise InvalidRequest(f"{where} has a {kind!r} content block: the served model reads text only, so "
                                 "KvbatonChatModel refuses it rather than answer without it", param=f"{where}.content")
    return "".join(parts)


def to_chat(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as kvbaton chat messages: LangChain's ``convert_to_openai_messages``, then
    the adapters' tool-call convention (:mod:`kvbaton.adapters.core`): an AI message's tool calls
    follow its text as ``<tool_call>`` lines, so a conversation re-renders to the tokens the model
    produced; tool results are wrapped in ``<tool_response>``. Content other than text is refused
    (``InvalidRequest`` naming the message)."""
    out: list[dict[str, Any]] = []
    for k, m in enumerate(convert_to_openai_messages(list(messages), text_format="string")):
        where = f"messages[{k}]"
        role = m.get("role")
        content = _text(m.get("content"), where)
        if role == "tool":
            out.append(tool_result(content))
            continue
        calls = m.get("tool_calls") or []
        if role == "assistant" and calls:
            content = render_tool_calls(content, [(c["function"]["name"], _arguments(c["function"]["arguments"]))
                                                  for c in calls])
        out.append({"role": role if role in _ROLES else "user", "content": content})
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


_CALL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"?')
_CALL_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def cut_call(text: str, names: Sequence[str], forced: str | None) -> tuple[str, str] | None:
    """``(name, arguments as written)`` of a required call (constrained to ``{"name": ..., "arguments":
    {...}}``) that ``max_tokens`` cut short; None when the text names no tool."""
    m = _CALL_NAME.match(text)
    fits = [n for n in names if m is not None and n.startswith(m.group(1))]
    name = forced or (fits[0] if len(fits) == 1 else None)
    if name is None:
        return None
    args = _CALL_ARGUMENTS.search(text, m.end() if m is not None else 0)
    return name, text[args.end():].rstrip() if args is not None else ""


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
    naming the same target (``timeout`` / ``max_retries`` other than the defaults: one connection per
    such setting). Nothing connects until the first call (or ``.client``). ``model`` is the served
    model (embedded: the checkpoint to load; default: the server's or kvbaton's default model);
    ``model_name`` reports it once known, and a call naming another model is refused.

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
    - ``usage_metadata.input_token_details.cache_read`` = prompt tokens whose KV was reused exactly;
    - tools (``bind_tools``, a required ``tool_choice`` enforced by constrained decoding) and
      ``with_structured_output`` (``function_calling``, ``json_schema``, ``json_mode``).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    given_client: Any = Field(default=None, alias="client", exclude=True,
                              description="A kvbaton Client or AsyncClient; default: a shared connection to base_url, "
                              "$KVBATON_URL or the embedded engine, opened on first use.")
    base_url: str | None = Field(default=None,
                                 description="A kvbaton serve URL (default: $KVBATON_URL, else embedded).")
    api_key: SecretStr | None = Field(default=None, description="The kvbaton server's token (default: $KVBATON_TOKEN); "
                                      "unused by the embedded engine.")
    model_name: str | None = Field(default=None, alias="model",
                                   description="The served model (default: the engine's); embedded: the model to load.")
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    timeout: float | None = Field(default=None, description="Seconds a server request may take (default: the "
                                  "HTTP client's); not used by the embedded engine.")
    max_retries: int | None = Field(default=None, description="Retries of a transient server error (default: the "
                                    "HTTP client's); not used by the embedded engine.")
    streaming: bool = Field(default=False, description="invoke() streams underneath (callbacks get each token).")
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
    _opened: Any = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check(self) -> KvbatonChatModel:
        """No I/O here (LangChain's convention: building a model is cheap): only what can be refused
        from the arguments; a process-wide connection already open for this target is adopted."""
        if self.given_client is not None and (self.base_url is not None or self.api_key is not None):
            raise ValueError("give either client or base_url/api_key, not both: the client already says where it runs")
        if self.given_client is None and self.model_name is None:  # (a named model is checked when it connects)
            self._opened = open_connection(*self._key())
        return self

    def _key(self) -> tuple[str, str | None, str | None]:
        """(target, model, token) of the connection this model opens."""
        target = default_target(self.base_url)
        token = self.api_key.get_secret_value() if self.api_key is not None and target != "embedded" else None
        return target, self.model_name, token

    @property
    def client(self) -> Any:
        """The client this model runs on: the one given, else the connection, opened now if it is not yet
        (and the served model's name learned)."""
        if self.given_client is not None:
            client = self.given_client
        else:
            if self._opened is None:
                target, model, token = self._key()
                options = {k: v for k, v in (("timeout", self.timeout), ("max_retries", self.max_retries))
                           if v is not None and target != "embedded"}
                self._opened = (shared_connection(target, model, token) if not options
                                else _tuned_connection(target, model, token, options))
            client = self._opened
        if self.model_name is None:
            self.model_name = served_model(client)
        return client

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

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        """LangSmith's standard parameters: provider ``kvbaton``, the model (a call's ``model`` first;
        ``"default"`` while the served model is not known yet: no I/O for a trace)."""
        params = LangSmithParams(ls_provider="kvbaton", ls_model_name=kwargs.get("model") or self.model_name or "default",
                                 ls_model_type="chat", ls_temperature=kwargs.get("temperature", self.temperature),
                                 ls_max_tokens=kwargs.get("max_tokens", self.max_tokens))
        stops = stop or kwargs.get("stop") or self.stop
        if stops:
            params["ls_stop"] = list(stops)
        return params

    # -- tools and structured output -----------------------------------------------------------

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: str | dict[str, Any] | bool | None = None,
                   **kwargs: Any) -> Runnable[Any, AIMessage]:
        """Bind tools (anything ``convert_to_openai_tool`` accepts). They are described in the system
        prompt and calls are parsed from the output (the convention of :mod:`kvbaton.adapters.core`).
        ``tool_choice`` may be a tool name, ``"any"``/``"required"``/``True`` (a call is required:
        constrained decoding writes exactly one) or ``"auto"``/``"none"``."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(self, schema: Any, *, include_raw: bool = False, method: str = "function_calling",
                               strict: bool | None = None, **kwargs: Any) -> Runnable[Any, Any]:
        """Answers parsed into ``schema`` (a pydantic class, a TypedDict, a JSON schema, an OpenAI tool):
        ``method="function_calling"`` (a required tool call), ``"json_schema"`` (the schema enforced on
        the content by constrained decoding) or ``"json_mode"`` (any JSON object). ``strict`` is
        accepted: constrained decoding enforces the schema either way. An answer that ``max_tokens``
        cut short raises ``OutputParserException`` (with ``include_raw``: in ``parsing_error``)."""
        from .structured import structured_output

        return structured_output(self, schema, include_raw=include_raw, method=method, **kwargs)

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
        stops = list(stop or kwargs.get("stop") or self.stop or ())
        fmt = kwargs.get("response_format")
        return {
            "max_tokens": kwargs.get("max_tokens", self.max_tokens),
            "temperature": kwargs.get("temperature", self.temperature),
            "top_p": kwargs.get("top_p", self.top_p),
            "top_k": kwargs.get("top_k", self.top_k),
            "seed": kwargs.get("seed", self.seed),
            **({"stop": stops} if stops else {}),
            **({"response_format": ResponseFormat.model_validate(fmt)} if fmt is not None else {}),
        }

    def _check_model(self, requested: Any) -> None:
        """A call may name the served model, not another (one model per kvbaton engine)."""
        if requested is not None and requested != self.model_name:
            raise ModelNotFound(f"this KvbatonChatModel serves {self.model_name!r}: a call cannot switch to "
                                f"{requested!r}", param="model")

    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any,
                 kwargs: dict[str, Any]) -> dict[str, Any]:
        tools = kwargs.get("tools") or []
        names = [t.get("function", t).get("name") for t in tools]
        forced = None
        choice = kwargs.get("tool_choice")
        if isinstance(choice, dict):
            choice = choice.get("function", {}).get("name") or choice.get("name")
        if choice == "none":
            tools, names = [], []  # the model is not told of the tools
        if isinstance(choice, str) and choice in names:
            forced = choice
        elif choice in ("any", "required", True) and len(names) == 1:
            forced = names[0]
        sampling = self._sampling(stop, kwargs)
        # A required call is enforced by constrained decoding: exactly one call of the allowed tools.
        required = [t for t in tools if t.get("function", t).get("name") == forced] if forced else (
            tools if choice in ("any", "required", True) else [])
        if required:
            if "response_format" in sampling:
                raise InvalidRequest("a required tool call cannot be combined with a response_format",
                                     param="response_format")
            sampling["response_format"] = tool_call_format(required)
        metadata = getattr(run_manager, "metadata", None) if run_manager is not None else None
        candidates = [h for m in messages if (h := _handle_data(m)) is not None] if self.pass_handles else []
        return {"chat": with_tool_prompt(to_chat(messages), tools), "candidates": candidates,
                "agent": self.agent or agent_from_metadata(metadata, getattr(ACTIVE_RUN.get(), "base_ns", "")),
                "tool_names": names, "forced": forced, "required": bool(required), "model": kwargs.get("model"),
                "sampling": sampling, "reuse": kwargs.get("reuse", self.reuse)}

    def _calls(self, req: dict[str, Any], result: Any) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
        """The answer's content, its tool calls, and the calls cut short (invalid: ``max_tokens`` ended
        a required call before its arguments did)."""
        text = result.text
        if not req["tool_names"]:
            return text, [], []
        if req["required"] and result.finish_reason == "length":
            cut = cut_call(text, req["tool_names"], req["forced"])
            if cut is not None:
                error = "the call was cut short by max_tokens (finish_reason 'length')"
                return "", [], [invalid_tool_call(name=cut[0], args=cut[1], id=f"call_{result.handle.id[:24]}",
                                                  error=error)]
        text, parsed = parse_tool_calls(text, req["tool_names"], req["forced"])
        return text, [tool_call(name=c.name, args=c.arguments, id=c.id) for c in parsed], []

    def _message(self, req: dict[str, Any], result: Any, chunk: bool = False) -> AIMessage:
        text, calls, invalid = self._calls(req, result)
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
        meta = {"model_name": self.model_name, "model_provider": "kvbaton", "finish_reason": result.finish_reason,
                "kvbaton_timings": timings.model_dump(), KVBATON_KEY: report}
        extra: dict[str, Any] = {KVBATON_KEY: kv}
        if invalid:  # as ChatOpenAI keeps them: LangChain's tool parsers raise on their arguments
            extra["tool_calls"] = [{"id": c["id"], "type": "function",
                                    "function": {"name": c["name"], "arguments": c["args"]}} for c in invalid]
        if chunk:
            chunks = [tool_call_chunk(name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i)
                      for i, c in enumerate(calls)]
            chunks += [tool_call_chunk(name=c["name"], args=c["args"], id=c["id"], index=len(chunks) + i)
                       for i, c in enumerate(invalid)]
            return AIMessageChunk(  # type: ignore[return-value]
                content=text, additional_kwargs=extra, response_metadata=meta, usage_metadata=usage,
                tool_call_chunks=chunks, chunk_position="last",
            )
        return AIMessage(content=text, additional_kwargs=extra, response_metadata=meta, usage_metadata=usage,
                         tool_calls=calls, invalid_tool_calls=invalid)  # type: ignore[arg-type]

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
        self._check_model(req["model"])
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
        if self.streaming:
            return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
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
        self._check_model(req["model"])
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
        if self.streaming:
            return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))
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


_tuned: dict[tuple[Any, ...], Any] = {}  # connections with a timeout / max_retries of their own
_tuned_lock = threading.Lock()


def _tuned_connection(target: str, model: str | None, token: str | None, options: dict[str, Any]) -> Any:
    """One process-wide connection to a server per (target, token, timeout, max_retries), closed at exit;
    ``ModelNotFound`` when the server serves another model than ``model``."""
    key = (target, token, *sorted(options.items()))
    with _tuned_lock:
        client = _tuned.get(key)
        if client is None:
            from kvbaton.connect import connect

            client = _tuned[key] = connect(target, token=token, **options)
    if model is not None and (served := served_model(client, default="")) != model:
        raise ModelNotFound(f"the kvbaton server at {target} serves {served!r}, not {model!r}")
    return client


@atexit.register
def _close_tuned() -> None:
    while _tuned:
        try:
            _tuned.popitem()[1].close()
        except Exception:  # noqa: BLE001 - at exit, a failing close must not hide the others
            pass


ChatKvbaton = KvbatonChatModel
"""The conventional LangChain name (``ChatOpenAI``, ``ChatAnthropic``...) of :class:`KvbatonChatModel`."""

__all__ = ["KVBATON_KEY", "ChatKvbaton", "KvbatonChatModel", "agent_from_metadata", "handle_of", "to_chat"]
