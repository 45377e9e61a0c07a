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
def test_cpu_of_started_processes_that_are_never_reaped_counts_as_the_runs_own(monkeypatch):
    """A peer server's workers die with its process group and never reach us as waited-for children: their
    CPU, noted when the server stops, is the run's own work, not other load."""
    before = record.cpu_seconds()
    if before is None:
        pytest.skip("no /proc/stat here")
    monkeypatch.setattr(record, "_unreaped_cpu_s", [0.0])
    start = record.cpu_seconds()
    record.note_own_cpu(12.5)
    record.note_own_cpu(-3.0)  # a negative reading (rounding at the stop) adds nothing
    after = record.cpu_seconds()
    assert start is not None and after is not None and after[1] - start[1] >= 12.5 - 1e-6  # float sums


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
def test_the_gpu_page_keeps_the_newest_run_of_each_phase_each_with_its_own_rows(tmp_path):
    """The GPU benchmark runs phase by phase on a machine lent for minutes: a run stays on the page while it
    has a phase no newer run measured; the targets read each phase from its newest run."""
    def gpu(run_id, date, phases, shapes=()):
        write(tmp_path, {"benchmark": "gpu", "run_id": run_id, "date": date,
                         "phases": {name: {"status": status} for name, status in phases.items()},
                         "rows": [{"shape": shape, "metric": "decode ms/token, batch 1", "kvbaton": 1.0}
                                  for shape in shapes]})

    gpu("20260101T000000Z-a", "2026-01-01", {"device": "ok", "speed-1b": "ok", "workflow": "ok"}, ["1b"])
    gpu("20260201T000000Z-b", "2026-02-01", {"speed-1b": "ok", "workflow": "failed: OOM"}, ["1b"])
    gpu("20260301T000000Z-c", "2026-03-01", {"speed-8b": "stopped before the profile: over its budget"}, ["8b"])
    runs = report.phased_runs(tmp_path)
    assert [r["run_id"] for r in runs] == ["20260301T000000Z-c", "20260201T000000Z-b", "20260101T000000Z-a"]
    view = report.combined(runs)
    assert set(view["phases"]) == {"speed-8b", "speed-1b", "device", "workflow"}
    assert [r["shape"] for r in view["rows"]] == ["8b", "1b"]  # 1b's rows from b only, never twice
    gpu("20260401T000000Z-d", "2026-04-01", {"device": "ok", "speed-1b": "ok", "speed-8b": "ok", "workflow": "ok"})
    assert [r["run_id"] for r in report.phased_runs(tmp_path)] == ["20260401T000000Z-d"]


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


# -- which baseline a speed-up is over -------------------------------------------------------------


def timed_row(base: dict, sides: tuple[str, ...], keys: dict[str, float]) -> dict:
    """A result row with every ``<side>_<key>`` measured twice (median = the value)."""
    row = dict(base)
    for side in sides:
        for key, value in keys.items():
            measured(row, f"{side}_{key}", [value * 0.9, value * 1.1])
    return row


def scaling_record(cached: bool) -> dict:
    sides = ("text", "handles", *(("cached",) if cached else ()))
    row = timed_row({"agents": 16}, sides, {"wall_s": 2.0, "ttft_mean_s": 0.5, "peak_kv_bytes": 2**26})
    for side in sides:
        row |= {f"{side}_prefilled": 1000, f"{side}_held_kv_bytes": 2**25, f"{side}_held_kv_blocks": 40}
    row |= {"text_wall_s": 20.0, "text_peak_kv_bytes": 2**29, "wall_text_over_handles": 10.0,
            "kv_text_over_handles": 8.0}
    if cached:
        row |= {"wall_cached_over_handles": 1.05, "kv_cached_over_handles": 1.0}
    return {"benchmark": "scaling", "context_tokens": 1024, "rows": [row]}


def branching_record(cached: bool) -> dict:
    sides = ("copies", "forks", *(("cached",) if cached else ()))
    row = timed_row({"branches": 16, "depth": 2}, sides, {"wall_s": 3.0, "peak_kv_bytes": 2**26})
    for side in sides:
        row |= {f"{side}_held_kv_bytes": 2**25, f"{side}_kv_blocks": 90, f"{side}_prefilled": 1300}
    row |= {"copies_wall_s": 40.0, "forks_ideal_blocks": 128, "kv_copies_over_forks": 17.0}
    if cached:
        row["kv_cached_over_forks"] = 1.1
    return {"benchmark": "branching", "rows": [row]}


def serve_record(cached: bool) -> dict:
    rows = []
    for mode in ("on", "off", *(("cache",) if cached else ())):
        rows.append(timed_row({"reuse": mode, "clients": 32, "requests": 64}, ("x",), {}) | {
            "requests_per_s": 13.0 if mode != "off" else 1.2, "tokens_per_s": 100.0, "ttft_p50_s": 1.0,
            "ttft_p99_s": 1.5})
    rows[0] |= {"throughput_vs_off": 11.0, "ttft_p50_vs_off": 22.0}
    if cached:
        rows[0] |= {"throughput_vs_cache": 1.02, "ttft_p50_vs_cache": 1.01}
    return {"benchmark": "serve", "rows": rows}


