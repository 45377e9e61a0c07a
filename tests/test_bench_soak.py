"""The soak benchmark (``python -m kvbaton.bench soak``): its quick run against real servers, and how
its record becomes the table of docs/results.md.

Specification:
- the soak's kernel-build phase (a build killed midway, then a server start on that cache, which comes
  up and answers, the stale lock removed rather than waited on) runs in the benchmark, not here: what a
  killed build leaves and a start's deadline are specified in test_kernels.py;
- a quick soak run (one device, ``--persist``, dropped streams, a tier that fills, a restart) writes
  one quick record whose phase leaves 0 live handles and 0 held blocks after ``release_all``, gets
  back every handle the clients kept, and answers no 500;
- its small-volume phase (``--persist`` on a small volume that another writer fills, a restart)
  has no permanent 503: every 503 is followed by a handle made again, ``/health`` is 200 at the
  end, every kept handle comes back, nothing leaks; its row tells the permanent 503s, the time
  degraded and the journal's largest size;
- its checkpointer phase (a LangGraph app with a ``MemorySaver``, thread after thread on a small pool)
  fails no unrelated request and no turn, holds at most the adapter's bound per thread and at most
  the pool, and leaves nothing once its threads are released;
- the report renders a soak record as one table row per phase: errors by class, leaks, RSS growth
  (over the load and over its second half),
  handles recovered, the worker kill, the unrelated requests that failed and the memory retained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvbaton.bench import report, soak, soak_harness

PERSISTENT = {
    "phase": "persistent", "clients": 64, "seconds": 120.0, "tier_fs": "tmpfs of 24 MiB",
    "requests": {"chat": 10, "resume": 5}, "errors": {"503 server_unavailable": 2}, "dropped_streams": 3,
    "rss_start_bytes": 100 * 2**20, "rss_end_bytes": 108 * 2**20, "rss_growth_bytes": 8 * 2**20,
    "rss_growth_second_half_bytes": 1 * 2**20, "clean_exit_code": 0, "handles_kept": 40, "handles_recovered": 40,
    "released": 60, "leaked_handles": 0,
    "leaked_blocks": 0,
}
VOLUME = {
    "phase": "small-volume", "clients": 8, "seconds": 20.0, "tier_fs": "tmpfs of 12 MiB", "volume_mib": 12,
    "requests": {"materialize": 29, "fork": 17}, "errors": {"503 server_unavailable": 5}, "dropped_streams": 0,
    "rss_start_bytes": None, "rss_end_bytes": None, "rss_growth_bytes": None, "handle_503s": 5, "permanent_503s": 0,
    "healthy_at_end": True, "degraded_s": 1.5, "journal_bytes_max": 94 * 1024,
    "journal_bytes_max_second_half": 90 * 1024,
    "handles_kept": 13, "handles_recovered": 13, "released": 17, "leaked_handles": 0, "leaked_blocks": 0,
}
CHECKPOINTER = {
    "phase": "checkpointer", "threads": 20, "seconds": 180.0, "kv_budget": "96 blocks", "pool_blocks": 96,
    "unrelated_blocks": 54, "requests": {"turn": 37, "unrelated": 20}, "errors": {}, "dropped_streams": 0,
    "turns_failed": 0, "unrelated_failed": 0, "max_retained_handles": 16, "retained_handles_per_thread_max": 4,
    "handles_live_max": 48, "retained_blocks_max": 41, "handles_spilled": 70, "handles_left_after_release": 0,
    "rss_growth_bytes": 2 * 2**20, "rss_growth_second_half_bytes": 0, "released": 0, "leaked_handles": 0,
    "leaked_blocks": 0,
}
KERNEL_BUILD = {
    "phase": "kernel_build", "mode": "build SIGKILLed mid-compile", "killed_after_s": 3.2, "stale_lock": True,
    "deadline_s": 300.0, "start_s": 61.5, "first_answer_s": 62.0, "outcome": "built", "stale_lock_removed": True,
    "requests": {"complete": 1}, "errors": {}, "dropped_streams": 0, "rss_growth_bytes": None, "released": 0,
    "leaked_handles": 0, "leaked_blocks": 0,
}
CLUSTER = {
    "phase": "cluster", "clients": 16, "seconds": 60.0, "workers_killed": 1, "healthy_after": True,
    "requests": {"generate": 7}, "errors": {}, "dropped_streams": 1, "rss_start_bytes": None, "rss_end_bytes": None,
    "rss_growth_bytes": None, "released": 2, "leaked_handles": 0, "leaked_blocks": 0,
}


@pytest.mark.unit
def test_the_table_has_a_row_per_phase_with_errors_leaks_growth_and_recovery():
    text = soak.table({"rows": [KERNEL_BUILD, PERSISTENT, CLUSTER, CHECKPOINTER]})
    kernels = next(line for line in text.splitlines() if "kernel build killed" in line)
    assert "built; up in 61.5 s, first answer in 62 s (deadline 300 s)" in kernels and "SIGKILLed mid-compile" in kernels
    persistent, cluster, checkpointer = [line for line in text.splitlines() if "kernel build" not in line and (
        "--persist" in line or "SIGKILL" in line or "checkpointer" in line)]
    assert "503 server_unavailable: 2" in persistent and "40 of 40" in persistent and "+8 MiB (+1 MiB)" in persistent
    assert "tmpfs of 24 MiB" in persistent and "64 x 120" in persistent
    assert "none" in cluster and "worker killed: 1, healthy after: True" in cluster
    assert "20 threads x 180" in checkpointer and "unrelated failed: 0 of 20" in checkpointer
    assert "4 handles/thread (bound 16)" in checkpointer and "41 of 96 blocks" in checkpointer
    (volume,) = [line for line in soak.table({"rows": [VOLUME]}).splitlines() if "small volume" in line]
    assert "permanent 503s: 0 (of 5)" in volume and "degraded 1.5 s" in volume and "journal max 94 KiB" in volume


@pytest.mark.unit
def test_rss_growth_is_told_over_the_whole_load_and_over_its_second_half():
    # Warm-up grows early and stops; a leak goes on growing in the second half (here: after 10 of 20 s).
    mib = 2**20
    fields = soak_harness.rss_fields([(0.0, 100 * mib), (5.0, 150 * mib), (10.0, 158 * mib), (20.0, 160 * mib)])
    assert fields["rss_growth_bytes"] == 60 * mib
    assert fields["rss_growth_second_half_bytes"] == 2 * mib  # from the sample nearest the middle (10 s)
    assert fields["rss_samples"][0] == [0.0, 100 * mib]
    assert soak_harness.rss_fields([])["rss_growth_bytes"] is None


@pytest.mark.unit
def test_report_renders_the_soak_section_from_its_record():
    rec = {"benchmark": "soak", "run_id": "20261202T000000Z-abcdef0", "git": {"short": "abcdef0"},
           "rows": [PERSISTENT, CLUSTER]}
    text = report.section("soak", rec, "")
    assert "run `20261202T000000Z-abcdef0`" in text and "40 of 40" in text
    assert "soak" in report.SECTIONS
    assert "<!-- bench:soak:start -->" in (report.REPO_ROOT / report.RESULTS_MD).read_text()


def test_quick_soak_leaks_nothing_and_recovers_every_kept_handle(tmp_path: Path):
    # Phase 1 only, for time; the benchmark's record runs every phase, and other tests specify what the others
    # check: test_kernels.py what a killed kernel build leaves and a start's deadline (phase 0),
    # test_server_persist.py's full-volume test a volume that fills (the small-volume phase),
    # test_adapter_ownership.py's checkpointer test retained handles on a small pool (the checkpointer phase).
    soak.main(["--quick", "--no-kernel-build", "--no-volume", "--no-checkpointer", "--results-dir", str(tmp_path),
               "--run-id", "soak-test"])
    rec = json.loads((tmp_path / "soak-test" / "soak.json").read_text())
    assert rec["quick"] is True
    phases = {row["phase"]: row for row in rec["rows"]}
    assert list(phases) == ["persistent"]
    phase = phases["persistent"]
    assert sum(phase["requests"].values()) > 0
    assert phase["leaked_handles"] == 0 and phase["leaked_blocks"] == 0
    assert phase["handles_recovered"] == phase["handles_kept"]
    assert phase["clean_exit_code"] == 0
    assert not [cls for cls in phase["errors"] if cls.startswith("500")]
