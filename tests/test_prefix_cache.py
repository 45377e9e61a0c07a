"""Radix prefix cache: automatic reuse, STE-ordered eviction, slow tiers, prefetch, recovery."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from conftest import dense_greedy
from kvbaton import SamplingParams, StepGraph
from kvbaton.backend import Engine
from kvbaton.backend.cache.block_pool import BlockPool, PoolShape
from kvbaton.backend.cache.eviction import LRU, StepsToExecution
from kvbaton.backend.cache.radix import NodeState, RadixCache

GREEDY_8 = SamplingParams(max_tokens=8, ignore_eos=True)
BS = 4


def tiny_cache(policy, num_blocks=32):
    pool = BlockPool(PoolShape(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS, dtype=torch.float32), num_blocks)
    return pool, RadixCache(pool, policy)


def cache_sequence(pool, cache, tokens):
    blocks = pool.allocate(len(tokens) // BS)
    cache.insert(tokens, blocks, len(blocks))
    pool.decref(blocks)  # the request ends; only the tree keeps them


def on_device(cache, tokens):
    return sum(n.state is NodeState.DEVICE for n in cache.match(tokens, len(tokens), touch=False))


def test_every_request_reuses_the_longest_cached_prefix(engine, reference, corpus_tokens):
    shared = corpus_tokens[:300]
    engine.complete(shared + corpus_tokens[300:310], GREEDY_8)
    second = engine.complete(shared + corpus_tokens[400:420], GREEDY_8)
    assert second.timings.tokens_reused == 300 // engine.block_size * engine.block_size
    assert second.token_ids == dense_greedy(reference, shared + corpus_tokens[400:420], 8)[0]


@pytest.mark.unit
def test_ste_eviction_keeps_the_soonest_agents_and_shared_preamble():
    ste: dict[str, float] = {}
    pool, cache = tiny_cache(StepsToExecution(ste))
    preamble = list(range(100, 108))  # 2 blocks shared by every agent
    prompts = {name: preamble + [base + i for i in range(8)] for name, base in [("a", 200), ("b", 300), ("c", 400)]}
    for name, fixed in prompts.items():
        cache.register_agent(name, fixed)
        cache_sequence(pool, cache, fixed + [900 + ord(name)] * 4)  # + one dynamic-suffix block
    ste.update({"a": 5, "b": 1, "c": 3})

    assert cache.evict(3) == 3  # the three dynamic suffixes go first
    assert [on_device(cache, prompts[n]) for n in "abc"] == [4, 4, 4]
    cache.evict(2)  # then the farthest agent's own blocks
    assert [on_device(cache, prompts[n]) for n in "abc"] == [2, 4, 4]
    cache.evict(2)
    assert [on_device(cache, prompts[n]) for n in "abc"] == [2, 4, 2]
    assert on_device(cache, preamble) == 2  # shared: min(STE) = 1 protects it


@pytest.mark.unit
def test_lru_eviction_drops_the_least_recently_used():
    pool, cache = tiny_cache(LRU())
    old, new = list(range(8)), list(range(50, 58))
    cache_sequence(pool, cache, old)
    cache_sequence(pool, cache, new)
    cache.evict(2)
    assert (on_device(cache, old), on_device(cache, new)) == (0, 2)


@pytest.mark.unit
def test_blocks_in_use_are_never_evicted():
    pool, cache = tiny_cache(LRU(), num_blocks=4)
    tokens = list(range(8))
    blocks = pool.allocate(2)
    cache.insert(tokens, blocks, 2)  # the request still holds its references
    assert cache.evict(2) == 0


def offload_everything(engine: Engine) -> None:
    engine.cache.evict(engine.pool.num_blocks)


def test_offloaded_prefix_loads_back_exactly(reference, corpus_tokens):
    engine = Engine(kv_budget="64 blocks", tiers=["disk:256 blocks"], prefetch=False)
    prompt = corpus_tokens[:200] + corpus_tokens[500:510]
    first = engine.complete(prompt, GREEDY_8)
    engine.release(first.handle)
    offload_everything(engine)
    assert engine.stats().cache.nodes_per_tier["disk"] > 0

    again = engine.complete(prompt, GREEDY_8)

    assert again.timings.tokens_reused == 208
    assert again.token_ids == first.token_ids == dense_greedy(reference, prompt, 8)[0]
    assert engine.stats().cache.hits_blocks["disk"] == 13
    engine.close()


def test_corrupted_or_missing_tier_files_are_recomputed_not_trusted(reference, corpus_tokens):
    engine = Engine(kv_budget="64 blocks", tiers=["disk:256 blocks"], prefetch=False)
    prompt = corpus_tokens[:160] + corpus_tokens[600:605]
    engine.release(engine.complete(prompt, GREEDY_8).handle)
    offload_everything(engine)
    files = sorted(engine.cache.tiers[0].dir.glob("*.safetensors"))
    assert len(files) == 10
    data = bytearray(files[3].read_bytes())
    data[-100:] = bytes(100)  # silently garbled K/V bytes, valid header
    files[3].write_bytes(bytes(data))
    files[6].unlink()

    again = engine.complete(prompt, GREEDY_8)

    assert again.token_ids == dense_greedy(reference, prompt, 8)[0]
    assert engine.stats().cache.tier_errors >= 1
    assert again.timings.tokens_prefilled > len(prompt) - 160
    engine.close()


def test_tier_files_are_removed_when_dropped_and_on_close(corpus_tokens):
    engine = Engine(kv_budget="64 blocks", tiers=["disk:256 blocks"], prefetch=False)
    engine.release(engine.materialize(corpus_tokens[:128]))
    offload_everything(engine)
    tier_dir = engine.cache.tiers[0].dir
    assert len(list(tier_dir.glob("*.safetensors"))) == 8
    engine.flush_cache()
    assert list(tier_dir.glob("*.safetensors")) == []  # the owner lock stays until close
    engine.release(engine.materialize(corpus_tokens[:64]))
    offload_everything(engine)
    engine.close()
    assert not tier_dir.exists()


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "dropped"])
def test_an_engine_closed_or_dropped_is_collected_with_its_pool_and_threads(corpus_tokens, closed):
    # Its finalizers (scheduler, audit, prefetch, tier files) once held the engine itself, so that no engine was
    # ever collected: a process that made engines one after another kept every pool.
    before = set(threading.enumerate())
    engine = Engine(kv_budget="64 blocks", tiers=["host:32 blocks"])
    handle = engine.materialize(corpus_tokens[:200])
    collected, pool = weakref.ref(engine), weakref.ref(engine.pool)
    threads = set(threading.enumerate()) - before
    assert {t.name for t in threads} >= {"kvbaton-scheduler", "kvbaton-prefetch"}
    if closed:
        engine.close()
    del engine, handle
    gc.collect()
    assert collected() is None and pool() is None
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive(), thread.name


def test_budgets_hold_in_every_tier(corpus_tokens):
    engine = Engine(kv_budget="40 blocks", tiers=["host:30 blocks", "disk:20 blocks"], prefetch=False)
    for i in range(6):
        engine.release(engine.complete(corpus_tokens[i * 150 : i * 150 + 150], SamplingParams(max_tokens=2)).handle)
        stats = engine.stats()
        assert stats.blocks_used <= stats.blocks_total == 40
        assert stats.cache.nodes_per_tier["host"] <= 30 and stats.cache.nodes_per_tier["disk"] <= 20
    engine.close()


def test_prefetch_brings_the_next_agent_back_before_it_runs(reference, corpus_tokens):
    """A scripted cycle a -> b -> c -> a whose fixed prompts do not all fit on the device."""
    engine = Engine(kv_budget="30 blocks", tiers=["disk:200 blocks"], lookahead=1)
    graph = StepGraph()
    for src, dst in [("a", "b"), ("b", "c"), ("c", "a")]:
        graph.add_edge(src, dst)
    fixed = {name: corpus_tokens[i * 200 : i * 200 + 192] for i, name in enumerate("abc")}  # 12 blocks each
    for name, tokens in fixed.items():
        engine.register_agent(name, tokens)

    for step, agent in enumerate(["a", "b", "c", "a", "b"]):
        engine.hints(graph, running=[agent])
        engine.prefetcher.idle()
        if step >= 3:  # second round: everything was offloaded at least once
            path = engine.cache.fixed_path(agent)
            assert len(path) == 12 and all(n.state is NodeState.DEVICE for n in path)
        prompt = fixed[agent] + corpus_tokens[900 + step : 905 + step]
        result = engine.complete(prompt, SamplingParams(max_tokens=4, ignore_eos=True), agent=agent)
        assert result.token_ids == dense_greedy(reference, prompt, 4)[0]
        engine.release(result.handle)

    stats = engine.stats()
    assert stats.cache.prefetch_hits > 0 and stats.cache.blocks_prefetched > 0
    assert set(stats.agents) == {"a", "b", "c"}
    # The events tell the same story per agent: what was prefetched, evicted, and found prefetched.
    events = engine.events().events
    prefetched = [e for e in events if e.kind == "prefetch"]
    assert sum(e.blocks for e in prefetched) == stats.cache.blocks_prefetched
    assert all(e.tier == "disk" and e.agent in "abc" for e in prefetched)
    assert any(e.kind == "evict" and e.tier == "disk" for e in events)
    requests = [e for e in events if e.kind == "request"]
    assert [e.agent for e in requests] == ["a", "b", "c", "a", "b"]
    assert sum(e.prefetch_hits for e in requests) == stats.cache.prefetch_hits
    assert all(sum(e.blocks_loaded.values()) * 16 <= e.tokens_reused for e in requests)
    engine.close()


def test_client_tags_agents_and_sends_hints():
    from kvbaton import connect

    with connect(kv_budget="64MiB") as client:
        client.register_agent("writer", [{"role": "system", "content": "You write haiku."}])
        graph = StepGraph()
        graph.add_edge("writer", "critic")
        graph.add_edge("critic", "writer")
        assert client.hints(graph, running=["critic"]) == {"writer": 1, "critic": 0}
        client.generate([{"role": "system", "content": "You write haiku."}, {"role": "user", "content": "Snow"}],
                        agent="writer", max_tokens=3)
        stats = client.stats()
        assert stats.agents["writer"].requests == 1
        assert stats.cache.steps_to_execution == {"writer": 1.0, "critic": 0.0}


def test_bounded_slow_tier_with_prefetch_never_breaks_a_path(reference, corpus_tokens, caplog):
    """Slow tier smaller than the working set: making room may drop nodes of the very path being
    loaded; loading stops there and the rest is recomputed (regression: this used to crash)."""
    engine = Engine(kv_budget="26 blocks", tiers=["disk:14 blocks"], tier_eviction="lru", lookahead=2)
    graph = StepGraph()
    names = ["a", "b", "c", "d"]
    for src, dst in zip(names, names[1:] + names[:1]):
        graph.add_edge(src, dst)
    fixed = {name: corpus_tokens[i * 200 : i * 200 + 160] for i, name in enumerate(names)}  # 10 blocks each
    for name, tokens in fixed.items():
        engine.register_agent(name, tokens)
    with caplog.at_level("ERROR"):
        for step, agent in enumerate(names * 2):
            engine.hints(graph, running=[agent])
            prompt = fixed[agent] + corpus_tokens[1000 + step : 1004 + step]
            result = engine.complete(prompt, SamplingParams(max_tokens=2, ignore_eos=True), agent=agent)
            assert result.token_ids == dense_greedy(reference, prompt, 2)[0]
            engine.release(result.handle)
            engine.prefetcher.idle()
    assert not [r for r in caplog.records if "prefetch" in r.getMessage()]
    stats = engine.stats()
    assert stats.blocks_used <= 26 and stats.cache.nodes_per_tier["disk"] <= 14
    engine.close()
