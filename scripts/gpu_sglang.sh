#!/usr/bin/env bash
# GPU check of the SGLang plugin (issue 10): `kvbaton serve --engine sglang` with the kvbaton
# eviction policy vs SGLang's lru, on a 6-agent cyclic workflow run twice around under a KV budget
# smaller than the agents' prompts; prints end-to-end time, cached prompt tokens and the ratio.
# Budget: at most 8 minutes on one H200 (the timeout below).
#
# Needs a Python with sglang==0.5.23 and kvbaton (make test-sglang builds .venv-sglang that way;
# docs/sglang.md). Model: a random-weight ~1B Llama made on the spot, or --model DIR, or
# --model default (the default model's safetensors, if converted on this machine).
# Usage: bash scripts/gpu_sglang.sh [results dir] [gpu_sglang.py options...]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-results}"
shift || true
PY="${PYTHON:-.venv-sglang/bin/python}"
if ! "$PY" -c 'import sglang, kvbaton' 2>/dev/null; then
  echo "gpu_sglang: $PY lacks sglang==0.5.23 or kvbaton; set PYTHON= or run make test-sglang first" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || { echo "gpu_sglang: no GPU" >&2; exit 2; }
# kvbaton serve runs as "$PY -m kvbaton.cli": the same interpreter as the driver.
PYTHONUNBUFFERED=1 timeout 480 "$PY" scripts/gpu_sglang.py --results-dir "$out" "$@"
