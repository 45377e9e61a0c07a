"""The request counters an engine keeps for ``Stats``: tokens by source, and the TTFTs per agent.

A leaf module: the lifecycle counts into :class:`RequestCounters`, :mod:`..stats` reads them, and
neither imports the other.

:class:`AgentLatencies` (the TTFTs per agent) is bounded whatever the traffic: the last
:data:`TTFT_WINDOW` samples of each of the :data:`MAX_AGENTS` most recently seen agents, so a stream
of fresh agent names cannot grow the engine's memory or the stats it builds.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvbaton.types import AgentStats

TTFT_WINDOW = 1024  # samples per agent behind ttft_mean_s and ttft_p90_s
MAX_AGENTS = 1024  # agents with stats; the least recently seen goes first


@dataclass
class _Agent:
    requests: int = 0
    ttft: deque[float] = field(default_factory=deque)


class AgentLatencies:
    """Time to first token per agent: a sliding window per agent, a bounded set of agents (LRU)."""

    def __init__(self, window: int = TTFT_WINDOW, max_agents: int = MAX_AGENTS) -> None:
        self.window = window
        self.max_agents = max_agents
        self._agents: OrderedDict[str, _Agent] = OrderedDict()

    def record(self, agent: str, ttft: float) -> None:
        entry = self._agents.get(agent)
        if entry is None:
            entry = self._agents[agent] = _Agent(ttft=deque(maxlen=self.window))
            if len(self._agents) > self.max_agents:
                self._agents.popitem(last=False)
        else:
            self._agents.move_to_end(agent)
        entry.requests += 1
        entry.ttft.append(ttft)

    def __len__(self) -> int:
        return len(self._agents)

    def summary(self) -> dict[str, AgentStats]:
        """Per agent: requests since it was last (re)admitted to the table, TTFT mean and p90 of the window."""
        return {
            name: AgentStats(requests=a.requests, ttft_mean_s=sum(a.ttft) / len(a.ttft), ttft_p90_s=_p90(a.ttft))
            for name, a in self._agents.items()
        }


@dataclass
class RequestCounters:
    """Tokens served, for ``Stats`` (its field names): of the prompts, reused from the prefix cache or a
    handle (``tokens_approximate`` of them placed behind another prefix) or prefilled (``tokens_recomputed`` of
    them found in other agents' K/V); generated. Guarded by the engine lock."""

    ttft: AgentLatencies = field(default_factory=AgentLatencies)  # bounded: see AgentLatencies
    tokens_reused: int = 0
    tokens_prefilled: int = 0
    tokens_approximate: int = 0
    tokens_discarded: int = 0
    tokens_recomputed: int = 0
    tokens_generated: int = 0

    def prompt(self, reused: int, prompt_len: int, approximate: int = 0, discarded: int = 0,
               recomputed: int = 0) -> None:
        """A prompt of ``prompt_len`` tokens was filled: ``reused`` of them (``approximate`` of those
        approximately), the rest prefilled (``recomputed`` of those found in other agents' K/V and computed
        anyway); ``discarded``: work the confidence gate threw away."""
        self.tokens_reused += reused
        self.tokens_prefilled += prompt_len - reused
        self.tokens_approximate += approximate
        self.tokens_discarded += discarded
        self.tokens_recomputed += recomputed


def _p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
