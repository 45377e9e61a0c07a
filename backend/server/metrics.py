"""Prometheus metrics of the server: request counts and durations, time to first token, prompt
tokens by source (reused exactly, reused approximately, prefilled), generated tokens, and the engine's pool and reuse counters.

Per agent (``AgentCollector``): requests, prompt tokens by source, generated tokens, prefetch hits
and misses, labelled ``tenant`` (the salted tenant id, never a token) and ``agent``, read from the
engine's event ring at scrape time.

Invariants: label values are bounded (route templates, never raw paths; never a token; at most
``max_agents`` agent labels, later agents count as ``other``); the pool gauges are read from the
engine at scrape time (``PoolCollector``), never cached.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvbaton.types import Events, Result, Stats
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
MAX_AGENT_LABELS = 32
OTHER = "other"
SINGLE = "default"  # the tenant label of a single-tenant server


class Metrics:
    """The registry of one app, with the metrics the middleware and the generation endpoints record."""

    def __init__(self, stats: Callable[[], Stats], events: Callable[[int], Events] | None = None,
                 tenant_of: Callable[[str], tuple[str, str]] | None = None, max_agents: int = MAX_AGENT_LABELS) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvbaton_requests", "HTTP requests by endpoint, method and status", ["endpoint", "method", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "kvbaton_request_duration_seconds", "HTTP request duration (streams: until the last byte)",
            ["endpoint"], registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.ttft = Histogram(
            "kvbaton_ttft_seconds", "Time to first token of generation requests, measured in the engine",
            ["endpoint"], registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30),
        )
        self.prompt_tokens = Counter(
            "kvbaton_prompt_tokens", "Prompt tokens of generation requests: reused exactly (from a handle or the "
            "prefix cache), reused approximately (spans placed behind another prefix), or prefilled",
            ["endpoint", "source"], registry=self.registry,
        )
        self.generated_tokens = Counter(
            "kvbaton_generated_tokens", "Generated tokens", ["endpoint"], registry=self.registry
        )
        self.registry.register(PoolCollector(stats))
        if events is not None:
            self.registry.register(AgentCollector(events, tenant_of or (lambda name: (SINGLE, name)), max_agents))

    def observe(self, endpoint: str, result: Result) -> None:
        t = result.timings
        self.ttft.labels(endpoint).observe(t.ttft_s)
        self.prompt_tokens.labels(endpoint, "reused").inc(t.tokens_reused - t.tokens_approximate)
        self.prompt_tokens.labels(endpoint, "approximate").inc(t.tokens_approximate)
        self.prompt_tokens.labels(endpoint, "prefilled").inc(t.tokens_prefilled)
        self.generated_tokens.labels(endpoint).inc(t.tokens_generated)

    def exposition(self) -> bytes:
        """Every metric in the text format (reads the engine's stats: call it off the event loop)."""
        return generate_latest(self.registry)


@dataclass
class _AgentTotals:
    requests: int = 0
    reused: int = 0
    approximate: int = 0
    prefilled: int = 0
    generated: int = 0
    prefetch_hits: int = 0
    tier_loads: int = 0  # blocks a request had to wait for from a slow tier: prefetch misses


class AgentCollector:
    """Per-agent counters from the engine's request events, read at scrape time.

    Cardinality is capped: the first ``max_agents`` (tenant, agent) pairs seen keep their own labels,
    every later one counts as agent ``other`` of its tenant (a counter never moves between series, so
    every series stays monotonic). Events the engine's ring lost before a scrape read them are counted
    in ``kvbaton_events_dropped`` rather than silently missing."""

    def __init__(self, events: Callable[[int], Events], tenant_of: Callable[[str], tuple[str, str]],
                 max_agents: int) -> None:
        self._events, self._tenant_of, self._max = events, tenant_of, max_agents
        self._lock = threading.Lock()  # one scrape reads and counts at a time
        self._cursor = 0
        self._dropped = 0
        self._totals: dict[tuple[str, str], _AgentTotals] = {}
        self._named: set[tuple[str, str]] = set()

    def describe(self) -> list[Any]:
        return []

    def _label(self, engine_agent: str | None) -> tuple[str, str]:
        tenant, agent = self._tenant_of(engine_agent or "")
        key = (tenant, agent or "none")
        if key not in self._named and len(self._named) < self._max:
            self._named.add(key)
        return key if key in self._named else (tenant, OTHER)

    def _read(self) -> None:
        while True:
            page = self._events(self._cursor)
            self._dropped += page.dropped
            for e in page.events:
                if e.kind != "request" or e.finish in ("error", "abandoned"):
                    continue
                t = self._totals.setdefault(self._label(e.agent), _AgentTotals())
                t.requests += 1
                t.reused += e.tokens_reused - e.tokens_approximate
                t.approximate += e.tokens_approximate
                t.prefilled += e.tokens_prefilled
                t.generated += e.tokens_generated
                t.prefetch_hits += e.prefetch_hits
                t.tier_loads += sum(n for tier, n in e.blocks_loaded.items() if tier != "device")
            if page.next == self._cursor or not page.events:
                return
            self._cursor = page.next

    def collect(self) -> Iterable[Any]:
        with self._lock:
            self._read()
            totals = {k: _AgentTotals(**vars(v)) for k, v in self._totals.items()}
            dropped = self._dropped
        labels = ["tenant", "agent"]
        requests = CounterMetricFamily("kvbaton_agent_requests", "Finished requests per agent", labels=labels)
        tokens = CounterMetricFamily(
            "kvbaton_agent_prompt_tokens", "Prompt tokens per agent by source: reused exactly, reused "
            "approximately, prefilled", labels=[*labels, "source"])
        generated = CounterMetricFamily("kvbaton_agent_generated_tokens", "Generated tokens per agent", labels=labels)
        prefetch = CounterMetricFamily(
            "kvbaton_agent_prefetch_blocks", "Cached blocks a request found brought back by prefetch (hit) or had "
            "to wait for from a slow tier (miss)", labels=[*labels, "outcome"])
        for (tenant, agent), t in sorted(totals.items()):
            requests.add_metric([tenant, agent], t.requests)
            for source, n in (("reused", t.reused), ("approximate", t.approximate), ("prefilled", t.prefilled)):
                tokens.add_metric([tenant, agent, source], n)
            generated.add_metric([tenant, agent], t.generated)
            prefetch.add_metric([tenant, agent, "hit"], t.prefetch_hits)
            prefetch.add_metric([tenant, agent, "miss"], t.tier_loads)
        yield from (requests, tokens, generated, prefetch)
        yield CounterMetricFamily("kvbaton_events_dropped", "Engine events lost to the bounded ring before a "
                                  "scrape read them (per-agent counters miss them)", value=dropped)


class PoolCollector:
    """Pool usage and the engine's own reuse counters, read at scrape time."""

    def __init__(self, stats: Callable[[], Stats]) -> None:
        self._stats = stats

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        s = self._stats()
        blocks = GaugeMetricFamily("kvbaton_pool_blocks", "KV pool blocks by state", labels=["state"])
        for state, value in (("total", s.blocks_total), ("used", s.blocks_used), ("free", s.blocks_free),
                             ("shared", s.blocks_shared)):
            blocks.add_metric([state], value)
        yield blocks
        nbytes = GaugeMetricFamily("kvbaton_pool_bytes", "KV pool bytes by state", labels=["state"])
        for state, value in (("total", s.pool_bytes_total), ("used", s.pool_bytes_used), ("free", s.pool_bytes_free)):
            nbytes.add_metric([state], value)
        yield nbytes
        yield GaugeMetricFamily("kvbaton_handles_live", "Live handles in the engine", value=s.handles_live)
        if s.cache is not None:  # the prefix cache's blocks per slow tier, in bytes
            tiers = GaugeMetricFamily("kvbaton_tier_bytes", "Prefix-cache bytes held per slow tier", labels=["tier"])
            for tier, nodes in s.cache.nodes_per_tier.items():
                tiers.add_metric([tier], nodes * s.bytes_per_block)
            yield tiers
        tokens = CounterMetricFamily(
            "kvbaton_engine_tokens", "Engine token counters: prompt tokens reused exactly, reused approximately "
            "(reuse='auto'/'rotate'), prefilled, generated",
            labels=["kind"],
        )
        for kind, value in (("reused", s.tokens_reused - s.tokens_approximate), ("approximate", s.tokens_approximate),
                            ("prefilled", s.tokens_prefilled), ("generated", s.tokens_generated)):
            tokens.add_metric([kind], value)
        yield tokens
        if s.audit is not None:  # the sampled fidelity check of approximate answers (backend/audit.py)
            checks = CounterMetricFamily(
                "kvbaton_audit_checks", "Approximate answers re-checked against dense prefill, by outcome",
                labels=["outcome"],
            )
            checks.add_metric(["agreed"], s.audit.agreed)
            checks.add_metric(["disagreed"], s.audit.checked - s.audit.agreed)
            checks.add_metric(["dropped"], s.audit.dropped)
            yield checks
            yield GaugeMetricFamily(
                "kvbaton_audit_agreement", "First-token agreement of checked approximate answers with dense prefill",
                value=s.audit.agreed / s.audit.checked if s.audit.checked else 1.0,
            )
