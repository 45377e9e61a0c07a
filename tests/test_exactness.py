"""Exact reuse: resuming a handle is token-identical to dense prefill of the same tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import dense_greedy

GENERATED = 32


@pytest.mark.parametrize("prefix_len", [1, 15, 16, 17, 500, 2000])
def test_resume_equals_dense_prefill(engine, reference, corpus_tokens, prefix_len):
    prefix = corpus_tokens[:prefix_len]
    suffix = engine.tokenize("\n\nQuestion: which team is mentioned first, and what did they do? Answer:")
    handle = engine.materialize(prefix)

    logits = engine.next_token_logits(handle, suffix)
    result = engine.resume(handle, suffix, engine_sampling(max_tokens=GENERATED))
    expected, dense_logits = dense_greedy(reference, prefix + suffix, GENERATED)

    assert result.token_ids == expected and result.exact and result.token_identical
    assert torch.max(torch.abs(logits - dense_logits)).item() < 1e-4
    assert result.timings.tokens_reused == prefix_len
    assert result.timings.tokens_prefilled == len(suffix)
    assert result.handle.num_tokens == prefix_len + len(suffix) + GENERATED
    assert result.handle.token_ids() == prefix + suffix + expected


def test_resume_of_a_resumed_handle_continues_exactly(engine, reference, corpus_tokens):
    prefix, turn1, turn2 = corpus_tokens[:100], corpus_tokens[100:120], corpus_tokens[120:133]
    first = engine.resume(engine.materialize(prefix), turn1, engine_sampling(max_tokens=8))
    second = engine.resume(first.handle, turn2, engine_sampling(max_tokens=16))
    expected, _ = dense_greedy(reference, prefix + turn1 + first.token_ids + turn2, 16)
    assert second.token_ids == expected
    assert second.timings.tokens_reused == 100 + 20 + 8 - 1  # the last generated token was pending


def test_extend_then_resume_with_empty_suffix(engine, reference, corpus_tokens):
    handle = engine.extend(engine.materialize(corpus_tokens[:40]), corpus_tokens[40:90])
    assert handle.num_tokens == 90
    result = engine.resume(handle, [], engine_sampling(max_tokens=12))
    expected, _ = dense_greedy(reference, corpus_tokens[:90], 12)
    assert result.token_ids == expected
    assert result.timings.tokens_prefilled == 0  # logits of the last token were kept


def test_text_and_token_inputs_agree(engine):
    text = "Agents pass handles, not text."
    by_text = engine.materialize(text)
    by_ids = engine.materialize(engine.tokenize(text))
    assert by_text.token_ids() == by_ids.token_ids()
    assert engine.resume(by_text, " So", engine_sampling(max_tokens=6)).token_ids == engine.resume(
        by_ids, " So", engine_sampling(max_tokens=6)
    ).token_ids


def test_bfloat16_exact_means_this_engines_dense_prefill_and_promises_no_more(corpus_tokens):
    """Issue 40: in bfloat16 ``exact`` keeps its one meaning (the K/V are this engine's own dense prefill of
    the same tokens) but does not promise token-identical output: a prefix-cache hit splits the prompt's
    computation differently from a fresh prefill, which rounds differently. Every bf16 result says so."""
    from kvbaton.backend import Engine

    engine = Engine(kv_budget="128MiB", dtype="bfloat16")
    try:
        prompt = corpus_tokens[:400]
        head = engine.materialize(prompt[:160])  # the prefix cache now holds the first 160 tokens
        split = engine.resume(engine.materialize(prompt), [], engine_sampling(max_tokens=4))
        assert split.exact and not split.token_identical
        assert torch.equal(*(engine.kv_rows(h, 0, 160)[0] for h in (split.handle, head)))  # cached: the same bits
        engine.release(head)
        engine.flush_cache()
        fresh = engine.resume(engine.materialize(prompt), [], engine_sampling(max_tokens=4))  # one prefill
        assert fresh.exact and not fresh.token_identical
        # The same tokens, computed in other chunks: the K/V agree up to bf16 rounding, but not bit for bit.
        k1, v1 = engine.kv_rows(split.handle, 160, 240)
        k2, v2 = engine.kv_rows(fresh.handle, 160, 240)
        for a, b in ((k1, k2), (v1, v2)):
            relative = float((a.float() - b.float()).norm() / b.float().norm())
            assert 0 < relative < 0.05
    finally:
        engine.close()


def engine_sampling(**kw):
    from kvbaton import SamplingParams

    return SamplingParams(ignore_eos=True, **kw)
