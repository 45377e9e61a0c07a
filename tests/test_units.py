"""Small pieces in isolation: block pool, budgets, handles, lineage, detokenizer."""

from __future__ import annotations

import pytest
import torch
from kvbaton import Handle, InvalidRequest, PoolExhausted
from kvbaton.backend.cache.block_pool import BlockPool, PoolShape, blocks_for_budget

SHAPE = PoolShape(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)


@pytest.mark.unit
def test_pool_refcounts_and_lowest_first_allocation():
    pool = BlockPool(SHAPE, 6)
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    pool.incref(a[:2])
    assert [pool.refcount(b) for b in a] == [2, 2, 1]
    pool.decref(a)
    assert pool.num_used == 2 and [pool.refcount(b) for b in a] == [1, 1, 0]
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
    from kvbaton.backend.runtime.detokenizer import Detokenizer

    detok = Detokenizer(engine.tokenizer, stop=["STOP"])
    out = ""
    for token in engine.tokenize("abc ST"):
        out += detok.add(token)
    assert out == "abc "
    for token in engine.tokenize("OP more"):
        out += detok.add(token)
    assert detok.stopped and out + detok.flush() == "abc "


MIXED_TEXT = "Plain words, then ünïcödé, 漢字と仮名, emoji 🧪🚀👩‍🔬 and a tab\tnewline\n end."


def test_streamed_pieces_add_up_to_the_whole_decode_and_never_split_a_character(engine):
    from kvbaton.backend.runtime.detokenizer import Detokenizer

    tokenizer = engine.tokenizer
    ids = engine.tokenize(MIXED_TEXT) + [tokenizer.eos_token_id] + engine.tokenize(" after the special token")
    detok = Detokenizer(tokenizer)
    pieces = [detok.add(token) for token in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == detok.text
    assert not any(piece.endswith("\ufffd") for piece in pieces)
    # A generation that ends inside a multi-byte character gives what a whole decode gives.
    cut = engine.tokenize("🧪")[:-1]
    detok = Detokenizer(tokenizer)
    assert "".join(detok.add(t) for t in cut) + detok.flush() == tokenizer.decode(cut, skip_special_tokens=True)


def test_each_token_is_decoded_alone_not_the_whole_answer_again(engine, monkeypatch):
    """A fast tokenizer streams: the answer so far is never decoded again, so a token costs the same
    at the 4,000th token as at the first."""
    from kvbaton.backend.runtime.detokenizer import Detokenizer

    tokenizer = engine.tokenizer
    detok = Detokenizer(tokenizer, stop=["never appears in this text"])
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **k: pytest.fail("decoded the whole answer"))
    out = "".join(detok.add(t) for t in engine.tokenize(MIXED_TEXT * 20))
    monkeypatch.undo()
    assert out + detok.flush() == MIXED_TEXT * 20


def test_stop_strings_across_tokens_long_stops_and_min_tokens(engine):
    from kvbaton.backend.runtime.detokenizer import Detokenizer

    long_stop = "END OF THE ANSWER " * 20
    detok = Detokenizer(engine.tokenizer, stop=[long_stop, "\n\n"])
    out = "".join(detok.add(t) for t in engine.tokenize("Some answer. " + long_stop[:100]))
    assert out == "Some answer. "  # the tail that may still become the long stop is held back
    out += "".join(detok.add(t) for t in engine.tokenize(long_stop[100:] + "ignored"))
    assert detok.stopped and out + detok.flush() == "Some answer. "
    # A stop inside the first min_tokens tokens does not count; one after them does.
    tokens = engine.tokenize("a\n\nb c d e f\n\ng")
    detok = Detokenizer(engine.tokenizer, stop=["\n\n"], min_tokens=4)
    out = "".join(detok.add(t) for t in tokens if not detok.stopped)
    assert detok.stopped and out + detok.flush() == "a\n\nb c d e f"


@pytest.mark.unit
def test_auto_dtype_picks_native_bf16_only():
    from pathlib import Path

    from kvbaton.backend.compute.loader import resolve_dtype

    flags = set(Path("/proc/cpuinfo").read_text().split())
    expected = "bfloat16" if flags & {"amx_bf16", "avx512_bf16"} else "float32"
    assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("float32", "cpu") == "float32"


@pytest.mark.unit
def test_a_lineage_of_twenty_thousand_steps_rebuilds_its_tokens_and_round_trips():
    """Lineage is replayed step by step, never recursively: an agent's thousands of turns are no deeper a walk."""
    from kvbaton.handle import LineageStep, Op, Placement, Positions

    steps = [LineageStep(op=Op.MATERIALIZE, token_ids=(0,))]
    steps += [LineageStep(op=Op.EXTEND, parent=f"{i:032x}", token_ids=(i, -1)) for i in range(1, 20_000)]
    steps += [LineageStep(op=Op.GENERATE, parent=f"{20_000:032x}", keep=39_998, token_ids=(7,))]  # drops a -1
    handle = Handle(
        id="a" * 32, model="m", model_fingerprint="f", tokenizer_fingerprint="t", num_tokens=39_999,
        positions=Positions(rope_type="default", rope_theta=1e4), lineage=tuple(steps),
        placement=Placement(device="cpu"),
    )
    tokens = handle.token_ids()
    assert len(tokens) == 39_999 and tokens[:3] == [0, 1, -1] and tokens[-2:] == [19_999, 7]
    assert Handle.model_validate_json(handle.model_dump_json()) == handle
