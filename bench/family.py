"""A family of agent-workflow shapes that tests and benchmarks share: 60 persona-first workloads, generated.

Every shape is a :class:`~kvbaton.bench.workloads.Workload` (each agent's own system prompt first, the shared
document after it, in the user message) plus what the family adds: a split tag, the facts planted in its
document and the questions about them (:class:`Shape`). The shapes vary, one axis at a time and together:

- **topology** (``TOPOLOGIES``): ``debate`` (2-3 debaters and a judge, 1-2 rounds, each turn sees the whole
  transcript), ``pipeline`` (reader -> reviewer -> editor, 1-2 rounds), ``mapreduce`` (one summarizer per part
  of the document, then a reducer over the whole document), ``supervisor`` (a supervisor plans, 2-3 workers
  act on the plan, the supervisor judges their reports), ``reflection`` (an actor drafts, a critic critiques,
  the actor revises, 1-2 loops), ``fanout`` (a planner, 2-3 specialists, a synthesizer);
- **document kind** (:data:`~kvbaton.bench.family_docs.DOC_KINDS`: prose, tables, contracts, code, logs, chat
  transcripts) and length (``DOC_SIZES`` estimated tokens);
- **personas**: length (short, medium, long) and style (plain prose, a rule list, markdown, terse);
- **instruction kinds** (``INSTRUCTION_KINDS``): summarise, extract, judge, critique, answer a question, plan
  (and the debaters' argue);
- **results kept or released** (``Workload.release``: each turn's handle released as soon as it is done);
- **app** (``APPS``): ``plain`` (the embedded client, turn by turn), ``langgraph`` (a LangGraph app of
  ``KvbatonChatModel`` nodes under ``wrap(app)``, the embedded client; a map-reduce's parts as a ``Send``
  fan-out), ``autogen`` (a ``RoundRobinGroupChat`` of ``AssistantAgent``\\ s on ``KvbatonChatCompletionClient``:
  each agent's system message is its persona and instruction, the team's task is the document and the ask).

Every shape ends with 1-2 **question turns**: an agent that has not read the document yet (a clerk, a fact
checker) answers a question about one planted fact (a reference number, a name, a date); its answer is right
when it contains the fact (:meth:`~kvbaton.bench.family_docs.Question.check`). Those turns are the family's
question-answering set: the same question answered after dense prefill and with reuse.

**Splits.** Each shape is tagged ``"tune"`` or ``"report"`` (``Shape.split``), fixed by the family's seed,
half of each topology each way: a decision rule is tuned on one part and reported on the other.

Deterministic (every choice from a seeded ``random.Random``); imports neither torch nor kvbaton (loadable by
file path, as :mod:`kvbaton.bench.workloads` is). :func:`family` builds it; ``quick=True`` builds the same shapes
small (short documents, one round, fewer agents), for tests.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


def _sibling(name: str) -> object:
    """A sibling module of this one, whether loaded as ``kvbaton.bench.family`` or by file path."""
    if __package__:
        return importlib.import_module(f"{__package__}.{name}")
    key = f"_kvbaton_bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


_docs: object = _sibling("family_docs")
_wl: object = _sibling("workloads")
Agent = _wl.Agent  # type: ignore[attr-defined]
Turn = _wl.Turn  # type: ignore[attr-defined]
Workload = _wl.Workload  # type: ignore[attr-defined]
split_parts = _wl.split  # type: ignore[attr-defined]
Facts = _docs.Facts  # type: ignore[attr-defined]
Question = _docs.Question  # type: ignore[attr-defined]
DOC_KINDS: tuple[str, ...] = _docs.DOC_KINDS  # type: ignore[attr-defined]
PERSONA_STYLES: tuple[str, ...] = _docs.PERSONA_STYLES  # type: ignore[attr-defined]
PERSONA_LENGTHS: tuple[str, ...] = _docs.PERSONA_LENGTHS  # type: ignore[attr-defined]

TOPOLOGIES = ("debate", "pipeline", "mapreduce", "supervisor", "reflection", "fanout")
APPS = ("plain", "langgraph", "autogen")
SPLITS = ("tune", "report")
INSTRUCTION_KINDS = ("summarise", "extract", "judge", "critique", "answer", "plan", "argue", "revise")
FAMILY_SIZE = 60
DOC_SIZES = (300, 500, 700, 900, 1200)
QUICK_DOC_TOKENS = 120
# The blocks of six shapes (one per topology) whose shapes run as apps: LangGraph where the topology is a graph,
# AutoGen where it is a round-robin conversation.
LANGGRAPH_BLOCKS = {1: ("pipeline", "mapreduce", "supervisor", "fanout"), 5: ("pipeline", "mapreduce", "supervisor",
                    "fanout"), 8: ("pipeline", "mapreduce", "supervisor", "fanout")}
AUTOGEN_BLOCKS = {3: ("debate", "reflection", "pipeline"), 7: ("debate", "reflection", "pipeline"),
                  9: ("debate", "reflection")}

_NOUN = {"prose": "the notes", "table": "the order report", "contract": "the contract", "code": "the code",
         "logs": "the logs", "chat": "the chat"}
_MOTION = {"prose": "the team should pause feature work next quarter", "table": "the blocked orders are the biggest "
           "risk in the report", "contract": "the customer should sign this contract as it is", "code": "this module "
           "is ready for production", "logs": "the last deploy should be rolled back", "chat": "the release should "
           "slip by one week"}
_ASK = {
    "summarise": "Summarise {doc} in two sentences.",
    "extract": "List the three most important facts in {doc}: names, numbers and dates, one line each.",
    "judge": "Judge the earlier outputs against {doc}: which is most accurate, and why? Two sentences.",
    "critique": "Critique the earlier outputs: name one error or omission with respect to {doc}.",
    "plan": "Plan the next steps {doc} calls for, as three short numbered steps.",
    "argue": "Argue your side about whether {motion}, in two sentences, answering the transcript so far.",
    "revise": "Revise your draft to address the critique, in two sentences.",
}


@dataclass(frozen=True)
class Shape:
    """One workflow of the family: its workload (turns, agents, document), its tags and its questions."""

    name: str
    index: int
    split: str  # "tune" or "report"
    topology: str
    doc_kind: str
    app: str  # "plain", "langgraph" or "autogen"
    persona_style: str
    persona_length: str
    doc_tokens_target: int
    facts: Facts
    workload: Workload
    kinds: tuple[str, ...]  # the instruction kind of each turn
    questions: Mapping[int, Question] = field(default_factory=dict)  # turn index -> its question
    task: str = ""  # autogen: the team's task (the document, then what the team is asked)

    @property
    def release(self) -> bool:
        return bool(self.workload.release)

    def tags(self) -> dict[str, object]:
        """What the shape is, as the benchmark records it."""
        return {"split": self.split, "topology": self.topology, "doc_kind": self.doc_kind, "app": self.app,
                "persona_style": self.persona_style, "persona_length": self.persona_length,
                "doc_tokens_target": self.doc_tokens_target, "release": self.release,
                "turns": len(self.workload.turns), "agents": len(self.workload.agents),
                "questions": len(self.questions)}


class _Builder:
    """The agents and turns of one shape, as its topology adds them."""

    def __init__(self, rng: random.Random, kind: str, style: str, length: str, seed: int) -> None:
        self.rng, self.kind, self.style, self.length, self.seed = rng, kind, style, length, seed
        self.agents: dict[str, Agent] = {}
        self.turns: list[Turn] = []
        self.kinds: list[str] = []
        self.duties: dict[str, str] = {}

    def agent(self, name: str, title: str, duty: str) -> str:
        if name not in self.agents:
            text = _docs.persona(title, duty, self.style, self.length, self.seed)  # type: ignore[attr-defined]
            self.agents[name] = Agent(name, title, text)
            self.duties[name] = duty
        return name

    def turn(self, agent: str, kind: str, sees: Sequence[int], header: str, part: int | None = None,
             text: str | None = None) -> int:
        instruction = text or _ASK[kind].format(doc=_NOUN[self.kind], motion=_MOTION[self.kind])
        self.turns.append(Turn(agent, instruction, tuple(sees), header, part))
        self.kinds.append(kind)
        return len(self.turns) - 1

    def everything(self) -> tuple[int, ...]:
        return tuple(range(len(self.turns)))


def _debate(b: _Builder, small: bool) -> None:
    sides = [("proponent", "Proponent", f"argue that {_MOTION[b.kind]}"),
             ("opponent", "Opponent", f"argue against the claim that {_MOTION[b.kind]}"),
             ("analyst", "Analyst", "weigh both sides using only numbers from the document")]
    sides = sides[: 2 if small else b.rng.choice((2, 3))]
    judge = b.agent("judge", "Judge", "decide who argued best after each round")
    for _ in range(1 if small else b.rng.choice((1, 2))):
        for name, title, duty in sides:
            b.turn(b.agent(name, title, duty), "argue", b.everything(), "Transcript so far:")
        b.turn(judge, "judge", b.everything(), "Transcript so far:")


def _pipeline(b: _Builder, small: bool) -> None:
    stages = [("reader", "Reader", b.rng.choice(("summarise", "extract")), "read documents and report what matters"),
              ("reviewer", "Reviewer", b.rng.choice(("critique", "judge")), "check a colleague's report against the "
                                                                              "source"),
              ("editor", "Editor", b.rng.choice(("plan", "summarise")), "turn drafts into the final text")]
    for _ in range(1 if small else b.rng.choice((1, 2))):
        for name, title, kind, duty in stages:
            b.turn(b.agent(name, title, duty), kind, b.everything(), "Earlier outputs:")


def _mapreduce(b: _Builder, small: bool, parts: int) -> None:
    kind = b.rng.choice(("summarise", "extract"))
    summarizer = b.agent("summarizer", "Summarizer", "summarise one part of a longer document")
    for i in range(parts):
        b.turn(summarizer, kind, (), "Earlier outputs:", part=i,
               text=f"{_ASK[kind].format(doc=f'this part (part {i + 1} of {parts}) of {_NOUN[b.kind]}')}")
    reducer = b.agent("reducer", "Reducer", "merge summaries of parts into one digest of the whole document")
    b.turn(reducer, "summarise", b.everything(), "Summaries of its parts:")


def _supervisor(b: _Builder, small: bool) -> None:
    boss = b.agent("supervisor", "Supervisor", "plan the work, hand it to workers and judge their reports")
    b.turn(boss, "plan", (), "Earlier outputs:")
    workers = [("worker-facts", "Fact worker", "extract", "pull facts out of documents"),
               ("worker-risks", "Risk worker", "critique", "find risks and mistakes"),
               ("worker-brief", "Brief worker", "summarise", "write short briefs")]
    done = [b.turn(b.agent(name, title, duty), kind, (0,), "The supervisor's plan:")
            for name, title, kind, duty in workers[: 2 if small else b.rng.choice((2, 3))]]
    b.turn(boss, "judge", done, "The workers' reports:")


def _reflection(b: _Builder, small: bool) -> None:
    actor = b.agent("actor", "Drafter", "write drafts and improve them from feedback")
    critic = b.agent("critic", "Critic", "find what a draft gets wrong")
    b.turn(actor, b.rng.choice(("summarise", "plan")), (), "Earlier outputs:")
    for _ in range(1 if small else b.rng.choice((1, 2))):
        b.turn(critic, "critique", b.everything(), "The draft and the discussion so far:")
        b.turn(actor, "revise", b.everything(), "The draft and the discussion so far:")


def _fanout(b: _Builder, small: bool) -> None:
    planner = b.agent("planner", "Planner", "split a review into tasks for specialists")
    b.turn(planner, "plan", (), "Earlier outputs:")
    specialists = [("security", "Security specialist", "critique", "find security and compliance problems"),
                   ("cost", "Cost specialist", "extract", "find costs, amounts and budgets"),
                   ("schedule", "Schedule specialist", "extract", "find dates, deadlines and owners")]
    done = [b.turn(b.agent(name, title, duty), kind, (0,), "The planner's plan:")
            for name, title, kind, duty in specialists[: 2 if small else b.rng.choice((2, 3))]]
    synth = b.agent("synthesizer", "Synthesizer", "merge specialists' findings into one recommendation")
    b.turn(synth, "summarise", done, "The specialists' findings:")


def _questions(b: _Builder, facts: Facts, count: int) -> dict[int, Question]:
    """``count`` question turns by agents that have not read the document: the shape's question set."""
    asked = list(_docs.questions(b.kind, facts))  # type: ignore[attr-defined]
    b.rng.shuffle(asked)
    out = {}
    for (name, title), question in zip([("clerk", "Clerk"), ("checker", "Fact checker")], asked[:count]):
        agent = b.agent(name, title, "answer questions about a document with the exact value it states")
        out[b.turn(agent, "answer", (), "Earlier outputs:", text=question.text)] = question
    return out


