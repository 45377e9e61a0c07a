"""Incremental detokenization with stop strings, for streaming.

Text is released only when it is final: never half of a multi-byte character, and never the
beginning of what may turn out to be a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._min_tokens = min_tokens
        self._armed_at = 0  # stop strings count once they end at or after this character (min_tokens)
        self._ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already released
        self.text = ""
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Add one generated token; return the newly final text (possibly empty)."""
        if len(self._ids) + 1 == self._min_tokens:  # this is token min_tokens: its text may complete a stop
            self._armed_at = len(self.text)
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        armed = len(self._ids) >= self._min_tokens
        for stop in self._stop if armed else ():
            at = text.find(stop, max(0, self._armed_at - len(stop) + 1))
            if at != -1:
                self.stopped = True
                text = text[:at]
                break
        self.text = text
        if self.stopped:
            return self._release(len(text))
        final = len(text)
        if text.endswith(_REPLACEMENT):  # an incomplete UTF-8 sequence: wait for its other bytes
            final = len(text.rstrip(_REPLACEMENT))
        for stop in self._stop:  # hold back a tail that could still grow into a stop string
            for k in range(min(len(stop) - 1, final), 0, -1):
                if text[:final].endswith(stop[:k]):
                    final = min(final, len(text[:final]) - k)
                    break
        return self._release(final)

    def flush(self) -> str:
        """At the end of generation everything left is final."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta
