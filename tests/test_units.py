"""Small pieces in isolation: block pool, budgets, handles, lineage, detokenizer."""

from __future__ import annotations

import pytest
import torch
from kvbaton import Handle, InvalidRequest, PoolExhausted
from kvbaton.backend.block_pool import BlockPool, PoolShape, blocks_for_budget

SHAPE = PoolShape(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)


@pytest.mark.unit
def test_pool_refcounts_and_lowest_first_allocation():
    pool = BlockPool(SHAPE, 6)
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    pool.incref(a[:2])
    assert pool.num_shared == 2
    pool.decref(a)
    assert pool.num_used == 2 and pool.num_shared == 0
    pool.decref(a[:2])
    assert pool.num_used == 0
    assert pool.allocate(2) == [0, 1]


@pytest.mark.unit
def test_pool_refuses_to_overallocate_atomically():
    pool = BlockPool(SHAPE, 2)
    pool.allocate(1)
    with pytest.raises(PoolExhausted):
        pool.allocate(2)
    assert pool.num_free == 1


@pytest.mark.unit
def test_slots_are_views_for_consecutive_blocks_and_indices_otherwise():
    pool = BlockPool(SHAPE, 8)
    assert pool.slots([2, 3, 4], 1, 10) == slice(9, 18)
    idx = pool.slots([5, 1, 6], 2, 9)
    assert idx.tolist() == [22, 23, 4, 5, 6, 7, 24]


@pytest.mark.unit
def test_copy_block_copies_every_layer():
    pool = BlockPool(SHAPE, 2)
    pool.k[:, :, 0:4] = torch.arange(32, dtype=torch.float32).reshape(2, 1, 4, 4)
    pool.copy_block(0, 1, 3)
    assert torch.equal(pool.k[:, :, 4:7], pool.k[:, :, 0:3])


@pytest.mark.unit
@pytest.mark.parametrize(
    ("budget", "blocks"), [(1000, 10), ("1KiB", 10), ("2 kb", 20), ("3 blocks", 3), ("1.5MB", 15000)]
)
def test_budget_parsing(budget, blocks):
    assert blocks_for_budget(budget, 100) == blocks


@pytest.mark.unit
@pytest.mark.parametrize("budget", ["lots", "-1MiB", "5 parsecs", "blocks", True])
def test_bad_budgets(budget):
    with pytest.raises(InvalidRequest):
        blocks_for_budget(budget, 100)


def test_handle_ids_are_validated_and_lineage_rebuilds_tokens(engine):
    root = engine.materialize([5, 6, 7, 8])
    (child,) = engine.fork(root, 1)
    ext = engine.extend(child, [9, 10])
    assert [s.op.value for s in ext.lineage] == ["materialize", "fork", "extend"]
    assert ext.lineage[-1].parent == child.id
    assert ext.token_ids() == [5, 6, 7, 8, 9, 10]
    assert len(root.id) == 32 and int(root.id, 16) >= 0
    assert Handle.model_validate_json(ext.model_dump_json()) == ext
    with pytest.raises(ValueError):
        Handle.model_validate({**ext.model_dump(), "id": "xyz"})
    assert ext.placement.device == "cpu" and ext.positions.rope_theta == 100000.0


def test_detokenizer_holds_back_partial_stop_strings(engine):
    from kvbaton.backend.detokenizer import Detokenizer

    detok = Detokenizer(engine.tokenizer, stop=["STOP"])
    out = ""
    for token in engine.tokenize("abc ST"):
        out += detok.add(token)
    assert out == "abc "
    for token in engine.tokenize("OP more"):
        out += detok.add(token)
    assert detok.stopped and out + detok.flush() == "abc "


@pytest.mark.unit
def test_auto_dtype_picks_native_bf16_only():
    from pathlib import Path

    from kvbaton.backend.loader import resolve_dtype

    flags = set(Path("/proc/cpuinfo").read_text().split())
    expected = "bfloat16" if flags & {"amx_bf16", "avx512_bf16"} else "float32"
    assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("float32", "cpu") == "float32"
