"""Persistence in process: ``Engine(persist=True)`` with a disk tier (the server's tests restart real
``kvbaton serve --persist`` processes: tests/test_server_persist.py).

Specification:
- a journaled handle (``persist_handles``) comes back in the next engine of the same configuration,
  same id, greedy output identical to dense prefill, its K/V loaded from the blocks saved at close;
- a handle released before the close does not come back; journaling needs persistence on and a
  live handle.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import dense_greedy
from kvbaton import SamplingParams
from kvbaton.backend import Engine
from kvbaton.errors import HandleNotFound, HandleReleased, InvalidRequest

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def persistent(tier: Path) -> Engine:
    return Engine(kv_budget="64 blocks", tiers=[f"disk:32 blocks:{tier}"], persist=True)


def test_journaled_handles_come_back_in_the_next_engine(reference, corpus_tokens, tmp_path: Path):
    prompt = corpus_tokens[:70]
    first = persistent(tmp_path)
    try:
        kept = first.materialize(prompt)
        gone = first.materialize(prompt[:40])
        first.persist_handles([kept, gone])
        first.release(gone)
        with pytest.raises(HandleReleased):
            first.persist_handles([gone])
    finally:
        first.close()
    plain = Engine(kv_budget="4 blocks")
    try:
        with pytest.raises(InvalidRequest, match="persistence is off"):
            plain.persist_handles([kept])
    finally:
        plain.close()

    second = persistent(tmp_path)
    try:
        result = second.resume(kept.id, sampling=GREEDY)
        assert result.token_ids == dense_greedy(reference, prompt, 4)[0]
        assert result.timings.tokens_reused >= 64, "the blocks saved at close were loaded"
        with pytest.raises(HandleNotFound):
            second.describe(gone.id)
    finally:
        second.close()
