"""Who holds blocks: the lines of waiting and running requests, admission, growth and preemption.

The scheduler (:mod:`.scheduler`) asks :class:`Lines` three things:

- **admit** the next waiting request: its prompt's blocks are reserved through the KV manager (whose one
  ``reserve`` frees kept KV in one order, :mod:`..cache.store`). One that does not fit waits, first come
  first served, while running requests can give blocks back, at most ``admission_wait_s`` since blocks last
  came back; else it fails with :class:`~kvbaton.PoolExhausted`. While it waits, a tenant holding more than
  its share of the pool (the pool divided among the tenants with requests) has its newest generation
  preempted, so one tenant's long generations cannot hold the pool against the others;
- **grow** a running generation's blocks as it decodes (nothing is reserved for ``max_tokens`` up front); a
  pool short of blocks preempts a generation: of the tenant holding the most blocks, its newest first;
- **preempt**: a generation gives its blocks back (its exact blocks offered to the prefix cache first) and
  goes back in line; re-admitted, it recomputes its tokens from the cache and its lineage, which is exact,
  and goes on where it was. Approximate generations are never preempted: their K/V cannot be recomputed
  identically.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter

from kvbaton.errors import PoolExhausted

from ..cache.kv_manager import KVManager
from ..reuse.plan import compute_all
from .request import Request, Status

PAUSE_GRACE_S = 0.5  # a paused generation counts on to give blocks back for this long


class Lines:
    def __init__(self, kv: KVManager, admission_wait_s: float = 30.0) -> None:
        self.kv = kv
        self.admission_wait_s = admission_wait_s
        self.waiting: list[Request] = []  # by arrival
        self.running: list[Request] = []  # by admission
        self.waiting_since: dict[int, float] = {}  # a request that did not fit: since when it waits
        self.paused_since: dict[int, float] = {}  # a generation its consumer does not read: since when
        self.preemptions = 0

    def enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: r.arrival)

    def remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.paused_since.pop(id(request), None)
        self.waiting_since.pop(id(request), None)

    def admit(self, request: Request, now: float) -> bool:
        """Reserve a waiting request's prompt blocks and make it running: True, or False while it must wait.
        Raises what fails it (:class:`PoolExhausted` once it has waited long enough, or nothing could free
        blocks; :class:`~kvbaton.InvalidRequest`; a tier failure); it is out of the line then."""
        state = request.state
        try:
            if request.preemptions:  # what the prefix cache kept of it when it was preempted
                self.kv.attach(state)
            # A generation's first decode write too: a block it shares with its parent is copied now.
            self.kv.reserve(state, state.num_tokens + (1 if request.generates else 0))
        except PoolExhausted:
            since = self.waiting_since.setdefault(id(request), now)
            self._make_room(request)
            if now - max(since, self.kv.last_back) < self.admission_wait_s and self._progressing(now):
                return False
            self.remove(request)
            raise
        except BaseException:
            self.remove(request)
            raise
        self.waiting.remove(request)
        self.waiting_since.pop(id(request), None)
        request.status = Status.PROMPT
        request.t_admitted = time.time()
        self.running.append(request)
        return True

    def grow(self, request: Request, upto: int) -> list[Request]:
        """Blocks for a running request's positions below ``upto``; the generations preempted to make room.
        Raises :class:`PoolExhausted` when no preemption can."""
        state = request.state
        preempted: list[Request] = []
        if upto <= len(state.blocks) * self.kv.block_size:
            return preempted
        while True:
            try:
                self.kv.reserve(state, upto)
                return preempted
            except PoolExhausted:
                victim = self._victim(exclude=request)
                if victim is None:
                    raise
                self.preempt(victim)
                preempted.append(victim)

    def preempt(self, request: Request) -> None:
        state = request.state
        self.kv.insert(state)
        self.kv.release_blocks(state)
        self.running.remove(request)
        self.paused_since.pop(id(request), None)
        request.status = Status.WAITING
        request.preemptions += 1
        request.program = compute_all(state)
        request.need = None
        self.enqueue(request)
        self.preemptions += 1

    def _progressing(self, now: float) -> bool:
        """Some running request will give blocks back: not only ones whose consumers left them paused."""
        return any(now - self.paused_since.get(id(r), now) < PAUSE_GRACE_S for r in self.running)

    def _held(self) -> Counter[str | None]:
        held: Counter[str | None] = Counter()
        for r in self.running:
            held[r.tenant] += len(r.state.blocks)
        return held

    def _victim(self, exclude: Request, tenant: str | None = None, any_tenant: bool = True) -> Request | None:
        """The generation to preempt: exact ones only, of ``tenant`` (or of the tenant holding the most blocks),
        its newest first."""
        held = self._held()
        candidates = [r for r in self.running if r is not exclude and r.status is Status.DECODING
                      and r.state.exact_len is None and (any_tenant or r.tenant == tenant)]
        if not candidates:
            return None
        return max(candidates, key=lambda r: (held[r.tenant], r.arrival))

    def _make_room(self, waiter: Request) -> None:
        tenants = {r.tenant for r in self.running} | {waiter.tenant}
        if len(tenants) < 2:
            return
        greedy, blocks = max(self._held().items(), key=lambda item: item[1])
        if greedy != waiter.tenant and blocks > self.kv.pool.num_blocks / len(tenants):
            victim = self._victim(exclude=waiter, tenant=greedy, any_tenant=False)
            if victim is not None:
                self.preempt(victim)
