"""Benchmark records and the results generated from them.

- The committed docs/results.md blocks and the README headline block are exactly what
  ``python -m kvbaton.bench report`` generates from the committed records (so a number there is
  the number a record holds), and results.md's prose states no measured numbers.
- The record writer keeps its metadata, every raw repeat, and flags an overloaded machine.
- min / median / max summarising, peak sampling and the report's marking of older commits, on
  hand-made data.

Model-free except the last test, which runs one small benchmark end to end.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from kvbaton.bench import record, report
from kvbaton.bench.headline import targets
from kvbaton.bench.spread import bounds, cell, measured, summary

ROOT = record.REPO_ROOT
HAS_GIT = shutil.which("git") is not None and (ROOT / ".git").exists()
needs_git = pytest.mark.skipif(not HAS_GIT, reason="needs the git checkout (records are matched to commits)")


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


# -- the committed docs are the generator's output -------------------------------------------------


@pytest.mark.unit
@needs_git
def test_committed_results_and_readme_are_generated_from_the_committed_records():
    for rel, text in report.generate(ROOT).items():
        assert (ROOT / rel).read_text() == text, (
            f"{rel} is not what the committed records give: run `python -m kvbaton.bench report` and commit")


MEASURED_NUMBER = re.compile(r"\b\d+(\.\d+)?\s?(x|%)(?!\w)|\b\d+\.\d+\s?(s|ms|MiB|MB|GiB|GB|tok/s)\b")


def outside_blocks(text: str) -> str:
    return re.sub(r"<!-- bench:(\w+):start -->.*?<!-- bench:\1:end -->", "", text, flags=re.DOTALL)


@pytest.mark.unit
def test_results_prose_states_no_measured_numbers():
    prose = outside_blocks((ROOT / report.RESULTS_MD).read_text())
    assert not MEASURED_NUMBER.search(prose), MEASURED_NUMBER.search(prose)
    headline = (ROOT / report.README).read_text().split("## Headline numbers")[1].split("\n## ")[0]
    assert not MEASURED_NUMBER.search(outside_blocks(headline))


# -- summaries -------------------------------------------------------------------------------------


@pytest.mark.unit
def test_summary_is_min_median_max_of_every_repeat():
    assert summary([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}
    assert summary([4.0, 1.0])["median"] == 2.5
    with pytest.raises(ValueError):
        summary([])
    row = measured({}, "t_s", [0.3, 0.1, 0.2])
    assert row["t_s"] == 0.2 and row["spread"]["t_s"] == [0.1, 0.3] and row["runs"]["t_s"] == [0.3, 0.1, 0.2]
    assert bounds(row, "t_s") == (0.1, 0.3) and bounds(row, "other") is None
    assert cell(row, "t_s") == "0.200 [0.100–0.300]"
    assert cell(measured({}, "same", [2.0, 2.0]), "same") == "2.000"
    assert cell(measured({}, "b", [2 * 2**20]), "b", 1, 1 / 2**20) == "2.0"


# -- the record writer -----------------------------------------------------------------------------


@pytest.mark.unit
def test_record_has_its_metadata_and_keeps_every_repeat(tmp_path):
    with record.Recording("ttft", tmp_path, run_id="20260101T000000Z-abc1234", argv=["--repeats", "3"]) as rec:
        record.watch_kv("pool", lambda: 5 * 2**20)
        payload = {"benchmark": "ttft", "rows": [measured({"context_tokens": 64}, "replay_s", [0.5, 0.4, 0.6])]}
        path = rec.write(payload, dtypes=["float32"])
    assert path == tmp_path / "20260101T000000Z-abc1234" / "ttft.json"
    rec_ = json.loads(path.read_text())
    for key in record.META_KEYS:
        assert key in rec_, key
    assert rec_["command"][-2:] == ["--repeats", "3"] and rec_["dtypes"] == ["float32"]
    assert set(rec_["git"]) == {"commit", "short", "dirty"}
    if HAS_GIT:
        assert rec_["git"]["commit"] == git("rev-parse", "HEAD")
    machine = rec_["machine"]
    for key in ("cpu", "cpu_flags", "cores", "memory_bytes", "torch", "torch_threads", "python"):
        assert key in machine, key
    assert len(rec_["load"]["before"]) == 3 and len(rec_["load"]["after"]) == 3
    assert isinstance(rec_["load"]["overloaded"], bool)
    memory = rec_["memory"]
    assert memory["peak_rss_bytes"] > 0 and memory["peak_kv_bytes"] == 5 * 2**20
    assert rec_["rows"][0]["runs"]["replay_s"] == [0.5, 0.4, 0.6]  # raw repeats, not only the median
    assert rec_["rows"][0]["replay_s"] == 0.5 and rec_["partial"] is False


@pytest.mark.unit
def test_load_above_the_core_count_is_flagged():
    busy = record.load_state((1.0, 1.0, 1.0), (1.5, 1.2, 1.0), max_during=2.6, cores=2)
    assert busy["overloaded"] is True and busy["max_1min_during"] == 2.6
    quiet = record.load_state((0.2, 0.2, 0.2), (1.8, 0.9, 0.5), max_during=1.9, cores=2)
    assert quiet["overloaded"] is False
    assert record.load_state((0.1,) * 3, (3.0, 1.0, 1.0), max_during=0.5, cores=2)["overloaded"] is True


@pytest.mark.unit
def test_where_cpu_time_is_measured_other_processes_decide_the_flag_not_the_runs_own_threads():
    # a run keeping both cores busy itself has a load average of about 2: not a reason to distrust it
    own_load = record.load_state((2.1,) * 3, (2.6, 2.2, 2.0), max_during=2.7, cores=2, other_cpu_s=3.0, wall_s=100.0)
    assert own_load["overloaded"] is False and own_load["other_cpu_share"] == 0.015
    contended = record.load_state((0.5,) * 3, (2.0,) * 3, max_during=2.0, cores=2, other_cpu_s=40.0, wall_s=100.0)
    assert contended["overloaded"] is True and contended["other_cpu_share"] == 0.2


@pytest.mark.unit
def test_cpu_time_of_other_processes_excludes_this_process_and_its_waited_for_children():
    before = record.cpu_seconds()
    if before is None:
        pytest.skip("no /proc/stat here")
    sum(i * i for i in range(2_000_000))  # this process's own work
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(2_000_000))"], check=True)  # a waited-for child
    after = record.cpu_seconds()
    assert after is not None and after[1] > before[1], "own and children's CPU time counted"
    other = record.other_cpu_seconds(before, after)
    assert other is not None and other >= 0.0
    assert other <= (after[0] - before[0]), "never more than the machine was busy"
    assert record.other_cpu_seconds(None, after) is None


@pytest.mark.unit
def test_peak_sampler_keeps_high_water_marks_and_drops_closed_engines():
    values = iter([10, 30, 20])
    closed = {"yes": False}

    def gone() -> int:
        if closed["yes"]:
            raise RuntimeError("engine closed")
        return 7

    sampler = record.PeakSampler({"a": lambda: next(values), "b": gone, "c": lambda: {0: 1, 1: 2}})
    sampler.sample()  # a=10, b=7, c=3 -> 20
    sampler.sample()  # a=30 -> 40
    closed["yes"] = True
    sampler.sample()  # a=20, b dropped -> 23
    assert sampler.peak == {"a": 30, "b": 7, "c:0": 1, "c:1": 2}
    assert sampler.total == 40


@pytest.mark.unit
def test_run_ids_are_utc_time_and_short_commit():
    import datetime as dt

    when = dt.datetime(2026, 12, 1, 3, 15, tzinfo=dt.UTC)
    assert record.new_run_id("42f0eb7", when) == "20261201T031500Z-42f0eb7"
    assert record.new_run_id(None, when).endswith("-nogit")


# -- the report on hand-made records ---------------------------------------------------------------


def ttft_record(run_id: str, commit: str, date: str, **extra) -> dict:
    rows = []
    for n, replay in ((512, [1.2, 1.1, 1.3]), (4096, [13.0, 13.7, 14.1])):
        row = {"context_tokens": n, "question_tokens": 21}
        measured(row, "replay_s", replay)
        measured(row, "resume_s", [0.22, 0.2, 0.25])
        measured(row, "floor_s", [0.2, 0.19, 0.21])
        row["replay_over_resume"] = row["replay_s"] / row["resume_s"]
        row["resume_over_floor"] = row["resume_s"] / row["floor_s"]
        rows.append(row)
    return {"benchmark": "ttft", "rows": rows, "run_id": run_id, "date": date, "command": ["python", "-m", "x"],
            "git": {"commit": commit, "short": commit[:7], "dirty": False}, "dtypes": ["float32"], "quick": False,
            "partial": False, "wall_s": 60.0,
            "machine": {"cpu": "Test CPU", "cpu_flags": ["avx2"], "cores": 2, "memory_bytes": 2**34,
                        "torch": "2.x", "torch_threads": 2, "python": "3.11"},
            "load": record.load_state((0.1,) * 3, (1.9, 1.0, 0.5), 1.9, 2),
            "memory": {"peak_rss_bytes": 2**30, "vm_hwm_bytes": 2**30, "children_peak_rss_bytes": None,
                       "peak_kv_bytes": 2**26}, **extra}


def write(records, rec) -> None:
    folder = records / rec["run_id"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{rec['benchmark']}.json").write_text(json.dumps(rec))


@pytest.mark.unit
def test_report_picks_the_newest_publishable_record(tmp_path):
    write(tmp_path, ttft_record("20260101T000000Z-a", "a" * 40, "2026-01-01T00:00:00+00:00"))
    write(tmp_path, ttft_record("20260301T000000Z-c", "c" * 40, "2026-03-01T00:00:00+00:00", quick=True))
    write(tmp_path, ttft_record("20260401T000000Z-d", "d" * 40, "2026-04-01T00:00:00+00:00", partial=True))
    write(tmp_path, ttft_record("20260201T000000Z-b", "b" * 40, "2026-02-01T00:00:00+00:00"))
    assert report.select(tmp_path)["ttft"]["run_id"] == "20260201T000000Z-b"


@pytest.mark.unit
@needs_git
def test_report_names_run_and_commit_and_marks_older_code(tmp_path):
    head = git("rev-parse", "HEAD")
    write(tmp_path, ttft_record("20260101T000000Z-cur", head, "2026-01-01T00:00:00+00:00"))
    texts = report.generate(ROOT, tmp_path)
    results, readme = texts[report.RESULTS_MD], texts[report.README]
    ttft = results.split("<!-- bench:ttft:start -->")[1].split("<!-- bench:ttft:end -->")[0]
    assert "run `20260101T000000Z-cur`" in ttft and f"commit `{head[:7]}`" in ttft and "older commit" not in ttft
    assert "13.700 [13.000–14.100]" in ttft  # the median with its spread, from the record
    assert "Test CPU" in ttft and "within the 2 cores" in ttft
    assert "target: (a)/(b) >= 50x at 4096 tokens" in ttft and "met" in ttft
    assert "13.700 [13.000–14.100]" in readme.split("<!-- bench:headline:start -->")[1]
    # no record: no number, the command to run instead
    assert "Not yet measured on the current code: run `python -m kvbaton.bench serve`" in results
    assert "Not yet measured on the current code: run `python -m kvbaton.bench serve`" in readme

    first = git("rev-list", "--max-parents=0", "HEAD").splitlines()[0]  # code has changed since
    write(tmp_path, ttft_record("20260201T000000Z-old", first, "2026-02-01T00:00:00+00:00",
                                load=record.load_state((3.0,) * 3, (3.0,) * 3, 3.5, 2)))
    results = report.generate(ROOT, tmp_path)[report.RESULTS_MD]
    assert f"(older commit {first[:7]})" in results
    assert "above the 2 cores" in results
    elsewhere = "0" * 40
    write(tmp_path, ttft_record("20260301T000000Z-x", elsewhere, "2026-03-01T00:00:00+00:00"))
    assert "not in this history" in report.generate(ROOT, tmp_path)[report.RESULTS_MD]
    # where the record measured other processes' CPU time, that decides the flag and the words
    write(tmp_path, ttft_record("20260401T000000Z-cpu", head, "2026-04-01T00:00:00+00:00",
                                load=record.load_state((2.0,) * 3, (2.5,) * 3, 2.6, 2, other_cpu_s=30.0, wall_s=60.0)))
    results = report.generate(ROOT, tmp_path)[report.RESULTS_MD]
    assert "other processes used 25% of the CPU during the run: times suspect" in results
    assert "Other processes used 30 s of CPU time, 25.0% of the 2 cores' time: **above the 10% limit" in results


@pytest.mark.unit
def test_fill_replaces_only_the_marked_blocks():
    text = "a 1.5x\n<!-- bench:x:start -->\nold 9x\n<!-- bench:x:end -->\nb\n<!-- bench:y:start -->\n<!-- bench:y:end -->\n"
    out = report.fill(text, {"x": "new", "y": "fresh\n"})
    assert out == "a 1.5x\n<!-- bench:x:start -->\nnew\n<!-- bench:x:end -->\nb\n<!-- bench:y:start -->\nfresh\n<!-- bench:y:end -->\n"
    with pytest.raises(SystemExit):
        report.fill("no markers", {"x": "new"})


@pytest.mark.unit
def test_correction_targets_count_only_runs_at_the_default_gate():
    rows = [{"method": "lowrank_chained", "shared_tokens": 4096, "speedup_vs_dense": 2.1,
             "first_token_agreement": 1.0, "prompts": 60}]
    at_default = {"benchmark": "correction", "rows": rows, "default_gate": True, "gate": {}}
    assert all(t.met for t in targets(at_default))
    other_gate = {**at_default, "default_gate": False, "gate": {"min_margin": 0.5}}
    assert not targets(other_gate)[0].met and "NOT MET" in targets(other_gate)[0].line()
    few = {**at_default, "rows": [{**rows[0], "prompts": 24}]}
    assert not targets(few)[0].met


# -- one small benchmark end to end (loads the model) ----------------------------------------------


def test_ttft_benchmark_writes_one_record_with_every_repeat(tmp_path):
    from kvbaton.bench import ttft

    ttft.main(["--lengths", "64", "--repeats", "2", "--no-hf", "--results-dir", str(tmp_path), "--run-id", "run1"])
    (path,) = list(tmp_path.glob("*/*.json"))
    assert path == tmp_path / "run1" / "ttft.json"
    rec = json.loads(path.read_text())
    assert rec["benchmark"] == "ttft" and rec["run_id"] == "run1" and rec["dtypes"] == ["float32"]
    assert rec["command"][:4] == ["python", "-m", "kvbaton.bench", "ttft"]
    (row,) = rec["rows"]
    for key in ("replay_s", "resume_s", "floor_s"):
        assert len(row["runs"][key]) == 2
        low, high = row["spread"][key]
        assert low <= row[key] <= high
    assert rec["memory"]["peak_kv_bytes"] > 0 and rec["memory"]["peak_rss_bytes"] > 0
    assert rec["load"]["cores"] == rec["machine"]["cores"]


# -- the cost model's fit and its error (what the transfer benchmark reports) ----------------------


@pytest.mark.unit
def test_prefill_line_is_a_least_squares_fit_and_refits_online_from_observed_prefills():
    from kvbaton.backend.costmodel import Calibration, CostModel, fit_line, prediction_error

    points = [(float(n), 0.05 + 0.004 * n) for n in (32, 128, 512, 1024, 2048)]
    fixed, per_token = fit_line(points)
    assert fixed == pytest.approx(0.05) and per_token == pytest.approx(0.004)
    assert prediction_error(0.195, 0.6) == pytest.approx(0.195 / 0.6 - 1)
    assert prediction_error(None, 0.6) is None and prediction_error(0.1, 0.0) is None

    costs = CostModel(Calibration(1e-4, 1e9, 0.0, {1: 0.01}, {1: 0.001}))
    assert not costs.observe_prefill(1, 0, 1.0)  # nothing prefilled: not a point
    for n in (100, 110, 120, 130):  # four points, but all of one length: the line stays
        assert not costs.observe_prefill(1, n, 0.05 + 0.004 * n)
    assert costs.predict_recompute(1, 2000) == pytest.approx(0.01 + 0.001 * 2000)
    assert costs.observe_prefill(1, 2000, 0.05 + 0.004 * 2000)  # now they span the lengths: refitted
    assert costs.predict_recompute(1, 1000) == pytest.approx(0.05 + 0.004 * 1000)
