"""The paged, refcounted KV block pool of one device.

A block holds the keys and values of ``block_size`` consecutive tokens for every layer. Storage is
two tensors shaped ``[layers, kv_heads, num_blocks * block_size, head_dim]``: block ``b`` owns
slots ``b*block_size .. (b+1)*block_size - 1`` in every layer. That layout lets attention read one
layer's context for a run of consecutive blocks as a zero-copy view, and as a single
``index_select`` otherwise.

Blocks are shared by reference counting: fork aliases blocks, and a block returns to the free
list when its last reference is dropped. Free blocks are handed out lowest id first, which keeps
a sequence's blocks consecutive in the common case.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from kvbaton.errors import InvalidRequest, PoolExhausted


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * itemsize


class BlockPool:
    """Fixed-capacity KV storage with a refcounted block allocator."""

    def __init__(self, shape: PoolShape, num_blocks: int, device: torch.device | str = "cpu") -> None:
        if num_blocks < 1:
            raise InvalidRequest("the KV budget must hold at least one block")
        self.shape = shape
        self.block_size = shape.block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        size = (shape.num_layers, shape.num_kv_heads, num_blocks * shape.block_size, shape.head_dim)
        # torch.empty: pages are committed only when written, so a large budget costs nothing upfront.
        self.k = torch.empty(size, dtype=shape.dtype, device=self.device)
        self.v = torch.empty(size, dtype=shape.dtype, device=self.device)
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks))  # already a valid min-heap

    # -- allocation -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (refcount 1 each), or raise without taking any."""
        if n > len(self._free):
            raise PoolExhausted(
                f"KV pool exhausted: need {n} blocks, {len(self._free)} of {self.num_blocks} free; "
                "release handles or raise the KV budget"
            )
        blocks = [heapq.heappop(self._free) for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def incref(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"incref of free block {b}")
            self._refs[b] += 1

    def decref(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            refs = self._refs[b]
            if refs <= 0:
                raise RuntimeError(f"decref of free block {b}")
            self._refs[b] = refs - 1
            if refs == 1:
                heapq.heappush(self._free, b)

    # -- data ---------------------------------------------------------------------------------
    def copy_block(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` slots of ``src`` into ``dst`` in every layer (copy-on-write)."""
        bs = self.block_size
        s, d = src * bs, dst * bs
        self.k[:, :, d : d + num_tokens].copy_(self.k[:, :, s : s + num_tokens])
        self.v[:, :, d : d + num_tokens].copy_(self.v[:, :, s : s + num_tokens])

    def read_block(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of one block's K and V, each ``[layers, kv_heads, block_size, head_dim]``."""
        s = block * self.block_size
        return self.k[:, :, s : s + self.block_size].clone(), self.v[:, :, s : s + self.block_size].clone()

    def write_block(self, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        s = block * self.block_size
        self.k[:, :, s : s + self.block_size].copy_(k, non_blocking=True)
        self.v[:, :, s : s + self.block_size].copy_(v, non_blocking=True)

    def slots(self, blocks: Sequence[int], start: int, end: int) -> torch.Tensor | slice:
        """Pool slots of token positions ``start..end-1`` of a sequence with block table ``blocks``.

        Returns a slice when the slots are consecutive (the common case: zero-copy reads and
        plain copies on writes), an index tensor otherwise.
        """
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        table = blocks[first : last + 1]
        if table[-1] - table[0] == len(table) - 1 and all(
            table[i + 1] == table[i] + 1 for i in range(len(table) - 1)
        ):
            base = table[0] * bs - first * bs
            return slice(base + start, base + end)
        ids = torch.tensor(table, dtype=torch.long, device=self.device)
        slot = (ids[:, None] * bs + torch.arange(bs, device=self.device)[None, :]).reshape(-1)
        return slot[start - first * bs : end - first * bs]

    def write(self, layer: int, slots: torch.Tensor | slice, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store one layer's K/V (``[kv_heads, tokens, head_dim]``) at ``slots``."""
        self.k[layer][:, slots] = key
        self.v[layer][:, slots] = value

    def read_rows(self, slots: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of every layer's K/V at ``slots``, each ``[layers, kv_heads, tokens, head_dim]``."""
        if isinstance(slots, slice):
            return self.k[:, :, slots].clone(), self.v[:, :, slots].clone()
        return self.k.index_select(2, slots), self.v.index_select(2, slots)

    def write_rows(self, slots: torch.Tensor | slice, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store every layer's K/V (``[layers, kv_heads, tokens, head_dim]``) at ``slots``."""
        self.k[:, :, slots] = k.to(self.k.dtype)
        self.v[:, :, slots] = v.to(self.v.dtype)

    def move_rows(self, src: torch.Tensor | slice, dst: torch.Tensor | slice,
                  keys: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Copy every layer's K/V at ``src`` slots to (distinct) ``dst`` slots, the keys through ``keys``
        (a RoPE shift), one layer at a time: a few MB in flight rather than a segment's whole K/V."""
        for layer in range(self.k.shape[0]):
            k, v = self.read(layer, src)
            self.write(layer, dst, keys(k), v)

    def read(self, layer: int, slots: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K/V at ``slots`` as ``[kv_heads, tokens, head_dim]``."""
        if isinstance(slots, slice):
            return self.k[layer][:, slots], self.v[layer][:, slots]
        return self.k[layer].index_select(1, slots), self.v[layer].index_select(1, slots)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def memory_share(budget: str) -> tuple[float, str] | None:
    """``(percent, device)`` of a budget given as a share of a GPU's free memory (``"90%"``, ``"90% of cuda:1"``;
    device ``"cuda"`` when it names none), None for any other budget; a share outside (0, 100] is refused."""
    share, _, device = budget.strip().partition(" of ")
    share = share.strip()
    if not share.endswith("%"):
        return None
    try:
        percent = float(share[:-1])
    except ValueError:
        percent = -1.0
    if not 0 < percent <= 100:
        raise InvalidRequest(f"invalid KV budget {budget!r}: a share of free GPU memory is in (0%, 100%], e.g. '90%'")
    return percent, device.strip() or "cuda"


def blocks_for_budget(budget: int | str, bytes_per_block: int) -> int:
    """Number of blocks a KV budget buys: bytes as an int, a string like ``"512MiB"`` or ``"800 blocks"``, or a
    share of a GPU's memory free now (``"90% of cuda:0"``: free plus what torch's allocator holds unused)."""
    if isinstance(budget, bool):
        raise InvalidRequest(f"invalid KV budget {budget!r}")
    if isinstance(budget, int):
        return budget // bytes_per_block
    share = memory_share(budget)
    if share is not None:
        device = torch.device(share[1])
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free * share[0] / 100) // bytes_per_block
    text = budget.strip().lower().replace(" ", "")
    if text.endswith("blocks"):
        count = text.removesuffix("blocks")
        if count.isdigit():
            return int(count)
    else:
        number = text.rstrip("kmgib")
        unit = text[len(number) :]
        try:
            value = float(number)
        except ValueError:
            value = -1.0
        if unit in _UNITS and value >= 0:
            return int(value * _UNITS[unit]) // bytes_per_block
    raise InvalidRequest(f"invalid KV budget {budget!r}: use bytes, e.g. '512MiB' or '2GB', or 'N blocks'")
