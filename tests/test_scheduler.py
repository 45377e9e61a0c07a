"""The one loop without a model (backend/runtime/scheduler.py over tests/fakes.py's runner), as its users see
it: requests waiting together share forwards up to the token budget; a long prompt is never starved by
running generations; grammar and plain requests share the decode path; blocks are reserved as decoding grows,
a short pool preempts (and later recomputes, exactly) the newest generation and never lets one tenant hold
the pool against another; an error reaches every request of its forward and the loop lives on; background
work waits for quiet; closing fails what still waits."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from fakes import FakeRunner, greedy, stack
from kvbaton import PoolExhausted, SamplingParams

pytestmark = pytest.mark.unit

DEADLINE_S = 30.0  # generous: what a test waits for is named where it waits


def _until(condition, what):
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


class Gate:
    """Holds the scheduler inside its next forward until opened: what is submitted meanwhile queues up."""

    def __init__(self, runner: FakeRunner) -> None:
        self.runner = runner
        self.open = threading.Event()
        self.entered = threading.Event()
        self._forward = runner.forward
        runner.forward = self._gated  # type: ignore[method-assign]

    def _gated(self, chunks):
        if not self.entered.is_set():
            self.entered.set()
            assert self.open.wait(DEADLINE_S), "the test never opened the gate"
        return self._forward(chunks)


def _in_threads(*calls):
    """Run each call in a thread of its own (as concurrent SDK calls do); the threads and their results."""
    results: dict[int, object] = {}

    def run(i, call):
        try:
            results[i] = call()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    return threads, results


def _join(threads):
    for t in threads:
        t.join(DEADLINE_S)
        assert not t.is_alive(), "a request did not finish"


def _generate(s, tokens, n, **params):
    state = s.state(tokens)
    return lambda: s.lifecycle.stream(state, SamplingParams(max_tokens=n, ignore_eos=True, **params)).until_done()


def test_generations_waiting_together_share_every_decode_forward():
    prompts = [list(range(100 + 7 * i, 120 + 7 * i)) for i in range(4)]
    with stack(blocks=128, max_batch_tokens=128) as s:
        gate = Gate(s.runner)
        first, _ = _in_threads(_generate(s, [1, 2, 3], 1))
        assert gate.entered.wait(DEADLINE_S)
        threads, results = _in_threads(*[_generate(s, p, 6) for p in prompts])
        _until(lambda: s.scheduler.queued == 4, "the four requests to queue behind the gated forward")
        gate.open.set()
        _join(first + threads)
        assert [results[i].token_ids for i in range(4)] == [greedy(p, 6) for p in prompts]
        # their prompts in one forward, then five decode steps of four rows each
        assert s.runner.batches[1:] == [[20, 20, 20, 20]] + [[1, 1, 1, 1]] * 5


def test_a_long_prompt_gets_its_first_token_while_generations_run_and_they_keep_stepping():
    """The starvation the old queue had: a prompt longer than the step budget behind running generations waited
    until every one of them finished. Now each step takes the generations' rows and a piece of the prompt."""
    with stack(blocks=4096, prefill_chunk=16, max_batch_tokens=64) as s:
        stop = threading.Event()

        def consume(i):
            with s.lifecycle.stream(s.state(list(range(10 * i, 10 * i + 8))),
                                    SamplingParams(max_tokens=1000, ignore_eos=True)) as stream:
                for _ in stream:
                    if stop.is_set():
                        return

        consumers, _ = _in_threads(*[lambda i=i: consume(i) for i in range(4)])
        _until(lambda: sum(1 for b in s.runner.batches if b == [1, 1, 1, 1]) >= 3, "the generations to run")
        before = len(s.runner.batches)
        long_prompt = list(range(5000, 5200))  # 200 tokens: over three times the step budget
        result = _generate(s, long_prompt, 1)()
        during = s.runner.batches[before:]
        alive = [t.is_alive() for t in consumers]
        stop.set()
        _join(consumers)
        assert result.token_ids == greedy(long_prompt, 1)
        assert all(alive)  # none of the generations had finished: the prompt did not wait for them
        pieces = [n for b in during for n in b if n > 1]
        assert sum(pieces) == 200 and max(pieces) <= 16  # beside decode rows, one prefill chunk a step
        assert all(b.count(1) >= 1 for b in during if any(n > 1 for n in b))  # the generations stepped alongside


