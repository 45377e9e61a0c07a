"""What an OpenAI request asks of the engine, parsed once (``OpenAIServing.plan``): whose it is (tenant,
session, agent), which handle it continues, the reuse policy, one set of sampling options per choice
(prompt-major), the prompts, the tools and how answers parse them; the serving template and the stream
events read it and never the request again."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbaton.errors import InvalidRequest
from kvbaton.tools import required_tools, tool_call_format, tool_names
from kvbaton.types import PromptTokenLogprob, Reuse, SamplingParams

from ..tenants import AgentRef
from . import protocol as p
from .grammar import check_format
from .tenancy import SlotKey


@dataclass
class Plan:
    """One parsed OpenAI request: who asks, what the engine gets, the sampling of each choice."""

    tenant: str
    session: str  # "" is the default session
    agent: str  # "" when none
    engine_agent: AgentRef | None  # whose the request is, for the engine (its tenant included)
    handle: p.HandleRef | None  # the caller's handle to continue (else the agent's latest, for chat)
    policy: Reuse  # the reuse policy the engine runs it with
    keep: bool
    step: str | int | None
    params: list[SamplingParams]  # one per choice, prompt-major
    prompts: list[Any]  # what the engine is given, per prompt: chat messages, or a completion prompt
    n: int  # choices per prompt
    tools: list[dict[str, Any]] | None
    include_usage: bool
    id: str
    created: int
    model: str = ""  # the name answers carry: the served name asked for, else the first
    scope: dict[str, Any] | None = None  # the request's ASGI scope: its access line counts the tokens
    tool_names: list[str] = field(default_factory=list)  # the tools an answer may call (chat)
    forced: str | None = None  # the one tool the answer must call, when tool_choice names it
    required: bool = False  # tool_choice requires a call: every choice is constrained to exactly one
    echo: list[str] | None = None  # completions with echo: each prompt's text, that its choices start with
    echo_top: int | None = None  # completions with echo and logprobs: the alternatives per prompt token
    echo_logprobs: list[list[PromptTokenLogprob]] | None = None  # ... and each prompt's tokens' log probabilities

    @property
    def parses_tools(self) -> bool:
        return bool(self.tool_names)

    def prompt_of(self, choice: int) -> Any:
        return self.prompts[choice // self.n]

    @property
    def key(self) -> SlotKey:
        return (self.tenant, self.session, self.agent)


def tool_plan(plan: Plan, tool_choice: Any) -> Plan:
    """``plan`` with its tools' names to parse answers for, and, when ``tool_choice`` requires a call,
    every choice constrained to one call of the allowed tools (:func:`kvbaton.tools.tool_call_format`)."""
    tools = plan.tools or []
    required = required_tools(tools, tool_choice) if tool_choice != "none" else None
    plan.tool_names = tool_names(tools)
    if required is None:
        return plan
    if any(params.response_format is not None and params.response_format.type != "text" for params in plan.params):
        raise InvalidRequest("Invalid value for 'response_format': it cannot be combined with a tool_choice that "
                             "requires a call.", param="response_format")
    fmt = tool_call_format(required)
    check_format(fmt, param="tools")
    plan.params = [params.model_copy(update={"response_format": fmt}) for params in plan.params]
    plan.forced = tool_names(required)[0] if len(required) == 1 else None
    plan.required = True
    return plan
