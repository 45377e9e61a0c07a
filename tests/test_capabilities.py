"""client.capabilities(), and the parts of the SGLang integration that run without SGLang.

The plugin's behaviour inside SGLang's own radix cache is specified in tests/with_sglang/
(``make test-sglang``); here: what every client reports, the plugin's pure-Python STE table (kvbaton's
own eviction order applied to tagged tree nodes), hint envelopes, and the typed errors of
``engine="sglang"`` where SGLang is not installed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math

import kvbaton
import pytest
from kvbaton.backend.cache.eviction import StepsToExecution
from kvbaton.backend.sglang_plugin.budget import gigabytes, kv_tokens_for_budget
from kvbaton.backend.sglang_plugin.table import (
    ACTION_TYPE,
    HintError,
    SteTable,
    WorkflowHint,
    hints_from_envelope,
    inherit_owners,
    make_envelope,
    owners_of,
    tag_path,
)
from kvbaton.capabilities import KVBATON, SGLANG, Capabilities
from kvbaton.cli import main as cli_main
from kvbaton.embedded import AsyncEmbeddedClient, EmbeddedClient
from kvbaton.errors import InvalidRequest, ModelNotFound

HAS_SGLANG = importlib.util.find_spec("sglang") is not None


# -- what clients report --------------------------------------------------------------------------


def test_the_embedded_client_reports_kvbatons_own_engine(engine) -> None:
    caps = EmbeddedClient(engine=engine).capabilities()
    assert caps == KVBATON
    assert (caps.resume, caps.fork, caps.shifted_segments, caps.handles_pinned) == ("exact", "exact", "corrected", True)
    assert asyncio.run(AsyncEmbeddedClient(engine=engine).capabilities()) == KVBATON


def test_the_server_reports_its_engine(server) -> None:
    with server.http() as http:
        response = http.get("/v1/capabilities")
    assert response.status_code == 200
    assert Capabilities.model_validate(response.json()) == KVBATON
    with kvbaton.connect(server.url) as client:
        assert client.capabilities() == KVBATON

    async def remote() -> Capabilities:
        async with await kvbaton.aconnect(server.url) as client:
            return await client.capabilities()

    assert asyncio.run(remote()) == KVBATON


@pytest.mark.unit
def test_sglang_reports_what_it_recomputes_instead_of_correcting() -> None:
    assert SGLANG.engine == "sglang"
    assert SGLANG.resume == SGLANG.fork == "exact"
    assert SGLANG.shifted_segments == "recompute"  # dense prefill, never an approximation
    assert SGLANG.transfer == "unsupported"
    assert not SGLANG.handles_pinned  # a handle names a prefix SGLang may evict (then recompute)


# -- the plugin's STE table (pure Python) ---------------------------------------------------------


class Node:
    """A radix tree node as SGLang's trees have them: a parent and a last access time."""

    def __init__(self, parent: Node | None, last_access_time: float) -> None:
        self.parent = parent
        self.last_access_time = last_access_time


def tree() -> dict[str, Node]:
    """root -> shared -> {a_own -> a_dyn, b_own -> b_dyn}; root -> c. Agent a ran first, b last."""
    root = Node(None, 0)
    shared = Node(root, 7)  # touched with every request below it
    a_own, b_own, c = Node(shared, 2), Node(shared, 5), Node(root, 4)
    nodes = {"shared": shared, "a_own": a_own, "a_dyn": Node(a_own, 3), "b_own": b_own, "b_dyn": Node(b_own, 6),
             "c": c}
    tag_path(a_own, "a")
    tag_path(b_own, "b")
    tag_path(c, "c")
    return nodes


def evict_order(table: SteTable, nodes: dict[str, Node]) -> list[str]:
    return sorted(nodes, key=lambda name: table.priority(nodes[name]))


@pytest.mark.unit
def test_a_shared_prefix_takes_the_soonest_of_its_owners() -> None:
    nodes, table = tree(), SteTable()
    table.update({"a": 0, "b": 3, "c": 1})
    assert owners_of(nodes["shared"]) == {"a", "b"}
    assert table.node_ste(nodes["shared"]) == 0
    assert evict_order(table, nodes) == ["a_dyn", "b_dyn", "b_own", "c", "a_own", "shared"]


