"""``python -m kvbaton.bench gpu`` (bench/gpu.py): without a CUDA device it says so and exits cleanly; with
``--device cpu --quick`` the whole benchmark (every phase, tiny random-weight checkpoints with the default
tokenizer) runs on CPU and writes a quick record whose exactness checks all pass and whose tables render."""

from __future__ import annotations

import json

import pytest
import torch
from kvbaton.bench import gpu, report
from kvbaton.bench.headline import headline, targets


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the benchmark would run")
def test_without_a_cuda_device_it_says_skipped_and_writes_nothing(tmp_path, capsys):
    gpu.main(["--results-dir", str(tmp_path)])
    assert capsys.readouterr().out.strip() == "skipped: no CUDA device"
    assert not any(tmp_path.iterdir())


def test_the_quick_run_on_cpu_measures_every_phase_and_writes_a_quick_record(tmp_path):
    gpu.main(["--device", "cpu", "--quick", "--results-dir", str(tmp_path), "--run-id", "smoke"])
    rec = json.loads((tmp_path / "smoke" / "gpu.json").read_text())
    assert rec["benchmark"] == "gpu" and rec["quick"] and not rec["partial"]
    assert {name: p["status"] for name, p in rec["phases"].items()} == {
        "device": "ok", "exactness": "ok", "speed-tiny": "ok", "workflow": "ok"}
    exact = rec["phases"]["exactness"]
    assert exact["total"] >= 15 and exact["passed"] == exact["total"]
    assert {c["check"].split(" (")[0] for c in exact["checks"]} >= {
        "dense prefill", "resume from a handle", "fork, decoded concurrently", "one of 8 concurrent requests"}
    assert any(c["check"].startswith("prefix-cache hit") for c in exact["checks"])
    metrics = [r["metric"] for r in rec["rows"]]
    assert any(m.startswith("decode ms/token") for m in metrics) and any(m.startswith("TTFT") for m in metrics)
    assert all("kvbaton" in r and "spread" in r for r in rec["rows"])
    assert rec["phases"]["workflow"]["result"]["steady_state_ratios"]
    section = report.section("gpu", rec, "")
    assert "| shape" in section and "fp32 exactness" in section
    assert headline(rec).startswith("on no GPU: fp32 token-identical")
    assert targets(rec)[0].met
