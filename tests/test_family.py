"""The workload family (issue 46, item 2) and its benchmark harness (item 3).

The family is pure data: its shapes, splits, prompts and questions are checked without a model (and without
torch or kvbaton, loaded by file path as another engine's environment would). The harness runs once on the
real model (``--quick``: three small shapes, exact and auto, a few tokens): what every run must satisfy —
token accounting, exact runs never approximate, teacher-forced prompts equal the reference's, every placed
span has a decision and a reason — never which decisions the reuse rule takes, and no time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from kvbaton.bench import family, family_docs, family_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shapes() -> list[family.Shape]:
    return family.family()


@pytest.mark.unit
def test_the_family_loads_by_file_path_without_torch_or_kvbaton():
    code = f"""
import importlib.util, sys
sys.modules["torch"] = None  # any import of torch (or kvbaton) fails
sys.modules["kvbaton"] = None
spec = importlib.util.spec_from_file_location("f", {str(ROOT / "bench" / "family.py")!r})
f = importlib.util.module_from_spec(spec); sys.modules["f"] = f; spec.loader.exec_module(f)
print(len(f.family()), sum(len(s.workload.turns) for s in f.family(quick=True)))
"""
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "60"


@pytest.mark.unit
def test_at_least_fifty_shapes_vary_every_axis(shapes):
    assert len(shapes) >= 50 and len({s.name for s in shapes}) == len(shapes)
    assert {s.topology for s in shapes} == set(family.TOPOLOGIES)
    assert {s.doc_kind for s in shapes} == set(family_docs.DOC_KINDS)
    assert {s.app for s in shapes} == set(family.APPS)
    assert {s.persona_style for s in shapes} == set(family_docs.PERSONA_STYLES)
    assert {s.persona_length for s in shapes} == set(family_docs.PERSONA_LENGTHS)
    assert {s.release for s in shapes} == {True, False}
    assert set(family.INSTRUCTION_KINDS) <= {k for s in shapes for k in s.kinds}
    # every topology meets every document kind
    assert {(s.topology, s.doc_kind) for s in shapes} == {(t, k) for t in family.TOPOLOGIES
                                                          for k in family_docs.DOC_KINDS}
    assert family.family() == shapes  # deterministic


@pytest.mark.unit
def test_the_split_is_fixed_by_the_seed_half_of_each_topology_each_way(shapes):
    for topology in family.TOPOLOGIES:
        assert Counter(s.split for s in shapes if s.topology == topology) == {"tune": 5, "report": 5}
    assert [s.split for s in family.family(seed=0)] == [s.split for s in shapes]
    assert [s.split for s in family.family(seed=1)] != [s.split for s in shapes]
    assert {s.split for s in family.select(shapes, "report")} == {"report"}
    assert [s.index for s in family.select(shapes, quick=True)] == list(family.QUICK_PICK)
    with pytest.raises(ValueError, match="split"):
        family.select(shapes, "test")


@pytest.mark.unit
def test_every_agent_puts_its_own_system_prompt_first_and_the_shared_context_after(shapes):
    for s in shapes:
        wl = s.workload
        assert len({a.persona for a in wl.agents.values()}) == len(wl.agents)
        if s.app == "autogen":  # the team's task is the document, each system message a persona
            assert s.task.startswith(wl.document + "\n\n")
            assert family.system_message(s, wl.turns[0].agent).startswith(wl.agents[wl.turns[0].agent].persona)
            continue
        for i, turn in enumerate(wl.turns):
            system, user = wl.messages(i, ["x"] * i)
            assert system == {"role": "system", "content": wl.agents[turn.agent].persona}
            assert user["content"].startswith(wl.context(i) + "\n\n")
    first = family.first_readers(shapes[0])  # a debate: the first speaker read nothing before anyone
    assert first[0] is False and all(first[i] for i in range(1, 3))


@pytest.mark.unit
def test_every_shape_asks_questions_a_string_match_answers(shapes):
    for s in shapes:
        assert 1 <= len(s.questions) <= 2
        for i, question in s.questions.items():
            assert s.kinds[i] == "answer" and s.workload.turns[i].instruction == question.text
            assert question.answer in s.workload.document  # stated where the seed put it
            if question.fact == "reference":
                assert s.workload.document.count(question.answer) == 1
                assert s.facts.reference in s.workload.document
    ref, person, date = family_docs.questions("contract", family_docs.Facts("HP-894179-H", "Dalia Moreau",
                                                                            "14 March 2023"))
    assert ref.answer == "894179"  # the reference's unique part
    assert ref.check("The reference number is HP-894179-H.") and ref.check("894179-H")
    assert not ref.check("HP-89417") and not ref.check("HP-984179-H")
    assert date.check("It takes effect on 14 march 2023.") and not date.check("14 March 2024")
    assert family_docs.Question("Who?", "Dalia Moreau", "person").check("It was  dalia moreau.")


@pytest.mark.unit
def test_the_table_compares_like_with_like_and_names_the_reasons():
    def turn(index: int, tokens: list[int], sha: str = "p", approx: int = 0) -> dict:
        return {"index": index, "token_ids": tokens, "prompt_sha": sha, "reused_approx": approx}

    ref = {"turns": [turn(0, [1]), turn(1, [2, 3]), turn(2, [4, 5])]}
    forced = {"teacher_forced": True, "turns": [turn(0, [1]), turn(1, [2, 9], approx=5), turn(2, [7, 5], "q")]}
    assert [(c["index"], c["first_token"], c["prefix"], c["same_text"]) for c in family_table.compare(forced, ref)] \
        == [(1, True, 0.5, False), (2, False, 0.0, False)]
    free = {**forced, "teacher_forced": False}  # a free run: only turns whose prompts are the reference's
    assert [c["index"] for c in family_table.compare(free, ref)] == [1]
    assert family_table.reason_category("recomputed", "low confidence: next-token margin 0.09 < probe_min_margin "
                                                      "0.5 with the spans re-aligned; ") == "rejected: probe margin"
    assert family_table.reason_category("blended", "anything") == "blended"
    unknown = family_table.reason_category("recomputed", "a new rule said 12 tokens")
    assert unknown == "recomputed: a new rule said # tokens"
    share = family_table.context_share([
        {"first_reader": True, "context_tokens": 100, "context_reused": 90},
        {"first_reader": False, "context_tokens": 100, "context_reused": 100},  # its own earlier reading
        {"first_reader": True, "context_tokens": 100, "context_reused": 50}])
    assert share == {"turns": 2, "tokens": 200, "reused": 140, "share": 0.7}


# -- on the real model -----------------------------------------------------------------------------------


def test_document_sizes_follow_their_estimate():
    from kvbaton.backend import Engine

    engine = Engine(kv_budget="1 blocks")
    try:
        for kind in family_docs.DOC_KINDS:
            doc = family_docs.document(kind, 600, 3, family_docs.facts(__import__("random").Random(3)))
            assert 480 <= len(engine.tokenize(doc)) <= 720, kind
    finally:
        engine.close()


def test_the_harness_on_a_quick_family(tmp_path):
    from kvbaton.bench import family_run

    family_run.main(["--quick", "--variants", "auto", "--max-tokens", "2", "--qa-tokens", "4",
                     "--results-dir", str(tmp_path), "--run-id", "quick"])
    rec = json.loads((tmp_path / "quick" / "family.json").read_text())
    assert rec["benchmark"] == "family" and rec["quick"] and not rec["partial"]
    assert [s["index"] for s in rec["shapes"]] == list(family.QUICK_PICK)
    assert {s["app"] for s in rec["shapes"]} == set(family.APPS)
    for shape in rec["shapes"]:
        exact, auto = shape["runs"]["exact"], shape["runs"]["auto"]
        assert len(exact["turns"]) == len(auto["turns"]) == shape["turns"]
        for t in exact["turns"] + auto["turns"]:
            assert t["prompt_tokens"] == t["reused_exact"] + t["reused_approx"] + t["prefilled"]
            assert 0 <= t["context"][0] < t["context"][1] <= t["prompt_tokens"]
            assert 0 <= t["context_reused"] <= t["context_tokens"] and t["seconds"] > 0
            assert all(s["reason"] for s in t["segments"])  # every decision says why
        assert all(t["exact"] and t["reused_approx"] == 0 and not t["segments"] for t in exact["turns"])
        if shape["app"] != "autogen":  # teacher-forced: the reference's prompts, turn by turn
            assert [t["prompt_sha"] for t in auto["turns"]] == [t["prompt_sha"] for t in exact["turns"]]
        assert sum(t["question"] for t in exact["turns"]) == 1
    by = {r["name"]: r for r in rec["rows"]}
    assert set(by) == {s["name"] for s in rec["shapes"]}
    assert set(rec["summary"]) == {"tune", "report", "all"}
    assert set(rec["summary"]["all"]["auto"]["targets"]) >= {"first_token_95", "kl_mean_0.01"}
    assert family_table.table(rec).count("\n") > len(rec["shapes"])
