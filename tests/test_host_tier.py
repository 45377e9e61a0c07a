"""The host tier as one slab of block slots (backend/cache/host_tier.py) and the batched mover's copies straight
to and from it (backend/cache/device_ops.py): no memory per block (segments as the slab fills, lowest slots
first), a write-back lands in staged slots that the tier's put claims without a copy, a slot handed out as a
view is reused only once every view of it is gone, and blocks come back bit for bit through the radix cache.
The copy stream, pinned segments and events need a GPU: the CUDA case below is skipped without one (the GPU
benchmark's workflow phase runs them)."""

from __future__ import annotations

import gc

import pytest
import torch
from kvbaton.backend.cache.block_pool import BlockPool, PoolShape
from kvbaton.backend.cache.device_ops import BlockMover
from kvbaton.backend.cache.eviction import LRU
from kvbaton.backend.cache.host_tier import HostTier
from kvbaton.backend.cache.radix import NodeState, RadixCache
from kvbaton.backend.cache.tiers import Tier

pytestmark = pytest.mark.unit

BS = 4
SHAPE = (3, 2, BS, 8)  # one block's K: layers, kv_heads, block_size, head_dim
BLOCK_BYTES = 2 * 3 * 2 * BS * 8 * 4


def _pool(blocks: int = 32, device: str = "cpu") -> BlockPool:
    pool = BlockPool(PoolShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=BS, dtype=torch.float32), blocks,
                     device)
    gen = torch.Generator().manual_seed(blocks)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    return pool


def test_the_slab_is_a_tier_that_allocates_segments_as_it_fills_not_memory_per_block():
    tier = HostTier(10, segment_bytes=4 * BLOCK_BYTES)  # 4 slots per segment: 3 segments
    assert isinstance(tier, Tier) and tier.stats()["allocated_bytes"] == 0
    block = torch.randn(SHAPE), torch.randn(SHAPE)
    for key in range(5):
        tier.put(key, *block)
    assert tier.stats()["segments"] == 2 and tier.stats()["allocated_bytes"] == 8 * BLOCK_BYTES
    for key in range(5, 10):
        tier.put(key, *block)
    assert tier.full and len(tier) == 10 and tier.stats()["segments"] == 3
    tier.delete(3)
    tier.put(99, torch.zeros(SHAPE), torch.ones(SHAPE))  # the freed slot, no new memory
    assert tier.stats()["allocated_bytes"] == 10 * BLOCK_BYTES
    k, v = tier.get(99)
    assert torch.equal(k, torch.zeros(SHAPE)) and torch.equal(v, torch.ones(SHAPE))
    with pytest.raises(ValueError, match="float32 blocks"):  # one tier serves one pool's block shape
        tier.put(5, torch.zeros(2, 2), torch.zeros(2, 2))
    assert len(tier) == 10  # and the refused put lost nothing


def test_a_view_handed_out_stays_valid_after_its_block_is_deleted_until_it_is_dropped():
    tier = HostTier(1)
    tier.put(1, torch.full(SHAPE, 1.0), torch.full(SHAPE, -1.0))
    k, v = tier.get(1)
    tier.delete(1)
    assert tier.full  # the only slot is still read through k and v
    del k
    gc.collect()
    assert tier.full  # v still holds it
    del v
    assert not tier.full
    tier.put(2, torch.full(SHAPE, 2.0), torch.full(SHAPE, -2.0))
    assert torch.equal(tier.get(2)[0], torch.full(SHAPE, 2.0))


def test_a_write_back_lands_in_staged_slots_that_put_claims_without_a_copy():
    pool = _pool()
    tier = HostTier(8)
    mover = BlockMover(pool, batched=True, host=tier)
    blocks = [17, 3, 30]
    data = mover.to_host(blocks)
    assert tier.stats()["staged"] == 3 and len(tier) == 0
    slots = [tier.slot_of(k, v) for k, v in data]
    assert slots == [0, 1, 2] and len(tier.runs(slots)) == 1  # one stretch of the slab: one DMA on a GPU
    for key, (k, v) in zip((10, 11), data[:2]):  # the cache stores two; the third node was dropped meanwhile
        tier.put(key, k, v)
    assert tier.stats()["staged"] == 1 and tier.bytes_written == 2 * BLOCK_BYTES
    del data, k, v
    assert tier.stats()["staged"] == 0 and tier.stats()["free"] == 6
    for key, block in zip((10, 11), blocks):
        k, v = tier.get(key)
        assert tier.slot_of(k, v) is not None
        assert torch.equal(k, pool.read_block(block)[0]) and torch.equal(v, pool.read_block(block)[1])


def test_a_batch_the_slab_has_no_room_for_comes_back_in_host_memory_for_put_to_copy():
    pool = _pool()
    tier = HostTier(2)
    mover = BlockMover(pool, batched=True, host=tier)
    data = mover.to_host([1, 2, 3])
    assert tier.stats()["staged"] == 0 and all(tier.slot_of(k, v) is None for k, v in data)
    assert torch.equal(data[2][0], pool.read_block(3)[0])


def test_a_load_back_reads_runs_of_slots_and_writes_each_block_where_it_belongs():
    source = _pool()
    tier = HostTier(12, segment_bytes=4 * BLOCK_BYTES)
    for key, block in enumerate([9, 1, 22, 23, 5, 6]):
        tier.put(key, *source.read_block(block))
    tier.delete(2)
    data = [tier.get(key) for key in (5, 0, 3, 1, 4)]  # out of slot order, across segments, one slot freed
    slots = [tier.slot_of(k, v) for k, v in data]
    assert slots == [5, 0, 3, 1, 4]
    assert [count for _, count in tier.runs(sorted(slots))] == [2, 1, 2]  # slots 0-1 | 3 (2 is free) | 4-5
    targets = [30, 2, 11, 0, 7]
    batched, per_block = _pool(), _pool()
    BlockMover(batched, batched=True, host=tier).to_device(targets, data)
    BlockMover(per_block).to_device(targets, data)
    assert torch.equal(batched.k, per_block.k) and torch.equal(batched.v, per_block.v)
    assert torch.equal(batched.read_block(30)[0], source.read_block(6)[0])


def test_offload_and_load_back_through_the_slab_come_back_bit_for_bit():
    pool = _pool(16)
    tier = HostTier(16)
    cache = RadixCache(pool, LRU(), [tier], mover=BlockMover(pool, batched=True, host=tier))
    tokens = list(range(6 * BS))
    blocks = pool.allocate(6)
    expected = [pool.read_block(b) for b in blocks]
    cache.insert(tokens, blocks, 6)
    pool.decref(blocks)
    assert cache.evict(6) == 6 and cache.nodes_in_tier(0) == 6 and tier.stats()["stored"] == 6
    assert tier.stats()["staged"] == 0  # every staged slot claimed by the cache's put
    pool.k.zero_()
    pool.v.zero_()
    path = cache.match(tokens, len(tokens))
    started = cache.begin_load(path)
    installed = cache.finish_loads(started, [cache.read(node) for node in started])
    assert installed == path and all(n.state is NodeState.DEVICE for n in path)
    assert tier.stats()["stored"] == 0 and tier.stats()["free"] == 16
    for node, (k, v) in zip(installed, expected):
        got_k, got_v = pool.read_block(node.block)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_the_default_cache_mover_goes_through_its_first_tier_slab():
    pool = _pool(8)
    tier = HostTier(8)
    assert RadixCache(pool, LRU(), [tier]).mover.host is tier
    assert RadixCache(pool, LRU()).mover.host is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy stream, pinned slab and events need a GPU")
def test_on_cuda_the_write_back_and_load_back_are_asynchronous_and_ordered():
    pool = _pool(64, "cuda")
    tier = HostTier(64, pin=True)
    cache = RadixCache(pool, LRU(), [tier])
    tokens = list(range(40 * BS))
    blocks = pool.allocate(40)
    expected = [tuple(t.cpu() for t in pool.read_block(b)) for b in blocks]
    cache.insert(tokens, blocks, 40)
    pool.decref(blocks)
    assert cache.evict(40) == 40 and tier.stats()["pinned"]
    pool.k.zero_()  # on the forward stream, after the gather it waited for
    path = cache.match(tokens, len(tokens))
    started = cache.begin_load(path)
    cache.finish_loads(started, [cache.read(node) for node in started])
    for node, (k, v) in zip(path, expected):
        got_k, got_v = pool.read_block(node.block)  # on the forward stream: after the scatter
        assert torch.equal(got_k.cpu(), k) and torch.equal(got_v.cpu(), v)
