"""kvbaton's C++ decode kernels: built once per machine at first use, loaded by every engine after.

The kernels (``csrc/decode_kernels.cpp``, ``prefill_attention.cpp`` and ``bindings.cpp``, built as one
translation unit) are compiled with ``torch.utils.cpp_extension`` for the
CPU they run on (``-march=native``), so the build directory is keyed by the source, the torch
installation (version, C++ ABI, install path, Python) and the CPU's feature flags: a cache shared
between machines never loads code built for another instruction set, and two virtual environments
on one machine keep a build each instead of rebuilding each other's on every start. The first build takes about 40 s on 2 cores; later processes
load the cached library in well under a second.

Set ``KVBATON_KERNELS=0`` to skip them. Without a C++ compiler, or when the build fails, the fused
decode step runs on oneDNN instead (logged once), with the same results.

One process builds a directory at a time, under an exclusive ``flock`` on ``build.flock`` in it, which
the kernel drops when the process ends, however it ends. ``cpp_extension`` has a lock of its own, a
plain ``lock`` file that it waits on without a deadline; a build that was killed leaves it behind, and
every later start then hung. Holding the ``flock`` proves that no other kvbaton process is building
here, so a ``lock`` file found then is stale and is removed. A process that finds the ``flock`` held
says so every few seconds and gives up after ``KVBATON_KERNELS_BUILD_TIMEOUT`` seconds (default 600),
running on oneDNN instead: a start never waits forever.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from types import ModuleType

import filelock
import torch

from ...dirs import cache_dir

log = logging.getLogger(__name__)

# The kernels' source files, concatenated in this order into one translation unit (SOURCE, in the build
# directory): they share one anonymous namespace of vector helpers, and no file grows past a readable size.
PARTS = ("decode_kernels.cpp", "prefill_attention.cpp", "bindings.cpp")
SOURCE = "kvbaton_kernels.cpp"
BUILD_LOCK = "build.flock"  # kvbaton's own lock (flock: released by the kernel when its holder dies)
STALE_LOCK = "lock"  # cpp_extension's lock file, which it waits on forever
BUILD_TIMEOUT_S = 600.0  # a build on 2 cores takes ~40 s; a holder this long is hung, not busy
WAIT_REPORT_S = 10.0  # how often a waiting process says that it waits, and for whom
_LOCK = threading.Lock()
_STATE: dict[str, ModuleType | str] = {}  # "module" or "error" once decided
_OFF = ("0", "false", "off", "no")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _source() -> str:
    parts = resources.files(__package__).joinpath("csrc")
    return "\n".join(f"// ---- csrc/{name} ----\n{parts.joinpath(name).read_text()}" for name in PARTS)


def _torch_install() -> str:
    """The torch a build links against: its version, C++ ABI, install path and the Python it runs in
    (torch's own build files name the include paths, so another venv means another build)."""
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "?")
    return f"{torch.__version__} abi={abi} {Path(torch.__file__).resolve().parent} py={sys.version.split()[0]}"


def _compiler() -> str:
    """The C++ compiler cpp_extension will run (``$CXX`` or ``c++``) and its version: another compiler
    means another build, in another directory, rather than two configurations rebuilding one."""
    cxx = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "unavailable"
    return f"{shutil.which(cxx) or cxx} {version.splitlines()[0] if version else ''}"


def build_key(source: str | None = None) -> str:
    """What the compiled library depends on: source (read here unless given), torch install, Python headers,
    compiler, flags and CPU features."""
    text = "\n".join((
        source or _source(), _torch_install(), sysconfig.get_paths()["include"], _compiler(), platform.machine(),
        _cpu_flags(), " ".join(_cflags()),
    ))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _disabled() -> bool:
    return os.environ.get("KVBATON_KERNELS", "1").lower() in _OFF


def _openmp() -> list[str]:
    """``-fopenmp`` where torch runs its threads on OpenMP: ``at::parallel_for`` is a header template, and
    compiled without it every kernel's parallel loop runs on the calling thread alone. The library then
    needs ``libgomp.so.1``, which torch has already loaded (its own copy): one OpenMP runtime, one pool."""
    return ["-fopenmp"] if sys.platform.startswith("linux") and torch.backends.openmp.is_available() else []


def _cflags() -> list[str]:
    flags = ["-O3", "-march=native", "-fno-math-errno", *_openmp()]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-mprefer-vector-width=512")  # else GCC splits bf16 widening into 256-bit halves
    return flags


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    try:  # the `ninja` wheel's binary, which is not on PATH unless the venv is activated
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    text = _source()
    key = build_key(text)
    directory = cache_dir() / "kernels" / key
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        return _compile(directory, key, text, cpp_extension)


