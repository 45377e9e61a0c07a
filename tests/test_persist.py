"""Persistence in process: ``Engine(persist=True)`` with a disk tier (the server's tests restart real
``kvbaton serve --persist`` processes: tests/test_server_persist.py).

Specification:
- a journaled handle (``persist_handles``) comes back in the next engine of the same configuration,
  same id, greedy output identical to dense prefill, its K/V loaded from the blocks saved at close;
- a handle released before the close does not come back; journaling needs persistence on and a
  live handle;
- a clean exit on a volume that another writer filled still saves what fits, the most recently used
  handles first (the disk tier's blocks given back for them), says what it could not, and every
  handle comes back greedy-identical, its unsaved tokens recomputed;
- the journal's fsync runs off the server's event loop: while it is slow, a request that needs no
  journal is answered, and the request that made a handle is answered only once its line is durable.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import anyio
import anyio.to_thread
import httpx
import pytest
from conftest import dense_greedy
from kvbaton import SamplingParams
from kvbaton.backend import Engine
from kvbaton.backend.cache.blockstore import block_keys
from kvbaton.backend.server import create_app
from kvbaton.bench.soak_harness import fill_volume, small_volume
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


def test_a_clean_exit_on_a_full_volume_saves_the_most_recently_used_handles_first(reference, corpus_tokens,
                                                                                  caplog) -> None:
    with small_volume(12) as (volume, why):
        if why is not None:
            pytest.skip(f"needs a small tmpfs: {why}")
        spec = [f"disk:256 blocks:{volume / 'tier'}"]
        first = Engine(kv_budget="40 blocks", tiers=spec, persist=True, prefetch=False)
        old, new = corpus_tokens[:160], corpus_tokens[1000:1160]  # 10 blocks each: both do not fit the volume
        handles = [first.materialize(old), first.materialize(new)]
        first.persist_handles(handles)
        for i in range(8):  # other traffic: its blocks go to the disk tier, as far as the volume allows
            first.release(first.complete(corpus_tokens[2000 + 110 * i: 2110 + 110 * i], GREEDY).handle)
        first.release(first.resume(handles[1].id, sampling=GREEDY).handle)  # the newest is also the last used
        assert len(first.cache.tiers[0]) >= 10, "the tier filled what the volume allows (more than one handle's worth)"
        fill_volume(volume)  # another process takes everything left, the journal's reserve included
        with caplog.at_level(logging.WARNING, logger="kvbaton.backend.cache.persist"):
            first.close()
        saved = {p.stem for p in (volume / "tier" / "state" / "blocks").glob("*.safetensors")}
        new_keys, old_keys = block_keys(new, 16, 10), block_keys(old, 16, 10)
        n_new = next((i for i, key in enumerate(new_keys) if key not in saved), 10)
        assert n_new >= 5, "the tier's blocks were given back for the saves"
        assert not saved & set(new_keys[n_new:]), "a handle's blocks are saved from its start"
        assert n_new == 10 or not saved & set(old_keys), "the older handle only once the newer is whole"
        assert not set(old_keys) <= saved and "could not be saved whole" in caplog.text, "what did not fit is told"
        (volume / "kvbaton-filler").unlink()

        second = Engine(kv_budget="64 blocks", tiers=spec, persist=True, prefetch=False)
        for handle, prompt in zip(handles, (old, new)):
            result = second.resume(handle.id, sampling=GREEDY)
            assert result.token_ids == dense_greedy(reference, prompt, 4)[0]
            if prompt is new:
                assert result.timings.tokens_reused >= 16 * n_new, "its saved blocks were used"
            second.release(result.handle)
        second.close()


def test_the_journals_fsync_runs_off_the_event_loop(tmp_path: Path, monkeypatch) -> None:
    engine = Engine(kv_budget="64 blocks", tiers=[f"disk:32 blocks:{tmp_path / 'tier'}"], persist=True)
    app = create_app(engine)
    syncing, go = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:  # the fault hook: the journal's disk is slow until the test says so
        if threading.current_thread().name == "kvbaton-journal":
            syncing.set()
            assert go.wait(300)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    answers: dict[str, httpx.Response] = {}

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvbaton", timeout=300) as http:
            async def materialize() -> None:
                answers["made"] = await http.post("/v1/kv/materialize", json={"context": "A ledger of ships."})

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(materialize)
                assert await anyio.to_thread.run_sync(syncing.wait, 300)  # its journal line is being fsync'd
                other = await http.post("/v1/completions", json={"prompt": "Hello",
                                                                  "max_tokens": 2})
                assert other.status_code == 200, other.text  # served meanwhile: the loop is not waiting on the disk
                assert (await http.get("/health")).status_code == 200
                assert "made" not in answers, "a handle is acknowledged only once its line is durable"
                go.set()
        assert answers["made"].status_code == 200, answers["made"].text

    anyio.run(scenario)
    monkeypatch.undo()
    made = answers["made"].json()["id"]
    assert made in {e.handle.id for e in engine.persistence.journal.live()}
    engine.close()