@pytest.mark.unit
@pytest.mark.parametrize("make", [
    lambda cached: ttft_record("r", "a" * 40, "2026-01-01", **({"rows": [
        {**row, "replay_cached_s": 0.2, "replay_cached_over_resume": 0.9}
        for row in ttft_record("r", "a" * 40, "2026-01-01")["rows"]]} if cached else {})),
    scaling_record, branching_record, serve_record,
], ids=["ttft", "scaling", "branching", "serve"])
def test_every_speedup_over_text_replay_names_its_baseline_and_older_records_say_what_they_lack(make):
    from kvbaton.bench.common import NOT_MEASURED
    from kvbaton.bench.headline import headline

    old, new = make(False), make(True)
    name = old["benchmark"]
    for rec in (old, new):
        assert "prefix cache off" in headline(rec)
    # a record from before the prefix-cache baseline renders, and says what it does not hold
    assert NOT_MEASURED in headline(old) and NOT_MEASURED in report.table_of(name, old)
    # one that measured it puts it beside the other, in the headline and the table
    assert NOT_MEASURED not in headline(new) and NOT_MEASURED not in report.table_of(name, new)
    assert "prefix cache on" in headline(new)
    assert "cache" in report.table_of(name, new).splitlines()[0]  # a column of its own


@pytest.mark.unit
def test_the_correction_table_says_its_speedups_are_ratios_of_means():
    from kvbaton.bench import correction
    from kvbaton.bench.headline import headline

    rows = [measured({"method": method, "shared_tokens": 4096, "prompts": 60, "ttft_mean_s": mean,
                      "ttft_p90_s": mean, "speedup_vs_dense": 8.0 / mean, "first_token_agreement": 1.0,
                      "greedy32_agreement": 1.0, "kl_mean": 0.0, "reuse_ratio": 0.5, "anchor_pool_bytes": 0,
                      "outcomes": {}}, "ttft_s", [mean / 2, mean / 3, mean * 3])
            for method, mean in (("dense", 8.0), ("lowrank_chained", 4.0))]
    rec = {"benchmark": "correction", "rows": rows, "default_gate": True, "gate": {}}
    table = correction.table(rec, simulated=False)
    assert "TTFT mean s" in table and "vs dense (means)" in table and "2.00x" in table  # 8.0 / 4.0: the means
    assert "ratio of means" in headline(rec) and "mean" in correction.SUMMARY and "median" not in headline(rec)


@pytest.mark.unit
def test_transfer_cells_at_the_cost_models_own_crossover():
    from kvbaton.bench.common import rate
    from kvbaton.bench.headline import headline
    from kvbaton.bench.transfer import crossover_speed, link_of, table

    assert [rate(x) for x in (None, 1e8, 3e7, 1.6e7, 2.5e9, 900.0)] == [
        "unpaced", "100 MB/s", "30 MB/s", "16 MB/s", "2.5 GB/s", "900 B/s"]
    # transfer = latency + bytes / speed + overhead equals the predicted recompute at bytes / (recompute - fixed)
    row = {"kv_bytes": 9_900_000, "predicted_recompute_s": 1.0, "link_latency_s": 0.001, "resume_overhead_s": 0.009}
    assert crossover_speed(row) == pytest.approx(1e7)
    assert crossover_speed({**row, "predicted_recompute_s": 0.005}) is None  # no link is fast enough

    def cell(cap: float | None, kind: str, choice: str, faster: str, error: float, **extra) -> dict:
        out = {"cell": kind, "bandwidth_cap_bytes_per_s": cap, "context_tokens": 1024, "kv_bytes": 47_000_000,
               "predicted_transfer_s": 1.0, "predicted_recompute_s": 2.5, "transfer_error": error,
               "recompute_error": 0.1, "model_choice": choice, "faster_measured": faster,
               "recompute_over_transfer": 1.1, **extra}
        return measured(measured(out, "transfer_s", [1.0]), "recompute_s", [2.5])

    fork = {"k": 2, "handles_s": 3.0, "replay_s": 3.3, "replay_over_handles": 1.1, "moves": 0, "moves_transfer": 0,
            "peak_kv_bytes_handles": {0: 1}, "peak_kv_bytes_replay": {0: 1}}
    rec = {"benchmark": "transfer", "fork": [fork], "crossover": [
        cell(None, "sweep", "transfer", "transfer", -0.83), cell(1e8, "sweep", "transfer", "transfer", 0.01),
        cell(1.9e7, "crossover", "transfer", "recompute", -0.02, crossover_factor=1.0,
             predicted_crossover_bytes_per_s=1.9e7)]}
    assert [link_of(r) for r in rec["crossover"]] == ["unpaced", "paced 100 MB/s", "1 x crossover = 19 MB/s"]
    text = headline(rec)
    assert "2/2 cells of the sweep" in text and "0/1 cells at its own predicted crossover" in text
    assert "on the unpaced link -83% to -83%" in text and "emulated" in text
    assert "not measured" not in table(rec)
    old = {**rec, "crossover": [{k: v for k, v in r.items() if k != "cell"} for r in rec["crossover"][:2]]}
    assert "not measured in this record" in headline(old) and "not measured in this record" in table(old)


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
    from kvbaton.backend.cluster.costmodel import Calibration, CostModel, fit_line, prediction_error

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
