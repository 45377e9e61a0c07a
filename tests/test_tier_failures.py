"""Slow tiers that fail or outlive their process: write errors degrade to drop-and-recompute, tier
directories are owned by their configuration (locked, collected after a crash, removed at exit),
and reactive tier reads run outside the engine lock."""

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
from kvbaton import SamplingParams
from kvbaton.backend import Engine
from kvbaton.backend.tierdirs import LOCK_NAME, owner_pid
from kvbaton.backend.tiers import claim_tiers
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


# -- 2. tier directories belong to their configuration -----------------------------------------------
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
        "import os, signal, sys; from pathlib import Path; from kvbaton.backend.tiers import claim_tiers\n"
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
        "from pathlib import Path; from kvbaton.backend.tiers import claim_tiers\n"
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


# -- 3. a reactive tier read does not hold the engine lock --------------------------------------------
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
