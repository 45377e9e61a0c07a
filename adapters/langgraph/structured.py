"""``KvbatonChatModel.with_structured_output``: answers parsed into a schema, by one of three methods.

- ``function_calling`` (the default, as LangChain's): the schema is a tool the answer must call
  (``tool_choice`` required: constrained decoding writes exactly one call), parsed by LangChain's
  tool parsers;
- ``json_schema``: the schema enforced on the answer's content by constrained decoding
  (``response_format`` ``json_schema``), the content parsed as JSON;
- ``json_mode``: any JSON object (``response_format`` ``json_object``), parsed as JSON.

Invariants: an answer cut short by ``max_tokens`` is never a silent ``None``: a required call cut
short is an invalid tool call whose arguments LangChain's parsers refuse, a cut JSON content fails
to parse — both raise ``OutputParserException`` (with ``include_raw``, in ``parsing_error``).
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

METHODS = ("function_calling", "json_schema", "json_mode")


def structured_output(model: BaseChatModel, schema: Any, *, include_raw: bool, method: str,
                      **kwargs: Any) -> Runnable[Any, Any]:
    """The runnable of ``model.with_structured_output(schema, method=...)`` (module docstring)."""
    if kwargs:
        raise ValueError(f"Received unsupported arguments {kwargs}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    traced = {"kwargs": {"method": method}, "schema": schema}
    if method == "function_calling":
        name = convert_to_openai_tool(schema)["function"]["name"]
        llm = model.bind_tools([schema], tool_choice=name, ls_structured_output_format=traced)
        parser: Runnable[Any, Any] = (PydanticToolsParser(tools=[schema], first_tool_only=True) if pydantic
                                      else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
    else:
        if method == "json_schema":
            json_schema = convert_to_json_schema(schema)
            fmt = {"type": "json_schema",
                   "json_schema": {"name": json_schema.get("title", "output"), "schema": json_schema, "strict": True}}
        else:
            fmt = {"type": "json_object"}
        llm = model.bind(response_format=fmt, ls_structured_output_format=traced)
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
    if not include_raw:
        return llm | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    fallback = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")
