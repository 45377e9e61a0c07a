#!/usr/bin/env bash
# The GPU run (issues 38, 50): `python -m kvbaton.bench gpu` on a lent GPU machine, one part per device call.
#
# Prepare here first (after committing): `bash scripts/gpu_wheels.sh` (the wheels that machine lacks in .whl/,
# the default tokenizer and the commit in .gpu/). Then one device `run` per part, from the checkout's root,
# carry [".whl", ".gpu"] (docs/development.md, "The GPU run"):
#   bash scripts/gpu_run.sh part1    timeout_s 330   device + exactness + speed-1b       (270 s)
#   bash scripts/gpu_run.sh part2    timeout_s 270   workflow on the 8B shape, host tier  (210 s)
#   bash scripts/gpu_run.sh part3    timeout_s 270   speed-8b                            (210 s)
# or `bash scripts/gpu_run.sh SECONDS [benchmark arguments]` for any other run.
# It installs the wheels into /tmp/site (no index there; skipped when a warm machine has them already), builds
# kvbaton from the tree that travelled (the carried wheel if that fails), runs the benchmark under `timeout`
# with 45 s less than the part's seconds (install, a stopped phase's grace), each phase in its own process under
# a hard limit, and copies the record (gpu.json) and the log into $OUT, the folder whose files come back
# (results/gpu-run/ when run by hand). Checkpoints stay in /dev/shm/kvbaton-gpu-checkpoints (/tmp/... when
# /dev/shm is small), so a later part on the same warm machine reuses the 8B one (the record says which were).
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-part1}" in
  part1) limit=270; phases=(--phases device exactness speed-1b) ;;
  part2) limit=210; phases=(--phases workflow) ;;
  part3) limit=210; phases=(--phases speed-8b) ;;
  *[!0-9]*) echo "gpu_run: the first argument is part1, part2, part3 or a number of seconds" >&2; exit 2 ;;
  *) limit="$1"; phases=() ;;
esac
out="${OUT:-results/gpu-run}"
mkdir -p "$out"
log="$out/gpu_run.log"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader \
    || echo "gpu_run: nvidia-smi failed"
  stamp=$(ls -l .whl | md5sum | cut -c1-32)
  if [ "$(cat /tmp/site/.kvbaton-wheels 2>/dev/null)" != "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || { echo "gpu_run: installing the carried wheels failed"; exit 3; }
    echo "$stamp" > /tmp/site/.kvbaton-wheels
  fi
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
# Checkpoints in RAM when /dev/shm has room for the 8B one (a container's may be small), else on disk.
shm_free_kib=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
if [ "${shm_free_kib:-0}" -gt $((40 * 1024 * 1024)) ]; then ckpts=/dev/shm/kvbaton-gpu-checkpoints
else ckpts=/tmp/kvbaton-gpu-checkpoints; fi
timeout --signal=TERM --kill-after=20 "$((limit - 20))" python3 -m kvbaton.bench gpu --results-dir "$results" \
  --budget-s $((limit - 45)) --checkpoints "$ckpts" "${phases[@]}" "${@:2}" 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
if ls "$results"/*/gpu.json >/dev/null 2>&1; then
  cp "$results"/*/gpu.json "$out/"
else
  echo "gpu_run: no record was written" | tee -a "$log"
fi
echo "gpu_run: exit status $status" | tee -a "$log"
exit "$status"
