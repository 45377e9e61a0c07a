"""The material of the workload family (:mod:`kvbaton.bench.family`): documents of six kinds with checkable
facts planted in them, and personas of several lengths and styles. Pure, deterministic, engine-agnostic.

Document kinds: ``prose`` (meeting notes), ``table`` (a markdown table of orders), ``contract`` (numbered
clauses), ``code`` (a Python module), ``logs`` (timestamped service logs), ``chat`` (a team chat transcript).
Every document carries one :class:`Facts` sheet (a reference number, a person's name, a date), each fact in a
sentence written in the kind's own voice, at a place fixed by the seed (start, middle or end), so a question
about it has one answer a string match can check (:func:`questions`).

Sizes are estimated (this module cannot tokenize): characters per token of SmolLM2's tokenizer per kind,
measured once on these generators (``CHARS_PER_TOKEN``); the benchmark records the real token counts.

Like :mod:`kvbaton.bench.workloads`, it imports neither torch nor kvbaton.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

DOC_KINDS = ("prose", "table", "contract", "code", "logs", "chat")
# SmolLM2's tokenizer on these generators' output (measured: tests/test_family.py checks the estimate).
CHARS_PER_TOKEN = {"prose": 4.17, "table": 2.06, "contract": 3.94, "code": 3.23, "logs": 2.45, "chat": 3.05}

FIRST = ["Amara", "Bjorn", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ines", "Jonas", "Keiko", "Luis",
         "Mirela", "Nikhil", "Oksana", "Pavel", "Quentin", "Rosa", "Sanjay", "Tove"]
LAST = ["Moreau", "Okafor", "Lindqvist", "Takahashi", "Herrera", "Novak", "Brennan", "Adeyemi", "Castillo",
        "Falk", "Iversen", "Kowalski", "Marchetti", "Nakamura", "Osei", "Petrov", "Quiroga", "Sorensen"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
TEAMS = ["platform", "payments", "search", "mobile", "data", "security", "support", "infrastructure"]
THINGS = ["the billing migration", "the onboarding flow", "the ranking model", "the retention policy",
          "the incident review", "the release train", "the rate limits", "the warehouse schema",
          "the on-call rotation", "the export tool", "the audit pipeline", "the caching layer"]
SERVICES = ["auth-gateway", "billing-worker", "search-api", "ledger-sync", "export-cron", "cache-proxy"]
PRODUCTS = ["router kit", "sensor pack", "license bundle", "storage node", "support plan", "gpu voucher"]


@dataclass(frozen=True)
class Facts:
    """What a document states once, and a question can ask: a reference number, a person, a date."""

    reference: str  # e.g. "HP-894179-H"
    person: str  # e.g. "Dalia Moreau"
    date: str  # e.g. "14 March 2023"


@dataclass(frozen=True)
class Question:
    """A question about a document and the string its right answer contains (``check``): a person's full name, a
    date, or a reference number's six digits."""

    text: str
    answer: str
    fact: str  # "reference", "person" or "date"

    def check(self, reply: str) -> bool:
        """Whether ``reply`` gives the answer: the answer's characters, case and spacing aside."""
        return _norm(self.answer) in _norm(reply)


def _norm(text: str) -> str:
    return " ".join(text.lower().replace("-", " - ").split())


def facts(rng: random.Random) -> Facts:
    letters = "ABCDEFGHJKLMNPRSTUVWXZ"
    reference = f"{rng.choice(letters)}{rng.choice(letters)}-{rng.randint(100000, 999999)}-{rng.choice(letters)}"
    return Facts(reference, f"{rng.choice(FIRST)} {rng.choice(LAST)}",
                 f"{rng.randint(2, 28)} {rng.choice(MONTHS)} {rng.randint(2019, 2025)}")


# How each kind states each fact, and what its question calls the person and the date.
_STATEMENTS = {
    "prose": ("The reference number of this review is {reference}.",
              "The review was chaired by {person}.", "The review took place on {date}."),
    "table": ("Report reference: {reference}.", "Prepared by: {person}.", "Report date: {date}."),
    "contract": ("Contract reference: {reference}.", "Signed for the supplier by {person}.",
                 "This agreement takes effect on {date}."),
    "code": ("# Ticket: {reference}", "# Maintainer: {person}", "# Last reviewed: {date}"),
    "logs": ("INFO incident reference {reference} opened", "INFO incident owner is {person}",
             "INFO incident date recorded as {date}"),
    "chat": ("{person}: the ticket for this is {reference}, please quote it.", "{person}: I will own this one.",
             "{person}: the deadline is {date}."),
}
_ROLES = {
    "prose": ("the review", "chaired the review", "did the review take place"),
    "table": ("the report", "prepared the report", "is the report dated"),
    "contract": ("the contract", "signed for the supplier", "does the agreement take effect"),
    "code": ("the module's ticket", "maintains the module", "was the module last reviewed"),
    "logs": ("the incident", "owns the incident", "was recorded as the incident date"),
    "chat": ("the ticket", "said they will own it", "is the deadline"),
}


