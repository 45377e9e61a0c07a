"""The fused CPU prefill (backend/compute/cpu/prefill.py): installed on the engine's model only, the same logits as the
model's own modules and as plain transformers (first chunk and later chunks), off when asked or when a
patched layer would disagree with this transformers version's modules."""

from __future__ import annotations

import contextlib

import pytest
import torch
from kvbaton.backend import Engine
from kvbaton.backend.compute.cpu import prefill
from kvbaton.backend.compute.loader import _load, resolve_model


@torch.inference_mode()
def _reference_logits(reference, tokens: list[int]) -> torch.Tensor:
    return reference(torch.tensor([tokens]), logits_to_keep=1).logits[0, -1].float()


def test_the_engines_model_is_patched_and_the_reference_is_not(engine, reference):
    model = engine.loaded.model
    assert len(model._kvbaton_prefill) == model.config.num_hidden_layers
    layer = model.model.layers[0]
    assert layer.self_attn.forward == model._kvbaton_prefill[0].attention_forward
    assert "forward" not in vars(reference.model.layers[0].self_attn)  # the class's own forward


def test_projections_are_the_products_prefill_runs(engine, reference):
    # The engine's fp32 model: fused q/k/v and gate/up, o and down (4 per layer); a plain model: its 7 modules.
    layers = len(reference.model.layers)
    fused = prefill.projections(engine.loaded.model)
    assert len(fused) == 4 * layers and all(isinstance(p, prefill._Linear) for p, _, _ in fused)
    x = torch.randn(20, fused[0][1])
    assert torch.allclose(fused[0][0](x)[:, : reference.config.hidden_size],
                          reference.model.layers[0].self_attn.q_proj(x), atol=1e-4)
    assert len(prefill.projections(reference)) == 7 * layers


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


def test_tokens_recomputed_at_scattered_positions_use_the_kernel_and_match_sdpa(engine, corpus_tokens, monkeypatch):
    """Selective recomputation (a blended segment): tokens at ascending positions among cached ones, each
    seeing the keys up to its own position, through kvbaton's kernel instead of SDPA with a dense mask."""
    from kvbaton.backend.compute.runner import Chunk

    calls = []
    original = prefill.attention

    def seen(query, pool, layer, read_slots, scaling, positions=None, *window_and_softcap):
        calls.append(positions)
        return original(query, pool, layer, read_slots, scaling, positions, *window_and_softcap)

    monkeypatch.setattr(prefill, "attention", seen)
    tokens = corpus_tokens[:700]
    blocks = engine.pool.allocate(700 // engine.pool.block_size + 1)
    try:
        engine.runner.forward([Chunk(blocks, 0, tokens)])
        positions = list(range(40, 700, 23))
        picked = Chunk(blocks, positions[0], [tokens[p] for p in positions], all_logits=True, positions=positions)
        calls.clear()
        fused = engine.runner.forward([picked])[0]
        assert calls and all(p is not None and p.tolist() == positions for p in calls)
        with prefill.disabled():
            plain = engine.runner.forward([picked])[0]
    finally:
        engine.pool.decref(blocks)
    assert torch.max(torch.abs(fused - plain)).item() < 1e-4
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


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
