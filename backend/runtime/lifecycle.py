"""The request lifecycle: one request from admission to its handle or :class:`~kvbaton.Result`.

A request is a fresh :class:`~.sequence.KVState` (its tokens, and the blocks it shares with its
parent). The lifecycle admits it (attach the cached prefix, reserve every block it will write),
computes its uncached tokens through the batching :class:`~.scheduler.Scheduler` (a long prompt in
chunks sized by the scheduler), runs the decode loop of a generation, and registers the finished
state in the handle table with its blocks offered to the prefix cache and its spans to the span index.

A request with cross-prefix reuse brings its reuse step (:class:`~..reuse.place.AutoReuse`): once the
request is admitted, the lifecycle runs it in place of computing the prompt, handing it itself as the
:class:`~..reuse.place.Forward` (compute, compute until, deviation, recompute at, a context-free
reference); the step calls nothing above. What the lifecycle needs of the rest of the engine is given
when it is built: the span index it keeps in step with the live states, the event ring, and the
steps-to-execution the hints predicted for each agent (for its events).

Invariants:

- blocks for the whole request are reserved at admission: a request that starts always finishes;
- forwards and slow-tier loads run WITHOUT the engine lock; the lock is taken per step, never across
  a ``yield``, so an idle stream consumer cannot block other requests;
- a request that fails or is abandoned gives every block back; only a finished one is registered;
- a request with a response format samples only tokens its grammar allows (:mod:`.constrained`), from
  its own logits after the batched forward, so batching and the fused decode path are unchanged.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Generator, Mapping
from contextlib import nullcontext

import torch
from kvbaton.handle import Handle, LineageStep, Op
from kvbaton.stream import TokenStream
from kvbaton.types import Result, SamplingParams, SegmentReport, StreamChunk, Timings, TokenLogprob

from ..cache.kv_manager import KVManager, Loads
from ..cache.sequence import KVState
from ..compute.loader import LoadedModel
from ..compute.runner import Chunk
from ..events import EventRing
from ..handles import HandleTable
from ..reuse.place import AutoReuse
from ..reuse.spans import SpanIndex
from ..tenants import Agent, check_agent_of, label_of
from .constrained import Constraint, Constraints
from .counters import RequestCounters
from .detokenizer import Detokenizer
from .sampler import make_generator, sample, token_logprob
from .scheduler import Generation, Scheduler

# How long a request that does not fit waits for requests in flight to give blocks back before it is
# PoolExhausted (503 + Retry-After on a server): a burst of cold requests queues instead of failing.
ADMISSION_WAIT_S = 30.0


class Lifecycle:
    def __init__(
        self, kv: KVManager, scheduler: Scheduler, handles: HandleTable[KVState], loaded: LoadedModel,
        prefill_chunk: int, events: EventRing | None = None, spans: SpanIndex | None = None,
        predictions: Mapping[str, float] | None = None,
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
        self._spans = spans  # indexes every cacheable state registered, forgets every one dropped
        # Each hinted agent's steps-to-execution just before it ran (the engine's live map; engine lock).
        self._predictions: Mapping[str, float] = predictions if predictions is not None else {}

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
                self.counters.prompt(reused, state.num_tokens)
            self._handles.add(state.id, state)
            self._kv.finished(state)
            if self._spans is not None and state.cacheable:
                self._spans.index(state)
            return self.publish(state)

    def abandon(self, state: KVState) -> None:
        """Give back everything a failed or abandoned request held."""
        with self._lock:
            self._kv.drop(state)
            self._handles.discard(state.id)
            if self._spans is not None:
                self._spans.remove(state.id)

    def release(self, state: KVState) -> None:
        """Release a registered state the engine made for its own use (a reference, a measurement), as
        releasing its handle would."""
        with self._lock:
            self._handles.release(state.id)
            if self._spans is not None:
                self._spans.release(state, self._kv.held_by_cache(state))
            self._kv.drop(state)

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
        if logits is not None and logits.untyped_storage().nbytes() > logits.nbytes:
            logits = logits.clone()  # a row of a batch's logits: kept with the state, it would keep the whole batch
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

    def kv_alone(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``tokens`` prefilled on their own from position 0 (a context-free reference of the
        anchor-pool correction), through an ordinary request whose handle is released again."""
        state = self._kv.share(None, 0, tokens, LineageStep(op=Op.MATERIALIZE, token_ids=tuple(tokens)))
        self.prefill(state)
        try:
            with self._lock:
                return self._kv.read_rows(state, 0, len(tokens))
        finally:
            self.release(state)

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
    def prefill(self, state: KVState, agent: Agent | None = None) -> Handle:
        """Prefill a new state and register it; free it again on failure. Call without the lock."""
        ref, agent = agent, label_of(agent)
        event = _RequestEvent(state, agent, self._predicted(agent))
        try:
            check_agent_of(ref)
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
        self, state: KVState, params: SamplingParams, agent: Agent | None = None, reuse: AutoReuse | None = None
    ) -> TokenStream:
        """A generation behind ``state``'s prompt, as a stream; closing it, even unread, frees the state.
        ``reuse`` fills the prompt after admission, placing spans of other states (default: compute every
        uncached token)."""
        ref, agent = agent, label_of(agent)
        try:
            check_agent_of(ref)
            constraint = self.constraints.start(params)  # a bad schema fails before admission
        except BaseException:
            self.abandon(state)
            raise
        state.agent = agent
        chunks = self._decode(state, params, agent, reuse, constraint)
        next(chunks)  # run up to the sentinel so that closing the stream, even unread, frees the state
        return TokenStream(chunks)  # type: ignore[arg-type]

    def _decode(
        self, state: KVState, params: SamplingParams, agent: str | None = None, reuse: AutoReuse | None = None,
        constraint: Constraint | None = None,
    ) -> Generator[StreamChunk | None, None, Result]:
        """Prefill the uncached prompt, then generate token by token, yielding text as it becomes final."""
        prompt_len = state.num_tokens
        generated: list[int] = []
        logprobs: list[TokenLogprob] = []
        registered = False
        generation: Generation | None = None
        event = _RequestEvent(state, agent, self._predicted(agent))
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
            discarded = 0
            if reuse is None:
                logits = self.compute(state)
            else:
                filled = reuse.fill(self, state)
                logits, segments, discarded = filled.logits, filled.segments, filled.discarded
                reused += sum(s.tokens_reused for s in segments)
                approximate += sum(s.tokens_reused for s in segments if not s.exact)
            exact_prompt = state.exact_len is None  # said on the first chunk: a stream's consumer knows it early
            with self._lock:
                self._kv.insert(state)
                self.counters.prompt(reused, prompt_len, approximate, discarded)
            rng = make_generator(params, self._loaded.device)
            detok = Detokenizer(self._loaded.tokenizer, params.stop, params.min_tokens)
            eos = sorted(self._loaded.eos_token_ids)
            ttft = 0.0
            finish: str | None = None
            # A plain generation's later tokens are stepped by the scheduler itself (Scheduler.generate);
            # one that needs its logits each step (a grammar, log probabilities) comes back for each token.
            plain = constraint is None and not params.logprobs
            with nullcontext() if plain else self._scheduler.decoding():  # lets the scheduler wait for our steps
                while finish is None:
                    step_logprobs = None
                    if generation is not None:  # stepped by the scheduler, which appended it to the state
                        token, _ = generation.next()
                    else:
                        allowed = logits if constraint is None else constraint.mask(logits)
                        if len(generated) < params.min_tokens and eos:  # too early to end: EOS cannot be picked
                            allowed = allowed.clone() if allowed is logits else allowed
                            allowed[eos] = float("-inf")
                        token = sample(allowed, params, rng)
                        if params.logprobs:
                            step_logprobs = [token_logprob(logits, token, params.top_logprobs,
                                                         self.constraints.token_bytes)]
                            logprobs += step_logprobs
                        if constraint is not None:
                            constraint.advance(token)
                        if not generated:
                            ttft = time.perf_counter() - t0
                            if agent is not None:
                                with self._lock:
                                    self.counters.ttft.record(agent, ttft)
                        state.token_ids.append(token)
                        state.last_logits = None
                    generated.append(token)
                    delta = detok.add(token)
                    if detok.stopped or (token in self._loaded.eos_token_ids and not params.ignore_eos):
                        finish = "stop"
                    elif constraint is not None and constraint.ended:  # the grammar admits nothing more
                        finish = "stop"
                    elif len(generated) >= params.max_tokens:
                        finish = "length"
                    elif generation is not None:
                        pass  # the scheduler computes the next one
                    elif plain:
                        generation = self._scheduler.generate(
                            Generation(state, params, rng, self._loaded.eos_token_ids, len(generated)))
                    else:
                        logits = self.compute(state)
                    if finish is not None and generation is not None:
                        generation.stop()  # it may have run ahead of a stop string: back to what was accepted
                        self._accept(state, prompt_len + len(generated))
                    if finish is not None:
                        delta += detok.flush()
                    yield from self._emit(state, StreamChunk(text=delta, token_ids=[token], logprobs=step_logprobs,
                                                             exact=exact_prompt if len(generated) == 1 else None))
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
            if generation is not None and not registered:  # the scheduler lets go before the blocks do
                generation.stop()
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
                tokens_discarded=discarded,
            ),
            exact=handle.exact,
            # what exact promises: token-identical to dense prefill in float32 only (tests/test_exactness.py)
            token_identical=handle.exact and self._loaded.dtype == torch.float32,
            segments=segments,
            logprobs=logprobs if params.logprobs else None,
        )
        event.emit_result(self.events, result)
        return result

    def _emit(self, state: KVState, chunk: StreamChunk) -> Generator[StreamChunk, None, None]:
        """Yield a token's chunk of the stream, the state marked suspended until the consumer reads on
        (see KVManager.reserve)."""
        self._kv.suspend(state)
        try:
            yield chunk
        finally:
            self._kv.suspend(state, False)

    @staticmethod
    def _accept(state: KVState, length: int) -> None:
        """Cut a generation the scheduler stepped back to its ``length`` accepted tokens (it may have run
        ahead of a stop string); the last stays pending, as in every handle."""
        del state.token_ids[length:]
        state.num_cached = min(state.num_cached, length - 1)
        state.last_logits = None

    def first_token(self, prompt: list[int]) -> int:
        """The greedy next token after ``prompt`` on the exact path (the fidelity audit's reference), as
        background work: it never delays a request by more than one small chunk."""
        with self._lock:
            state = self._kv.share(None, 0, prompt, LineageStep(op=Op.GENERATE, token_ids=tuple(prompt)))
        with self._scheduler.background():
            result = self.stream(state, SamplingParams(max_tokens=1)).until_done()
        self.release(state)
        return result.token_ids[0]

    def _predicted(self, agent: str | None) -> float | None:
        """The steps-to-execution the hints gave ``agent`` just before it ran (None: unknown)."""
        if not isinstance(agent, str):
            return None
        with self._lock:
            value = self._predictions.get(agent)
        return None if value is None or math.isinf(value) else value


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
