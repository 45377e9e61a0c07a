"""LangChain's own standard test suites (``langchain-tests``) run against ``KvbatonChatModel``: the unit
suite (construction, standard parameters, tool binding, structured output: no I/O) and the
integration suite against one real ``kvbaton serve`` started for this module.

The capability flags say what docs/langgraph.md claims: text in, tool calling with a required
``tool_choice`` (constrained decoding), structured output by every method, JSON mode, usage metadata;
no images, audio, PDFs, Anthropic-style inputs, and no per-call model override (one model per
engine). A failure that is the served 135M model's answer (not the protocol) is marked ``xfail``
with the reason, per test; protocol failures are never marked.
"""

from __future__ import annotations

from typing import Any

import pytest
from kvbaton.adapters.langgraph import KvbatonChatModel
from kvbaton.errors import InvalidRequest, ModelNotFound
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import HumanMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests
from pydantic import BaseModel
from server_fixtures import ServerProcess, running

MODEL = "smollm2-135m-instruct"
_SERVER: dict[str, str] = {}

# The served model's answers, not the protocol: what SmolLM2-135M cannot do (each one seen failing here, and
# why). Marked xfail (not strict: a better model passes them); a protocol failure is never listed here.
_JOKE = ("model capability: SmolLM2-135M repeats itself inside the joke's strings (\"a cat is a cat and a cat is...\") "
         "until max_tokens cuts the required call, which then raises OutputParserException (issue 49 item 1)")
MODEL_CAPABILITY = {
    "test_tool_calling": "model capability: the forced call of magic_function passes {'input': 100}, not 3 "
                         "(the call itself is well formed: constrained decoding)",
    "test_tool_calling_async": "model capability: as test_tool_calling",
    "test_structured_output": _JOKE,
    "test_structured_output_async": _JOKE,
    "test_structured_output_pydantic_2_v1": _JOKE,
    "test_structured_output_optional_param": _JOKE,
    "test_json_mode": "model capability: in JSON mode the model writes valid JSON of the wrong shape "
                      "({\"setup\": {\"setup\": ...}}) instead of a joke's setup and punchline",
    "test_agent_loop": "model capability: with tool_choice auto, SmolLM2-135M answers in prose instead of calling "
                       "get_weather (docs/server.md: a small model rarely calls a tool unless it is required)",
}


class _Flags:
    """What docs/langgraph.md says KvbatonChatModel supports."""

    @property
    def chat_model_class(self) -> type[KvbatonChatModel]:
        return KvbatonChatModel

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return False  # one model per engine: a call naming another is refused (ModelNotFound)

    @property
    def supports_image_inputs(self) -> bool:
        return False  # refused with InvalidRequest, never dropped

    @property
    def supports_image_urls(self) -> bool:
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        return False

    @property
    def supports_video_inputs(self) -> bool:
        return False

    @property
    def supports_anthropic_inputs(self) -> bool:
        return False

    @property
    def supports_image_tool_message(self) -> bool:
        return False

    @property
    def supports_pdf_tool_message(self) -> bool:
        return False

    @property
    def enable_vcr_tests(self) -> bool:
        return False


@pytest.mark.unit
class TestKvbatonChatModelUnit(_Flags, ChatModelUnitTests):
    """Construction does no I/O: none of these tests connects to anything."""

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": MODEL, "base_url": "http://127.0.0.1:9"}  # a port nothing listens on: never reached

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        return {"KVBATON_URL": "http://127.0.0.1:9", "KVBATON_TOKEN": "t"}, {"model": MODEL}, {"model_name": MODEL}


@pytest.fixture(scope="module")
def kvbaton_server():
    """One real server for the integration suite, started once for this module."""
    proc = ServerProcess(["--kv-budget", "256MiB", "--max-tokens", "256", "--default-max-tokens", "64"])
    with running({"langchain-standard": proc}):
        proc.wait_healthy()
        _SERVER["url"] = proc.url
        yield proc


