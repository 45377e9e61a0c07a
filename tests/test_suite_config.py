"""The test suite's own configuration: a crashed or hung test worker ends `make test` with an error,
never a run that waits forever (an OOM kill of one worker once left the run hung at 87%), and the
servers a test starts die with it instead of running on as orphans."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _make_test_flags() -> list[str]:
    """The pytest flags of the Makefile's `test` target."""
    recipe = re.search(r"^test: .*\n\t\$\(PY\) -m pytest (.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert recipe, "the Makefile's test target runs pytest"
    return recipe.group(1).split()


def _run_like_make_test(tmp_path: Path, tests: str, *extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    (tmp_path / "test_scope.py").write_text(tests)
    (tmp_path / "test_other.py").write_text("import time\n\ndef test_d():\n    time.sleep(0.5)\n")
    # The project's pytest settings (timeout, timeout_method) with the Makefile's flags, on these tests.
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *_make_test_flags(), "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"),
         "--rootdir", str(tmp_path), *extra, str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    return done, time.monotonic() - start


def test_a_killed_worker_ends_the_run_with_an_error(tmp_path):
    done, _ = _run_like_make_test(tmp_path, (
        "import os, signal\n\n"
        "def test_a():\n    pass\n\n"
        "def test_b():\n    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would\n\n"
        "def test_c():\n    pass\n"
    ))
    assert done.returncode != 0
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "crashed while running 'test_scope" in failed[0]  # not re-run (the line is cut to the terminal's width)


def test_a_hung_test_is_ended_by_the_per_test_timeout(tmp_path):
    done, elapsed = _run_like_make_test(
        tmp_path, "import threading\n\ndef test_hangs():\n    threading.Event().wait()\n", "-o", "timeout=5",
    )
    assert done.returncode != 0
    # pytest-timeout's thread dumped the stacks (on the worker's stderr) and ended the worker.
    assert "crashed while running 'test_scope.py::test_hangs'" in done.stdout
    assert elapsed < 240


def test_a_server_started_by_a_test_dies_with_the_test_process(tmp_path):
    """What a killed test worker leaves behind: nothing (its servers get SIGTERM from the kernel)."""
    pid_file = tmp_path / "child.pid"
    child_code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    parent = (
        "import subprocess, sys, time\n"
        "from kvbaton.bench.processes import dies_with_parent\n"
        f"child = subprocess.Popen(dies_with_parent([sys.executable, '-c', {child_code!r}]))\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.1)
        child = int(pid_file.read_text())
    finally:
        proc.kill()  # as the OOM killer would: no cleanup code runs in the parent
        proc.wait(10)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child}").exists() and "zombie" not in _state(child):
        assert time.monotonic() < deadline, f"pid {child} outlived the process that started it"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split("\n", 1)[0].lower()
    except (OSError, IndexError):
        return "gone"
