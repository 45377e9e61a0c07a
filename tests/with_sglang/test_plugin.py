"""The kvbaton plugin inside SGLang 0.5.23's own radix cache (optional: needs the sglang venv).

Run with ``make test-sglang`` (docs/sglang.md). The main suite skips this file: sglang is not
installed there. Everything runs on the CPU against SGLang's real ``UnifiedRadixCache`` on its
Python tree core, with a real (tiny) KV pool: no model, no GPU.
"""

from __future__ import annotations

import json
import math
import os
import types
from array import array

import pytest

pytest.importorskip("sglang.srt.plugins", reason="needs the sglang venv: make test-sglang")

import torch
from kvbaton.backend.sglang_plugin import hooks
from kvbaton.backend.sglang_plugin.table import TABLE, WorkflowHint, make_envelope, owners_of
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.sampling.sampling_params import SamplingParams

KV_SLOTS = 512


@pytest.fixture(scope="module", autouse=True)
def plugin() -> None:
    """Load the plugin the way SGLang does: through the ``sglang.srt.plugins`` entry point."""
    from sglang.srt.plugins import load_plugins

    os.environ["SGLANG_PLUGINS"] = "kvbaton"  # only ours: other installed plugins are not under test
    load_plugins()


@pytest.fixture(autouse=True)
def fresh_table() -> None:
    TABLE.reset()


class Tree:
    """A real UnifiedRadixCache with a small CPU KV pool, and helpers to read it by tokens."""

    def __init__(self, policy: str, tree_core_backend: str | None = None) -> None:
        kv = MHATokenToKVPool(size=KV_SLOTS, page_size=1, dtype=torch.bfloat16, head_num=1, head_dim=8,
                              layer_num=1, device="cpu", enable_memory_saver=False)
        self.allocator = TokenToKVPoolAllocator(size=KV_SLOTS, dtype=torch.bfloat16, device="cpu", kvcache=kv,
                                                need_sort=False)
        self.req_pool = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
        params = CacheInitParams(req_to_token_pool=self.req_pool, token_to_kv_pool_allocator=self.allocator,
                                 page_size=1, disable=False, tree_components=(ComponentType.FULL,),
                                 eviction_policy=policy, tree_core_backend=tree_core_backend)
        self.cache = UnifiedRadixCache(params=params)
        self._rid = 0

    def insert(self, tokens: list[int]) -> None:
        value = self.allocator.alloc(len(tokens))
        self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=value[: len(tokens)]))

    def cached(self, tokens: list[int]) -> int:
        """How many leading tokens of ``tokens`` have device KV in the tree."""
        return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))).device_prefix_len

    def evict_one_node(self) -> None:
        # One token asked: the cache frees one whole leaf, the first in the policy's order.
        self.cache.evict(EvictParams(num_tokens=1))

    def request(self, tokens: list[int], kv_hints: dict | None) -> Req:
        """A request whose KV sits in its own slots, not yet in the tree (what a prefill leaves)."""
        req = Req(rid=f"r{self._rid}", origin_input_text="", origin_input_ids=array("q", tokens),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1), kv_hints=kv_hints)
        self._rid += 1
        self.req_pool.alloc([req])
        req.full_untruncated_fill_ids = array("q", tokens)
        req.extend_end = len(tokens)
        slots = self.allocator.alloc(len(tokens))
        self.req_pool.write((req.kv.req_pool_idx, slice(0, len(tokens))), slots)
        req.kv.kv_committed_len = len(tokens)
        req.last_node = self.cache.root_node_handle()
        req.kv.cache_protected_len = 0
        req.lock = None
        req.extra_key = None
        return req


# A workflow's prompts: a system prompt shared by agents a and b, each agent's own instructions,
# agent c with a prompt of its own, and a dynamic suffix (conversation so far) behind each.
SHARED = list(range(1, 17))
A_OWN, B_OWN, C_FIXED = list(range(100, 108)), list(range(200, 208)), list(range(300, 316))
A_FIXED, B_FIXED = SHARED + A_OWN, SHARED + B_OWN
A_DYN, B_DYN, C_DYN = [901, 902, 903], [911, 912, 913], [921, 922, 923]


