"""Per-agent stats stay bounded whatever the traffic: a TTFT window per agent, a bounded agent table."""

from __future__ import annotations

import pytest
from kvbaton import SamplingParams
from kvbaton.backend.runtime.counters import MAX_AGENTS, TTFT_WINDOW, AgentLatencies


@pytest.mark.unit
def test_agent_latencies_keep_a_window_per_agent_and_the_most_recent_agents():
    lat = AgentLatencies(window=4, max_agents=3)
    for i in range(10):
        lat.record("a", float(i))
    summary = lat.summary()["a"]
    assert summary.requests == 10  # every request counted...
    assert summary.ttft_mean_s == (6 + 7 + 8 + 9) / 4 and summary.ttft_p90_s == 9  # ...the last 4 measured
    for name in "bcd":
        lat.record(name, 1.0)
    assert list(lat.summary()) == ["b", "c", "d"]  # "a", least recently seen, went first
    lat.record("b", 2.0)
    lat.record("e", 3.0)
    assert list(lat.summary()) == ["d", "b", "e"]


@pytest.mark.unit
def test_four_thousand_agent_names_cost_a_bounded_table():
    lat = AgentLatencies()
    for i in range(4000):
        for _ in range(3):
            lat.record(f"agent-{i}", 0.01)
    for _ in range(3 * TTFT_WINDOW):
        lat.record("busy", 0.02)
    assert len(lat) == MAX_AGENTS == 1024
    summary = lat.summary()
    assert "agent-0" not in summary and "agent-3999" in summary
    assert summary["busy"].requests == 3 * TTFT_WINDOW and summary["busy"].ttft_mean_s == pytest.approx(0.02)


def test_engine_stats_list_only_the_most_recent_agents(engine):
    engine.requests.counters.ttft = AgentLatencies(window=2, max_agents=2)
    for agent in ["a", "b", "c", "a"]:
        engine.release(engine.complete("Hello there", SamplingParams(max_tokens=1), agent=agent).handle)
    agents = engine.stats().agents
    assert list(agents) == ["c", "a"] and agents["a"].requests == 1  # re-admitted after it was dropped
