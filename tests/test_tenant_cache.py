"""Per-tenant prefix-cache isolation: on a multi-tenant server a tenant reuses only the prefix-cache
blocks its own requests computed (so it cannot tell from its reuse or time to first token what another
tenant sent); ``--shared-prefix-cache`` shares them. The radix tree keeps one root per partition.

Model-free radix tests, one engine-level test of both modes, and the session's two-token
``secure_server`` (max_tokens capped at 4) for the server's default. No server of its own."""

from __future__ import annotations

import uuid

import kvbaton
import pytest
import torch
from kvbaton import SamplingParams
from kvbaton.backend.cache.block_pool import BlockPool, PoolShape
from kvbaton.backend.cache.eviction import LRU
from kvbaton.backend.cache.radix import NodeState, RadixCache
from kvbaton.backend.tenants import AgentRef, TenantPartition
from kvbaton.bench.corpus import document
from kvbaton.errors import InvalidRequest
from server_fixtures import TOKEN_A, TOKEN_B

BS = 4
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def fresh_prompt(words: int = 230) -> str:
    """About 1.3 tokens a word (300 by default) no other test sends (the session's server is shared)."""
    return f"[{uuid.uuid4().hex}] " + document(words, seed=11)


# -- the radix tree's partitions (model-free) -------------------------------------------------------------


def tiny_cache(num_blocks: int = 16) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(PoolShape(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS, dtype=torch.float32), num_blocks)
    return pool, RadixCache(pool, LRU())


def cache_in(pool: BlockPool, cache: RadixCache, tokens: list[int], partition: str) -> list[int]:
    blocks = pool.allocate(len(tokens) // BS)
    cache.insert(tokens, blocks, len(blocks), partition)
    pool.decref(blocks)  # the request ends; only the tree keeps them
    return blocks


@pytest.mark.unit
def test_radix_scopes_match_insert_evict_and_flush_apart():
    pool, cache = tiny_cache()
    tokens = list(range(8))
    cache_in(pool, cache, tokens, "a")
    assert len(cache.match(tokens, 8, partition="a")) == 2
    assert cache.match(tokens, 8, partition="b") == [] and cache.match(tokens, 8) == [], "another sees nothing"

    cache_in(pool, cache, tokens, "b")  # the same prefix in another partition: its own copy, not a' blocks
    a_blocks = {n.block for n in cache.match(tokens, 8, partition="a")}
    b_blocks = {n.block for n in cache.match(tokens, 8, partition="b")}
    assert not a_blocks & b_blocks and cache.device_nodes == 4

    # Eviction walks every root (and takes a parent once its leaf is gone, in each partition).
    assert cache.evict(4) == 4 and cache.device_nodes == 0 and pool.num_free == pool.num_blocks
    assert cache.match(tokens, 8, partition="a") == [] and cache.match(tokens, 8, partition="b") == []

    cache_in(pool, cache, tokens, "")
    cache_in(pool, cache, tokens, "b")
    cache.flush()  # every partition
    assert cache.device_nodes == 0 and pool.num_free == pool.num_blocks and not cache.cached_blocks()


@pytest.mark.unit
def test_an_agents_fixed_prompt_is_tagged_and_found_in_its_own_scope():
    pool, cache = tiny_cache()
    fixed = list(range(100, 108))
    cache.register_agent("a/writer", fixed, partition="a")
    cache_in(pool, cache, fixed, "b")  # another tenant's identical prompt: not the agent's nodes
    assert all(not n.owners for n in cache.match(fixed, 8, partition="b"))
    assert cache.fixed_path("a/writer") == []
    cache_in(pool, cache, fixed, "a")
    path = cache.fixed_path("a/writer")
    assert len(path) == 2 and all(n.owners == {"a/writer"} and n.state is NodeState.DEVICE for n in path)


# -- the engine: isolated partitions, and the shared default ----------------------------------------------------


def test_engine_isolates_tenants_prefixes_or_shares_them(engine):
    prompt = engine.tokenize(fresh_prompt(80))
    reusable = (len(prompt) - 1) // engine.block_size * engine.block_size

    engine.partition_tenants(TenantPartition(prefix_cache=True))
    first = engine.complete(prompt, GREEDY, agent=AgentRef("ta"))  # tenant ta's agentless request
    again = engine.complete(prompt, GREEDY, agent=AgentRef("ta", "reader"))  # the same tenant: its own prefix
    other = engine.complete(prompt, GREEDY, agent=AgentRef("tb", "reader"))  # another tenant: nothing of ta's
    assert (first.timings.tokens_reused, again.timings.tokens_reused, other.timings.tokens_reused) == (0, reusable, 0)
    assert first.token_ids == again.token_ids == other.token_ids  # exact either way
    # Whose it is is unknown (no tenant: no agent, or a plain name, whatever it spells): it neither reads nor
    # feeds the cache.
    unknown = engine.complete(prompt, GREEDY, agent="ta/reader")
    assert unknown.timings.tokens_reused == 0 and engine.complete(prompt, GREEDY).timings.tokens_reused == 0

    engine.partition_tenants(TenantPartition())  # shared (the default; the change drops the cache)
    first = engine.complete(prompt, GREEDY, agent=AgentRef("ta"))
    other = engine.complete(prompt, GREEDY, agent=AgentRef("tb"))
    assert (first.timings.tokens_reused, other.timings.tokens_reused) == (0, reusable)
    assert first.token_ids == other.token_ids
    # What an engine shows of a tenant's agent is its label, as before tenants were typed.
    assert {e.agent for e in engine.events(0).events if e.kind == "request"} >= {"ta/", "ta/reader", "tb/reader"}
    engine.release([r.handle for r in (first, other, again, unknown)])


def test_the_server_isolates_by_default_and_shares_on_request(engine, monkeypatch):
    from kvbaton.backend.server import create_app

    set_to = []
    monkeypatch.setattr(engine, "partition_tenants", set_to.append)  # what each app asks of the engine
    create_app(engine, token=["one", "two"])
    create_app(engine, token=["one", "two"], shared_prefix_cache=True)
    create_app(engine, token=["one", "two"], shared_spans=True, shared_prefix_cache=True)
    create_app(engine, token="one")  # one tenant: one prefix-cache partition (its spans are still its own)
    create_app(engine)  # no tokens: everything shared
    assert set_to == [TenantPartition(prefix_cache=True, spans=True), TenantPartition(spans=True), TenantPartition(),
                      TenantPartition(spans=True), TenantPartition()]


@pytest.mark.unit
def test_partitions_follow_the_typed_tenant_not_the_agent_string():
    isolated = TenantPartition(prefix_cache=True, spans=True)
    assert isolated.cache_partition("t-1") == isolated.span_partition("t-1") == "t-1"
    assert isolated.cache_partition(None) is None and isolated.span_partition(None) is None  # no tenant: no partition
    assert TenantPartition().cache_partition("t-1") == TenantPartition().cache_partition(None) == ""  # shared: one
    assert AgentRef.of("t-1/reader") == AgentRef(None, "t-1/reader")  # a plain name is never parsed for a tenant
    assert AgentRef("t-1", "reader").label == "t-1/reader" and AgentRef("t-1").label == "t-1/"
    assert AgentRef.parse("t-1/reader") == AgentRef("t-1", "reader") and AgentRef.parse("solo") == AgentRef(None, "solo")
    with pytest.raises(InvalidRequest, match="tenant"):
        AgentRef.of(AgentRef("a/b", "x"))
    assert TenantPartition(prefix_cache=True).within(isolated) and not isolated.within(TenantPartition(prefix_cache=True))


@pytest.mark.unit
def test_shared_prefix_cache_flag(capsys):
    from kvbaton.cli import build_parser, main

    assert not build_parser().parse_args(["serve"]).shared_prefix_cache
    assert build_parser().parse_args(["serve", "--shared-prefix-cache"]).shared_prefix_cache
    # An engine that cannot keep tenants apart is refused, before loading anything, unless shared explicitly.
    assert main(["serve", "--engine", "sglang", "--token", "a", "--token", "b"]) == 2
    assert "--shared-prefix-cache" in capsys.readouterr().err


# -- the two-tenant server ------------------------------------------------------------------------------


def test_openai_route_agentless_and_tagged_requests_reuse_only_their_tenants_prefix(secure_server):
    def cached(token: str, agent: str | None) -> tuple[int, str]:
        with secure_server.http(token) as http:
            r = http.post("/v1/completions", json=body, headers={"X-Kvbaton-Agent": agent} if agent else {})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], r.json()["choices"][0]["text"]

    for agent in (None, "reader"):
        body = {"prompt": fresh_prompt(), "max_tokens": 4, "temperature": 0.0}
        a_first, a_text = cached(TOKEN_A, agent)
        a_again, _ = cached(TOKEN_A, agent)
        assert a_again > 0, "the same tenant reuses its own prefix"
        b_cached, b_text = cached(TOKEN_B, agent)
        assert b_cached == 0 and b_text == a_text, "tenant B reuses nothing of A's, and answers the same"
    for token in (TOKEN_A, TOKEN_B):
        with secure_server.http(token) as http:
            http.post("/v1/kv/release_all")


