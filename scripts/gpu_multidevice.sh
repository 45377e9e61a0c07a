#!/usr/bin/env bash
# GPU check of the Ray multi-device backend (issue 48): two worker actors (one GPU each, or two sharing
# one GPU), KV transfer exactness over NCCL (two GPUs) or gloo (one GPU: NCCL refuses two ranks on one
# device) and over Ray's object store, against resuming in place and dense transformers (fp32 greedy).
# Budget: a few minutes on one GPU (two model loads per transport). Without a GPU it says so and exits 0.
# Usage: bash scripts/gpu_multidevice.sh [results dir] [--smoke-cpu]   (PYTHON=... a CUDA-enabled interpreter with Ray)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-results}"
shift || true
PY="${PYTHON:-.venv/bin/python}"
timeout 470 "$PY" scripts/gpu_multidevice.py --results-dir "$out" "$@"
