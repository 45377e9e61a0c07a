"""Prometheus metrics of the server: request counts and durations, time to first token, prompt
tokens by source (reused exactly, reused approximately, prefilled), generated tokens, and the engine's pool and reuse counters.

Invariants: label values are bounded (route templates, never raw paths; no tenant or token); the
pool gauges are read from the engine at scrape time (``PoolCollector``), never cached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvbaton.types import Result, Stats
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The registry of one app, with the metrics the middleware and the generation endpoints record."""

    def __init__(self, stats: Callable[[], Stats]) -> None:
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
