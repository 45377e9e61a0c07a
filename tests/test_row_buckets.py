"""Row buckets: oneDNN's products see a bounded set of row counts, and bucketing changes no result.

oneDNN keeps a primitive and JIT kernels for every input shape it meets (pre-packed fp32 weights in
the fused prefill, every bf16 linear), so a server seeing prompts of every length would grow without
bound. The engine pads rows to buckets; these tests pin the bound and that padding is invisible.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from kvbaton.backend import Engine
from kvbaton.backend.compute.cpu import prefill, row_buckets


@pytest.mark.unit
@given(st.integers(min_value=1, max_value=4096))
def test_a_bucket_holds_the_rows_and_wastes_less_than_one_step(rows):
    b = row_buckets.bucket(rows)
    assert b >= rows
    assert b - rows < max(row_buckets.STEP, rows)  # at most one step above, or under 2x for tiny products
    if 32 < rows <= row_buckets.FINE_LIMIT:  # a later turn's short chunk pads less
        assert b - rows < row_buckets.FINE_STEP
    assert row_buckets.bucket(b) == b


@pytest.mark.unit
def test_every_chunk_size_up_to_the_batch_budget_maps_to_a_few_dozen_shapes():
    shapes = {row_buckets.bucket(n) for n in range(1, 2049)}
    fine = (row_buckets.FINE_LIMIT - 32) // row_buckets.FINE_STEP
    assert len(shapes) <= 6 + fine + (2048 - row_buckets.FINE_LIMIT) // row_buckets.STEP <= 80
    assert row_buckets.bucket(1) == 1  # a decode step stays one row


@pytest.mark.unit
@pytest.mark.parametrize("rows", [16, 17, 33, 250, 1078])
def test_padding_rows_changes_no_bit_of_the_real_rows(rows):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=g)
    x = torch.randn(rows, 96, generator=g)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 512)
    plain = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    padded = torch.ops.mkldnn._linear_pointwise(row_buckets.pad_rows(x), packed, None, "none", [], "")
    assert padded.shape[0] == row_buckets.bucket(rows)
    assert torch.equal(padded[:rows], plain)
    xb, wb = x.bfloat16(), weight.bfloat16()
    assert torch.equal(F.linear(row_buckets.pad_rows(xb), wb)[:rows], F.linear(xb, wb))


def _rows_seen(monkeypatch) -> set[int]:
    seen: set[int] = set()
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):
        seen.add(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    return seen


def test_fused_prefill_hands_onednn_only_bucketed_row_counts(engine, monkeypatch):
    seen = _rows_seen(monkeypatch)
    for n in (40, 41, 77, 130):
        engine.release(engine.materialize(list(range(1000, 1000 + n))))
    assert seen, "the fused prefill's packed products did not run"
    assert all(row_buckets.bucket(r) == r for r in seen)


def test_a_bf16_engine_buckets_every_linear_without_changing_its_output():
    bf16 = Engine(dtype="bfloat16", kv_budget="16MiB")
    try:
        linears = [m for m in bf16.loaded.model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(isinstance(m.forward, row_buckets._BucketedLinear) for m in linears)
        g = torch.Generator().manual_seed(0)
        for module in (linears[0], linears[-1]):  # a projection of layer 0, and the LM head
            x = torch.randn(1, 45, module.in_features, generator=g).bfloat16()  # 45 rows: run as 48
            with torch.inference_mode():
                assert torch.equal(module.forward(x), module.forward.original(x))
        bf16.release(bf16.materialize("The harbour cranes lifted containers while the gulls"))
    finally:
        bf16.close()


def test_the_fp32_plain_weights_are_left_to_mkl(reference):
    # fp32 products on plain weights run on MKL, which keeps no per-shape state: nothing to bucket.
    assert row_buckets.install(reference, torch.device("cpu"), torch.float32) == 0
    assert prefill.PACKED_MIN_ROWS <= row_buckets.STEP
