#!/usr/bin/env bash
# Prepare, on this machine, what the GPU run (scripts/gpu_run.sh) carries to a lent GPU machine, which has no
# package index and no model file (docs/development.md, "The GPU run"):
#   .whl/           the wheels that machine lacks (Python 3.12, x86-64): transformers, pydantic, pydantic-core,
#                   annotated-types, typing-inspection, platformdirs, llguidance, at the versions this checkout's
#                   .venv runs, and kvbaton itself (`pip wheel --no-deps .`);
#   .gpu/tokenizer/ the default model's tokenizer files (tokenizer.json, tokenizer_config.json,
#                   chat_template.jinja) from its converted folder: its GGUF is too big to carry;
#   .gpu/commit     this checkout's commit and whether it has uncommitted changes (0/1): the checkout travels
#                   without .git, and the record names the code it measured.
# Both are git-ignored; name them in the run's `carry`. The benchmark needs no server packages (fastapi,
# uvicorn, opentelemetry): none is carried. Checks that the two stay well under the 64 MiB a call may carry.
# Usage: bash scripts/gpu_wheels.sh        (PYTHON=... for another interpreter with kvbaton installed)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
LIMIT_MIB=40  # of the 64 MiB a call carries: the checkout itself travels too

version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

rm -rf .whl .gpu/tokenizer
mkdir -p .whl .gpu/tokenizer
common=(--quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --dest .whl)
manylinux=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
packages=()
for name in transformers pydantic pydantic-core annotated-types typing-inspection platformdirs; do
  packages+=("$name==$(version "$name")")
done
"$PY" -m pip download "${common[@]}" "${manylinux[@]}" "${packages[@]}"
"$PY" -m pip download "${common[@]}" --platform manylinux_2_31_x86_64 "llguidance==$(version llguidance)"
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir .whl .
rm -rf build

"$PY" - <<'EOF'
import shutil
from pathlib import Path

from kvbaton.backend.compute.loader import convert_default_model
from kvbaton.bench.gpu_harness import TOKENIZER_FILES

source = convert_default_model()
for name in TOKENIZER_FILES:
    shutil.copy(source / name, Path(".gpu/tokenizer") / name)
EOF

dirty=$([ -z "$(git status --porcelain --untracked-files=no)" ] && echo 0 || echo 1)
echo "$(git rev-parse HEAD) $dirty" > .gpu/commit
[ "$dirty" = 0 ] || echo "gpu_wheels: uncommitted changes: the record will say dirty (commit first to publish it)"

ls -l .whl .gpu/tokenizer
total=$(du -sk .whl .gpu | awk '{s += $1} END {print s}')
echo "gpu_wheels: $(ls .whl | wc -l) wheels and the tokenizer, $((total / 1024)) MiB in all"
if [ "$total" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "gpu_wheels: more than ${LIMIT_MIB} MiB: the checkout and these must stay under 64 MiB per call" >&2
  exit 1
fi
