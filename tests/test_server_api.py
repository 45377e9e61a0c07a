"""The native API over a real ``kvbaton serve`` process: SDK round trips, exactness against the
embedded engine, the error schema of every error path, OpenAI-compatible endpoints, metrics."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import kvbaton
import pytest
from kvbaton import (
    ContextTooLong,
    HandleNotFound,
    HandleReleased,
    IncompatibleHandle,
    InvalidRequest,
)
from kvbaton.embedded import EmbeddedClient
from kvbaton.errors import PayloadTooLarge
from kvbaton.http import AsyncHttpClient, HttpClient

CONTEXT = "The meeting notes: the blue team shipped the parser, the red team fixed three bugs."
QUESTION = "\nQuestion: which team fixed bugs?\nAnswer:"


@pytest.fixture(scope="module")
def local() -> EmbeddedClient:
    """The embedded reference: same model, same code, in this process (one engine for the module)."""
    from kvbaton.backend import Engine

    engine = Engine(kv_budget="64MiB")
    yield EmbeddedClient(engine=engine)
    engine.close()


@pytest.fixture
def client(server) -> HttpClient:
    with kvbaton.connect(server.url, timeout=60) as c:
        yield c


def test_connect_returns_http_client(server):
    with kvbaton.connect(server.url) as c:
        assert isinstance(c, HttpClient)
        assert c.health()["status"] == "ok"
    with pytest.raises(InvalidRequest, match="embedded engine"):
        kvbaton.connect(server.url, kv_budget="1GiB")


def test_round_trip_matches_embedded_engine(client, local):
    engine = local
    ctx, q = engine.tokenize(CONTEXT), engine.tokenize(QUESTION)
    assert client.tokenize(CONTEXT) == ctx
    assert client.detokenize(ctx) == engine.detokenize(ctx)

    notes = client.materialize(ctx)
    assert notes.num_tokens == len(ctx) and notes.token_ids() == ctx
    a, b = client.fork(notes, 2)
    remote = client.resume(a, q, max_tokens=8)
    local = engine.resume(engine.materialize(ctx), q, max_tokens=8)
    assert remote.token_ids == local.token_ids and remote.text == local.text
    assert remote.timings.tokens_reused == len(ctx) and remote.timings.tokens_prefilled == len(q)

    # streaming gives the same tokens, in chunks, and a Result at the end
    stream = client.resume_stream(b, q, max_tokens=8)
    chunks = list(stream)
    assert [t for c in chunks for t in c.token_ids] == local.token_ids
    assert "".join(c.text for c in chunks) == local.text
    assert stream.result is not None and stream.result.token_ids == local.token_ids

    # a Handle object (checked for compatibility server-side) works like its id
    more = client.extend(notes, q)
    assert more.num_tokens == len(ctx) + len(q)
    client.release([notes, a, b, remote.handle, stream.result.handle, more])
    with pytest.raises(HandleReleased):
        client.resume(a, q)


def test_generate_complete_and_chat_tokens(client, local):
    engine = local
    messages = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "Who fixed bugs?"}]
    assert client.chat_tokens(messages) == engine.chat_tokens(messages)
    shared = client.materialize(client.chat_tokens(messages[:1], add_generation_prompt=False))
    res = client.generate(messages, handle=shared, max_tokens=6)
    assert res.token_ids == engine.generate(messages, max_tokens=6).token_ids
    assert res.timings.tokens_reused >= shared.num_tokens - 1
    done = client.complete("The capital of France is", max_tokens=4)
    assert done.token_ids == engine.complete("The capital of France is", max_tokens=4).token_ids
    client.release([shared, res.handle, done.handle])


def test_async_client(server, local):
    engine = local
    ctx = engine.tokenize(CONTEXT)
    expected = engine.resume(engine.materialize(ctx), QUESTION, max_tokens=5).token_ids

    async def main() -> None:
        async with await kvbaton.aconnect(server.url) as c:
            assert isinstance(c, AsyncHttpClient)
            h = await c.materialize(ctx)
            res = await c.resume(h, QUESTION, max_tokens=5)
            stream = await c.resume_stream(h, QUESTION, max_tokens=5)
            texts = [chunk.text async for chunk in stream]
            assert stream.result is not None and stream.result.token_ids == res.token_ids == expected
            assert "".join(texts) == res.text
            with pytest.raises(HandleNotFound):
                await c.fork("f" * 32)
            await c.release([h, res.handle, stream.result.handle])

    asyncio.run(main())


def test_typed_errors_through_the_sdk(client):
    with pytest.raises(HandleNotFound):
        client.resume("0" * 32, "x")
    with pytest.raises(HandleNotFound):
        client.resume_stream("0" * 32, "x")  # raised at the call, as embedded
    h = client.materialize("Some context.")
    foreign = h.model_copy(update={"model_fingerprint": "f" * 32})
    with pytest.raises(IncompatibleHandle):
        client.fork(foreign)
    with pytest.raises(ContextTooLong):
        client.materialize(list(range(1, 9000)))
    with pytest.raises(InvalidRequest, match="limit"):
        client.resume(h, "x", max_tokens=65)  # server cap
    with pytest.raises(InvalidRequest):
        client.resume(h, "x", temperature=-1)  # validated client-side, same error as embedded
    with pytest.raises(InvalidRequest, match="can never fit"):  # larger than the whole pool: 400, not retry later
        client.materialize(list(range(1, 4000)))
    with pytest.raises(PayloadTooLarge):
        client.materialize("word " * 2_000_000)
    client.release(h)
    with pytest.raises(HandleReleased):
        client.release(h)


def _error(response: httpx.Response) -> tuple[int, str]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "type", "param"}, body
    assert body["error"]["message"]
    return response.status_code, body["error"]["code"]


def test_error_schema_and_status_codes(server):
    with server.http() as http:
        h = http.post("/v1/kv/materialize", json={"context": "Some context."}).json()
        gone = http.post("/v1/kv/materialize", json={"context": "Other."}).json()
        assert http.post("/v1/kv/release", json={"handles": [gone["id"]]}).status_code == 200
        cases = [
            (("POST", "/v1/kv/resume", {"handle": "0" * 32}), 404, "handle_not_found"),
            (("POST", "/v1/kv/fork", {"handle": "not-an-id"}), 404, "handle_not_found"),
            (("POST", "/v1/kv/resume", {"handle": gone["id"], "max_tokens": 2}), 410, "handle_released"),
            (("POST", "/v1/kv/release", {"handles": [gone["id"]]}), 410, "handle_released"),
            (("POST", "/v1/kv/fork", {"handle": {**h, "tokenizer_fingerprint": "0" * 32}}), 409, "incompatible_handle"),
            (("POST", "/v1/kv/resume", {"handle": h["id"], "temperature": -1}), 400, "invalid_request"),
            (("POST", "/v1/kv/resume", {"handle": h["id"], "top_p": 0}), 400, "invalid_request"),
            (("POST", "/v1/kv/resume", {"handle": h["id"], "stop": [""]}), 400, "invalid_request"),
            (("POST", "/v1/kv/resume", {"handle": h["id"], "max_tokens": 10_000}), 400, "invalid_request"),
            (("POST", "/v1/kv/resume", {"handle": h["id"], "bogus": 1}), 400, "invalid_request"),
            (("POST", "/v1/kv/fork", {"handle": h["id"], "k": 0}), 400, "invalid_request"),
            (("POST", "/v1/kv/materialize", {"context": ""}), 400, "invalid_request"),
            (("POST", "/v1/kv/materialize", {"context": [10**9]}), 400, "invalid_request"),
            (("POST", "/v1/kv/materialize", {"context": list(range(1, 9000))}), 400, "context_too_long"),
            (("POST", "/v1/kv/resume", {"handle": h["id"], "suffix": list(range(1, 8200)), "max_tokens": 4}),
             400, "context_too_long"),
            # larger than the whole 96 MiB pool: never fits, so 400, not 503 "retry later"
            (("POST", "/v1/kv/materialize", {"context": list(range(1, 4000))}), 400, "invalid_request"),
            (("POST", "/v1/kv/generate", {"messages": [{"role": "wizard", "content": "x"}]}), 400, "invalid_request"),
            (("POST", "/v1/kv/generate", {"messages": []}), 400, "invalid_request"),
            (("POST", "/v1/kv/tokenize", {"text": 3}), 400, "invalid_request"),
            (("GET", "/v1/kv/nothing-here", None), 404, "not_found"),
            (("GET", "/v1/kv/materialize", None), 405, "method_not_allowed"),
            (("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 99}),
             400, "invalid_request"),
            (("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
             400, "invalid_request"),
        ]
        for (method, path, body), status, code in cases:
            response = http.request(method, path, json=body)
            assert _error(response) == (status, code), (path, body, response.text)

        raw = [
            b'{"context": ',                      # malformed JSON
            b"[1, 2]",                           # not an object
            b'{"context": "a\\ud800b"}',         # lone surrogate
            b"\xff\xfe garbage",                 # not UTF-8
        ]
        for body in raw:
            response = http.post("/v1/kv/materialize", content=body, headers={"content-type": "application/json"})
            assert _error(response) == (400, "invalid_request"), (body, response.text)
        big = http.post("/v1/kv/materialize", content=b"x" * (9 * 1024 * 1024))
        assert _error(big) == (413, "payload_too_large")
        # streams report admission errors as HTTP errors, before any event
        response = http.post("/v1/kv/resume", json={"handle": "0" * 32, "stream": True})
        assert _error(response) == (404, "handle_not_found")
        http.post("/v1/kv/release", json={"handles": [h["id"]]})


def test_health_metrics_and_stats(server):
    with server.http() as http:
        assert http.get("/health").json()["status"] == "ok"
        h = http.post("/v1/kv/materialize", json={"context": "Metrics context."}).json()
        res = http.post("/v1/kv/resume", json={"handle": h["id"], "suffix": " more", "max_tokens": 2}).json()
        stats = http.get("/v1/kv/stats").json()
        assert stats["handles_live"] >= 2 and stats["blocks_used"] >= 1
        http.post("/v1/kv/release", json={"handles": [h["id"], res["handle"]["id"]]})
        text = http.get("/metrics").text
    assert 'kvbaton_requests_total{endpoint="/v1/kv/materialize",method="POST",status="200"}' in text
    assert 'kvbaton_ttft_seconds_bucket{endpoint="/v1/kv/resume"' in text
    assert 'kvbaton_prompt_tokens_total{endpoint="/v1/kv/resume",source="reused"}' in text
    assert 'kvbaton_pool_blocks{state="used"}' in text
    assert "kvbaton_handles_live" in text


def test_openai_chat_completions_raw(server):
    messages = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "Who shipped the parser?"}]
    with server.http() as http:
        models = http.get("/v1/models").json()
        model = models["data"][0]["id"]
        body = {"model": model, "messages": messages, "max_tokens": 4, "kvbaton": {"agent": "raw", "step": 1}}
        first = http.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        one = first.json()
        assert one["object"] == "chat.completion" and one["choices"][0]["message"]["role"] == "assistant"
        handle = one["kvbaton"]["handle"]
        assert first.headers["x-kvbaton-handle"] == handle and one["kvbaton"]["step"] == 1
        usage = one["usage"]
        assert usage["completion_tokens"] <= 4 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

        # the agent's next turn reuses its previous handle: the whole earlier prompt is cached
        turn = messages + [one["choices"][0]["message"], {"role": "user", "content": "And the bugs?"}]
        second = http.post("/v1/chat/completions", json={**body, "messages": turn}).json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"]
        # ...and the previous handle was released (one retained handle per agent)
        assert http.post("/v1/kv/fork", json={"handle": handle}).status_code == 410

        # an explicit handle (extra_body kvbaton.handle), kept for the caller
        shared = http.post("/v1/kv/chat_tokens", json={"messages": messages[:1], "add_generation_prompt": False}).json()
        h = http.post("/v1/kv/materialize", json={"context": shared["token_ids"]}).json()
        kept = http.post("/v1/chat/completions", json={
            "messages": messages, "max_completion_tokens": 3, "n": 2, "seed": 1, "stop": ["\n"],
            "kvbaton": {"handle": h["id"], "keep": True},
        }).json()
        assert len(kept["choices"]) == 2 and kept["usage"]["prompt_tokens_details"]["cached_tokens"] >= h["num_tokens"]
        assert all(kept["kvbaton"]["handles"])
        http.post("/v1/kv/release", json={"handles": [h["id"], *kept["kvbaton"]["handles"]]})

        # streaming: role chunk, content chunks, finish chunk with the handle, usage chunk, [DONE]
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                               "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["usage"]["completion_tokens"] >= 1 and chunks[-1]["kvbaton"]["handle"]
        assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)

        completion = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3}).json()
        assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] <= 3
        assert http.post("/v1/kv/release_all").status_code == 200


def test_closing_a_stream_early_frees_the_request(server):
    with server.http() as http:
        assert http.post("/v1/kv/release_all").status_code == 200
    with kvbaton.connect(server.url) as client:
        h = client.materialize("A context to resume from, a few tokens long.")
        base = client.stats()
        stream = client.resume_stream(h, " Then", max_tokens=64, ignore_eos=True)
        next(stream)
        assert client.stats().blocks_used > base.blocks_used  # the request holds its blocks
        stream.close()  # drops the connection: the server cancels the generation
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            now = client.stats()
            if now.handles_live == base.handles_live and now.blocks_used - now.blocks_cache_only <= base.blocks_used:
                break
            time.sleep(0.1)
        assert now.handles_live == base.handles_live == 1
        assert now.blocks_used - now.blocks_cache_only <= base.blocks_used
        client.release(h)


def test_sampling_fields_match_the_sdk():
    from kvbaton.types import SamplingParams
    from kvbaton.wire import Sampling

    assert set(Sampling.model_fields) - {"stream"} == set(SamplingParams.model_fields)
    assert Sampling().sampling_fields() == SamplingParams().model_dump()


def test_create_app_takes_an_engine_or_an_embedded_client(local):
    from kvbaton.backend.server import create_app

    assert create_app(local).state.kvbaton.engine is local.engine
    with pytest.raises(TypeError, match="EngineOps"):
        create_app(object())


def test_async_embedded_client_has_the_same_shape(local):
    engine = local.engine
    from kvbaton import AsyncClient
    from kvbaton.embedded import AsyncEmbeddedClient

    abstract = {n for n in dir(AsyncClient) if not n.startswith("_")}
    assert abstract == {n for n in dir(kvbaton.Client) if not n.startswith("_")} | {"aclose"}
    expected = local.resume(local.materialize(CONTEXT), QUESTION, max_tokens=4)

    async def main() -> None:
        async with AsyncEmbeddedClient(engine=engine) as c:
            h = await c.materialize(CONTEXT)
            stream = await c.resume_stream(h, QUESTION, max_tokens=4)
            assert [t async for chunk in stream for t in chunk.token_ids] == expected.token_ids
            early = await c.resume_stream(h, QUESTION, max_tokens=4)
            await early.aclose()  # cancelled: nothing registered
            await c.release([h, stream.result.handle])

    before = engine.stats().handles_live
    asyncio.run(main())
    assert engine.stats().handles_live == before


def test_agents_and_hints_through_the_http_client(client):
    info = client.register_agent("http-writer", [{"role": "system", "content": "You write limericks."}])
    assert info.fixed_tokens > 0
    graph = kvbaton.StepGraph()
    graph.add_edge("http-writer", "http-critic")
    graph.add_edge("http-critic", "http-writer")
    assert client.hints(graph, running=["http-critic"]) == {"http-writer": 1.0, "http-critic": 0.0}
    result = client.generate([{"role": "system", "content": "You write limericks."}, {"role": "user", "content": "A cat"}],
                             agent="http-writer", max_tokens=2)
    client.release(result.handle)
    assert client.stats().agents["http-writer"].requests >= 1
