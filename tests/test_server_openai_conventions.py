"""The OpenAI route keeps OpenAI's and vLLM's conventions, through the real ``openai`` client against
one ``kvbaton serve`` started the way vLLM users start theirs: ``--api-key``, ``--served-model-name``,
``--chat-template``, ``--allowed-origins``, INFO logs.

A field the server cannot honour is a 400 naming it, never dropped, and every vLLM/SGLang extra at
its default is accepted; errors have OpenAI's shape, one sentence naming the field in ``param``, so
the client raises its own classes with ``code``/``param``; numbers are not read from strings;
vLLM's extras ``ignore_eos`` and ``min_tokens`` are honoured; the Responses API refuses the chat
API's fields; each session of an agent retains its own handle; one default ``max_tokens`` on every
route; the OpenAPI schema declares the answers' bodies; browsers of the allowed origins pass CORS;
the logs have one format, agree with ``usage`` and cannot be forged.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest
from kvbaton.errors import ContextTooLong, InvalidRequest, error_from_code
from server_fixtures import ServerProcess, running

API_KEY = "vllm-style-key"
ORIGIN = "https://app.example"
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
         "--stats-interval", "1", "--allowed-origins", ORIGIN],
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
    assert err.value.code == "unauthorized" and err.value.type == "invalid_request_error"  # OpenAI's type of a bad key
    assert [m.id for m in client.models.list().data] == list(NAMES)


@pytest.mark.parametrize(("route", "field", "value"), [
    ("chat", "presence_penalty", 0.5),
    ("chat", "frequency_penalty", -1.0),
    ("chat", "logit_bias", {"42": 5}),
    ("chat", "reasoning_effort", "high"),
    ("chat", "repetition_penalty", 1.3),  # vLLM's extra
    ("chat", "echo", True),
    ("chat", "frobnicate", 1),  # not a field of anybody's
    ("completion", "best_of", 3),
    ("completion", "suffix", " the end"),
    ("completion", "presence_penalty", 1.0),
    # vLLM's and SGLang's extras at a value that would change the answer
    ("chat", "skip_special_tokens", False),
    ("chat", "include_stop_str_in_output", True),
    ("chat", "add_generation_prompt", False),
    ("chat", "continue_final_message", True),
    ("chat", "stop_token_ids", [2]),
    ("chat", "guided_regex", "yes|no"),
    ("chat", "no_stop_trim", True),
    ("completion", "add_special_tokens", True),
    ("completion", "min_p", 0.1),
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


# Every extra of vLLM's and SGLang's OpenAI servers at its default (vllm/entrypoints/openai/protocol.py,
# sglang/srt/entrypoints/openai/protocol.py): the answer is the one without them.
EXTRAS_AT_DEFAULTS = {
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
    "add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False, "echo": False,
    "stop_token_ids": [], "repetition_penalty": 1.0, "min_p": 0.0, "length_penalty": 1.0, "use_beam_search": False,
    "top_k": -1, "bad_words": [], "priority": 0, "request_id": "req-1", "return_tokens_as_token_ids": False,
    "include_reasoning": True, "guided_json": None, "truncate_prompt_tokens": None, "documents": None,
    "chat_template_kwargs": None, "logits_processors": None, "cache_salt": None, "vllm_xargs": None,
    "no_stop_trim": False, "return_hidden_states": False, "separate_reasoning": True, "stream_reasoning": True,
    "rid": "r-1", "regex": None, "ebnf": None, "lora_path": None, "custom_params": None,
}


def test_every_vllm_and_sglang_extra_at_its_default_is_accepted_and_changes_nothing(client):
    plain = client.chat.completions.create(model=NAMES[0], messages=YES_OR_NO, max_tokens=4, user="extras")
    extras = client.chat.completions.create(model=NAMES[0], messages=YES_OR_NO, max_tokens=4, user="extras",
                                            extra_body=EXTRAS_AT_DEFAULTS)
    assert extras.choices[0].message.content == plain.choices[0].message.content
    completion = {k: v for k, v in EXTRAS_AT_DEFAULTS.items() if k not in ("add_generation_prompt",
                                                                            "continue_final_message")}
    done = client.completions.create(model=NAMES[0], prompt="Once upon a time", max_tokens=3, extra_body=completion)
    assert done.usage.completion_tokens <= 3
    client.delete("/sessions/extras", cast_to=object)


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"max_tokens": "3"}, "max_tokens", "Invalid type for 'max_tokens': expected an integer, but got a string"),
    ({"temperature": "0.5"}, "temperature", "expected a number, but got a string"),
    ({"n": "2"}, "n", "expected an integer, but got a string"),
    ({"stream": "true"}, "stream", "expected a boolean, but got a string"),
    ({"logprobs": 1}, "logprobs", "expected a boolean, but got an integer"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"n": 9}, "n", "limit of 8 choices"),
    ({"max_tokens": 100}, "max_tokens", "100 exceeds the server's limit of 64"),
    ({"max_completion_tokens": 100}, "max_completion_tokens", "100 exceeds the server's limit of 64"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "exceeds max_tokens 8"),
    ({"stop": 3}, "stop", "expected a string or an array of strings, but got an integer"),
    ({"stop": ["ok", 3]}, "stop[1]", "expected a string"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "expected one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]", "only text"),
    ({"messages": "hi"}, "messages", "expected an array, but got a string"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}], "tool_choice": "required"},
     "tools[0].function.parameters", "expected an object, but got an array"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters", "expected an object, but got a string"),
    ({"tool_choice": "always"}, "tool_choice", "expected one of 'none', 'auto' or 'required' or an object"),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats", "Invalid value"),
    ({"kvbaton": {"handle": 3}}, "kvbaton.handle", "expected an object or a string, but got an integer"),
    ({"kvbaton": {"bogus": 1}}, "kvbaton.bogus", "Unrecognized request argument"),
])
def test_every_400_says_in_one_sentence_what_was_wrong_and_names_the_field(client, fields, param, says):
    body = {"model": NAMES[0], "messages": YES_OR_NO, "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/chat/completions", body=body, cast_to=object)
    message = err.value.body["message"]
    assert (err.value.param, err.value.code) == (param, "invalid_request") and says in message, message
    # one sentence, no validator dump
    assert message.endswith(".") and "\n" not in message and "Input should" not in message and "type=" not in message


def test_bodies_that_are_not_unicode_json_are_400(http):
    for body in (b'{"messages": [{"role": "user", "content": "\\udc00 low"}]}',  # a lone low surrogate
                 b'{"messages": [{"role": "user", "content": "\\ud800 high"}]}',
                 json.dumps({"messages": YES_OR_NO}).encode("utf-16"),  # JSON is UTF-8
                 json.dumps({"messages": YES_OR_NO}).encode("utf-32")):
        r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
        assert r.headers.get("connection") != "close"


def test_context_overflow_is_context_length_exceeded_on_the_openai_routes(client, http):
    prompt = "word " * 9000
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAMES[0], prompt=prompt, max_tokens=1)
    assert (err.value.code, err.value.param) == ("context_length_exceeded", "prompt")  # the prompt alone is too long
    context = client.models.retrieve(NAMES[0]).model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as err:  # the prompt fits, prompt + max_tokens does not: lower it
        client.completions.create(model=NAMES[0], prompt=[42] * (context - 10), max_tokens=20)
    assert (err.value.code, err.value.param) == ("context_length_exceeded", "max_tokens")
    assert err.value.message.endswith("lower 'max_tokens'.")
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
    assert response.usage.output_tokens == chat.usage.completion_tokens  # what is returned is what is counted
    for refused, param in (({"tools": [{"type": "web_search"}]}, "tools"),
                           ({"previous_response_id": response.id}, "previous_response_id"),
                           # the chat API's fields the Responses API does not have, at any value
                           ({"n": 3}, "n"), ({"n": 1}, "n"), ({"stop": ["."]}, "stop"), ({"seed": 1}, "seed"),
                           ({"max_tokens": 5}, "max_tokens"), ({"messages": YES_OR_NO}, "messages"),
                           ({"stream_options": {"include_usage": True}}, "stream_options.include_usage")):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=NAMES[0], input="hi", extra_body=refused)
        assert err.value.param == param, refused
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


def test_logs_say_what_the_server_does(srv, client, http):
    client.chat.completions.create(model=NAMES[0], messages=YES_OR_NO, max_tokens=2, user="logs")
    client.delete("/sessions/logs", cast_to=object)
    # the access line counts what usage says: the prompt once, every choice's tokens
    two = client.chat.completions.create(model=NAMES[0], messages=YES_OR_NO, max_tokens=3, n=2, user="logs",
                                         extra_body={"ignore_eos": True})
    batch = client.completions.create(model=NAMES[0], prompt=["One, two,", "Once upon a"], max_tokens=2,
                                      extra_body={"ignore_eos": True})
    client.delete("/sessions/logs", cast_to=object)
    # a URL cannot forge a log line, with or without the token
    http.get("/v1/models%0AINFO kvbaton.access: forged%0D")
    httpx.get(f"{srv.url}/v1/models%0AINFO forged-without-token")
    http.get("/v1/models%C2%85INFO forged-by-nel%E2%80%A8INFO forged-by-ls")  # U+0085, U+2028: line breaks too
    deadline = time.monotonic() + 30  # the throughput line comes with the next interval (1 s); an access line
    waited = ("kvbaton.stats: throughput:", "forged-without-token 401",  # is written just after its answer went
              "forged-by-ls 404")
    while not all(w in srv.log.read_text(errors="replace") for w in waited) and time.monotonic() < deadline:
        time.sleep(0.2)
    log = srv.log.read_text(errors="replace")
    assert "loading the default model..." in log and "loading the default model: done in" in log
    assert f"serving {NAMES[0]} on http://127.0.0.1:{srv.port}" in log  # the served name
    assert "kvbaton.access: POST /v1/chat/completions 200" in log
    assert "prompt_tokens=" in log and "generated_tokens=2" in log
    for answer in (two, batch):
        assert (f"prompt_tokens={answer.usage.prompt_tokens} generated_tokens={answer.usage.completion_tokens}"
                in log), answer.usage
    assert "kvbaton.stats: throughput:" in log and "requests/s" in log and "prompt tokens reused" in log
    assert API_KEY not in log
    assert "GET /v1/models\\x0aINFO kvbaton.access: forged\\x0d 404" in log
    assert "GET /v1/models\\x0aINFO forged-without-token 401" in log, [l for l in log.splitlines() if "forged" in l]
    assert "GET /v1/models\\x85INFO forged-by-nel\\u2028INFO forged-by-ls 404" in log
    assert not any(line.startswith(("INFO kvbaton.access: forged", "INFO forged")) for line in log.splitlines())
    # kvbaton's and uvicorn's lines in one format
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO "
    assert re.search(stamp + r"uvicorn\.error: Application startup complete", log)
    assert re.search(stamp + r"kvbaton\.access: POST /v1/chat/completions 200", log)


def test_cors_is_opt_in_and_a_browser_preflight_passes(srv, client, secure_server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with httpx.Client(base_url=srv.url) as browser:  # a preflight carries no token
        r = browser.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        answer = browser.post("/v1/chat/completions", headers={"Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}"},
                              json={"messages": YES_OR_NO, "max_tokens": 1, "user": "cors"})
        assert answer.headers["access-control-allow-origin"] == ORIGIN
        assert "x-kvbaton-handle" in answer.headers["access-control-expose-headers"].lower()
        other = browser.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        assert browser.post("/v1/chat/completions", headers={"Origin": ORIGIN},
                            json={"messages": YES_OR_NO}).status_code == 401  # the token is still required
    client.delete("/sessions/cors", cast_to=object)
    with httpx.Client(base_url=secure_server.url) as browser:  # started without --allowed-origins: no CORS
        r = browser.options("/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers


def test_the_openapi_schema_declares_the_openai_answers_and_they_match(client, http):
    from kvbaton.backend.server import protocol as p

    schema = http.get("/openapi.json").json()
    for path, model in [("/v1/chat/completions", "ChatCompletion"), ("/v1/completions", "Completion"),
                        ("/v1/responses", "ResponseObject")]:
        ok = schema["paths"][path]["post"]["responses"]["200"]["content"]
        assert ok["application/json"]["schema"]["$ref"].endswith(f"/{model}"), path
    assert schema["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    # the real answers are what the schema says (the models refuse any field they do not declare)
    body = {"model": NAMES[0], "messages": YES_OR_NO, "max_tokens": 3, "user": "schema", "logprobs": True,
            "top_logprobs": 1}
    p.ChatCompletion.model_validate(http.post("/v1/chat/completions", json=body).json())
    with http.stream("POST", "/v1/chat/completions", json={**body, "n": 2, "stream": True,
                                                           "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and all(p.ChatCompletionChunk.model_validate(c) for c in chunks)
    p.Completion.model_validate(http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2,
                                                                    "logprobs": 1}).json())
    p.ResponseObject.model_validate(http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                                                     "user": "schema"}).json())
    p.ModelList.model_validate(http.get("/v1/models").json())
    p.ModelCard.model_validate(http.get(f"/v1/models/{NAMES[1]}").json())
    client.delete("/sessions/schema", cast_to=object)


def test_cli_usage_and_help_texts():
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvbaton.cli", *args], capture_output=True, text=True, timeout=120,
                              check=False)

    bogus = cli("serve", "--bogus")
    assert bogus.returncode == 2 and bogus.stderr.startswith("usage: kvbaton serve ")
    assert "kvbaton serve: error: unrecognized arguments: --bogus" in bogus.stderr
    for args, usage in [(("bench", "ttft", "--help"), "usage: kvbaton bench ttft "),
                        (("bench", "agents", "--help"), "usage: kvbaton bench agents "),
                        (("bench", "all", "--help"), "usage: kvbaton bench all "),
                        (("serve", "--help"), "usage: kvbaton serve "), (("dashboard", "--help"), "usage: kvbaton "),
                        (("--help",), "usage: kvbaton ")]:
        done = cli(*args)
        assert done.returncode == 0 and done.stdout.startswith(usage), args
        assert "`" not in done.stdout and ":mod:" not in done.stdout, args  # no reST markup in help


# -- model-free parts ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_field_table_refuses_what_would_be_dropped():
    from kvbaton.backend.server.openai_fields import check_fields

    check_fields({"presence_penalty": 0, "logit_bias": {}, "echo": False, "best_of": 1, "suffix": None,
                  "modalities": ["text"], "user": "u", "metadata": {}, "store": True, "tools": [],
                  "response_format": {"type": "json_object"}, "logprobs": True, "top_logprobs": 2})
    for field, value in [("presence_penalty", 0.1), ("logit_bias", {"1": 1}), ("echo", True), ("best_of", 2),
                         ("modalities", ["text", "audio"]), ("functions", []), ("guided_json", {}), ("mystery", 0),
                         ("skip_special_tokens", False), ("spaces_between_special_tokens", False),
                         ("add_generation_prompt", False), ("priority", 1), ("return_hidden_states", True)]:
        with pytest.raises(InvalidRequest) as err:
            check_fields({field: value})
        assert err.value.param == field
    check_fields({name: value for name, value in EXTRAS_AT_DEFAULTS.items() if name != "top_k"})


@pytest.mark.unit
def test_the_responses_api_refuses_the_chat_apis_fields():
    from kvbaton.backend.server.openai_fields import RESPONSES_FIELDS, check_fields

    check_fields({"user": "u", "metadata": {}, "store": False, "truncation": "disabled", "include": []},
                 RESPONSES_FIELDS)
    for field in ("n", "stop", "seed", "max_tokens", "messages", "response_format"):
        with pytest.raises(InvalidRequest, match="Responses API has no such parameter") as err:
            check_fields({field: 1}, RESPONSES_FIELDS)
        assert err.value.param == field


@pytest.mark.unit
def test_validation_errors_are_one_sentence_naming_the_field():
    from kvbaton.backend.server import protocol as p
    from kvbaton.errors import validation_error
    from pydantic import ValidationError

    def error(body: dict) -> InvalidRequest:
        with pytest.raises(ValidationError) as err:
            p.ChatCompletionRequest.model_validate(body)
        return validation_error(err.value.errors())

    missing = error({})
    assert (missing.message, missing.param) == ("Missing required parameter: 'messages'.", "messages")
    union = error({"messages": YES_OR_NO, "stop": 3.5})
    assert union.message == "Invalid type for 'stop': expected a string or an array of strings, but got a number instead."
    deeper = error({"messages": YES_OR_NO, "kvbaton": {"agent": "a" * 1000}})
    assert deeper.param == "kvbaton.agent" and deeper.message.startswith("Invalid value for 'kvbaton.agent': ")


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
