"""Schemathesis against the server's own OpenAPI schema: generated bodies, valid and invalid, for every
native endpoint. Whatever comes in, the answer is never a 5xx (a full pool, 503 ``pool_exhausted``,
is a capacity answer and allowed), and every error has the one error schema. Bounded: a fixed
number of examples per endpoint, on the secure server (max_tokens capped at 4). The OpenAI-compatible
endpoints get the same treatment."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.generation import GenerationMode
from server_fixtures import TOKEN_A

NATIVE = [
    "POST /v1/kv/materialize",
    "POST /v1/kv/extend",
    "POST /v1/kv/fork",
    "POST /v1/kv/resume",
    "POST /v1/kv/complete",
    "POST /v1/kv/generate",
    "POST /v1/kv/release",
    "POST /v1/kv/release_all",
    "GET /v1/kv/stats",
    "POST /v1/kv/tokenize",
    "POST /v1/kv/detokenize",
    "POST /v1/kv/chat_tokens",
    "POST /v1/kv/agents",
    "DELETE /v1/kv/agents",
    "POST /v1/kv/hints",
    "POST /v1/kv/compose",
    "POST /v1/kv/merge",
    "POST /v1/kv/fidelity",
    "POST /v1/kv/transfer",
    "GET /v1/kv/events",
]
# Live server-sent-event streams never end by themselves: not fuzzed request by request here
# (tests/test_events.py reads the event stream and checks its bad-input answer).
ENDLESS = {"GET /v1/kv/events/stream"}
OPENAI = ["POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "GET /v1/models/{model_id}"]
NO_INPUT = {"POST /v1/kv/release_all", "GET /v1/kv/stats", "GET /v1/models/{model_id}"}  # nothing to make invalid
EXAMPLES = {GenerationMode.POSITIVE: 20, GenerationMode.NEGATIVE: 10}
CASES = [(label, mode) for label in NATIVE + OPENAI for mode in EXAMPLES
         if not (mode is GenerationMode.NEGATIVE and label in NO_INPUT)]
AUTH = {"Authorization": f"Bearer {TOKEN_A}"}


@pytest.fixture(scope="module")
def schema(secure_server):
    yield schemathesis.openapi.from_url(f"{secure_server.url}/openapi.json", headers=AUTH)
    with secure_server.http() as http:  # drop what the fuzzer made
        http.post("/v1/kv/release_all")


def test_schema_lists_every_native_endpoint(schema):
    labels = {op.ok().label for op in schema.get_all_operations() if op.ok().path.startswith("/v1/kv/")}
    assert labels == set(NATIVE) | ENDLESS


@pytest.mark.parametrize(("label", "mode"), CASES, ids=[f"{label}-{mode}" for label, mode in CASES])
def test_fuzz_never_5xx(schema, secure_server, label, mode):
    operation = schema.find_operation_by_label(label)
    assert operation is not None
    seen: list[int] = []

    @settings(max_examples=EXAMPLES[mode], deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case) -> None:
        response = case.call(base_url=secure_server.url, headers=AUTH, timeout=60)
        seen.append(response.status_code)
        if response.status_code >= 400:
            body = response.json()
            assert set(body) == {"error"} and {"code", "message"} <= set(body["error"]), response.text
            capacity = response.status_code == 503 and body["error"]["code"] == "pool_exhausted"
            assert response.status_code < 500 or capacity, f"{label}: {response.status_code} {response.text}"

    check()
    assert seen
