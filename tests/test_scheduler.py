"""The batching scheduler without a model (backend/runtime/scheduler.py over tests/fakes.py's runner): work
waiting together runs as one forward up to the token budget, a call runs alone, an error reaches every request
of its batch and the loop lives on, background work waits for quiet, and closing fails what still waits."""

from __future__ import annotations

import threading
import time

import pytest
from fakes import FakeRunner, tiny_pool
from kvbaton.backend.compute.runner import Chunk
from kvbaton.backend.runtime.scheduler import Scheduler

pytestmark = pytest.mark.unit

DEADLINE_S = 10.0


class GatedRunner(FakeRunner):
    """Its first forward waits for ``gate``: work submitted meanwhile queues up behind it."""

    def __init__(self, pool):
        super().__init__(pool)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def forward(self, chunks):
        if not self.entered.is_set():
            self.entered.set()
            assert self.gate.wait(DEADLINE_S)
        return super().forward(chunks)


def _until(condition):
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _submit(scheduler, chunks):
    """Run each chunk from a thread of its own (as concurrent requests do); the threads and their results."""
    results: dict[int, object] = {}

    def run(i, chunk):
        try:
            results[i] = scheduler.run(chunk)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(chunks)]
    for t in threads:
        t.start()
    return threads, results


@pytest.fixture
def gated():
    pool = tiny_pool(64)
    runner = GatedRunner(pool)
    scheduler = Scheduler(runner, max_batch_tokens=16, gather_s=0.0, background_quiet_s=0.0)
    yield pool, runner, scheduler
    runner.gate.set()
    scheduler.close()


def _chunks(pool, sizes):
    return [Chunk(pool.allocate(4), 0, list(range(10 * i, 10 * i + n))) for i, n in enumerate(sizes)]


def _occupy(gated):
    """The scheduler thread inside a (gated) forward of one chunk, so that work submitted now waits; its thread."""
    pool, runner, scheduler = gated
    threads, _ = _submit(scheduler, _chunks(pool, [1]))
    assert runner.entered.wait(DEADLINE_S)
    return threads


def _queue(scheduler, pool, sizes):
    """Submit chunks of ``sizes`` tokens and wait until they all wait in the scheduler; the threads, results."""
    before = scheduler.queued
    threads, results = _submit(scheduler, _chunks(pool, sizes))
    _until(lambda: scheduler.queued == before + len(sizes))
    return threads, results


def test_work_waiting_together_runs_as_one_forward_up_to_the_token_budget(gated):
    pool, runner, scheduler = gated
    first = _occupy(gated)
    threads, results = _queue(scheduler, pool, [4] * 6)
    runner.gate.set()
    for t in first + threads:
        t.join(DEADLINE_S)
    assert runner.batches == [[1], [4, 4, 4, 4], [4, 4]]  # 16 tokens, then the rest
    assert scheduler.max_sequences == 4 and scheduler.forwards == 3
    assert all(r.shape == (runner.vocab,) for r in results.values())


def test_a_call_runs_alone_in_turn_with_the_forwards(gated):
    pool, runner, scheduler = gated
    first = _occupy(gated)
    threads, _ = _queue(scheduler, pool, [2])
    called = []
    caller = threading.Thread(target=lambda: called.append(scheduler.call(lambda: len(runner.batches))))
    caller.start()
    _until(lambda: scheduler.queued == 2)
    more, _ = _queue(scheduler, pool, [3])
    runner.gate.set()
    for t in first + threads + more + [caller]:
        t.join(DEADLINE_S)
    assert runner.batches == [[1], [2], [3]] and called == [2]  # the call ran after [2], before [3]


def test_an_error_reaches_every_request_of_its_batch_and_the_loop_lives_on(gated):
    pool, runner, scheduler = gated
    runner.fail = RuntimeError("device lost")
    runner.gate.set()
    threads, results = _submit(scheduler, _chunks(pool, [2]))
    threads[0].join(DEADLINE_S)
    assert isinstance(results[0], RuntimeError)
    assert scheduler.run(_chunks(pool, [2])[0]).shape == (runner.vocab,)


def test_background_work_waits_until_no_request_is_active_or_waiting():
    pool = tiny_pool(16)
    runner = FakeRunner(pool)
    scheduler = Scheduler(runner, gather_s=0.0, background_quiet_s=0.0)
    done = threading.Event()

    def check():
        with scheduler.background():
            scheduler.run(Chunk(pool.allocate(1), 0, [1, 2]))
        done.set()

    try:
        with scheduler.decoding():  # a request between two of its steps
            background = threading.Thread(target=check)
            background.start()
            _until(lambda: scheduler.queued == 1)
            assert scheduler.run(Chunk(pool.allocate(1), 0, [3])) is not None  # the request's own step runs
            assert not done.is_set() and scheduler.background_forwards == 0
        assert done.wait(DEADLINE_S) and scheduler.background_forwards == 1
        background.join(DEADLINE_S)
    finally:
        scheduler.close()


def test_background_prompts_go_in_small_chunks():
    scheduler = Scheduler(FakeRunner(tiny_pool(1)), max_batch_tokens=64, background_chunk=8)
    try:
        assert scheduler.chunk_tokens(16) == 64  # alone: the whole budget
        with scheduler.background():
            assert scheduler.chunk_limit(512) == 8 and scheduler.chunk_tokens(16) == 8
        with scheduler.decoding():
            assert scheduler.chunk_tokens(16) == 16  # another request waits on each chunk
    finally:
        scheduler.close()


def test_closing_fails_what_still_waits_and_refuses_new_work(gated):
    pool, runner, scheduler = gated
    first = _occupy(gated)
    waiting, later = _queue(scheduler, pool, [2])
    closer = threading.Thread(target=scheduler.close)
    closer.start()
    _until(lambda: scheduler._closed)  # closed while the forward still runs: the waiting work never starts
    runner.gate.set()
    for t in first + waiting + [closer]:
        t.join(DEADLINE_S)
    assert isinstance(later[0], RuntimeError) and "closed" in str(later[0])
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.run(_chunks(pool, [1])[0])
