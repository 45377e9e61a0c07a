"""The KV manager, spilling, the slow tiers and prefetch without a model (backend/cache/): a fake runner writes
K/V rows that depend on every token before them (tests/fakes.py), so every test checks the one thing that
matters besides the block counts: a state's K/V, however they got there (shared, copied on write, attached
from the cache, loaded back from host or disk, recomputed after a spill), are the ones a dense pass writes."""

from __future__ import annotations

import pytest
import torch
from fakes import chain, stack
from kvbaton import InvalidRequest, PoolExhausted
from kvbaton.backend.reuse.plan import compute_all
from kvbaton.backend.cache.blockfile import BlockDataError
from kvbaton.backend.cache.prefetch import Prefetcher

pytestmark = pytest.mark.unit

A = list(range(100, 116))  # 16 tokens: 4 blocks of 4
B = list(range(200, 224))  # 24 tokens: 6 blocks


def _dense(s, state):
    """The state's K/V rows and logits are those of a dense pass over its tokens."""
    assert s.runner.rows(state.blocks, state.num_cached) == chain(state.token_ids[: state.num_cached])
    if state.last_logits is not None:
        assert torch.equal(state.last_logits, s.runner.dense_logits(state.token_ids))
    return True


def test_a_child_shares_its_parents_blocks_and_copies_a_partly_filled_one_before_writing_it():
    with stack() as s:
        parent = s.materialize(list(range(1, 11)))  # 10 tokens: the third block is partly filled
        child = s.state([50, 51], parent=parent)
        assert child.blocks == parent.blocks and child.num_cached == 10
        assert [s.pool.refcount(b) for b in parent.blocks] == [3, 3, 2]  # parent, child (and the cache's)
        s.lifecycle.prefill(child)
        assert child.blocks[:2] == parent.blocks[:2] and child.blocks[2] != parent.blocks[2]  # copy-on-write
        assert s.pool.refcount(parent.blocks[2]) == 1
        assert _dense(s, parent) and _dense(s, child)


def test_a_request_attaches_the_longest_cached_prefix_and_computes_only_the_rest():
    with stack() as s:
        s.release(s.materialize(A))
        s.runner.batches.clear()
        state = s.materialize(A + [7, 8, 9])
        assert s.runner.batches == [[3]] and s.kv.counters.hits == {"device": 4}
        assert _dense(s, state)
        again = s.materialize(A)  # the whole prompt is cached: its last block runs again for the logits
        assert s.runner.batches[-1] == [4] and _dense(s, again)


def test_only_exact_cacheable_blocks_enter_the_prefix_cache_and_only_in_their_scope():
    with stack() as s:
        approximate = s.state(A)
        s.lifecycle.run(approximate, compute_all(approximate))
        approximate.exact_len = 5  # K/V from position 5 on were re-aligned, not computed densely
        s.kv.insert(approximate)
        assert len(s.cache.match(A, 16)) == 1  # the one block before position 5
        private = s.state(B)
        private.cacheable = False  # a measurement state
        s.lifecycle.prefill(private)
        assert s.cache.match(B, 24) == []
        s.kv.partition = lambda state: "tenant"
        s.release(s.materialize(B))
        assert s.cache.match(B, 24) == [] and len(s.cache.match(B, 24, partition="tenant")) == 6


def test_reserve_takes_every_block_up_front_and_drop_gives_them_all_back():
    with stack(blocks=16) as s:
        state = s.state(list(range(30)))
        s.kv.reserve(state, 40)
        assert len(state.blocks) == 10 and s.pool.num_used == 10
        s.kv.drop(state)
        s.kv.drop(state)  # idempotent
        assert state.blocks == [] and s.pool.num_used == 0
        with pytest.raises(InvalidRequest, match="can never fit"):
            s.kv.reserve(s.state(list(range(30))), 65)  # more than the whole pool: no retry helps


