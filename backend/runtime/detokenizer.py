"""Incremental detokenization with stop strings, for streaming.

Text is released only when it is final: never half of a multi-byte character, and never the
beginning of what may turn out to be a stop string.

Each token costs work in proportion to its own text and the stop strings, not to the answer so far:
the tokenizer library's streaming decoder (``tokenizers.decoders.DecodeStream``) turns one token id
into its new characters (holding back a partial UTF-8 sequence until its other bytes come), a stop
string is looked for only where it could end inside the new characters, and the held-back tail is
at most the longest stop string. Re-decoding the whole output on every token cost 1.27 s of work
over a 4,096-token answer; this costs milliseconds. The text is the one ``tokenizer.decode(ids,
skip_special_tokens=True)`` gives (tested), so the streamed pieces add up to the final answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast


class Detokenizer:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        # A fast tokenizer streams through its Rust backend; any other is decoded whole per token.
        self._backend = tokenizer.backend_tokenizer if isinstance(tokenizer, PreTrainedTokenizerFast) else None
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = tuple(s for s in stop if s)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._min_tokens = min_tokens
        self._armed_at = 0  # stop strings count once they end at or after this character (min_tokens)
        self._ids: list[int] = []
        self._pending = 0  # ids the streaming decoder holds (an incomplete UTF-8 sequence)
        self._emitted = 0  # characters of the decoded text already released
        self.text = ""
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Add one generated token; return the newly final text (possibly empty)."""
        if self.stopped:
            return ""
        if len(self._ids) + 1 == self._min_tokens:  # this is token min_tokens: its text may complete a stop
            self._armed_at = len(self.text)
        self._ids.append(token_id)
        piece = self._step(token_id)
        if piece is None:  # waiting for the rest of a multi-byte character: nothing new is final
            self._pending += 1
            return ""
        self._pending = 0
        return self._append(piece)

    def flush(self) -> str:
        """At the end of generation everything left is final (an incomplete character as U+FFFD, as a
        whole decode gives it)."""
        released = ""
        if self._pending and not self.stopped:
            self._pending = 0
            whole = self._tokenizer.decode(self._ids, skip_special_tokens=True)
            released = self._append(whole[len(self.text):])
        return released + self._release(len(self.text))

    def _step(self, token_id: int) -> str | None:
        if self._backend is not None:
            return self._stream.step(self._backend, token_id)
        whole = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        return None if whole.endswith("\ufffd") else whole[len(self.text):]

    def _append(self, piece: str) -> str:
        start = len(self.text)
        self.text += piece
        if len(self._ids) >= self._min_tokens:
            for stop in self._stop:
                # Only where the stop could end inside the new characters (and after it was armed).
                at = self.text.find(stop, max(0, start - len(stop) + 1, self._armed_at - len(stop) + 1))
                if at != -1:
                    self.stopped = True
                    self.text = self.text[:at]
                    return self._release(at)
        final = len(self.text)
        # Hold back a tail that could still grow into a stop string (at most the longest stop, less one).
        for k in range(min(self._longest_stop - 1, final), 0, -1):
            if any(len(stop) > k and self.text.endswith(stop[:k]) for stop in self._stop):
                final -= k
                break
        return self._release(final)

    def _release(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta
