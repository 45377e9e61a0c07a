"""The soak benchmark (``python -m kvbaton.bench soak``): its quick run against real servers, and how
its record becomes the table of docs/results.md.

Specification:
- a quick soak run (one device, ``--persist``, dropped streams, a tier that fills, a restart) writes
  one quick record whose phase leaves 0 live handles and 0 held blocks after ``release_all``, gets
  back every handle the clients kept, and answers no 500;
- the report renders a soak record as one table row per phase: errors by class, leaks, RSS growth
  (over the load and over its second half),
  handles recovered, the worker kill.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvbaton.bench import report, soak

PERSISTENT = {
    "phase": "persistent", "clients": 64, "seconds": 120.0, "tier_fs": "tmpfs of 24 MiB",
    "requests": {"chat": 10, "resume": 5}, "errors": {"503 server_unavailable": 2}, "dropped_streams": 3,
    "rss_start_bytes": 100 * 2**20, "rss_end_bytes": 108 * 2**20, "rss_growth_bytes": 8 * 2**20,
    "rss_growth_second_half_bytes": 1 * 2**20, "clean_exit_code": 0, "handles_kept": 40, "handles_recovered": 40,
    "released": 60, "leaked_handles": 0,
    "leaked_blocks": 0,
}
CLUSTER = {
    "phase": "cluster", "clients": 16, "seconds": 60.0, "workers_killed": 1, "healthy_after": True,
    "requests": {"generate": 7}, "errors": {}, "dropped_streams": 1, "rss_start_bytes": None, "rss_end_bytes": None,
    "rss_growth_bytes": None, "released": 2, "leaked_handles": 0, "leaked_blocks": 0,
}


@pytest.mark.unit
def test_the_table_has_a_row_per_phase_with_errors_leaks_growth_and_recovery():
    text = soak.table({"rows": [PERSISTENT, CLUSTER]})
    persistent, cluster = [line for line in text.splitlines() if "--persist" in line or "SIGKILL" in line]
    assert "503 server_unavailable: 2" in persistent and "40 of 40" in persistent and "+8 MiB (+1 MiB)" in persistent
    assert "tmpfs of 24 MiB" in persistent
    assert "none" in cluster and "worker killed: 1, healthy after: True" in cluster


@pytest.mark.unit
def test_rss_growth_is_told_over_the_whole_load_and_over_its_second_half():
    # Warm-up grows early and stops; a leak goes on growing in the second half (here: after 10 of 20 s).
    mib = 2**20
    fields = soak.rss_fields([(0.0, 100 * mib), (5.0, 150 * mib), (10.0, 158 * mib), (20.0, 160 * mib)])
    assert fields["rss_growth_bytes"] == 60 * mib
    assert fields["rss_growth_second_half_bytes"] == 2 * mib  # from the sample nearest the middle (10 s)
    assert fields["rss_samples"][0] == [0.0, 100 * mib]
    assert soak.rss_fields([])["rss_growth_bytes"] is None


@pytest.mark.unit
def test_report_renders_the_soak_section_from_its_record():
    rec = {"benchmark": "soak", "run_id": "20261202T000000Z-abcdef0", "git": {"short": "abcdef0"},
           "rows": [PERSISTENT, CLUSTER]}
    text = report.section("soak", rec, "")
    assert "run `20261202T000000Z-abcdef0`" in text and "40 of 40" in text
    assert "soak" in report.SECTIONS
    assert "<!-- bench:soak:start -->" in (report.REPO_ROOT / report.RESULTS_MD).read_text()


def test_quick_soak_leaks_nothing_and_recovers_every_kept_handle(tmp_path: Path):
    soak.main(["--quick", "--results-dir", str(tmp_path), "--run-id", "soak-test"])
    rec = json.loads((tmp_path / "soak-test" / "soak.json").read_text())
    assert rec["quick"] is True
    (phase,) = rec["rows"]
    assert sum(phase["requests"].values()) > 0
    assert phase["leaked_handles"] == 0 and phase["leaked_blocks"] == 0
    assert phase["handles_recovered"] == phase["handles_kept"]
    assert phase["clean_exit_code"] == 0
    assert not [cls for cls in phase["errors"] if cls.startswith("500")]
