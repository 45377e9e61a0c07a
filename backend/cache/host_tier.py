"""The host-RAM tier as one slab of fixed block slots (SGLang HiCache's ``MHATokenToKVPoolHost`` shape).

A tier of ``capacity`` blocks is one slot array: slot ``s`` holds one block's K then V, ``[2, layers, kv_heads,
block_size, head_dim]`` in the pool's dtype, so a run of consecutive slots is one contiguous stretch of memory
and many blocks go between the device and the host in one copy (:class:`~.device_ops.BlockMover`). No memory is
allocated per block. The slab is allocated in segments of :data:`SEGMENT_BYTES` as it first fills, pinned when the
device is a GPU (page-locking a 40 GB tier up front would cost seconds at every engine start and the memory at
once; a segment, once there, stays until the tier closes). A copy runs per contiguous run of slots within one
segment; slots are handed out lowest first, so a batch stored together comes back as one or two runs.

Who may use a slot's memory, and when it may be handed out again:

- :meth:`HostTier.get` returns views of the slot, not copies (a load-back reads the slab directly). A slot
  stays out of reuse while any view it handed out is alive (a finalizer per view counts them) and until the
  device copies recorded against it (:meth:`fence`) have run: the views stay valid for whoever holds them
  exactly as copies would, even after the block is deleted.
- :meth:`stage` hands the mover ``n`` free slots to copy a batch of evicted blocks into directly (an
  asynchronous write-back, fenced by its copy's event); :meth:`put` of a staged slot's own views claims that
  slot for the key without a copy. A staged slot whose views die unclaimed (its node was dropped meanwhile)
  goes back to the free slots. :meth:`get` of a slot still being written waits for that copy.

Blocks live in this process's memory, as the pool's do, so they carry no checksum (the disk tier's do): on a
GPU a CRC of each block cost as much as its copy, on the very path the tier exists to make fast (issue 38).
"""

from __future__ import annotations

import heapq
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .blockfile import BlockDataError

SEGMENT_BYTES = 1 << 30  # slab memory is allocated (and pinned) 1 GiB at a time as the tier fills

Block = tuple[torch.Tensor, torch.Tensor]


