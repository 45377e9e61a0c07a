"""Idle live handles spill instead of exhausting the pool: their blocks go to the slow tier (or are
dropped) in the eviction policy's order, and their next use is token-identical to dense prefill.
Approximate handles spill too: their approximate K/V are dropped and rebuilt densely (exact) on next use."""

from __future__ import annotations

import pytest
from conftest import dense_greedy
from kvbaton import SamplingParams
from kvbaton.backend import Engine
from kvbaton.bench.corpus import document
from kvbaton.errors import PoolExhausted

GREEDY_4 = SamplingParams(max_tokens=4, ignore_eos=True)
SUFFIX = [13, 2]  # a short question after each handle


def contexts(corpus_tokens, n: int) -> list[list[int]]:
    return [corpus_tokens[i * 300 : i * 300 + 300] for i in range(n)]  # 19 blocks each


def check_spilled_handles_resume_exactly(engine, reference, handles, tokens, n: int) -> list:
    results = []
    for handle, ctx in list(zip(handles, tokens))[:n]:
        result = engine.resume(handle, SUFFIX, GREEDY_4)
        assert result.token_ids == dense_greedy(reference, ctx + SUFFIX, 4)[0]
        results.append(result)
        engine.release(result.handle)
    return results


def assert_pool_drains(engine, handles) -> None:
    engine.release(handles)
    engine.flush_cache()
    assert engine.stats().blocks_used == 0 and not engine.kv.spiller.spilled


@pytest.mark.parametrize("tiers", [[], ["disk:400 blocks"]], ids=["no-tier", "disk-tier"])
def test_many_idle_handles_spill_instead_of_exhausting_the_pool(reference, corpus_tokens, tiers):
    engine = Engine(kv_budget="60 blocks", tiers=tiers, prefetch=False)  # three 300-token handles fill it
    tokens = contexts(corpus_tokens, 8)
    handles = [engine.materialize(ctx) for ctx in tokens]  # was PoolExhausted at the fourth
    stats = engine.stats()
    assert stats.handles_live == 8 and stats.blocks_used <= 60
    assert set(engine.kv.spiller.spilled) >= {handles[0].id, handles[1].id}  # the least recently used first
    if tiers:
        assert stats.cache.nodes_per_tier["disk"] > 0

    first, second = check_spilled_handles_resume_exactly(engine, reference, handles, tokens, 2)
    if tiers:  # loaded back from the disk tier, not recomputed
        assert first.timings.tokens_reused == 288 and engine.stats().cache.hits_blocks["disk"] > 0
    else:  # nowhere to keep them: recomputed from the tokens
        assert first.timings.tokens_prefilled == 302
    (child,) = engine.fork(handles[2], 1)  # fork and extend of a spilled handle work as of any other
    longer = engine.extend(child, SUFFIX)
    again = engine.resume(longer, "", GREEDY_4)
    assert again.token_ids == dense_greedy(reference, tokens[2] + SUFFIX, 4)[0]
    engine.release([child, longer, again.handle])
    assert_pool_drains(engine, handles)
    engine.close()


def test_handles_spill_in_steps_to_execution_order(reference, corpus_tokens):
    engine = Engine(kv_budget="60 blocks")
    tokens = contexts(corpus_tokens, 4)
    engine.hints({"a": 1, "b": 5, "c": 3})
    a, b, c = (engine.materialize(ctx, agent=name) for ctx, name in zip(tokens, "abc"))
    d = engine.materialize(tokens[3], agent="a")  # room for one more: the farthest agent's handle goes
    assert engine.kv.spiller.spilled == {b.id}
    check_spilled_handles_resume_exactly(engine, reference, [b], [tokens[1]], 1)
    assert_pool_drains(engine, [a, b, c, d])
    engine.close()


def test_blocks_of_requests_in_flight_are_not_spillable(corpus_tokens):
    engine = Engine(kv_budget="60 blocks")
    idle = engine.materialize(corpus_tokens[:100])  # 7 blocks: spillable, but not enough
    stream = engine.complete_stream(corpus_tokens[1000:1600], SamplingParams(max_tokens=200, ignore_eos=True))
    next(stream)  # running: its ~40 blocks (the prompt's and those of the tokens it ran ahead) are its own
    # 24 blocks: ~13 free + 7 spillable is not enough, and the stream, unread, gives nothing back
    with pytest.raises(PoolExhausted):
        engine.materialize(corpus_tokens[2000:2380])
    assert not engine.kv.spiller.spilled  # and nothing was spilled for a reservation that fails anyway
    stream.close()
    engine.release(engine.materialize(corpus_tokens[2000:2380]))  # fits once the stream is gone
    assert_pool_drains(engine, [idle])
    engine.close()


def test_a_burst_larger_than_the_pool_queues_instead_of_failing(reference, corpus_tokens):
    """Six cold 300-token requests at once need 6 x 19 blocks of a 60-block pool: those that do not fit
    wait for the requests in flight to finish (their blocks come back as idle handles, which spill),
    rather than failing with PoolExhausted; each answer is the dense one."""
    from concurrent.futures import ThreadPoolExecutor

    engine = Engine(kv_budget="60 blocks", prefetch=False)
    tokens = contexts(corpus_tokens, 6)
    try:
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda ctx: engine.complete(ctx, GREEDY_4), tokens))
        for ctx, result in zip(tokens, results, strict=True):
            assert result.token_ids == dense_greedy(reference, ctx, 4)[0]
        engine.release([r.handle for r in results])
        assert engine.stats().handles_live == 0
    finally:
        engine.close()


def test_approximate_handles_spill_and_come_back_exact(reference, corpus_tokens):
    """An approximate handle (another agent's document re-aligned behind its own system prompt) held by an
    idle app must not make an unrelated request fail: it gives up its blocks like any idle handle, and its
    next use rebuilds it densely from its tokens, so that answer is the dense one, marked exact."""
    engine = Engine(kv_budget="120 blocks", prefetch=False)
    doc = document(140, seed=11)
    reader = engine.generate([{"role": "system", "content": "You are the reader. Summarize the notes."},
                              {"role": "user", "content": f"{doc}\n\nSummarize."}], sampling=GREEDY_4, agent="reader")
    review = engine.generate([{"role": "system", "content": "You are a strict reviewer of risks."},
                              {"role": "user", "content": f"{doc}\n\nRisk?"}], sampling=GREEDY_4, agent="reviewer",
                             reuse="rotate")
    assert not review.exact and not review.handle.exact
    engine.release(reader.handle)
    engine.flush_cache()  # the approximate handle is what holds the pool now
    unrelated = corpus_tokens[: (engine.pool.num_free + 4) * 16 - 8]
    result = engine.complete(unrelated, GREEDY_4)  # was PoolExhausted: approximate handles never spilled
    assert engine.kv.spiller.spilled == {review.handle.id}
    assert result.token_ids == dense_greedy(reference, unrelated, 4)[0]
    engine.release(result.handle)

    tokens = review.handle.token_ids()
    again = engine.resume(review.handle, SUFFIX, GREEDY_4)
    assert again.exact and again.timings.tokens_approximate == 0
    assert again.token_ids == dense_greedy(reference, tokens + SUFFIX, 4)[0]
    assert engine.describe(review.handle).exact  # rebuilt densely from its lineage: exact from now on
    engine.release(again.handle)
    assert_pool_drains(engine, [review.handle])
    engine.close()
