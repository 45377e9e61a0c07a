#!/usr/bin/env bash
# GPU variant of the workflow benchmark (issue: workflow-aware KV cache): device KV on cuda, the
# slow tier in pinned host RAM, so PCIe transfers compete with compute as in KVFlow's setting.
# Budget: at most 8 minutes on one H200. Usage: bash scripts/gpu_workflow.sh [results dir]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-results}"
PY="${PYTHON:-.venv/bin/python}"
# Longer fixed prompts and more rounds than on CPU: the GPU prefills fast, so the gap between
# reactive load-back (c) and prefetch (d) only shows when transfers are a visible share of time.
timeout 480 "$PY" -m kvbaton.bench workflow --device cuda --slow-tier host --rounds 4 \
  --fixed-min 2048 --fixed-max 4096 --bounded --results-dir "$out"
