"""The plugin's steps-to-execution table and node tags, in pure Python (no SGLang import).

SGLang's radix tree knows nothing of agents. The plugin tags every tree node on an agent's fixed
prompt with the agent's name (``node._kvbaton_owners``) and keeps one table per scheduler process:
the current steps-to-execution (STE) of each agent and the token prefix of its fixed prompt. The
eviction order itself is kvbaton's own :class:`~kvbaton.backend.cache.eviction.StepsToExecution`: a node
takes the MIN STE of its owners, untagged nodes (dynamic suffixes) go first, ties by recency.

Node priority in SGLang can only rise (``priority`` is a max over requests), which cannot express
"this agent runs later now"; the table is read at every eviction instead, so lowering works.

Hints arrive in SGLang's ``kv_hints`` envelope on a request (one action of type
:data:`ACTION_TYPE`), or between requests through the scheduler RPC the plugin adds.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..cache.eviction import StepsToExecution

ACTION_TYPE = "kvbaton.workflow"
ACTION_VERSION = "1"
PROTOCOL_VERSION = "1"
OWNERS_ATTR = "_kvbaton_owners"


class WorkflowHint(BaseModel):
    """The payload of a ``kvbaton.workflow`` kv_hints action (or of the hints RPC).

    ``agent`` tags the request's first ``fixed_tokens`` tokens (its fixed prompt) with the agent;
    ``steps`` updates the STE table (``replace`` drops agents it does not name); ``running``
    agents get STE 0.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    agent: str | None = Field(default=None, min_length=1, max_length=256)
    fixed_tokens: int = Field(default=0, ge=0)
    steps: dict[str, float] = Field(default_factory=dict)
    running: tuple[str, ...] = ()
    replace: bool = False

    @field_validator("steps")
    @classmethod
    def _non_negative(cls, value: dict[str, float]) -> dict[str, float]:
        bad = sorted(agent for agent, steps in value.items() if not agent or math.isnan(steps) or steps < 0)
        if bad:
            raise ValueError(f"steps must be >= 0 (inf allowed) for non-empty agent names: {bad}")
        return value


class HintError(ValueError):
    """A kvbaton hint that does not validate; the plugin logs it and ignores the hint."""


def parse_hint(payload: Any) -> WorkflowHint:
    try:
        return WorkflowHint.model_validate(payload)
    except ValidationError as exc:
        raise HintError(f"invalid kvbaton hint: {exc}") from exc


def hints_from_envelope(envelope: Any) -> list[WorkflowHint]:
    """The kvbaton actions of a ``KvHintsEnvelope`` (or its dict form); other actions are ignored,
    as SGLang's envelope contract asks of every consumer."""
    if envelope is None:
        return []
    actions = envelope.get("actions", []) if isinstance(envelope, Mapping) else getattr(envelope, "actions", [])
    found = []
    for action in actions or ():
        get = action.get if isinstance(action, Mapping) else lambda k, a=action: getattr(a, k, None)
        if get("action_type") == ACTION_TYPE and str(get("action_version")) == ACTION_VERSION:
            found.append(parse_hint(get("payload") or {}))
    return found


def make_envelope(hint: WorkflowHint, message_id: str) -> dict[str, Any]:
    """The ``kv_hints`` envelope carrying ``hint`` (JSON-ready), as the SGLang client sends it."""
    return {
        "protocol_version": PROTOCOL_VERSION,
        "message_id": message_id,
        "actions": [
            {
                "action_id": f"{message_id}-0",
                "action_type": ACTION_TYPE,
                "action_version": ACTION_VERSION,
                "payload": hint.model_dump(mode="json", exclude_defaults=True),
            }
        ],
    }


# -- node tags ------------------------------------------------------------------------------------


def owners_of(node: Any) -> frozenset[str]:
    return getattr(node, OWNERS_ATTR, frozenset())


def tag_path(node: Any, agent: str) -> int:
    """Tag ``node`` and its ancestors (not the root) with ``agent``; returns how many were new.

    Works on any tree whose nodes have ``parent`` (``None`` at the root): SGLang's
    ``UnifiedTreeNode`` and the legacy ``TreeNode`` alike."""
    tagged = 0
    while node is not None and node.parent is not None:
        owners = owners_of(node)
        if agent not in owners:
            setattr(node, OWNERS_ATTR, owners | {agent})
            tagged += 1
        node = node.parent
    return tagged


def inherit_owners(new_parent: Any, child: Any) -> None:
    """A split's new parent holds a prefix of the child's tokens: same fixed prompts own it."""
    owners = owners_of(child) | owners_of(new_parent)
    if owners:
        setattr(new_parent, OWNERS_ATTR, owners)


class _NodeView:
    """What kvbaton's eviction policy reads of a node (its ``CacheNode`` protocol)."""

    __slots__ = ("last_access", "owners")

    def __init__(self, owners: frozenset[str], last_access: float) -> None:
        self.owners = owners
        self.last_access = last_access


# -- the table ------------------------------------------------------------------------------------


class SteTable:
    """STE per agent, the fixed-prompt tokens per agent, and prefetch counters of one process."""

    def __init__(self, lookahead: int = 2) -> None:
        self.lookahead = lookahead
        self.ste: dict[str, float] = {}
        # agent -> (fixed-prompt token ids, extra_key, cache_salt): what prefetch looks up
        self.prefixes: dict[str, tuple[tuple[int, ...], str | None, str | None]] = {}
        self.counters = {"hints": 0, "tagged_nodes": 0, "prefetch_requests": 0, "prefetch_loads": 0}
        self._policy = StepsToExecution(self.ste)  # reads self.ste live
        self._lock = threading.Lock()

    # -- intake
    def update(self, steps: Mapping[str, float], running: Iterable[str] = (), *, replace: bool = False) -> None:
        with self._lock:
            if replace:
                self.ste.clear()
            self.ste.update({agent: float(value) for agent, value in steps.items()})
            for agent in running:
                self.ste[agent] = 0.0
            self.counters["hints"] += 1

    def apply(self, hint: WorkflowHint) -> None:
        if hint.steps or hint.running or hint.replace:
            self.update(hint.steps, hint.running, replace=hint.replace)

    def remember_prefix(self, agent: str, tokens: Iterable[int], extra_key: str | None = None,
                        cache_salt: str | None = None) -> None:
        with self._lock:
            self.prefixes[agent] = (tuple(int(t) for t in tokens), extra_key, cache_salt)

    # -- reading
    def node_ste(self, node: Any) -> float:
        return self._policy.node_ste(_NodeView(owners_of(node), 0))

    def priority(self, node: Any) -> tuple[Any, ...]:
        """SGLang's ``get_priority``: the smallest is evicted first."""
        return self._policy.priority(_NodeView(owners_of(node), node.last_access_time))

    def due(self, lookahead: int | None = None) -> list[str]:
        """Agents whose fixed prompt should be on the device now: STE <= look-ahead, soonest first."""
        limit = self.lookahead if lookahead is None else lookahead
        return sorted((a for a, s in self.ste.items() if s <= limit and a in self.prefixes), key=self.ste.__getitem__)

    def snapshot(self) -> dict[str, Any]:
        return {"ste": dict(self.ste), "agents_with_prefix": sorted(self.prefixes), **self.counters}

    def reset(self) -> None:
        with self._lock:
            self.ste.clear()
            self.prefixes.clear()
            for key in self.counters:
                self.counters[key] = 0


TABLE = SteTable()
"""The table of this process (SGLang runs one radix tree per scheduler process)."""
