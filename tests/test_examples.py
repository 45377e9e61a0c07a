"""The examples, ``kvbaton run`` / ``kvbaton bench`` and the benchmark suite, at the smallest sizes.

Each example runs in both modes on the real model and must report its metrics; greedy decoding
makes the two modes' outputs identical, so the reports must say so. No timing is asserted.
"""

from __future__ import annotations

import json

import pytest
from kvbaton.cli import main as cli
from kvbaton.examples import EXAMPLES

TINY = ["--baseline", "all", "--quiet", "--max-tokens", "3"]
ARGS = {
    "debate": ["--rounds", "1", "--context-words", "60"],
    "tree_of_thought": ["--k", "2", "--depth", "1", "--context-words", "60"],
    "rag": ["--k", "2", "--top-n", "1"],
    "wrap_existing_langgraph_app": ["--context-words", "60"],
}
AGENTS = {
    "debate": {"optimist", "skeptic", "pragmatist", "judge"},
    "tree_of_thought": {"thinker", "scorer", "answer"},
    "rag": {"planner", "solver_1", "solver_2", "synthesizer"},
    "wrap_existing_langgraph_app": {"researcher", "writer", "editor"},
}


@pytest.mark.unit
def test_every_example_is_tested():
    assert set(ARGS) == set(EXAMPLES) == set(AGENTS)


@pytest.mark.parametrize("name", sorted(ARGS))
def test_example_runs_in_every_mode_and_reports_metrics(name, capsys, tmp_path):
    import importlib

    plot = tmp_path / "timeline.png"
    out = importlib.import_module(f"kvbaton.examples.{name}").main([*ARGS[name], *TINY, "--plot", str(plot)])
    assert out["plot"] == str(plot) and plot.stat().st_size > 0  # the timelines, every mode side by side
    kv, text, cached = out["modes"]["kvbaton"], out["modes"]["text"], out["modes"]["cached"]
    for report in (kv, text, cached):
        assert AGENTS[name] <= set(report["per_agent"])
        assert report["total_s"] > 0 and report["peak_kv_bytes"] > 0 and report["tokens_prefilled"] > 0
        for agent in AGENTS[name]:
            assert report["per_agent"][agent]["ttft_mean_s"] > 0
    # text passing without a prefix cache reuses nothing and prefills everything; kvbaton reuses the shared
    # prefix; with the prefix cache on, text passing reuses what repeats an earlier prompt's start
    assert text["tokens_reused"] == 0
    assert kv["tokens_reused"] > 0
    assert kv["tokens_prefilled"] < text["tokens_prefilled"]
    assert cached["tokens_prefilled"] <= text["tokens_prefilled"]
    assert out["same_outputs"] is True
    assert set(out["ratios"]) == {f"{metric}_{base}_over_kvbaton" for metric in ("total_time", "mean_ttft", "prefilled")
                                  for base in ("text", "cached")}
    printed = capsys.readouterr().out
    for heading in ("kvbaton (KV handles)", "text passing, no prefix cache (baseline)",
                    "text passing, prefix cache on (baseline)",
                    "kvbaton vs text passing, no prefix cache and vs text passing, prefix cache on", "peak KV",
                    "TTFT mean ms", "tokens reused", "tokens prefilled", "total time s", "text+cache / kvbaton"):
        assert heading in printed


def test_example_single_mode():
    from kvbaton.examples import tree_of_thought

    out = tree_of_thought.main(["--k", "1", "--depth", "1", "--context-words", "30", "--max-tokens", "2",
                                "--baseline", "text", "--quiet"])
    assert list(out["modes"]) == ["text"] and "ratios" not in out


@pytest.mark.unit
@pytest.mark.parametrize("argv", [
    [], ["serve"], ["info"], ["run"], ["bench"], ["bench", "all"], ["bench", "scaling"], ["bench", "branching"],
    *(["run", name] for name in sorted(EXAMPLES)),
])
def test_cli_help(argv, capsys):
    try:
        code = cli([*argv, "--help"])
    except SystemExit as exc:  # argparse's own --help exits
        code = exc.code
    assert code in (0, None)
    assert "usage:" in capsys.readouterr().out


