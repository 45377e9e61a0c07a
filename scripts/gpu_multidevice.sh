#!/usr/bin/env bash
# GPU check of the multi-device backend (issue 7): pool block copy bandwidth (D2H / H2D), exactness
# of transfer / recompute between two cuda workers, and TTFT tables for the default model and a
# random-weight Llama-8B-shaped model. Budget: at most 8 minutes on one H200.
# Usage: bash scripts/gpu_multidevice.sh [results dir]   (PYTHON=... for a CUDA-enabled interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-results}"
PY="${PYTHON:-.venv/bin/python}"
timeout 470 "$PY" scripts/gpu_multidevice.py --results-dir "$out" --budget-s 460
