"""The request lifecycle: an operator's call turned into a :class:`~.request.Request`, and its result.

The lifecycle builds a request for a fresh :class:`~.sequence.KVState` (its tokens, and the blocks it
shares with its parent), attaches what the prefix cache holds of it (slow-tier reads run here, on the
caller's thread, never on the scheduler's), hands it to the :class:`~.scheduler.Scheduler` and reads its
output (:mod:`.output`): it never runs a forward, admits a request or samples. What it does is on either
side of the scheduler: checks before a request starts (its agent tag, its response format, whether it
could ever fit), and after it ends, the handle table (a finished state is registered with its blocks
offered to the prefix cache and its spans to the span index), the request counters and one ``request``
event per request.

A request's prompt is a program (:mod:`..reuse.plan`): plain prefill (:func:`~..reuse.plan.compute_all`),
a cross-prefix reuse plan (:class:`~..reuse.place.AutoReuse`), a composition (:mod:`..reuse.compose`), a
measurement. The scheduler runs what it needs.

Invariants:

- a request that fails or is abandoned gives every block back (the scheduler drops what it holds, the
  consumer what the scheduler has let go of); only a finished one is registered;
- an idle stream consumer blocks nobody: a generation runs at most ``AHEAD`` messages ahead of it, then
  pauses;
- a request with a response format samples only tokens its grammar allows (:mod:`.constrained`), masked in
  the scheduler's batched sampling, so constrained and unconstrained requests share every forward.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Generator, Mapping
from typing import Any

import torch
from kvbaton.handle import Handle, LineageStep, Op
from kvbaton.stream import TokenStream
from kvbaton.types import Result, SamplingParams, StreamChunk, Timings

from ..cache.kv_manager import KVManager, Loads
from ..cache.sequence import KVState
from ..compute.loader import LoadedModel
from ..events import EventRing
from ..handles import HandleTable
from ..reuse.place import AutoReuse
from ..reuse.plan import Compute, Filled, Program, compute_all
from ..reuse.spans import SpanIndex
from ..tenants import Agent, check_agent_of, label_of
from .constrained import Constraints
from .counters import RequestCounters
from .detokenizer import Detokenizer
from .output import GenerationOutput, wait_prompt
from .request import Prompted, Request
from .sampler import make_generator
from .scheduler import Scheduler


class Lifecycle:
    def __init__(
        self, kv: KVManager, scheduler: Scheduler, handles: HandleTable[KVState], loaded: LoadedModel,
        events: EventRing | None = None, spans: SpanIndex | None = None,
        predictions: Mapping[str, float] | None = None,
    ) -> None:
        self._kv = kv
        self.events = events if events is not None else EventRing()  # one ``request`` event per request
        self._lock = kv.lock
        self.scheduler = scheduler
        self._handles = handles  # its identity is what published handles carry
        self._loaded = loaded
        self.counters = RequestCounters()
        self.constraints = Constraints(loaded)  # response formats (constrained decoding)
        self._spans = spans  # indexes every cacheable state registered, forgets every one dropped
        # Each hinted agent's steps-to-execution just before it ran (the engine's live map; engine lock).
        self._predictions: Mapping[str, float] = predictions if predictions is not None else {}

    # -- the handle table --------------------------------------------------------------------------
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

    # -- requests ----------------------------------------------------------------------------------
    def submit(
        self, state: KVState, program: Program[Filled] | None = None, *, attach: bool = True,
        loads: Loads | None = None, background: bool = False, **generation: Any,
    ) -> Request:
        """Hand ``state`` to the scheduler: the prefix cache's blocks attached first (here: slow-tier reads never
        stall the loop), ``program`` computing its prompt (default: every uncached token)."""
        try:
            params = generation.get("params")
            # the last sampled token is never fed back, so its K/V is never written
            self._kv.check_fits(state.num_tokens + (max(params.max_tokens - 1, 0) if params is not None else 0))
            if attach:
                self._kv.attach(state, loads)
            request = Request(state=state, program=program or compute_all(state), background=background,
                              tenant=state.tenant, reused_prefix=state.num_cached, **generation)
            self.scheduler.add(request)
        except BaseException:
            self.abandon(state)
            raise
        return request

    def run(self, state: KVState, program: Program[Filled], *, attach: bool = True, register: bool = False,
            count: bool = True, agent: Agent | None = None) -> tuple[Handle | None, Prompted]:
        """Run a request without generation; its handle when ``register`` (the state is otherwise the
        caller's to drop; ``count``: its prompt counts in the request counters), and what its prompt did."""
        ref, label = agent, label_of(agent)
        event = _RequestEvent(state, label, self._predicted(label))
        try:
            check_agent_of(ref)
            state.agent = label if label is not None else state.agent
            request = self.submit(state, program, attach=attach, loads=event.loads)
            prompted = wait_prompt(self.scheduler, request)
            event.t_admitted = request.t_admitted
            handle = self.register(state, prompted.reused if count else None) if register else None
        except BaseException:
            self.abandon(state)
            event.emit(self.events, "error")
            raise
        event.emit(self.events, "done", reused=prompted.reused, prefilled=state.num_tokens - prompted.reused,
                   handle=handle.id if handle is not None else None)
        return handle, prompted

    def prefill(self, state: KVState, agent: Agent | None = None) -> Handle:
        """Prefill a new state and register it; free it again on failure."""
        handle, _ = self.run(state, compute_all(state), register=True, agent=agent)
        assert handle is not None
        return handle

    def logits_after_each(self, state: KVState) -> torch.Tensor:
        """Next-token logits after each uncached token (blocks not attached from the cache): ``[n, vocab]``;
        the state stays the caller's."""
        def program() -> Program[Filled]:
            return Filled(None, extra=(yield Compute(state.num_tokens, all_logits=True)))
        return self.run(state, program(), attach=False)[1].extra

    def stream(
        self, state: KVState, params: SamplingParams, agent: Agent | None = None, reuse: AutoReuse | None = None,
        *, background: bool = False,
    ) -> TokenStream:
        """A generation behind ``state``'s prompt, as a stream; closing it, even unread, frees the state.
        ``reuse`` fills the prompt after admission, placing spans of other states (default: compute every
        uncached token)."""
        ref, label = agent, label_of(agent)
        try:
            check_agent_of(ref)
            constraint = self.constraints.start(params)  # a bad schema fails before admission
        except BaseException:
            self.abandon(state)
            raise
        state.agent = label
        event = _RequestEvent(state, label, self._predicted(label), background=background)
        eos = self._loaded.eos_token_ids
        request = self.submit(
            state, reuse.program(state) if reuse is not None else None, loads=event.loads, background=background,
            params=params, constraint=constraint, rng=make_generator(params, self._loaded.device),
            eos=frozenset() if params.ignore_eos else eos, banned=sorted(eos),
        )
        chunks = self._generation(request, label, event)
        next(chunks)  # run up to the sentinel so that closing the stream, even unread, frees the state
        return TokenStream(chunks)  # type: ignore[arg-type]

    def _generation(self, request: Request, agent: str | None, event: _RequestEvent
                    ) -> Generator[StreamChunk | None, None, Result]:
        state, params = request.state, request.params
        assert params is not None
        out = GenerationOutput(self.scheduler, request, Detokenizer(self._loaded.tokenizer, params.stop, params.min_tokens),
                               state.num_tokens, self.constraints.token_bytes)
        registered = False

        def first() -> None:
            if agent is not None:
                with self._lock:
                    self.counters.ttft.record(agent, out.ttft)

        try:
            yield None  # sentinel, consumed by stream()
            for chunk in out.chunks(first):
                if out.prompted is not None and not event.counted:
                    event.counted = True
                    event.t_admitted = request.t_admitted
                    with self._lock:
                        p = out.prompted
                        self.counters.prompt(p.reused, out.prompt_len, p.approximate, p.discarded, p.recomputed)
                yield chunk
            with self._lock:
                self._kv.trim(state)
                last = state.lineage[-1]
                state.lineage = state.lineage[:-1] + (
                    last.model_copy(update={"token_ids": last.token_ids + tuple(out.generated)}),
                )
                self.counters.tokens_generated += len(out.generated)
                handle = self.register(state)
                registered = True
        except GeneratorExit:
            event.finish = "abandoned"
            raise
        finally:
            if not registered:  # error or abandoned stream: give everything back
                if not out.abandon():
                    self.abandon(state)
                event.emit(self.events, event.finish or "error", generated=len(out.generated))
        prompted = out.prompted
        assert prompted is not None
        result = Result(
            text=out.detokenizer.text,
            token_ids=out.generated,
            handle=handle,
            finish_reason=out.finish,  # type: ignore[arg-type]
            timings=Timings(
                ttft_s=out.ttft,
                total_s=time.perf_counter() - request.t_submitted,
                tokens_reused=prompted.reused,
                tokens_prefilled=out.prompt_len - prompted.reused,
                tokens_generated=len(out.generated),
                tokens_approximate=prompted.approximate,
                tokens_discarded=prompted.discarded,
                tokens_recomputed=prompted.recomputed,
            ),
            exact=handle.exact,
            # what exact promises: token-identical to dense prefill in float32 only (tests/test_exactness.py)
            token_identical=handle.exact and self._loaded.dtype == torch.float32,
            segments=prompted.segments,
            logprobs=out.logprobs if params.logprobs else None,
        )
        event.emit_result(self.events, result, request.t_submitted)
        return result

    def first_token(self, prompt: list[int]) -> int:
        """The greedy next token after ``prompt`` on the exact path (the fidelity audit's reference), as
        background work: it never delays a request by more than one small chunk."""
        with self._lock:
            state = self._kv.share(None, 0, prompt, LineageStep(op=Op.GENERATE, token_ids=tuple(prompt)))
        result = self.stream(state, SamplingParams(max_tokens=1), background=True).until_done()
        self.release(state)
        return result.token_ids[0]

    def _predicted(self, agent: str | None) -> float | None:
        """The steps-to-execution the hints gave ``agent`` just before it ran (None: unknown)."""
        if not isinstance(agent, str):
            return None
        with self._lock:
            value = self._predictions.get(agent)
        return None if value is None or math.isinf(value) else value


MAX_REASONS = 8  # span reasons an event carries (a prompt quoting many spans: the first ones)


class _RequestEvent:
    """The ``request`` event of one request, filled in as it goes (times from ``time.time()``)."""

    def __init__(self, state: KVState, agent: str | None, predicted: float | None, background: bool = False) -> None:
        step = state.lineage[-1] if state.lineage else None
        self.agent = agent if isinstance(agent, str) else None  # a bad tag fails the request, not its event
        self.predicted = predicted
        self.background = background  # the engine's own work (a fidelity check), not a user's request
        self.op = step.op.value if step is not None else None
        self.handle_in = step.parent if step is not None else None
        self.request_id = uuid.uuid4().hex[:16]
        self.loads = Loads()
        self.t_queued = time.time()
        self.t_admitted: float | None = None
        self.finish: str | None = None
        self.counted = False

    def emit(
        self, ring: EventRing, finish: str, *, reused: int = 0, prefilled: int = 0, generated: int = 0,
        handle: str | None = None,
    ) -> None:
        ring.emit(
            "request", agent=self.agent, request_id=self.request_id, op=self.op, finish=finish,
            t_queued=self.t_queued, t_admitted=self.t_admitted, t_done=time.time(),
            tokens_reused=reused, tokens_prefilled=prefilled, tokens_generated=generated,
            handle_in=self.handle_in, handle_out=handle, blocks_loaded=dict(self.loads.blocks),
            prefetch_hits=self.loads.prefetch_hits, ste_predicted=self.predicted, background=self.background,
        )

    def emit_result(self, ring: EventRing, result: Result, t_submitted: float) -> None:
        """A finished generation: its phases are the engine's own ``Timings`` (from ``t_queued``)."""
        t = result.timings
        ring.emit(
            "request", agent=self.agent, request_id=self.request_id, op=self.op, finish=result.finish_reason,
            t_queued=self.t_queued, t_admitted=self.t_admitted, t_first_token=self.t_queued + t.ttft_s,
            t_done=self.t_queued + t.total_s, tokens_reused=t.tokens_reused, tokens_approximate=t.tokens_approximate,
            tokens_prefilled=t.tokens_prefilled, tokens_generated=t.tokens_generated, handle_in=self.handle_in,
            handle_out=result.handle.id, blocks_loaded=dict(self.loads.blocks),
            prefetch_hits=self.loads.prefetch_hits, ste_predicted=self.predicted, background=self.background,
            tokens_recomputed=t.tokens_recomputed,
            reasons=[s.reason for s in result.segments if s.outcome == "recomputed" or s.tokens_reused < s.end - s.start
                     - s.tokens_cached][:MAX_REASONS],
        )
