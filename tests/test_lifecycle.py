"""The request lifecycle without a model (backend/runtime/lifecycle.py over tests/fakes.py's runner): a
generation gives what a dense pass would and registers its handle, a prompt program's stale positions ride
along with its next chunk, a stop string cuts the state back to the accepted tokens, an unread stream pauses
its generation, and a request that fails or is abandoned gives every block back and is never registered."""

from __future__ import annotations

import time

import pytest
import torch
from fakes import chain, greedy, stack
from kvbaton import SamplingParams
from kvbaton.backend.reuse.place import recompute_at
from kvbaton.backend.reuse.plan import Compute, Deviation, Filled

pytestmark = pytest.mark.unit

PROMPT = list(range(300, 340))  # 40 tokens


def test_the_decode_loop_generates_what_a_dense_pass_does_and_registers_the_handle():
    with stack() as s:
        state = s.state(PROMPT)
        result = s.lifecycle.stream(state, SamplingParams(max_tokens=6, ignore_eos=True)).until_done()
        assert result.token_ids == greedy(PROMPT, 6) and result.finish_reason == "length"
        assert result.text == "".join(f"<{t}>" for t in result.token_ids)
        assert result.handle.num_tokens == 46 and result.handle.id in s.handles
        assert s.runner.batches == [[40]] + [[1]] * 5  # the prompt, then the five tokens before the last
        assert state.num_cached == 45  # the last token stays pending for its next user
        assert len(state.blocks) == 12  # the tokens' blocks, no more
        assert s.lifecycle.counters.tokens_generated == 6


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_request_that_fails_gives_every_block_back_and_is_not_registered(where):
    with stack() as s:
        state = s.state(PROMPT)
        if where == "prefill":
            s.runner.fail = RuntimeError("device lost")
            with pytest.raises(RuntimeError, match="device lost"):
                s.lifecycle.prefill(state)
        else:
            stream = iter(s.lifecycle.stream(state, SamplingParams(max_tokens=100, ignore_eos=True)))
            next(stream)  # it runs ahead of this consumer, then pauses: the next forwards fail
            s.runner.fail = RuntimeError("device lost")
            with pytest.raises(RuntimeError, match="device lost"):
                list(stream)
        assert state.blocks == [] and state.id not in s.handles
        assert s.pool.num_used == len(s.cache.cached_blocks())  # only the prefix cache holds blocks
        assert [e.finish for e in s.lifecycle.events.since(0).events] == ["error"]


def test_an_abandoned_stream_gives_every_block_back():
    with stack() as s:
        state = s.state(PROMPT)
        stream = s.lifecycle.stream(state, SamplingParams(max_tokens=8, ignore_eos=True))
        next(iter(stream))
        stream.close()
        assert state.blocks == [] and state.id not in s.handles
        unread = s.state(PROMPT[:8])
        s.lifecycle.stream(unread, SamplingParams(max_tokens=8)).close()  # closed before reading anything
        assert unread.blocks == [] and unread.id not in s.handles
        assert s.pool.num_used == len(s.cache.cached_blocks())


def test_stale_positions_are_recomputed_in_the_next_chunk_with_the_new_tokens():
    """A prompt program (as a reuse plan is) yields what it needs computed; positions it marks stale ride along
    with the tokens of its next chunk, in one forward, and come out as a dense pass writes them."""
    seen = {}

    def program(state):
        yield Compute(40)
        slot = s.runner.slot(state.blocks, 38)
        s.pool.k[:, :, slot] = s.pool.v[:, :, slot] = 0.0  # as if re-aligned from another context
        seen["deviation"] = (yield Deviation(37, 2)).tolist()
        recompute_at(state, [38])
        logits = yield Compute(state.num_tokens)
        return Filled(logits)

    with stack() as s:
        state = s.state(PROMPT + [1, 2, 3])
        s.lifecycle.run(state, program(state), register=True)
        assert seen["deviation"] == [0.0, 1.0]
        assert s.runner.batches[-1] == [4]  # position 38, then the three new tokens, in one chunk
        assert s.runner.rows(state.blocks, 43) == chain(PROMPT + [1, 2, 3])
        assert torch.equal(s.logits(state), s.runner.dense_logits(PROMPT + [1, 2, 3]))


def test_a_generation_is_cut_back_to_its_stop_string():
    """The scheduler may compute tokens past a stop string before the consumer sees it: they are cut off, the
    handle holds exactly the accepted tokens (the last pending), and a continuation from it is what a dense
    pass gives."""
    want = greedy(PROMPT, 40)
    with stack() as s:
        state = s.state(PROMPT)
        stop = f"<{want[2]}>"
        accepted = want[: want.index(want[2]) + 1]
        result = s.lifecycle.stream(state, SamplingParams(max_tokens=40, stop=[stop], ignore_eos=True)).until_done()
        assert result.token_ids == accepted and result.finish_reason == "stop"
        assert state.token_ids == PROMPT + accepted and state.num_cached == len(PROMPT) + len(accepted) - 1
        follow = s.state([7], parent=state)
        more = s.lifecycle.stream(follow, SamplingParams(max_tokens=3, ignore_eos=True)).until_done()
        assert more.token_ids == greedy(PROMPT + accepted + [7], 3)


def test_a_generation_runs_at_most_AHEAD_tokens_ahead_of_a_consumer_that_does_not_read():
    from kvbaton.backend.runtime.scheduler import AHEAD

    want = greedy(PROMPT, AHEAD + 10)
    with stack(blocks=128) as s:
        state = s.state(PROMPT)
        stream = iter(s.lifecycle.stream(state, SamplingParams(max_tokens=AHEAD + 10, ignore_eos=True)))
        first = next(stream)
        deadline = time.monotonic() + 30
        while len(state.token_ids) < len(PROMPT) + 1 + AHEAD and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(state.token_ids) == len(PROMPT) + 1 + AHEAD  # paused: the queue holds AHEAD unread tokens
        rest = [chunk.token_ids[0] for chunk in stream]
        assert first.token_ids + rest == want and s.lifecycle.counters.tokens_generated == AHEAD + 10
