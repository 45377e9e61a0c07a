"""The one loop: every request the engine runs is moved forward here, one step at a time.

``step()`` = schedule -> run -> postprocess, on one thread (nano-vllm's and SGLang's shape):

- **schedule** (:meth:`Scheduler._schedule`): signals from consumers first (a stop string found, a stream
  closed); then one decode row per running generation (more with speculative drafts, :mod:`.speculate`),
  growing its blocks as it goes (a pool short of blocks preempts the newest generation, which is
  recomputed from its tokens later: exact); then the prompt work of admitted requests, first come first
  served, and admissions, under the step's token budget (``max_batch_tokens``; beside decode rows a
  prompt takes at most ``prefill_chunk`` tokens a step, so running generations wait at most one such chunk,
  and a long prompt never waits for them to finish). A prompt is a *program* (:mod:`..reuse.plan`): plain
  prefill, or a reuse plan's placement; what it needs computed becomes ordinary chunks of this batch.
- **run**: one ``ModelRunner.forward`` over every chunk (and a reuse plan's deviation passes).
- **postprocess**: prompt programs get their results; every row that needs a token is sampled in one
  batched call (:mod:`.sampler`: greedy argmax for all at once, grammar masks, logprobs), token-level
  stop rules (EOS, ``max_tokens``, the grammar's end) apply once, and each request's tokens go to its
  output queue once per step. Detokenizing, stop strings and stream framing happen on the consumer's
  thread (:mod:`.output`).

Who holds blocks is :mod:`.admission`'s: admission first come first served (a request that does not fit
waits while running ones can give blocks back), decode blocks reserved as decoding grows, preemption when
the pool is short, and no tenant holding the pool against the others.

Background requests (the fidelity audit's dense checks) run only once no other request has waited or run
for ``background_quiet_s``, in chunks of at most ``background_chunk`` tokens.

Only this thread writes a running request's state and runs the model; consumers and other threads read
output queues and take the engine lock for the pool and the handle table.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch
from kvbaton.handle import LineageStep, Op

from ..cache.kv_manager import KVManager
from ..compute.runner import Chunk, ModelRunner
from ..reuse.plan import Alone, Compute, Deviation, Filled, compute_all
from .admission import Lines
from .request import Emitted, Ended, Prompted, Request, Status
from .sampler import RawLogprob, sample_rows
from .speculate import propose

log = logging.getLogger(__name__)

AHEAD = 32  # output messages a generation runs ahead of its consumer before it pauses
WAITING_POLL_S = 0.05  # how often a request that did not fit tries again
IDLE_WAIT_S = 1.0  # the longest an idle loop waits without a notification (a bound, not a poll)
STOP_WAIT_S = 120.0  # the longest a consumer waits for the scheduler to let go of its request (one step)


@dataclass
class _Row:
    """One chunk of this step's forward: a request's decode row, or a piece of its prompt."""

    request: Request
    chunk: Chunk
    decode: bool
    start: int = 0  # prompt pieces: first new position, end, and whether stale positions led it
    end: int = 0
    stale: bool = False


@dataclass
class _Batch:
    rows: list[_Row] = field(default_factory=list)
    deviations: list[Request] = field(default_factory=list)
    sample: list[tuple[Request, torch.Tensor]] = field(default_factory=list)  # prompts done without a forward

    def __bool__(self) -> bool:
        return bool(self.rows or self.deviations or self.sample)


class Scheduler:
    def __init__(
        self, runner: ModelRunner, kv: KVManager, *, max_batch_tokens: int = 2048, prefill_chunk: int = 512,
        max_batch_seqs: int = 256, background_chunk: int = 128, background_quiet_s: float = 0.25,
        admission_wait_s: float = 30.0, speculate: int = 0,
    ) -> None:
        self.runner = runner  # the only way to the model: the runner interface (compute/runner.py)
        self.kv = kv
        self.max_batch_tokens = max(max_batch_tokens, prefill_chunk)
        self.prefill_chunk = prefill_chunk
        self.max_batch_seqs = max_batch_seqs
        self.background_chunk = background_chunk
        self.background_quiet_s = background_quiet_s
        self.speculate = speculate  # draft tokens per greedy decode row (prompt lookup; 0: off)
        self._cv = threading.Condition()
        self._incoming: list[Request] = []  # added by consumers, taken at the next step
        self._signals: list[Request] = []  # stop / abort asked by consumers
        self._closed = False
        # The scheduler thread's own: the lines of waiting and running requests (admission.py).
        self.lines = Lines(kv, admission_wait_s)
        self._waiting, self._running = self.lines.waiting, self.lines.running
        self._fresh: list[Request] = []  # generations whose prompt is done: their first token is sampled next
        self._last_foreground = time.monotonic()
        # What happened, for tests, benchmarks and stats.
        self.forwards = 0
        self.background_forwards = 0
        self.max_sequences = 0
        self.drafted = 0
        self.accepted = 0
        self.steps = 0
        self.host_s = 0.0  # time in schedule and postprocess (not in the runner)
        self._thread = threading.Thread(target=self._loop, name="kvbaton-scheduler", daemon=True)
        self._thread.start()

    # -- what consumers call -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Hand a request to the loop (it is WAITING until admitted)."""
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._incoming.append(request)
            self._cv.notify()

    def stop(self, request: Request) -> None:
        """Let go of ``request`` and keep its state (its consumer found a stop string): returns once the
        scheduler holds it no more (within a step)."""
        with self._cv:
            if not request.left.is_set():
                request.stopping = True
                self._signals.append(request)
                self._cv.notify()
        if not request.left.wait(STOP_WAIT_S):
            raise RuntimeError(f"the scheduler did not let go of a request within {STOP_WAIT_S:.0f} s")

    def abort(self, request: Request) -> bool:
        """The consumer left: the scheduler lets go of ``request`` and gives its blocks back (returns once it has,
        within a step). False when it had already let go: the state is then the consumer's to drop."""
        with self._cv:
            if request.left.is_set():
                return False
            request.aborting = True
            self._signals.append(request)
            self._cv.notify()
        if not request.left.wait(STOP_WAIT_S) and self.alive:
            raise RuntimeError(f"the scheduler did not let go of a request within {STOP_WAIT_S:.0f} s")
        return True

    def wake(self) -> None:
        """A consumer read on: a paused generation may run again."""
        with self._cv:
            self._cv.notify()

    @property
    def preemptions(self) -> int:
        return self.lines.preemptions

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queued(self) -> int:
        """Requests waiting for admission."""
        with self._cv:
            return len(self._incoming) + len(self._waiting)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._ready():
                    self._cv.wait(timeout=self._sleep())
                if self._closed:
                    break
            try:
                self.step()
            except BaseException:
                log.exception("scheduler step failed")
        self._shut_down()

    def _ready(self) -> bool:
        """Something to do now (condition held)."""
        if self._incoming or self._signals:
            return True
        now = time.monotonic()
        for r in self._running:
            runnable = (r.status is Status.DECODING and r.unread < AHEAD) or \
                (r.status is Status.PROMPT and not isinstance(r.need, Alone))
            if runnable and (not r.background or self._quiet(now)):
                return True
        head = self._next_waiting(now)
        return head is not None and now - self.lines.waiting_since.get(id(head), 0.0) >= WAITING_POLL_S

    def _next_waiting(self, now: float) -> Request | None:
        """The request next in line for admission: the first to arrive, background ones only once it is quiet."""
        quiet = None
        for request in self._waiting:
            if not request.background:
                return request
            if quiet is None:
                quiet = self._quiet(now)
            if quiet:
                return request
        return None

    def _sleep(self) -> float:
        """How long the loop may wait for a notification: new requests, signals and consumers' reads notify it;
        only a request that did not fit and the end of the quiet period are woken by time. Idle, it sleeps
        (an idle server's loop once woke every 10 ms)."""
        if self._waiting:
            return WAITING_POLL_S
        until_quiet = self._last_foreground + self.background_quiet_s - time.monotonic()
        return min(1.0, max(0.01, until_quiet)) if until_quiet > 0 else IDLE_WAIT_S

    def _quiet(self, now: float) -> bool:
        """No foreground request waits or runs, and none did for the quiet period: background work may run."""
        if any(not r.background for r in self._running) or any(not r.background for r in self._waiting):
            return False
        return now - self._last_foreground >= self.background_quiet_s

    def step(self) -> bool:
        """One step of the loop; whether anything ran."""
        t0 = time.perf_counter()
        with self._cv:
            for request in self._incoming:
                self.lines.enqueue(request)
            self._incoming.clear()
            signals, self._signals = self._signals, []
        for request in signals:
            self._signaled(request)
        batch = self._schedule()
        if not batch:
            self.host_s += time.perf_counter() - t0
            return False
        t1 = time.perf_counter()
        try:
            logits = self.runner.forward([row.chunk for row in batch.rows]) if batch.rows else []
            deviations = [self._deviation(r) for r in batch.deviations]
        except BaseException as exc:  # noqa: BLE001 - handed to every request of the batch; the loop lives on
            self._fail_batch(batch, exc)
            return True
        t2 = time.perf_counter()
        self.forwards += bool(batch.rows)
        foreground = any(not row.request.background for row in batch.rows)
        self.background_forwards += bool(batch.rows) and not foreground
        if foreground or any(not r.background for r in batch.deviations):
            self._last_foreground = time.monotonic()
        self.max_sequences = max(self.max_sequences, len({id(row.request) for row in batch.rows}))
        try:
            self._postprocess(batch, logits, deviations)
        except BaseException as exc:
            log.exception("scheduler postprocess failed")
            self._fail_batch(batch, exc)
        self.steps += 1
        self.host_s += (t1 - t0) + (time.perf_counter() - t2)
        return True

    # -- schedule --------------------------------------------------------------------------------
    def _schedule(self) -> _Batch:
        batch = _Batch()
        now = time.monotonic()
        quiet = self._quiet(now)
        budget = self.max_batch_tokens
        for request in list(self._running):
            if request.status is not Status.DECODING or (request.background and not quiet):
                continue
            if len(batch.rows) >= self.max_batch_seqs:
                break
            if request.unread >= AHEAD:  # its consumer is not reading: pause it
                self.lines.paused_since.setdefault(id(request), now)
                continue
            self.lines.paused_since.pop(id(request), None)
            row = self._decode_row(request, batch)
            if row is not None:
                batch.rows.append(row)
                budget -= len(row.chunk.token_ids)
        # Prompts beside decode rows take at most one prefill chunk a step: the generations wait at most that.
        prompt_budget = min(budget, self.prefill_chunk) if batch.rows else budget
        for request in [r for r in self._running if r.status is Status.PROMPT]:
            if request.background and not quiet:
                continue
            prompt_budget -= self._prompt_work(request, batch, prompt_budget)
        while prompt_budget > 0 and len(batch.rows) < self.max_batch_seqs:
            request = self._next_waiting(now)
            if request is None:
                break
            if not self._admit(request, now):
                break  # first come, first served: the head waits for blocks, and the rest behind it
            prompt_budget -= self._prompt_work(request, batch, prompt_budget)
        batch.sample.extend((r, r.state.last_logits) for r in self._fresh)  # prompts that needed no forward
        self._fresh.clear()
        return batch

    def _decode_row(self, request: Request, batch: _Batch) -> _Row | None:
        state = request.state
        start = state.num_cached
        pending = state.token_ids[start:]
        request.draft = propose(state.token_ids, self.speculate) if self._speculates(request) else []
        tokens = pending + request.draft
        if not self._grow(request, start + len(tokens), batch):
            return None
        return _Row(request, Chunk(state.blocks, start, tokens, all_logits=bool(request.draft)), decode=True)

    def _speculates(self, request: Request) -> bool:
        p = request.params
        # Drafts are kept by the row's plain argmax: not where a mask applies (a grammar, EOS before min_tokens).
        return (self.speculate > 0 and p is not None and p.greedy and request.constraint is None and not p.logprobs
                and request.generated >= p.min_tokens and p.max_tokens - request.generated > 1)

    def _prompt_work(self, request: Request, batch: _Batch, budget: int) -> int:
        """Schedule what ``request``'s prompt program needs now; the tokens that takes."""
        need = request.need
        if isinstance(need, Deviation):
            batch.deviations.append(request)
            return 0
        if not isinstance(need, Compute) or budget <= 0:
            return 0
        state = request.state
        size = budget if not need.all_logits else None  # measurements want their rows in one piece
        if request.background:
            size = min(size or self.background_chunk, self.background_chunk)
        stale = state.stale[:size] if size is not None else list(state.stale)
        del state.stale[: len(stale)]
        start = state.num_cached
        end = need.until if size is None else min(need.until, start + size - len(stale))
        if not stale:
            chunk = Chunk(state.blocks, start, state.token_ids[start:end], all_logits=need.all_logits)
        else:
            positions = stale + list(range(start, end))
            chunk = Chunk(state.blocks, positions[0], [state.token_ids[p] for p in positions], positions=positions)
        batch.rows.append(_Row(request, chunk, decode=False, start=start, end=end, stale=bool(stale)))
        return len(chunk.token_ids)

    # -- admission and blocks (admission.py) -----------------------------------------------------------
    def _admit(self, request: Request, now: float) -> bool:
        """Admit ``request`` (reserve its prompt's blocks) and start its program; False while it must wait."""
        try:
            if not self.lines.admit(request, now):
                return False
        except BaseException as exc:  # noqa: BLE001 - it fails; the next one in line may try
            self._fail(request, exc)
            return True
        self._advance(request, None)
        return True

    def _grow(self, request: Request, upto: int, batch: _Batch) -> bool:
        """Blocks for ``request``'s positions below ``upto``, preempting others when short; whether it goes on."""
        try:
            preempted = self.lines.grow(request, upto)
        except BaseException as exc:  # noqa: BLE001 - PoolExhausted with nothing to preempt, a tier failure
            self._fail(request, exc)
            return False
        if preempted:
            batch.rows = [row for row in batch.rows if row.request not in preempted]
        return True

    # -- programs ----------------------------------------------------------------------------------
    def _advance(self, request: Request, value: object) -> None:
        """Run ``request``'s prompt program until it needs something computed (or ends)."""
        state = request.state
        try:
            while True:
                need = request.program.send(value)
                if isinstance(need, Compute) and state.num_cached >= need.until and not state.stale:
                    value = state.last_logits if need.until == state.num_tokens else None
                    continue
                request.need = need
                if isinstance(need, Alone):
                    self._spawn(request, need)
                return
        except StopIteration as done:
            self._prompt_done(request, done.value)
        except BaseException as exc:  # noqa: BLE001 - the request fails, the loop goes on
            self._fail(request, exc)

    def _spawn(self, parent: Request, need: Alone) -> None:
        """A program's context-free reference: its tokens prefilled alone, as a request of their own."""
        tokens = list(need.tokens)
        state = self.kv.share(None, 0, tokens, LineageStep(op=Op.MATERIALIZE, token_ids=tuple(tokens)))
        state.tenant, state.agent = parent.state.tenant, parent.state.agent
        child = Request(state=state, program=compute_all(state), background=parent.background, tenant=parent.tenant,
                        parent=parent)
        self.kv.attach(child.state)
        self.lines.enqueue(child)

    def _prompt_done(self, request: Request, filled: Filled) -> None:
        state = request.state
        request.need = None
        parent = request.parent
        if parent is not None:  # a reference prefill: its K/V go to the program that asked
            try:
                kv = self.kv.read_rows(state, 0, state.num_tokens)
            except BaseException as exc:  # noqa: BLE001
                self._fail(request, exc)
                return
            self.kv.insert(state)
            self._let_go(request, drop=True)
            self._advance(parent, kv)
            return
        logits = _own(filled.logits)
        state.last_logits = logits
        if not request.prompted:
            request.prompted = True
            approximate = max(0, request.reused_prefix - state.exact_len) if state.exact_len is not None else 0
            approximate += sum(s.tokens_reused for s in filled.segments if not s.exact)
            request.out.put(Prompted(
                reused=request.reused_prefix + sum(s.tokens_reused for s in filled.segments),
                approximate=approximate, discarded=filled.discarded, segments=filled.segments,
                exact=state.exact_len is None, extra=filled.extra,
                recomputed=sum(s.end - s.start - s.tokens_cached - s.tokens_reused for s in filled.segments),
            ))
        if request.generates:
            if logits is None:
                self._fail(request, RuntimeError("a generation's prompt ended without next-token logits"))
                return
            request.status = Status.DECODING
            self.kv.insert(state)  # its prompt, for requests beside it (a registered state offers the rest)
            self._fresh.append(request)
            return
        request.out.put(Ended("prefilled"))
        self._let_go(request)

    def _deviation(self, request: Request) -> torch.Tensor:
        need = request.need
        assert isinstance(need, Deviation)
        state = request.state
        return self.runner.deviation(state.blocks, need.start, state.token_ids[need.start : need.start + need.n])

    # -- postprocess -------------------------------------------------------------------------------
    def _postprocess(self, batch: _Batch, logits: list[torch.Tensor], deviations: list[torch.Tensor]) -> None:
        rows: list[tuple[Request, torch.Tensor]] = list(batch.sample)
        for row, out in zip(batch.rows, logits, strict=True):
            request, state = row.request, row.request.state
            if request.left.is_set():
                continue
            if row.decode:
                if request.draft:
                    rows.extend(self._verified(request, out))
                else:
                    state.num_cached = len(state.token_ids)
                    rows.append((request, out))
                continue
            state.num_cached = max(row.start, row.end)
            need = request.need
            assert isinstance(need, Compute)
            if state.num_cached < need.until or state.stale:
                continue  # more chunks next step
            value = out if not (row.stale and row.end <= row.start and row.chunk.positions[-1] != row.start - 1) \
                else None  # the chunk ended on a stale position: no logits after the last token
            keep = value is not None and need.until == state.num_tokens and not need.all_logits
            state.last_logits = _own(value) if keep else None
            self._advance(request, value)
        for request, deviation in zip(batch.deviations, deviations, strict=True):
            if not request.left.is_set():
                self._advance(request, deviation)
        rows.extend((r, r.state.last_logits) for r in self._fresh)
        self._fresh.clear()
        if rows:
            self._sample(rows)

    def _verified(self, request: Request, out: torch.Tensor) -> list[tuple[Request, torch.Tensor]]:
        """A decode row with drafts (``out``: logits after the pending token and after each draft): the drafts
        greedy decoding would have produced are accepted, the rest's K/V left to be overwritten."""
        state = request.state
        draft = request.draft
        best = out.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(draft) and best[accepted] == draft[accepted]:
            accepted += 1
        accepted = min(accepted, request.params.max_tokens - request.generated - 1)  # type: ignore[union-attr]
        self.drafted += len(draft)
        self.accepted += accepted
        request.drafted += len(draft)
        request.accepted += accepted
        written = len(state.token_ids)  # the pending token's position + 1: its K/V and the drafts' are in the pool
        request.draft = []
        for i, token in enumerate(draft[:accepted]):
            state.num_cached = written + i  # the accepted token is the pending one: an end leaves it so
            if not self._emit(request, [token]):
                return []
        state.num_cached = written + accepted
        return [(request, out[accepted])]

    def _sample(self, rows: list[tuple[Request, torch.Tensor]]) -> None:
        requests = [r for r, _ in rows]
        tokens, logprobs = sample_rows([l for _, l in rows], requests)
        for request, token, logprob in zip(requests, tokens, logprobs, strict=True):
            if request.t_first is None:
                request.t_first = time.perf_counter()
            self._emit(request, [token], logprob)

    def _emit(self, request: Request, tokens: list[int], logprob: RawLogprob | None = None) -> bool:
        """Append sampled (or accepted) tokens, apply the token-level stop rules, hand them to the consumer;
        whether the request goes on."""
        state, params = request.state, request.params
        assert params is not None
        for token in tokens:
            state.token_ids.append(token)
            state.last_logits = None
            request.generated += 1
            if request.constraint is not None:
                request.constraint.advance(token)
            finish = None
            if token in request.eos or request.constraint is not None and request.constraint.ended:
                finish = "stop"
            elif request.generated >= params.max_tokens:
                finish = "length"
            request.out.put(Emitted([token], [logprob] if logprob is not None else None, finish))
            if finish is not None:
                self._finish(request)
                return False
        return True

    # -- letting go --------------------------------------------------------------------------------
    def _finish(self, request: Request) -> None:
        self.kv.trim(request.state)
        self._let_go(request)

    def _let_go(self, request: Request, drop: bool = False) -> None:
        """The scheduler holds ``request`` no more (its state is its consumer's now, or dropped)."""
        self.lines.remove(request)
        request.status = Status.FINISHED
        request.need = None
        if drop:
            request.program.close()  # its finally blocks: the sources it pinned
            self.kv.drop(request.state)
        with self._cv:
            request.left.set()
        self._last_foreground = time.monotonic() if not request.background else self._last_foreground

    def _fail(self, request: Request, exc: BaseException) -> None:
        """``request`` fails with ``exc``: everything it held goes back, and so does its reference prefill's
        (a failing reference prefill fails the program that asked for it)."""
        if request.left.is_set():
            return
        for child in [r for r in (*self._running, *self._waiting) if r.parent is request]:
            self._let_go(child, drop=True)
        self._let_go(request, drop=True)
        request.out.put(exc)
        if request.parent is not None:
            self._fail(request.parent, exc)

    def _fail_batch(self, batch: _Batch, exc: BaseException) -> None:
        failed = {id(r.request): r.request for r in batch.rows}
        failed.update({id(r): r for r in (*batch.deviations, *(r for r, _ in batch.sample), *self._fresh)})
        self._fresh.clear()
        for request in failed.values():
            self._fail(request, exc)

    def _signaled(self, request: Request) -> None:
        if request.left.is_set():
            return
        if request.aborting:
            self._fail(request, RuntimeError("the request was abandoned"))
        elif request.stopping:
            self._let_go(request)

    def _shut_down(self) -> None:
        with self._cv:
            requests = [*self._incoming, *self._waiting, *self._running]
            self._incoming.clear()
        for request in requests:
            self._fail(request, RuntimeError("the engine was closed"))


def _own(logits: torch.Tensor | None) -> torch.Tensor | None:
    """Logits kept with a state in storage of their own: a row of a batch's logits would keep the whole batch."""
    if logits is not None and logits.untyped_storage().nbytes() > logits.nbytes:
        return logits.clone()
    return logits