@pytest.mark.unit
def test_cli_rejects_unknown_example_and_benchmark(capsys):
    for argv in (["run", "nope"], ["bench", "nope"]):
        with pytest.raises(SystemExit) as exc:
            cli(argv)
        assert exc.value.code == 2


def test_cli_run_delegates_to_the_example(capsys):
    assert cli(["run", "tree_of_thought", "--k", "1", "--depth", "1", "--context-words", "30",
                "--max-tokens", "2", "--quiet"]) == 0
    assert "kvbaton (KV handles)" in capsys.readouterr().out


def test_bench_all_quick_writes_json_png_and_summary(tmp_path, monkeypatch, capsys):
    from kvbaton.bench import branching, suite

    monkeypatch.setattr(branching, "QUICK_ARGS", ["--branches", "2", "--context-tokens", "32", "--depth", "1",
                                                  "--max-tokens", "1"])
    monkeypatch.setattr(suite, "TIMELINE_QUICK_ARGS", ["--rounds", "1", "--context-words", "30", "--max-tokens", "1"])
    assert cli(["bench", "all", "--quick", "--only", "branching", "timeline", "--results-dir", str(tmp_path)]) == 0
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]  # one run id for the whole suite
    assert (run_dir / "branching.png").stat().st_size > 0
    assert (run_dir / "debate_timeline.png").stat().st_size > 0  # the debate's timeline, kvbaton vs text
    payload = json.loads((run_dir / "branching.json").read_text())
    assert payload["run_id"] == run_dir.name and payload["quick"] is True
    (row,) = payload["rows"]
    assert row["branches"] == 2 and row["copies_kv_blocks"] >= row["forks_kv_blocks"]
    summary = json.loads((run_dir / "summary.json").read_text())
    status = {o["name"]: o["status"] for o in summary["outcomes"]}
    assert status["branching"] == "ok" and status["timeline"] == "ok" and status["ttft"] == "skipped"
    experiments = {e["benchmark"]: e["experiment"] for e in summary["experiments"]}
    assert {"ttft", "scaling", "transfer", "branching", "serve", "adapter_overhead"} <= set(experiments)
    printed = capsys.readouterr().out
    assert "=== experiments" in printed and "peak KV vs branch factor" in printed


@pytest.mark.unit
def test_plots_draw_unknown_benchmarks_generically(tmp_path):
    from kvbaton.bench.plots import plot

    payload = {"benchmark": "later", "rows": [{"size": 1, "a_s": 0.5, "b_s": 1.0}, {"size": 2, "a_s": 0.7, "b_s": 2.1}]}
    assert plot(payload, tmp_path / "later.png").stat().st_size > 0
    assert plot({"benchmark": "empty"}, tmp_path / "empty.png").stat().st_size > 0


@pytest.mark.unit
def test_correction_bench_simulates_confidence_gate_thresholds():
    from kvbaton.bench.correction import margin_analysis

    rows = [
        {"method": "dense", "shared_tokens": 64, "ttft_mean_s": 2.0, "ttfts": [2.0, 2.0, 2.0, 2.0]},
        {"method": "lowrank_chained_nogate", "shared_tokens": 64, "margins": [0.1, 0.55, 0.9, 3.0],
         "first_token_agrees": [False, False, True, True], "ttfts": [0.5, 0.5, 0.5, 0.5]},
    ]
    by = {a["min_margin"]: a for a in margin_analysis(rows)}
    # Below the threshold a prompt is recomputed densely: it agrees, and costs a dense prefill more.
    assert by[0.25]["recomputed_share"] == 0.25 and by[0.25]["first_token_agreement"] == 0.75
    assert by[0.6]["disagreements_below"] == 2 and by[0.6]["first_token_agreement"] == 1.0
    assert by[0.6]["ttft_mean_s"] == pytest.approx(0.5 + 0.5 * 2.0)
    assert by[2.0]["speedup_vs_dense"] == pytest.approx(2.0 / 2.0)
