"""Where the plugin meets SGLang 0.5.23: policy registration, hint intake, node tags, prefetch.

Everything here goes through SGLang's public extension points: the radix eviction policy choice
list, the plugin ``HookRegistry`` (before/after hooks on named methods), the ``kv_hints`` envelope
a request carries to ``Req.kv_hints``, and the engine's ``collective_rpc`` into a scheduler method.
The one private name used is the strategy factory table (``mem_cache.utils``), which has no public
registration function in this release.
"""

from __future__ import annotations

import json
import logging
import types
from array import array
from collections.abc import Sequence
from typing import Any

from .table import TABLE, HintError, hints_from_envelope, inherit_owners, parse_hint, tag_path

log = logging.getLogger("kvbaton.sglang")

POLICY_NAME = "kvbaton"
RPC_HINTS = "kvbaton_hints"
RPC_AGENT = "kvbaton_agent"
RPC_RESET = "kvbaton_reset"

_URC = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
_installed = False


# -- registration ---------------------------------------------------------------------------------


def register_policy() -> None:
    """Add ``kvbaton`` to ``--radix-eviction-policy`` and to the strategy factories (idempotent)."""
    from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES, add_radix_eviction_policy_choices
    from sglang.srt.mem_cache import utils

    from .strategy import KvbatonStrategy

    if POLICY_NAME not in RADIX_EVICTION_POLICY_CHOICES:
        add_radix_eviction_policy_choices([POLICY_NAME])
    utils._EVICTION_POLICY_FACTORIES.setdefault(POLICY_NAME, KvbatonStrategy)


def install() -> None:
    """The plugin's entry point body: runs in every SGLang process (``load_plugins``)."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    register_policy()
    hooks = [
        (f"{_URC}.__init__", force_python_tree_core, HookType.BEFORE),
        (f"{_URC}.checkpoint", after_checkpoint, HookType.AFTER),
        ("sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore._split_node",
         after_unified_split, HookType.AFTER),
        ("sglang.srt.mem_cache.radix_cache.RadixCache._split_node", after_legacy_split, HookType.AFTER),
        ("sglang.srt.managers.schedule_batch.Req.__init__", after_req_init, HookType.AFTER),
        ("sglang.srt.managers.scheduler.Scheduler.__init__", attach_rpc, HookType.AFTER),
    ]
    for target, hook, kind in hooks:
        HookRegistry.register(target, hook, kind)
    _installed = True


def _advisory(hook: Any) -> Any:
    """Hints only steer eviction: a failing hook logs and lets SGLang's scheduler carry on."""

    def guarded(*args: Any, **kwargs: Any) -> None:
        try:
            hook(*args, **kwargs)
        except Exception:
            log.exception("kvbaton plugin: %s failed (ignored)", hook.__name__)

    guarded.__name__ = hook.__name__
    guarded.__doc__ = hook.__doc__
    return guarded


# -- the Python tree core -------------------------------------------------------------------------


def force_python_tree_core(*args: Any, **kwargs: Any) -> None:
    """SGLang's default tree core is native (Rust) and never calls a Python strategy: with the
    kvbaton policy the cache is built on the Python ``UnifiedTreeCore`` instead."""
    params = kwargs.get("params", args[1] if len(args) > 1 else None)
    if params is not None and str(params.eviction_policy).lower() == POLICY_NAME:
        if params.tree_core_backend not in (None, "python", "rust"):
            log.warning("kvbaton policy: replacing tree core %r by the Python one", params.tree_core_backend)
        params.tree_core_backend = "python"


# -- node tags survive splits ---------------------------------------------------------------------


@_advisory
def after_unified_split(result: Any, tree: Any, key: Any, child: Any, split_len: int, *a: Any, **k: Any) -> None:
    new_node = result[0] if isinstance(result, tuple) else result
    inherit_owners(new_node, child)


@_advisory
def after_legacy_split(result: Any, cache: Any, key: Any, child: Any, split_len: int, *a: Any, **k: Any) -> None:
    inherit_owners(result, child)


# -- hint intake ----------------------------------------------------------------------------------


def _hints_of(req: Any) -> list[Any]:
    hints = getattr(req, "_kvbaton_hints", None)
    if hints is None:
        try:
            hints = hints_from_envelope(getattr(req, "kv_hints", None))
        except HintError as exc:
            log.warning("request %s: %s (ignored)", getattr(req, "rid", "?"), exc)
            hints = []
        req._kvbaton_hints = hints
    return hints


