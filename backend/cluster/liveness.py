"""Liveness of the workers: Ray restarts actors that die; this notices a hung one and the restarted ones.

Ray restarts an actor whose process dies, and a call in flight on it fails at once (:mod:`.remote`
marks the worker down). Two things Ray does not do are done here, in one thread, every
``timeout / 5`` seconds, with Ray's own calls: a worker that does not answer ``ping`` (its own
concurrency group, so a busy worker answers) within ``timeout`` seconds is **hung** (stopped,
deadlocked, thrashing): it is marked down and killed with ``ray.kill(no_restart=False)``, so that Ray
restarts it and no request waits on it longer than that; and a worker that is down and answers again
(Ray restarted it) **rejoins** through ``rejoin(worker)``.

Invariants: the thread never waits on one worker longer than the timeout, and on all of them at once;
``close`` stops it within one interval.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import ray

from .remote import WorkerRef

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0


class Liveness:
    def __init__(self, workers: Sequence[WorkerRef], timeout: float, rejoin: Callable[[WorkerRef], None]) -> None:
        if not timeout > 0:
            raise ValueError(f"the liveness timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.interval = min(max(timeout / 5, 0.05), 5.0)
        self._workers, self._rejoin = workers, rejoin
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvbaton-liveness", daemon=True)
        self._pending: dict[int, tuple[object, float]] = {}  # rank -> (ping in flight, when sent)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        import time

        while not self._stop.wait(self.interval):
            now = time.monotonic()
            for w in list(self._workers):
                ref, sent = self._pending.get(w.rank, (None, now))
                if ref is None:
                    self._pending[w.rank] = (w.actor.ping.remote(), now)
                    continue
                ready, _ = ray.wait([ref], timeout=0)
                if ready:
                    del self._pending[w.rank]
                    try:
                        ray.get(ready[0])
                    except Exception:  # noqa: BLE001 - dead (Ray restarts it, or gave up on it)
                        w.lost()
                        continue
                    if not w.alive:
                        try:
                            self._rejoin(w)
                        except Exception:  # noqa: BLE001 - tried again at the next answer
                            log.exception("worker %d answered again but could not rejoin", w.rank)
                elif w.alive and now - sent > self.timeout:
                    del self._pending[w.rank]
                    w.lost(f"answered no liveness ping (heartbeat) for {now - sent:.0f} s and was restarted")
                    ray.kill(w.actor, no_restart=False)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(self.interval * 2, 1.0))
