"""GPU defaults in ``EngineConfig`` (issue 50): on CUDA an engine computes in bf16, its KV pool takes 90% of the GPU
memory free once the weights are loaded (a share of the engine's own device) and a lone prompt is prefilled in
chunks of 16K tokens; on CPU nothing changes (fp32, 1GiB, 2048); a knob given explicitly is kept. The share is
measured when the pool is built (here with the CUDA memory calls stubbed: CI has no GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kvbaton.backend.cache.block_pool import blocks_for_budget, memory_share
from kvbaton.backend.config import EngineConfig
from kvbaton.errors import InvalidRequest

pytestmark = pytest.mark.unit


def test_on_cuda_the_defaults_are_bf16_a_share_of_free_memory_and_a_16k_step():
    cpu, cuda = EngineConfig(), EngineConfig(device="cuda:1")
    assert (cpu.dtype, cpu.kv_budget, cpu.max_batch_tokens) == ("float32", "1GiB", 2048)
    assert (cuda.dtype, cuda.kv_budget, cuda.max_batch_tokens) == ("bfloat16", "90% of cuda:1", 16384)
    asked = EngineConfig(device="cuda", dtype="float32", kv_budget="4GiB", max_batch_tokens=2048)
    assert (asked.dtype, asked.kv_budget, asked.max_batch_tokens) == ("float32", "4GiB", 2048)
    assert EngineConfig.from_json(cuda.to_json()) == cuda


def test_a_share_is_of_the_configs_own_device_and_needs_a_gpu():
    config = EngineConfig(device="cuda", kv_budget="50%")
    assert config.kv_budget == "50% of cuda"
    assert dataclasses.replace(config, device="cuda:3").kv_budget == "50% of cuda:3"  # a cluster worker's own GPU
    with pytest.raises(InvalidRequest, match="needs a CUDA device") as caught:
        EngineConfig(kv_budget="90%")
    assert caught.value.param == "kv_budget"
    with pytest.raises(InvalidRequest, match=r"\(0%, 100%\]"):
        EngineConfig(device="cuda", kv_budget="120%")
    assert memory_share("2GiB") is None and memory_share("800 blocks") is None
    assert memory_share("75% of cuda:2") == (75.0, "cuda:2") and memory_share("10%") == (10.0, "cuda")


def test_the_share_counts_free_memory_and_what_torchs_allocator_holds_unused(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: asked.append(device) or (10 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1 * 2**30)
    assert blocks_for_budget("50% of cuda:1", 2**20) == 6 * 2**10  # half of (10 free + 2 cached) GiB, in MiB blocks
    assert asked == [torch.device("cuda:1")]
