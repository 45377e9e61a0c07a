"""Proactive prefetch: bring the fixed prompts of agents that run soon back to the device.

On every hint update the engine hands the worker the agents with STE <= look-ahead, soonest
first. The worker reserves pool blocks under the engine lock (evicting only nodes that are needed
later than the agent being loaded), reads the tier data WITHOUT the lock, so requests keep
running, then installs the blocks and wakes requests waiting for them.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence

from .eviction import StepsToExecution
from .radix import NodeState, RadixCache, RadixNode
from .tiers import TierDataError

log = logging.getLogger(__name__)


class Prefetcher:
    def __init__(self, cache: RadixCache, lock: threading.RLock, loaded: threading.Condition,
                 ste: Mapping[str, float]) -> None:
        self._cache = cache
        self._lock = lock
        self._loaded = loaded
        self._ste = ste
        self._wake = threading.Condition()
        self._queue: list[str] = []
        self._busy = False
        self._closed = False
        self.bytes_prefetched = 0
        self.blocks_prefetched = 0
        self._thread = threading.Thread(target=self._run, name="kvbaton-prefetch", daemon=True)
        self._thread.start()

    def submit(self, agents: Sequence[str]) -> None:
        """Replace pending work with these agents (soonest first)."""
        with self._wake:
            self._queue = list(agents)
            self._wake.notify()

    def idle(self, timeout: float = 10.0) -> bool:
        """Wait until the queue is drained (for tests and benchmarks that want a settled cache)."""
        with self._wake:
            return self._wake.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                agent = self._queue.pop(0)
                self._busy = True
            try:
                self._prefetch(agent)
            except Exception:  # a failed prefetch only costs a later reactive load
                log.exception("prefetch of agent %r failed", agent)
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def _prefetch(self, agent: str) -> None:
        ste = self._ste.get(agent, math.inf)
        with self._lock:
            path = self._cache.fixed_path(agent)
            if not any(n.state is NodeState.SLOW for n in path):
                return
            started = self._cache.begin_load(path, allowed=self._later_than(ste))
        loaded: dict[int, object] = {}
        try:
            for node in started:  # the slow part, outside the lock
                try:
                    loaded[id(node)] = self._cache.read(node)
                except TierDataError as exc:
                    log.warning("prefetch: %s; the tokens will be recomputed", exc)
        finally:
            # Every started node is finished, with data or as a failure: requests wait on them.
            with self._lock:
                for node in started:
                    if self._cache.finish_load(node, loaded.get(id(node))):  # type: ignore[arg-type]
                        node.prefetched = True
                        self.blocks_prefetched += 1
                        self.bytes_prefetched += self._cache.pool.shape.bytes_per_block
                self._loaded.notify_all()

    def _later_than(self, ste: float) -> Callable[[RadixNode], bool]:
        """Prefetch may evict only nodes needed strictly later than the agent it loads."""
        policy = self._cache.policy
        if not isinstance(policy, StepsToExecution):
            return lambda node: True
        return lambda node: not node.owners or policy.node_ste(node) > ste
