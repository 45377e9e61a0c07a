"""kvbaton's C++ decode kernels against plain torch: each op alone, on fp32 and bf16 storage, with
paged (non-consecutive) block tables, and bit-identical rows whether computed alone or batched."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import filelock
import pytest
import torch
import torch.nn.functional as F
from kvbaton.backend.compute.cpu import kernels

HEADS, KV_HEADS, D, BLOCK = 9, 3, 64, 16
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def lib():
    module = kernels.load()
    assert module is not None, kernels.unavailable_reason()  # this machine has a compiler: they must build
    return module


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 17])
@pytest.mark.parametrize("outputs", [96, 100])  # 100: padded to whole blocks of 16, sliced back by the caller
def test_linear_matches_torch_with_and_without_bias(lib, dtype, rows, outputs):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(outputs, 576, generator=g).to(dtype)
    bias = torch.cat([torch.randn(outputs, generator=g), torch.zeros(-outputs % 16)])
    x = torch.randn(rows, 576, generator=g)
    if dtype == torch.bfloat16 and lib.bf16_dot:  # AVX512-BF16 dot products take bf16 inputs, as the model's bf16 forward
        x_used = x.to(dtype).float()
    else:
        x_used = x
    expected = x_used @ weight.float().T
    packed = lib.pack(weight)
    torch.testing.assert_close(lib.linear(x, packed, None)[:, :outputs], expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lib.linear(x, packed, bias)[:, :outputs], expected + bias[:outputs], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_are_bit_identical_alone_or_batched(lib, dtype):
    g = torch.Generator().manual_seed(0)
    packed = lib.pack(torch.randn(80, 1536, generator=g).to(dtype))  # 5 blocks: a full group of 4 and an edge
    x = torch.randn(21, 1536, generator=g)  # tiles of 8, 4 and single rows
    batched = lib.linear(x, packed, None)
    for i in range(len(x)):
        assert torch.equal(batched[i], lib.linear(x[i : i + 1].contiguous(), packed, None)[0])


def test_rms_norms_match_the_hugging_face_formula(lib):
    g = torch.Generator().manual_seed(1)
    x, delta = torch.randn(3, 576, generator=g), torch.randn(3, 576, generator=g)
    weight = torch.randn(576, generator=g)

    def reference(h: torch.Tensor) -> torch.Tensor:
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))

    torch.testing.assert_close(lib.rms_norm(x, weight, 1e-5), reference(x))
    residual = x.clone()
    normed = lib.add_rms_norm(residual, delta, weight, 1e-5)
    assert torch.equal(residual, x + delta)  # the residual stream is updated in place
    torch.testing.assert_close(normed, reference(x + delta))


def test_silu_mul_matches_torch(lib):
    x = torch.randn(2, 2 * 1536, generator=torch.Generator().manual_seed(2)) * 8
    torch.testing.assert_close(lib.silu_mul(x), F.silu(x[:, :1536]) * x[:, 1536:], rtol=1e-5, atol=1e-5)


def _paged(dtype: torch.dtype, lengths: list[int], blocks: int = 160):
    """A random pool and block tables that scatter each sequence over non-consecutive blocks."""
    g = torch.Generator().manual_seed(3)
    k_pool = torch.randn(2, KV_HEADS, blocks * BLOCK, D, generator=g).to(dtype)
    v_pool = torch.randn(2, KV_HEADS, blocks * BLOCK, D, generator=g).to(dtype)
    order = torch.randperm(blocks, generator=g).tolist()
    width = max(-(-n // BLOCK) for n in lengths)
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    for s, n in enumerate(lengths):
        count = -(-n // BLOCK)
        tables[s, :count] = torch.tensor(order[:count])
        order = order[count:]
    return k_pool, v_pool, tables


def _slots(tables: torch.Tensor, s: int, n: int) -> torch.Tensor:
    return torch.cat([torch.arange(BLOCK) + int(b) * BLOCK for b in tables[s, : -(-n // BLOCK)]])[:n]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_rotates_q_and_k_and_writes_only_the_new_slots(lib, dtype):
    lengths = [5, 40, 17]
    k_pool, v_pool, tables = _paged(dtype, lengths)
    before_k, before_v = k_pool.clone(), v_pool.clone()
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(3, (HEADS + 2 * KV_HEADS) * D, generator=g)
    angles = torch.rand(3, D // 2, generator=g) * 100
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    slots = torch.stack([_slots(tables, s, n)[-1] for s, n in enumerate(lengths)])
    q = lib.rope_write(qkv, cos, sin, k_pool, v_pool, 1, slots, HEADS, KV_HEADS)
    torch.testing.assert_close(q, _rotate(qkv[:, : HEADS * D].view(3, HEADS, D), cos[:, None], sin[:, None]))
    k = _rotate(qkv[:, HEADS * D : (HEADS + KV_HEADS) * D].view(3, KV_HEADS, D), cos[:, None], sin[:, None])
    v = qkv[:, (HEADS + KV_HEADS) * D :].view(3, KV_HEADS, D)
    torch.testing.assert_close(k_pool[1][:, slots].transpose(0, 1), k.to(dtype))
    torch.testing.assert_close(v_pool[1][:, slots].transpose(0, 1), v.to(dtype))
    k_pool[1][:, slots], v_pool[1][:, slots] = before_k[1][:, slots], before_v[1][:, slots]
    assert torch.equal(k_pool, before_k) and torch.equal(v_pool, before_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_matches_sdpa_over_the_gathered_context(lib, dtype):
    lengths = [1, 16, 17, 300, 1100]  # one token, a full block, a block and one, several 256-token chunks
    k_pool, v_pool, tables = _paged(dtype, lengths)
    q = torch.randn(len(lengths), HEADS, D, generator=torch.Generator().manual_seed(5))
    out = lib.attention(q, k_pool, v_pool, 1, tables, torch.tensor(lengths), BLOCK, 0.125)
    for s, n in enumerate(lengths):
        slots = _slots(tables, s, n)
        keys, values = k_pool[1][:, slots].float(), v_pool[1][:, slots].float()
        query = q[s].view(KV_HEADS, HEADS // KV_HEADS, D)
        expected = F.scaled_dot_product_attention(query[None], keys[None], values[None], scale=0.125)
        torch.testing.assert_close(out[s], expected.reshape(-1), rtol=1e-5, atol=1e-5)


def test_attention_rows_are_bit_identical_alone_or_batched(lib):
    lengths = [700, 3, 260]
    k_pool, v_pool, tables = _paged(torch.float32, lengths)
    q = torch.randn(len(lengths), HEADS, D, generator=torch.Generator().manual_seed(6))
    batched = lib.attention(q, k_pool, v_pool, 0, tables, torch.tensor(lengths), BLOCK, 0.125)
    for s, n in enumerate(lengths):
        alone = lib.attention(q[s : s + 1].contiguous(), k_pool, v_pool, 0, tables[s : s + 1].contiguous(),
                              torch.tensor([n]), BLOCK, 0.125)
        assert torch.equal(batched[s], alone[0])


def test_out_of_range_blocks_and_slots_are_refused_not_read(lib):
    k_pool, v_pool, tables = _paged(torch.float32, [20])
    q = torch.zeros(1, HEADS, D)
    tables[0, 1] = 10_000
    with pytest.raises(RuntimeError, match="block out of range"):
        lib.attention(q, k_pool, v_pool, 0, tables, torch.tensor([20]), BLOCK, 0.125)
    with pytest.raises(RuntimeError, match="length outside the block table"):
        lib.attention(q, k_pool, v_pool, 0, tables, torch.tensor([33]), BLOCK, 0.125)
    qkv = torch.zeros(1, (HEADS + 2 * KV_HEADS) * D)
    with pytest.raises(RuntimeError, match="slot out of range"):
        lib.rope_write(qkv, torch.ones(1, D), torch.zeros(1, D), k_pool, v_pool, 0, torch.tensor([-1]), HEADS, KV_HEADS)
    short_v = v_pool[:, :, :16].contiguous()  # a V pool smaller than the K pool would be written out of bounds
    with pytest.raises(RuntimeError, match="K and V pools differ"):
        lib.rope_write(qkv, torch.ones(1, D), torch.zeros(1, D), k_pool, short_v, 0, torch.tensor([0]), HEADS, KV_HEADS)
    with pytest.raises(RuntimeError, match="K and V pools differ"):
        lib.attention(q, k_pool, short_v, 0, tables, torch.tensor([20]), BLOCK, 0.125)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("cached", "new"), [(0, 1), (0, 37), (0, 300), (17, 33), (100, 300), (700, 2)])
def test_prefill_attention_matches_causal_sdpa_over_paged_blocks(lib, dtype, head_dim, cached, new):
    """A chunk of ``new`` tokens behind ``cached`` ones: query i sees keys 0..cached+i, through the slots."""
    g = torch.Generator().manual_seed(cached + new + head_dim)
    blocks = 80
    k_pool = torch.randn(2, KV_HEADS, blocks * BLOCK, head_dim, generator=g).to(dtype)
    v_pool = torch.randn(2, KV_HEADS, blocks * BLOCK, head_dim, generator=g).to(dtype)
    total = cached + new
    order = torch.randperm(blocks, generator=g)  # non-consecutive blocks
    slots = (order[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:total].contiguous()
    q = torch.randn(total, HEADS, head_dim, generator=g)[cached:].transpose(0, 1)  # [heads, new, d], strided
    keys, values = k_pool[1][:, slots].float(), v_pool[1][:, slots].float()
    mask = torch.arange(total)[None, :] <= torch.arange(cached, total)[:, None]
    scale = head_dim**-0.5
    expected = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, scale=scale,
                                              enable_gqa=True)[0].transpose(0, 1)
    got = lib.prefill_attention(q.transpose(0, 1), k_pool, v_pool, 1, slots, 0, total, scale)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)
    # Consecutive slots, given as a first slot instead of an index tensor.
    first = 5 * BLOCK
    consecutive = torch.arange(first, first + total)
    expected = F.scaled_dot_product_attention(q[None], k_pool[1][:, consecutive].float()[None],
                                              v_pool[1][:, consecutive].float()[None], attn_mask=mask, scale=scale,
                                              enable_gqa=True)[0].transpose(0, 1)
    got = lib.prefill_attention(q.transpose(0, 1), k_pool, v_pool, 1, torch.empty(0, dtype=torch.long), first, total,
                                scale)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("total", "picked"), [(40, 2), (300, 45), (700, 130)])
def test_prefill_attention_of_scattered_positions_matches_masked_sdpa(lib, dtype, total, picked):
    """Tokens recomputed at scattered positions among cached ones: query i sees keys 0..positions[i]."""
    g = torch.Generator().manual_seed(total + picked)
    blocks = 60
    k_pool = torch.randn(2, KV_HEADS, blocks * BLOCK, D, generator=g).to(dtype)
    v_pool = torch.randn(2, KV_HEADS, blocks * BLOCK, D, generator=g).to(dtype)
    order = torch.randperm(blocks, generator=g)
    slots = (order[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:total].contiguous()
    positions = torch.cat((torch.randperm(total - 1, generator=g)[: picked - 1].sort().values,
                           torch.tensor([total - 1])))  # ascending, the last at kv_len - 1
    q = torch.randn(picked, HEADS, D, generator=g)
    mask = torch.arange(total)[None, :] <= positions[:, None]
    scale = D**-0.5
    expected = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_pool[1][:, slots].float()[None],
                                              v_pool[1][:, slots].float()[None], attn_mask=mask, scale=scale,
                                              enable_gqa=True)[0].transpose(0, 1)
    got = lib.prefill_attention(q, k_pool, v_pool, 1, slots, 0, total, scale, positions)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


def test_prefill_attention_refuses_positions_that_do_not_ascend_to_the_last_key(lib):
    k_pool, v_pool, _ = _paged(torch.float32, [20], blocks=4)
    q = torch.zeros(3, HEADS, D)
    none = torch.empty(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="positions must ascend"):
        lib.prefill_attention(q, k_pool, v_pool, 0, none, 0, 10, 0.125, torch.tensor([4, 2, 9]))
    with pytest.raises(RuntimeError, match="positions must end at kv_len - 1"):
        lib.prefill_attention(q, k_pool, v_pool, 0, none, 0, 10, 0.125, torch.tensor([1, 2, 3]))
    with pytest.raises(RuntimeError, match=r"positions must be \[n\] int64"):
        lib.prefill_attention(q, k_pool, v_pool, 0, none, 0, 10, 0.125, torch.tensor([9]))


def test_prefill_attention_refuses_out_of_range_slots(lib):
    k_pool, v_pool, _ = _paged(torch.float32, [20], blocks=4)
    q = torch.zeros(3, HEADS, D)
    with pytest.raises(RuntimeError, match="slot out of range"):
        lib.prefill_attention(q, k_pool, v_pool, 0, torch.tensor([0, 1, 4 * BLOCK]), 0, 3, 0.125)
    with pytest.raises(RuntimeError, match="slots out of range"):
        lib.prefill_attention(q, k_pool, v_pool, 0, torch.empty(0, dtype=torch.long), 4 * BLOCK - 2, 3, 0.125)
    with pytest.raises(RuntimeError, match="kv_len must cover the queries"):
        lib.prefill_attention(q, k_pool, v_pool, 0, torch.empty(0, dtype=torch.long), 0, 2, 0.125)


def test_rope_inplace_rotates_q_and_k_and_leaves_v(lib):
    g = torch.Generator().manual_seed(7)
    n = 150  # more rows than one thread's share
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * D, generator=g)
    angles = torch.rand(n, D // 2, generator=g) * 100
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    rotated = qkv.clone()
    lib.rope_inplace(rotated, cos, sin, HEADS, KV_HEADS)
    heads = qkv.view(n, HEADS + 2 * KV_HEADS, D)
    expected = torch.cat([_rotate(heads[:, : HEADS + KV_HEADS], cos[:, None], sin[:, None]),
                          heads[:, HEADS + KV_HEADS :]], dim=1)
    torch.testing.assert_close(rotated.view_as(expected), expected)
    assert torch.equal(rotated[:, (HEADS + KV_HEADS) * D :], qkv[:, (HEADS + KV_HEADS) * D :])


def test_rms_norm_rows_matches_the_hugging_face_formula(lib):
    g = torch.Generator().manual_seed(9)
    x, weight = torch.randn(300, 576, generator=g) * 5, torch.randn(576, generator=g)
    expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(lib.rms_norm_rows(x, weight, 1e-5), expected)


def test_silu_mul_rows_are_bit_identical_alone_or_in_a_prefill(lib):
    x = torch.randn(300, 2 * 1536, generator=torch.Generator().manual_seed(8)) * 4  # split across threads
    many = lib.silu_mul(x)
    torch.testing.assert_close(many, F.silu(x[:, :1536]) * x[:, 1536:], rtol=1e-5, atol=1e-5)
    for i in (0, 77, 299):
        assert torch.equal(many[i], lib.silu_mul(x[i : i + 1].contiguous())[0])


@pytest.mark.unit
def test_disabled_kernels_report_why_and_log_once(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_STATE", {})
    monkeypatch.setenv("KVBATON_KERNELS", "0")
    caplog.set_level(logging.WARNING, logger=kernels.__name__)
    assert kernels.load() is None and kernels.load() is None
    assert kernels.unavailable_reason() == "disabled by KVBATON_KERNELS"
    assert sum("disabled by KVBATON_KERNELS" in r.message for r in caplog.records) == 1


@pytest.mark.unit
def test_a_failed_build_is_reported_not_raised(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "_STATE", {})
    monkeypatch.delenv("KVBATON_KERNELS", raising=False)

    def no_compiler() -> None:
        raise RuntimeError("Error building extension\ng++: command not found")

    monkeypatch.setattr(kernels, "_build", no_compiler)
    caplog.set_level(logging.WARNING, logger=kernels.__name__)
    assert kernels.load() is None
    assert kernels.unavailable_reason() == "build failed: g++: command not found"
    assert any("fused decode uses oneDNN" in r.message for r in caplog.records)


@pytest.mark.unit
def test_the_build_is_keyed_by_source_torch_install_and_cpu(monkeypatch):
    key = kernels.build_key()
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: "another instruction set")
    assert kernels.build_key() != key
    other_cpu = kernels.build_key()
    monkeypatch.setattr(kernels, "_torch_install", lambda: "2.13.0 abi=True /another/venv/torch py=3.11.7")
    assert kernels.build_key() != other_cpu  # another venv's torch: a build of its own, no ping-pong
    other_torch = kernels.build_key()
    monkeypatch.setattr(kernels, "_compiler", lambda: "/usr/bin/clang++ clang version 14")
    assert kernels.build_key() != other_torch  # another compiler: likewise


# How long a child that imports torch and loads the kernels may take on a loaded machine (two fit in
# pytest-timeout's 600 s): a deadline that says what it waited for, never a measured bound.
CHILD_S = 280.0


def _load_in_a_process(cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """A fresh process loading the kernels from ``cache``; what it says (the outcome, not how long it took)."""
    code = ("import logging, sys; logging.basicConfig(level=logging.WARNING)\n"
            "from kvbaton.backend.compute.cpu import kernels\n"
            "print('loaded' if kernels.load() is not None else 'unavailable:', kernels.unavailable_reason())")
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_S,
                              env={**os.environ, "KVBATON_CACHE_DIR": str(cache), **env})
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"a process loading the kernels did not finish within {CHILD_S} s "
                             f"(it imports torch, then waits for the build lock at most its deadline): {exc}") from None


@pytest.fixture
def built_cache(lib, tmp_path):
    """A cache directory holding this machine's built kernels (copied: no 40-s build in the test)."""
    key = kernels.build_key()
    shutil.copytree(kernels.cache_dir() / "kernels" / key, tmp_path / "kernels" / key,
                    ignore=shutil.ignore_patterns("lock", "build.flock", "build.owner"))
    return tmp_path, tmp_path / "kernels" / key


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start(built_cache):
    cache, directory = built_cache
    (directory / "lock").touch()  # what cpp_extension leaves when its build is killed: it waits on it forever
    done = _load_in_a_process(cache)
    assert done.stdout.startswith("loaded"), done.stdout + done.stderr
    assert "left by a kernel build that was killed" in done.stderr
    assert not (directory / "lock").exists()


