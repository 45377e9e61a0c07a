"""Prompt-lookup drafts: agents quote the documents and each other, so the tokens that followed the last few
generated tokens earlier in the sequence are a good guess of what comes next (vLLM's ``ngram`` method).

:func:`propose` finds the latest earlier occurrence of the sequence's last ``n`` tokens (``n`` from
:data:`MAX_NGRAM` down to :data:`MIN_NGRAM`) and drafts the tokens after it. The scheduler appends the drafts
to the request's decode row and keeps those that greedy decoding itself picks (each row's argmax is the next
token whatever the drafts were, so accepted tokens are exactly the ones plain decoding would produce); the K/V
written for rejected drafts lie beyond the request's cached tokens and are overwritten by the next step.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

MAX_NGRAM = 4
MIN_NGRAM = 2
_WIDTH = array("i").itemsize


def propose(tokens: Sequence[int], k: int) -> list[int]:
    """Up to ``k`` draft tokens to follow ``tokens`` (none when no n-gram of its tail occurred before)."""
    if k <= 0 or len(tokens) < MIN_NGRAM + 1:
        return []
    raw = array("i", tokens).tobytes()  # rfind over bytes: a scan in C, not a Python loop per position
    for n in range(min(MAX_NGRAM, len(tokens) - 1), MIN_NGRAM - 1, -1):
        tail = raw[-n * _WIDTH :]
        end = len(raw) - _WIDTH  # the match must end before the tail's last token, so something follows it
        while True:
            at = raw.rfind(tail, 0, end)
            if at < 0:
                break
            if at % _WIDTH == 0:  # aligned on a token, not inside two of them
                start = at // _WIDTH + n
                return list(tokens[start : start + k])
            end = at + len(tail) - 1
    return []
