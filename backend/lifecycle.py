"""The request lifecycle: one request from admission to its handle or :class:`~kvbaton.Result`.

A request is a fresh :class:`~.sequence.KVState` (its tokens, and the blocks it shares with its
parent). The lifecycle admits it (attach the cached prefix, reserve every block it will write),
computes its uncached tokens through the batching :class:`~.scheduler.Scheduler` (a long prompt in
chunks sized by the scheduler), runs the decode loop of a generation, and registers the finished
state in the handle table with its blocks offered to the prefix cache.

Invariants:

- blocks for the whole request are reserved at admission: a request that starts always finishes;
- forwards and slow-tier loads run WITHOUT the engine lock; the lock is taken per step, never across
  a ``yield``, so an idle stream consumer cannot block other requests;
- a request that fails or is abandoned gives every block back; only a finished one is registered;
- a request with a response format samples only tokens its grammar allows (:mod:`.constrained`), from
  its own logits after the batched forward, so batching and the fused decode path are unchanged.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch
from kvbaton.handle import Handle
from kvbaton.ops import check_agent
from kvbaton.stream import TokenStream
from kvbaton.types import Result, SamplingParams, SegmentReport, StreamChunk, Timings, TokenLogprob

from .constrained import Constraint, Constraints
from .detokenizer import Detokenizer
from .events import EventRing
from .handles import HandleTable
from .kv_manager import KVManager, Loads
from .loader import LoadedModel
from .model_runner import Chunk
from .sampler import make_generator, sample, token_logprob
from .scheduler import Scheduler
from .sequence import KVState
from .stats import AgentLatencies

# How long a request that does not fit waits for requests in flight to give blocks back before it is
# PoolExhausted (503 + Retry-After on a server): a burst of cold requests queues instead of failing.
ADMISSION_WAIT_S = 30.0

# Fills an admitted request's prompt (placing reused spans, computing the rest) and returns its
# next-token logits and what it placed: cross-prefix reuse (``Engine._placer``).
Prepare = Callable[[KVState], tuple[torch.Tensor, list[SegmentReport]]]


@dataclass
class RequestCounters:
    """Tokens served, for ``Stats``: reused from cache or handles, prefilled, generated; TTFTs per agent."""

    tokens_reused: int = 0
    tokens_prefilled: int = 0
    tokens_generated: int = 0
    tokens_approximate: int = 0
    ttft: AgentLatencies = field(default_factory=AgentLatencies)  # bounded: see stats.AgentLatencies


class Lifecycle:
    def __init__(
        self, kv: KVManager, scheduler: Scheduler, handles: HandleTable[KVState], loaded: LoadedModel,
        prefill_chunk: int, events: EventRing | None = None,
    ) -> None:
        self._kv = kv
        self.events = events if events is not None else EventRing()  # one ``request`` event per request
        self._lock = kv.lock
        self._scheduler = scheduler
        self._handles = handles  # its identity is what published handles carry
        self._loaded = loaded
        self.prefill_chunk = prefill_chunk
        self.counters = RequestCounters()
        self.constraints = Constraints(loaded)  # response formats (constrained decoding)
        self.on_register: Callable[[KVState], None] | None = None  # the engine's span index
        self.on_drop: Callable[[str], None] | None = None
        self.predicted: Callable[[str | None], float | None] = lambda agent: None  # the engine's STE hints

    # -- admission and registration -------------------------------------------------------------
    def admit(self, state: KVState, num_tokens: int, loads: Loads | None = None) -> int:
        """Attach the cached prefix and reserve blocks up to ``num_tokens``; the tokens reused
        (``loads``, when given, says where the attached blocks came from)."""
        self._kv.check_fits(num_tokens)  # before any slow-tier load or compute
        self._kv.attach(state, loads)
        self._kv.reserve(state, num_tokens, wait_s=ADMISSION_WAIT_S)
        return state.num_cached

    def publish(self, state: KVState) -> Handle:
        """The public handle of a state."""
        identity = self._handles.identity
        assert identity is not None
        return identity.handle(state.id, state.num_tokens, state.lineage, exact=state.exact_len is None)

    def register(self, state: KVState, reused: int | None = None) -> Handle:
        """Make a computed state a live handle, its exact blocks offered to the prefix cache.
        With ``reused``, its prompt's tokens are counted as reused / prefilled."""
        assert not state.stale, "a state is registered only once its stale positions are recomputed"
        with self._lock:
            self._kv.insert(state)
            if reused is not None:
                self.count_prefill(reused, state.num_tokens)
            self._handles.add(state.id, state)
            self._kv.finished(state)
            if self.on_register is not None and state.cacheable:
                self.on_register(state)
            return self.publish(state)

    def abandon(self, state: KVState) -> None:
        """Give back everything a failed or abandoned request held."""
        with self._lock:
            self._kv.drop(state)
            self._handles.discard(state.id)
            if self.on_drop is not None:
                self.on_drop(state.id)

    def count_prefill(self, reused: int, prompt_len: int) -> None:
        with self._lock:
            self.counters.tokens_reused += reused
            self.counters.tokens_prefilled += prompt_len - reused

    # -- computing --------------------------------------------------------------------------------
    def compute(self, state: KVState) -> torch.Tensor:
        """Run the model over the state's uncached tokens (blocks reserved); return last logits.

        Called WITHOUT the engine lock: the work goes through the batching scheduler, chunk by
        chunk, so other requests' steps are packed into the same forwards.
        """
        logits = self.compute_until(state, state.num_tokens)
        assert logits is not None
        return logits

    def compute_until(self, state: KVState, until: int) -> torch.Tensor | None:
        """Like :meth:`compute`, for positions up to ``until`` only (None: nothing was computed); the
        state's stale positions are always recomputed, in the first chunk."""
        logits = state.last_logits if until == state.num_tokens else None
        if until - state.num_cached + len(state.stale) <= self._scheduler.chunk_limit(self.prefill_chunk):
            if state.num_cached < until or state.stale:  # decode steps, short prompts
                logits = self._chunk(state, until)
        else:
            with self._scheduler.prefilling():
                while state.num_cached < until or state.stale:
                    logits = self._chunk(state, until, self._scheduler.chunk_tokens(self.prefill_chunk))
        state.last_logits = logits if until == state.num_tokens else None
        return logits

    def logits_after_each(self, state: KVState) -> torch.Tensor:
        """Next-token logits after each uncached token, in one chunk (blocks reserved): ``[n, vocab]``."""
        start = state.num_cached
        return self._scheduler.run(Chunk(list(state.blocks), start, state.token_ids[start:], all_logits=True))

    def deviation(self, state: KVState, start: int, n: int) -> torch.Tensor:
        """Per-token deviation of the re-aligned K/V at ``start..start+n-1`` from their recomputation
        behind the state's own prefix (``ModelRunner.deviation``; layer 0 is rewritten exactly)."""
        blocks, tokens = list(state.blocks), state.token_ids[start : start + n]
        runner = self._scheduler.runner
        return self._scheduler.call(lambda: runner.deviation(blocks, start, tokens))

    def recompute_at(self, state: KVState, positions: list[int]) -> None:
        """Recompute the K/V of the (ascending) cached ``positions`` behind everything before them
        (selective recomputation), in the state's next forward (:meth:`compute_until`) together with the
        tokens after them: the same K/V as a forward of their own (every query sees the keys up to its own
        position, each layer's new K/V written before they are read), one pass over the weights fewer."""
        assert all(p < state.num_cached for p in positions) and (not state.stale or state.stale[-1] < positions[0])
        state.stale.extend(positions)
        state.last_logits = None

    def _chunk(self, state: KVState, end: int, size: int | None = None) -> torch.Tensor | None:
        """One forward of at most ``size`` tokens: the stale positions first, then new ones up to ``end``.
        Returns the logits after the state's last cached token (None when the chunk ended on a stale one)."""
        stale = state.stale[:size] if size is not None else list(state.stale)
        del state.stale[: len(stale)]
        start = state.num_cached
        if size is not None:
            end = min(end, start + size - len(stale))
        if not stale:
            logits = self._scheduler.run(Chunk(list(state.blocks), start, state.token_ids[start:end]))
        else:
            positions = stale + list(range(start, end))
            tokens = [state.token_ids[p] for p in positions]
            logits = self._scheduler.run(Chunk(list(state.blocks), positions[0], tokens, positions=positions))
            if end <= start and positions[-1] != start - 1:
                logits = None
        state.num_cached = max(start, end)
        return logits

    # -- whole requests ---------------------------------------------------------------------------
    def prefill(self, state: KVState, agent: str | None = None) -> Handle:
        """Prefill a new state and register it; free it again on failure. Call without the lock."""
        event = _RequestEvent(state, agent, self.predicted(agent))
        try:
            check_agent(agent)
            state.agent = agent
            reused = self.admit(state, state.num_tokens, event.loads)
            event.t_admitted = time.time()
            self.compute(state)
            handle = self.register(state, reused)
        except BaseException:
            self.abandon(state)
            event.emit(self.events, "error")
            raise
        event.emit(self.events, "done", reused=reused, prefilled=state.num_tokens - reused, handle=handle.id)
        return handle

    def stream(
        self, state: KVState, params: SamplingParams, agent: str | None = None, prepare: Prepare | None = None
    ) -> TokenStream:
        """A generation behind ``state``'s prompt, as a stream; closing it, even unread, frees the state.
        ``prepare`` fills the prompt after admission (default: compute every uncached token)."""
        try:
            check_agent(agent)
            constraint = self.constraints.start(params)  # a bad schema fails before admission
        except BaseException:
            self.abandon(state)
            raise
        state.agent = agent
        chunks = self._decode(state, params, agent, prepare, constraint)
        next(chunks)  # run up to the sentinel so that closing the stream, even unread, frees the state
        return TokenStream(chunks)  # type: ignore[arg-type]

    def _decode(
        self, state: KVState, params: SamplingParams, agent: str | None = None, prepare: Prepare | None = None,
        constraint: Constraint | None = None,
    ) -> Generator[StreamChunk | None, None, Result]:
        """Prefill the uncached prompt, then generate token by token, yielding text as it becomes final."""
        prompt_len = state.num_tokens
        generated: list[int] = []
        logprobs: list[TokenLogprob] = []
        registered = False
        event = _RequestEvent(state, agent, self.predicted(agent))
        try:
            yield None  # sentinel, consumed by stream()
            t0 = time.perf_counter()
            event.t_queued = time.time()
            # The last generated token is never written: it stays pending for the next user.
            reused = self.admit(state, prompt_len + params.max_tokens - 1, event.loads)
            event.t_admitted = time.time()
            # Reused from an approximate parent (the agent's own earlier approximate turn).
            approximate = max(0, reused - state.exact_len) if state.exact_len is not None else 0
            segments: list[SegmentReport] = []
            if prepare is None:
                logits = self.compute(state)
            else:
                logits, segments = prepare(state)
                reused += sum(s.tokens_reused for s in segments)
                approximate += sum(s.tokens_reused for s in segments if not s.exact)
            with self._lock:
                self._kv.insert(state)
                self.count_prefill(reused, prompt_len)
                self.counters.tokens_approximate += approximate
            rng = make_generator(params, self._loaded.device)
            detok = Detokenizer(self._loaded.tokenizer, params.stop, params.min_tokens)
            eos = sorted(self._loaded.eos_token_ids)
            ttft = 0.0
            finish: str | None = None
            with self._scheduler.decoding():  # lets the scheduler wait for our next step
                while finish is None:
                    allowed = logits if constraint is None else constraint.mask(logits)
                    if len(generated) < params.min_tokens and eos:  # too early to end: EOS cannot be picked
                        allowed = allowed.clone() if allowed is logits else allowed
                        allowed[eos] = float("-inf")
                    token = sample(allowed, params, rng)
                    step_logprobs = None
                    if params.logprobs:
                        step_logprobs = [token_logprob(logits, token, params.top_logprobs, self._loaded.tokenizer)]
                        logprobs += step_logprobs
                    if constraint is not None:
                        constraint.advance(token)
                    if not generated:
                        ttft = time.perf_counter() - t0
                        if agent is not None:
                            with self._lock:
                                self.counters.ttft.record(agent, ttft)
                    generated.append(token)
                    state.token_ids.append(token)
                    state.last_logits = None
                    delta = detok.add(token)
                    if detok.stopped or (token in self._loaded.eos_token_ids and not params.ignore_eos):
                        finish = "stop"
                    elif constraint is not None and constraint.ended:  # the grammar admits nothing more
                        finish = "stop"
                    elif len(generated) >= params.max_tokens:
                        finish = "length"
                    else:
                        logits = self.compute(state)
                    if finish is not None:
                        delta += detok.flush()
                    self._kv.suspend(state)  # until the consumer reads on: see KVManager.reserve
                    try:
                        yield StreamChunk(text=delta, token_ids=[token], logprobs=step_logprobs)
                    finally:
                        self._kv.suspend(state, False)
            with self._lock:
                self._kv.trim(state)
                last = state.lineage[-1]
                state.lineage = state.lineage[:-1] + (
                    last.model_copy(update={"token_ids": last.token_ids + tuple(generated)}),
                )
                self.counters.tokens_generated += len(generated)
                handle = self.register(state)
                registered = True
        except GeneratorExit:
            event.finish = "abandoned"
            raise
        finally:
            if not registered:  # error or abandoned stream: give everything back
                self.abandon(state)
                event.emit(self.events, event.finish or "error", generated=len(generated))
        result = Result(
            text=detok.text,
            token_ids=generated,
            handle=handle,
            finish_reason=finish,  # type: ignore[arg-type]
            timings=Timings(
                ttft_s=ttft,
                total_s=time.perf_counter() - t0,
                tokens_reused=reused,
                tokens_prefilled=prompt_len - reused,
                tokens_generated=len(generated),
                tokens_approximate=approximate,
            ),
            exact=handle.exact,
            segments=segments,
            logprobs=logprobs if params.logprobs else None,
        )
        event.emit_result(self.events, result)
        return result