class HostTier:
    """Host RAM as one slab of block slots (see the module). ``capacity`` is in blocks; ``pin``: page-locked
    segments (a GPU's DMA reads and writes them at full bandwidth, asynchronously)."""

    name = "host"

    def __init__(self, capacity: int, pin: bool = False, segment_bytes: int = SEGMENT_BYTES) -> None:
        from kvbaton.errors import InvalidRequest

        if capacity < 1:
            raise InvalidRequest(f"the {self.name} tier must hold at least one block")
        self.capacity = capacity
        self.bytes_written = 0
        self.bytes_read = 0
        self.pin = pin
        self._segment_bytes = segment_bytes
        self._lock = threading.Lock()  # get runs outside the engine's lock, on the prefetch thread too
        self._layout: tuple[torch.dtype, tuple[int, ...]] | None = None  # one block's K (and V) shape
        self._per_segment = 0
        self._segments: list[torch.Tensor | None] = []
        self._free = list(range(capacity))  # a valid min-heap: lowest slot first
        self._slot: dict[int, int] = {}  # key -> slot
        self._staged: dict[int, int] = {}  # data_ptr of a staged slot's K view -> slot, until claimed
        self._staged_ptr: dict[int, int] = {}  # the same, slot -> data_ptr
        self._orphans: set[int] = set()  # slots no key holds whose views are still alive
        self._views: dict[int, int] = {}  # slot -> live views handed out
        self._died: list[int] = []  # slots of views that died since the last call (appended by finalizers)
        self._writing: dict[int, Any] = {}  # slot -> the copy (a CUDA event) writing it
        self._reading: dict[int, Any] = {}  # slot -> the last copy reading it

    # -- the Tier interface (tiers.Tier) --------------------------------------------------------------
    @property
    def full(self) -> bool:
        """No slot is free (stored, staged, or no longer stored while views of it are still in use)."""
        with self._lock:
            self._reap()
            return not self._free

    def __len__(self) -> int:
        return len(self._slot)

    def put(self, key: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a block: the staged slot ``k``/``v`` are views of, claimed without a copy, else a free slot."""
        with self._lock:
            self._reap()
            slot = self._staged.pop(k.data_ptr(), None)
            if slot is not None:
                del self._staged_ptr[slot]
                self._forget(key)
                self._slot[key] = slot
            else:
                self._set_layout(k.dtype, tuple(k.shape))
                self._forget(key)
                (slot,) = self._take(1)
                self._slot[key] = slot
                block = self._slot_tensor(slot)
                block[0].copy_(k)
                block[1].copy_(v)
            self.bytes_written += k.nbytes + v.nbytes

    def get(self, key: int) -> Block:
        """Views of the block's K and V (valid while held: see the module)."""
        with self._lock:
            self._reap()
            slot = self._slot.get(key)
            if slot is None:
                raise BlockDataError(f"block {key} is not in the host tier")
            writing = self._writing.pop(slot, None)
            if writing is not None:
                writing.synchronize()  # a write-back still copying into it (almost always done)
            k, v = self._views_of(slot)
            self.bytes_read += k.nbytes + v.nbytes
            return k, v

    def delete(self, key: int) -> None:
        with self._lock:
            self._reap()
            self._forget(key)

    def close(self) -> None:
        with self._lock:
            self._slot.clear()
            self._staged.clear()
            self._staged_ptr.clear()
            self._segments = [None] * len(self._segments)
            self._writing.clear()
            self._reading.clear()
            self._free = list(range(self.capacity))
            self._orphans.clear()

    # -- batched copies (device_ops.BlockMover) ----------------------------------------------------------
    def stage(self, n: int, dtype: torch.dtype, shape: Sequence[int]) -> list[Block] | None:
        """Views of ``n`` free slots (lowest first) for a batch the mover copies straight into, each claimed by
        :meth:`put` of those views; None when fewer are free (the batch then goes through :meth:`put` after
        the cache has made room)."""
        with self._lock:
            self._reap()
            if n > len(self._free):
                return None
            self._set_layout(dtype, tuple(shape))
            out = []
            for slot in self._take(n):
                k, v = self._views_of(slot)
                self._staged[k.data_ptr()] = slot
                self._staged_ptr[slot] = k.data_ptr()
                out.append((k, v))
            return out

    def slot_of(self, k: torch.Tensor, v: torch.Tensor) -> int | None:
        """The slot whose views ``k``/``v`` are (as :meth:`get` and :meth:`stage` give them), else None."""
        if self._layout is None or k.dtype != self._layout[0] or tuple(k.shape) != self._layout[1]:
            return None
        ptr = k.data_ptr()
        if v.data_ptr() != ptr + k.nbytes:
            return None
        for index, memory in enumerate(self._segments):
            if memory is not None and memory.data_ptr() <= ptr < memory.data_ptr() + memory.nbytes:
                offset, rest = divmod(ptr - memory.data_ptr(), 2 * k.nbytes)
                return index * self._per_segment + offset if rest == 0 else None
        return None

    def runs(self, slots: Sequence[int]) -> list[tuple[torch.Tensor, int]]:
        """``slots`` (ascending) as ``(memory, count)``: one per run of consecutive slots within a segment, each
        a contiguous ``[count, 2, *block shape]`` stretch of the slab."""
        out: list[tuple[torch.Tensor, int, int, int]] = []  # (segment, first offset, count, segment index)
        for slot in slots:
            index, offset = divmod(slot, self._per_segment)
            if out and out[-1][3] == index and out[-1][1] + out[-1][2] == offset:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1, index)
            else:
                out.append((self._segment(index), offset, 1, index))
        return [(memory[first : first + count], count) for memory, first, count, _ in out]

    def fence(self, slots: Sequence[int], event: Any, *, writing: bool) -> None:
        """A device copy recorded by ``event`` writes (or reads) ``slots``: no slot is handed out again, nor
        (when written) read by :meth:`get`, before it has run."""
        with self._lock:
            for slot in slots:
                (self._writing if writing else self._reading)[slot] = event

    # -- slots -------------------------------------------------------------------------------------------
    def _set_layout(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        if self._layout is None:
            self._layout = (dtype, shape)
            block_bytes = 2 * torch.empty((), dtype=dtype).element_size() * int(torch.Size(shape).numel())
            self._per_segment = max(1, min(self.capacity, self._segment_bytes // block_bytes))
            self._segments = [None] * -(-self.capacity // self._per_segment)
        elif self._layout != (dtype, shape):
            raise ValueError(f"the host tier holds {self._layout[0]} blocks of {list(self._layout[1])}, "
                             f"not {dtype} blocks of {list(shape)}")

    def _segment(self, index: int) -> torch.Tensor:
        memory = self._segments[index]
        if memory is None:
            assert self._layout is not None
            dtype, shape = self._layout
            count = min(self._per_segment, self.capacity - index * self._per_segment)
            memory = torch.empty((count, 2, *shape), dtype=dtype, pin_memory=self.pin)
            self._segments[index] = memory
        return memory

    def _slot_tensor(self, slot: int) -> torch.Tensor:
        index, offset = divmod(slot, self._per_segment)
        return self._segment(index)[offset]

    def _take(self, n: int) -> list[int]:
        """The ``n`` lowest free slots, each past the copies that last used it."""
        if n > len(self._free):
            raise RuntimeError(f"the host tier has {len(self._free)} free slots, not {n}")
        slots = [heapq.heappop(self._free) for _ in range(n)]
        for slot in slots:
            for fences in (self._writing, self._reading):
                event = fences.pop(slot, None)
                if event is not None:
                    event.synchronize()  # almost always long done
        return slots

    def _forget(self, key: int) -> None:
        slot = self._slot.pop(key, None)
        if slot is not None:
            self._release(slot)

    def _views_of(self, slot: int) -> Block:
        """The slot's K and V as two views, each counted until it dies."""
        block = self._slot_tensor(slot)
        k, v = block[0], block[1]
        self._views[slot] = self._views.get(slot, 0) + 2
        died = self._died
        for view in (k, v):
            weakref.finalize(view, died.append, slot)  # no lock, no work: reaped at the next call
        return k, v

    def _reap(self) -> None:
        """Count the views that died; a slot whose last view died is free when no key holds it."""
        while self._died:
            slot = self._died.pop()
            left = self._views.get(slot, 0) - 1
            if left > 0:
                self._views[slot] = left
                continue
            self._views.pop(slot, None)
            ptr = self._staged_ptr.pop(slot, None)
            if ptr is not None:  # staged, never claimed: its node went meanwhile
                del self._staged[ptr]
                self._orphans.add(slot)
            if slot in self._orphans:
                self._orphans.discard(slot)
                heapq.heappush(self._free, slot)

    def _release(self, slot: int) -> None:
        """A slot no key holds any more: free now, or once its last view has died."""
        if self._views.get(slot, 0) > 0:
            self._orphans.add(slot)
        else:
            heapq.heappush(self._free, slot)

    def stats(self) -> dict[str, Any]:
        """Slots by state and the memory allocated so far (tests, benchmarks)."""
        with self._lock:
            self._reap()
            return {"stored": len(self._slot), "staged": len(self._staged), "orphans": len(self._orphans),
                    "free": len(self._free), "segments": sum(m is not None for m in self._segments),
                    "allocated_bytes": sum(m.nbytes for m in self._segments if m is not None), "pinned": self.pin}
