"""The ``kvbaton`` radix eviction strategy for SGLang (``--radix-eviction-policy kvbaton``)."""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.evict_policy import EvictionStrategy

from .table import TABLE

POLICY_NAME = "kvbaton"


class KvbatonStrategy(EvictionStrategy):
    """Steps-to-execution order, read from the plugin's table at every eviction (see table.py).

    Options come from ``--radix-eviction-policy-config``: ``{"lookahead": 2}`` sets how many steps
    ahead an agent's host-tier KV is prefetched."""

    def __init__(self, lookahead: int | None = None) -> None:
        if lookahead is not None:
            if not isinstance(lookahead, int) or lookahead < 0:
                raise ValueError(f"kvbaton policy: lookahead must be an int >= 0, got {lookahead!r}")
            TABLE.lookahead = lookahead

    def get_priority(self, node: Any) -> tuple[Any, ...]:
        return TABLE.priority(node)
