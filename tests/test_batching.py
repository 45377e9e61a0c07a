"""Continuous batching: concurrent requests share forwards and each stays exact."""

from __future__ import annotations

from conftest import dense_greedy
from kvbaton import SamplingParams
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
