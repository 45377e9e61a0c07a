"""Which worker runs a request: locality first, balanced by queue length.

- A request on a handle goes to the worker holding it, unless that worker's queue is longer than
  the shortest one by more than ``slack`` requests: then the handle is brought to the least loaded
  worker (by KV transfer or recompute, whichever the cost model predicts cheaper).
- A request without a handle goes to the worker whose recent sequences share the longest prefix
  with its tokens (its prefix cache likely holds them), unless that worker is overloaded likewise;
  with no useful prefix anywhere, to the least loaded worker.

A worker's load is the requests placed on it and not ended yet (:meth:`Placer.place` to
:meth:`Placer.done`), whichever ingress runs them, so that requests placed at the same moment see each other.

The router remembers a bounded number of recent token sequences per worker; this is a hint
about the workers' radix caches, never a correctness input (the engine checks tokens itself).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from kvbaton.handle import common_prefix_length

RECENT_PER_WORKER = 256


class Loaded(Protocol):
    rank: int
    alive: bool


L = TypeVar("L", bound=Loaded)


class Placer:
    def __init__(self, slack: int = 1, min_prefix_tokens: int = 16) -> None:
        self.slack = slack
        self.min_prefix_tokens = min_prefix_tokens
        self._lock = threading.Lock()
        self._recent: dict[int, deque[tuple[int, ...]]] = {}
        self._placing = threading.Lock()  # one placement decision at a time (each takes microseconds)
        self._inflight: dict[int, int] = {}  # requests placed on a worker and not ended yet

    def load(self, w: Loaded) -> int:
        return self._inflight.get(w.rank, 0)

    def place(self, choose: Callable[[], L]) -> L:
        """The worker ``choose()`` picks, counted in its load until :meth:`done`; two requests placed at
        once each see the other."""
        with self._placing:
            worker = choose()
            self._inflight[worker.rank] = self._inflight.get(worker.rank, 0) + 1
        return worker

    def done(self, rank: int) -> None:
        """A request placed on worker ``rank`` ended (or never started)."""
        with self._placing:
            self._inflight[rank] = max(self._inflight.get(rank, 0) - 1, 0)

    def remember(self, rank: int, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        with self._lock:
            self._recent.setdefault(rank, deque(maxlen=RECENT_PER_WORKER)).append(tuple(tokens))

    def forget_worker(self, rank: int) -> None:
        with self._lock:
            self._recent.pop(rank, None)

    def least_loaded(self, workers: Sequence[Loaded], exclude: int | None = None) -> Loaded:
        live = [w for w in workers if w.alive and w.rank != exclude] or [w for w in workers if w.alive]
        if not live:
            raise RuntimeError("no live worker")
        return min(live, key=lambda w: (self.load(w), w.rank))

    def overloaded(self, worker: Loaded, workers: Sequence[Loaded]) -> bool:
        best = self.least_loaded(workers)
        return self.load(worker) > self.load(best) + self.slack

    def for_handle(self, holder: Loaded | None, workers: Sequence[Loaded]) -> Loaded:
        """Where a request on a handle held by ``holder`` (None: lost) should run."""
        if holder is not None and holder.alive and not self.overloaded(holder, workers):
            return holder
        return self.least_loaded(workers)

    def for_tokens(self, tokens: Sequence[int] | None, workers: Sequence[Loaded]) -> Loaded:
        """Where a request without a handle, on these prompt tokens, should run."""
        if tokens:
            best: tuple[int, Loaded] | None = None
            with self._lock:
                for w in workers:
                    if not w.alive:
                        continue
                    match = max((common_prefix_length(seq, tokens) for seq in self._recent.get(w.rank, ())), default=0)
                    if best is None or match > best[0]:
                        best = (match, w)
            if best is not None and best[0] >= self.min_prefix_tokens and not self.overloaded(best[1], workers):
                return best[1]
        return self.least_loaded(workers)