@pytest.mark.usefixtures("kvbaton_server")
class TestKvbatonChatModelIntegration(_Flags, ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _model_capability(self, request: pytest.FixtureRequest) -> None:
        reason = MODEL_CAPABILITY.get(request.node.originalname)
        if reason is not None:
            request.applymarker(pytest.mark.xfail(reason=reason, strict=False))

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # max_tokens 40: the suite's required calls fit; free text is cut there (it checks content, not length)
        return {"model": MODEL, "base_url": _SERVER["url"], "max_tokens": 40, "reuse": "exact"}


# -- what the standard suites do not check (issue 49 items 1-3), against the same server ----------------------


@pytest.fixture
def llm(kvbaton_server: ServerProcess) -> KvbatonChatModel:
    return KvbatonChatModel(model=MODEL, base_url=kvbaton_server.url, max_tokens=12, reuse="exact")


class Joke(BaseModel):
    """A joke to tell the user."""

    setup: str
    punchline: str


def test_a_required_call_cut_by_max_tokens_is_an_invalid_call_and_a_parsing_error(llm):
    ask = [HumanMessage("Tell me a joke about cats")]
    reply = llm.bind_tools([Joke], tool_choice="Joke").invoke(ask)
    assert reply.response_metadata["finish_reason"] == "length" and reply.content == "" and not reply.tool_calls
    [cut] = reply.invalid_tool_calls
    assert cut["name"] == "Joke" and cut["args"].startswith("{") and "max_tokens" in cut["error"]
    with pytest.raises(OutputParserException):  # never a silent None
        llm.with_structured_output(Joke).invoke(ask)
    raw = llm.with_structured_output(Joke, include_raw=True).invoke(ask)
    assert raw["parsed"] is None and isinstance(raw["parsing_error"], OutputParserException)
    chunks = list(llm.bind_tools([Joke], tool_choice="Joke").stream(ask))  # a stream yields the cut call too
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    # (a stream's call is partial by nature: LangChain reads its arguments as partial JSON)
    assert [c["name"] for c in whole.tool_calls + whole.invalid_tool_calls] == ["Joke"]
    assert whole.response_metadata["finish_reason"] == "length" and not whole.content
    with pytest.raises(OutputParserException):  # the schema on the content: cut JSON fails to parse
        llm.with_structured_output(Joke, method="json_schema").invoke(ask)


def test_content_the_model_cannot_read_is_refused_not_dropped(llm):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    for content in ([{"type": "text", "text": "What is in this picture?"}, image],
                    [{"type": "image", "source_type": "base64", "data": "iVBORw0KGgo=", "mime_type": "image/png"}]):
        with pytest.raises(InvalidRequest, match="text only") as err:
            llm.invoke([HumanMessage(content=content)])
        assert err.value.param == "messages[0].content"


@pytest.mark.unit
def test_building_a_model_does_no_io_and_follows_langchains_conventions():
    dead = "http://127.0.0.1:9"  # nothing listens there: any connection attempt would fail
    model = KvbatonChatModel(api_key="test")  # an api_key alone (the standard suites pass one): no error
    assert model._get_ls_params()["ls_provider"] == "kvbaton"
    model = KvbatonChatModel(base_url=dead, model=MODEL, timeout=5, max_retries=0)
    params = model._get_ls_params(max_tokens=7)
    assert (params["ls_provider"], params["ls_model_name"], params["ls_max_tokens"]) == ("kvbaton", MODEL, 7)
    assert model._get_ls_params(model="override")["ls_model_name"] == "override"
    with pytest.raises(ValueError, match="either client or base_url"):
        KvbatonChatModel(client=object(), base_url=dead)


def test_a_call_naming_another_model_is_refused(llm):
    with pytest.raises(ModelNotFound):
        llm.invoke("hi", model="gpt-4o")
    with pytest.raises(ModelNotFound, match="serves"):
        KvbatonChatModel(base_url=llm.base_url, model="another-model").invoke("hi")  # checked on first use


@pytest.mark.unit
def test_the_moved_connection_helpers_still_import_from_core_with_a_deprecation_warning():
    """Issue 49 item 8: ``kvbaton.adapters.core.shared_connection`` / ``register_connection`` moved to
    ``kvbaton.adapters.connections``; the old import works for one release, and says where they went."""
    from kvbaton.adapters import connections

    with pytest.warns(DeprecationWarning, match="moved to kvbaton.adapters.connections.shared_connection"):
        from kvbaton.adapters.core import shared_connection
    with pytest.warns(DeprecationWarning, match="register_connection"):
        from kvbaton.adapters.core import register_connection
    assert (shared_connection, register_connection) == (connections.shared_connection, connections.register_connection)