def workflow_tree(policy: str) -> Tree:
    tree = Tree(policy, tree_core_backend="python")  # the same tree core for both policies
    # Fixed prompts first, then the full requests (the SDK materializes fixed prompts the same way).
    for fixed, dyn in ((A_FIXED, A_DYN), (B_FIXED, B_DYN), (C_FIXED, C_DYN)):
        tree.insert(fixed)
        tree.insert(fixed + dyn)
    for agent, fixed in (("a", A_FIXED), ("b", B_FIXED), ("c", C_FIXED)):
        hooks.tag_prefix(tree.cache, fixed, agent)
    return tree


def eviction_trace(tree: Tree) -> list[str]:
    """Evict node by node and name what disappears, in order."""
    probes = {
        "a.dyn": (A_FIXED + A_DYN, len(A_FIXED)), "b.dyn": (B_FIXED + B_DYN, len(B_FIXED)),
        "c.dyn": (C_FIXED + C_DYN, len(C_FIXED)), "a.own": (A_FIXED, len(SHARED)),
        "b.own": (B_FIXED, len(SHARED)), "c": (C_FIXED, 0), "shared": (SHARED, 0),
    }
    gone: list[str] = []
    for _ in range(20):
        for name, (tokens, floor) in probes.items():
            if name not in gone and tree.cached(tokens) <= floor:
                gone.append(name)
        if len(gone) == len(probes):
            break
        tree.evict_one_node()
    return gone


def test_the_entry_point_registers_the_kvbaton_policy() -> None:
    from kvbaton.backend.sglang_plugin.strategy import KvbatonStrategy
    from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES
    from sglang.srt.mem_cache.utils import get_eviction_strategy
    from sglang.srt.plugins.hook_registry import HookRegistry

    assert "kvbaton" in RADIX_EVICTION_POLICY_CHOICES
    assert isinstance(get_eviction_strategy("kvbaton"), KvbatonStrategy)
    assert isinstance(get_eviction_strategy("kvbaton", {"lookahead": 3}), KvbatonStrategy) and TABLE.lookahead == 3
    with pytest.raises(ValueError):
        get_eviction_strategy("kvbaton", {"lookahead": -1})
    assert "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint" in HookRegistry._patched
    TABLE.lookahead = 2


def test_the_kvbaton_policy_runs_on_the_python_tree_core() -> None:
    # Asked for the native core explicitly (the default), the kvbaton policy still gets the Python one,
    # the only one that calls a Python strategy.
    tree = Tree("kvbaton", tree_core_backend="rust")
    assert tree.cache._tree_core_backend == "python"
    assert type(tree.cache.tree_core) is UnifiedTreeCore


def test_shared_prefixes_take_the_soonest_owner_and_dynamic_suffixes_go_first() -> None:
    tree = workflow_tree("kvbaton")
    TABLE.update({"a": 0, "b": 3, "c": 1})
    order = eviction_trace(tree)
    assert set(order[:3]) == {"a.dyn", "b.dyn", "c.dyn"}
    # then fixed prompts from the farthest STE down; the prefix shared by a (0) and b (3) goes last
    assert order[3:] == ["b.own", "c", "a.own", "shared"]


def test_lru_ignores_the_workflow() -> None:
    tree = workflow_tree("lru")
    TABLE.update({"a": 0, "b": 3, "c": 1})
    order = eviction_trace(tree)
    assert order.index("a.own") < order.index("b.own")  # a was used first, so LRU drops it first


