"""The shared adapter core (kvbaton.adapters.core), model-free: the tool-call convention, the best
handle, sync/async dispatch, agent registration and the hint sender, against small recording fakes
of a client (the adapter core's own contract; no engine is involved)."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from kvbaton.adapters import core
from kvbaton.client import AsyncClient
from kvbaton.embedded import AsyncEmbeddedClient
from kvbaton.errors import HandleReleased, InvalidRequest
from kvbaton.handle import Handle, LineageStep, Op, Placement, Positions
from kvbaton.stepgraph import StepGraph

pytestmark = pytest.mark.unit

NAMES = ["get_weather", "transfer_to_bob"]


def handle(tokens: list[int], hid: str = "a", keep_steps: tuple[LineageStep, ...] = ()) -> Handle:
    steps = (LineageStep(op=Op.GENERATE, token_ids=tuple(tokens)), *keep_steps)
    return Handle(id=hid.ljust(32, "0"), model="m", model_fingerprint="0", tokenizer_fingerprint="0",
                  num_tokens=len(tokens), positions=Positions(rope_type="default", rope_theta=1.0),
                  lineage=steps, placement=Placement(device="cpu"))


class Fake:
    """A synchronous client that records every call; ``tokens`` answers chat_tokens."""

    engine = None  # AsyncEmbeddedClient(client=Fake()) reads it

    def __init__(self, tokens: list[int] | None = None, caps: Any = None, stale: bool = False,
                 fail: bool = False) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.tokens = tokens or [1, 2, 3]
        self.caps = caps
        self.stale = stale
        self.fail = fail

    def chat_tokens(self, messages: Any, *, tools: Any = None, add_generation_prompt: bool = True) -> list[int]:
        self.calls.append(("chat_tokens", (messages,), {"tools": tools}))
        return self.tokens

    def generate(self, messages: Any, *, handle: Any = None, agent: str | None = None, **options: Any) -> str:
        self.calls.append(("generate", (messages,), {"handle": handle, "agent": agent, **options}))
        if handle is not None and self.stale:
            raise HandleReleased("released")
        return "ok"

    def register_agent(self, name: str, fixed_prompt: Any, *, prefill: bool = False) -> str:
        self.calls.append(("register_agent", (name, fixed_prompt), {"prefill": prefill}))
        if self.fail:
            raise InvalidRequest("no")
        return name

    def capabilities(self) -> Any:
        return self.caps if self.caps is not None else SimpleNamespace(workflow_eviction=True)

    def hints(self, steps: Any, *, running: Any = (), finished: Any = ()) -> dict[str, float]:
        self.calls.append(("hints", (steps,), {"running": running, "finished": finished}))
        if self.fail:
            raise InvalidRequest("no")
        return steps.steps_to_execution(running, finished)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class AsyncOnly(AsyncClient):
    """An async client that wraps no sync one (like AsyncHttpClient)."""

    async def hints(self, steps: Any, *, running: Any = (), finished: Any = ()) -> dict[str, float]:
        self.sent = (steps, running, finished)
        return {}


AsyncOnly.__abstractmethods__ = frozenset()  # the other operators are never called here


# -- the tool-call convention -----------------------------------------------------------------------


def test_parse_tool_calls_formats() -> None:
    text, calls = core.parse_tool_calls(
        'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', NAMES
    )
    assert text == "Let me check." and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    text, calls = core.parse_tool_calls('{"name": "transfer_to_bob", "arguments": {}}', NAMES)
    assert [c.name for c in calls] == ["transfer_to_bob"] and text == ""
    # a list of objects; arguments as a JSON string, or under "parameters"
    _, calls = core.parse_tool_calls('[{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}, '
                                     '{"name": "get_weather", "parameters": {"city": "Rome"}}]', NAMES)
    assert [c.arguments for c in calls] == [{"city": "Oslo"}, {"city": "Rome"}]
    # an unterminated last block counts
    _, (call,) = core.parse_tool_calls('<tool_call>{"name": "get_weather", "arguments": {}}', NAMES)
    assert call.name == "get_weather"
    # unknown tools, no tools, broken JSON or prose: plain text, unchanged
    unknown = '{"name": "rm_rf", "arguments": {}}'
    assert core.parse_tool_calls(unknown, NAMES) == (unknown, [])
    assert core.parse_tool_calls('<tool_call>{"name": "get_weather"}</tool_call>', []) == (
        '<tool_call>{"name": "get_weather"}</tool_call>', [])
    assert core.parse_tool_calls("<tool_call>{oops</tool_call>", NAMES) == ("<tool_call>{oops</tool_call>", [])
    assert core.parse_tool_calls("It is sunny.", NAMES) == ("It is sunny.", [])
    assert core.parse_tool_calls("no call here", ["add"]) == ("no call here", [])
    two = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>' * 2
    assert len({c.id for c in core.parse_tool_calls(two, NAMES)[1]}) == 2
    assert all(c.id.startswith("call_") for c in core.parse_tool_calls(two, NAMES)[1])


def test_forced_tool_takes_a_bare_object_as_arguments() -> None:
    text, calls = core.parse_tool_calls('{"city": "Oslo", "celsius": 3}', ["Weather"], forced="Weather")
    assert text == "" and [(c.name, c.arguments) for c in calls] == [("Weather", {"city": "Oslo", "celsius": 3})]
    # a real call still wins over the forced reading, and prose stays prose
    _, (call,) = core.parse_tool_calls('{"name": "Weather", "arguments": {"city": "X"}}', ["Weather"], "Weather")
    assert call.arguments == {"city": "X"}
    assert core.parse_tool_calls("cold", ["Weather"], forced="Weather") == ("cold", [])


def test_tool_prompt_and_rendering_round_trip() -> None:
    params = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fn = {"name": "add", "description": "Add.", "strict": True, "parameters": params}
    tool = {"type": "function", "function": fn}
    block = core.render_tools([tool])
    assert block.startswith("You can call these tools:\n<tools>\n") and "</tools>\nTo call a tool" in block
    line = block.split("\n")[2]
    assert json.loads(line) == {"name": "add", "description": "Add.", "parameters": params}  # "strict" is not shown
    assert '"name": "add"' in line  # one JSON style for every adapter
    # appended to the first system message, or a new one
    chat = core.with_tool_prompt([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}],
                                 [tool])
    assert chat[0]["content"] == f"Be terse.\n\n{block}" and len(chat) == 2
    assert core.with_tool_prompt([{"role": "user", "content": "hi"}], [tool])[0] == {"role": "system", "content": block}
    assert core.with_tool_prompt([{"role": "user", "content": "hi"}], []) == [{"role": "user", "content": "hi"}]
    # an earlier call re-renders to what the model wrote, and parses back to the same call
    rendered = core.render_tool_calls("Sure.", [("add", {"a": 2})])
    assert rendered == 'Sure.\n<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    assert core.render_tool_calls("", [("add", {})]) == '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    text, (call,) = core.parse_tool_calls(rendered, ["add"])
    assert (text, call.name, call.arguments) == ("Sure.", "add", {"a": 2})
    assert core.tool_result("5") == {"role": "tool", "content": "<tool_response>5</tool_response>"}


# -- the best handle --------------------------------------------------------------------------------


def test_rank_handles_longest_prefix_then_latest() -> None:
    prompt = [1, 2, 3, 4, 5, 6]
    old_long, new_short, unrelated = handle([1, 2, 3, 4], "a"), handle([1, 2, 9], "b"), handle([7, 7], "c")
    # longest common prefix wins over the latest; a handle sharing nothing is left out
    assert core.rank_handles([old_long, new_short, unrelated], prompt) == [old_long, new_short]
    assert core.best_handle([unrelated], prompt) is None
    # ties: the latest; without prompt tokens: latest first
    tie_a, tie_b = handle([1, 2, 5], "d"), handle([1, 2, 7], "e")
    assert core.best_handle([tie_a, tie_b], prompt) is tie_b
    assert core.rank_handles([tie_a, tie_b]) == [tie_b, tie_a]
    assert core.best_handle([], prompt) is None


def test_handle_tokens_of_handles_and_their_json() -> None:
    h = handle([1, 2, 3], keep_steps=(LineageStep(op=Op.EXTEND, token_ids=(8, 9), keep=2),))
    assert core.handle_tokens(h) == [1, 2, 8, 9]
    assert core.handle_tokens(h.model_dump(mode="json")) == [1, 2, 8, 9]  # a handle dict, unvalidated
    assert core.handle_tokens({"id": "x"}) is None  # an id-only handle (mode 2): nobody knows its tokens
    assert core.handle_tokens({"lineage": [{"token_ids": 5}]}) is None
    dicts = [handle([1, 2], "a").model_dump(mode="json"), handle([1, 2, 3], "b").model_dump(mode="json")]
    assert core.best_handle(dicts, [1, 2, 3])["id"].startswith("b")
    # a compact reference (what goes on messages) has no lineage; this process remembers its tokens
    compact = core.compact_handle(h)
    assert "lineage" not in compact and Handle.model_validate(compact).id == h.id
    assert core.handle_tokens(compact) == [1, 2, 8, 9]
    # handles whose tokens nobody knows are still candidates, after those known to share the prompt
    unknown = {"id": "f" * 32}
    assert core.rank_handles([unknown, dicts[0]], [1, 2, 3]) == [dicts[0], unknown]


def test_rank_for_prompt_tokenizes_only_to_choose() -> None:
    fake = Fake(tokens=[1, 2, 3])
    one, two = handle([9], "a"), handle([1, 2], "b")
    assert core.rank_for_prompt(fake, [one], [{"role": "user", "content": "x"}]) == [one]
    assert fake.calls == []  # one candidate: taken as it is
    assert core.rank_for_prompt(fake, [one, two], [{"role": "user", "content": "x"}], tools=["t"]) == [two]
    assert fake.calls == [("chat_tokens", ([{"role": "user", "content": "x"}],), {"tools": ["t"]})]
    ranked = asyncio.run(core.arank_for_prompt(AsyncEmbeddedClient(client=fake), [one, two], []))
    assert ranked == [two] and fake.names() == ["chat_tokens", "chat_tokens"]


def test_run_with_handle_falls_back_on_a_stale_handle() -> None:
    fake, stale = Fake(stale=True), []
    h = handle([1], "a")
    assert core.run_with_handle(fake, "generate", ["m"], h, agent="bob", on_stale=stale.append, max_tokens=4) == "ok"
    assert [c[2]["handle"] for c in fake.calls] == [h, None] and stale == [h]
    assert all(c[2]["agent"] == "bob" and c[2]["max_tokens"] == 4 for c in fake.calls)
    with pytest.raises(HandleReleased):  # no handle to drop: the error is the caller's
        core.run_with_handle(SimpleNamespace(generate=_released), "generate", ["m"], None)
    fake = Fake(stale=True)
    assert asyncio.run(core.arun_with_handle(fake, "generate", ["m"], h, agent="bob")) == "ok"
    assert [c[2]["handle"] for c in fake.calls] == [h, None]


def _released(messages: Any, **kwargs: Any) -> Any:
    raise HandleReleased("gone")


# -- dispatch ---------------------------------------------------------------------------------------


def test_call_and_acall_on_sync_and_async_clients() -> None:
    fake = Fake(tokens=[4])
    wrapped = AsyncEmbeddedClient(client=fake)
    assert core.sync_client(fake) is fake and core.sync_client(wrapped) is fake
    assert core.sync_client(AsyncOnly()) is None and core.sync_client(None) is None
    assert core.call(wrapped, "chat_tokens", []) == [4]  # the wrapped sync client, no event loop
    with pytest.raises(TypeError, match="async-only"):
        core.call(AsyncOnly(), "hints", {})
    with pytest.raises(AttributeError, match="no stats"):
        core.call(fake, "stats")
    assert asyncio.run(core.acall(fake, "chat_tokens", [])) == [4]  # sync: in a worker thread
    assert asyncio.run(core.acall(wrapped, "chat_tokens", [])) == [4]  # async: awaited

    async def collect() -> list[int]:
        return [x async for x in core.iterate_in_thread(iter([1, 2, 3]))]

    assert asyncio.run(collect()) == [1, 2, 3]


def test_agent_kwargs_only_where_taken() -> None:
    def tagged(messages: Any, *, agent: str | None = None) -> None: ...

    def untagged(messages: Any, **kwargs: Any) -> None: ...

    assert core.agent_kwargs(tagged, "a") == {"agent": "a"}
    assert core.agent_kwargs(untagged, "a") == {} and core.agent_kwargs(tagged, None) == {}
    assert core.agent_kwargs(Fake().generate, "a") == {"agent": "a"}


# -- agent registration -----------------------------------------------------------------------------

CHAT = [{"role": "system", "content": "You plan."}, {"role": "user", "content": "Go."}]


def test_fixed_prompt_registered_once_per_client_and_again_when_changed() -> None:
    fake = Fake()
    for _ in range(3):
        core.register_fixed_prompt(fake, "planner", CHAT)
    assert fake.calls == [("register_agent", ("planner", [CHAT[0]]), {"prefill": False})]
    assert core.registered_prompt(fake, "planner") == [CHAT[0]]
    changed = [{"role": "system", "content": "You plan.\n\ntools"}, CHAT[1]]
    core.register_fixed_prompt(fake, "planner", changed)
    core.register_fixed_prompt(Fake(), "planner", CHAT)  # another client: its own registration
    assert fake.names() == ["register_agent"] * 2 and core.registered_prompt(fake, "planner") == [changed[0]]
    # nothing to register: no agent, no leading system message
    core.register_fixed_prompt(fake, None, CHAT)
    core.register_fixed_prompt(fake, "coder", CHAT[1:])
    assert len(fake.calls) == 2


def test_registration_skips_engines_without_workflow_eviction_and_never_raises(caplog: Any) -> None:
    no_eviction = Fake(caps=SimpleNamespace(workflow_eviction=False))
    core.register_fixed_prompt(no_eviction, "a", CHAT)
    assert no_eviction.calls == []
    failing = Fake(fail=True)
    with caplog.at_level(logging.WARNING, logger="kvbaton.adapters"):
        core.register_fixed_prompt(failing, "a", CHAT)
        core.register_fixed_prompt(failing, "a", CHAT)  # not retried
    assert failing.names() == ["register_agent"] and "registering agent 'a' failed" in caplog.text
    core.register_fixed_prompt(SimpleNamespace(), "a", CHAT)  # a client that cannot register


def test_explicit_registration_is_remembered_and_raises() -> None:
    fake = Fake()
    assert core.register_agent(fake, "judge", "You judge.", prefill=True) == "judge"
    judge = [{"role": "system", "content": "You judge."}]
    assert fake.calls == [("register_agent", ("judge", judge), {"prefill": True})]
    core.register_fixed_prompt(fake, "judge", judge)
    assert len(fake.calls) == 1  # already registered with that prompt
    with pytest.raises(InvalidRequest):
        core.register_agent(Fake(fail=True), "judge", "x")
    # the async twins, through an async client
    other = Fake()
    wrapped = AsyncEmbeddedClient(client=other)
    assert asyncio.run(core.aregister_agent(wrapped, "x", [CHAT[0]])) == "x"
    asyncio.run(core.aregister_fixed_prompt(wrapped, "y", CHAT))
    asyncio.run(core.aregister_fixed_prompt(wrapped, "y", CHAT))
    assert [c[1][0] for c in other.calls] == ["x", "y"]


# -- hints ------------------------------------------------------------------------------------------


def _graph() -> StepGraph:
    graph = StepGraph()
    graph.add_entry("a")
    graph.add_edge("a", "b")
    return graph


def test_hint_sender_sync_and_async() -> None:
    fake, graph = Fake(), _graph()
    sender = core.HintSender(graph, fake)
    assert sender.send(["a"], []) is True
    assert fake.calls == [("hints", (graph,), {"running": ("a",), "finished": ()})]
    assert asyncio.run(sender.asend(["b"], ["a"])) is True  # a sync client, from a worker thread
    assert fake.calls[-1][2] == {"running": ("b",), "finished": ("a",)}
    async_sender = core.HintSender(graph, AsyncEmbeddedClient(client=fake))
    assert asyncio.run(async_sender.asend(["a"], [])) is True and len(fake.calls) == 3
    only = AsyncOnly()
    assert asyncio.run(core.HintSender(graph, only).asend(["a"], [])) is True and only.sent == (graph, ("a",), ())
    # no client yet, or disabled: nothing is sent
    assert core.HintSender(graph).send(["a"], []) is False
    assert core.HintSender(graph, fake, enabled=False).send(["a"], []) is False and len(fake.calls) == 3


def test_hint_sender_never_raises(caplog: Any) -> None:
    graph = _graph()
    failing = core.HintSender(graph, Fake(fail=True))
    with caplog.at_level(logging.WARNING, logger="kvbaton.adapters"):
        assert failing.send(["a"], []) is False
    assert "kvbaton hints failed" in caplog.text and failing.enabled  # a failure is not a verdict
    deaf = core.HintSender(graph, SimpleNamespace())  # a client without hints(): asked no more
    assert deaf.send(["a"], []) is False and not deaf.enabled
    assert asyncio.run(deaf.asend(["a"], [])) is False
