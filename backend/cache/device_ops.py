"""Moving many KV blocks between the pool and host memory at once: the slow tiers' offload and load-back
(a request's miss and prefetch alike) and filling a state from exported blocks.

The pool's K (and V) is ``[layers, kv_heads, blocks * block_size, head_dim]``; viewed as ``[layers, kv_heads,
blocks, block_size, head_dim]``, a set of blocks is one ``index_select`` (out) or one ``index_copy_`` (in)
along the block axis, whatever their number: no per-block kernel. A block's host copy is ``[layers, kv_heads,
block_size, head_dim]``, the layout :meth:`~.block_pool.BlockPool.read_block` gives and the tiers store.

On CUDA the copies run on a copy stream of their own, so they overlap the forward running on the default
stream:

- :meth:`BlockMover.to_host`: the blocks gathered on the device, copied into pinned host memory in one
  transfer; the caller waits for that transfer only (the blocks may be freed as soon as it returns);
- :meth:`BlockMover.to_device`: each block's host copy into a device staging buffer (from pinned memory: DMA
  at full bandwidth, the host does not wait), one ``index_copy_`` into the pool, and an event the default
  stream waits on, so any forward enqueued afterwards (the one that reads these blocks) runs after the copy,
  while the forward already running goes on. Pinned sources stay valid until their copy ran: PyTorch's
  pinned-memory allocator holds a block until the copies recorded on it are done.

The blocks written must be reserved by the caller (nobody else writes them meanwhile) and the blocks read
must not be written concurrently (the radix cache evicts only blocks nothing else references). On CPU the
calls keep the per-block copies of :class:`~.block_pool.BlockPool` (as fast or faster there: see
:class:`BlockMover`). Bits are unchanged either way: a block comes back exactly as it was read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .block_pool import BlockPool

Block = tuple[torch.Tensor, torch.Tensor]


class BlockMover:
    """Block copies for one pool (see the module). ``batched``: one index copy per K and V for any number of
    blocks (default: on CUDA only; on CPU per-block copies were as fast reading and faster writing, measured
    with the default model's blocks, so CPU keeps them). One copy stream per mover on CUDA."""

    def __init__(self, pool: BlockPool, batched: bool | None = None) -> None:
        self.pool = pool
        self._cuda = pool.device.type == "cuda"
        self.batched = self._cuda if batched is None else batched
        self._stream: torch.cuda.Stream | None = None  # created at first use: constructing touches no device

    def _copy_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.pool.device)
        return self._stream

    def _blocked(self, t: torch.Tensor) -> torch.Tensor:
        """A pool tensor viewed as ``[layers, kv_heads, blocks, block_size, head_dim]``."""
        layers, heads, _, dim = t.shape
        return t.view(layers, heads, self.pool.num_blocks, self.pool.block_size, dim)

    def gather(self, t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``ids`` of pool tensor ``t`` as ``[blocks, layers, kv_heads, block_size, head_dim]``: one index copy."""
        return self._blocked(t).index_select(2, ids).permute(2, 0, 1, 3, 4).contiguous()

    def scatter(self, t: torch.Tensor, ids: torch.Tensor, staged: torch.Tensor) -> None:
        """Write ``staged`` (``[blocks, layers, kv_heads, block_size, head_dim]``) into blocks ``ids`` of ``t``."""
        self._blocked(t).index_copy_(2, ids, staged.permute(1, 2, 0, 3, 4))

    def to_host(self, blocks: Sequence[int]) -> list[Block]:
        """Host copies of the blocks' K and V, in order (batched: views of one batch copy; whoever keeps one
        copies it)."""
        if not blocks:
            return []
        if not self.batched:
            return [self.pool.read_block(b) for b in blocks]
        ids = torch.tensor(list(blocks), dtype=torch.long, device=self.pool.device)
        if not self._cuda:
            k, v = (self.gather(t, ids) for t in (self.pool.k, self.pool.v))
            return list(zip(k.unbind(0), v.unbind(0)))
        stream = self._copy_stream()
        with torch.cuda.stream(stream):
            host = []
            for t in (self.pool.k, self.pool.v):
                gathered = self.gather(t, ids)
                pinned = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                pinned.copy_(gathered, non_blocking=True)
                host.append(pinned)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        return list(zip(host[0].unbind(0), host[1].unbind(0)))

    def to_device(self, blocks: Sequence[int], data: Sequence[Block]) -> None:
        """Write each block's host K and V (``[layers, kv_heads, block_size, head_dim]``) into ``blocks``."""
        if not blocks:
            return
        assert len(blocks) == len(data)
        if not self.batched:
            for block, (k, v) in zip(blocks, data):
                self.pool.write_block(block, k, v)
            return
        if not self._cuda:
            ids = torch.tensor(list(blocks), dtype=torch.long)
            for which, t in enumerate((self.pool.k, self.pool.v)):
                self.scatter(t, ids, torch.stack([block[which] for block in data]).to(t.dtype))
            return
        device = self.pool.device
        stream = self._copy_stream()
        with torch.cuda.stream(stream):
            ids = torch.tensor(list(blocks), dtype=torch.long).to(device, non_blocking=True)
            for which, t in enumerate((self.pool.k, self.pool.v)):
                staging = torch.empty((len(blocks), *data[0][which].shape), dtype=t.dtype, device=device)
                for i, block in enumerate(data):
                    staging[i].copy_(block[which], non_blocking=True)  # one DMA per host buffer, no kernel
                self.scatter(t, ids, staging)
            done = torch.cuda.Event()
            done.record(stream)
        torch.cuda.default_stream(device).wait_event(done)  # forwards enqueued from now on see the blocks
