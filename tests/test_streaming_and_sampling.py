"""Streaming yields the same tokens as a blocking call; sampling options behave as documented."""

from __future__ import annotations

import threading

import pytest
from kvbaton import SamplingParams, connect


def test_stream_matches_blocking_result(engine, corpus_tokens):
    handle = engine.materialize(corpus_tokens[:60])
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    stream = engine.resume_stream(handle, " In short,", params)
    chunks = list(stream)
    blocking = engine.resume(handle, " In short,", params)
    assert [t for c in chunks for t in c.token_ids] == blocking.token_ids
    assert "".join(c.text for c in chunks) == blocking.text == stream.result.text
    assert stream.result.token_ids == blocking.token_ids


def test_stream_never_emits_part_of_a_stop_string(engine):
    handle = engine.materialize("Count: 1, 2, 3, 4,")
    with engine.resume_stream(handle, sampling=SamplingParams(max_tokens=30, stop=[", 8"])) as stream:
        text = "".join(chunk.text for chunk in stream)
    assert text == stream.result.text
    assert ", 8" not in text and not text.endswith(",")


def test_seeded_sampling_is_reproducible(engine, corpus_tokens):
    handle = engine.materialize(corpus_tokens[:30])
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    assert engine.resume(handle, [], params).token_ids == engine.resume(handle, [], params).token_ids


def test_top_k_one_is_greedy(engine, corpus_tokens):
    handle = engine.materialize(corpus_tokens[:30])
    greedy = engine.resume(handle, [], SamplingParams(max_tokens=10, ignore_eos=True))
    topk1 = engine.resume(handle, [], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3, ignore_eos=True))
    assert greedy.token_ids == topk1.token_ids


def test_max_tokens_and_timings(engine):
    result = engine.resume(engine.materialize("Once upon a time"), sampling=SamplingParams(max_tokens=5, ignore_eos=True))
    assert result.finish_reason == "length"
    assert len(result.token_ids) == result.timings.tokens_generated == 5
    assert 0 < result.timings.ttft_s <= result.timings.total_s


YES_OR_NO = [{"role": "user", "content": "Reply with one word: yes or no?"}]


def test_min_tokens_holds_off_end_of_sequence(engine):
    natural = engine.generate(YES_OR_NO, sampling=SamplingParams(max_tokens=32))
    assert natural.finish_reason == "stop" and natural.timings.tokens_generated < 8  # "Yes." then EOS
    held = engine.generate(YES_OR_NO, sampling=SamplingParams(max_tokens=12, min_tokens=12))
    assert held.finish_reason == "length" and held.timings.tokens_generated == 12
    assert held.token_ids[: len(natural.token_ids) - 1] == natural.token_ids[:-1]  # greedy until EOS was due


def test_min_tokens_holds_off_stop_strings(engine):
    # Greedy continues ", the city of Nova...": the stop string " " appears in token 2 already.
    early = engine.complete("Once upon a time", SamplingParams(max_tokens=8, stop=[" "]))
    late = engine.complete("Once upon a time", SamplingParams(max_tokens=8, min_tokens=4, stop=[" "]))
    assert early.text == "," and len(early.token_ids) == 2
    # A stop string counts once it ends in the text of token min_tokens or later.
    assert late.text == ", the city" and len(late.token_ids) == 4 and late.finish_reason == "stop"


@pytest.mark.unit
def test_min_tokens_beyond_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens 9 exceeds max_tokens 8"):
        SamplingParams(max_tokens=8, min_tokens=9)


def test_concurrent_requests_from_threads_are_exact(engine, corpus_tokens):
    shared = engine.materialize(corpus_tokens[:80])
    suffixes = [corpus_tokens[80 + 7 * i : 87 + 7 * i] for i in range(4)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    alone = [engine.resume(shared, s, params).token_ids for s in suffixes]
    together: list[list[int] | None] = [None] * 4

    def work(i: int) -> None:
        together[i] = engine.resume(shared, suffixes[i], params).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


def test_client_interface_matches_engine():
    with connect(kv_budget="64MiB") as client:
        handle = client.materialize("The capital of France is")
        (child,) = client.fork(handle, 1)
        result = client.resume(child, " the city of", max_tokens=4)
        assert result.timings.tokens_reused == handle.num_tokens
        assert client.detokenize(client.tokenize("round trip")) == "round trip"
        stream = client.resume_stream(child, " the city of", max_tokens=4)
        assert "".join(c.text for c in stream) == result.text
        client.release([handle, child, result.handle, stream.result.handle])
        stats = client.stats()
        assert stats.handles_live == 0 and stats.blocks_used == stats.blocks_cache_only
