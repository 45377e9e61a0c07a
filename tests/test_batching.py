"""Continuous batching: concurrent requests share forwards and each stays exact."""

from __future__ import annotations

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


def _chunk_sizes(engine, monkeypatch) -> list[int]:
    """Record the size of every prefill chunk the engine's forwards receive."""
    sizes: list[int] = []
    forward = engine.runner.forward

    def recording(chunks):
        sizes.extend(len(c.token_ids) for c in chunks if len(c.token_ids) > 1)
        return forward(chunks)

    monkeypatch.setattr(engine.runner, "forward", recording)
    return sizes


def test_prompt_alone_is_prefilled_in_chunks_of_the_token_budget(reference, corpus_tokens, monkeypatch):
    """Nothing else to interleave with: smaller chunks would only cost, and the result is the same."""
    engine = Engine(kv_budget="64MiB", prefill_chunk=64, max_batch_tokens=256)
    try:
        sizes = _chunk_sizes(engine, monkeypatch)
        prompt = corpus_tokens[:600]
        logits = engine.next_token_logits(engine.materialize(prompt[:-1]), prompt[-1:])
        assert sizes == [256, 256, 87]
        _, dense = dense_greedy(reference, prompt, 0)
        assert torch.max(torch.abs(logits - dense)).item() < 1e-4
    finally:
        engine.close()


def test_prompt_beside_a_decoding_request_is_prefilled_in_small_chunks(reference, corpus_tokens, monkeypatch):
    """Another request is decoding: each chunk stalls it, so chunks stay at ``prefill_chunk``."""
    engine = Engine(kv_budget="64MiB", prefill_chunk=64, max_batch_tokens=256)
    try:
        sizes = _chunk_sizes(engine, monkeypatch)
        prompt = corpus_tokens[:300]
        with engine.scheduler.decoding():  # as a streaming request holds it between its steps
            handle = engine.materialize(prompt[:-1])
        logits = engine.next_token_logits(handle, prompt[-1:])
        assert sizes == [64, 64, 64, 64, 43]
        _, dense = dense_greedy(reference, prompt, 0)
        assert torch.max(torch.abs(logits - dense)).item() < 1e-4
    finally:
        engine.close()
