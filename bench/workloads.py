"""Persona-first multi-agent workloads: plain data and prompt builders, engine-agnostic.

Every agent puts ITS OWN system prompt first (a persona of 40-80 tokens, distinct per agent) and the
shared context after it, in the user message::

    [{"role": "system", "content": persona},
     {"role": "user", "content": document + "\\n\\n" + header + "\\n" + earlier outputs + "\\n\\n" + instruction}]

so the shared document never sits at the same position, behind the same tokens, in two agents'
prompts: exact prefix caching can reuse an agent's own earlier turns but not another agent's reading
of the document. The workloads:

- ``debate``: 3 debaters + a judge over a ~2300-token document, 3 rounds; the judge speaks after the
  three debaters every round (12 turns); every turn sees the whole transcript so far.
- ``chain``: reader -> reviewer -> editor over a ~1000-token document, 2 rounds (6 turns); each turn
  sees every earlier output.
- ``fanout``: a planner reads a ~1000-token document, 4 specialists each get the document, the
  planner's output and their own task, then a join agent gets the document and the 4 outputs (6 turns).
- ``mapreduce``: a map-reduce over one ~2000-token document, as a LangGraph ``Send`` fan-out runs it:
  4 summarizer turns (one agent, one persona) each read one part of the document, then a reducer
  reads the whole document and the 4 summaries (5 turns): the reducer's document is stitched from 4
  spans read behind 4 other contexts.
- ``debate_released``: ``debate`` written the way the README's first example is, every turn's result
  handle released as soon as the turn is done (``Workload.release``): what is reused then is only what
  the prefix cache still holds.
- ``debate_openai``: ``debate`` through ``kvbaton serve`` with the OpenAI client, the server managing the
  handles (each agent's latest retained in the run's session) (``Workload.via == "openai"``).
- ``mapreduce_langgraph``: ``mapreduce`` as a LangGraph app (a ``Send`` fan-out into a reducer) whose nodes
  call an unchanged ``ChatOpenAI``, wrapped with ``wrap(app)`` against ``kvbaton serve``
  (``Workload.via == "langgraph"``).

The turn loop :func:`run_workload` takes ``generate_fn(agent_name, messages) -> text``, so the same
loop drives kvbaton (``python -m kvbaton.bench agents``) and another engine (the `vllm` variant, through its OpenAI server).
With ``teacher=`` (the outputs of a reference run) every turn gets the reference run's prompt instead
of one built from this run's own outputs: a teacher-forced pass.

Everything is deterministic (documents from :mod:`kvbaton.bench.corpus` with fixed seeds). This module
imports neither torch nor kvbaton's package: scripts load it by file path
(``importlib.util.spec_from_file_location``) in another engine's environment. It cannot tokenize, so
documents are sized in estimated tokens (``TOKENS_PER_WORD`` of the default model's tokenizer on this
corpus); the benchmark records the real token counts.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:  # as kvbaton.bench.workloads
    from .corpus import document as _corpus_document
except ImportError:  # loaded by file path, outside the package (another engine's venv)
    _spec = importlib.util.spec_from_file_location("_kvbaton_bench_corpus", Path(__file__).with_name("corpus.py"))
    assert _spec is not None and _spec.loader is not None
    _corpus = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_corpus)
    _corpus_document = _corpus.document

Messages = list[dict[str, str]]
GenerateFn = Callable[[str, Messages], str]

# SmolLM2's tokenizer on kvbaton.bench.corpus text: about 1.36 tokens per whitespace-separated word.
TOKENS_PER_WORD = 1.36
DEBATE_TOKENS = 2300
DOC_TOKENS = 1000
MAPREDUCE_TOKENS = 2000
MAX_TOKENS = 32  # generated per turn, greedy, EOS ignored (every turn generates exactly this many)
# The warm-up request every engine runs once before anything is measured. About 2.4K tokens: as long
# as a debate turn's cold prompt, so the first timed prefill does not pay one-time costs that only
# long forwards meet (oneDNN primitives for a full 2048-row chunk, first touch of large buffers).
WARMUP_PROMPT = "Warm-up: " + "kvbaton " * 600
QUICK_WARMUP_PROMPT = "Warm-up: " + "kvbaton " * 60  # --quick (tests): about 250 tokens


def warmup_prompt(quick: bool) -> str:
    return QUICK_WARMUP_PROMPT if quick else WARMUP_PROMPT
WARMUP_TOKENS = 2
NO_TURNS_YET = "(nothing yet)"


@dataclass(frozen=True)
class Agent:
    name: str  # the agent tag (kvbaton's agent=; at most 64 characters)
    title: str  # how its lines are labelled in the others' prompts
    persona: str  # its system prompt: first in every one of its prompts


@dataclass(frozen=True)
class Turn:
    agent: str
    instruction: str
    sees: tuple[int, ...]  # indices of the earlier turns whose outputs this turn's prompt quotes
    header: str  # the line above those outputs
    part: int | None = None  # the part of the document this turn reads (None: the whole document)


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    document: str
    agents: dict[str, Agent]
    turns: tuple[Turn, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    parts: tuple[str, ...] = ()  # the document in parts, "\n".join(parts) == document (a turn reads one)
    release: bool = False  # each turn's result handle is released as soon as the turn is done
    via: str = "embedded"  # how kvbaton runs it: the embedded client, "openai" (kvbaton serve), "langgraph" (wrap)

    def context(self, index: int) -> str:
        """The document (or the part of it) turn ``index`` reads."""
        part = self.turns[index].part
        return self.document if part is None else self.parts[part]

    def messages(self, index: int, outputs: Sequence[str]) -> Messages:
        """The chat messages of turn ``index``, given the outputs of the turns before it."""
        turn = self.turns[index]
        agent = self.agents[turn.agent]
        lines = [f"{self.agents[self.turns[j].agent].title}: {clean(outputs[j])}" for j in turn.sees]
        quoted = "\n".join(lines) if lines else NO_TURNS_YET
        user = f"{self.context(index)}\n\n{turn.header}\n{quoted}\n\n{turn.instruction}"
        return [{"role": "system", "content": agent.persona}, {"role": "user", "content": user}]


def clean(text: str) -> str:
    """An output as quoted in later prompts: whitespace collapsed to single spaces, one line."""
    return " ".join(text.split())


def document(target_tokens: int, seed: int) -> str:
    """Meeting notes of about ``target_tokens`` tokens (whole paragraphs, estimated; deterministic)."""
    paragraphs = _corpus_document(int(target_tokens / TOKENS_PER_WORD) + 200, seed=seed).splitlines(keepends=True)
    out: list[str] = []
    estimate = 0.0
    for paragraph in paragraphs:
        cost = len(paragraph.split()) * TOKENS_PER_WORD
        if out and estimate + cost / 2 > target_tokens:
            break
        out.append(paragraph)
        estimate += cost
    return "".join(out).rstrip("\n")


# -- the agents ------------------------------------------------------------------------------------

DEBATE_AGENTS = {
    a.name: a for a in (
        Agent("advocate", "Advocate",
              "You are the Advocate in a structured debate. You argue that the company should pause new feature "
              "work next quarter and spend it on reliability. You cite concrete facts from the meeting notes, "
              "answer the other speakers directly, and never repeat an argument already made."),
        Agent("critic", "Critic",
              "You are the Critic in a structured debate. You argue against pausing feature work: customers, "
              "revenue and momentum matter more than a quiet on-call rotation. You attack weak evidence, point "
              "out what the notes do not say, and keep every reply short and pointed."),
        Agent("analyst", "Analyst",
              "You are the Analyst, a neutral data person in the debate. You only speak in numbers taken from "
              "the meeting notes: latency, error rates, backlog sizes and costs. You say which side the data "
              "supports and how confident you are, in plain words."),
        Agent("judge", "Judge",
              "You are the Judge of the debate. You have read the same meeting notes as the speakers. After each "
              "round you decide who argued best, naming the strongest and the weakest point made, and you keep "
              "a running score. You are fair, brief and decisive."),
    )
}
CHAIN_AGENTS = {
    a.name: a for a in (
        Agent("reader", "Reader",
              "You are the Reader on a documentation team. You read internal meeting notes carefully and extract "
              "the facts that matter: who did what, which numbers changed, and what was decided. You write short "
              "factual bullet points and never add opinions."),
        Agent("reviewer", "Reviewer",
              "You are the Reviewer on a documentation team. You compare a colleague's summary with the original "
              "meeting notes, line by line. You flag every wrong number, missing decision or invented claim, and "
              "you say exactly how to fix each one."),
        Agent("editor", "Editor",
              "You are the Editor on a documentation team. You turn a draft summary and the reviewer's comments "
              "into the final text that leadership will read: plain language, correct numbers, no jargon, and "
              "at most three sentences."),
    )
}
SPECIALIST_AREAS = {
    "security": "security and compliance risks",
    "cost": "cost and budget impact",
    "reliability": "reliability and incident risk",
    "schedule": "schedule and staffing risks",
}
FANOUT_AGENTS = {
    a.name: a for a in (
        Agent("planner", "Planner",
              "You are the Planner of an analysis team. You read the meeting notes once and split the review "
              "into independent tasks for four specialists: security, cost, reliability and schedule. For each "
              "task you name the paragraphs and numbers the specialist should look at first."),
        Agent("security", "Security specialist",
              "You are the Security specialist. You look for access, audit, data retention and compliance "
              "problems in engineering notes. You rate each problem low, medium or high and propose one "
              "concrete mitigation, without speculating beyond the text."),
        Agent("cost", "Cost specialist",
              "You are the Cost specialist, a finance partner to engineering. You translate what the notes say "
              "into money: storage growth, infrastructure spend, staff time and delays. You give rough figures "
              "and say which assumption each one rests on."),
        Agent("reliability", "Reliability specialist",
              "You are the Reliability specialist, a senior site reliability engineer. You read notes for signs "
              "of outages to come: rising latency, error rates, postponed reviews and tired on-call staff. You "
              "rank the risks and name an owner for each."),
        Agent("schedule", "Schedule specialist",
              "You are the Schedule specialist, a program manager. You track dates, dependencies and who is "
              "overloaded. From the notes you list what could slip, why it could slip, and which team is on the "
              "critical path for the next release."),
        Agent("synthesizer", "Synthesizer",
              "You are the Synthesizer who reports to the vice president of engineering. You merge the "
              "specialists' findings into a single recommendation: the top three risks, one action for each, "
              "and a yes or no on shipping the next release on time."),
    )
}
MAPREDUCE_AGENTS = {
    a.name: a for a in (
        Agent("summarizer", "Summary",
              "You are a Summarizer on a research team. You get one part of a longer set of meeting notes and "
              "write what that part says that matters: decisions, numbers and owners. You never guess what the "
              "other parts say."),
        Agent("reducer", "Reducer",
              "You are the Reducer who writes the team's final digest. You read the whole meeting notes and the "
              "summaries your colleagues wrote of its parts, keep what is right, fix what is wrong, and merge "
              "them into one short digest for the managers."),
    )
}
ALL_AGENTS = {**DEBATE_AGENTS, **CHAIN_AGENTS, **FANOUT_AGENTS, **MAPREDUCE_AGENTS}


# -- the workloads ---------------------------------------------------------------------------------


def debate(seed: int = 0, doc_tokens: int = DEBATE_TOKENS, rounds: int = 3) -> Workload:
    """3 debaters + a judge, ``rounds`` rounds; every turn quotes the whole transcript so far."""
    order = ["advocate", "critic", "analyst", "judge"]
    turns: list[Turn] = []
    for r in range(1, rounds + 1):
        for name in order:
            instruction = (
                f"Round {r} of {rounds}: judge this round. Who argued best, and why? Answer in two sentences."
                if name == "judge" else
                f"Round {r} of {rounds}: give your argument in two sentences, answering the transcript so far."
            )
            turns.append(Turn(name, instruction, tuple(range(len(turns))), "Transcript so far:"))
    return Workload("debate", seed, document(doc_tokens, seed=2300 + seed), DEBATE_AGENTS, tuple(turns),
                    {"rounds": rounds, "doc_tokens_target": doc_tokens})


def chain(seed: int = 0, doc_tokens: int = DOC_TOKENS, rounds: int = 2) -> Workload:
    """reader -> reviewer -> editor, ``rounds`` rounds; each turn quotes every earlier output."""
    steps = {
        "reader": ("Summarize the key facts of the notes in three short bullet points.",
                   "Add the most important fact the current summary still misses, as one bullet point."),
        "reviewer": ("Review the reader's summary against the notes: list every error or omission.",
                     "Check the editor's text against the notes: is anything still wrong or missing?"),
        "editor": ("Write the final summary, fixing what the reviewer found, in at most three sentences.",
                   "Write the improved final summary, in at most three sentences."),
    }
    turns: list[Turn] = []
    for r in range(1, rounds + 1):
        for name, (first, later) in steps.items():
            turns.append(Turn(name, f"Round {r} of {rounds}. " + (first if r == 1 else later),
                              tuple(range(len(turns))), "Earlier outputs:"))
    return Workload("chain", seed, document(doc_tokens, seed=1000 + seed), CHAIN_AGENTS, tuple(turns),
                    {"rounds": rounds, "doc_tokens_target": doc_tokens})


def fanout(seed: int = 0, doc_tokens: int = DOC_TOKENS, specialists: int = 4) -> Workload:
    """planner -> ``specialists`` specialists (each: doc + plan + own task) -> join (doc + all findings)."""
    areas = list(SPECIALIST_AREAS)[:specialists]
    turns = [Turn("planner", "Write the plan: one line per specialist (" + ", ".join(areas) + ").", (),
                  "Earlier outputs:")]
    for area in areas:
        turns.append(Turn(area, f"Your task: assess the {SPECIALIST_AREAS[area]} in the notes, following the plan. "
                                "Answer in two sentences.", (0,), "The planner's plan:"))
    turns.append(Turn("synthesizer", "Combine the findings into one recommendation in three sentences.",
                      tuple(range(1, len(turns))), "The specialists' findings:"))
    agents = {name: FANOUT_AGENTS[name] for name in ["planner", *areas, "synthesizer"]}
    return Workload("fanout", seed, document(doc_tokens, seed=5000 + seed), agents, tuple(turns),
                    {"specialists": specialists, "doc_tokens_target": doc_tokens})


def mapreduce(seed: int = 0, doc_tokens: int = MAPREDUCE_TOKENS, parts: int = 4) -> Workload:
    """``parts`` summarizer turns, one per part of the document (a ``Send`` fan-out), then a reducer over the
    whole document and every summary."""
    doc = document(doc_tokens, seed=7000 + seed)
    pieces = split(doc, parts)
    turns = [Turn("summarizer", f"Summarize this part (part {i + 1} of {len(pieces)}) of the notes in two sentences.",
                  (), "Earlier outputs:", part=i) for i in range(len(pieces))]
    turns.append(Turn("reducer", "Merge the summaries into one digest of the whole notes, in three sentences.",
                      tuple(range(len(pieces))), "Summaries of its parts:"))
    return Workload("mapreduce", seed, doc, MAPREDUCE_AGENTS, tuple(turns),
                    {"parts": len(pieces), "doc_tokens_target": doc_tokens}, parts=pieces)


def debate_released(seed: int = 0, doc_tokens: int = DEBATE_TOKENS, rounds: int = 3) -> Workload:
    """``debate`` with every turn's result handle released as soon as the turn is done (the README's pattern)."""
    wl = debate(seed, doc_tokens, rounds)
    return Workload("debate_released", seed, wl.document, wl.agents, wl.turns, {**wl.meta, "release": True},
                    release=True)


def debate_openai(seed: int = 0, doc_tokens: int = DEBATE_TOKENS, rounds: int = 3) -> Workload:
    """``debate`` through ``kvbaton serve`` with the OpenAI client (the server keeps the handles)."""
    wl = debate(seed, doc_tokens, rounds)
    return Workload("debate_openai", seed, wl.document, wl.agents, wl.turns, {**wl.meta, "via": "openai"},
                    via="openai")


def mapreduce_langgraph(seed: int = 0, doc_tokens: int = MAPREDUCE_TOKENS, parts: int = 4) -> Workload:
    """``mapreduce`` as a LangGraph ``Send`` fan-out on an unchanged ``ChatOpenAI``, ``wrap(app)``-ed."""
    wl = mapreduce(seed, doc_tokens, parts)
    return Workload("mapreduce_langgraph", seed, wl.document, wl.agents, wl.turns, {**wl.meta, "via": "langgraph"},
                    parts=wl.parts, via="langgraph")


def split(doc: str, parts: int) -> tuple[str, ...]:
    """``doc`` in ``parts`` runs of whole lines of about equal length ("\n".join gives it back)."""
    lines = doc.split("\n")
    parts = max(1, min(parts, len(lines)))
    total = sum(len(line) + 1 for line in lines)
    out: list[list[str]] = [[]]
    done = 0
    for line in lines:
        if out[-1] and len(out) < parts and done >= total * len(out) / parts:
            out.append([])
        out[-1].append(line)
        done += len(line) + 1
    return tuple("\n".join(p) for p in out)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "debate": debate, "chain": chain, "fanout": fanout, "mapreduce": mapreduce, "debate_released": debate_released,
    "debate_openai": debate_openai, "mapreduce_langgraph": mapreduce_langgraph,
}
# The small sizes of a smoke run (--quick): same shapes, short documents, fewer turns.
QUICK_SIZES: dict[str, dict[str, int]] = {
    "debate": {"doc_tokens": 200, "rounds": 1},
    "chain": {"doc_tokens": 100, "rounds": 2},
    "fanout": {"doc_tokens": 120, "specialists": 2},
    "mapreduce": {"doc_tokens": 200, "parts": 2},
    "debate_released": {"doc_tokens": 200, "rounds": 1},
    "debate_openai": {"doc_tokens": 200, "rounds": 1},
    "mapreduce_langgraph": {"doc_tokens": 200, "parts": 2},
}


def build(name: str, seed: int = 0, quick: bool = False) -> Workload:
    """Workload ``name`` with document ``seed``, at the default sizes or the smoke-run ones."""
    return WORKLOADS[name](seed, **(QUICK_SIZES[name] if quick else {}))


@dataclass
class TurnOutput:
    index: int
    agent: str
    messages: Messages
    text: str


def run_workload(workload: Workload, generate_fn: GenerateFn, teacher: Sequence[str] | None = None) -> list[TurnOutput]:
    """Run every turn in order: ``generate_fn(agent, messages) -> text``.

    Free-running (``teacher=None``), each prompt quotes this run's own earlier outputs. Teacher-forced,
    each prompt quotes ``teacher`` (a reference run's outputs), so turn ``i`` gets exactly the reference
    run's prompt whatever this run generated before it.
    """
    if teacher is not None and len(teacher) != len(workload.turns):
        raise ValueError(f"teacher has {len(teacher)} outputs for {len(workload.turns)} turns")
    outputs: list[str] = []
    done: list[TurnOutput] = []
    for index, turn in enumerate(workload.turns):
        messages = workload.messages(index, outputs if teacher is None else teacher)
        text = generate_fn(turn.agent, messages)
        outputs.append(text)
        done.append(TurnOutput(index, turn.agent, messages, text))
    return done
