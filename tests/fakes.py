"""A model runner without a model, and the memory subsystem wired over it, for model-free unit tests.

:class:`FakeRunner` implements :class:`~kvbaton.backend.compute.runner.ModelRunner` the way a causal model
behaves, at no cost: the K/V row it writes for position ``p`` is a hash of the row at ``p - 1`` (read back
from the pool) and token ``p``, and a token's logits are random but determined by its row. So, as with a
real model, a token's K/V and logits depend on every token before it and on nothing else; a prefix
attached from the cache, a chunked prefill or a forked handle gives exactly the logits a cold, dense pass
gives (:meth:`FakeRunner.dense_logits`), and a wrong block (a missed copy-on-write, a block loaded back
from the wrong place) gives other logits. A row that is not one the fake wrote (every layer, K and V, the
same value) fails the forward. Tokens are plain ints; there is no tokenizer to download.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kvbaton.backend.cache.block_pool import BlockPool, PoolShape
from kvbaton.backend.cache.kv_manager import KVManager, prefix_cache_for
from kvbaton.backend.cache.radix import RadixCache
from kvbaton.backend.cache.sequence import KVState
from kvbaton.backend.cache.tiers import claim_tiers
from kvbaton.backend.compute.loader import LoadedModel
from kvbaton.backend.compute.runner import Chunk
from kvbaton.backend.events import EventRing
from kvbaton.backend.handles import HandleTable, Identity
from kvbaton.backend.runtime.lifecycle import Lifecycle
from kvbaton.backend.runtime.scheduler import Scheduler
from kvbaton.handle import LineageStep, Op, Placement, Positions

VOCAB = 64
ROOT = 12_345  # the "row" before position 0
_MODULUS = 16_777_213  # a prime below 2**24: every hash is exact in float32


def _mix(previous: int, token: int) -> int:
    return (previous * 1_000_003 + token * 7_919 + 1) % _MODULUS


def chain(tokens: Sequence[int], previous: int = ROOT) -> list[int]:
    """The rows a dense pass writes for ``tokens`` behind the row ``previous``."""
    rows = []
    for token in tokens:
        previous = _mix(previous, int(token))
        rows.append(previous)
    return rows


def logits_of(row: int, vocab: int = VOCAB) -> torch.Tensor:
    """The fp32 logits ``[vocab]`` after a token whose K/V row is ``row``."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(row))


def greedy(tokens: Sequence[int], n: int) -> list[int]:
    """What greedy decoding of ``n`` tokens after ``tokens`` gives, from a dense pass."""
    row, out = chain(tokens)[-1], []
    for _ in range(n):
        out.append(int(torch.argmax(logits_of(row))))
        row = chain(out[-1:], row)[0]
    return out


