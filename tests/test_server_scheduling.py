"""The one loop behind a real ``kvbaton serve``, as its clients see it (issue 45, issue 49 items 10 and 15):
a long prompt and a short one sent while generations stream are answered while those generations still run
(they used to wait for every running generation to finish), and one tenant's long generations do not hold
the pool against another tenant's request. Tests assert the order of events, never a time."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from kvbaton.bench.corpus import document
from server_fixtures import ServerProcess, running

pytestmark = pytest.mark.server

TOKEN_A, TOKEN_B = "sched-tenant-a", "sched-tenant-b"
DEADLINE_S = 600.0  # generous: a loaded CI machine; what each wait is for is named where it waits


@pytest.fixture(scope="module")
def served() -> Iterator[ServerProcess]:
    # 96 MiB: 136 blocks of 16 tokens (2,176 tokens) for SmolLM2 in fp32: room for the first test's requests
    # at once, not for the second's three long generations
    proc = ServerProcess(["--kv-budget", "96MiB", "--max-tokens", "1200", "--token", TOKEN_A, "--token", TOKEN_B],
                         token=TOKEN_A)
    with running({"sched": proc}):
        proc.wait_healthy()
        with proc.http() as client:
            proc.model = client.get("/v1/models").json()["data"][0]["id"]  # type: ignore[attr-defined]
        yield proc


class Streaming:
    """A streamed completion read on a thread of its own until it ends or is stopped."""

    def __init__(self, proc: ServerProcess, token: str, prompt: str, max_tokens: int) -> None:
        self.client = proc.http(token, timeout=DEADLINE_S)
        self.body = {"model": proc.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                     "ignore_eos": True, "temperature": 0}
        self.chunks = 0
        self.started = threading.Event()
        self.ended = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            with self.client.stream("POST", "/v1/completions", json=self.body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.chunks += 1
                        self.started.set()
                    if self.stop.is_set():
                        return  # leaving the block closes the connection: the server aborts the generation
        finally:
            self.ended.set()
            self.client.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(DEADLINE_S)
        assert not self.thread.is_alive(), "a streamed completion did not end"


def _complete(proc: ServerProcess, token: str, prompt: str, max_tokens: int) -> httpx.Response:
    with proc.http(token, timeout=DEADLINE_S) as client:
        return client.post("/v1/completions", json={"model": proc.model, "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0})


def test_prompts_sent_while_generations_stream_are_answered_before_those_generations_end(served):
    generations = [Streaming(served, TOKEN_A, f"Story {i}: once upon a time", 1000) for i in range(4)]
    try:
        for g in generations:
            assert g.started.wait(DEADLINE_S), "a generation did not start streaming"
        long_prompt = document(700, seed=3)  # ~900 tokens: more than one prefill chunk a step takes
        answers = [_complete(served, TOKEN_A, long_prompt, 2), _complete(served, TOKEN_A, "Hello, my name is", 2)]
        assert [a.status_code for a in answers] == [200, 200]
        assert not any(g.ended.is_set() for g in generations)  # answered while every generation still streams
    finally:
        for g in generations:
            g.close()


def test_one_tenants_long_generations_do_not_hold_the_pool_against_another_tenant(served):
    hog = [Streaming(served, TOKEN_A, f"List {i}: the first item is", 1150) for i in range(3)]
    try:
        for g in hog:
            assert g.started.wait(DEADLINE_S), "tenant A's generation did not start streaming"
        answer = _complete(served, TOKEN_B, document(300, seed=4), 4)  # ~400 tokens
        assert answer.status_code == 200, answer.text
        assert not all(g.ended.is_set() for g in hog)  # served while tenant A's generations run
    finally:
        for g in hog:
            g.close()
