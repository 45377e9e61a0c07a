"""Ownership scopes (kvbaton.scope, ``client.scope()`` / ``client.keep()``): the bookkeeping on a
model-free fake backend (nesting, keeping, gone handles, threads and asyncio tasks, streams), then
real release on the embedded engine (sync and async clients) and over HTTP."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import kvbaton
import pytest
from kvbaton.embedded import AsyncEmbeddedClient, ThreadedOps
from kvbaton.errors import HandleReleased, ServerUnavailable
from kvbaton.handle import Handle, LineageStep, Op, Placement, Positions, new_handle_id
from kvbaton.scope import Scope
from kvbaton.stream import TokenStream
from kvbaton.types import Result, StreamChunk, Timings

# -- a model-free backend ---------------------------------------------------------------------------


def _handle(tokens: int = 3) -> Handle:
    return Handle(id=new_handle_id(), model="fake", model_fingerprint="0", tokenizer_fingerprint="0",
                  num_tokens=tokens, positions=Positions(rope_type="default", rope_theta=1.0),
                  lineage=(LineageStep(op=Op.MATERIALIZE, token_ids=tuple(range(tokens))),),
                  placement=Placement(device="cpu"))


class FakeOps:
    """Just enough of KVOps: live handles in a set, release all-or-nothing like the engine."""

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.release_calls = 0

    def _new(self) -> Handle:
        h = _handle()
        self.live.add(h.id)
        return h

    def materialize(self, context: Any, *, agent: Any = None) -> Handle:
        return self._new()

    def fork(self, handle: Any, k: int = 2) -> list[Handle]:
        return [self._new() for _ in range(k)]

    def transfer(self, handle: Any, device: Any) -> Handle:
        return handle  # same id

    def _result(self) -> Result:
        return Result(text="x", token_ids=[1], handle=self._new(), finish_reason="stop",
                      timings=Timings(ttft_s=0, total_s=0, tokens_reused=0, tokens_prefilled=1, tokens_generated=1))

    def generate(self, messages: Any, **kwargs: Any) -> Result:
        return self._result()

    def generate_stream(self, messages: Any, **kwargs: Any) -> TokenStream:
        def chunks() -> Any:
            yield StreamChunk(text="x", token_ids=[1])
            return self._result()

        return TokenStream(chunks())

    def release(self, handles: Any) -> None:
        self.release_calls += 1
        items = [handles] if isinstance(handles, Handle | str) else list(handles)
        ids = [getattr(h, "id", h) for h in items]
        for i in ids:
            if i not in self.live:
                raise HandleReleased(f"handle {i} was released")
        self.live.difference_update(ids)


def _client() -> tuple[kvbaton.Client, FakeOps]:
    ops = FakeOps()
    return kvbaton.Client(ops), ops


@pytest.mark.unit
def test_a_scope_releases_what_it_created_and_nothing_else() -> None:
    client, ops = _client()
    before = client.materialize("outside")
    with client.scope() as s:
        a = client.materialize("a")
        forks = client.fork(a, 2)
        r = client.generate([{"role": "user", "content": "x"}], handle=a)
        assert client.transfer(before, 0).id == before.id  # same id: not created here, not owned
        assert set(s.owned()) == {a.id, *(f.id for f in forks), r.handle.id}
    assert ops.live == {before.id}
    stream = None
    with client.scope():
        stream = client.generate_stream([{"role": "user", "content": "x"}])
    late = stream.until_done()  # finished after its scope closed: a closed scope records nothing
    assert late.handle.id in ops.live


@pytest.mark.unit
def test_kept_handles_survive_every_scope_until_released() -> None:
    client, ops = _client()
    with client.scope() as outer:
        with client.scope() as inner:
            a, b, c = (client.materialize(t) for t in "abc")
            inner.keep(a)  # this scope only: the outer one still owns it
            client.keep(b)  # every scope
        assert ops.live == {a.id, b.id}
        assert outer.owned() == [a.id]
    assert ops.live == {b.id}
    with client.scope():
        client.release(b)  # released by the user: the keep ends, and the scope does not try again
    assert not ops.live and c.id not in ops.live


@pytest.mark.unit
def test_handles_gone_at_scope_end_are_skipped_without_raising(caplog: pytest.LogCaptureFixture) -> None:
    client, ops = _client()
    caplog.set_level(logging.DEBUG, logger="kvbaton.scope")
    with client.scope(name="job") as s:
        a, _ = client.materialize("a"), client.materialize("b")
        ops.live.discard(a.id)  # released behind the client's back (another process, say)
    assert not ops.live and not s.owned()
    assert "kvbaton job: released 1 handles (1 already gone)" in caplog.text


@pytest.mark.unit
def test_scopes_cover_their_own_client_and_the_clients_it_is_built_on() -> None:
    mine, mine_ops = _client()
    other, other_ops = _client()
    wrapping = kvbaton.Client(mine)  # a client over a client: its calls are calls through ``mine``
    with mine.scope():
        theirs = other.materialize("x")
        inner = wrapping.materialize("y")
    assert other_ops.live == {theirs.id} and not mine_ops.live and inner.id not in mine_ops.live
    with Scope() as any_client:  # no client: every client's handles
        other.materialize("z")
        assert len(any_client) == 1
    assert other_ops.live == {theirs.id}


@pytest.mark.unit
def test_streams_are_recorded_when_their_result_arrives() -> None:
    client, ops = _client()
    with client.scope() as s:
        stream = client.generate_stream([{"role": "user", "content": "x"}])
        assert not s.owned()
        result = stream.until_done()
        assert s.owned() == [result.handle.id]
    assert not ops.live


@pytest.mark.unit
def test_threads_and_tasks_keep_their_scopes_apart() -> None:
    client, ops = _client()
    made: dict[str, str] = {}
    both = threading.Barrier(2)

    def work(name: str) -> None:
        with client.scope() as s:
            made[name] = client.materialize(name).id
            both.wait()  # both scopes are open at once
            assert s.owned() == [made[name]]
            if name == "keeper":
                s.keep(made[name])

    threads = [threading.Thread(target=work, args=(n,)) for n in ("keeper", "dropper")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ops.live == {made["keeper"]}

    aclient = kvbaton.AsyncClient(ThreadedOps(client))

    async def task(name: str, gate: asyncio.Event) -> list[str]:
        async with aclient.scope() as s:
            await aclient.materialize(name)
            gate.set()
            await asyncio.sleep(0)
            return s.owned()

    async def main() -> tuple[list[str], list[str]]:
        g1, g2 = asyncio.Event(), asyncio.Event()
        return tuple(await asyncio.gather(task("t1", g1), task("t2", g2)))  # type: ignore[return-value]

    one, two = asyncio.run(main())
    assert len(one) == len(two) == 1 and one != two  # each task owns only its own handle
    assert ops.live == {made["keeper"]}


@pytest.mark.unit
def test_a_failing_release_does_not_hide_the_blocks_exception() -> None:
    class Down(FakeOps):
        def release(self, handles: Any) -> None:
            raise ServerUnavailable("down")

    client = kvbaton.Client(Down())
    with pytest.raises(ServerUnavailable):  # nothing else in flight: the release error is raised
        with client.scope():
            client.materialize("a")
    with pytest.raises(KeyError):  # the block's own error wins, the release failure is logged
        with client.scope():
            client.materialize("a")
            raise KeyError("mine")


# -- the real engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kv() -> Any:
    client = kvbaton.connect(kv_budget="32MiB")
    yield client
    client.close()


def test_a_scope_frees_real_kv_on_the_engine(kv: Any) -> None:
    base = kv.stats()
    kept = None
    with kv.scope():
        h = kv.materialize("The scope owns this prefix.")
        kv.fork(h, 3)
        r = kv.resume(h, " and more", max_tokens=2)
        stream = kv.generate_stream([{"role": "user", "content": "Hi"}], handle=r.handle, max_tokens=2)
        stream.until_done()
        kept = kv.extend(h, " kept")
        kv.keep(kept)
        assert kv.stats().handles_live == base.handles_live + 7
    assert kv.stats().handles_live == base.handles_live + 1
    again = kv.resume(kept, "", max_tokens=1)  # the kept handle is intact (outside a scope: ours to free)
    kv.release([kept, again.handle])
    assert kv.stats().handles_live == base.handles_live


def test_async_scope_on_the_engine(kv: Any) -> None:
    aclient = AsyncEmbeddedClient(client=kv)
    before = kv.stats().handles_live

    async def go() -> None:
        async with aclient.scope():
            h = await aclient.materialize("async scope")
            await aclient.generate([{"role": "user", "content": "Hi"}], handle=h, max_tokens=2)
            stream = await aclient.generate_stream([{"role": "user", "content": "Yo"}], max_tokens=2)
            await stream.until_done()
            assert kv.stats().handles_live == before + 3

    asyncio.run(go())
    assert kv.stats().handles_live == before


def test_a_scope_over_http_releases_on_the_server(server: Any) -> None:
    with kvbaton.connect(server.url) as http:
        before = http.stats().handles_live
        with http.scope():
            h = http.materialize("over http")
            http.fork(h, 2)
            http.release(h)  # released inside the scope: not released twice
        assert http.stats().handles_live == before
