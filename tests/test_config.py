"""``EngineConfig``: every engine knob declared once, validated before anything loads.

- each bad knob is an ``InvalidRequest`` naming it (in its message and as ``param``), raised when the
  config is built: ``Engine(bad=...)`` fails before a tier directory is claimed or the model loads,
  ``kvbaton serve --bad ...`` exits 2 before loading anything;
- ``kvbaton serve`` derives its engine options from the config's fields: its arguments and
  ``Engine``'s keywords build the same config, and every knob with a flag has its default there;
- a config goes to a worker process as JSON and comes back equal; docs/sdk.md lists every knob;
- an engine serves the hosted-engine contract a server reads (hosting.py) from its config.
"""

from __future__ import annotations

import dataclasses

import pytest
from kvbaton.backend.cache.eviction import LRU
from kvbaton.backend.config import DEFAULT_KV_BUDGET, EngineConfig, knob_flags
from kvbaton.cli import build_parser, engine_config, main
from kvbaton.errors import InvalidRequest

BAD_KNOBS = [
    ("model", ""),
    ("dtype", "float8"),
    ("device", "toaster:0"),
    ("kv_budget", "lots"),
    ("kv_budget", 0),
    ("block_size", 0),
    ("prefill_chunk", -1),
    ("max_batch_tokens", 0),
    ("event_capacity", 0),
    ("lookahead", -1),
    ("block_size", True),  # a bool is no count
    ("prefix_cache", "yes"),
    ("prefetch", None),
    ("fast_decode", 1),
    ("persist", "no"),
    ("audit_fraction", 1.5),
    ("reuse", "always"),
    ("chat_template", 3),
    ("eviction", "fifo"),
    ("tier_eviction", "fifo"),
    ("tiers", ["tape:1GiB"]),
    ("tiers", ["disk:lots"]),
    ("tiers", "disk:1GiB"),  # one spec, not a list of them
    ("correction", {"rank": 8, "bogus": 1}),
]


@pytest.mark.unit
@pytest.mark.parametrize(("knob", "value"), BAD_KNOBS, ids=[f"{k}={v!r}" for k, v in BAD_KNOBS])
def test_each_bad_knob_is_refused_by_name(knob, value):
    with pytest.raises(InvalidRequest, match=knob) as caught:
        EngineConfig(**{knob: value})
    assert caught.value.param == knob


@pytest.mark.unit
def test_knobs_that_contradict_each_other_are_refused():
    with pytest.raises(InvalidRequest, match="disk tier") as caught:
        EngineConfig(persist=True, tiers=["host:1GiB"])
    assert caught.value.param == "persist"
    with pytest.raises(InvalidRequest, match="prefix_cache=True") as caught:
        EngineConfig(prefix_cache=False, tiers=["host:1GiB"])
    assert caught.value.param == "tiers"
    assert EngineConfig(persist=True, tiers=["host:1GiB", "disk:1GiB"]).disk_tier


@pytest.mark.unit
def test_a_bad_knob_fails_the_engine_before_it_claims_or_loads_anything(monkeypatch):
    import kvbaton.backend.engine as engine_module

    def must_not_run(*args, **kwargs):
        raise AssertionError("a bad knob got as far as claiming tiers or loading the model")

    monkeypatch.setattr(engine_module, "claim_tiers", must_not_run)
    monkeypatch.setattr(engine_module, "load_model", must_not_run)
    for knob, value in BAD_KNOBS:
        with pytest.raises(InvalidRequest, match=knob):
            engine_module.Engine(**{knob: value})
    with pytest.raises(TypeError, match="kv_budgit"):  # an unknown knob, as any unknown keyword argument
        engine_module.Engine(kv_budgit="1GiB")


@pytest.mark.unit
def test_the_cli_and_the_engine_build_the_same_config():
    defaults = build_parser().parse_args(["serve"])
    assert engine_config(defaults, "cpu", None) == EngineConfig()
    for knob, default, _ in knob_flags():  # every flag's default is the knob's own
        assert getattr(defaults, knob) == (None if knob == "tiers" else default), knob
    args = build_parser().parse_args([
        "serve", "--kv-budget", "64MiB", "--dtype", "bfloat16", "--block-size", "32", "--prefill-chunk", "128",
        "--max-batch-tokens", "1024", "--no-fast-decode", "--eviction", "lru", "--tier", "host:1GiB",
        "--tier", "disk:2GiB", "--lookahead", "3", "--persist", "--reuse", "auto", "--model", "/models/x",
    ])
    assert engine_config(args, "cuda:1", "{{ messages }}") == EngineConfig(
        model="/models/x", kv_budget="64MiB", dtype="bfloat16", block_size=32, prefill_chunk=128,
        max_batch_tokens=1024, fast_decode=False, eviction="lru", tiers=("host:1GiB", "disk:2GiB"), lookahead=3,
        persist=True, reuse="auto", device="cuda:1", chat_template="{{ messages }}",
    )
    assert not engine_config(build_parser().parse_args(["serve", "--no-prefix-cache"]), "cpu", None).prefix_cache


@pytest.mark.unit
def test_serve_refuses_a_bad_knob_before_loading_anything(capsys):
    assert main(["serve", "--block-size", "0"]) == 2
    assert "block_size" in capsys.readouterr().err
    assert main(["serve", "--kv-budget", "lots"]) == 2
    assert "kv_budget" in capsys.readouterr().err


@pytest.mark.unit
def test_a_config_travels_to_a_worker_as_json():
    config = EngineConfig(kv_budget="64MiB", tiers=["host:1GiB"], correction={"rank": 8}, reuse="auto")
    assert config.tiers == ("host:1GiB",) and config.correction is not None and config.correction.rank == 8
    assert EngineConfig.from_json(config.to_json()) == config
    with pytest.raises(InvalidRequest, match="eviction"):
        EngineConfig(eviction=LRU()).to_json()  # a policy object stays in its process


@pytest.mark.unit
def test_a_config_is_frozen_and_changed_only_through_validation():
    config = EngineConfig()
    assert config.kv_budget == DEFAULT_KV_BUDGET
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.kv_budget = "2GiB"  # type: ignore[misc]
    assert EngineConfig.build(config, kv_budget="2GiB").kv_budget == "2GiB"
    with pytest.raises(InvalidRequest, match="block_size"):
        EngineConfig.build(config, block_size=0)


def test_an_engine_serves_the_hosted_contract_from_its_config(engine):
    from kvbaton.backend.hosting import HostedEngine, WorkerEngine
    from kvbaton.backend.tenants import TenantPartition

    assert isinstance(engine, HostedEngine) and isinstance(engine, WorkerEngine)
    assert engine.model_name == engine.stats().model and engine.default_reuse == engine.config.reuse == "exact"
    assert engine.persistence is None and engine.partitionable == TenantPartition(prefix_cache=True, spans=True)


@pytest.mark.unit
def test_an_engine_is_asked_only_what_it_can_keep_apart():
    from kvbaton.backend.hosting import check_partition
    from kvbaton.backend.tenants import TenantPartition

    cache_only = TenantPartition(prefix_cache=True)
    check_partition(object(), cache_only, cache_only)
    with pytest.raises(InvalidRequest, match="cannot keep tenants apart"):
        check_partition(object(), TenantPartition(spans=True), cache_only)


@pytest.mark.unit
def test_the_sdk_docs_list_every_knob():
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "sdk.md").read_text()
    table = page[page.index("Engine options ("):].split("\n\n", 2)[1]
    documented = {name for row in table.splitlines() for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert documented == {f.name for f in dataclasses.fields(EngineConfig)}
