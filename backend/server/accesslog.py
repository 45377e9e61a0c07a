"""The server's own log of its traffic, at INFO: one access line per request, and a throughput line
every interval while requests come (as vLLM logs its engine stats).

Invariants: a line never names a tenant, token or prompt (method, route path, status, duration, token
counts only); the token counts of a request are what its generations recorded in the ASGI scope
(``note_tokens``: prompt, generated), so streams are counted once they end; the throughput line is
computed from the engine's own counters (``Stats``), so every route and backend is in it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvbaton.types import Result, Stats
from starlette.types import ASGIApp, Scope

from .middleware import AnsweredMiddleware

access_log = logging.getLogger("kvbaton.access")
stats_log = logging.getLogger("kvbaton.stats")

TOKENS_KEY = "kvbaton.tokens"


def note_tokens(scope: dict[str, Any] | None, result: Result) -> None:
    """Add a generation's prompt and generated tokens to its request's access line."""
    if scope is None:
        return
    t = result.timings
    counts = scope.setdefault(TOKENS_KEY, [0, 0])
    counts[0] += t.tokens_reused + t.tokens_prefilled
    counts[1] += t.tokens_generated


class AccessLogMiddleware(AnsweredMiddleware):
    """One INFO line per HTTP request when it ends: method, path, status, seconds, tokens."""

    def __init__(self, app: ASGIApp, requests: Callable[[], None]) -> None:
        super().__init__(app)
        self.requests = requests  # counts every finished request, for the throughput line

    def answered(self, scope: Scope, status: int, seconds: float) -> None:
        self.requests()
        if access_log.isEnabledFor(logging.INFO):
            tokens = scope.get(TOKENS_KEY)
            access_log.info("%s %s %d %.3fs%s", scope.get("method", ""), scope.get("path", ""), status, seconds,
                            f" prompt_tokens={tokens[0]} generated_tokens={tokens[1]}" if tokens else "")


@dataclass
class _Mark:
    at: float
    requests: int
    prompt: int
    reused: int
    generated: int


class Throughput:
    """Requests/s, prompt and generated tokens/s and the share of prompt tokens reused, since the last line."""

    def __init__(self, stats: Callable[[], Stats], clock: Callable[[], float] = time.monotonic) -> None:
        self._stats, self._clock = stats, clock
        self.requests = 0
        self._last = self._mark()

    def finished(self) -> None:
        self.requests += 1

    def _mark(self) -> _Mark:
        s = self._stats()
        return _Mark(self._clock(), self.requests, s.tokens_reused + s.tokens_prefilled, s.tokens_reused,
                     s.tokens_generated)

    def line(self) -> str | None:
        """The throughput since the last call, or None when nothing happened (no line for an idle server)."""
        now, last = self._mark(), self._last
        self._last = now
        if now.requests == last.requests and now.generated == last.generated and now.prompt == last.prompt:
            return None
        dt = max(now.at - last.at, 1e-9)
        prompt = now.prompt - last.prompt
        hit = (now.reused - last.reused) / prompt if prompt else 0.0
        return (f"throughput: {(now.requests - last.requests) / dt:.2f} requests/s, prompt {prompt / dt:.1f} tok/s, "
                f"generation {(now.generated - last.generated) / dt:.1f} tok/s, prompt tokens reused {hit:.1%}")

    def log(self) -> None:
        line = self.line()
        if line is not None:
            stats_log.info("%s", line)