def _app(index: int, topology: str) -> str:
    block = index // len(TOPOLOGIES)
    if topology in LANGGRAPH_BLOCKS.get(block, ()):
        return "langgraph"
    if topology in AUTOGEN_BLOCKS.get(block, ()):
        return "autogen"
    return "plain"


def shape(index: int, seed: int = 0, quick: bool = False, split: str = "tune") -> Shape:
    """Shape ``index`` of the family of ``seed`` (``split``: its tag, see :func:`splits`)."""
    topology = TOPOLOGIES[index % len(TOPOLOGIES)]
    block = index // len(TOPOLOGIES)
    kind = DOC_KINDS[(index + block) % len(DOC_KINDS)]  # each topology meets every kind within six blocks
    rng = random.Random(f"family:{seed}:{index}")
    style, length = rng.choice(PERSONA_STYLES), rng.choice(PERSONA_LENGTHS)
    size = rng.choice(DOC_SIZES)
    size = QUICK_DOC_TOKENS if quick else size  # drawn either way: the later draws stay the same
    app = _app(index, topology)
    release = app == "plain" and rng.random() < 0.4
    facts = _docs.facts(rng)  # type: ignore[attr-defined]
    doc = _docs.document(kind, size, seed * 1000 + index, facts)  # type: ignore[attr-defined]
    b = _Builder(rng, kind, style, length, seed * 1000 + index)
    parts: tuple[str, ...] = ()
    if topology == "mapreduce":
        parts = split_parts(doc, 2 if quick else rng.choice((3, 4)))
        _mapreduce(b, quick, len(parts))
    else:
        {"debate": _debate, "pipeline": _pipeline, "supervisor": _supervisor, "reflection": _reflection,
         "fanout": _fanout}[topology](b, quick)
    questions = _questions(b, facts, 1 if quick else rng.choice((1, 2)))
    name = f"{index:02d}-{topology}-{kind}-{app}{'-released' if release else ''}"
    task = ""
    turns = b.turns
    if app == "autogen":
        task, turns = _autogen(b, doc, topology)
        questions = {i: questions[q] for i, q in _requestions(b.turns, turns, questions).items()}
    workload = Workload(name, seed, doc, b.agents, tuple(turns),
                        {"doc_tokens_target": size, "topology": topology, "kind": kind, "app": app},
                        parts=parts, release=release)
    kinds = tuple(b.kinds[_origin(b.turns, t)] for t in turns)
    return Shape(name, index, split, topology, kind, app, style, length, size, facts, workload, kinds, questions,
                 task)


