"""The operator contract: every client and engine behind it gives the same answers and the same errors.

Each case runs against every implementation of :class:`kvbaton.ops.KVOps` that a user can reach:
the embedded engine, a ``kvbaton serve`` process over HTTP, a two-worker cluster, and the
asynchronous clients of the embedded engine and of the server (driven here through a small
blocking shim so the cases are written once). SGLang joins where it is installed (it needs a GPU).
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kvbaton import (
    Capabilities,
    ContextTooLong,
    HandleNotFound,
    HandleReleased,
    IncompatibleHandle,
    InvalidRequest,
    StepGraph,
)
from kvbaton.embedded import AsyncEmbeddedClient, EmbeddedClient
from kvbaton.http import AsyncHttpClient, HttpClient
from kvbaton.ops import KVOps
from kvbaton.stream import AsyncTokenStream

NOTES = "Meeting notes. The blue team shipped the parser; the red team fixed three bugs in the lexer."
QUESTION = "\nQuestion: which team fixed bugs?\nAnswer:"
SYSTEM = {"role": "system", "content": "You are a terse assistant who answers in one sentence."}
ASK = {"role": "user", "content": "Which team shipped the parser?"}
MAX = 6  # tokens per generation: enough to compare, cheap on two cores


class _Blocking:
    """An AsyncClient driven from synchronous test code: one event loop in a thread for its life."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.inner = self._run(self._build(make))

    @staticmethod
    async def _build(make: Callable[[], Any]) -> Any:
        return make()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.inner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            out = self._run(method(*args, **kwargs))
            return _BlockingStream(self, out) if isinstance(out, AsyncTokenStream) else out

        return call

    def close(self) -> None:
        self._run(self.inner.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class _BlockingStream:
    def __init__(self, owner: _Blocking, stream: AsyncTokenStream) -> None:
        self._owner, self._stream = owner, stream

    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                yield self._owner._run(self._stream.__anext__())
            except StopAsyncIteration:
                return

    @property
    def result(self) -> Any:
        return self._stream.result


@pytest.fixture(scope="module")
def cluster():
    from kvbaton.backend.cluster import Cluster

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # two workers + this process share a couple of cores
        c = Cluster(["cpu", "cpu"], engine_options={"kv_budget": "64MiB"}, calibrate=False)
    yield c
    c.close()


# SGLang (GPU only) joins where its Python has it; tests/with_sglang run it against its own checkpoint.
IMPLEMENTATIONS = ["embedded", "http", "cluster", "async-embedded", "async-http"] + (
    ["sglang"] if importlib.util.find_spec("sglang") else []
)


@pytest.fixture(params=IMPLEMENTATIONS)
def kv(request: pytest.FixtureRequest, engine) -> Iterator[Any]:
    kind = request.param
    if kind == "sglang":
        pytest.skip("the SGLang engine needs a GPU and its checkpoint: make test-sglang runs tests/with_sglang")
    if kind in ("http", "async-http"):
        url = request.getfixturevalue("server").url
        client: Any = HttpClient(url, timeout=120) if kind == "http" else _Blocking(lambda: AsyncHttpClient(url))
    elif kind == "cluster":
        client = EmbeddedClient(engine=request.getfixturevalue("cluster"))
    elif kind == "embedded":
        client = EmbeddedClient(engine=engine)
    else:
        client = _Blocking(lambda: AsyncEmbeddedClient(engine=engine))
    made: list[Any] = []
    client.track = made.append  # handles a case makes, released after it (the server is shared)
    yield client
    live = [h for h in made if h is not None]
    for h in live:
        try:
            client.release(h)
        except (HandleNotFound, HandleReleased):
            pass
    client.close()


def keep(kv: Any, *handles: Any) -> Any:
    for h in handles:
        kv.track(h)
    return handles[0] if len(handles) == 1 else handles


def test_every_backend_implements_the_contract(engine, cluster) -> None:
    from kvbaton.http import HttpOps

    http = HttpOps("http://127.0.0.1:9")
    for ops in (engine, cluster, http):
        assert isinstance(ops, KVOps), type(ops).__name__
    http.close()


def test_materialize_spells_its_tokens(kv) -> None:
    tokens = kv.tokenize(NOTES)
    assert kv.detokenize(tokens) == NOTES
    notes = keep(kv, kv.materialize(NOTES))
    assert notes.num_tokens == len(tokens) and notes.token_ids() == tokens and notes.exact


def test_resume_is_token_identical_to_replaying_the_text(kv) -> None:
    notes = keep(kv, kv.materialize(NOTES))
    resumed = kv.resume(notes, QUESTION, max_tokens=MAX, ignore_eos=True)
    keep(kv, resumed.handle)
    replayed = kv.complete(kv.tokenize(NOTES) + kv.tokenize(QUESTION), max_tokens=MAX, ignore_eos=True)
    keep(kv, replayed.handle)
    assert resumed.token_ids == replayed.token_ids and len(resumed.token_ids) == MAX
    assert resumed.timings.tokens_reused >= notes.num_tokens - 1


def test_fork_and_extend_share_the_prefix(kv) -> None:
    notes = keep(kv, kv.materialize(NOTES))
    before = kv.stats().handles_live
    forks = keep(kv, *kv.fork(notes, 3))
    assert len({h.id for h in forks}) == 3 and all(h.num_tokens == notes.num_tokens for h in forks)
    assert kv.stats().handles_live == before + 3
    longer = keep(kv, kv.extend(forks[0], QUESTION))
    assert longer.token_ids() == kv.tokenize(NOTES) + kv.tokenize(QUESTION)


def test_a_stream_yields_the_blocking_result(kv) -> None:
    notes = keep(kv, kv.materialize(NOTES))
    stream = kv.resume_stream(notes, QUESTION, max_tokens=MAX, ignore_eos=True)
    text = "".join(chunk.text for chunk in stream)
    keep(kv, stream.result.handle)
    blocking = kv.resume(notes, QUESTION, max_tokens=MAX, ignore_eos=True)
    keep(kv, blocking.handle)
    assert text == stream.result.text == blocking.text


def test_generate_reuses_a_handle_of_the_rendered_system_prompt(kv) -> None:
    prefix = keep(kv, kv.materialize(kv.chat_tokens([SYSTEM], add_generation_prompt=False)))
    reused = kv.generate([SYSTEM, ASK], handle=prefix, max_tokens=MAX)
    fresh = kv.generate([SYSTEM, ASK], max_tokens=MAX)
    keep(kv, reused.handle, fresh.handle)
    assert reused.token_ids == fresh.token_ids
    assert reused.timings.tokens_reused >= prefix.num_tokens - 1


def test_a_response_format_is_enforced_and_logprobs_reported(kv) -> None:
    age = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
           "additionalProperties": False}
    ask = {"role": "user", "content": "Return Bob's age (30) in a JSON object."}
    result = kv.generate([ask], max_tokens=12, logprobs=True, top_logprobs=1,
                         response_format={"type": "json_schema", "json_schema": {"name": "age", "schema": age}})
    keep(kv, result.handle)
    assert result.text == '{"age":30}' and result.finish_reason == "stop"
    assert [e.token_id for e in result.logprobs] == result.token_ids and len(result.logprobs[0].top_logprobs) == 1