@pytest.mark.unit
def test_the_order_is_kvbatons_own_eviction_policy() -> None:
    nodes, table = tree(), SteTable()
    table.update({"a": 2, "b": 1})
    policy = StepsToExecution(table.ste)

    class View:
        def __init__(self, node: Node) -> None:
            self.owners, self.last_access = owners_of(node), node.last_access_time

    for node in nodes.values():
        assert table.priority(node) == policy.priority(View(node))


@pytest.mark.unit
def test_steps_replace_and_running_agents_are_due() -> None:
    table = SteTable(lookahead=1)
    table.update({"a": 0, "b": 3})
    table.update({"b": 1}, running=["c"], replace=True)
    assert table.ste == {"b": 1.0, "c": 0.0}
    table.remember_prefix("b", [1, 2])
    table.remember_prefix("c", [3])
    table.remember_prefix("z", [4])  # no hint: never due
    assert table.due() == ["c", "b"]
    assert table.due(lookahead=0) == ["c"]


@pytest.mark.unit
def test_split_nodes_inherit_their_childs_owners() -> None:
    root = Node(None, 0)
    child = Node(root, 1)
    tag_path(child, "a")
    new_parent = Node(root, 1)
    child.parent = new_parent
    inherit_owners(new_parent, child)
    assert owners_of(new_parent) == {"a"}


@pytest.mark.unit
def test_hints_travel_in_the_kv_hints_envelope() -> None:
    hint = WorkflowHint(agent="a", fixed_tokens=12, steps={"b": 2.0, "c": math.inf}, running=("a",))
    envelope = json.loads(json.dumps(make_envelope(hint, "m1")))  # through JSON, as on the wire
    assert envelope["actions"][0]["action_type"] == ACTION_TYPE
    assert hints_from_envelope(envelope) == [hint]
    other = {"protocol_version": "1", "message_id": "x", "actions": [{"action_type": "x", "action_version": "1"}]}
    assert hints_from_envelope(other) == [] and hints_from_envelope(None) == []


@pytest.mark.unit
@pytest.mark.parametrize("payload", [{"steps": {"a": -1}}, {"steps": {"": 1}}, {"fixed_tokens": -1}, {"agnet": "a"}])
def test_invalid_hints_are_rejected(payload: dict) -> None:
    with pytest.raises(HintError):
        hints_from_envelope({"actions": [{"action_type": ACTION_TYPE, "action_version": "1", "payload": payload}]})


# -- engine="sglang" without SGLang ---------------------------------------------------------------


@pytest.mark.unit
def test_kv_budgets_become_sglang_token_counts() -> None:
    config = {"num_hidden_layers": 30, "num_key_value_heads": 3, "num_attention_heads": 9, "hidden_size": 576}
    per_token = 2 * 30 * 3 * 64 * 2
    assert kv_tokens_for_budget("4096 tokens", config) == 4096
    assert kv_tokens_for_budget("64MiB", config) == 64 * 2**20 // per_token
    assert gigabytes("8GiB") == 9 and gigabytes("1GB") == 1
    with pytest.raises(InvalidRequest):
        kv_tokens_for_budget("lots", config)


@pytest.mark.unit
def test_connect_to_sglang_needs_a_checkpoint_and_sglang(tmp_path) -> None:
    with pytest.raises(InvalidRequest, match="model="):
        kvbaton.connect(engine="sglang")
    with pytest.raises(ModelNotFound):
        kvbaton.connect(engine="sglang", model=str(tmp_path))
    with pytest.raises(InvalidRequest, match="unknown engine"):
        kvbaton.connect(engine="vllm")
    with pytest.raises(InvalidRequest, match="own engine"):
        kvbaton.connect("http://127.0.0.1:1", engine="sglang")
    if not HAS_SGLANG:
        (tmp_path / "config.json").write_text("{}")
        with pytest.raises(InvalidRequest, match="sglang==0.5.23"):
            kvbaton.connect(engine="sglang", model=str(tmp_path))


@pytest.mark.unit
def test_serve_with_sglang_refuses_without_a_model(capsys) -> None:
    assert cli_main(["serve", "--engine", "sglang", "--port", "1"]) == 2
    assert "needs model=" in capsys.readouterr().err
