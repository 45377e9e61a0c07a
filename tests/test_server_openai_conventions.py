"""The OpenAI route keeps OpenAI's and vLLM's conventions, through the real ``openai`` client against
one ``kvbaton serve`` started the way vLLM users start theirs: ``--api-key``, ``--served-model-name``,
``--chat-template``, INFO logs.

A field the server cannot honour is a 400 naming it, never dropped; errors have OpenAI's shape, so
the client raises its own classes with ``code``/``param``; vLLM's extras ``ignore_eos`` and
``min_tokens`` are honoured; each session of an agent retains its own handle; one default
``max_tokens`` on every route.
"""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai
import pytest
from kvbaton.errors import ContextTooLong, InvalidRequest, error_from_code
from server_fixtures import ServerProcess, running

API_KEY = "vllm-style-key"
NAMES = ("smol", "kvbaton-smol")
TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou answer tersely (custom template).<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
YES_OR_NO = [{"role": "user", "content": "Reply with one word: yes or no?"}]  # greedy: "Yes." then EOS


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    proc = ServerProcess(
        ["--kv-budget", "96MiB", "--max-tokens", "64", "--default-max-tokens", "8", "--api-key", API_KEY,
         "--served-model-name", *NAMES, "--chat-template", str(template), "--log-level", "info",
         "--stats-interval", "1"],
        token=API_KEY,
    )
    with running({"conventions": proc}):
        proc.wait_healthy()
        yield proc


@pytest.fixture(scope="module")
def client(srv):
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(srv):
    with srv.http() as h:
        yield h


def test_serve_help_lists_the_new_flags():
    out = subprocess.run([sys.executable, "-m", "kvbaton.cli", "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--api-key", "--served-model-name", "--chat-template", "--stats-interval", "--default-max-tokens"):
        assert flag in out


def test_api_key_is_required(srv, client):
    with pytest.raises(openai.AuthenticationError) as err:
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert err.value.code == "unauthorized" and err.value.type == "authentication_error"
    assert [m.id for m in client.models.list().data] == list(NAMES)


@pytest.mark.parametrize(("route", "field", "value"), [
    ("chat", "presence_penalty", 0.5),
    ("chat", "frequency_penalty", -1.0),
    ("chat", "logit_bias", {"42": 5}),
    ("chat", "reasoning_effort", "high"),
    ("chat", "repetition_penalty", 1.3),  # vLLM's extra
    ("chat", "echo", True),
    ("chat", "frobnicate", 1),  # not a field of anybody's
    ("completion", "echo", True),
    ("completion", "best_of", 3),
    ("completion", "suffix", " the end"),
    ("completion", "presence_penalty", 1.0),
])
def test_unsupported_fields_are_400_naming_them(client, route, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        if route == "chat":
            client.chat.completions.create(model=NAMES[0], messages=YES_OR_NO, max_tokens=2, extra_body={field: value})
        else:
            client.completions.create(model=NAMES[0], prompt="Once upon a time", max_tokens=2,
                                      extra_body={field: value})
    assert err.value.status_code == 400
    assert (err.value.param, err.value.code, err.value.type) == (field, "invalid_request", "invalid_request_error")
    assert repr(field) in err.value.message


def test_fields_at_their_no_op_value_and_harmless_fields_are_accepted(client):
    answer = client.chat.completions.create(
        model=NAMES[1], messages=YES_OR_NO, max_tokens=2, presence_penalty=0, frequency_penalty=0, logit_bias={},
        user="someone", metadata={"run": "1"}, store=False, service_tier="auto",
    )
    assert answer.model == NAMES[1] and answer.usage.completion_tokens <= 2  # the served name asked for
    client.delete(f"/sessions/{'someone'}", cast_to=object)


def test_context_overflow_is_context_length_exceeded_on_the_openai_routes(client, http):
    prompt = "word " * 9000
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAMES[0], prompt=prompt, max_tokens=1)
    assert err.value.code == "context_length_exceeded" and err.value.param is None
    native = http.post("/v1/kv/complete", json={"prompt": prompt, "max_tokens": 1}).json()
    assert native["error"]["code"] == "context_too_long"  # the SDK's ContextTooLong, as before


def test_models_by_name(client):
    assert client.models.retrieve(NAMES[1]).id == NAMES[1]
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert (err.value.code, err.value.param) == ("model_not_found", "model")


def test_responses_api_is_a_chat_completion_in_another_shape(client):
    response = client.responses.create(model=NAMES[0], input="Reply with one word: yes or no?", user="responses")
    chat = client.chat.completions.create(model=NAMES[0], messages=YES_OR_NO, user="responses-chat")
    assert response.status == "completed" and response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    cut = client.responses.create(model=NAMES[0], max_output_tokens=3, user="responses",
                                  input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hi"}]}],
                                  instructions="Greet at length.", extra_body={"ignore_eos": True})
    assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert cut.usage.output_tokens == 3
    for refused, param in (({"stream": True}, "stream"), ({"tools": [{"type": "web_search"}]}, "tools"),
                           ({"previous_response_id": response.id}, "previous_response_id")):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=NAMES[0], input="hi", extra_body=refused)
        assert err.value.param == param
    for session in ("responses", "responses-chat"):
        client.delete(f"/sessions/{session}", cast_to=object)


