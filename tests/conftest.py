"""Shared fixtures: one real SmolLM2 per test session (per worker under `make test`'s pytest-xdist),
fresh engines (cheap) per test; the test tiers.

Tiers (``make test-unit``, ``test-model``, ``test-server``; ``make test`` runs all three):

- ``unit``: model-free, marked explicitly (``pytestmark = pytest.mark.unit`` or per test); the
  whole tier runs in seconds. A unit test that asks for a model or server fixture is an error.
- ``server``: starts ``kvbaton serve`` or worker processes (the server fixtures, a cluster, the
  ``test_server_*`` and ``test_multidevice`` modules, the contract suite's HTTP and cluster cases).
- ``model``: everything else: runs the real model in the test process.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's interpreter runs the CUDA runner's kernels on CPU tensors (tests/test_cuda_kernels.py). It must be
    # chosen before Triton is first imported, which importing kvbaton's backend may do (where Triton is installed).
    os.environ.setdefault("TRITON_INTERPRET", "1")
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


# -- tiers ----------------------------------------------------------------------------------------

MODEL_FIXTURES = {"engine", "reference", "corpus_tokens"}
SERVER_FIXTURES = {"server", "secure_server", "server_processes", "cluster"}
SERVER_MODULES = ("test_server_", "test_multidevice", "test_bench_soak")
SERVER_PARAMS = {"http", "async-http", "cluster"}


def _tier(item: pytest.Item) -> str:
    fixtures = set(getattr(item, "fixturenames", ()))
    params = set(map(str, getattr(getattr(item, "callspec", None), "params", {}).values()))
    if item.get_closest_marker("unit") is not None:
        if fixtures & (MODEL_FIXTURES | SERVER_FIXTURES):
            raise pytest.UsageError(f"{item.nodeid} is marked unit but uses {sorted(fixtures & (MODEL_FIXTURES | SERVER_FIXTURES))}")
        return "unit"
    if fixtures & SERVER_FIXTURES or params & SERVER_PARAMS or item.module.__name__.startswith(SERVER_MODULES):
        return "server"
    return "model"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = _tier(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(tier)


# -- kvbaton serve subprocesses for the server tests (tests/server_fixtures.py) ---------------------
from server_fixtures import secure_server, server, server_processes  # noqa: F401