def test_a_prompt_alone_takes_the_whole_step_budget():
    with stack(prefill_chunk=16, max_batch_tokens=32) as s:
        state = s.materialize(list(range(300, 340)))
        assert s.runner.batches == [[32], [8]]
        assert torch.equal(s.logits(state), s.runner.dense_logits(list(range(300, 340))))


def test_sampled_and_early_stop_banning_requests_step_in_the_same_forwards_as_plain_ones():
    """One decode path: a seeded temperature request and one that may not end before min_tokens share every
    forward with a greedy one (grammar and logprob requests too: tests/test_structured.py on the real model)."""
    with stack(blocks=128) as s:
        gate = Gate(s.runner)
        first, _ = _in_threads(_generate(s, [1, 2, 3], 1))
        assert gate.entered.wait(DEADLINE_S)
        threads, results = _in_threads(_generate(s, list(range(20)), 5),
                                       _generate(s, list(range(40, 60)), 5, temperature=0.8, seed=7),
                                       _generate(s, list(range(60, 80)), 5, min_tokens=5))
        _until(lambda: s.scheduler.queued == 3, "the three requests to queue")
        gate.open.set()
        _join(first + threads)
        assert results[0].token_ids == greedy(list(range(20)), 5)
        assert len(results[1].token_ids) == 5 and results[2].token_ids == greedy(list(range(60, 80)), 5)
        assert s.runner.batches[1:] == [[20, 20, 20]] + [[1, 1, 1]] * 4


