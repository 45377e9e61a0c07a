"""kvbaton's one tool-call convention (``kvbaton.tools``): what a required call is, the response
format that enforces it, and how OpenAI-shaped history is written for a template without tools."""

from __future__ import annotations

import pytest
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
    with pytest.raises(InvalidRequest, match="tool_choice must be"):
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
