"""How the workflow benchmark turns its calls into the issue's numbers: rounds, steady state
(the rounds after the cold first one), per-agent TTFT, and the ratios it reports, ablation included.

Pure bookkeeping on made-up calls: the benchmark itself runs the real model and is not run here.
"""

from __future__ import annotations

import pytest
from kvbaton.bench.workflow import EXECUTORS, main, p90, ratios, schedule, summarize

pytestmark = pytest.mark.unit


def call(agent: str, ttft: float, prefilled: int, round_: int = 1) -> dict:
    return {"round": round_, "agent": agent, "seconds": ttft, "ttft_s": ttft, "tokens_prefilled": prefilled,
            "tokens_reused": 0}


def test_every_round_is_one_trip_around_the_cycle_with_one_executor():
    rounds = schedule(5, seed=0)
    assert len(rounds) == 5
    for agents in rounds:
        assert agents[:2] == ["planner", "researcher"] and agents[2] in EXECUTORS
        assert agents[3:] == ["coder", "expresser", "reviewer", "critic", "summarizer"]
    assert schedule(5, seed=0) == rounds  # the same schedule for every variant


def test_p90_is_the_nearest_rank_value():
    assert p90([3.0]) == 3.0
    assert p90([float(i) for i in range(1, 11)]) == 10.0
    assert p90([float(i) for i in range(1, 21)]) == 19.0


def test_summary_counts_prefill_work_and_ttft_overall_and_per_agent():
    calls = [call("planner", 1.0, 100), call("coder", 3.0, 50), call("planner", 2.0, 10)]
    s = summarize(calls, seconds=7.5)
    assert s["calls"] == 3 and s["end_to_end_s"] == 7.5 and s["tokens_prefilled"] == 160
    assert s["ttft_mean_s"] == pytest.approx(2.0) and s["ttft_p90_s"] == 3.0
    assert s["per_agent_ttft"]["planner"] == {"calls": 2, "mean_s": 1.5, "p90_s": 2.0}
    assert s["per_agent_ttft"]["coder"]["calls"] == 1


def row(seconds: float, p90_ttft: float = 1.0) -> dict:
    return {"end_to_end_s": seconds, "ttft_p90_s": p90_ttft}


def test_ratios_compare_d_with_each_baseline():
    r = ratios({"a": row(90), "b": row(60), "c": row(30, p90_ttft=2.0), "d": row(30)})
    assert r == {"b_over_d": 2.0, "c_over_d": 1.0, "a_over_d": 3.0, "c_p90_ttft_over_d": 2.0}


def test_ablation_reports_the_share_of_the_gain_due_to_ste_order_in_the_slow_tier():
    # (b) 100 s; bounded (d) with STE order 60 s, with LRU order 70 s: of the 40 s saved, 10 s need STE order.
    r = ratios({"a": row(110), "b": row(100), "c": row(50), "d": row(50),
                "d_bounded": row(60), "d_bounded_lru_tier": row(70)})
    assert r["bounded_lru_tier_over_ste_tier"] == pytest.approx(70 / 60)
    assert r["bounded_ste_tier_share_of_gain_over_b"] == pytest.approx(0.25)


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--bounded-tier-fraction", "1"]])
def test_bad_arguments_are_refused_before_anything_runs(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