def questions(kind: str, f: Facts) -> tuple[Question, Question, Question]:
    """One question per fact of a ``kind`` document, each answered by a string match."""
    thing, who, when = _ROLES[kind]
    return (
        # the reference's six digits are its unique part (a small model often drops the letters around them)
        Question(f"What is the reference number of {thing}? Reply with the reference number only.",
                 f.reference.split("-")[1], "reference"),
        Question(f"Who {who}? Reply with the full name only.", f.person, "person"),
        Question(f"On what date {when}? Reply with the date only." if kind != "logs" else
                 "What date was recorded as the incident date? Reply with the date only.", f.date, "date"),
    )


# -- the kinds: units of text (a paragraph, a row, a line) ------------------------------------------


def _prose(rng: random.Random, n: int) -> str:
    findings = ["latency at the 99th percentile rose by {a} milliseconds", "error rates stayed below {a} per million",
                "the backlog shrank from {b} to {a} open tickets", "storage costs grew by {a} percent",
                "{a} customers asked for the feature", "the test suite now runs in {a} minutes instead of {b}"]
    finding = rng.choice(findings).format(a=rng.randint(2, 90), b=rng.randint(100, 900))
    return (f"Item {n}, {rng.choice(TEAMS)} team. {rng.choice(FIRST)} reviewed {rng.choice(THINGS)} and noted that "
            f"{finding}. {rng.choice(FIRST)} asked how this affects {rng.choice(THINGS)}; the owners will report "
            f"back next week.")


def _row(rng: random.Random, n: int) -> str:
    status = rng.choice(["shipped", "pending", "blocked", "returned", "invoiced"])
    return (f"| {1000 + n} | {rng.choice(FIRST)} {rng.choice(LAST)} | {rng.choice(PRODUCTS)} | {rng.randint(1, 40)} | "
            f"{rng.randint(120, 9800)}.{rng.randint(0, 99):02d} | {status} |")


def _clause(rng: random.Random, n: int) -> str:
    topics = [("Payment", "The customer pays each invoice within {a} days of receipt; late amounts carry interest of "
                          "{b} percent per year."),
              ("Termination", "Either party may end this agreement with {a} days written notice; obligations "
                              "accrued before the end survive it."),
              ("Liability", "Neither party is liable for indirect losses; total liability is capped at {a} times the "
                            "fees paid in the {b} months before the claim."),
              ("Confidentiality", "Each party keeps the other's confidential information secret for {a} years after "
                                  "this agreement ends."),
              ("Service levels", "The supplier keeps the service available {b}.{a} percent of each month, measured "
                                 "at the customer's edge."),
              ("Audit", "The customer may audit the supplier's records once every {a} months with {b} days notice.")]
    title, text = rng.choice(topics)
    return f"Clause {n}. {title}. " + text.format(a=rng.randint(2, 60), b=rng.randint(3, 24))


def _function(rng: random.Random, n: int) -> str:
    noun = rng.choice(["invoice", "order", "ticket", "session", "report", "shipment"])
    verb = rng.choice(["validate", "load", "merge", "price", "archive", "route"])
    limit = rng.randint(2, 500)
    return (f"def {verb}_{noun}_{n}({noun}, limit={limit}):\n"
            f"    \"\"\"{verb.capitalize()} one {noun}; at most {limit} items are read.\"\"\"\n"
            f"    items = [x for x in {noun}.items if x.size <= limit]\n"
            f"    if not items:\n"
            f"        raise ValueError(\"empty {noun}\")\n"
            f"    return sum(x.size for x in items) / len(items)\n")


def _log(rng: random.Random, n: int) -> str:
    level = rng.choice(["INFO", "INFO", "INFO", "WARN", "ERROR"])
    event = rng.choice(["request served in {a} ms", "retrying upstream call, attempt {b}",
                        "cache hit ratio {a} percent",
                        "queue depth {a}", "connection pool exhausted after {a} ms", "deployed build {b}"])
    return (f"{n // 60:02d}:{n % 60:02d}:{rng.randint(10, 59)} {level} {rng.choice(SERVICES)} "
            + event.format(a=rng.randint(2, 900), b=rng.randint(2, 99)))