def test_a_full_pool_spills_the_least_recently_used_idle_handle_and_its_next_use_recomputes_it():
    with stack(blocks=8) as s:
        a, b = s.materialize(A), s.materialize(B[:16])  # the pool is full of live handles
        c = s.materialize(list(range(300, 312)))
        assert s.kv.spiller.spilled == {a.id} and a.blocks == [] and a.num_cached == 0
        assert s.pool.num_used <= 8 and _dense(s, c)
        d = s.materialize([1, 2], parent=a)  # a's next use: recomputed, exactly
        assert _dense(s, d) and s.kv.spiller.handles_spilled == 2  # b made room for it
        with pytest.raises(PoolExhausted, match="spilled"):
            s.kv.read_rows(a, 0, 4)


def test_pinned_blocks_are_never_spilled_and_a_request_that_does_not_fit_gives_everything_back():
    with stack(blocks=8) as s:
        a = s.materialize(list(range(100, 132)))  # all 8 blocks
        s.kv.pin(a.blocks)
        used = s.pool.num_used
        with pytest.raises(PoolExhausted):
            s.materialize(list(range(300, 308)))
        assert s.pool.num_used == used and len(s.handles) == 1
        s.kv.unpin(a.blocks)
        assert _dense(s, s.materialize(list(range(300, 308))))


def test_evicted_blocks_come_back_from_the_host_tier_bit_for_bit():
    with stack(blocks=8, tiers=["host:8 blocks"]) as s:
        s.release(s.materialize(A))
        s.release(s.materialize(B))  # needs 6 blocks: two of A's go to the host tier
        assert s.cache.nodes_in_tier(0) == 2
        state = s.materialize(A + [5])
        assert s.kv.counters.hits["host"] == 2 and s.kv.counters.loaded_on_demand == 2
        assert s.runner.batches[-1] == [1] and _dense(s, state)


def test_a_full_host_tier_moves_its_coldest_block_to_disk_and_both_come_back(tmp_path):
    with stack(blocks=8, tiers=["host:1 blocks", "disk:8 blocks"], tier_root=tmp_path) as s:
        s.release(s.materialize(A))
        s.release(s.materialize(B))
        assert (s.cache.nodes_in_tier(0), s.cache.nodes_in_tier(1)) == (1, 1)
        disk = s.cache.tiers[1]
        assert len(list(disk.dir.glob("*.safetensors"))) == 1
        state = s.materialize(A + [5])
        assert s.kv.counters.loaded_on_demand == 2 and "disk" in s.kv.counters.hits
        assert s.runner.batches[-1] == [1] and _dense(s, state)
    assert not disk.dir.exists() or not list(disk.dir.glob("*.safetensors"))  # close removes the tier's files


def test_a_block_that_cannot_be_read_back_is_recomputed_never_trusted():
    with stack(blocks=8, tiers=["host:8 blocks"]) as s:
        s.release(s.materialize(A))
        s.release(s.materialize(B))
        tier = s.cache.tiers[0]

        def unreadable(key):
            raise BlockDataError(f"block {key} in the host tier is corrupted")

        tier.get = unreadable
        state = s.materialize(A + [5])
        assert s.runner.batches[-1] == [9]  # the first two blocks attached, the rest computed
        assert s.cache.tier_errors == 1 and _dense(s, state)  # the first failure dropped the block below it too


def test_prefetch_brings_an_agents_fixed_prompt_back_before_it_runs():
    with stack(blocks=8, tiers=["host:8 blocks"]) as s:
        s.cache.register_agent("planner", A)
        s.release(s.materialize(A))
        s.release(s.materialize(B))
        assert s.kv.slow_fixed_path("planner")
        prefetcher = Prefetcher(s.kv, s.ste)
        try:
            prefetcher.submit(["planner"])
            assert prefetcher.idle(timeout=10)
        finally:
            prefetcher.close()
        assert s.kv.slow_fixed_path("planner") == [] and s.kv.counters.prefetched == 2
        state = s.materialize(A + [5])
        assert s.kv.counters.prefetch_hits == 2 and s.kv.counters.loaded_on_demand == 0
        assert s.runner.batches[-1] == [1] and _dense(s, state)
