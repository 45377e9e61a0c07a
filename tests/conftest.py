"""Shared fixtures: one real SmolLM2 per test session, fresh engines (cheap) per test."""

from __future__ import annotations

import pytest
import torch
from kvbaton.backend import Engine, load_model
from kvbaton.bench.corpus import document


@pytest.fixture(scope="session")
def reference():
    """Plain transformers SmolLM2 (SDPA attention, its own cache): the dense baseline."""
    return load_model(attn_implementation="sdpa").model


@pytest.fixture
def engine():
    # The model is loaded once per process; each engine only adds its own (lazily committed) pool.
    engine = Engine(kv_budget="384MiB")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def corpus_tokens() -> list[int]:
    eng = Engine(kv_budget="1 blocks")
    return eng.tokenize(document(3000, seed=7))


@torch.inference_mode()
def dense_greedy(model, tokens: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Dense prefill of ``tokens`` then ``n`` greedy steps with transformers' own KV cache."""
    out = model(torch.tensor([tokens]), use_cache=True)
    first_logits = out.logits[0, -1].float()
    cache, logits = out.cache, first_logits
    generated: list[int] = []
    for step in range(n):
        token = int(torch.argmax(logits))
        generated.append(token)
        if step + 1 < n:
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            cache, logits = out.cache, out.logits[0, -1].float()
    return generated, first_logits


# -- kvbaton serve subprocesses for the server tests (tests/server_fixtures.py) ---------------------
from server_fixtures import secure_server, server, server_processes  # noqa: F401
