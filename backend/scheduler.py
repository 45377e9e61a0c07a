"""Continuous batching: one thread runs every forward, packing the work of all waiting requests.

Requests (each in its own thread: an SDK call, a server worker, a stream consumer) hand their next
piece of work — a prefill chunk or a single decode token — to :meth:`Scheduler.run` and block
until its logits are back. The scheduler thread takes everything waiting, up to a token budget,
and runs it as ONE packed forward (``ModelRunner.forward`` accepts many sequences), so decode
steps of concurrent requests share a single pass over the weights. A long prompt is submitted one
chunk at a time by its request, so it delays the decodes of others by at most one chunk; a prompt
with no other request active goes in chunks as large as the token budget, since splitting it
further would only cost (smaller matrix products, attention re-reading the cached part).

Background work (the fidelity audit's dense checks: :meth:`Scheduler.background`) runs only once no
request has been waiting or active for ``background_quiet_s``, in chunks of at most
``background_chunk`` tokens, so a request that arrives meanwhile waits for one small chunk at most,
and a busy engine simply runs no checks. The quiet period matters: a request's own steps leave
millisecond gaps (its placement work between forwards, an agent workflow starting the next turn),
and background chunks taken in those gaps landed on the request path (in the agents benchmark, the
debate turns that ran beside a check were the slowest of their run).

Forwards never run under the engine lock: a request only submits work for blocks it owns (written
ones are private, thanks to copy-on-write) or pins (read ones), so eviction and prefetch can go on
meanwhile. All forwards run on this one thread, which is what serializes them.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .model_runner import Chunk, ModelRunner


@dataclass(eq=False)
class _Work:
    chunk: Chunk | None  # None: ``call`` is run instead, alone
    call: Callable[[], torch.Tensor] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None
    error: BaseException | None = None


class Scheduler:
    def __init__(
        self, runner: ModelRunner, max_batch_tokens: int = 2048, max_batch_seqs: int = 64, gather_s: float = 0.003,
        background_chunk: int = 128, background_quiet_s: float = 0.25,
    ) -> None:
        self._runner = runner
        self.runner = runner
        self.gather_s = gather_s
        self.background_chunk = background_chunk
        self.background_quiet_s = background_quiet_s
        self._last_foreground = time.monotonic()  # when a request last submitted, finished work or left
        # Requests inside their decode loop ("decoding") or a prefill of several chunks ("prefilling");
        # background threads count as "background" whatever they do, so requests never wait for them.
        self._active: Counter[str] = Counter()
        self._background: deque[_Work] = deque()
        self._local = threading.local()
        self.background_forwards = 0
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self._pending: deque[_Work] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self.forwards = 0
        self.sequences = 0
        self.max_sequences = 0
        self._thread = threading.Thread(target=self._loop, name="kvbaton-scheduler", daemon=True)
        self._thread.start()

    def decoding(self) -> _Active:
        """Context manager a request holds while it decodes, so its next step is waited for."""
        return _Active(self, "decoding")

    def prefilling(self) -> _Active:
        """Context manager a request holds while it prefills a prompt longer than one chunk."""
        return _Active(self, "prefilling")

    @contextmanager
    def background(self) -> Iterator[None]:
        """While inside, the calling thread's work is background work: it waits until no request is
        waiting or active, and its prompts go in chunks of at most ``background_chunk`` tokens."""
        previous = getattr(self._local, "background", False)
        self._local.background = True
        try:
            yield
        finally:
            self._local.background = previous

    def in_background(self) -> bool:
        return bool(getattr(self._local, "background", False))

    def chunk_limit(self, chunk: int) -> int:
        """The largest prompt the calling thread computes in one piece (``chunk``, less in the background)."""
        return min(chunk, self.background_chunk) if self.in_background() else chunk

    def chunk_tokens(self, contended: int) -> int:
        """Size of a prefilling request's next chunk: ``contended`` tokens while any other request
        is active (its decodes wait at most one such chunk), the whole token budget when alone
        (background work: never more than ``background_chunk``, a request may come at any moment)."""
        if self.in_background():
            return self.chunk_limit(contended)
        with self._cv:
            alone = not self._pending and self._active["decoding"] == 0 and self._active["prefilling"] <= 1
        return max(contended, self.max_batch_tokens) if alone else contended

    def run(self, chunk: Chunk) -> torch.Tensor:
        """Compute one chunk (batched with whatever else is waiting); its logits (see ``ModelRunner.forward``)."""
        return self._wait(_Work(chunk))

    def call(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run ``fn`` (a model computation that is not one chunk, e.g. ``ModelRunner.deviation``) on
        the scheduler thread, alone, in turn with the forwards; its result."""
        return self._wait(_Work(None, fn))

    def _wait(self, work: _Work) -> torch.Tensor:
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            if self.in_background():
                self._background.append(work)
            else:
                self._pending.append(work)
                self._last_foreground = time.monotonic()
            self._cv.notify()
        work.done.wait()
        if work.error is not None:
            raise work.error
        assert work.logits is not None
        return work.logits

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    @property
    def mean_sequences(self) -> float:
        return self.sequences / self.forwards if self.forwards else 0.0

    def _quiet_left(self) -> float | None:
        """Seconds until background work may run: None while a request is waiting or active, else
        what remains of the quiet period since the last one (condition held)."""
        if self._pending or self._active["decoding"] or self._active["prefilling"]:
            return None
        return self._last_foreground + self.background_quiet_s - time.monotonic()

    def _idle(self) -> bool:
        """No request waiting or active for the quiet period: background work may run (condition held)."""
        left = self._quiet_left()
        return left is not None and left <= 0

    def _wait_for_work(self) -> None:
        """Until a request's work is waiting, background work may run, or the scheduler closes."""
        while not (self._pending or self._closed):
            left = self._quiet_left() if self._background else None
            if left is not None and left <= 0:
                return
            self._cv.wait(timeout=left)

    def _take(self) -> list[_Work]:
        batch: list[_Work] = []
        tokens = 0
        while self._pending and len(batch) < self.max_batch_seqs:
            head = self._pending[0].chunk
            if head is None:  # a call runs alone
                return batch or [self._pending.popleft()]
            size = len(head.token_ids)
            if batch and tokens + size > self.max_batch_tokens:
                break
            batch.append(self._pending.popleft())
            tokens += size
        return batch

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._wait_for_work()
                # Decoding requests come back a moment after their last step (sampling, text):
                # wait briefly for all of them, so a step runs once for everyone, not in pieces.
                self._cv.wait_for(
                    lambda: len(self._pending) >= self._active["decoding"] or self._closed, timeout=self.gather_s
                )
                if self._closed:
                    for work in (*self._pending, *self._background):
                        work.error = RuntimeError("the engine was closed")
                        work.done.set()
                    return
                background = not self._pending
                if background and not (self._background and self._idle()):
                    continue  # a request became active while we gathered: its step comes first
                batch = [self._background.popleft()] if background else self._take()
            try:
                if batch[0].call is not None:
                    batch[0].logits = batch[0].call()
                else:
                    logits = self._runner.forward([w.chunk for w in batch if w.chunk is not None])
                    for i, work in enumerate(batch):
                        work.logits = logits[i]
            except BaseException as exc:  # handed to every waiting request; the loop lives on
                for work in batch:
                    work.error = exc
            finally:
                if not background:
                    with self._cv:
                        self._last_foreground = time.monotonic()
                self.forwards += 1
                self.background_forwards += background
                self.sequences += len(batch)
                self.max_sequences = max(self.max_sequences, len(batch))
                for work in batch:
                    work.done.set()


class _Active:
    """Counts a request as ``activity`` ("decoding", "prefilling") in its scheduler while held."""

    def __init__(self, scheduler: Scheduler, activity: str) -> None:
        self._scheduler = scheduler
        self._activity = activity

    def __enter__(self) -> None:
        if self._scheduler.in_background():
            self._activity = "background"
        with self._scheduler._cv:
            self._scheduler._active[self._activity] += 1

    def __exit__(self, *exc: object) -> None:
        with self._scheduler._cv:
            self._scheduler._active[self._activity] -= 1
            if self._activity != "background":
                self._scheduler._last_foreground = time.monotonic()
            self._scheduler._cv.notify()  # the engine may have become idle: background work may run