@_advisory
def after_req_init(result: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """A request reaches the scheduler: its STE hints apply before its prefill allocates (and evicts)."""
    if getattr(req, "kv_hints", None) is None:
        return
    for hint in _hints_of(req):
        TABLE.apply(hint)


@_advisory
def after_checkpoint(result: Any, cache: Any, req: Any, *args: Any, up_to: int | None = None, **kwargs: Any) -> None:
    """The request's KV is in the tree: tag the nodes of its agent's fixed prompt."""
    if getattr(req, "kv_hints", None) is None or getattr(req, "_kvbaton_tagged", False):
        return
    for hint in _hints_of(req):
        if not hint.agent or not hint.fixed_tokens:
            continue
        if up_to is not None and up_to < hint.fixed_tokens:
            return  # chunked prefill: the fixed prompt is not all in the tree yet
        tokens = list(req.origin_input_ids[: hint.fixed_tokens])
        extra_key, salt = getattr(req, "extra_key", None), getattr(req, "cache_salt", None)
        TABLE.remember_prefix(hint.agent, tokens, extra_key, salt)
        tag_prefix(cache, tokens, hint.agent, extra_key=extra_key, cache_salt=salt)
        req._kvbaton_tagged = True


def resolve_node(cache: Any, handle: Any) -> Any:
    """A node object from a match result: the unified cache reports node ids, the legacy one nodes."""
    if not isinstance(handle, int):
        return handle
    node_by_id = getattr(getattr(cache, "tree_core", None), "node_by_id", None)
    try:
        return node_by_id(handle) if node_by_id is not None else None
    except NotImplementedError:  # the native tree core keeps its nodes to itself
        return None


def _match(cache: Any, tokens: Sequence[int], extra_key: str | None, cache_salt: str | None) -> Any:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(array("q", tokens), extra_key, cache_salt=cache_salt)
    return cache.match_prefix(MatchPrefixParams(key=key))


def tag_prefix(cache: Any, tokens: Sequence[int], agent: str, *, extra_key: str | None = None,
               cache_salt: str | None = None) -> int:
    """Tag the tree nodes holding ``tokens`` (an agent's fixed prompt) with ``agent``.

    The match splits a node that straddles the end of the prompt, so the dynamic suffix behind it
    stays untagged. Returns the number of newly tagged nodes (0 when nothing is cached)."""
    if not tokens:
        return 0
    node = resolve_node(cache, _match(cache, tokens, extra_key, cache_salt).best_match_node)
    if node is None:
        log.warning("kvbaton policy: this tree core exposes no nodes; is the Python tree core selected?")
        return 0
    tagged = tag_path(node, agent)
    TABLE.counters["tagged_nodes"] += tagged
    return tagged


# -- RPC between requests, and prefetch -----------------------------------------------------------


def attach_rpc(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Give the scheduler the methods ``Engine.collective_rpc`` calls by name (flat scalars only,
    so payloads travel as JSON strings)."""
    scheduler.kvbaton_hints = types.MethodType(rpc_hints, scheduler)
    scheduler.kvbaton_agent = types.MethodType(rpc_agent, scheduler)
    scheduler.kvbaton_reset = types.MethodType(rpc_reset, scheduler)


def rpc_hints(scheduler: Any, payload: str) -> None:
    """``{"steps": {...}, "running": [...], "replace": bool}``: update STE, then prefetch."""
    hint = parse_hint(json.loads(payload))
    TABLE.apply(hint)
    prefetch_due(scheduler.tree_cache)


def rpc_agent(scheduler: Any, payload: str) -> None:
    """``{"agent": name, "tokens": [...], "extra_key": null}``: an agent's fixed prompt."""
    body = json.loads(payload)
    agent, tokens = str(body["agent"]), [int(t) for t in body["tokens"]]
    extra_key = body.get("extra_key")
    TABLE.remember_prefix(agent, tokens, extra_key)
    tag_prefix(scheduler.tree_cache, tokens, agent, extra_key=extra_key)


def rpc_reset(scheduler: Any) -> None:
    TABLE.reset()


def prefetch_due(cache: Any) -> int:
    """Load back from the host tier the fixed prompts of agents due within the look-ahead.

    KVFlow's proactive prefetch: SGLang's HiCache loads host KV back only when a request needs it.
    Without a host tier (no ``cache_controller``) there is nothing to prefetch. The loads are queued
    on SGLang's cache controller and start with the next batch, whose forward waits layer by layer
    for them exactly as for a request's own load-back: starting them here instead would let a batch
    read KV still in flight. Returns the number of load-backs queued."""
    if getattr(cache, "cache_controller", None) is None or not hasattr(cache, "load_back"):
        return 0
    started = 0
    for agent in TABLE.due():
        tokens, extra_key, salt = TABLE.prefixes[agent]
        TABLE.counters["prefetch_requests"] += 1
        if not cache.has_free_load_back_slot():
            break
        try:
            match = _match(cache, tokens, extra_key, salt)
            if match.host_hit_length > 0 and cache.load_back(match.best_match_node):
                started += 1
        except Exception:  # a failed prefetch only costs the reactive load-back later
            log.exception("kvbaton prefetch of agent %r failed", agent)
    TABLE.counters["prefetch_loads"] += started
    return started
