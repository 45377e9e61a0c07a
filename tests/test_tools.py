"""kvbaton's one tool-call convention (``kvbaton.tools``): what a required call is, the response
format that enforces it, and how OpenAI-shaped history is written for a template without tools; the
call formats of the models the docs name (Hermes, Llama 3 JSON, Mistral), parsed whole and streamed
(``server/openai_tools``: the streamed deltas add up to the whole answer's calls)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvbaton import InvalidRequest, ResponseFormat, SamplingParams
from kvbaton.tools import parse_tool_calls, required_tools, template_messages, tool_call_format

pytestmark = pytest.mark.unit

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
NOW = {"type": "function", "function": {"name": "now"}}


def test_tool_choice_says_which_tools_an_answer_must_call():
    assert required_tools([ADD, NOW], None) is None and required_tools([ADD], "auto") is None
    assert required_tools([ADD, NOW], "none") is None
    assert required_tools([ADD, NOW], "required") == [ADD, NOW]
    assert required_tools([ADD, NOW], {"type": "function", "function": {"name": "now"}}) == [NOW]
    with pytest.raises(InvalidRequest, match="not one of the tools"):
        required_tools([ADD], {"type": "function", "function": {"name": "sub"}})
    with pytest.raises(InvalidRequest, match="requires tools"):
        required_tools(None, "required")
    with pytest.raises(InvalidRequest, match="it must be .none., .auto., .required."):
        required_tools([ADD], "always")


def test_a_required_call_is_one_json_call_of_an_allowed_tool_with_only_its_parameters():
    one = tool_call_format([ADD]).json_schema["schema"]
    assert one["properties"]["name"] == {"const": "add"} and one["required"] == ["name", "arguments"]
    assert one["properties"]["arguments"]["additionalProperties"] is False
    assert ADD["function"]["parameters"].get("additionalProperties") is None  # the caller's schema is untouched
    either = tool_call_format([ADD, NOW]).json_schema["schema"]
    assert [o["properties"]["name"]["const"] for o in either["anyOf"]] == ["add", "now"]
    assert either["anyOf"][1]["properties"]["arguments"] == {"type": "object", "properties": {},
                                                             "additionalProperties": False}
    # what the format produces is what the parser reads
    [call] = parse_tool_calls('{"name":"add","arguments":{"a":1,"b":2}}', ["add", "now"])[1]
    assert (call.name, call.arguments) == ("add", {"a": 1, "b": 2})


def test_openai_history_is_written_in_the_convention():
    history = [
        {"role": "system", "content": "Be terse."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    system, call, result = template_messages(history, [ADD])
    assert system["content"].startswith("Be terse.\n\nYou can call these tools:\n<tools>\n")
    assert call == {"role": "assistant",
                    "content": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'}
    assert result == {"role": "tool", "content": "<tool_response>3</tool_response>"}
    with pytest.raises(InvalidRequest):
        template_messages([{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}], None)


def test_response_formats_and_logprob_options_are_validated():
    with pytest.raises(ValueError, match="json_schema is required"):
        ResponseFormat(type="json_schema")
    with pytest.raises(ValueError, match="only with it"):
        ResponseFormat(type="json_object", json_schema={"schema": {}})
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        SamplingParams(top_logprobs=1)
    with pytest.raises(ValueError):
        SamplingParams(logprobs=True, top_logprobs=21)
    assert SamplingParams(response_format={"type": "json_object"}).response_format == ResponseFormat(type="json_object")


# -- the formats of the models the docs name, whole and streamed --------------------------------------

NAMES = ["add", "now"]


@pytest.mark.parametrize(("text", "calls", "rest"), [
    # Hermes (kvbaton's convention, Qwen)
    ('Sure.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', [("add", {"a": 1})], "Sure."),
    # Llama 3 JSON: "parameters", several separated by ";", after <|python_tag|> when it is text
    ('{"name": "add", "parameters": {"a": 1}}', [("add", {"a": 1})], ""),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "now", "parameters": {}}',
     [("add", {"a": 1}), ("now", {})], ""),
    # Mistral: [TOOL_CALLS] and a list (the marker is gone when special tokens are skipped)
    ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 2}}, {"name": "now", "arguments": {}}]',
     [("add", {"a": 2}), ("now", {})], ""),
    ('[{"name": "add", "arguments": {"a": 2}}]', [("add", {"a": 2})], ""),
    # text after the calls is the answer's content
    ('{"name": "add", "arguments": {"a": 1}} Done.', [("add", {"a": 1})], "Done."),
])
def test_every_named_models_tool_call_format_parses(text, calls, rest):
    content, parsed = parse_tool_calls(text, NAMES)
    assert [(c.name, c.arguments) for c in parsed] == calls and content == rest


def _streamed(text: str, cuts: list[int], forced: str | None = None) -> tuple[str, list[tuple[str, dict]], int]:
    """Feed ``text`` cut at ``cuts`` to a ToolCallStream: its content, calls, and argument pieces."""
    import json

    from kvbaton.backend.server.openai_tools import ToolCallStream

    stream, deltas, at = ToolCallStream(NAMES, forced), [], 0
    for cut in [*sorted(cuts), len(text)]:
        deltas += stream.feed(text[at:cut])
        at = cut
    deltas += stream.finish()
    calls: dict[int, list[str]] = {}
    pieces = 0
    for d in deltas:
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], [c["function"].get("name") or "", ""])
            entry[1] += c["function"].get("arguments", "")
            pieces += bool(c["function"].get("arguments"))
    content = "".join(d.get("content", "") for d in deltas)
    return content, [(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))], pieces


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(args=st.dictionaries(st.text(min_size=1, max_size=6), _JSON, max_size=4), data=st.data(),
       form=st.sampled_from(["hermes", "json", "llama", "mistral", "text+hermes"]),
       ascii_only=st.booleans())
def test_streamed_tool_calls_add_up_to_the_whole_answer(args, data, form, ascii_only):
    import json

    call = json.dumps({"name": "add", "arguments": args}, ensure_ascii=ascii_only)
    text = {"hermes": f"<tool_call>\n{call}\n</tool_call>", "json": call,
            "llama": f"<|python_tag|>{call.replace('arguments', 'parameters', 1)}",
            "mistral": f"[TOOL_CALLS][{call}]", "text+hermes": f"Let me see.\n<tool_call>{call}</tool_call>"}[form]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    content, calls, _ = _streamed(text, cuts)
    whole_content, whole_calls = parse_tool_calls(text, NAMES)
    assert calls == [(c.name, c.arguments) for c in whole_calls] == [("add", args)]
    assert content.strip() == whole_content.strip()


def test_prose_streams_as_content_and_a_call_streams_piece_by_piece():
    prose = "It is sunny, <tool there and <tool_call is not a tag."
    assert _streamed(prose, list(range(len(prose))))[:2] == (prose, [])
    call = '{"name": "add", "arguments": {"a": 1234, "b": "a long string value"}}'
    content, calls, pieces = _streamed(call, list(range(len(call))))
    assert content == "" and calls == [("add", {"a": 1234, "b": "a long string value"})] and pieces > 10
    unknown = '{"name": "rm_rf", "arguments": {}}'  # no tool's: the whole reply is content, as the whole answer says
    assert _streamed(unknown, list(range(len(unknown))))[:2] == (unknown, [])
