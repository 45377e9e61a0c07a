"""Every misuse gets a typed error before any compute, and nothing leaks."""

from __future__ import annotations

import pytest
from kvbaton import (
    ContextTooLong,
    HandleNotFound,
    HandleReleased,
    IncompatibleHandle,
    InvalidRequest,
    ModelNotFound,
    PoolExhausted,
    SamplingParams,
    connect,
)
from kvbaton.backend import Engine


def test_unknown_handle(engine):
    with pytest.raises(HandleNotFound):
        engine.resume("0" * 32, "hi")
    with pytest.raises(HandleNotFound):
        engine.fork("not-an-id", 2)


def test_released_handle(engine):
    handle = engine.materialize("Some context.")
    engine.release(handle)
    for op in (lambda: engine.resume(handle, "x"), lambda: engine.fork(handle), lambda: engine.extend(handle, "y"),
               lambda: engine.release(handle), lambda: engine.generate([{"role": "user", "content": "q"}], handle=handle)):
        with pytest.raises(HandleReleased):
            op()


def test_handle_from_another_model(engine):
    handle = engine.materialize("Some context.")
    foreign = handle.model_copy(update={"model": "other", "model_fingerprint": "f" * 32})
    with pytest.raises(IncompatibleHandle, match="other"):
        engine.resume(foreign, "x")


def test_handle_from_another_tokenizer(engine):
    handle = engine.materialize("Some context.")
    with pytest.raises(IncompatibleHandle, match="tokenizer"):
        engine.fork(handle.model_copy(update={"tokenizer_fingerprint": "0" * 32}))


def test_handle_with_another_rope_layout(engine):
    handle = engine.materialize("Some context.")
    shifted = handle.positions.model_copy(update={"rope_theta": 10000.0})
    with pytest.raises(IncompatibleHandle, match="positional"):
        engine.resume(handle.model_copy(update={"positions": shifted}), "x")


def test_handle_from_a_bf16_engine_is_incompatible(engine):
    bf16 = Engine(dtype="bfloat16", kv_budget="8MiB")
    with pytest.raises(IncompatibleHandle):
        engine.resume(bf16.materialize("Some context."), "x")


def test_context_too_long_fails_before_compute(engine):
    limit = engine.loaded.max_context
    with pytest.raises(ContextTooLong):
        engine.materialize([1] * (limit + 1))
    handle = engine.materialize([1] * 10)
    with pytest.raises(ContextTooLong):
        engine.resume(handle, [1] * 10, SamplingParams(max_tokens=limit))
    assert engine.stats().tokens_prefilled == 10


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -3},
        {"max_tokens": 0},
        {"seed": -1},
        {"stop": [""]},
        {"unknown_option": 1},
    ],
)
def test_invalid_sampling_values(bad):
    client = connect(kv_budget="8MiB")
    handle = client.materialize("Some context.")
    with pytest.raises(InvalidRequest):
        client.resume(handle, "x", **bad)
    assert client.stats().handles_live == 1


@pytest.mark.parametrize("context", ["", [], [-1], [10**9], ["a"], b"bytes", 3.5, [True, 1.5]])
def test_invalid_context(engine, context):
    with pytest.raises(InvalidRequest):
        engine.materialize(context)
    assert engine.stats().blocks_used == 0


@pytest.mark.parametrize("k", [0, -1, 2000, 1.5, True])
def test_invalid_fork_count(engine, k):
    handle = engine.materialize("x y z")
    with pytest.raises(InvalidRequest):
        engine.fork(handle, k)


@pytest.mark.parametrize("messages", [[], "hello", [{"role": "wizard", "content": "x"}], [{"content": "x"}], [1]])
def test_invalid_messages(engine, messages):
    with pytest.raises(InvalidRequest):
        engine.generate(messages)


def test_pool_exhausted_is_typed_and_leaves_pool_intact():
    small = Engine(kv_budget="4 blocks")
    busy = small.complete_stream([9] * 30, SamplingParams(max_tokens=4, ignore_eos=True))
    next(busy)  # in flight: its 3 blocks cannot be evicted or spilled (an idle handle's could)
    keep = small.materialize([5] * 10)  # the last block
    with pytest.raises(PoolExhausted):
        small.materialize([6] * 40)
    with pytest.raises(PoolExhausted):  # shares keep's block: spilling keep would free nothing
        small.resume(keep, [7] * 10, SamplingParams(max_tokens=4))
    assert small.stats().blocks_used == 4 and small.stats().cache.handles_spilled == 0
    busy.close()
    small.release(keep)
    small.flush_cache()
    assert small.stats().blocks_used == 0


def test_a_request_that_can_never_fit_is_invalid_not_retry_later():
    small = Engine(kv_budget="8 blocks")  # 128 tokens in all
    keep = small.materialize([5] * 40)
    prefilled = small.stats().tokens_prefilled
    never = "^this request can never fit: its {} tokens .* need {} KV blocks of 16 tokens, the whole pool has 8;"
    with pytest.raises(InvalidRequest, match=never.format(239, 15)):  # 40 + 200 - 1 tokens
        small.complete([6] * 40, SamplingParams(max_tokens=200))
    never = never.format(r"\d+", r"\d+")
    with pytest.raises(InvalidRequest, match=never):
        small.resume(keep, [7] * 10, SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequest, match=never):
        small.materialize([8] * 200)
    with pytest.raises(InvalidRequest, match=never):
        small.generate([{"role": "user", "content": "hi"}], handle=keep, sampling=SamplingParams(max_tokens=120))
    stats = small.stats()
    assert stats.tokens_prefilled == prefilled and stats.blocks_used == 3  # checked before any compute or block
    assert small.resume(keep, [7] * 10, SamplingParams(max_tokens=4)).finish_reason == "length"  # one that fits
    small.release(keep)


@pytest.mark.unit
def test_missing_model_says_what_to_install(tmp_path):
    with pytest.raises(ModelNotFound, match="never downloads"):
        Engine(model="HuggingFaceTB/SmolLM2-1.7B")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFound, match="safetensors"):
        Engine(model=str(tmp_path))


def test_invalid_engine_options():
    with pytest.raises(InvalidRequest):
        Engine(kv_budget="lots")
    with pytest.raises(InvalidRequest):
        Engine(dtype="float8")
    with pytest.raises(InvalidRequest, match="max_batch_tokens"):
        Engine(max_batch_tokens=0)


def test_text_that_cannot_be_encoded_is_invalid_request(engine):
    with pytest.raises(InvalidRequest):
        engine.materialize("broken \ud800 surrogate")
