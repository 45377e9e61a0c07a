"""Continuous batching: one thread runs every forward, packing the work of all waiting requests.

Requests (each in its own thread: an SDK call, a server worker, a stream consumer) hand their next
piece of work — a prefill chunk or a single decode token — to :meth:`Scheduler.run` and block
until its logits are back. The scheduler thread takes everything waiting, up to a token budget,
and runs it as ONE packed forward (``ModelRunner.forward`` accepts many sequences), so decode
steps of concurrent requests share a single pass over the weights. A long prompt is submitted one
chunk at a time by its request, so it delays the decodes of others by at most one chunk; a prompt
with no other request active goes in chunks as large as the token budget, since splitting it
further would only cost (smaller matrix products, attention re-reading the cached part).

A plain generation (no grammar, no log probabilities) does not come back for each token: once its
first token is sampled, its request hands the decode loop to the scheduler (:meth:`Scheduler.generate`),
which steps every such generation in the same forward, samples them together (one batched argmax for
the greedy ones) and hands each request its tokens through a queue. Per token, that saves a round trip
between two threads per request, which on a GPU cost more than the forward itself (issue 38: 64
concurrent requests ran at 3,400 tokens/s with a 1.4 ms batch-1 step). A generation runs at most
``AHEAD`` tokens ahead of its consumer, then pauses until the consumer reads on.

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

import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from kvbaton.types import SamplingParams

from ..cache.sequence import KVState
from ..compute.runner import Chunk, ModelRunner
from .sampler import sample

AHEAD = 32  # tokens a generation computes ahead of its consumer before it pauses
STOP_WAIT_S = 120.0  # the longest a request waits for the scheduler to let go of its generation (one forward)


@dataclass(eq=False)
class _Work:
    chunk: Chunk | None  # None: ``call`` is run instead, alone
    call: Callable[[], torch.Tensor] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None
    error: BaseException | None = None


class Generation:
    """A request's decode loop, stepped by the scheduler thread (:meth:`Scheduler.generate`).

    The scheduler appends each sampled token to the state (``token_ids``; ``num_cached`` as its forward
    writes the previous one) and puts ``(token, last)`` on :attr:`tokens`; ``last``: the generation ended
    (EOS unless ignored, or ``max_tokens``), the token is not written (it stays pending, as in every
    handle). The request reads with :meth:`next` and ends it early with :meth:`stop` (a stop string, an
    abandoned stream, an error), after which the state is its own again, with the tokens it accepted."""

    def __init__(self, state: KVState, params: SamplingParams, rng: torch.Generator | None, eos: frozenset[int],
                 generated: int) -> None:
        self.state, self.params, self.rng = state, params, rng
        self.eos = frozenset() if params.ignore_eos else eos
        self._banned = sorted(eos)  # EOS cannot be picked before min_tokens, even when ignore_eos is set
        self.generated = generated
        self.tokens: queue.SimpleQueue[tuple[int, bool] | BaseException] = queue.SimpleQueue()
        self.stopping = False
        self.left = threading.Event()  # set once the scheduler has let go of the state
        self._scheduler: Scheduler | None = None

    def next(self) -> tuple[int, bool]:
        """The next token, and whether it is the last one (blocks until the scheduler has it)."""
        item = self.tokens.get()
        if isinstance(item, BaseException):
            raise item
        scheduler = self._scheduler
        if scheduler is not None and self.tokens.qsize() == AHEAD - 1:  # it may have paused for us
            with scheduler._cv:
                scheduler._cv.notify()
        return item

    def stop(self) -> None:
        """End the generation (if the scheduler still runs it) and wait until the scheduler lets go of
        the state; the tokens beyond those accepted are then cut off by the caller."""
        scheduler = self._scheduler
        if scheduler is not None and not self.left.is_set():
            with scheduler._cv:
                self.stopping = True
                scheduler._cv.notify()
            if not self.left.wait(STOP_WAIT_S):
                raise RuntimeError(f"the scheduler did not let go of a generation within {STOP_WAIT_S:.0f} s")

    def _ready(self) -> bool:
        return self.stopping or self.tokens.qsize() < AHEAD

    def _chunk(self) -> Chunk:
        state = self.state
        return Chunk(list(state.blocks), state.num_cached, state.token_ids[state.num_cached :])

    def _mask(self, rows: torch.Tensor, i: int) -> None:
        if self.generated < self.params.min_tokens and self._banned:
            rows[i, self._banned] = float("-inf")


class Scheduler:
    def __init__(
        self, runner: ModelRunner, max_batch_tokens: int = 2048, max_batch_seqs: int = 64, gather_s: float = 0.003,
        background_chunk: int = 128, background_quiet_s: float = 0.25,
    ) -> None:
        self.runner = runner  # the only way to the model: the runner interface (compute/runner.py)
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
        self._running: list[Generation] = []  # generations the scheduler steps itself (``generate``)
        self._cv = threading.Condition()
        self._closed = False
        self.forwards = 0
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

    def generate(self, generation: Generation) -> Generation:
        """Hand a request's decode loop to the scheduler thread from its next forward on: the state's last
        token (sampled, pending) is computed with the next batch (see :class:`Generation`)."""
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            generation._scheduler = self
            self._running.append(generation)
            self._last_foreground = time.monotonic()
            self._cv.notify()
        return generation

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

    @property
    def queued(self) -> int:
        """Pieces of work waiting for the scheduler thread (requests' and background)."""
        with self._cv:
            return len(self._pending) + len(self._background)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    def _quiet_left(self) -> float | None:
        """Seconds until background work may run: None while a request is waiting or active, else
        what remains of the quiet period since the last one (condition held)."""
        if self._pending or self._running or self._active["decoding"] or self._active["prefilling"]:
            return None
        return self._last_foreground + self.background_quiet_s - time.monotonic()

    def _idle(self) -> bool:
        """No request waiting or active for the quiet period: background work may run (condition held)."""
        left = self._quiet_left()
        return left is not None and left <= 0

    def _wait_for_work(self) -> None:
        """Until a request's work is waiting, background work may run, or the scheduler closes."""
        while not (self._pending or self._closed or any(g._ready() for g in self._running)):
            left = self._quiet_left() if self._background else None
            if left is not None and left <= 0:
                return
            self._cv.wait(timeout=left)

    def _generations(self) -> list[Generation]:
        """The generations stepped in the next forward (condition held): stopped ones let go of, paused
        ones (``AHEAD`` tokens unread) left for later, at most ``max_batch_seqs``."""
        stepped = []
        for generation in list(self._running):
            if generation.stopping:
                self._running.remove(generation)
                generation.left.set()
            elif generation._ready() and len(stepped) < self.max_batch_seqs:
                stepped.append(generation)
        return stepped

    def _take(self, seqs: int = 0) -> list[_Work]:
        """Waiting work for the next forward, beside ``seqs`` generations (one token each)."""
        batch: list[_Work] = []
        tokens = seqs
        while self._pending and len(batch) + seqs < self.max_batch_seqs:
            head = self._pending[0].chunk
            if head is None:  # a call runs alone
                return batch if batch or seqs else [self._pending.popleft()]
            size = len(head.token_ids)
            if (batch or seqs) and tokens + size > self.max_batch_tokens:
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
                    self._end(self._running, RuntimeError("the engine was closed"))
                    return
                generations = self._generations()
                background = not self._pending and not generations
                if background and not (self._background and self._idle()):
                    continue  # a request became active while we gathered: its step comes first
                batch = [self._background.popleft()] if background else self._take(len(generations))
            try:
                if batch and batch[0].call is not None:
                    batch[0].logits = batch[0].call()
                else:
                    chunks = [g._chunk() for g in generations] + [w.chunk for w in batch if w.chunk is not None]
                    logits = self.runner.forward(chunks)
                    for generation in generations:
                        generation.state.num_cached = len(generation.state.token_ids)
                    for i, work in enumerate(batch):
                        work.logits = logits[len(generations) + i]
                    if generations:
                        self._sample(generations, logits[: len(generations)])
            except BaseException as exc:  # noqa: BLE001 - handed to every waiting request; the loop lives on
                for work in batch:
                    work.error = exc
                with self._cv:
                    self._end(generations, exc)
            finally:
                if not background:
                    with self._cv:
                        self._last_foreground = time.monotonic()
                self.forwards += 1
                self.background_forwards += background
                self.max_sequences = max(self.max_sequences, len(batch) + len(generations))
                for work in batch:
                    work.done.set()

    def _sample(self, generations: list[Generation], logits: list[torch.Tensor]) -> None:
        """Each generation's next token from its logits (the greedy ones in one batched argmax), appended
        to its state and handed to its request; an ended generation is let go of."""
        rows = torch.stack(logits)  # a copy: masking it leaves the runner's logits alone
        for i, generation in enumerate(generations):
            generation._mask(rows, i)
        best = torch.argmax(rows, dim=-1).tolist() if any(g.params.greedy for g in generations) else []
        ended = []
        for i, generation in enumerate(generations):
            params = generation.params
            token = best[i] if params.greedy else sample(rows[i], params, generation.rng)
            generation.state.token_ids.append(token)
            generation.state.last_logits = None
            generation.generated += 1
            last = token in generation.eos or generation.generated >= params.max_tokens
            generation.tokens.put((token, last))
            if last:
                ended.append(generation)
        if ended:
            with self._cv:
                for generation in ended:
                    self._running.remove(generation)
                    generation.left.set()

    def _end(self, generations: list[Generation], error: BaseException) -> None:
        """Let go of ``generations`` with ``error`` for their requests (condition held)."""
        for generation in generations:
            if generation in self._running:
                self._running.remove(generation)
            generation.tokens.put(error)
            generation.left.set()


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
