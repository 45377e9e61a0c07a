"""The consumer's side of a request: reading its output queue on the caller's thread, never the scheduler's.

:func:`wait_prompt` waits for a request without generation; :class:`GenerationOutput` turns a generation's
messages into :class:`~kvbaton.types.StreamChunk` s — detokenizing (:mod:`.detokenizer`), stop strings
(which end the generation: the scheduler is told to let go, and the state is cut back to the tokens the
answer keeps), ``min_tokens`` — and, at the end, the :class:`~kvbaton.types.Result` with the handle the
caller registers.

Every wait is bounded: a consumer polls its queue and gives up when the scheduler's thread is gone.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from kvbaton.types import StreamChunk, TokenLogprob

from .detokenizer import Detokenizer
from .request import Emitted, Ended, Message, Prompted, Request
from .sampler import token_logprob
from .scheduler import AHEAD, Scheduler

POLL_S = 1.0  # how often a waiting consumer checks that the scheduler still runs


def next_message(scheduler: Scheduler, request: Request) -> Message:
    """The request's next message (its exception raised), waiting while the scheduler runs."""
    while True:
        try:
            message = request.out.get(timeout=POLL_S)
        except queue.Empty:
            if not scheduler.alive:
                raise RuntimeError("the engine's scheduler has stopped") from None
            continue
        if request.unread == AHEAD - 1:  # it may have paused for us
            scheduler.wake()
        if isinstance(message, BaseException):
            raise message
        return message


def wait_prompt(scheduler: Scheduler, request: Request) -> Prompted:
    """Wait until a request without generation is computed; what its prompt reused. Raises its error; an
    interrupted wait (KeyboardInterrupt) abandons the request."""
    prompted: Prompted | None = None
    try:
        while True:
            message = next_message(scheduler, request)
            if isinstance(message, Prompted):
                prompted = message
            elif isinstance(message, Ended):
                assert prompted is not None
                return prompted
    except BaseException:
        scheduler.abort(request)
        raise


@dataclass
class GenerationOutput:
    """What a generation's consumer has read so far, and how it reads on."""

    scheduler: Scheduler
    request: Request
    detokenizer: Detokenizer
    prompt_len: int
    token_bytes: Callable[[int], bytes]
    prompted: Prompted | None = None
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: str | None = None

    @property
    def ttft(self) -> float:
        t = self.request.t_first
        return 0.0 if t is None else t - self.request.t_submitted

    def chunks(self, on_first: Callable[[], None]) -> Generator[StreamChunk, None, None]:
        """The stream's chunks, one per token (``on_first``: called when the first token is read); ends with
        :attr:`finish` set and the state cut back to what the answer keeps."""
        while self.finish is None:
            message = next_message(self.scheduler, self.request)
            if isinstance(message, Prompted):
                self.prompted = message
                continue
            assert isinstance(message, Emitted)
            for i, token in enumerate(message.tokens):
                self.generated.append(token)
                if len(self.generated) == 1:
                    on_first()
                step_logprobs = ([token_logprob(message.logprobs[i], self.token_bytes)]
                                 if message.logprobs is not None else None)
                if step_logprobs is not None:
                    self.logprobs += step_logprobs
                delta = self.detokenizer.add(token)
                if self.detokenizer.stopped:
                    self.finish = "stop"
                    self._cut_back()
                elif i == len(message.tokens) - 1:
                    self.finish = message.finish
                if self.finish is not None:
                    delta += self.detokenizer.flush()
                exact = self.prompted.exact if self.prompted is not None and len(self.generated) == 1 else None
                yield StreamChunk(text=delta, token_ids=[token], logprobs=step_logprobs, exact=exact)
                if self.finish is not None:
                    return

    def _cut_back(self) -> None:
        """A stop string ended the answer: the scheduler lets go (it may have run ahead), and the state keeps
        the tokens accepted, the last one pending as in every handle."""
        self.scheduler.stop(self.request)
        state = self.request.state
        length = self.prompt_len + len(self.generated)
        del state.token_ids[length:]
        state.num_cached = min(state.num_cached, length - 1)
        state.last_logits = None

    def abandon(self) -> bool:
        """The consumer leaves early: True when the scheduler drops the state, False when it is the caller's."""
        return self.scheduler.abort(self.request)