class _RequestEvent:
    """The ``request`` event of one request, filled in as it goes (times from ``time.time()``)."""

    def __init__(self, state: KVState, agent: str | None, predicted: float | None) -> None:
        step = state.lineage[-1] if state.lineage else None
        self.agent = agent if isinstance(agent, str) else None  # a bad tag fails the request, not its event
        self.predicted = predicted
        self.op = step.op.value if step is not None else None
        self.handle_in = step.parent if step is not None else None
        self.request_id = uuid.uuid4().hex[:16]
        self.loads = Loads()
        self.t_queued = time.time()
        self.t_admitted: float | None = None
        self.finish: str | None = None

    def emit(
        self, ring: EventRing, finish: str, *, reused: int = 0, prefilled: int = 0, generated: int = 0,
        handle: str | None = None,
    ) -> None:
        ring.emit(
            "request", agent=self.agent, request_id=self.request_id, op=self.op, finish=finish,
            t_queued=self.t_queued, t_admitted=self.t_admitted, t_done=time.time(),
            tokens_reused=reused, tokens_prefilled=prefilled, tokens_generated=generated,
            handle_in=self.handle_in, handle_out=handle, blocks_loaded=dict(self.loads.blocks),
            prefetch_hits=self.loads.prefetch_hits, ste_predicted=self.predicted,
        )

    def emit_result(self, ring: EventRing, result: Result) -> None:
        """A finished generation: its phases are the engine's own ``Timings`` (from ``t_queued``)."""
        t = result.timings
        ring.emit(
            "request", agent=self.agent, request_id=self.request_id, op=self.op, finish=result.finish_reason,
            t_queued=self.t_queued, t_admitted=self.t_admitted, t_first_token=self.t_queued + t.ttft_s,
            t_done=self.t_queued + t.total_s, tokens_reused=t.tokens_reused, tokens_approximate=t.tokens_approximate,
            tokens_prefilled=t.tokens_prefilled, tokens_generated=t.tokens_generated, handle_in=self.handle_in,
            handle_out=result.handle.id, blocks_loaded=dict(self.loads.blocks),
            prefetch_hits=self.loads.prefetch_hits, ste_predicted=self.predicted,
        )
