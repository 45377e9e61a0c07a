"""Batched block moves (backend/cache/device_ops.py): many blocks between the pool and host memory in one index
copy per K and V. The batched path (CUDA's, forced here on CPU) gives the same bits as the per-block copies CPU
keeps: reading scattered blocks, writing them back, and the radix cache's offload to a slow tier and load-back
through it. The copy stream, pinned memory and events around it need a GPU (the GPU benchmark runs them)."""

from __future__ import annotations

import pytest
import torch
from kvbaton.backend.cache.block_pool import BlockPool, PoolShape
from kvbaton.backend.cache.device_ops import BlockMover
from kvbaton.backend.cache.eviction import LRU
from kvbaton.backend.cache.radix import NodeState, RadixCache
from kvbaton.backend.cache.tiers import HostTier

pytestmark = pytest.mark.unit

BS = 4


def _random_pool(blocks: int = 32) -> BlockPool:
    pool = BlockPool(PoolShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=BS, dtype=torch.float32), blocks)
    gen = torch.Generator().manual_seed(blocks)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    return pool


def test_the_cpu_keeps_per_block_copies_and_cuda_batches_them():
    assert not BlockMover(_random_pool()).batched
    assert BlockMover(_random_pool(), batched=True).batched


def test_a_batched_read_gives_each_blocks_bits_in_order():
    pool = _random_pool()
    blocks = [17, 3, 30, 4, 5, 0]  # scattered, out of order, a consecutive run inside
    batched = BlockMover(pool, batched=True).to_host(blocks)
    single = BlockMover(pool).to_host(blocks)
    assert len(batched) == len(single) == len(blocks)
    for (k, v), (k1, v1), block in zip(batched, single, blocks):
        assert k.shape == (3, 2, BS, 8) and torch.equal(k, k1) and torch.equal(v, v1)
        assert torch.equal(k, pool.k[:, :, block * BS : (block + 1) * BS])
    assert BlockMover(pool, batched=True).to_host([]) == []


def test_a_batched_write_puts_each_block_where_the_per_block_path_does():
    source = _random_pool()
    data = BlockMover(source).to_host([9, 1, 22, 23])
    targets = [5, 31, 0, 6]
    per_block, batched = _random_pool(), _random_pool()
    BlockMover(per_block).to_device(targets, data)
    BlockMover(batched, batched=True).to_device(targets, data)
    assert torch.equal(batched.k, per_block.k) and torch.equal(batched.v, per_block.v)
    for block, (k, v) in zip(targets, data):
        assert torch.equal(batched.read_block(block)[0], k) and torch.equal(batched.read_block(block)[1], v)


@pytest.mark.parametrize("batched", [False, True])
def test_offload_and_load_back_through_a_tier_come_back_bit_for_bit(batched):
    pool = _random_pool(16)
    cache = RadixCache(pool, LRU(), [HostTier(16)], mover=BlockMover(pool, batched=batched))
    tokens = list(range(6 * BS))
    blocks = pool.allocate(6)
    expected = [pool.read_block(b) for b in blocks]
    cache.insert(tokens, blocks, 6)
    pool.decref(blocks)
    assert cache.evict(6) == 6 and cache.nodes_in_tier(0) == 6 and pool.num_used == 0
    pool.k.zero_()
    pool.v.zero_()
    path = cache.match(tokens, len(tokens))
    started = cache.begin_load(path)
    data = [cache.read(node) for node in started]
    data[4] = None  # the tier could not read the 5th block back: it and the block below it are forgotten
    installed = cache.finish_loads(started, data)
    assert installed == path[:4] and [n.state for n in path] == [NodeState.DEVICE] * 4 + [NodeState.DROPPED] * 2
    assert cache.tier_errors == 1 and pool.num_used == 4 and cache.nodes_in_tier(0) == 0
    for node, (k, v) in zip(installed, expected):
        got_k, got_v = pool.read_block(node.block)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
