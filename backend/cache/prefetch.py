"""Proactive prefetch: bring the fixed prompts of agents that run soon back to the device.

On every hint update the engine hands the worker the agents with STE <= look-ahead, soonest
first. The worker loads their slow-tier blocks back through the KV manager's one load-back path
(:meth:`~.kv_manager.KVManager.load_back`: blocks reserved under the engine lock, tier data read
WITHOUT it, so requests keep running, then installed and waiters woken), evicting only nodes that
are needed later than the agent being loaded.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence

from ..events import CacheEvents
from .eviction import StepsToExecution
from .kv_manager import KVManager
from .radix import RadixNode

log = logging.getLogger(__name__)


class Prefetcher:
    def __init__(self, kv: KVManager, ste: Mapping[str, float], events: CacheEvents | None = None) -> None:
        self._kv = kv
        self._ste = ste
        self._events = events  # told of each agent's blocks brought back
        self._wake = threading.Condition()
        self._queue: list[str] = []
        self._busy = False
        self._closed = False
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
        path = self._kv.slow_fixed_path(agent)
        if path:
            loaded: dict[str, int] = {}
            self._kv.load_back(path, allowed=self._later_than(self._ste.get(agent, math.inf)), prefetch=True,
                               loaded=loaded)
            if loaded and self._events is not None:
                self._events.prefetched(agent, loaded)

    def _later_than(self, ste: float) -> Callable[[RadixNode], bool]:
        """Prefetch may evict only nodes needed strictly later than the agent it loads."""
        policy = self._kv.cache.policy  # type: ignore[union-attr]
        if not isinstance(policy, StepsToExecution):
            return lambda node: True
        return lambda node: not node.owners or policy.node_ste(node) > ste
