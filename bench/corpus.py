"""Deterministic, varied English text for benchmarks, demos and tests (no downloads)."""

from __future__ import annotations

import random

_TEAMS = ["platform", "payments", "search", "mobile", "data", "security", "support", "infrastructure"]
_PEOPLE = ["Amara", "Bjorn", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ines", "Jonas", "Keiko", "Luis"]
_THINGS = [
    "the billing migration", "the new onboarding flow", "the search ranking model", "the data retention policy",
    "the incident review process", "the mobile release train", "the API rate limits", "the warehouse schema",
    "the on-call rotation", "the customer export tool", "the audit log pipeline", "the caching layer",
]
_VERBS = ["reviewed", "proposed changes to", "raised concerns about", "shipped", "postponed", "benchmarked", "documented"]
_FINDINGS = [
    "latency at the 99th percentile rose by {n} milliseconds after the last deploy",
    "error rates stayed below {n} per million requests for the whole week",
    "the backlog shrank from {m} to {n} open tickets",
    "storage costs grew by {n} percent compared with last quarter",
    "{n} customers asked for the feature during the beta",
    "the test suite now runs in {n} minutes instead of {m}",
    "peak traffic reached {m} requests per second on Tuesday",
]
_DECISIONS = [
    "The group agreed to revisit the topic at the next meeting.",
    "A follow-up document will be written before any code changes.",
    "The owners will run a small experiment first and report back.",
    "Nobody objected, so the plan goes ahead as proposed.",
    "The decision was deferred until the security review is complete.",
]


def document(num_words: int, seed: int = 0) -> str:
    """Meeting notes of roughly ``num_words`` words (about 1.3 tokens per word for SmolLM2)."""
    rng = random.Random(seed)
    parts: list[str] = []
    words = 0
    day = 1
    while words < num_words:
        team, person = rng.choice(_TEAMS), rng.choice(_PEOPLE)
        thing = rng.choice(_THINGS)
        finding = rng.choice(_FINDINGS).format(n=rng.randint(2, 90), m=rng.randint(100, 900))
        paragraph = (
            f"Day {day}, {team} team. {person} {rng.choice(_VERBS)} {thing}. "
            f"They noted that {finding}. {rng.choice(_PEOPLE)} asked how this affects {rng.choice(_THINGS)}. "
            f"{rng.choice(_DECISIONS)}\n"
        )
        parts.append(paragraph)
        words += len(paragraph.split())
        day += 1
    return "".join(parts)


QUESTIONS = [
    "Which team reported the highest error rate, and what did they decide?",
    "Summarize the three most important decisions in one sentence each.",
    "Who raised concerns, and about what?",
    "What happened to the backlog over the period?",
    "List two risks mentioned in the notes.",
    "Which topics were postponed?",
]
