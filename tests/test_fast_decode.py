"""The fused decode step: same greedy tokens as the model's own forward, alone or batched, on
kvbaton's C++ kernels and on each fallback (oneDNN, plain linear, the model's own forward), each
fallback logged once."""

from __future__ import annotations

import logging
import threading
import weakref

import pytest
import torch
from conftest import dense_greedy
from kvbaton import SamplingParams
from kvbaton.backend import Engine
from kvbaton.backend.compute.cpu import fast_decode as fd

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


def _greedy(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    result = engine.complete(prompt, params)
    engine.release(result.handle)
    return result.token_ids


def test_fast_decode_is_on_by_default_with_kvbaton_kernels(engine):
    assert engine.runner.fast is not None
    assert engine.runner.fast.weights.kernels == fd.KVBATON == "kvbaton C++"


def test_fast_decode_matches_the_models_own_forward_and_transformers(engine, reference, corpus_tokens):
    eager = Engine(kv_budget="64MiB", fast_decode=False)
    try:
        assert eager.runner.fast is None
        for start, length in ((0, 40), (500, 300)):
            prompt = corpus_tokens[start : start + length]
            fast = _greedy(engine, prompt)
            assert fast == _greedy(eager, prompt)
            assert fast == dense_greedy(reference, prompt, GREEDY.max_tokens)[0]
    finally:
        eager.close()


@pytest.mark.parametrize("new", [2, 5, fd.SMALL_CHUNK_ROWS])
def test_a_chunk_of_a_few_tokens_runs_as_fused_rows_with_the_modules_logits(engine, reference, corpus_tokens,
                                                                            monkeypatch, new):
    """A short tail behind cached tokens (a turn's new message, a few recomputed tokens) runs as rows of the
    fused step, each row seeing the positions up to its own: the logits of plain transformers."""
    rows = []
    original = engine.runner.fast.forward
    monkeypatch.setattr(engine.runner.fast, "forward", lambda b, p, t: rows.append(len(t)) or original(b, p, t))
    prompt, suffix = corpus_tokens[:300], corpus_tokens[300 : 300 + new]
    handle = engine.materialize(prompt)
    try:
        logits = engine.next_token_logits(handle, suffix)
    finally:
        engine.release(handle)
    assert new in rows
    dense = reference(torch.tensor([prompt + suffix]), logits_to_keep=1).logits[0, -1].float()
    assert torch.max(torch.abs(logits - dense)).item() < 1e-4
    assert int(logits.argmax()) == int(dense.argmax())


def test_decode_weights_are_built_once_per_model(engine):
    other = Engine(kv_budget="16MiB")
    try:
        assert other.runner.fast.weights is engine.runner.fast.weights
    finally:
        other.close()


def test_a_batch_of_different_prefixes_and_lengths_decodes_each_as_alone(engine, corpus_tokens):
    prompts = [corpus_tokens[i * 97 : i * 97 + n] for i, n in enumerate((23, 150, 301, 77, 512))]
    alone = [_greedy(engine, p) for p in prompts]
    # Fork one prompt too: two sequences then share blocks and write into private copies.
    handles = [engine.materialize(p) for p in prompts]
    handles += engine.fork(handles[1], 2)[1:]
    expected = alone + [alone[1]]
    results: list[list[int] | None] = [None] * len(handles)
    before = engine.scheduler.max_sequences

    def run(i: int) -> None:
        out = engine.resume(handles[i], [], GREEDY)
        results[i] = out.token_ids
        engine.release(out.handle)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(handles))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.release(handles)
    assert results == expected
    assert engine.scheduler.max_sequences > max(before, 1)  # they really shared forwards


def test_without_kvbaton_kernels_it_decodes_on_onednn_with_the_same_tokens(monkeypatch, corpus_tokens):
    monkeypatch.setattr(fd, "_WEIGHTS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(fd, "_kvbaton_kernels", lambda loaded: None)  # no compiler, or KVBATON_KERNELS=0
    engine, eager = Engine(kv_budget="32MiB"), Engine(kv_budget="32MiB", fast_decode=False)
    try:
        assert engine.runner.fast.weights.kernels == fd.ONEDNN
        for prompt in (corpus_tokens[:60], corpus_tokens[200:500]):
            assert _greedy(engine, prompt) == _greedy(eager, prompt)
    finally:
        engine.close()
        eager.close()


def test_without_packed_kernels_it_falls_back_to_plain_linear_logged_once(monkeypatch, caplog, corpus_tokens):
    monkeypatch.setattr(fd, "_WEIGHTS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(fd, "_kvbaton_kernels", lambda loaded: None)
    monkeypatch.setattr(fd, "packing_available", lambda device, dtype: "no oneDNN in this test")
    prompt = corpus_tokens[:60]
    caplog.set_level(logging.WARNING, logger=fd.__name__)
    engines = [Engine(kv_budget="32MiB") for _ in range(2)]
    eager = Engine(kv_budget="32MiB", fast_decode=False)
    try:
        assert engines[0].runner.fast.weights.kernels == "plain"
        assert _greedy(engines[1], prompt) == _greedy(eager, prompt)
    finally:
        for e in [*engines, eager]:
            e.close()
    assert [r.message for r in caplog.records].count(
        "fast decode without packed weights (no oneDNN in this test): plain linear kernels"
    ) == 1


def test_an_unsupported_model_decodes_through_its_own_forward_logged_once(monkeypatch, caplog, corpus_tokens):
    monkeypatch.setattr(fd, "unsupported_reason", lambda model: "a family kvbaton does not fuse")
    monkeypatch.setattr(fd, "_REFUSED", set())
    caplog.set_level(logging.WARNING, logger=fd.__name__)
    engines = [Engine(kv_budget="32MiB") for _ in range(2)]
    try:
        assert all(e.runner.fast is None for e in engines)
        assert len(_greedy(engines[0], corpus_tokens[:30], SamplingParams(max_tokens=3))) == 3
    finally:
        for e in engines:
            e.close()
    assert sum("a family kvbaton does not fuse" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("name", ["GPT2LMHeadModel"])
def test_unknown_families_are_refused_by_name(name):
    model = type(name, (), {"config": object()})()
    assert name in fd.unsupported_reason(model)
