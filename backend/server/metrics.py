"""Prometheus metrics of the server: request counts and durations, time to first token, prompt
tokens by source (reused exactly, reused approximately, prefilled), generated tokens, and the engine's pool and reuse counters.

Per agent (``AgentCollector``): requests, prompt tokens by source, generated tokens, prefetch hits
and misses, labelled ``tenant`` (the salted tenant id, never a token) and ``agent``, read from the
engine's event ring at scrape time.

Per tenant (``TenantUsageCollector``): each tenant's live handles and their tokens, requests running
and waiting for a slot, open streams and registered agents.

Two views: the whole registry (``exposition``: every tenant, the pool, the engine) for a server
without tokens or an admin token; a tenant's own view (``tenant_exposition``) for its token: its
requests and generations (the same ``kvbaton_requests``, ``kvbaton_request_duration_seconds``,
``kvbaton_ttft_seconds``, ``kvbaton_prompt_tokens`` and ``kvbaton_generated_tokens`` series, counted
for it alone), its own agents' counters and its own usage, and nothing of the other tenants, the shared
pool or the engine's totals, from which their activity could be read.

Invariants: label values are bounded (route templates, never raw paths; never a token; at most
``max_agents`` agent labels, later agents count as ``other``; tenants are the server's tokens); the
pool gauges are read from the engine at scrape time (``PoolCollector``), never cached.
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvbaton.types import Events, Result, Stats
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

CONTENT_TYPE = CONTENT_TYPE_LATEST
MAX_AGENT_LABELS = 32
OTHER = "other"
SINGLE = "default"  # the tenant label of a single-tenant server


class Metrics:
    """The registry of one app, with the metrics the middleware and the generation endpoints record."""

    def __init__(self, stats: Callable[[], Stats], events: Callable[[int], Events] | None = None,
                 tenant_of: Callable[[str], tuple[str, str]] | None = None, max_agents: int = MAX_AGENT_LABELS,
                 usage: Callable[[], Mapping[str, Mapping[str, int]]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Every request metric twice: in the whole registry, and per tenant for the tenants' own views
        # (labelled ``tenant``, which a tenant's view drops: the same series names as the whole's).
        self._by_tenant = CollectorRegistry(auto_describe=True)
        self.requests, self._tenant_requests = self._twins(
            Counter, "kvbaton_requests", "HTTP requests by endpoint, method and status", ["endpoint", "method", "status"])
        self.duration, self._tenant_duration = self._twins(
            Histogram, "kvbaton_request_duration_seconds", "HTTP request duration (streams: until the last byte)",
            ["endpoint"], buckets=_DURATION_BUCKETS)
        self.ttft, self._tenant_ttft = self._twins(
            Histogram, "kvbaton_ttft_seconds", "Time to first token of generation requests, measured in the engine",
            ["endpoint"], buckets=(0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30))
        self.prompt_tokens, self._tenant_prompt_tokens = self._twins(
            Counter, "kvbaton_prompt_tokens", "Prompt tokens of generation requests: reused exactly (from a handle or "
            "the prefix cache), reused approximately (spans placed behind another prefix), or prefilled",
            ["endpoint", "source"])
        self.generated_tokens, self._tenant_generated_tokens = self._twins(
            Counter, "kvbaton_generated_tokens", "Generated tokens", ["endpoint"])
        self._agents: AgentCollector | None = None
        self._usage: TenantUsageCollector | None = None
        self.registry.register(PoolCollector(stats))
        if events is not None:
            self._agents = AgentCollector(events, tenant_of or (lambda name: (SINGLE, name)), max_agents)
            self.registry.register(self._agents)
        if usage is not None:
            self._usage = TenantUsageCollector(usage)
            self.registry.register(self._usage)

    def _twins(self, kind: type[Any], name: str, text: str, labels: list[str], **options: Any) -> tuple[Any, Any]:
        return (kind(name, text, labels, registry=self.registry, **options),
                kind(name, text, ["tenant", *labels], registry=self._by_tenant, **options))

    def answered(self, tenant: str | None, endpoint: str, method: str, status: int, seconds: float) -> None:
        """One HTTP request answered (``tenant``: whose, None when it had none: unauthenticated)."""
        self.requests.labels(endpoint, method, str(status)).inc()
        self.duration.labels(endpoint).observe(seconds)
        if tenant is not None:
            self._tenant_requests.labels(tenant, endpoint, method, str(status)).inc()
            self._tenant_duration.labels(tenant, endpoint).observe(seconds)

    def observe(self, tenant: str, endpoint: str, result: Result) -> None:
        """One generation's result, of ``tenant``'s request to ``endpoint``."""
        t = result.timings
        sources = {"reused": t.tokens_reused - t.tokens_approximate, "approximate": t.tokens_approximate,
                   "prefilled": t.tokens_prefilled}
        for labels, ttft, prompt, generated in (
            ((endpoint,), self.ttft, self.prompt_tokens, self.generated_tokens),
            ((tenant, endpoint), self._tenant_ttft, self._tenant_prompt_tokens, self._tenant_generated_tokens),
        ):
            ttft.labels(*labels).observe(t.ttft_s)
            for source, tokens in sources.items():
                prompt.labels(*labels, source).inc(tokens)
            generated.labels(*labels).inc(t.tokens_generated)

    def exposition(self) -> bytes:
        """Every metric in the text format (reads the engine's stats: call it off the event loop)."""
        return generate_latest(self.registry)

    def tenant_exposition(self, tenant: str) -> bytes:
        """The tenant's own metrics in the text format (see the module docstring)."""
        return generate_latest(_TenantView(self, tenant))


_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _TenantView:
    """What one tenant's ``/metrics`` shows: the families of its own series only."""

    def __init__(self, metrics: Metrics, tenant: str) -> None:
        self._metrics, self._tenant = metrics, tenant

    def collect(self) -> Iterable[Any]:
        m = self._metrics
        for family in m._by_tenant.collect():  # its requests, the tenant label dropped: the same series names
            yield _only(family, self._tenant, drop_label=True)
        if m._agents is not None:
            yield from (_only(f, self._tenant) for f in m._agents.collect() if f.name != "kvbaton_events_dropped")
        if m._usage is not None:
            yield from (_only(f, self._tenant) for f in m._usage.collect())


def _only(family: Metric, tenant: str, drop_label: bool = False) -> Metric:
    """``family`` with the samples of ``tenant`` alone."""
    out = Metric(family.name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        if sample.labels.get("tenant") == tenant:
            labels = {k: v for k, v in sample.labels.items() if k != "tenant"} if drop_label else sample.labels
            out.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
    return out


class TenantUsageCollector:
    """What each tenant holds now, read at scrape time: ``usage()`` is ``{tenant: {gauge: value}}``
    with the gauges of :data:`TENANT_GAUGES`."""

    def __init__(self, usage: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
        self._usage = usage

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        usage = self._usage()
        for name, text in TENANT_GAUGES.items():
            gauge = GaugeMetricFamily(f"kvbaton_tenant_{name}", text, labels=["tenant"])
            for tenant, values in sorted(usage.items()):
                gauge.add_metric([tenant], values.get(name, 0))
            yield gauge


TENANT_GAUGES = {
    "handles_live": "Live handles the tenant holds",
    "handle_tokens": "Tokens of the tenant's live handles (forks counted in full)",
    "requests_running": "The tenant's requests holding a request slot",
    "requests_waiting": "The tenant's requests waiting for a request slot",
    "streams_open": "The tenant's open streams (generation and event streams)",
    "agents_registered": "Agents the tenant registered (POST /v1/kv/agents)",
}


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
        # Per label: requests, prompt tokens reused / approximate / prefilled, generated tokens, prefetch hits
        # and tier loads (blocks a request had to wait for from a slow tier: prefetch misses).
        self._totals: dict[tuple[str, str], Tally[str]] = {}
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
                self._totals.setdefault(self._label(e.agent), Tally()).update(
                    requests=1, reused=e.tokens_reused - e.tokens_approximate, approximate=e.tokens_approximate,
                    prefilled=e.tokens_prefilled, generated=e.tokens_generated, prefetch_hits=e.prefetch_hits,
                    tier_loads=sum(n for tier, n in e.blocks_loaded.items() if tier != "device"),
                )
            if page.next == self._cursor or not page.events:
                return
            self._cursor = page.next

    def collect(self) -> Iterable[Any]:
        with self._lock:
            self._read()
            totals = {k: Tally(v) for k, v in self._totals.items()}
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
            requests.add_metric([tenant, agent], t["requests"])
            for source in ("reused", "approximate", "prefilled"):
                tokens.add_metric([tenant, agent, source], t[source])
            generated.add_metric([tenant, agent], t["generated"])
            prefetch.add_metric([tenant, agent, "hit"], t["prefetch_hits"])
            prefetch.add_metric([tenant, agent, "miss"], t["tier_loads"])
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
        if s.audit is not None:  # the sampled fidelity check of approximate answers (backend/reuse/audit.py)
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