def test_a_start_waits_for_a_running_build_with_a_deadline_and_says_for_whom(built_cache):
    cache, directory = built_cache
    held = filelock.FileLock(directory / kernels.BUILD_LOCK)
    held.acquire()  # another process building right now (this one, to the child)
    try:
        (directory / "build.owner").write_text("pid 4242")
        done = _load_in_a_process(cache, KVBATON_KERNELS_BUILD_TIMEOUT="3")  # the child waits 3 s for the lock
    finally:
        held.release()
    assert done.stdout.startswith("unavailable:"), done.stdout + done.stderr
    assert "pid 4242 has held the kernel build lock" in done.stdout
    assert "fused decode uses oneDNN" in done.stderr
    assert _load_in_a_process(cache).stdout.startswith("loaded")  # once it is free, it loads


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("hidden_size", 577, "hidden_size must be even"),
    ("intermediate_size", 1544, "multiple of 16"),
])
def test_kernels_fit_the_default_model_and_say_which_shape_does_not(monkeypatch, field, value, reason):
    from kvbaton.backend import load_model
    from kvbaton.backend.compute.cpu.fast_decode import kernels_fit

    model = load_model().model
    assert kernels_fit(model) is None
    monkeypatch.setattr(model.config, field, value)
    assert reason in kernels_fit(model)


