"""The request loop's benchmarks run end to end: ``host`` (no model) and ``concurrency`` (the engine alone; vLLM
only when its interpreter is given), each writing a record with every repeat."""

from __future__ import annotations

import json

import pytest


@pytest.mark.unit
def test_the_host_benchmark_measures_host_time_per_sequence_and_a_resumes_fixed_cost(tmp_path):
    from kvbaton.bench import host

    host.main(["--quick", "--results-dir", str(tmp_path), "--run-id", "host-smoke"])
    record = json.loads((tmp_path / "host-smoke" / "host.json").read_text())
    assert [r["sequences"] for r in record["rows"]] == [1, 8]
    assert all(r["host_us_per_seq_step"] > 0 and r["runs"]["host_us_per_seq_step"] for r in record["rows"])
    assert record["resume"]["resume_fixed_ms"] > 0 and len(record["resume"]["runs"]["resume_fixed_ms"]) == 50


def test_the_concurrency_benchmark_runs_kvbaton_alone_without_a_vllm_interpreter(tmp_path):
    from kvbaton.bench import concurrency

    concurrency.main(["--agents", "1", "3", "--tokens", "3", "--repeats", "1", "--tiny",
                      "--results-dir", str(tmp_path), "--run-id", "cc-smoke"])
    record = json.loads((tmp_path / "cc-smoke" / "concurrency_tiny.json").read_text())
    assert [r["agents"] for r in record["rows"]] == [1, 3] and record["peer"] is None
    assert all(r["kvbaton_tokens_per_s"] > 0 for r in record["rows"])