def test_chat_template_renders_every_chat_path(client, http):
    tokens = http.post("/v1/kv/chat_tokens", json={"messages": YES_OR_NO}).json()["token_ids"]
    text = http.post("/v1/kv/detokenize", json={"token_ids": tokens}).json()["text"]
    assert "custom template" in text
    answer = client.chat.completions.create(model=NAMES[0], messages=YES_OR_NO, max_tokens=1, user="template")
    assert answer.usage.prompt_tokens == len(tokens)  # the OpenAI route rendered the same template
    client.delete("/sessions/template", cast_to=object)


def test_ignore_eos_and_min_tokens_generate_exactly_n(client):
    natural = client.chat.completions.create(model=NAMES[0], messages=YES_OR_NO, max_tokens=12, user="eos")
    assert natural.choices[0].finish_reason == "stop" and natural.usage.completion_tokens < 12
    for extra in ({"ignore_eos": True}, {"min_tokens": 12}, {"kvbaton": {"ignore_eos": True}},
                  {"kvbaton": {"min_tokens": 12}}):
        chat = client.chat.completions.create(model=NAMES[0], messages=YES_OR_NO, max_tokens=12, user="eos",
                                              extra_body=extra)
        assert (chat.usage.completion_tokens, chat.choices[0].finish_reason) == (12, "length"), extra
    prompt = "<|im_start|>user\nReply with one word: yes or no?<|im_end|>\n<|im_start|>assistant\n"
    done = client.completions.create(model=NAMES[0], prompt=prompt, max_tokens=12)
    assert done.choices[0].finish_reason == "stop"
    for extra in ({"ignore_eos": True}, {"min_tokens": 12}):
        completion = client.completions.create(model=NAMES[0], prompt=prompt, max_tokens=12, extra_body=extra)
        assert completion.usage.completion_tokens == 12, extra
    with pytest.raises(openai.BadRequestError) as err:  # given twice, differently
        client.completions.create(model=NAMES[0], prompt=prompt, max_tokens=12,
                                  extra_body={"min_tokens": 2, "kvbaton": {"min_tokens": 3}})
    assert err.value.param == "min_tokens"
    with pytest.raises(openai.BadRequestError) as err:  # more than max_tokens (here the server's default, 8)
        client.completions.create(model=NAMES[0], prompt=prompt, extra_body={"min_tokens": 9})
    assert err.value.param == "min_tokens" and "exceeds max_tokens 8" in err.value.message
    client.delete("/sessions/eos", cast_to=object)


def test_one_default_max_tokens_on_every_route(client, http):
    native = http.post("/v1/kv/complete", json={"prompt": "Once upon a time", "ignore_eos": True}).json()
    http.post("/v1/kv/release", json={"handles": [native["handle"]["id"]]})
    chat = client.chat.completions.create(model=NAMES[0], messages=YES_OR_NO, user="default",
                                          extra_body={"ignore_eos": True})
    assert native["timings"]["tokens_generated"] == chat.usage.completion_tokens == 8  # --default-max-tokens
    client.delete("/sessions/default", cast_to=object)


def _chat(http: httpx.Client, session: str, text: str, **headers: str) -> dict:
    body = {"model": NAMES[0], "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=body, headers={"X-Kvbaton-Agent": "writer", **headers,
                                                               "X-Kvbaton-Session": session})
    assert r.status_code == 200, r.text
    return r.json()


def test_sessions_of_one_agent_keep_separate_handles(client, http):
    first = _chat(http, "s1", "Write one line about rivers.")["kvbaton"]["handle"]
    second = _chat(http, "s2", "Write one line about mountains.")["kvbaton"]["handle"]
    # The same agent in another session did not replace (and release) the first session's handle.
    for h in (first, second):
        forks = http.post("/v1/kv/fork", json={"handle": h, "k": 2})
        assert forks.status_code == 200, forks.text
        http.post("/v1/kv/release", json={"handles": [f["id"] for f in forks.json()["handles"]]})
    # Deleting a session releases what it retained, and only that.
    assert http.delete("/v1/sessions/s1").json() == {"session": "s1", "released": 1}
    assert http.post("/v1/kv/fork", json={"handle": first}).json()["error"]["code"] == "handle_released"
    assert http.delete("/v1/sessions/s1").json()["released"] == 0
    forks = http.post("/v1/kv/fork", json={"handle": second})
    assert forks.status_code == 200
    http.post("/v1/kv/release", json={"handles": [f["id"] for f in forks.json()["handles"]]})
    assert http.delete("/v1/sessions/s2").json()["released"] == 1


