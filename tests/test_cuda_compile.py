"""The CUDA runner's Triton kernels compile for a Hopper GPU (sm_90) on a machine without one: Triton's compiler
and the ``ptxas`` of its wheel, down to machine code, for every dtype, head size and flag the runner launches
them with (tests/cuda_compile.py, in a process of its own). Skipped where Triton is not installed (CI)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CI has no Triton)")
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(HERE / "cuda_compile.py")], capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.count("ok ") == 48 and "FAIL" not in done.stdout  # 2 dtypes x 3 shapes x 8 kernels