def test_compose_and_merge_of_whole_handles_are_exact(kv) -> None:
    notes = keep(kv, kv.materialize(NOTES))
    composed = kv.compose(segments=[notes])
    keep(kv, composed.handle)
    assert composed.exact and composed.handle.token_ids() == notes.token_ids()
    longer = keep(kv, kv.extend(notes, QUESTION))
    merged = kv.merge([notes, longer])
    keep(kv, merged.handle)
    assert merged.handle.num_tokens == longer.num_tokens and merged.exact


def test_agents_and_hints(kv) -> None:
    info = kv.register_agent("contract-reader", [SYSTEM])
    assert info.fixed_tokens == len(kv.chat_tokens([SYSTEM], add_generation_prompt=False))
    assert kv.hints({"contract-reader": 2}, running=["contract-writer"]) == {
        "contract-reader": 2.0, "contract-writer": 0.0,
    }
    graph = StepGraph()
    graph.add_edge("contract-reader", "contract-writer")
    assert kv.hints(graph, running=["contract-reader"])["contract-writer"] == 1.0
    assert isinstance(kv.capabilities(), Capabilities)


def test_a_transfer_to_the_handles_own_device_is_a_no_op(kv) -> None:
    notes = keep(kv, kv.materialize(NOTES))
    here = notes.placement.worker if notes.placement.worker is not None else 0
    assert kv.transfer(notes, here).id == notes.id
    with pytest.raises(InvalidRequest):
        kv.transfer(notes, 99)