def test_session_from_the_body_or_the_user_field(client, http):
    by_body = client.chat.completions.create(model=NAMES[0], messages=YES_OR_NO, max_tokens=1,
                                             extra_body={"kvbaton": {"session": "from-body", "agent": "a"}})
    by_user = client.chat.completions.create(model=NAMES[0], messages=YES_OR_NO, max_tokens=1, user="alice",
                                             extra_body={"kvbaton": {"agent": "a"}})
    assert by_body.model_extra["kvbaton"]["handle"] != by_user.model_extra["kvbaton"]["handle"]
    assert http.delete("/v1/sessions/from-body").json()["released"] == 1
    assert http.delete("/v1/sessions/alice").json()["released"] == 1


def test_logs_say_what_the_server_does(srv, client):
    client.chat.completions.create(model=NAMES[0], messages=YES_OR_NO, max_tokens=2, user="logs")
    client.delete("/sessions/logs", cast_to=object)
    deadline = time.monotonic() + 30  # the throughput line comes with the next interval (1 s)
    while "kvbaton.stats: throughput:" not in srv.log.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.2)
    log = srv.log.read_text(errors="replace")
    assert "loading the default model..." in log and "loading the default model: done in" in log
    assert "kvbaton.access: POST /v1/chat/completions 200" in log
    assert "prompt_tokens=" in log and "generated_tokens=2" in log
    assert "kvbaton.stats: throughput:" in log and "requests/s" in log and "prompt tokens reused" in log
    assert API_KEY not in log


# -- model-free parts ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_field_table_refuses_what_would_be_dropped():
    from kvbaton.backend.server.openai_fields import check_fields

    check_fields({"presence_penalty": 0, "logit_bias": {}, "echo": False, "best_of": 1, "suffix": None,
                  "modalities": ["text"], "user": "u", "metadata": {}, "store": True, "tools": [],
                  "response_format": {"type": "json_object"}, "logprobs": True, "top_logprobs": 2})
    for field, value in [("presence_penalty", 0.1), ("logit_bias", {"1": 1}), ("echo", True), ("best_of", 2),
                         ("modalities", ["text", "audio"]), ("functions", []), ("guided_json", {}), ("mystery", 0)]:
        with pytest.raises(InvalidRequest) as err:
            check_fields({field: value})
        assert err.value.param == field


@pytest.mark.unit
def test_sessions_are_slots_of_their_own():
    from kvbaton.backend.server.tenancy import AgentSlots

    slots = AgentSlots(max_slots=8)
    slots.slot(("t", "s1", "writer")).replace("h1")
    slots.slot(("t", "s2", "writer")).replace("h2")
    slots.slot(("u", "s1", "writer")).replace("h3")  # another tenant's session of the same name
    assert [s.handle_id for s in slots.session("t", "s1")] == ["h1"]
    assert slots.slot(("t", "s2", "writer")).handle_id == "h2"
    assert slots.slot(("u", "s1", "writer")).handle_id == "h3"
    slots.forget({"h2"})  # its handle expired (TTL): the session's slot ends with it
    assert slots.session("t", "s2") == []


@pytest.mark.unit
def test_openai_codes_map_back_to_the_sdk_errors():
    err = error_from_code("context_length_exceeded", "too long", "messages")
    assert isinstance(err, ContextTooLong) and err.param == "messages"


@pytest.mark.unit
def test_tokens_from_the_environment():
    from kvbaton.serverconf import env_tokens

    assert env_tokens({"KVBATON_API_KEY": "k1, k2"}) == ["k1", "k2"]
    assert env_tokens({"KVBATON_TOKEN": "t", "KVBATON_API_KEY": "k"}) == ["t"]  # kvbaton's own name first
    assert env_tokens({}) == []


def test_a_session_is_its_tenants_own(secure_server):
    from server_fixtures import TOKEN_B

    body = {"messages": YES_OR_NO, "max_tokens": 1}
    with secure_server.http() as a, secure_server.http(TOKEN_B) as b:
        held = a.post("/v1/chat/completions", json=body, headers={"X-Kvbaton-Session": "shared-name"}).json()
        assert b.delete("/v1/sessions/shared-name").json()["released"] == 0  # another tenant's session of that name
        assert a.post("/v1/kv/fork", json={"handle": held["kvbaton"]["handle"], "k": 2}).status_code == 200
        a.post("/v1/kv/release_all")
        assert a.delete("/v1/sessions/shared-name").json()["released"] == 0  # release_all took it already
