"""``python -m kvbaton.bench gpu`` (bench/gpu.py): without a CUDA device it says so and exits cleanly; with
``--device cpu --quick`` the whole benchmark (every phase, tiny random-weight checkpoints with the default
tokenizer) runs on CPU, each phase in a process of its own, and writes quick records whose exactness checks all
pass and whose tables render; ``--phases workflow`` alone builds the shape the workflow needs. A phase past its
budget is stopped there (SIGTERM, then SIGKILL), keeping the rows it had written, and the record says so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from kvbaton.bench import gpu, report
from kvbaton.bench.gpu_process import run_phase
from kvbaton.bench.headline import headline, targets

HERE = Path(__file__).parent


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the benchmark would run")
def test_without_a_cuda_device_it_says_skipped_and_writes_nothing(tmp_path, capsys):
    gpu.main(["--results-dir", str(tmp_path)])
    assert capsys.readouterr().out.strip() == "skipped: no CUDA device"
    assert not any(tmp_path.iterdir())


@pytest.mark.unit
def test_an_unknown_phase_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--device", "cpu", "--quick", "--phases", "speed-8b", "--results-dir", str(tmp_path)])
    assert "unknown phase(s) speed-8b" in capsys.readouterr().err and not any(tmp_path.iterdir())


@pytest.mark.unit
@pytest.mark.parametrize(("mode", "stopped_by"), [("polite", "at its 3 s hard limit"),
                                                  ("stubborn", "killed at its 3 s hard limit")])
def test_a_phase_past_its_budget_is_stopped_and_keeps_its_rows(mode, stopped_by):
    """SIGTERM at the budget: the phase records where it stopped; one that ignores it is killed after the grace."""
    result = run_phase("slow", 3.0, ["--mode", mode], grace_s=2.0,
                       launcher=(sys.executable, str(HERE / "gpu_phase_child.py")))
    out = result["out"]
    assert out["status"] == f"stopped before the long step: {stopped_by}"
    assert out["hard_limit"] and out["rows"] == [{"shape": "x", "metric": "first row", "kvbaton": 1.0}]
    assert result["environment"] == {"x": 1}
    assert out["seconds"] < 60  # it did not run its 60 s: the wait is bounded, not timed to the second


def test_the_quick_run_on_cpu_measures_every_phase_and_writes_quick_records(tmp_path):
    gpu.main(["--device", "cpu", "--quick", "--results-dir", str(tmp_path), "--run-id", "smoke",
              "--phases", "device", "exactness", "speed-tiny"])
    rec = json.loads((tmp_path / "smoke" / "gpu.json").read_text())
    assert rec["benchmark"] == "gpu" and rec["quick"] and not rec["partial"]
    assert {name: p["status"] for name, p in rec["phases"].items()} == {
        "device": "ok", "exactness": "ok", "speed-tiny": "ok"}
    assert not any(p["hard_limit"] for p in rec["phases"].values())
    exact = rec["phases"]["exactness"]
    assert exact["total"] >= 15 and exact["passed"] == exact["total"]
    assert {c["check"].split(" (")[0] for c in exact["checks"]} >= {
        "dense prefill", "resume from a handle", "fork, decoded concurrently", "one of 8 concurrent requests"}
    assert any(c["check"].startswith("prefix-cache hit") for c in exact["checks"])
    metrics = [r["metric"] for r in rec["rows"]]
    assert any(m.startswith("decode ms/token") for m in metrics) and any(m.startswith("TTFT") for m in metrics)
    assert all("kvbaton" in r and "spread" in r for r in rec["rows"])
    errors = rec["phases"]["speed-tiny"]["logit_error"]  # fp32 here: the reference's own dtype, errors ~1e-7
    assert errors["kvbaton_prefill"]["positions"] + errors["kvbaton_decode_rows"]["positions"] == 2 * 48
    assert errors["kvbaton_decode_rows"]["top1_agreement"] == 1.0 and errors["kvbaton_prefill"]["kl_max"] < 1e-4
    section = report.section("gpu", rec, "")
    assert "| shape" in section and "fp32 exactness" in section and "logits against an fp32 reference" in section
    assert headline(rec).startswith("on no GPU: fp32 token-identical")
    assert targets(rec)[0].met
    # The workflow phase alone builds the checkpoint of the shape it runs, in a run of its own.
    gpu.main(["--device", "cpu", "--quick", "--results-dir", str(tmp_path), "--run-id", "flow", "--phases", "workflow"])
    flow = json.loads((tmp_path / "flow" / "gpu.json").read_text())
    assert flow["phases"]["workflow"]["status"] == "ok" and flow["phases"]["workflow"]["shape"] == "tiny"
    assert flow["checkpoints"]["tiny-float32"]["seconds"] > 0 and not flow["checkpoints"]["tiny-float32"].get("reused")
    assert flow["phases"]["workflow"]["result"]["steady_state_ratios"]
