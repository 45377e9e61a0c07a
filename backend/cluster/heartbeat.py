"""Heartbeats between the coordinator and its workers: a hung worker is found within a deadline.

A dead worker closes its control connection and is noticed at once; a hung one (stopped, deadlocked,
thrashing) keeps it open and answers nothing, and every request on it would wait forever. So the
coordinator sends each live worker a heartbeat every ``timeout / 5`` seconds, which the worker answers
from its connection's own loop (not from a call's thread: a busy worker answers at once), and any
message from a worker counts as a sign of life. A worker silent for ``timeout`` seconds is hung:
``hung(worker, silent_s)`` is called once, and the cluster treats it as dead from then on (its calls
and streams in flight fail over, ``/health`` reports the cluster degraded; see
:meth:`.coordinator.Cluster`).

Invariants: the heartbeat thread never blocks on a worker (a beat that cannot be sent at once is
skipped: the silence still counts); a worker is declared hung at most once; ``close`` stops the
thread within one interval.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvbaton.serverconf import DEFAULT_HEARTBEAT_TIMEOUT_S

from .worker import WorkerClient

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_HEARTBEAT_TIMEOUT_S", "Heartbeat"]


class Heartbeat:
    """The coordinator's heartbeat thread over ``workers`` (the cluster's own list, read each round)."""

    def __init__(self, workers: Sequence[WorkerClient], timeout: float,
                 hung: Callable[[WorkerClient, float], None]) -> None:
        if not timeout > 0:
            raise ValueError(f"the heartbeat timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.interval = min(max(timeout / 5, 0.05), 5.0)
        self._workers, self._hung = workers, hung
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvbaton-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for worker in list(self._workers):
                if not worker.alive:
                    continue
                silent = worker.silent_s()
                if silent > self.timeout:
                    try:
                        self._hung(worker, silent)
                    except Exception:  # the other workers still need their heartbeats
                        log.exception("handling hung worker %d failed", worker.rank)
                else:
                    worker.beat()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(self.interval * 2, 1.0))