def test_decode_blocks_are_reserved_as_decoding_grows_not_for_max_tokens_up_front():
    with stack(blocks=64, block_size=4) as s:
        state = s.state(list(range(40)))
        stream = iter(s.lifecycle.stream(state, SamplingParams(max_tokens=100, ignore_eos=True)))
        next(stream)
        written = len(state.token_ids)  # it ran ahead of this consumer by a few tokens at most (AHEAD)
        assert len(state.blocks) <= -(-(written + 1) // 4) < 35  # what it wrote, not 140 tokens' worth up front
        stream.close()


def test_a_short_pool_preempts_the_newest_generation_which_later_goes_on_exactly():
    prompts = [list(range(10)), list(range(50, 60))]
    with stack(blocks=14, block_size=4, prefix_cache=False) as s:  # 56 slots: not both to 40 tokens
        gate = Gate(s.runner)
        first, _ = _in_threads(_generate(s, [1, 2, 3], 1))
        assert gate.entered.wait(DEADLINE_S)
        threads, results = _in_threads(_generate(s, prompts[0], 30), _generate(s, prompts[1], 30))
        _until(lambda: s.scheduler.queued == 2, "both requests to queue")
        gate.open.set()
        _join(first + threads)
        assert [results[i].token_ids for i in range(2)] == [greedy(p, 30) for p in prompts]
        assert s.scheduler.preemptions >= 1


def test_one_tenant_cannot_hold_the_pool_against_another():
    with stack(blocks=24, block_size=4, prefix_cache=False) as s:
        hog = []
        for i in range(3):
            state = s.state(list(range(100 * i, 100 * i + 4)))
            state.tenant = "a"
            hog.append(iter(s.lifecycle.stream(state, SamplingParams(max_tokens=80, ignore_eos=True))))
            next(hog[-1])
        _until(lambda: s.pool.num_free == 0 or s.scheduler.preemptions, "tenant a to fill the pool")
        other = s.state(list(range(900, 920)))
        other.tenant = "b"
        result = s.lifecycle.stream(other, SamplingParams(max_tokens=4, ignore_eos=True)).until_done()
        assert result.token_ids == greedy(list(range(900, 920)), 4)
        for stream in hog:
            stream.close()


def test_a_request_that_can_never_get_blocks_fails_instead_of_waiting_forever():
    with stack(blocks=8, block_size=4, prefix_cache=False) as s:
        held = s.materialize(list(range(28)))  # a live handle holding 7 of 8 blocks, pinned (a compose reads it)
        s.kv.pin(held.blocks)
        state = s.state(list(range(100, 124)))
        with pytest.raises(PoolExhausted):  # nothing runs that could give blocks back: at once, not in 30 s
            s.lifecycle.stream(state, SamplingParams(max_tokens=4, ignore_eos=True)).until_done()
        assert state.blocks == [] and held.id in s.handles
        s.kv.unpin(held.blocks)


def _counting(runner):
    """Make greedy decoding count on modulo 20 (logits peak at the token after the last one): a continuation that
    repeats the prompt, which prompt lookup drafts. K/V rows are still written as the fake writes them."""
    forward = runner.forward

    def peak(token):
        row = torch.zeros(runner.vocab)
        row[(token + 1) % 20] = 1.0
        return row

    def counting(chunks):
        outs = forward(chunks)
        return [torch.stack([peak(t) for t in c.token_ids]) if c.all_logits else peak(c.token_ids[-1])
                for c, _ in zip(chunks, outs, strict=True)]

    runner.forward = counting


def test_drafts_from_the_sequence_itself_give_exactly_the_tokens_plain_decoding_gives():
    tokens = list(range(20)) * 3
    outputs = {}
    for speculate in (0, 4):
        with stack(blocks=128, speculate=speculate) as s:
            _counting(s.runner)
            outputs[speculate] = _generate(s, tokens, 24)().token_ids
            if speculate:
                assert s.scheduler.accepted > 0 and len(s.runner.batches) < 24  # fewer forwards than tokens
    assert outputs[4] == outputs[0] == [(i + 1) % 20 for i in range(19, 43)]


def test_an_error_reaches_every_request_of_its_forward_and_the_loop_lives_on():
    with stack() as s:
        gate = Gate(s.runner)
        first, first_result = _in_threads(_generate(s, [1, 2, 3], 1))
        assert gate.entered.wait(DEADLINE_S)
        threads, results = _in_threads(_generate(s, list(range(10)), 3), _generate(s, list(range(20, 30)), 3))
        _until(lambda: s.scheduler.queued == 2, "both requests to queue")
        s.runner.fail = RuntimeError("device lost")  # the next forward: the gated one has begun
        gate.open.set()
        _join(first + threads)
        failed = [r for r in (first_result[0], results[0], results[1]) if isinstance(r, RuntimeError)]
        assert failed and all("device lost" in str(e) for e in failed)
        assert _generate(s, list(range(30, 40)), 2)().token_ids == greedy(list(range(30, 40)), 2)
        assert s.pool.num_used == len(s.cache.cached_blocks() | {b for h in s.handles.states() for b in h.blocks})


def test_background_work_waits_until_no_request_waits_or_runs():
    with stack(background_quiet_s=0.0) as s:
        stream = iter(s.lifecycle.stream(s.state(list(range(8))), SamplingParams(max_tokens=50, ignore_eos=True)))
        next(stream)
        done = threading.Event()
        threads, results = _in_threads(lambda: (s.lifecycle.first_token(list(range(200, 240))), done.set()))
        time.sleep(0.2)
        assert not done.is_set() and s.scheduler.background_forwards == 0  # the generation still runs
        stream.close()
        _join(threads)
        assert results[0][0] == greedy(list(range(200, 240)), 1)[0]
        assert s.scheduler.background_forwards >= 1


def test_an_idle_loop_sleeps_until_work_arrives_then_runs_it():
    with stack(background_quiet_s=0.0) as s:
        s.lifecycle.first_token(list(range(20)))  # the loop has run, and is idle now
        checks = []
        ready = s.scheduler._ready
        s.scheduler._ready = lambda: (checks.append(1), ready())[1]  # type: ignore[method-assign]
        time.sleep(0.5)
        # not a poll (it once checked every 10 ms, ~50 times here); the first request's last signals may still
        # wake it a couple of times
        assert len(checks) <= 5
        assert s.lifecycle.first_token(list(range(30, 50))) == greedy(list(range(30, 50)), 1)[0]


def test_background_prompts_go_in_small_chunks_even_alone():
    with stack(background_quiet_s=0.0, background_chunk=8, max_batch_tokens=64) as s:
        s.lifecycle.first_token(list(range(20)))
        assert s.runner.batches == [[8], [8], [4]]


def test_closing_fails_what_still_waits_and_refuses_new_work():
    with stack() as s:
        gate = Gate(s.runner)
        first, _ = _in_threads(_generate(s, [1, 2, 3], 1))
        assert gate.entered.wait(DEADLINE_S)
        threads, results = _in_threads(_generate(s, list(range(10)), 3))
        _until(lambda: s.scheduler.queued == 1, "the request to queue")
        closing = threading.Thread(target=s.scheduler.close, daemon=True)
        closing.start()
        gate.open.set()
        closing.join(DEADLINE_S)
        _join(first + threads)
        assert isinstance(results[0], RuntimeError)
        with pytest.raises(RuntimeError, match="closed"):
            _generate(s, [5, 6], 1)()
