"""Slow tiers that fail or outlive their process: write errors degrade to drop-and-recompute, a full
volume costs the tier its own oldest blocks (never a request, never the journal's reserve), tier
directories are owned by their configuration (locked, collected after a crash, removed at exit; a
persist directory held by a live process is refused, naming it), and reactive tier reads run
outside the engine lock."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import dense_greedy
from fakes import tiny_pool
from kvbaton import SamplingParams
from kvbaton.backend import Engine
from kvbaton.backend.cache.eviction import LRU
from kvbaton.backend.cache.radix import RadixCache
from kvbaton.backend.cache.tierdirs import LOCK_NAME, owner_pid
from kvbaton.backend.cache.tiers import claim_tiers, make_tier
from kvbaton.bench.soak_harness import small_volume
from kvbaton.errors import InvalidRequest

GREEDY_4 = SamplingParams(max_tokens=4, ignore_eos=True)


def offload_everything(engine: Engine) -> None:
    engine.cache.evict(engine.pool.num_blocks)


def run_through_evictions(engine: Engine, reference, corpus_tokens, start: int) -> list:
    """Requests that only fit by evicting the cache, every other one kept live; each checked against dense."""
    kept = []
    for i in range(5):
        prompt = corpus_tokens[start + i * 150 : start + i * 150 + 150]
        result = engine.complete(prompt, GREEDY_4)
        if i in (0, 3):
            assert result.token_ids == dense_greedy(reference, prompt, 4)[0]
        (kept.append if i % 2 else engine.release)(result.handle)
    return kept


def assert_pool_drains(engine: Engine, kept: list) -> None:
    engine.release(kept)
    engine.flush_cache()
    assert engine.stats().blocks_used == 0


# -- 1. a failing tier never fails a request and never strands a block -----------------------------
def test_a_full_disk_drops_blocks_instead_of_failing_requests(reference, corpus_tokens, tmp_path, monkeypatch):
    engine = Engine(kv_budget="32 blocks", tiers=[f"disk:256 blocks:{tmp_path / 'tier'}"], prefetch=False)
    tier = engine.cache.tiers[0]

    def full(key, k, v):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier, "put", full)
    kept = run_through_evictions(engine, reference, corpus_tokens, 0)

    stats = engine.stats()
    assert stats.cache.tier_errors > 0 and stats.cache.nodes_per_tier["disk"] == 0
    assert list(tier.dir.glob("*.safetensors")) == []
    assert_pool_drains(engine, kept)

    monkeypatch.delattr(tier, "put")  # space returns: offloading works again
    engine.release(engine.complete(corpus_tokens[:150], GREEDY_4).handle)
    offload_everything(engine)
    assert engine.stats().cache.nodes_per_tier["disk"] == 9
    again = engine.complete(corpus_tokens[:150], GREEDY_4)
    assert again.timings.tokens_reused == 144 and again.token_ids == dense_greedy(reference, corpus_tokens[:150], 4)[0]
    engine.release(again.handle)
    engine.close()


def test_a_tier_directory_removed_while_running(reference, corpus_tokens, tmp_path):
    engine = Engine(kv_budget="32 blocks", tiers=[f"disk:256 blocks:{tmp_path / 'tier'}"], prefetch=False)
    prompt = corpus_tokens[2000:2150]
    engine.release(engine.complete(prompt, GREEDY_4).handle)
    offload_everything(engine)
    shutil.rmtree(engine.cache.tiers[0].dir)  # its offloaded blocks and every later write fail

    again = engine.complete(prompt, GREEDY_4)
    assert again.token_ids == dense_greedy(reference, prompt, 4)[0]
    assert again.timings.tokens_prefilled == len(prompt)
    engine.release(again.handle)
    kept = run_through_evictions(engine, reference, corpus_tokens, 0)

    assert engine.stats().cache.tier_errors > 1
    assert_pool_drains(engine, kept)
    engine.close()


# -- 2. a full volume: the tier's blocks go first ---------------------------------------------------
def _disk_tier(tmp_path, blocks: int = 64):
    pool = tiny_pool(32, 4)
    (spec,) = claim_tiers([f"disk:{blocks} blocks:{tmp_path / 'tier'}"], tmp_path / "root")
    return pool, make_tier(spec, pool.shape.bytes_per_block, pool.device)


def _cached_sequences(pool, cache, n: int) -> None:
    """``n`` one-block sequences in the cache, held by the cache only (finished requests)."""
    for i in range(n):
        tokens = [i] * 4
        blocks = pool.allocate(1)
        pool.k[:, :, blocks[0] * 4 : blocks[0] * 4 + 4] = float(i)
        cache.insert(tokens, blocks, 1)
        pool.decref(blocks)


@pytest.mark.unit
def test_a_disk_tiers_capacity_follows_its_volumes_free_space(tmp_path, monkeypatch):
    _, tier = _disk_tier(tmp_path)
    volume = tier.volume
    monkeypatch.setattr(volume, "free", lambda: volume.reserve() + 3 * tier.file_bytes)
    assert not tier.full
    monkeypatch.setattr(volume, "free", lambda: volume.reserve() + tier.file_bytes - 1)
    assert tier.full, "one more block would eat into the reserve"
    volume.keep(lambda: 10 * tier.file_bytes)  # a persistent engine's journal keeps its own reserve too
    monkeypatch.setattr(volume, "free", lambda: 5 * tier.file_bytes)
    assert tier.full
    tier.close()


@pytest.mark.unit
def test_enospc_in_the_tier_gives_back_its_oldest_blocks_and_the_write_succeeds(tmp_path, monkeypatch):
    pool, tier = _disk_tier(tmp_path)
    real_put = tier.put

    def three_block_volume(key, k, v):  # the volume is shared: its free-space check was overtaken
        if len(tier) >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_put(key, k, v)

    monkeypatch.setattr(tier, "put", three_block_volume)
    cache = RadixCache(pool, LRU(), [tier])
    _cached_sequences(pool, cache, 6)
    cache.evict(6)
    assert cache.tier_errors == 0, "no block was dropped for the write's failure"
    assert cache.nodes_in_tier(0) == 3 and len(list(tier.dir.glob("*.safetensors"))) == 3
    newest = cache.match([5] * 4, 4)
    assert newest and cache.read(newest[0])[0][0, 0, 0, 0] == 5.0, "the newest blocks were kept, the oldest went"
    cache.close()


def test_a_full_volume_costs_the_tier_its_blocks_never_a_request(reference, corpus_tokens, tmp_path):
    with small_volume(8) as (volume_dir, why):
        if why is not None:
            pytest.skip(f"needs a small tmpfs: {why}")
        engine = Engine(kv_budget="32 blocks", tiers=[f"disk:256 blocks:{volume_dir / 'tier'}"], prefetch=False)
        tier = engine.cache.tiers[0]
        kept = run_through_evictions(engine, reference, corpus_tokens, 0)
        assert engine.stats().cache.tier_errors == 0
        assert 0 < len(tier) < 256, "the tier holds what the volume has room for, not its configured 256 blocks"
        assert tier.volume.free() >= tier.volume.reserve(), "the reserve stays free"

        tier.volume.room_for = lambda nbytes: True  # another writer overtakes the check: real ENOSPC
        more = run_through_evictions(engine, reference, corpus_tokens, 750)
        assert tier.volume.free() < 2 * tier.file_bytes, "the tier wrote until the volume itself was full"
        assert engine.stats().cache.tier_errors == 0, "ENOSPC gave back the tier's oldest blocks, then the write"
        assert not list(tier.dir.glob("*.tmp")), "no partial file is left"
        assert_pool_drains(engine, kept + more)
        engine.close()


# -- 3. tier directories belong to their configuration -----------------------------------------------
@pytest.mark.unit
def test_tier_directories_are_named_by_config_and_locked_per_live_owner(tmp_path):
    first, second = claim_tiers(["disk:8 blocks"], tmp_path)[0], claim_tiers(["disk:8 blocks"], tmp_path)[0]
    other = claim_tiers(["disk:16 blocks"], tmp_path)[0]
    assert first.dir.path.parent == tmp_path and first.dir.path.name.startswith("disk-")
    assert second.dir.path.name == first.dir.path.name + "-1"  # the same config, live: never shared
    assert other.dir.path.name != first.dir.path.name
    assert owner_pid(first.dir.path) == os.getpid()
    path = first.dir.path
    first.release()
    assert not path.exists()
    assert claim_tiers(["disk:8 blocks"], tmp_path)[0].dir.path == path  # free again: reused
    for tier in (second, other):
        tier.release()


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_a_crashed_owners_directory_is_collected_at_the_next_start(tmp_path):
    crash = _python(
        "import os, signal, sys; from pathlib import Path; from kvbaton.backend.cache.tiers import claim_tiers\n"
        f"t = claim_tiers(['disk:8 blocks'], Path({str(tmp_path)!r}))[0]\n"
        "(t.dir.path / '7.safetensors').write_bytes(b'x' * 1000)\n"
        "print(t.dir.path, flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    assert crash.returncode == -9
    left = Path(crash.stdout.strip())
    assert (left / "7.safetensors").exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    legacy = tmp_path / f"{dead.stdout.strip()}-0123456789ab"  # what earlier versions left per process
    legacy.mkdir()
    (legacy / "3.safetensors").write_bytes(b"x")

    tier = claim_tiers(["disk:64 blocks"], tmp_path)[0]  # any start collects what dead owners left

    assert not left.exists() and not legacy.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", tier.dir.path.name]
    tier.release()


def test_tier_directories_go_at_interpreter_exit_without_close(tmp_path):
    done = _python(
        "from pathlib import Path; from kvbaton.backend.cache.tiers import claim_tiers\n"
        f"t = claim_tiers(['disk:8 blocks', 'disk:8 blocks:{tmp_path / 'mine'}'], Path({str(tmp_path)!r}))\n"
        "[(s.dir.path / '1.safetensors').write_bytes(b'x') for s in t]"
    )
    assert done.returncode == 0, done.stderr
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]


def test_two_live_engines_of_one_config_get_their_own_directories(corpus_tokens, tmp_path):
    spec = f"disk:64 blocks:{tmp_path / 'tier'}"
    a, b = Engine(kv_budget="64 blocks", tiers=[spec]), Engine(kv_budget="64 blocks", tiers=[spec])
    dirs = [e.cache.tiers[0].dir for e in (a, b)]
    assert dirs == [tmp_path / "tier", tmp_path / "tier-1"]
    assert owner_pid(dirs[1]) == os.getpid() and (dirs[1] / LOCK_NAME).exists()
    for engine in (a, b):
        engine.release(engine.materialize(corpus_tokens[:64]))
        offload_everything(engine)
    assert [len(list(d.glob("*.safetensors"))) for d in dirs] == [4, 4]
    a.close()
    b.close()
    assert not dirs[0].exists() and not dirs[1].exists()


@pytest.mark.unit
def test_a_persist_directory_held_by_a_live_process_is_refused_naming_it(tmp_path, capsys):
    from kvbaton import cli

    code = ("import time; from pathlib import Path; from kvbaton.backend.cache.tiers import claim_tiers\n"
            f"claim_tiers(['disk:8 blocks:{tmp_path / 'tier'}'], Path({str(tmp_path / 'root')!r}), persist=True)\n"
            "print('claimed', flush=True); time.sleep(300)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        spec = f"disk:8 blocks:{tmp_path / 'tier'}"
        with pytest.raises(InvalidRequest, match=f"locked by process {holder.pid}"):
            claim_tiers([spec], tmp_path / "root", persist=True)
        assert cli.main(["serve", "--persist", "--tier", spec]) == 2  # refused before the model loads
        err = capsys.readouterr().err
        assert f"process {holder.pid}" in err and str(tmp_path / "tier") in err and "kill -TERM" in err
        (plain,) = claim_tiers([spec], tmp_path / "root")  # without persistence: a directory of its own, as before
        assert plain.dir.path == tmp_path / "tier-1"
        plain.release()
    finally:
        holder.kill()
        holder.wait(30)
    (mine,) = claim_tiers([spec], tmp_path / "root", persist=True)  # its owner gone: free again
    assert mine.dir.path == tmp_path / "tier"
    mine.release()


def test_an_unusable_tier_directory_fails_before_the_model_loads(tmp_path, monkeypatch):
    import kvbaton.backend.engine as engine_module

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the tier directory was checked")

    monkeypatch.setattr(engine_module, "load_model", no_model)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(InvalidRequest, match=f"tier directory {blocker}"):
        Engine(tiers=[f"disk:8GiB:{blocker / 'tier'}"])
    with pytest.raises(InvalidRequest, match="unknown tier kind"):
        Engine(tiers=["tape:8GiB"])
    with pytest.raises(InvalidRequest, match="invalid KV budget"):
        Engine(tiers=["disk:lots"])
    if os.geteuid() != 0:  # root writes through permission bits
        read_only = tmp_path / "ro"
        read_only.mkdir(mode=0o555)
        with pytest.raises(InvalidRequest, match=f"tier directory {read_only}"):
            Engine(tiers=[f"disk:8GiB:{read_only}"])
    good = tmp_path / "fine"
    with pytest.raises(AssertionError):  # a usable spec gets as far as the model...
        Engine(tiers=[f"disk:8GiB:{good}"])
    assert not good.exists()  # ...and gives its directory back when the start fails


# -- 4. a reactive tier read does not hold the engine lock --------------------------------------------
def test_a_slow_reactive_tier_read_lets_other_requests_run(reference, corpus_tokens, tmp_path, monkeypatch):
    engine = Engine(kv_budget="64 blocks", tiers=[f"disk:256 blocks:{tmp_path / 'tier'}"], prefetch=False)
    prompt_a = corpus_tokens[:160] + corpus_tokens[600:605]
    engine.release(engine.complete(prompt_a, GREEDY_4).handle)
    offload_everything(engine)
    tier = engine.cache.tiers[0]
    reading, b_done = threading.Event(), threading.Event()
    b_finished_during_read: list[bool] = []
    real_get = tier.get

    def slow_get(key):
        reading.set()
        if not b_finished_during_read:  # A's load stays in progress until B has finished (or a lock times it out)
            b_finished_during_read.append(b_done.wait(timeout=120))
        return real_get(key)

    monkeypatch.setattr(tier, "get", slow_get)
    results = {}
    a = threading.Thread(target=lambda: results.update(a=engine.complete(prompt_a, GREEDY_4)))
    a.start()
    assert reading.wait(timeout=120)
    prompt_b = corpus_tokens[1200:1240]
    results["b"] = engine.complete(prompt_b, GREEDY_4)  # would wait for the lock if A read under it
    b_done.set()
    a.join(timeout=300)

    assert b_finished_during_read == [True]
    assert results["a"].timings.tokens_reused == 160
    assert results["a"].token_ids == dense_greedy(reference, prompt_a, 4)[0]
    assert results["b"].token_ids == dense_greedy(reference, prompt_b, 4)[0]
    assert engine.stats().cache.bytes_loaded_on_demand > 0
    engine.close()