class FakeRunner:
    """:class:`~kvbaton.backend.compute.runner.ModelRunner` without weights (see the module).

    ``batches`` records every forward's chunk sizes, in order (what the scheduler packed together).
    """

    def __init__(self, pool: BlockPool, vocab: int = VOCAB) -> None:
        if pool.k.dtype != torch.float32:
            raise ValueError("the fake runner's rows are exact in float32 only")
        self.pool = pool
        self.vocab = vocab
        self.batches: list[list[int]] = []
        self.deviations = 0
        self.fail: BaseException | None = None  # raised by the next forward (then cleared)

    def forward(self, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        self.batches.append([len(c.token_ids) for c in chunks])
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        out = []
        for chunk in chunks:
            positions = (list(chunk.positions) if chunk.positions is not None
                         else list(range(chunk.start, chunk.start + len(chunk.token_ids))))
            rows = self._write(chunk.blocks, positions, chunk.token_ids)
            logits = [logits_of(r, self.vocab) for r in (rows if chunk.all_logits else rows[-1:])]
            out.append(torch.stack(logits) if chunk.all_logits else logits[0])
        return out

    def deviation(self, blocks: Sequence[int], start: int, token_ids: Sequence[int]) -> torch.Tensor:
        """1.0 for each token whose row differs from what the real context before ``start`` gives, else 0.0."""
        self.deviations += 1
        expected = chain(token_ids, self.row(blocks, start - 1) if start > 0 else ROOT)
        return torch.tensor([float(self.row(blocks, start + i) != e) for i, e in enumerate(expected)])

    # -- rows in the pool -------------------------------------------------------------------------
    def row(self, blocks: Sequence[int], position: int) -> int:
        """The row at ``position`` of the sequence with block table ``blocks``; fails on one the fake did not write."""
        slot = self.slot(blocks, position)
        k, v = self.pool.k[:, :, slot], self.pool.v[:, :, slot]
        value = k.flatten()[0]
        if not (bool((k == value).all()) and bool((v == value).all())):
            raise AssertionError(f"position {position} (slot {slot}) holds K/V the fake runner did not write")
        return int(value)

    def rows(self, blocks: Sequence[int], n: int) -> list[int]:
        return [self.row(blocks, p) for p in range(n)]

    def dense_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """The logits after ``tokens`` computed from scratch (the dense reference)."""
        return logits_of(chain(tokens)[-1], self.vocab)

    def _write(self, blocks: Sequence[int], positions: list[int], tokens: Sequence[int]) -> list[int]:
        written: dict[int, int] = {}
        for p, token in zip(positions, tokens):
            previous = written[p - 1] if p - 1 in written else (self.row(blocks, p - 1) if p > 0 else ROOT)
            written[p] = _mix(previous, int(token))
        slots = torch.tensor([self.slot(blocks, p) for p in positions])
        values = torch.tensor([written[p] for p in positions], dtype=torch.float32)
        layers, heads, _, dim = self.pool.k.shape
        rows = values[None, None, :, None].expand(layers, heads, len(positions), dim)
        self.pool.write_rows(slots, rows, rows)
        return [written[p] for p in positions]

    def slot(self, blocks: Sequence[int], position: int) -> int:
        """The pool slot of ``position`` in the sequence with block table ``blocks``."""
        bs = self.pool.block_size
        return blocks[position // bs] * bs + position % bs


class FakeTokenizer:
    """Token ``i`` reads ``<i>``."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def fake_loaded(vocab: int = VOCAB, eos: Sequence[int] = ()) -> LoadedModel:
    """What the lifecycle needs to know of a model, for a model that does not exist."""
    return LoadedModel(
        name="fake", path=Path("fake"), model=None, tokenizer=FakeTokenizer(), dtype=torch.float32,
        device=torch.device("cpu"), fingerprint="f" * 32, tokenizer_fingerprint="t" * 32, rope_type="default",
        rope_theta=10000.0, rope_parameters={}, max_context=1 << 20, num_layers=2, num_kv_heads=1, head_dim=2,
        vocab_size=vocab, eos_token_ids=frozenset(eos),
    )


def tiny_pool(blocks: int, block_size: int = 4) -> BlockPool:
    return BlockPool(PoolShape(num_layers=2, num_kv_heads=1, head_dim=2, block_size=block_size, dtype=torch.float32),
                     blocks)


@dataclass
class Stack:
    """The memory subsystem and the runtime of one engine, over a :class:`FakeRunner`."""

    pool: BlockPool
    cache: RadixCache | None
    kv: KVManager
    runner: FakeRunner
    scheduler: Scheduler
    handles: HandleTable[KVState]
    lifecycle: Lifecycle
    ste: dict[str, float] = field(default_factory=dict)

    def state(self, tokens: Sequence[int], parent: KVState | None = None, keep: int | None = None) -> KVState:
        """A new request's state: ``tokens`` behind ``parent``'s first ``keep`` tokens (all by default)."""
        if parent is None:
            return self.kv.share(None, 0, tokens, LineageStep(op=Op.MATERIALIZE, token_ids=tuple(tokens)))
        keep = parent.num_tokens if keep is None else keep
        step = LineageStep(op=Op.EXTEND, parent=parent.id, token_ids=tuple(tokens))
        return self.kv.share(parent, keep, tokens, step)

    def materialize(self, tokens: Sequence[int], parent: KVState | None = None) -> KVState:
        """Prefill ``tokens`` (behind ``parent``) into a live handle; its state."""
        state = self.state(tokens, parent)
        self.lifecycle.prefill(state)
        return state

    def release(self, state: KVState) -> None:
        with self.kv.lock:
            self.handles.release(state.id)
            self.kv.drop(state)

    def logits(self, state: KVState) -> torch.Tensor:
        """The state's next-token logits as the runner computed them."""
        assert state.last_logits is not None
        return state.last_logits


@contextmanager
def stack(
    blocks: int = 64, block_size: int = 4, *, prefix_cache: bool = True, tiers: Sequence[str] = (),
    tier_root: Path | None = None, eviction: str = "lru", prefill_chunk: int = 16, max_batch_tokens: int = 64,
    **scheduling: Any,
) -> Iterator[Stack]:
    """An engine's pieces wired as the engine wires them, over a fake runner (closed on exit)."""
    pool = tiny_pool(blocks, block_size)
    ste: dict[str, float] = {}
    cache = None
    if prefix_cache:
        claimed = claim_tiers(tiers, root=tier_root)
        cache = prefix_cache_for(pool, ste, eviction, claimed)
    handles: HandleTable[KVState] = HandleTable(Identity(
        model="fake", fingerprint="f" * 32, tokenizer_fingerprint="t" * 32,
        positions=Positions(rope_type="default", rope_theta=10000.0), placement=Placement(device="cpu"),
    ))
    kv = KVManager(pool, cache, threading.RLock(), live=handles.states)
    runner = FakeRunner(pool)
    scheduler = Scheduler(runner, kv, max_batch_tokens=max_batch_tokens, prefill_chunk=prefill_chunk,
                          **scheduling)
    lifecycle = Lifecycle(kv, scheduler, handles, fake_loaded(), EventRing(256))
    try:
        yield Stack(pool, cache, kv, runner, scheduler, handles, lifecycle, ste)
    finally:
        scheduler.close()
        if cache is not None:
            cache.close()