def _autogen(b: _Builder, doc: str, topology: str) -> tuple[str, list[Turn]]:
    """An AutoGen team runs round-robin: each agent speaks in the order of its first turn, once per round; its
    instruction goes into its system message (``system_message(shape, agent)``), the document into the task."""
    order = list(dict.fromkeys(t.agent for t in b.turns))
    rounds = min(max(sum(t.agent == order[0] for t in b.turns), 1), 2)
    asked = [t for t in b.turns if t.agent in ("clerk", "checker")]
    workers = [a for a in order if a not in ("clerk", "checker")]
    turns = []
    for _ in range(rounds):
        for agent in workers:
            first = next(t for t in b.turns if t.agent == agent)
            turns.append(Turn(agent, first.instruction, tuple(range(len(turns))), "", None))
    for t in asked:
        turns.append(Turn(t.agent, t.instruction, tuple(range(len(turns))), "", None))
    ask = _ASK["argue" if topology == "debate" else "summarise"].format(doc=_NOUN[b.kind], motion=_MOTION[b.kind])
    # the questions are in the task too: an AutoGen agent answers the conversation, not only its system message
    questions = " ".join(f"The {b.agents[t.agent].title} answers: {t.instruction}" for t in asked)
    return f"{doc}\n\nThe team's task: {ask} {questions}".rstrip(), turns


