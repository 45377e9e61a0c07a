"""The model-runner seam (backend/compute/runner.py): the runtime's only way to the model. The fake runner the
model-free tests use behaves like a causal model; the CUDA runner imports everywhere and refuses to be built
with the reason where it cannot run (no CUDA device, a model family it does not know, no Triton, turned off);
attention backends are chosen per device in one place."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fakes import FakeRunner, chain, fake_loaded, tiny_pool
from kvbaton.backend.compute.runner import Chunk, ModelRunner, RunnerUnavailable

pytestmark = pytest.mark.unit

TOKENS = list(range(40, 60))


def test_the_fake_runner_is_a_model_runner_whose_chunking_and_batching_change_nothing():
    pool = tiny_pool(16)
    runner = FakeRunner(pool)
    assert isinstance(runner, ModelRunner)
    whole, pieces, other = pool.allocate(5), pool.allocate(5), pool.allocate(1)
    (dense,) = runner.forward([Chunk(whole, 0, TOKENS)])
    runner.forward([Chunk(pieces, 0, TOKENS[:7])])
    runner.forward([Chunk(pieces, 7, TOKENS[7:19]), Chunk(other, 0, [1, 2])])  # packed with another sequence
    (chunked,) = runner.forward([Chunk(pieces, 19, TOKENS[19:])])
    assert torch.equal(chunked, dense) and torch.equal(dense, runner.dense_logits(TOKENS))
    assert runner.rows(pieces, 20) == runner.rows(whole, 20) == chain(TOKENS)
    every = runner.forward([Chunk(whole, 18, TOKENS[18:], all_logits=True)])[0]
    assert every.shape == (2, runner.vocab) and torch.equal(every[-1], dense)


def test_a_sparse_chunk_rewrites_its_positions_behind_what_is_cached():
    pool = tiny_pool(16)
    runner = FakeRunner(pool)
    blocks = pool.allocate(5)
    runner.forward([Chunk(blocks, 0, TOKENS)])
    slot = runner.slot(blocks, 5)
    pool.k[:, :, slot] = pool.v[:, :, slot] = 0.0  # position 5, as if re-aligned from another context
    assert runner.deviation(blocks, 4, TOKENS[4:7]).tolist() == [0.0, 1.0, 0.0]
    runner.forward([Chunk(blocks, 5, [TOKENS[5], TOKENS[9]], positions=[5, 9])])
    assert runner.rows(blocks, 20) == chain(TOKENS)


def test_a_row_the_runner_never_wrote_fails_the_forward():
    pool = tiny_pool(4)
    pool.k.fill_(1.0)
    pool.v.fill_(2.0)
    with pytest.raises(AssertionError, match="did not write"):
        FakeRunner(pool).forward([Chunk([0, 1], 4, [7])])


def test_the_cuda_runner_imports_everywhere_and_refuses_without_cuda_with_the_reason():
    from kvbaton.backend.compute.cuda import runner as cuda

    assert not torch.cuda.is_initialized()  # importing it touched no device
    loaded = fake_loaded()
    assert "not on a CUDA device" in cuda.unavailable_reason(loaded)
    with pytest.raises(RunnerUnavailable, match="CUDA graph runner is unavailable: the model is on cpu"):
        cuda.CudaGraphRunner(loaded, tiny_pool(1))
    if not torch.cuda.is_available():
        on_cuda = dataclasses.replace(loaded, device=torch.device("cuda"))
        assert cuda.unavailable_reason(on_cuda) == "no CUDA device here (torch.cuda.is_available() is False)"


def test_the_cuda_runner_can_be_turned_off_and_refuses_a_model_it_does_not_know(monkeypatch):
    from kvbaton.backend.compute.cuda import runner as cuda

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # only the reason is asked for: no device use
    on_cuda = dataclasses.replace(fake_loaded(), device=torch.device("cuda"))
    assert cuda.unavailable_reason(on_cuda) == "NoneType has no transformers config: not a supported model"
    monkeypatch.setenv(cuda.RUNNER_ENV, "0")
    assert cuda.unavailable_reason(on_cuda) == "turned off by KVBATON_CUDA_RUNNER=0"


def test_attention_backends_are_chosen_per_device():
    from kvbaton.backend.compute import selector
    from kvbaton.backend.compute.attention import SDPA

    cpu = selector.attention_backend(torch.device("cpu"))
    assert cpu.fused is not None and cpu.split_prefix  # kvbaton's kernel over the pool, split prefixes
    assert selector.attention_backend(torch.device("cuda")) is SDPA
    assert selector.attention_backend(torch.device("meta")) is SDPA
