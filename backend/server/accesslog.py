"""The server's own log of its traffic, at INFO: one access line per request, and a throughput line
every interval while requests come (as vLLM logs its engine stats).

Invariants: a line never names a tenant, token or prompt (method, route path, status, duration, token
counts only), and the path is written with its control characters escaped (a ``%0A`` in a URL
cannot start a forged line); the token counts of a request are what its answer's ``usage`` says
(``note_usage``: each prompt once, every choice's completion; a native generation's ``Result``
through ``note_result``), recorded in the ASGI scope, so streams are counted once they end; the
throughput line sums the same counts over the requests that ended in its interval, so the access
lines, the throughput line and ``usage`` agree.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvbaton.types import Result
from starlette.types import ASGIApp, Scope

from .middleware import AnsweredMiddleware, printable

access_log = logging.getLogger("kvbaton.access")
stats_log = logging.getLogger("kvbaton.stats")

TOKENS_KEY = "kvbaton.tokens"


@dataclass
class Tokens:
    """What a request's answer counted: prompt tokens (each prompt once), of them reused exactly, generated."""

    prompt: int = 0
    reused: int = 0
    generated: int = 0

    def add(self, other: Tokens) -> None:
        self.prompt += other.prompt
        self.reused += other.reused
        self.generated += other.generated


def _note(scope: dict[str, Any] | None, tokens: Tokens) -> None:
    if scope is not None:
        scope.setdefault(TOKENS_KEY, Tokens()).add(tokens)


def note_usage(scope: dict[str, Any] | None, usage: Mapping[str, Any]) -> None:
    """Count an OpenAI answer's ``usage`` in its request's access line."""
    _note(scope, Tokens(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                        usage["completion_tokens"]))


def note_result(scope: dict[str, Any] | None, result: Result) -> None:
    """Count a native generation's tokens (its ``Result.timings``) in its request's access line."""
    t = result.timings
    _note(scope, Tokens(t.tokens_reused + t.tokens_prefilled, t.tokens_reused - t.tokens_approximate,
                        t.tokens_generated))


class AccessLogMiddleware(AnsweredMiddleware):
    """One INFO line per HTTP request when it ends: method, path, status, seconds, tokens."""

    def __init__(self, app: ASGIApp, requests: Callable[[Tokens | None], None]) -> None:
        super().__init__(app)
        self.requests = requests  # counts every finished request and its tokens, for the throughput line

    def answered(self, scope: Scope, status: int, seconds: float) -> None:
        tokens: Tokens | None = scope.get(TOKENS_KEY)
        self.requests(tokens)
        if access_log.isEnabledFor(logging.INFO):
            access_log.info("%s %s %d %.3fs%s", printable(scope.get("method", "")), printable(scope.get("path", "")),
                            status, seconds,
                            f" prompt_tokens={tokens.prompt} generated_tokens={tokens.generated}" if tokens else "")


class Throughput:
    """Requests/s, prompt and generated tokens/s and the share of prompt tokens reused, over the
    requests that ended since the last line (their answers' counts)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since = clock()
        self._requests = 0
        self._tokens = Tokens()

    def finished(self, tokens: Tokens | None) -> None:
        self._requests += 1
        if tokens is not None:
            self._tokens.add(tokens)

    def line(self) -> str | None:
        """The throughput since the last call, or None when nothing happened (no line for an idle server)."""
        now = self._clock()
        requests, tokens, dt = self._requests, self._tokens, max(now - self._since, 1e-9)
        self._since, self._requests, self._tokens = now, 0, Tokens()
        if not requests:
            return None
        hit = tokens.reused / tokens.prompt if tokens.prompt else 0.0
        return (f"throughput: {requests / dt:.2f} requests/s, prompt {tokens.prompt / dt:.1f} tok/s, "
                f"generation {tokens.generated / dt:.1f} tok/s, prompt tokens reused {hit:.1%}")

    def log(self) -> None:
        line = self.line()
        if line is not None:
            stats_log.info("%s", line)
