"""What the family benchmark records of each turn, whichever way the shape runs (the embedded client turn by
turn, a LangGraph app, an AutoGen team): every model call goes through one :class:`RecordingClient`.

:class:`RecordingClient` is an :class:`~kvbaton.embedded.EmbeddedClient` over the benchmark's engine whose
``generate`` records the call — which turn (:data:`TURN`, set by whoever runs the turn; else the order of the
calls), the prompt's token ids, the :class:`~kvbaton.Result`, the seconds — with the benchmark's sampling for
that turn in place of the caller's (greedy, a fixed number of tokens; a question's answer stops at EOS), and,
with ``kl``, the KL of an approximate answer's next-token distribution against dense prefill
(``fidelity(handle, max_tokens=1)``, untimed). Public client API only, so the benchmark keeps working whatever
the engine's reuse step does inside.

:func:`turn_record` turns a call into the record the benchmark keeps: the marks (exact, tokens reused
exactly / approximately / prefilled / discarded), every placed span's outcome and reason, and how much of the
turn's shared context (its document, located in the prompt by :func:`context_range`) was reused.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from kvbaton import SamplingParams
from kvbaton.embedded import EmbeddedClient
from kvbaton.handle import common_prefix_length

TURN: ContextVar[int | None] = ContextVar("kvbaton_family_turn", default=None)
"""The index of the turn whose model call runs in this context (None: count the calls)."""
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "min_tokens")
MARKER = "\u00a7"  # what the context is replaced by to find it in the prompt's tokens


@dataclass
class Call:
    index: int
    agent: str | None
    messages: list[dict[str, str]]
    prompt: list[int]
    result: Any
    seconds: float  # the generate call alone
    kl: float | None = None
    kl_seconds: float = 0.0  # the KL check after it (untimed: not part of the workflow)


class RecordingClient(EmbeddedClient):
    """An embedded client over ``engine`` that records every ``generate`` (see the module docstring);
    ``sampling_of(turn)`` is each turn's sampling."""

    def __init__(self, engine: Any, sampling_of: Callable[[int], SamplingParams], kl: bool = False) -> None:
        super().__init__(engine=engine)
        self.sampling_of = sampling_of
        self.kl = kl
        self.calls: dict[int, Call] = {}
        self._lock = threading.Lock()
        self._count = 0

    def _index(self) -> int:
        with self._lock:
            given = TURN.get()
            index = given if given is not None else self._count
            self._count += 1
            return index

    def generate(  # type: ignore[override]
        self, messages: Any, *, handle: Any = None, tools: Any = None, sampling: Any = None, agent: Any = None,
        reuse: Any = None, **options: Any,
    ) -> Any:
        # The adapters pass agent= and reuse= only to a generate whose signature names them: it does.
        index = self._index()
        for key in SAMPLING_KEYS:
            options.pop(key, None)
        prompt = self.chat_tokens(messages, tools=tools)
        start = time.perf_counter()
        result = super().generate(messages, handle=handle, tools=tools, sampling=self.sampling_of(index), agent=agent,
                                  reuse=reuse, **options)
        call = Call(index, _name(agent), [dict(m) for m in messages], prompt, result, time.perf_counter() - start)
        if self.kl and not result.exact:
            start = time.perf_counter()
            call.kl = float(self.fidelity(result.handle, max_tokens=1).kl_first)
            call.kl_seconds = time.perf_counter() - start
        with self._lock:
            if index in self.calls:
                raise RuntimeError(f"turn {index} ran twice")
            self.calls[index] = call
        return result

    def generate_stream(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise NotImplementedError("the family benchmark records whole answers: its apps do not stream")


def _name(agent: Any) -> str | None:
    return getattr(agent, "name", agent)


def context_range(client: Any, messages: Sequence[Mapping[str, str]], prompt: Sequence[int],
                  text: str) -> tuple[int, int]:
    """Where ``text`` (a turn's shared context) lies in ``prompt`` (the tokens of ``messages``): the tokens
    that change when it is replaced by a marker. (0, 0) when no message holds it."""
    replaced, found = [], False
    for m in messages:
        content = m.get("content", "")
        if not found and text and text in content:
            content, found = content.replace(text, MARKER, 1), True
        replaced.append({**m, "content": content})
    if not found:
        return 0, 0
    other = client.chat_tokens(replaced)
    start = common_prefix_length(prompt, other)
    tail = common_prefix_length(list(reversed(prompt[start:])), list(reversed(other[start:])))
    return start, len(prompt) - tail


def overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def context_reused(result: Any, context: tuple[int, int]) -> int:
    """Tokens of ``context`` whose K/V the turn did not compute: the exact prefix it reused (prefix cache or a
    handle) and what each placed span kept (re-aligned, blended or copied), capped at the span's overlap."""
    segments = list(getattr(result, "segments", None) or ())
    prefix = result.timings.tokens_reused - sum(s.tokens_reused for s in segments)
    reused = overlap((0, prefix), context)
    for s in segments:
        placed = (s.offset + s.tokens_cached, s.offset + (s.end - s.start))
        reused += min(s.tokens_reused, overlap(placed, context))
    return min(reused, context[1] - context[0])


def turn_record(call: Call, context: tuple[int, int]) -> dict[str, Any]:
    """The record of one turn (its sampling and shape tags are added by the caller)."""
    result, t = call.result, call.result.timings
    approx = int(getattr(t, "tokens_approximate", 0) or 0)
    segments = [{"outcome": s.outcome, "reason": s.reason, "start": s.start, "end": s.end, "offset": s.offset,
                 "tokens_reused": s.tokens_reused, "tokens_cached": s.tokens_cached, "exact": s.exact}
                for s in getattr(result, "segments", None) or ()]
    out = {
        "index": call.index, "agent": call.agent, "seconds": call.seconds, "ttft_s": t.ttft_s,
        "prompt_tokens": len(call.prompt), "prompt_sha": hashlib.sha1(str(call.prompt).encode()).hexdigest()[:16],
        "reused_exact": t.tokens_reused - approx, "reused_approx": approx, "prefilled": t.tokens_prefilled,
        "discarded": int(getattr(t, "tokens_discarded", 0) or 0), "generated": t.tokens_generated,
        "exact": bool(result.exact), "context": list(context), "context_tokens": context[1] - context[0],
        "context_reused": context_reused(result, context), "segments": segments,
        "token_ids": list(result.token_ids), "text": result.text,
    }
    if call.kl is not None:
        out["kl"] = call.kl
    return out


__all__ = ["TURN", "Call", "RecordingClient", "context_range", "context_reused", "overlap", "turn_record"]
