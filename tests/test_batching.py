"""Continuous batching: concurrent requests share forwards and each stays exact."""

from __future__ import annotations

import pytest
import torch
from conftest import dense_greedy
from kvbaton import SamplingParams
from kvbaton.backend import Engine
from kvbaton.bench.common import parallel  # raises the first request's error, failing the test


def test_batched_decodes_equal_each_request_alone(engine, reference, corpus_tokens):
    """Different prefixes and lengths, some from a handle, some plain completions."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    shared = engine.materialize(corpus_tokens[:150])
    prompts = [corpus_tokens[1000 : 1000 + n] for n in (5, 37, 90, 16)]
    jobs = [lambda p=p: engine.complete(p, params) for p in prompts]
    suffixes = [corpus_tokens[2000 + 9 * i : 2009 + 9 * i] for i in range(4)]
    jobs += [lambda s=s: engine.resume(shared, s, params) for s in suffixes]

    results = parallel(jobs)

    expected = [dense_greedy(reference, p, 12)[0] for p in prompts]
    expected += [dense_greedy(reference, corpus_tokens[:150] + s, 12)[0] for s in suffixes]
    assert [r.token_ids for r in results] == expected
    assert engine.scheduler.max_sequences > 1  # they really shared forwards


def test_long_prefill_is_chunked_between_decodes(engine, corpus_tokens):
    long_prompt = corpus_tokens[:1800]  # several chunks of prefill_chunk tokens
    short = engine.materialize(corpus_tokens[2000:2040])
    results = parallel([
        lambda: engine.complete(long_prompt, SamplingParams(max_tokens=2, ignore_eos=True)),
        lambda: engine.resume(short, [], SamplingParams(max_tokens=30, ignore_eos=True)),
    ])
    assert results[0].timings.tokens_prefilled == 1800
    assert len(results[1].token_ids) == 30


@pytest.fixture
def chunking(monkeypatch):
    """A small engine (chunks of 64 tokens while contended, budget 256) and the size of every prefill
    chunk its forwards receive."""
    engine = Engine(kv_budget="64MiB", prefill_chunk=64, max_batch_tokens=256)
    sizes: list[int] = []
    forward = engine.runner.forward

    def recording(chunks):
        sizes.extend(len(c.token_ids) for c in chunks if len(c.token_ids) > 1)
        return forward(chunks)

    monkeypatch.setattr(engine.runner, "forward", recording)
    yield engine, sizes
    engine.close()


def _matches_dense(engine, handle, prompt, reference) -> bool:
    """The next-token logits after ``handle`` + the prompt's last token equal dense prefill's."""
    logits = engine.next_token_logits(handle, prompt[-1:])
    _, dense = dense_greedy(reference, prompt, 0)
    return torch.max(torch.abs(logits - dense)).item() < 1e-4


def test_prompt_alone_is_prefilled_in_chunks_of_the_token_budget(chunking, reference, corpus_tokens):
    """Nothing else to interleave with: smaller chunks would only cost, and the result is the same."""
    engine, sizes = chunking
    prompt = corpus_tokens[:600]
    handle = engine.materialize(prompt[:-1])
    assert sizes == [256, 256, 87]
    assert _matches_dense(engine, handle, prompt, reference)


class _Decoding:
    """A generation running beside the test's requests, its consumer reading on a thread of its own."""

    def __init__(self, engine, tokens):
        import threading

        self.stream = engine.complete_stream(tokens, SamplingParams(max_tokens=1000, ignore_eos=True))
        next(self.stream)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for _ in self.stream:
            if self._stop.is_set():
                break

    def close(self):
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "the generation's consumer did not stop"
        self.stream.close()


def test_prompt_beside_a_decoding_request_is_prefilled_in_small_chunks(chunking, reference, corpus_tokens):
    """Another request is decoding: each chunk stalls it, so chunks stay at ``prefill_chunk``."""
    engine, sizes = chunking
    prompt = corpus_tokens[:300]
    decoding = _Decoding(engine, corpus_tokens[2000:2010])
    sizes.clear()
    handle = engine.materialize(prompt[:-1])
    decoding.close()
    assert sizes == [64, 64, 64, 64, 43]
    assert _matches_dense(engine, handle, prompt, reference)


def test_each_sequence_of_a_batched_forward_gets_logits_of_its_own(engine, corpus_tokens):
    """A handle keeps its last logits: a view into the batch's logits would keep every row of the
    batch alive with it (issue 20: the soak's server memory grew with its live handles)."""
    from kvbaton.backend.compute.runner import Chunk

    blocks = [engine.pool.allocate(1) for _ in range(3)]
    try:
        chunks = [Chunk(b, 0, corpus_tokens[3000 + 8 * i : 3004 + 8 * i]) for i, b in enumerate(blocks)]
        # The engine is idle: the test's thread may call its runner (one caller at a time).
        prefilled = engine.runner.forward(chunks)
        decoded = engine.runner.forward([Chunk(b, 4, [corpus_tokens[3100]]) for b in blocks])  # the fast decode path
    finally:
        for b in blocks:
            engine.pool.decref(b)
    for logits in prefilled + decoded:
        assert logits.shape == (engine.loaded.vocab_size,)
        assert logits.untyped_storage().nbytes() == logits.nbytes


def test_background_work_waits_until_no_request_is_active(chunking, reference, corpus_tokens):
    """The fidelity audit's dense checks are background work: while a request is active they run no
    forward at all (a request is never slowed by a check), and they finish once the engine is idle."""
    import threading

    engine, sizes = chunking
    prompt = corpus_tokens[:300]
    done: list[int] = []
    unread = engine.complete_stream(corpus_tokens[2000:2010], SamplingParams(max_tokens=1000, ignore_eos=True))
    next(unread)  # a generation whose consumer reads nothing for now: it still holds the engine busy
    check = threading.Thread(target=lambda: done.append(engine.requests.first_token(prompt)))
    check.start()
    foreground = engine.complete(corpus_tokens[400:500], SamplingParams(max_tokens=2, ignore_eos=True))
    assert check.is_alive() and engine.scheduler.background_forwards == 0
    unread.close()
    check.join(timeout=120)
    assert not check.is_alive()
    assert done == [dense_greedy(reference, prompt, 1)[0][0]]
    assert foreground.token_ids == dense_greedy(reference, corpus_tokens[400:500], 2)[0]


def test_background_work_waits_for_a_quiet_period_after_the_last_request(chunking, reference, corpus_tokens):
    """The gaps between a request's own steps, or between an agent's turns, are not idleness: a check
    waits until no request has come for ``background_quiet_s``."""
    import threading

    engine, _ = chunking
    engine.scheduler.background_quiet_s = 3600.0
    prompt = corpus_tokens[:200]
    done: list[int] = []
    check = threading.Thread(target=lambda: done.append(engine.requests.first_token(prompt)))
    check.start()
    for start in (400, 500):  # two turns, no request active in between
        engine.complete(corpus_tokens[start : start + 80], SamplingParams(max_tokens=2, ignore_eos=True))
    assert check.is_alive() and engine.scheduler.background_forwards == 0

    engine.scheduler.background_quiet_s = 0.0
    engine.complete(corpus_tokens[600:610], SamplingParams(max_tokens=1))  # wakes the scheduler
    check.join(timeout=120)
    assert done == [dense_greedy(reference, prompt, 1)[0][0]]
    assert engine.scheduler.background_forwards > 0


def test_background_prompts_go_in_small_chunks_even_when_alone(chunking, reference, corpus_tokens):
    """A request may arrive at any moment: it waits for one small chunk of background work at most."""
    engine, sizes = chunking
    engine.scheduler.background_chunk = 32
    engine.scheduler.background_quiet_s = 0.0
    prompt = corpus_tokens[:150]
    assert engine.requests.first_token(prompt) == dense_greedy(reference, prompt, 1)[0][0]
    assert sizes == [32, 32, 32, 32, 22]
    assert engine.scheduler.background_forwards == 5
