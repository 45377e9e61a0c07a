"""Sampled online fidelity check of approximate answers, off the request path.

``reuse="auto"`` answers from re-aligned, partly recomputed K/V; the benchmark measures how often
that changes the first token, but a deployment's prompts are not the benchmark's. So a fraction of
approximate requests (every ``1/fraction``-th, deterministic) is checked after it answered: a
background thread runs the same prompt exactly (``reuse="exact"``: the prefix cache only ever holds
exact K/V) and compares the next-token argmax with the one the approximate request saw. Agreement is
kept per agent (the target side of the reuse edge) and overall, exported in ``Stats.audit`` and the
server's metrics, and it feeds back: an agent whose measured agreement falls below ``target`` after
``min_checks`` checks gets its confidence gate raised (``margin_for``), doubling each time it is
found short again, so its close calls go dense.

Owned by the engine, given to the placement step (:mod:`.place`) that consults and feeds it; the
dense check is given to it when it is built (the request lifecycle's ``first_token``: the prompt run
exactly as background work on the scheduler). The thread is started on first use and stopped by
:meth:`close`; the queue is bounded (a burst drops checks, it never delays requests); per-agent records
are bounded (LRU).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbaton.types import AuditAgentStats, AuditStats

log = logging.getLogger(__name__)

MAX_AGENTS = 1024
MAX_QUEUED = 8
MAX_RAISE = 8.0  # the gate of an agent is raised at most to this multiple of the configured margin


@dataclass
class _Record:
    checked: int = 0
    agreed: int = 0
    raised: float = 1.0  # multiplier of the configured gate margin

    @property
    def agreement(self) -> float:
        return self.agreed / self.checked if self.checked else 1.0


class FidelityAudit:
    """Checks every ``1/fraction``-th approximate request against dense prefill, in the background."""

    def __init__(
        self, dense_argmax: Callable[[list[int]], int], fraction: float = 0.05, target: float = 0.95,
        min_checks: int = 8,
    ) -> None:
        if not 0 <= fraction <= 1 or not 0 < target <= 1 or min_checks < 1:
            raise ValueError("audit fraction in [0, 1], target in (0, 1], min_checks >= 1")
        self._dense_argmax = dense_argmax
        self.fraction = fraction
        self.target = target
        self.min_checks = min_checks
        self._every = round(1 / fraction) if fraction > 0 else 0
        self._seen = 0
        self._lock = threading.Lock()
        self._agents: OrderedDict[str, _Record] = OrderedDict()
        self._total = _Record()
        self._dropped = 0
        self._queue: queue.Queue[tuple[str, list[int], int] | None] = queue.Queue(MAX_QUEUED)
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, agent: str | None, prompt: Sequence[int], approximate_argmax: int) -> None:
        """An approximate request answered: check it if it is the next sampled one."""
        if not self._every:
            return
        with self._lock:
            self._seen += 1
            if self._closed or self._seen % self._every:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvbaton-audit", daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait((agent or "", list(prompt), approximate_argmax))
        except queue.Full:
            with self._lock:
                self._dropped += 1

    def margin_for(self, agent: str | None, margin: float) -> float:
        """The confidence-gate margin for ``agent``: ``margin``, raised while its agreement is short."""
        with self._lock:
            record = self._agents.get(agent or "")
            return margin * (record.raised if record is not None else 1.0)

    def stats(self) -> AuditStats:
        with self._lock:
            return AuditStats(
                fraction=self.fraction, target=self.target, checked=self._total.checked, agreed=self._total.agreed,
                dropped=self._dropped,
                agents={a: AuditAgentStats(checked=r.checked, agreed=r.agreed, gate_raised=r.raised)
                        for a, r in self._agents.items()},
            )

    def flush(self) -> None:
        """Wait until every check handed over so far is done (tests, benchmarks)."""
        self._queue.join()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                agent, prompt, seen = item
                try:
                    dense = self._dense_argmax(prompt)
                except Exception as exc:  # the engine closing, a full pool: the check is skipped
                    log.info("fidelity audit skipped a check: %s", exc)
                    continue
                self._record(agent, dense == seen)
            finally:
                self._queue.task_done()

    def _record(self, agent: str, agreed: bool) -> None:
        with self._lock:
            record = self._agents.pop(agent, None) or _Record()
            self._agents[agent] = record  # most recently checked last
            while len(self._agents) > MAX_AGENTS:
                self._agents.popitem(last=False)
            for r in (record, self._total):
                r.checked += 1
                r.agreed += agreed
            if record.checked >= self.min_checks and record.agreement < self.target and record.raised < MAX_RAISE:
                record.raised *= 2
                log.warning("agent %r: approximate answers agreed with dense prefill on %.0f%% of %d checks "
                            "(target %.0f%%); its confidence gate is raised %gx", agent, 100 * record.agreement,
                            record.checked, 100 * self.target, record.raised)
                record.checked = record.agreed = 0  # measured anew under the raised gate