# -- sliding windows, soft-capping, head sizes (issue 47) ---------------------------------------------------------

def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
               softcap: float) -> torch.Tensor:
    """transformers' eager attention: ``q [heads, n, d]`` over ``keys/values [kv_heads, m, d]``, ``mask [n, m]``."""
    group = q.shape[0] // keys.shape[0]
    scores = q @ keys.repeat_interleave(group, 0).transpose(1, 2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return weights @ values.repeat_interleave(group, 0)


@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.float32, 64), (torch.float32, 96), (torch.bfloat16, 128),
                                                (torch.float32, 256), (torch.bfloat16, 256)])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (7, 0.0), (300, 0.0), (23, 5.0)])
def test_decode_attention_sees_only_its_window_and_soft_caps_its_scores(lib, dtype, head_dim, window, softcap):
    """Each query (the last token of its sequence) sees its ``window`` latest keys, itself included (the window
    starting mid-block, mid-chunk, or before the sequence), every head size the kernels are compiled for."""
    lengths = [1, 16, 17, 300, 700]
    g = torch.Generator().manual_seed(head_dim + window)
    blocks = 80
    k_pool = torch.randn(2, KV_HEADS, blocks * BLOCK, head_dim, generator=g).to(dtype)
    v_pool = torch.randn(2, KV_HEADS, blocks * BLOCK, head_dim, generator=g).to(dtype)
    order = torch.randperm(blocks, generator=g).tolist()
    width = max(-(-n // BLOCK) for n in lengths)
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    for s, n in enumerate(lengths):
        count = -(-n // BLOCK)
        tables[s, :count] = torch.tensor(order[:count])
        order = order[count:]
    q = torch.randn(len(lengths), HEADS, head_dim, generator=g)
    scale = head_dim**-0.5
    out = lib.attention(q, k_pool, v_pool, 1, tables, torch.tensor(lengths), BLOCK, scale, window, softcap)
    for s, n in enumerate(lengths):
        slots = torch.cat([torch.arange(BLOCK) + int(b) * BLOCK for b in tables[s, : -(-n // BLOCK)]])[:n]
        keys, values = k_pool[1][:, slots].float(), v_pool[1][:, slots].float()
        seen = torch.arange(n) > n - 1 - window if window else torch.ones(n, dtype=torch.bool)
        expected = _reference(q[s][:, None], keys, values, seen[None], scale, softcap)
        torch.testing.assert_close(out[s], expected.reshape(-1), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("head_dim", [96, 256])
@pytest.mark.parametrize(("cached", "new", "window", "softcap", "scattered"), [
    (0, 300, 50, 0.0, False), (100, 37, 64, 0.0, False), (700, 2, 16, 0.0, False), (0, 90, 0, 3.0, False),
    (17, 150, 70, 3.0, False), (0, 300, 0, 0.0, False), (0, 400, 30, 0.0, True), (0, 300, 100, 4.0, True),
])
def test_prefill_attention_sees_only_its_window_and_soft_caps_its_scores(lib, head_dim, cached, new, window, softcap,
                                                                          scattered):
    """A chunk behind cached tokens (or tokens at scattered positions): query at position p sees keys
    ``max(0, p - window + 1)..p``, whole key tiles before a query block's windows skipped, rows with no key in
    a tile left alone."""
    g = torch.Generator().manual_seed(cached + new + head_dim + window)
    blocks = 80
    k_pool = torch.randn(2, KV_HEADS, blocks * BLOCK, head_dim, generator=g)
    v_pool = torch.randn(2, KV_HEADS, blocks * BLOCK, head_dim, generator=g)
    total = cached + new
    order = torch.randperm(blocks, generator=g)
    slots = (order[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:total].contiguous()
    if scattered:
        positions = torch.cat((torch.randperm(total - 1, generator=g)[: new // 4 - 1].sort().values,
                               torch.tensor([total - 1])))
    else:
        positions = torch.arange(cached, total)
    q = torch.randn(positions.numel(), HEADS, head_dim, generator=g)
    keys = torch.arange(total)[None, :]
    mask = keys <= positions[:, None]
    if window:
        mask &= keys > positions[:, None] - window
    scale = head_dim**-0.5
    expected = _reference(q.transpose(0, 1), k_pool[1][:, slots], v_pool[1][:, slots], mask, scale, softcap)
    got = lib.prefill_attention(q, k_pool, v_pool, 1, slots, 0, total, scale,
                                positions if scattered else torch.empty(0, dtype=torch.long), window, softcap)
    torch.testing.assert_close(got, expected.transpose(0, 1), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("weight_dtype", DTYPES)
def test_head_norm_normalises_each_q_and_k_head_and_leaves_v(lib, weight_dtype):
    """Qwen3 / Gemma 3 q_norm and k_norm: RMSNorm over each head, before RoPE, in place."""
    g = torch.Generator().manual_seed(9)
    d = 128
    qkv = torch.randn(5, (HEADS + 2 * KV_HEADS) * d, generator=g) * 3
    q_w, k_w = (torch.randn(d, generator=g).to(weight_dtype) for _ in range(2))
    before = qkv.clone()
    lib.head_norm_inplace(qkv, q_w, k_w, 1e-6, HEADS, KV_HEADS)

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    q_end, k_end = HEADS * d, (HEADS + KV_HEADS) * d
    torch.testing.assert_close(qkv[:, :q_end].view(5, HEADS, d), rms(before[:, :q_end].view(5, HEADS, d), q_w))
    torch.testing.assert_close(qkv[:, q_end:k_end].view(5, KV_HEADS, d),
                               rms(before[:, q_end:k_end].view(5, KV_HEADS, d), k_w))
    assert torch.equal(qkv[:, k_end:], before[:, k_end:])


def test_kernel_head_sizes_are_the_registrys(lib):
    """The head sizes the C++ dispatch handles are the ones the registry routes to it; others are refused."""
    from kvbaton.backend.models.paths import KERNEL_HEAD_DIMS

    for d in (*KERNEL_HEAD_DIMS, 80):
        k_pool = torch.zeros(1, 1, BLOCK, d)
        call = lambda: lib.attention(torch.zeros(1, 1, d), k_pool, k_pool, 0,  # noqa: E731
                                     torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3]), BLOCK, 1.0)
        if d in KERNEL_HEAD_DIMS:
            call()
        else:
            with pytest.raises(RuntimeError, match="head_dim must be"):
                call()