def _origin(built: Sequence[Turn], turn: Turn) -> int:
    """The index of the built turn ``turn`` stands for (the same agent and instruction)."""
    return next(i for i, t in enumerate(built) if t.agent == turn.agent and t.instruction == turn.instruction)


def _requestions(built: Sequence[Turn], turns: Sequence[Turn], questions: Mapping[int, Question]) -> dict[int, int]:
    """New turn index -> built turn index, for the question turns."""
    return {i: _origin(built, t) for i, t in enumerate(turns) if _origin(built, t) in questions}


def system_message(s: Shape, agent: str) -> str:
    """An AutoGen agent's system message: its persona, then its instruction (a team's agents get no other)."""
    first = next(t for t in s.workload.turns if t.agent == agent)
    return f"{s.workload.agents[agent].persona}\n\n{first.instruction}"


def splits(seed: int, size: int = FAMILY_SIZE) -> list[str]:
    """The split of each shape: per topology, its shapes shuffled by ``seed``, half ``tune`` and half ``report``."""
    out = ["tune"] * size
    for t in range(len(TOPOLOGIES)):
        members = list(range(t, size, len(TOPOLOGIES)))
        random.Random(f"split:{seed}:{t}").shuffle(members)
        for i in members[len(members) // 2:]:
            out[i] = "report"
    return out


def family(seed: int = 0, quick: bool = False, size: int = FAMILY_SIZE) -> list[Shape]:
    """The whole family of ``seed``: ``size`` shapes (``quick``: the same shapes, small)."""
    tags = splits(seed, size)
    return [shape(i, seed, quick, tags[i]) for i in range(size)]


# The --quick subset (indices): a LangGraph map-reduce (a Send fan-out), a plain debate whose results are released,
# an AutoGen reflection team.
QUICK_PICK = (8, 12, 22)


def select(shapes: Sequence[Shape], split: str = "all", names: Sequence[str] = (),
           quick: bool = False) -> list[Shape]:
    """The shapes of ``split`` ("tune", "report" or "all"), only those named (by name or index) if ``names``
    are given, only the quick subset with ``quick``."""
    if split not in (*SPLITS, "all"):
        raise ValueError(f"split must be tune, report or all, got {split!r}")
    chosen = [s for s in shapes if split in ("all", s.split)]
    if names:
        wanted = set(names)
        chosen = [s for s in chosen if s.name in wanted or str(s.index) in wanted or f"{s.index:02d}" in wanted]
    if quick:
        chosen = [s for s in chosen if s.index in QUICK_PICK]
    return chosen


def first_readers(s: Shape) -> dict[int, bool]:
    """For each turn: whether it reads its context (the document or its part) for its agent's first time after
    another agent read it — the turns where reusing another agent's K/V can save a prefill."""
    seen: dict[object, set[str]] = {}
    out = {}
    for i, t in enumerate(s.workload.turns):
        context = t.part if s.app != "autogen" else None
        readers = seen.setdefault(context, set())
        # the whole document contains every part: a reader of a part has read part of the whole
        others = readers | (set().union(*(v for k, v in seen.items() if k is not None)) if context is None else set())
        out[i] = t.agent not in readers and bool(others - {t.agent})
        readers.add(t.agent)
    return out


__all__ = ["APPS", "DOC_KINDS", "FAMILY_SIZE", "INSTRUCTION_KINDS", "QUICK_PICK", "SPLITS", "TOPOLOGIES", "Shape",
           "family", "first_readers", "select", "shape", "splits", "system_message"]
