#!/usr/bin/env bash
# The GPU run (issue 38): `python -m kvbaton.bench gpu` on a lent GPU machine, in one command.
#
# Prepare here first (after committing): `bash scripts/gpu_wheels.sh` (the wheels that machine lacks in .whl/,
# the default tokenizer and the commit in .gpu/). Then the device tool's run, from the checkout's root:
#   command: bash scripts/gpu_run.sh 480        carry: [".whl", ".gpu"]        timeout_s: 560
# It installs the wheels into /tmp/site (no index there), builds kvbaton from the tree that travelled (the
# carried wheel if that fails), runs the benchmark under `timeout` (the argument, seconds; the benchmark gets
# 30 s less and shares it among its phases), and copies the record (gpu.json) and the log into $OUT, the
# folder whose files come back (results/gpu-run/ when run by hand). Arguments after the first go to the benchmark
# (e.g. `--phases device exactness` for a short first check). docs/development.md, "The GPU run".
set -uo pipefail
cd "$(dirname "$0")/.."
limit="${1:-480}"
out="${OUT:-results/gpu-run}"
mkdir -p "$out"
log="$out/gpu_run.log"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "gpu_run: nvidia-smi failed"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_run: installing the carried wheels failed"; exit 3; }
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
    --target /tmp/site . || echo "gpu_run: building kvbaton from the tree failed: the carried wheel runs"
  rm -rf build
} 2>&1 | tee "$log"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TQDM_DISABLE=1 KVBATON_CACHE_DIR=/tmp/kvbaton-cache
export KVBATON_GPU_TOKENIZER="$PWD/.gpu/tokenizer"
if [ -f .gpu/commit ]; then  # the checkout travels without .git: the record names the commit gpu_wheels.sh saw
  read -r KVBATON_GIT_COMMIT KVBATON_GIT_DIRTY < .gpu/commit
  export KVBATON_GIT_COMMIT KVBATON_GIT_DIRTY
fi
results=$(mktemp -d /tmp/gpu-results.XXXXXX)  # this run's own: a warm machine keeps the last run's /tmp
timeout --signal=TERM --kill-after=20 "$limit" python3 -m kvbaton.bench gpu --results-dir "$results" \
  --budget-s $((limit - 30)) "${@:2}" 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
if ls "$results"/*/gpu.json >/dev/null 2>&1; then
  cp "$results"/*/gpu.json "$out/"
else
  echo "gpu_run: no record was written" | tee -a "$log"
fi
echo "gpu_run: exit status $status" | tee -a "$log"
exit "$status"