def test_steps_can_fall_as_well_as_rise() -> None:
    # SGLang's per-request priority can only rise; the STE table is read at each eviction instead.
    tree = workflow_tree("kvbaton")
    TABLE.update({"a": 0, "b": 3, "c": 1})
    TABLE.update({"a": 4, "b": 0}, replace=True)  # the workflow moved on: b runs, a is far, c unknown
    order = eviction_trace(tree)
    assert order[3:] == ["c", "a.own", "b.own", "shared"]  # unhinted c counts as infinitely far


def test_tags_survive_node_splits() -> None:
    tree = Tree("kvbaton")
    tree.insert(A_FIXED)
    hooks.tag_prefix(tree.cache, A_FIXED, "a")
    tree.insert(SHARED + [555, 556])  # splits a's node at the end of SHARED
    node = hooks.resolve_node(tree.cache, tree.cache.match_prefix(
        MatchPrefixParams(key=RadixKey(array("q", SHARED)))).best_match_node)
    assert owners_of(node) == {"a"}
    assert owners_of(node.children[A_OWN[0]]) == {"a"}


def test_kv_hints_on_a_request_set_steps_and_tag_its_fixed_prompt() -> None:
    tree = Tree("kvbaton")
    hint = WorkflowHint(agent="a", fixed_tokens=len(A_FIXED), steps={"b": 2}, running=("a",))
    req = tree.request(A_FIXED + A_DYN, make_envelope(hint, "m1"))
    assert TABLE.ste == {"b": 2.0, "a": 0.0}  # applied when the request reached the scheduler
    tree.cache.checkpoint(req, up_to=len(A_FIXED + A_DYN))
    fixed_end = hooks.resolve_node(tree.cache, tree.cache.match_prefix(
        MatchPrefixParams(key=RadixKey(array("q", A_FIXED)))).best_match_node)
    assert owners_of(fixed_end) == {"a"}
    assert all(not owners_of(child) for child in fixed_end.children.values())  # the dynamic suffix
    assert TABLE.prefixes["a"][0] == tuple(A_FIXED)


def test_requests_without_kvbaton_hints_are_left_alone() -> None:
    tree = Tree("kvbaton")
    other = {"protocol_version": "1", "message_id": "x",
             "actions": [{"action_id": "0", "action_type": "someone.else", "action_version": "1"}]}
    req = tree.request(A_FIXED, other)
    tree.cache.checkpoint(req, up_to=len(A_FIXED))
    assert TABLE.ste == {} and TABLE.prefixes == {}


def test_a_malformed_kvbaton_hint_is_ignored_not_fatal() -> None:
    tree = Tree("kvbaton")
    bad = {"protocol_version": "1", "message_id": "x", "actions": [
        {"action_id": "0", "action_type": "kvbaton.workflow", "action_version": "1", "payload": {"steps": {"a": -1}}}]}
    req = tree.request(A_FIXED, bad)
    tree.cache.checkpoint(req, up_to=len(A_FIXED))
    assert TABLE.ste == {}


def test_the_scheduler_rpc_updates_hints_and_tags_agents_between_requests() -> None:
    tree = Tree("kvbaton")
    tree.insert(C_FIXED)
    scheduler = types.SimpleNamespace(tree_cache=tree.cache)
    hooks.attach_rpc(None, scheduler)
    scheduler.kvbaton_agent(payload=json.dumps({"agent": "c", "tokens": C_FIXED}))
    scheduler.kvbaton_hints(payload=json.dumps({"steps": {"c": 1, "z": math.inf}}))
    node = hooks.resolve_node(tree.cache, tree.cache.match_prefix(
        MatchPrefixParams(key=RadixKey(array("q", C_FIXED)))).best_match_node)
    assert owners_of(node) == {"c"}
    assert TABLE.ste == {"c": 1.0, "z": math.inf}
    assert TABLE.due() == ["c"]
    # No host tier in this cache: nothing to prefetch, and saying so is not an error.
    assert hooks.prefetch_due(tree.cache) == 0
    scheduler.kvbaton_reset()
    assert TABLE.ste == {}