def test_native_routes_and_registered_prompts_stay_within_the_tenant(secure_server):
    fixed = fresh_prompt()
    with kvbaton.connect(secure_server.url, token=TOKEN_A) as a, kvbaton.connect(secure_server.url, token=TOKEN_B) as b:
        a.register_agent("writer", fixed, prefill=True)  # computed into tenant A's partition now
        b.register_agent("writer", fixed)
        theirs = b.complete(fixed + " Next,", GREEDY, agent="writer")
        mine = a.complete(fixed + " Next,", GREEDY, agent="writer")
        assert theirs.timings.tokens_reused == 0 and mine.timings.tokens_reused > 0
        assert theirs.token_ids == mine.token_ids
        anon = b.complete(fixed + " Next,", GREEDY)  # B's agentless request: B's own prefix only (just computed)
        assert anon.timings.tokens_reused > 0 and anon.token_ids == mine.token_ids

        # Agentless requests are the tenant's, shown without an agent and never to the other tenant.
        stats = b.stats()
        assert "" not in stats.agents and not any("/" in name for name in stats.agents)
        events = [e for e in b.events(0).events if e.kind == "request" and e.handle_out == anon.handle.id]
        assert len(events) == 1 and events[0].agent is None and events[0].tenant is not None
        assert not [e for e in a.events(0).events if e.handle_out == anon.handle.id]
    for token in (TOKEN_A, TOKEN_B):
        with secure_server.http(token) as http:
            http.post("/v1/kv/release_all")
