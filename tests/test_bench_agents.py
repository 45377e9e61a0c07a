"""The persona-first agents benchmark: its workloads (pure data, no torch), its bookkeeping, and a
tiny smoke run on the real model through its command line (record, table, plot).

Nothing here asserts a time: the smoke run only checks what every run must satisfy (token
accounting, exact reuse = text replay under greedy decoding, the teacher-forced turn count).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvbaton.bench import agents, workloads
from kvbaton.bench.headline import headline
from kvbaton.bench.plots import plot

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_workloads_load_by_file_path_without_torch_or_kvbaton():
    code = f"""
import importlib.util, sys
sys.modules["torch"] = None  # any import of torch (or kvbaton) fails
sys.modules["kvbaton"] = None
spec = importlib.util.spec_from_file_location("w", {str(ROOT / "sdk" / "bench" / "workloads.py")!r})
w = importlib.util.module_from_spec(spec); sys.modules["w"] = w; spec.loader.exec_module(w)
counts = {{n: len(w.run_workload(w.build(n), lambda agent, messages: agent.upper())) for n in w.WORKLOADS}}
print(counts)
"""
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{'debate': 12, 'chain': 6, 'fanout': 6}"


@pytest.mark.unit
def test_every_prompt_is_persona_first_then_the_shared_document():
    for name in workloads.WORKLOADS:
        wl = workloads.build(name)
        for i, turn in enumerate(wl.turns):
            system, user = wl.messages(i, ["out"] * i)
            assert system == {"role": "system", "content": wl.agents[turn.agent].persona}
            assert user["role"] == "user" and user["content"].startswith(wl.document + "\n\n")
            assert user["content"].endswith("\n\n" + turn.instruction)
        assert len({a.persona for a in wl.agents.values()}) == len(wl.agents)  # distinct personas
    debate = workloads.build("debate")
    assert [t.agent for t in debate.turns] == ["advocate", "critic", "analyst", "judge"] * 3
    quoted = debate.messages(2, ["a", "b"])[1]["content"].split("\n\n")[-2]
    assert quoted == "Transcript so far:\nAdvocate: a\nCritic: b"
    fan = workloads.build("fanout")
    assert [t.agent for t in fan.turns] == ["planner", "security", "cost", "reliability", "schedule", "synthesizer"]
    assert fan.turns[1].sees == (0,) and fan.turns[-1].sees == (1, 2, 3, 4)


@pytest.mark.unit
def test_documents_are_deterministic_and_vary_with_the_seed():
    assert workloads.build("debate", 0).document == workloads.build("debate", 0).document
    assert workloads.build("debate", 0).document != workloads.build("debate", 1).document
    words = len(workloads.build("debate").document.split())
    assert 1500 < words * workloads.TOKENS_PER_WORD < 3000


@pytest.mark.unit
def test_teacher_forced_turns_get_the_reference_prompts_whatever_this_run_generates():
    wl = workloads.build("chain", quick=True)
    reference = workloads.run_workload(wl, lambda agent, messages: f"{agent} said {len(messages[1]['content'])}")
    forced = workloads.run_workload(wl, lambda agent, messages: "something else",
                                    teacher=[t.text for t in reference])
    assert [t.messages for t in forced] == [t.messages for t in reference]
    free = workloads.run_workload(wl, lambda agent, messages: "something else")
    assert free[1].messages != reference[1].messages


def turn(index: int, ids: list[int], text: str, approx: int = 0) -> dict:
    return {"index": index, "agent": f"a{index}", "token_ids": ids, "text": text, "reused_approx": approx,
            "reused_exact": 10, "prefilled": 90 - approx, "prompt_tokens": 100}


@pytest.mark.unit
def test_fidelity_skips_each_workloads_first_turn_and_counts_prefix_before_divergence():
    ref = {"workloads": {"w": {"turns": [turn(0, [1, 2, 3, 4], "x"), turn(1, [1, 2, 3, 4], "y"),
                                         turn(2, [5, 6, 7, 8], "z")]}}}
    run = {"workloads": {"w": {"turns": [turn(0, [9, 9, 9, 9], "q"), turn(1, [1, 2, 0, 4], "y2", approx=5),
                                         turn(2, [5, 6, 7, 8], "z")]}}}
    found = agents.agreement(agents.compare(run, ref, max_tokens=4))
    assert found == {"turns": 2, "turns_approximated": 1, "first_token": 1.0, "prefix": pytest.approx(0.75),
                     "same_text": 0.5}
    s = agents.shares(run["workloads"]["w"]["turns"])
    assert s["prompt_tokens"] == 300 and s["reused_approx"] == 5
    assert s["reused_exact_share"] + s["reused_approx_share"] + s["prefilled_share"] == pytest.approx(1.0)


@pytest.mark.unit
def test_reuse_keyword_is_detected_from_the_signature_or_a_probe():
    class WithKeyword:
        def generate(self, messages, *, sampling=None, agent=None, reuse="exact"):
            raise AssertionError("the signature is enough")

    class Refusing:
        def generate(self, messages, **options):
            raise ValueError("unknown sampling field 'reuse'")

    assert agents.supports_reuse(WithKeyword())
    assert not agents.supports_reuse(Refusing())


@pytest.mark.unit
def test_peer_script_loads_the_same_workloads_without_vllm():
    spec = importlib.util.spec_from_file_location("peer_vllm", ROOT / "scripts" / "peer_vllm.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)  # the __main__ guard: nothing runs, vllm is imported only by VllmPeer
    w = peer.load_workloads()
    assert w.debate().messages(0, []) == workloads.debate().messages(0, [])


def test_quick_run_writes_a_record_table_and_plot(tmp_path):
    # rotate runs the same code path as auto with another reuse= value: left out to keep this short.
    agents.main(["--quick", "--dtypes", "float32", "--only", "chain", "--variants", "exact", "auto", "text",
                 "--max-tokens", "2", "--results-dir", str(tmp_path), "--run-id", "smoke"])
    rec = json.loads((tmp_path / "smoke" / "agents.json").read_text())
    assert rec["benchmark"] == "agents" and rec["quick"] is True and rec["dtypes"] == ["float32"]
    by = {r["variant"]: r for r in rec["rows"]}
    assert {"exact", "text"} <= set(by)
    if rec["reuse_supported"]:  # 1 teacher-forced pass x the chain's turns after the first
        assert by["auto"]["teacher_forced"]["turns"] == rec["turns_per_workload"]["chain"] - 1
        assert "rotate" not in by
    else:
        assert rec["skipped_variants"] == ["auto"]
    for r in rec["rows"]:
        turns = r["run_detail"]["workloads"]["chain"]["turns"]
        assert len(turns) == rec["turns_per_workload"]["chain"] == 6
        assert all(t["generated"] == len(t["token_ids"]) == 2 for t in turns)  # ignore_eos: exactly max_tokens
        assert all(t["reused_exact"] + t["reused_approx"] + t["prefilled"] == t["prompt_tokens"] for t in turns)
        assert len(r["runs"]["end_to_end_s"]) == 1
    assert by["text"]["shares"]["prefilled_share"] == 1.0  # text replay re-reads everything
    assert by["exact"]["shares"]["reused_exact"] > 0  # round 2 resumes each agent's own round-1 prompt
    assert by["exact"]["shares"]["reused_approx"] == 0 and by["exact"]["results_not_exact"] == 0
    # Exact reuse is token-identical to dense prefill under greedy decoding: text replay agrees fully.
    assert by["text"]["free_running"]["same_text"] == 1.0
    assert all(40 <= n <= 80 for n in rec["persona_tokens"]["chain"].values())
    assert "chain s" in agents.table(rec) and headline(rec).startswith("float32:")
    assert plot(rec, tmp_path / "agents.png").stat().st_size > 0