def _message(rng: random.Random, n: int) -> str:
    lines = ["can someone look at {t} before the release?", "I pushed a fix for {t}, it needs a review",
             "the numbers for {t} look off by about {a} percent", "{t} is blocked on the vendor again",
             "moving {t} to next sprint, we are out of time", "done with {t}, closing my part"]
    return (f"[{9 + n // 60:02d}:{n % 60:02d}] {rng.choice(FIRST)} {rng.choice(LAST)}: "
            + rng.choice(lines).format(t=rng.choice(THINGS), a=rng.randint(2, 40)))


_UNITS = {"prose": _prose, "table": _row, "contract": _clause, "code": _function, "logs": _log, "chat": _message}
_HEADERS = {
    "prose": "Meeting notes of the quarterly engineering review.",
    "table": "Order report.\n\n| order | customer | product | quantity | amount | status |\n|---|---|---|---|---|---|",
    "contract": "SERVICES AGREEMENT between the Supplier and the Customer.",
    "code": "\"\"\"Order processing helpers.\"\"\"",
    "logs": "service log, newest last",
    "chat": "#release-team channel export",
}
_JOIN = {"code": "\n\n"}


def document(kind: str, target_tokens: int, seed: int, f: Facts) -> str:
    """A ``kind`` document of about ``target_tokens`` tokens stating ``f``'s three facts, each once, at
    places fixed by ``seed`` (deterministic)."""
    if kind not in _UNITS:
        raise ValueError(f"unknown document kind {kind!r}; kinds: {', '.join(DOC_KINDS)}")
    rng = random.Random(f"{kind}:{seed}")
    budget = target_tokens * CHARS_PER_TOKEN[kind]
    units: list[str] = []
    size = len(_HEADERS[kind])
    while size < budget * 0.92 or len(units) < 3:
        units.append(_UNITS[kind](rng, len(units) + 1))
        size += len(units[-1]) + 1
    statements = [s.format(reference=f.reference, person=f.person, date=f.date) for s in _STATEMENTS[kind]]
    # each fact at the start, the middle or the end of the document, the order fixed by the seed
    slots = [1, len(units) // 2, len(units)]
    rng.shuffle(slots)
    for at, statement in sorted(zip(slots, statements), key=lambda p: -p[0]):
        units.insert(at, _fact_unit(kind, statement))
    units.insert(0, _HEADERS[kind])
    return _JOIN.get(kind, "\n").join(units)


def _fact_unit(kind: str, statement: str) -> str:
    """A fact as a unit of its kind (a table's facts go in notes under the table's rows, a log's in a log line)."""
    if kind == "table":
        return f"| note | {statement} | | | | |"
    if kind == "logs":
        return f"00:00:00 {statement}"
    if kind == "chat":
        return f"[08:59] {statement}"
    return statement


# -- personas ---------------------------------------------------------------------------------------

PERSONA_STYLES = ("plain", "rules", "markdown", "terse")
PERSONA_LENGTHS = ("short", "medium", "long")
_TONES = ["You are precise and never invent facts.", "You keep every answer short.",
          "You quote numbers exactly as written.", "You say so when the document does not answer a question.",
          "You write for busy managers.", "You prefer plain words to jargon.",
          "You name the source of every claim.", "You do not repeat what others already said."]
_DUTIES = ["Check every number against the document.", "Flag anything that looks inconsistent.",
           "Keep a neutral tone.", "Answer in full sentences.", "Point out missing information.",
           "Put the most important point first.", "Use the same names the document uses.",
           "Never speculate beyond the text."]


def persona(title: str, duty: str, style: str, length: str, seed: int) -> str:
    """A system prompt for an agent called ``title`` whose job is ``duty``: ``length`` short (one sentence),
    medium (a few) or long (a role with rules), written in ``style`` (plain prose, a rule list, markdown
    headings, terse)."""
    rng = random.Random(f"{title}:{style}:{length}:{seed}")
    n = {"short": 0, "medium": 2, "long": 5}[length]
    tones, duties = rng.sample(_TONES, n), rng.sample(_DUTIES, n)
    if style == "terse":
        return " ".join([f"Role: {title}. Task: {duty}.", *(t.removeprefix("You ").rstrip(".") + "." for t in tones)])
    if style == "rules":
        return "\n".join([f"You are the {title}. Your job: {duty}.", *(f"- {r}" for r in tones + duties)])
    if style == "markdown":
        parts = [f"## Role\nYou are the {title}.", f"## Job\n{duty[0].upper()}{duty[1:]}."]
        if n:
            parts.append("## Rules\n" + "\n".join(f"* {r}" for r in duties + tones))
        return "\n\n".join(parts)
    return " ".join([f"You are the {title} on this team, and your job is to {duty}.", *tones, *duties])