def test_unknown_and_released_handles(kv) -> None:
    with pytest.raises(HandleNotFound):
        kv.resume("0" * 32, QUESTION)
    gone = kv.materialize(NOTES)
    kv.release(gone)
    with pytest.raises(HandleReleased):
        kv.fork(gone)
    with pytest.raises(HandleReleased):
        kv.release(gone)


def test_a_handle_of_another_model_is_incompatible(kv) -> None:
    notes = keep(kv, kv.materialize(NOTES))
    alien = notes.model_copy(update={"model_fingerprint": "0" * 16})
    with pytest.raises(IncompatibleHandle):
        kv.resume(alien, QUESTION)


def test_each_request_is_one_event_with_its_results_numbers(kv) -> None:
    since = kv.events().next
    result = kv.generate([SYSTEM, ASK], agent="eventful", max_tokens=MAX)
    keep(kv, result.handle)
    page = kv.events(since)
    assert page.next >= since and page.dropped == 0
    (event,) = [e for e in page.events if e.kind == "request" and e.handle_out == result.handle.id]
    assert (event.agent, event.op, event.finish) == ("eventful", "generate", result.finish_reason)
    t = result.timings
    assert (event.tokens_reused, event.tokens_prefilled, event.tokens_generated, event.tokens_approximate) == (
        t.tokens_reused, t.tokens_prefilled, t.tokens_generated, t.tokens_approximate)
    assert event.t_queued <= event.t_admitted <= event.t_first_token <= event.t_done
    assert all(e.seq > since for e in page.events)
    assert all(e.seq > page.next for e in kv.events(page.next).events)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda kv, h: kv.fork(h, 0), id="fork-zero"),
        pytest.param(lambda kv, h: kv.release([h, h]), id="release-twice-listed"),
        pytest.param(lambda kv, h: kv.materialize([10**9]), id="token-outside-vocab"),
        pytest.param(lambda kv, h: kv.materialize(""), id="empty-context"),
        pytest.param(lambda kv, h: kv.generate([]), id="no-messages"),
        pytest.param(lambda kv, h: kv.hints({"a": -1}), id="negative-steps"),
        pytest.param(lambda kv, h: kv.tokenize(5), id="tokenize-non-text"),
        pytest.param(lambda kv, h: kv.resume(h, QUESTION, temperature=-1), id="bad-temperature"),
        pytest.param(lambda kv, h: kv.compose(segments=[h], mode="bogus"), id="unknown-compose-mode"),
        pytest.param(lambda kv, h: kv.resume(h, QUESTION, response_format={
            "type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}), id="bad-response-format"),
        pytest.param(lambda kv, h: kv.events(-1), id="negative-event-seq"),
    ],
)
def test_bad_input_is_an_invalid_request_and_costs_nothing(kv, call) -> None:
    notes = keep(kv, kv.materialize(NOTES))
    before = kv.stats().handles_live
    with pytest.raises(InvalidRequest):
        call(kv, notes)
    assert kv.stats().handles_live == before
    assert keep(kv, kv.fork(notes, 1)[0]).num_tokens == notes.num_tokens  # the input is still usable


def test_a_context_longer_than_the_model_is_refused_before_compute(kv) -> None:
    with pytest.raises(ContextTooLong):
        kv.materialize([100] * 9000)  # SmolLM2's context is 8192 tokens
