"""The radix prefix cache on its own (backend/cache/radix.py): a block pool, no model. Identical prefixes are
stored once per partition, eviction takes unreferenced leaves in policy order into the slow tiers, data comes back
bit for bit, and every walk of the tree survives a chain far deeper than Python's recursion limit."""

from __future__ import annotations

import sys

import pytest
import torch
from fakes import tiny_pool
from kvbaton.backend.cache.eviction import LRU
from kvbaton.backend.cache.radix import NodeState, RadixCache
from kvbaton.backend.cache.tiers import HostTier

pytestmark = pytest.mark.unit

BS = 4


def _sequence(pool, tokens):
    """Blocks holding a sequence's K/V (block ``b`` filled with ``b``), as a request would own them."""
    blocks = pool.allocate(len(tokens) // BS)
    for b in blocks:
        pool.k[:, :, b * BS : (b + 1) * BS] = float(b)
        pool.v[:, :, b * BS : (b + 1) * BS] = -float(b)
    return blocks


def test_identical_prefixes_are_stored_once_and_the_sequence_switches_to_the_trees_blocks():
    pool = tiny_pool(16, BS)
    cache = RadixCache(pool, LRU())
    first = _sequence(pool, list(range(12)))
    cache.insert(list(range(12)), first, 3)
    assert [pool.refcount(b) for b in first] == [2, 2, 2]  # the sequence's and the tree's
    second = _sequence(pool, list(range(8)) + [99] * 4)
    cache.insert(list(range(8)) + [99] * 4, second, 3)
    assert second[:2] == first[:2]  # the shared prefix now points at the tree's copy
    assert [n.block for n in cache.match(list(range(8)) + [99] * 4, 12)] == second
    assert cache.device_nodes == 4


def test_a_prefix_is_matched_block_aligned_and_only_in_its_own_scope():
    pool = tiny_pool(16, BS)
    cache = RadixCache(pool, LRU())
    tokens = list(range(10))
    cache.insert(tokens, _sequence(pool, tokens[:8]), 2, partition="a")
    assert len(cache.match(tokens, 10, partition="a")) == 2
    assert len(cache.match(tokens, 7, partition="a")) == 1  # only whole blocks within the limit
    assert cache.match(tokens, 10) == [] and cache.match(tokens, 10, partition="b") == []


def test_eviction_takes_unreferenced_leaves_least_recently_used_first():
    pool = tiny_pool(16, BS)
    cache = RadixCache(pool, LRU())
    old, new = [1] * 8, [2] * 8
    for tokens in (old, new):
        blocks = _sequence(pool, tokens)
        cache.insert(tokens, blocks, 2)
        pool.decref(blocks)  # the request finished: only the tree holds them
    held = cache.match(new, 8)[-1].block
    pool.incref([held])  # a live handle still reads the newest leaf
    assert cache.evict(3) == 2  # old's leaf, then its parent; new's leaf is held, so its parent is no leaf
    assert cache.match(old, 8) == [] and [n.state for n in cache.match(new, 8)] == [NodeState.DEVICE] * 2
    assert pool.num_used == 2 and cache.device_nodes == 2
    pool.decref([held])
    assert cache.evict(3) == 2 and pool.num_used == 0


def test_evicted_blocks_wait_in_a_slow_tier_and_come_back_bit_for_bit():
    pool = tiny_pool(8, BS)
    cache = RadixCache(pool, LRU(), [HostTier(8)])
    tokens = list(range(8))
    blocks = _sequence(pool, tokens)
    expected = [pool.read_block(b) for b in blocks]
    cache.insert(tokens, blocks, 2)
    pool.decref(blocks)
    assert cache.evict(2) == 2 and cache.nodes_in_tier(0) == 2 and pool.num_used == 0
    path = cache.match(tokens, 8)
    assert [n.state for n in path] == [NodeState.SLOW] * 2
    started = cache.begin_load(path)
    for node in started:
        assert cache.finish_load(node, cache.read(node))
    assert all(n.state is NodeState.DEVICE for n in path) and cache.nodes_in_tier(0) == 0
    for node, (k, v) in zip(path, expected):
        got_k, got_v = pool.read_block(node.block)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_a_full_last_tier_drops_its_coldest_block_and_everything_below_it():
    pool = tiny_pool(8, BS)
    cache = RadixCache(pool, LRU(), [HostTier(2)])
    tokens = list(range(12))
    blocks = _sequence(pool, tokens)
    cache.insert(tokens, blocks, 3)
    pool.decref(blocks)
    assert cache.evict(3) == 3
    assert cache.nodes_in_tier(0) == 2 and cache.nodes_dropped >= 1
    assert pool.num_used == 0 and cache.device_nodes == 0


def test_a_chain_deeper_than_the_recursion_limit_is_walked_matched_evicted_and_flushed():
    """A 20,000-block prompt (issue 38: flush crashed with RecursionError at exit after long prompts)."""
    depth = 20_000
    assert depth > sys.getrecursionlimit()
    pool = tiny_pool(depth + 1, block_size=1)
    cache = RadixCache(pool, LRU(), [HostTier(4)])
    tokens = list(range(depth))
    blocks = pool.allocate(depth)
    cache.register_agent("deep", tokens)
    cache.insert(tokens, blocks, depth)
    pool.decref(blocks)
    path = cache.fixed_path("deep")
    assert len(path) == depth and path[-1].owners == {"deep"}
    assert repr(path[-1]).startswith("RadixNode(id=")  # no parent or children in it: no recursion
    assert len(cache.cached_blocks()) == depth
    assert cache.evict(10) == 10  # leaves first: the deepest ten, the tier then drops its coldest
    assert cache.device_nodes == depth - 10
    cache.close()  # flush: drops the whole chain
    assert cache.device_nodes == 0 and pool.num_used == 0 and cache.match(tokens, depth) == []
    assert all(n.state is NodeState.DROPPED for n in path)
