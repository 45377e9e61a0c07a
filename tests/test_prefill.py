"""The fused CPU prefill (backend/prefill.py): installed on the engine's model only, the same logits as the
model's own modules and as plain transformers (first chunk and later chunks), off when asked or when a
patched layer would disagree with this transformers version's modules."""

from __future__ import annotations

import contextlib

import pytest
import torch
from kvbaton.backend import Engine, prefill
from kvbaton.backend.loader import _load, resolve_model


@torch.inference_mode()
def _reference_logits(reference, tokens: list[int]) -> torch.Tensor:
    return reference(torch.tensor([tokens]), logits_to_keep=1).logits[0, -1].float()


def test_the_engines_model_is_patched_and_the_reference_is_not(engine, reference):
    model = engine.loaded.model
    assert len(model._kvbaton_prefill) == model.config.num_hidden_layers
    layer = model.model.layers[0]
    assert layer.self_attn.forward == model._kvbaton_prefill[0].attention_forward
    assert "forward" not in vars(reference.model.layers[0].self_attn)  # the class's own forward


@pytest.mark.parametrize("fused", [True, False])
def test_chunked_prefill_matches_transformers_with_and_without_fusion(reference, corpus_tokens, fused):
    # 512-token forwards: a first chunk (causal from position 0), then chunks behind cached tokens.
    engine = Engine(kv_budget="256MiB", max_batch_tokens=512, prefix_cache=False)
    prompt, suffix = corpus_tokens[:1100], corpus_tokens[1100:1140]
    try:
        with contextlib.nullcontext() if fused else prefill.disabled():
            handle = engine.materialize(prompt)
            logits = engine.next_token_logits(handle, suffix)
        dense = _reference_logits(reference, prompt + suffix)
        assert torch.max(torch.abs(logits - dense)).item() < 1e-4
        assert int(logits.argmax()) == int(dense.argmax())
    finally:
        engine.close()


def test_the_attention_kernel_runs_for_prefill_chunks(engine, corpus_tokens, monkeypatch):
    calls = []
    original = prefill.attention

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(prefill, "attention", counted)
    engine.release(engine.materialize(corpus_tokens[:300]))
    assert calls and all(calls)  # every layer, kvbaton's kernel (not SDPA)
    calls.clear()
    with prefill.disabled():
        engine.release(engine.materialize(corpus_tokens[300:600]))
    assert calls and not any(calls)


def _fresh_model():
    name, path = resolve_model(None)
    return _load(name, path, torch.float32, torch.device("cpu"), "kvbaton_paged").model


def test_switched_off_by_the_environment(monkeypatch):
    model = _fresh_model()
    monkeypatch.setenv("KVBATON_FUSED_PREFILL", "0")
    assert not prefill.install(model, torch.device("cpu"), torch.float32)
    assert "forward" not in vars(model.model.layers[0].self_attn)


def test_not_installed_when_a_patched_layer_disagrees(monkeypatch, caplog):
    model = _fresh_model()
    original = prefill._Layer.mlp_forward
    monkeypatch.setattr(prefill._Layer, "mlp_forward", lambda self, x: original(self, x) * 1.01)
    assert not prefill.install(model, torch.device("cpu"), torch.float32)
    assert "disagrees" in caplog.text
    assert "forward" not in vars(model.model.layers[0].mlp)
