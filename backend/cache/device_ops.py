"""Moving many KV blocks between the pool and host memory at once: the slow tiers' offload and load-back
(a request's miss and prefetch alike) and filling a state from exported blocks.

The pool's K (and V) is ``[layers, kv_heads, blocks * block_size, head_dim]``; viewed as ``[layers, kv_heads,
blocks, block_size, head_dim]``, a set of blocks is one ``index_select`` (out) or one ``index_copy_`` (in)
along the block axis, whatever their number: no per-block kernel. A block's host copy is ``[layers, kv_heads,
block_size, head_dim]`` for K and for V, the layout :meth:`~.block_pool.BlockPool.read_block` gives and the
tiers store. With the host tier's slab (:mod:`.host_tier`) the blocks go straight between the pool and the
tier's slots: one gather into a device staging buffer and one DMA per run of consecutive slots (usually one),
in either direction, and no host copy.

On CUDA every copy runs on a copy stream of its own, ordered against the stream the forwards run on (the
calling thread's current stream: the default stream) by explicit waits, never by an incidental sync:

- :meth:`BlockMover.to_host` (write-back): the copy stream waits for the forwards enqueued so far (they may
  still write these blocks), gathers the blocks, and the forward stream waits for that gather (the blocks are
  given out again as soon as this returns). With the slab, the DMA into the staged slots is left running:
  asynchronous write-back, the slots fenced by its event (the tier waits for it before anyone reads or reuses
  them). Without it (no slab tier, or no free slots) the blocks come back in pinned memory, waited for.
- :meth:`BlockMover.to_device` (load-back, prefetch): the DMA from the slab (or from pinned memory the blocks
  were stacked into) starts at once; the copy stream then waits for the forwards enqueued so far (a fresh
  block may still be read by one of them) before scattering into the pool, and the forward stream waits for
  the scatter, so the forward that reads these blocks runs after it while the forward already running goes
  on. The host never waits: the slab's slots are fenced by the DMA's event until it has run. Prefetch thus
  overlaps compute on the GPU as well as on the host.

The blocks written must be reserved by the caller (nobody else writes them meanwhile) and the blocks read
must not be written concurrently (the radix cache evicts only blocks nothing else references). On CPU the
calls keep the per-block copies of :class:`~.block_pool.BlockPool` unless asked to batch (as fast or faster
there: see :class:`BlockMover`). Bits are unchanged either way: a block comes back exactly as it was read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .block_pool import BlockPool

Block = tuple[torch.Tensor, torch.Tensor]


class BlockMover:
    """Block copies for one pool (see the module). ``batched``: one index copy per K and V for any number of
    blocks (default: on CUDA only; on CPU per-block copies were as fast reading and faster writing, measured
    with the default model's blocks, so CPU keeps them). ``host``: the host tier's slab (a
    :class:`~.host_tier.HostTier`) that batched copies go straight to and from. One copy stream per mover on
    CUDA."""

    def __init__(self, pool: BlockPool, batched: bool | None = None, host: Any = None) -> None:
        self.pool = pool
        self._cuda = pool.device.type == "cuda"
        self.batched = self._cuda if batched is None else batched
        self.host = host if host is not None and hasattr(host, "stage") else None
        self._stream: torch.cuda.Stream | None = None  # created at first use: constructing touches no device
        layers, heads, _, dim = pool.k.shape
        self.block_shape = (layers, heads, pool.block_size, dim)  # one block's K (and V)

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

    # -- out: write-back --------------------------------------------------------------------------
    def to_host(self, blocks: Sequence[int]) -> list[Block]:
        """Host copies of the blocks' K and V, in order: views of the host tier's staged slots (claimed by its
        ``put``), else of one batch copy (whoever keeps one copies it), else per-block copies."""
        if not blocks:
            return []
        if not self.batched:
            return [self.pool.read_block(b) for b in blocks]
        n = len(blocks)
        staged = self.host.stage(n, self.pool.k.dtype, self.block_shape) if self.host is not None else None
        if not self._cuda:
            ids = torch.tensor(list(blocks), dtype=torch.long)
            k, v = (self.gather(t, ids) for t in (self.pool.k, self.pool.v))
            if staged is None:
                return list(zip(k.unbind(0), v.unbind(0)))
            for i, (slot_k, slot_v) in enumerate(staged):
                slot_k.copy_(k[i])
                slot_v.copy_(v[i])
            return staged
        forward = torch.cuda.current_stream(self.pool.device)
        stream = self._copy_stream()
        stream.wait_stream(forward)  # the forwards enqueued so far may still be writing these blocks
        with torch.cuda.stream(stream):
            staging = self._gather_both(torch.tensor(list(blocks), dtype=torch.long).to(self.pool.device))
            gathered = torch.cuda.Event()
            gathered.record(stream)
        forward.wait_event(gathered)  # the blocks are given out again as soon as this returns
        if staged is not None:
            slots = [self.host.slot_of(k, v) for k, v in staged]
            with torch.cuda.stream(stream):
                at = 0
                for memory, count in self.host.runs(slots):  # one DMA per run of consecutive slots
                    memory.copy_(staging[at : at + count], non_blocking=True)
                    at += count
                written = torch.cuda.Event()
                written.record(stream)
            self.host.fence(slots, written, writing=True)  # left running: the tier waits before reading it
            return staged
        pinned = torch.empty(staging.shape, dtype=staging.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            pinned.copy_(staging, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()  # the caller reads these on the host (the tier's put copies them)
        return [(pinned[i, 0], pinned[i, 1]) for i in range(n)]

    def _gather_both(self, ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``ids`` of K and V as one ``[blocks, 2, *block shape]`` buffer (on the current stream)."""
        staging = torch.empty((len(ids), 2, *self.block_shape), dtype=self.pool.k.dtype, device=self.pool.device)
        for which, t in enumerate((self.pool.k, self.pool.v)):
            staging[:, which].copy_(self._blocked(t).index_select(2, ids).permute(2, 0, 1, 3, 4))
        return staging

    # -- in: load-back ----------------------------------------------------------------------------
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
        host = self.host
        slots = [host.slot_of(k, v) if host is not None else None for k, v in data]
        from_slab = sorted((slot, i) for i, slot in enumerate(slots) if slot is not None)
        others = [i for i, slot in enumerate(slots) if slot is None]
        forward = torch.cuda.current_stream(device)
        stream = self._copy_stream()
        with torch.cuda.stream(stream):
            staging = torch.empty((len(blocks), 2, *self.block_shape), dtype=self.pool.k.dtype, device=device)
            at = 0
            if from_slab:
                assert host is not None
                for memory, count in host.runs([slot for slot, _ in from_slab]):  # one DMA per run
                    staging[at : at + count].copy_(memory, non_blocking=True)
                    at += count
            if others:  # blocks from elsewhere (a disk tier, an export): stacked in pinned memory, one DMA
                pinned = torch.empty((len(others), 2, *self.block_shape), dtype=staging.dtype, pin_memory=True)
                for j, i in enumerate(others):
                    pinned[j, 0].copy_(data[i][0])
                    pinned[j, 1].copy_(data[i][1])
                staging[at:].copy_(pinned, non_blocking=True)  # torch keeps ``pinned`` until this has run
            read = torch.cuda.Event()
            read.record(stream)
            order = [blocks[i] for _, i in from_slab] + [blocks[i] for i in others]
            ids = torch.tensor(order, dtype=torch.long).to(device, non_blocking=True)
        stream.wait_stream(forward)  # a fresh block may still be read by a forward in flight
        with torch.cuda.stream(stream):
            for which, t in enumerate((self.pool.k, self.pool.v)):
                self.scatter(t, ids, staging[:, which])
            done = torch.cuda.Event()
            done.record(stream)
        forward.wait_event(done)  # forwards enqueued from now on see the blocks
        if from_slab:
            assert host is not None
            host.fence([slot for slot, _ in from_slab], read, writing=False)  # not reused before the DMA ran