def _build_timeout() -> float:
    value = os.environ.get("KVBATON_KERNELS_BUILD_TIMEOUT")
    try:
        return float(value) if value else BUILD_TIMEOUT_S
    except ValueError:
        log.warning("KVBATON_KERNELS_BUILD_TIMEOUT=%r is not a number of seconds: using %.0f", value, BUILD_TIMEOUT_S)
        return BUILD_TIMEOUT_S


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s build lock: wait for another builder at most the build timeout, saying so."""
    lock = filelock.FileLock(directory / BUILD_LOCK)
    owner = directory / "build.owner"  # who holds the lock, for the message of whoever waits
    deadline = time.monotonic() + _build_timeout()
    while True:
        try:
            lock.acquire(timeout=min(WAIT_REPORT_S, max(0.0, deadline - time.monotonic())))
            break
        except filelock.Timeout:
            try:
                holder = owner.read_text().strip()
            except OSError:
                holder = "another process"
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{holder} has held the kernel build lock {directory / BUILD_LOCK} for over "
                    f"{_build_timeout():.0f} s (KVBATON_KERNELS_BUILD_TIMEOUT)"
                ) from None
            log.warning("waiting for %s, which is building kvbaton decode kernels in %s", holder, directory)
    try:
        owner.write_text(f"pid {os.getpid()}")
        # Nobody else is building here while we hold the flock: a cpp_extension lock file is a killed build's.
        stale = directory / STALE_LOCK
        if stale.exists():
            log.warning("removing %s, left by a kernel build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield
    finally:
        lock.release()


def _compile(directory: Path, key: str, text: str, cpp_extension: ModuleType) -> ModuleType:
    source = directory / SOURCE
    if not source.exists() or source.read_text() != text:
        # Atomically: a process of an older kvbaton, which took no build lock, may be compiling it right now.
        partial = directory / f".{SOURCE}.{os.getpid()}"
        partial.write_text(text)
        os.replace(partial, source)
    name = f"kvbaton_decode_{key}"
    built = _import_built(directory, name)
    if built is not None:
        return built
    cached = any(directory.glob("*.so"))
    if not cached:  # a warning, so that a user with default logging sees why this start takes a while
        log.warning("building kvbaton decode kernels (one time for this CPU and torch install, ~40 s) in %s",
                    directory)
    start = time.perf_counter()
    module = cpp_extension.load(
        name=name,
        sources=[str(source)],
        extra_cflags=_cflags(),
        extra_ldflags=_openmp(),
        build_directory=str(directory),
        verbose=False,
    )
    elapsed = time.perf_counter() - start
    if cached:
        log.info("kvbaton decode kernels loaded in %.1f s", elapsed)
    else:
        log.warning("kvbaton decode kernels built in %.1f s", elapsed)
    return module


def _import_built(directory: Path, name: str) -> ModuleType | None:
    """The module a finished build left in ``directory``, imported as it is, or None. The directory's key
    names the source, compiler, flags and torch, so its library is this source's: no ninja run (whose
    build file names the directory, so a moved or copied cache would rebuild). A library a killed link
    left half-written fails to import, and the build runs."""
    path = directory / f"{name}.so"
    if not path.exists():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError, AssertionError) as exc:
        log.warning("the built kernels in %s do not load (%s): building them again", directory, exc)
        return None
    log.info("kvbaton decode kernels loaded from %s", path)
    return module


def _first_error(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or [type(exc).__name__])[0 if errors else -1]


def status() -> str:
    """One line for `kvbaton info`, without building anything."""
    if _disabled():
        return "disabled by KVBATON_KERNELS"
    if "module" in _STATE:
        return "loaded"
    if "error" in _STATE:
        return f"unavailable ({_STATE['error']})"
    built = any((cache_dir() / "kernels" / build_key()).glob("*.so"))
    return "built for this CPU" if built else "not built yet (built at the first engine start, ~40 s)"


def unavailable_reason() -> str | None:
    """None when the kernels are (or can be) loaded here; else why not. Builds them on first call."""
    load()
    error = _STATE.get("error")
    return error if isinstance(error, str) else None


def load() -> ModuleType | None:
    """The compiled kernels module, or None (the reason logged once, see :func:`unavailable_reason`)."""
    with _LOCK:
        if not _STATE:
            if _disabled():
                _STATE["error"] = "disabled by KVBATON_KERNELS"
            else:
                try:
                    _STATE["module"] = _build()
                except Exception as exc:  # no compiler, no ninja, a failed build: oneDNN still works
                    _STATE["error"] = f"build failed: {_first_error(exc)}"
            if "error" in _STATE:
                log.warning("kvbaton decode kernels unavailable (%s): fused decode uses oneDNN", _STATE["error"])
        module = _STATE.get("module")
        return module if isinstance(module, ModuleType) else None
