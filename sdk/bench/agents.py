"""Persona-first multi-agent workloads: exact reuse, approximate reuse and text replay side by side.

Every agent puts its own persona (system prompt) first and the shared document after it
(:mod:`kvbaton.bench.workloads`: ``debate``, ``chain``, ``fanout``), so exact prefix reuse finds an
agent's own earlier turns but never another agent's reading of the document; approximate reuse
(``reuse="auto"`` / ``"rotate"``) may place it from another agent's cache, re-aligned to the new
positions (``auto`` also recomputes its most-deviating tokens, or everything when the answer looks
unsure; ``rotate`` does no correction).

Variants, each on the embedded engine, side by side (``alternating`` repeats), per dtype:

- ``exact``: ``client.generate(messages, agent=..., reuse="exact")``: prefix cache, exact only;
- ``auto``: the same with ``reuse="auto"``; ``rotate``: with ``reuse="rotate"``;
- ``text``: text replay: ``client.complete(<the same chat's prompt tokens>)`` on an engine without a
  prefix cache, so every turn prefills everything.

One client per dtype serves exact/auto/rotate (a second one, without a prefix cache, serves text);
every variant and every workload inside it starts cold: the prefix cache flushed, the default anchor
pool cleared, no handle alive. A workload's result handles stay alive until the workload ends (as a
workflow holds them), then all are released. Greedy decoding, EOS ignored: every turn generates
exactly ``--max-tokens`` tokens.

Reported per dtype and variant: end-to-end seconds (min/median/max over ``--repeats``), the share of
prompt tokens reused exactly / approximately / prefilled (from ``Result.timings``, per agent too),
and fidelity against the ``exact`` variant:

- teacher-forced: each approximate variant runs again with every turn given the exact run's prompt
  (its transcript); its first generated token and its greedy tokens are compared with the exact
  run's output of that turn (first-token agreement, mean share of tokens identical before the first
  divergence). ``--tf-passes`` passes, pass ``p`` on documents of seed ``p``; only turns after each
  workload's first count (the first agent has no other agent's cache to reuse): a first-token claim
  needs at least 60 such turns (the default, 3 passes x 21 turns, gives 63);
- free-running: the share of turns whose whole text equals the exact run's (seed 0, first repeat).

KL: on the first teacher-forced pass, every approximated turn's handle (prompt and answer) is
measured with ``fidelity(handle, max_tokens=1)``: KL(dense || approximate) of the next-token
distribution against a dense prefill of the same tokens (untimed; a dense reference per turn costs a
full prefill, so later passes skip it).

Until ``reuse=`` exists on ``Client.generate`` (detected at run time), only ``exact`` and ``text``
run and the record says so.

Peer: ``--peer-vllm PYTHON`` (default ``$KVBATON_VLLM_PYTHON``; not run without either) adds the variant
``vllm``: vLLM's CPU build with automatic prefix caching, started by this benchmark as its
OpenAI-compatible server (``PYTHON -m vllm.entrypoints.openai.api_server``, a subprocess of that
interpreter on 127.0.0.1, stopped when the benchmark ends, also on Ctrl-C), on the same local checkpoint
(a copy re-keyed where vLLM needs it: :func:`vllm_checkpoint`), fp32 only. It runs the same workloads
turn by turn through ``POST /v1/completions`` with the prompt as the token ids of
``client.chat_tokens(messages)`` (vLLM's own chat rendering is checked against them, and recorded),
greedy, EOS ignored, after the same ~2.4K-token warm-up request; every workload starts with
``POST /reset_prefix_cache`` (the server's dev mode). Its reused share is vLLM's
``usage.prompt_tokens_details.cached_tokens``; its seconds include the HTTP round trip (the record
keeps vLLM's own per-request timings beside them). It takes part in the alternating repeats like the
kvbaton variants, and its free-running text is compared with ``exact``'s.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import socket
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbaton import SamplingParams
from kvbaton.bench import record
from kvbaton.bench.common import alternating, format_table
from kvbaton.bench.spread import cell, measured
from kvbaton.bench.workloads import WARMUP_TOKENS, WORKLOADS, Workload, build, run_workload, warmup_prompt
from tqdm.auto import tqdm

KVBATON_VARIANTS = ("exact", "auto", "rotate", "text")
VARIANTS = (*KVBATON_VARIANTS, "vllm")  # vllm: only with --peer-vllm
APPROXIMATE = ("auto", "rotate")
LABELS = {
    "exact": "exact reuse (prefix cache)",
    "auto": "reuse='auto' (re-align, recompute the most-deviating tokens)",
    "rotate": "reuse='rotate' (re-align only)",
    "text": "text replay (no prefix cache)",
    "vllm": "vLLM CPU build, automatic prefix caching (OpenAI server, token-id prompts)",
}
DEFAULT_DTYPES = ("float32", "bfloat16")
DEFAULT_REPEATS = 2
DEFAULT_TF_PASSES = 3
MIN_TF_TURNS = 60
KV_BUDGET = "4GiB"
KL_NOTE = ("KL(dense || approximate) of the next-token distribution after each approximated turn's prompt and "
           "answer, from `fidelity(handle, max_tokens=1)` (a dense prefill of the same tokens), on the first "
           "teacher-forced pass only (a dense reference per turn costs a full prefill); the time is not counted")


# -- the engine side -----------------------------------------------------------------------------------


def supports_reuse(client: Any) -> bool:
    """Whether ``client.generate`` takes ``reuse=`` (the keyword lands with approximate reuse)."""
    try:
        if "reuse" in inspect.signature(client.generate).parameters:
            return True
    except (TypeError, ValueError):
        pass
    try:  # a keyword taken through **options would show only by working
        probe = client.generate([{"role": "user", "content": "Hi"}], sampling=SamplingParams(max_tokens=1),
                                reuse="exact")
    except Exception:  # noqa: BLE001 - TypeError, or the sampling validator refusing an unknown field
        return False
    client.release(probe.handle)
    return True


def connect(dtype: str, prefix_cache: bool, quick: bool = False) -> Any:
    """An embedded client of ``dtype``, warmed up with the shared warm-up request."""
    import kvbaton

    client = kvbaton.connect(dtype=dtype, kv_budget=KV_BUDGET, prefix_cache=prefix_cache)
    warm = client.complete(warmup_prompt(quick), sampling=SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True))
    client.release(warm.handle)
    return client


def cold(client: Any) -> None:
    """Nothing cached, no anchors learned, no handle alive: the start of every variant and workload."""
    engine = client.engine
    audit = getattr(engine, "audit", None)
    if audit is not None:  # the sampled fidelity checks (on by default) finish before the next timed run
        audit.flush()
    engine.flush_cache()
    try:
        engine.anchor_pool().clear()
    except AttributeError:
        pass
    if client.stats().handles_live:
        raise RuntimeError("a handle outlived its workload: variants would not start cold")


def turn_record(result: Any, agent: str, index: int, seconds: float) -> dict[str, Any]:
    """What one turn cost and produced, from its ``Result``."""
    t = result.timings
    approx = int(getattr(t, "tokens_approximate", 0) or 0)
    segments = getattr(result, "segments", None) or []
    return {
        "index": index, "agent": agent, "seconds": seconds, "ttft_s": t.ttft_s,
        "prompt_tokens": t.tokens_reused + t.tokens_prefilled, "reused_exact": t.tokens_reused - approx,
        "reused_approx": approx, "prefilled": t.tokens_prefilled, "generated": t.tokens_generated,
        "exact": bool(getattr(result, "exact", True)),
        "segments": dict(Counter(str(getattr(s, "outcome", "?")) for s in segments)),
        "token_ids": list(result.token_ids), "text": result.text,
    }


def generate_fn(client: Any, variant: str, sampling: SamplingParams, reuse_kw: bool, held: list[Any],
                turns: list[dict[str, Any]], kl: bool = False) -> Callable[[str, list[dict[str, str]]], str]:
    """``generate_fn(agent, messages) -> text`` of one variant; keeps every handle and turn record
    (with ``kl``, the KL of approximate turns against dense prefill, untimed)."""
    def fn(agent: str, messages: list[dict[str, str]]) -> str:
        start = time.perf_counter()
        if variant == "text":
            result = client.complete(client.chat_tokens(messages), sampling=sampling, agent=agent)
        elif reuse_kw:
            result = client.generate(messages, sampling=sampling, agent=agent, reuse=variant)
        else:
            result = client.generate(messages, sampling=sampling, agent=agent)
        seconds = time.perf_counter() - start
        held.append(result.handle)
        turns.append(turn_record(result, agent, len(turns), seconds))
        if kl and not getattr(result, "exact", True):
            t0 = time.perf_counter()
            turns[-1]["kl"] = client.fidelity(result.handle, max_tokens=1).kl_first
            turns[-1]["seconds_kl"] = time.perf_counter() - t0
        return result.text

    return fn


def run_variant(client: Any, variant: str, workloads: Sequence[Workload], sampling: SamplingParams,
                reuse_kw: bool, teachers: dict[str, list[str]] | None = None, kl: bool = False) -> dict[str, Any]:
    """Every workload once with ``variant``, each from a cold engine: seconds and turn records."""
    out: dict[str, Any] = {"variant": variant, "workloads": {}}
    for wl in workloads:
        cold(client)
        held: list[Any] = []
        turns: list[dict[str, Any]] = []
        background = _background_forwards(client)
        start = time.perf_counter()
        run_workload(wl, generate_fn(client, variant, sampling, reuse_kw, held, turns, kl),
                     teacher=None if teachers is None else teachers[wl.name])
        # KL measurements are not part of the workload's time.
        seconds = time.perf_counter() - start - sum(t["seconds_kl"] for t in turns if "seconds_kl" in t)
        client.release(held)
        out["workloads"][wl.name] = {"seconds": seconds, "turns": turns,
                                     # the fidelity audit's forwards inside the timed run (it waits for a quiet engine)
                                     "background_forwards": _background_forwards(client) - background}
    out["seconds"] = sum(w["seconds"] for w in out["workloads"].values())
    return out


def _background_forwards(client: Any) -> int:
    scheduler = getattr(client.engine, "scheduler", None)
    return int(getattr(scheduler, "background_forwards", 0))


# -- vLLM as a peer -------------------------------------------------------------------------------------

VLLM_PYTHON_ENV = "KVBATON_VLLM_PYTHON"
VLLM_DTYPE = "float32"  # the peer comparison is fp32: the checkpoint's own precision on both engines
VLLM_MODEL_NAME = "kvbaton-peer"
VLLM_STARTUP_TIMEOUT_S = 300.0
VLLM_STOP_S = 10.0
# The server's environment: these defaults unless ours sets them (KV space in GiB; no core held back, so
# vLLM computes on every core as kvbaton does), and dev mode for POST /reset_prefix_cache.
VLLM_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
VLLM_ENV_FIXED = {"VLLM_SERVER_DEV_MODE": "1"}
VLLM_SKIPPED_DTYPE = "the vLLM comparison runs in float32 only (the checkpoint's own precision on both engines)"
# Run in the vLLM interpreter first: which vLLM and torch it has, from package metadata (fast: no import).
VLLM_PROBE = """
import importlib.metadata as m, json, sys
def version(*names):
    for name in names:
        try:
            return m.version(name)
        except m.PackageNotFoundError:
            pass
    return None
print(json.dumps({"vllm": version("vllm-cpu", "vllm"), "torch": version("torch"), "prefix": sys.prefix,
                  "python": sys.version.split()[0]}))
"""
# The server's launcher: asks the kernel for SIGTERM when this benchmark's process dies, however it dies
# (PR_SET_PDEATHSIG survives exec), then becomes the server. Ctrl-C and normal exits stop it in `finally`.
VLLM_SHIM = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit("kvbaton bench: the benchmark that started this vLLM server is already gone")
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def vllm_server_args(model_dir: str | os.PathLike[str], port: int) -> list[str]:
    """The server's flags (vLLM 0.32: requests are not logged unless asked for; no HTTP access log either)."""
    return ["--model", str(model_dir), "--served-model-name", VLLM_MODEL_NAME, "--dtype", VLLM_DTYPE,
            "--enable-prefix-caching", "--enforce-eager", "--gpu-memory-utilization", "0.5", "--max-model-len", "8192",
            "--enable-prompt-tokens-details", "--enable-per-request-metrics", "--disable-uvicorn-access-log",
            "--host", "127.0.0.1", "--port", str(port)]


def vllm_checkpoint(src: Path, root: Path) -> Path:
    """``src`` as vLLM loads it correctly: the same weights, re-keyed where needed (made once, under ``root``).

    kvbaton's converted checkpoint stores the tied embedding once, as ``lm_head.weight``, and its
    config has ``architectures: null``; vLLM's Llama would then leave ``embed_tokens`` unloaded
    (garbage output). The copy adds ``model.embed_tokens.weight`` (the same tensor) and names the
    architecture; tokenizer and other files are copied as they are. Runs here (torch and safetensors),
    not in vLLM's interpreter.
    """
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((src / "config.json").read_text())
    files = sorted(src.glob("*.safetensors"))
    keys: set[str] = set()
    for f in files:
        with safe_open(str(f), "pt") as st:
            keys |= set(st.keys())
    if "model.embed_tokens.weight" in keys and config.get("architectures"):
        return src
    dst = root / src.name
    if (dst / ".complete").is_file():
        return dst
    tmp = root / f".{src.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, tmp / f.name)
    config["architectures"] = config.get("architectures") or ["LlamaForCausalLM"]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tensors: dict[str, Any] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            tensors.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118 - a safetensors handle, not a dict
    if "model.embed_tokens.weight" not in tensors:
        tensors["model.embed_tokens.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / ".complete").write_text(f"re-keyed copy of {src}\n")
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group_alive(group: int, proc: subprocess.Popen[bytes]) -> bool:
    proc.poll()  # reap the leader once it exits, or it counts as alive
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit (so ``finally`` blocks run and stop the server); main thread only."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class VllmPeer:
    """vLLM's OpenAI-compatible server, run by another interpreter (``python``), and the calls made to it.

    ``start()`` makes the vLLM-ready checkpoint, starts the server in its own process group on a free
    port of 127.0.0.1 (its output to ``log_path``) and waits for ``/health``; ``stop()`` sends the group
    SIGTERM, then SIGKILL after ``VLLM_STOP_S``.
    """

    def __init__(self, python: str, source_dir: Path, models_dir: Path | None = None, log_path: Path | None = None,
                 startup_timeout: float = VLLM_STARTUP_TIMEOUT_S) -> None:
        self.python = python
        self.source_dir = Path(source_dir)
        self.models_dir = models_dir
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.http: Any = None
        self.can_reset = False
        self.info: dict[str, Any] = {}

    def probe(self) -> dict[str, Any]:
        try:
            out = subprocess.run([self.python, "-c", VLLM_PROBE], capture_output=True, text=True, timeout=120,
                                 check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"--peer-vllm {self.python}: cannot run it ({exc})") from exc
        if out.returncode != 0:
            raise RuntimeError(f"--peer-vllm {self.python}: it failed: {out.stderr.strip()[-800:]}")
        found: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        if not found.get("vllm"):
            raise RuntimeError(f"--peer-vllm {self.python}: no vLLM installed there "
                               "(bash scripts/peer_vllm.sh --setup-only builds a venv with it)")
        return found

    def start(self) -> dict[str, Any]:
        import tempfile

        import httpx

        found = self.probe()
        model_dir = vllm_checkpoint(self.source_dir, self.models_dir or Path(found["prefix"]) / "kvbaton-models")
        port = free_port()
        args = ["-m", "vllm.entrypoints.openai.api_server", *vllm_server_args(model_dir, port)]
        env = {**os.environ, **{k: os.environ.get(k, v) for k, v in VLLM_ENV_DEFAULTS.items()}, **VLLM_ENV_FIXED}
        if self.log_path is None:
            self.log_path = Path(tempfile.mkdtemp(prefix="kvbaton-vllm-")) / "vllm-server.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([self.python, "-c", VLLM_SHIM, str(os.getpid()), *args],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=httpx.Timeout(900.0, connect=10.0))
        self._wait_ready()
        startup_s = time.perf_counter() - started
        version = self.http.get("/version").json().get("version")
        self.can_reset = self.reset()
        self.info = {
            "engine": "vllm", "ran": True, "python": self.python, "prefix": found["prefix"],
            "python_version": found["python"], "version": version or found["vllm"], "package_version": found["vllm"],
            "torch": found["torch"], "server_command": [self.python, *args],
            "env": {k: env[k] for k in sorted(env) if k.startswith("VLLM_") or k in ("OMP_NUM_THREADS",)},
            "model_dir": str(self.source_dir), "vllm_model_dir": str(model_dir), "startup_s": startup_s,
            "reset_prefix_cache": self.can_reset,
            "cold_start": ("every workload starts with POST /reset_prefix_cache" if self.can_reset else
                           "no /reset_prefix_cache on this server: vLLM's prefix cache stays warm between workloads "
                           "and repeats (this favours vLLM)"),
            "log": str(self.log_path), "dtypes": [VLLM_DTYPE],
        }
        return self.info

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(Path(str(self.log_path)).read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def _wait_ready(self) -> None:
        import httpx

        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"the vLLM server ({self.python}) exited with code {code} before it was ready; "
                                   f"the end of its log {self.log_path}:\n{self.log_tail()}")
            try:
                if self.http.get("/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the vLLM server ({self.python}) was not ready after {self.startup_timeout:.0f} s "
                                   f"(--vllm-startup-timeout); the end of its log {self.log_path}:\n{self.log_tail()}")
            time.sleep(1.0)

    def stop(self) -> None:
        if self.http is not None:
            self.http.close()
            self.http = None
        proc, self.proc = self.proc, None
        if proc is None:
            return
        group = proc.pid  # start_new_session: the server leads its own process group (its workers in it)
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + VLLM_STOP_S
        while time.monotonic() < deadline and _group_alive(group, proc):
            time.sleep(0.2)
        if _group_alive(group, proc):
            _signal_group(group, signal.SIGKILL)
        proc.wait()

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system) used so far by the server's live processes."""
        if self.proc is None:
            return 0.0
        ticks = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == self.proc.pid:  # pgrp
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self.http.post(path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"vLLM {path} answered {response.status_code}: {response.text[:800]}")
        return response.json()

    def reset(self) -> bool:
        """Empty vLLM's prefix cache; False when the server has no such endpoint."""
        for _ in range(50):
            response = self.http.post("/reset_prefix_cache")
            if response.status_code == 404:
                return False
            if response.status_code != 200:
                raise RuntimeError(f"vLLM /reset_prefix_cache answered {response.status_code}: {response.text[:800]}")
            if response.json().get("success"):
                return True
            time.sleep(0.1)  # blocks still held by a request finishing
        raise RuntimeError("vLLM refused to reset its prefix cache 50 times in a row")

    def cold(self) -> None:
        if self.can_reset:
            self.reset()

    def complete(self, ids: Sequence[int], max_tokens: int) -> dict[str, Any]:
        body = {"model": VLLM_MODEL_NAME, "prompt": list(ids), "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        out: dict[str, Any] = self._post("/v1/completions", body)
        return out

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """vLLM's own rendering of a chat (its chat template, no special tokens added): kvbaton's check."""
        body = {"model": VLLM_MODEL_NAME, "messages": messages, "add_generation_prompt": True,
                "add_special_tokens": False}
        return list(self._post("/tokenize", body)["tokens"])

    def warm_up(self, ids: Sequence[int], tokens: int) -> None:
        """The kvbaton variants' warm-up request, then a cold cache."""
        self.complete(ids, tokens)
        self.cold()


def same_rendering(peer: VllmPeer, client: Any, workloads: Sequence[Workload]) -> dict[str, bool]:
    """Per workload: does vLLM render its first and last turn's chat to kvbaton's ``chat_tokens``?"""
    out = {}
    for wl in workloads:
        last = len(wl.turns) - 1
        chats = [wl.messages(0, []), wl.messages(last, ["An earlier answer, quoted."] * last)]
        out[wl.name] = all(peer.render(m) == client.chat_tokens(m) for m in chats)
    return out


def vllm_turn_record(body: dict[str, Any], prompt_ids: Sequence[int], agent: str, index: int, seconds: float,
                     tokenize: Callable[[str], list[int]]) -> dict[str, Any]:
    """One vLLM turn in the kvbaton variants' shape: reused = vLLM's cached prompt tokens (exact)."""
    choice = body["choices"][0]
    usage = body.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    prompt = int(usage.get("prompt_tokens") or len(prompt_ids))
    reused = int(cached or 0)
    ids = choice.get("token_ids")
    metrics = body.get("metrics") or {}
    parts = [metrics.get(k) for k in ("queue_time_ms", "time_to_first_token_ms", "generation_time_ms")]
    return {
        "index": index, "agent": agent, "seconds": seconds,
        "ttft_s": None if metrics.get("time_to_first_token_ms") is None else metrics["time_to_first_token_ms"] / 1000,
        "server_s": sum(parts) / 1000 if all(p is not None for p in parts) else None,
        "prompt_tokens": prompt, "reused_exact": reused, "reused_approx": 0, "prefilled": prompt - reused,
        "generated": int(usage.get("completion_tokens") or len(ids or [])), "exact": True, "segments": {},
        "token_ids": list(ids) if ids is not None else tokenize(choice["text"]),
        "token_ids_from": "vllm" if ids is not None else "kvbaton's tokenizer on vLLM's text",
        "cached_tokens_reported": cached is not None, "text": choice["text"],
    }


def run_vllm(peer: VllmPeer, client: Any, workloads: Sequence[Workload], max_tokens: int) -> dict[str, Any]:
    """Every workload once on vLLM, each from a cold prefix cache; prompts are ``client.chat_tokens``."""
    out: dict[str, Any] = {"variant": "vllm", "workloads": {}}
    for wl in workloads:
        peer.cold()
        turns: list[dict[str, Any]] = []

        def fn(agent: str, messages: list[dict[str, str]], turns: list[dict[str, Any]] = turns) -> str:
            start = time.perf_counter()
            ids = client.chat_tokens(messages)
            body = peer.complete(ids, max_tokens)
            seconds = time.perf_counter() - start
            turns.append(vllm_turn_record(body, ids, agent, len(turns), seconds, client.tokenize))
            return str(turns[-1]["text"])

        start = time.perf_counter()
        run_workload(wl, fn)
        out["workloads"][wl.name] = {"seconds": time.perf_counter() - start, "turns": turns}
    out["seconds"] = sum(w["seconds"] for w in out["workloads"].values())
    return out


# -- fidelity and shares -------------------------------------------------------------------------------


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(run: dict[str, Any], reference: dict[str, Any], max_tokens: int) -> list[dict[str, Any]]:
    """Turn by turn against the reference run: first token, greedy prefix, whole text (every turn
    after each workload's first: those are the turns that could reuse another agent's cache)."""
    out = []
    for name, wl in run["workloads"].items():
        ref_turns = reference["workloads"][name]["turns"]
        for mine, ref in zip(wl["turns"], ref_turns, strict=True):
            if mine["index"] == 0:
                continue
            out.append({"workload": name, "index": mine["index"], "agent": mine["agent"],
                        "first_token": mine["token_ids"][:1] == ref["token_ids"][:1],
                        "prefix": common_prefix(mine["token_ids"], ref["token_ids"]) / max_tokens,
                        "same_text": mine["text"] == ref["text"], "approximated": mine["reused_approx"] > 0})
    return out


def agreement(turns: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(turns)
    return {
        "turns": n, "turns_approximated": sum(t["approximated"] for t in turns),
        "first_token": sum(t["first_token"] for t in turns) / n if n else None,
        "prefix": statistics.fmean(t["prefix"] for t in turns) if n else None,
        "same_text": sum(t["same_text"] for t in turns) / n if n else None,
    }


def kl_summary(values: list[float] | None) -> dict[str, Any] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"turns": len(values), "mean": statistics.fmean(values), "median": statistics.median(values),
            "max": ordered[-1], "values": values}


def shares(turns: Sequence[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(t["prompt_tokens"] for t in turns)
    totals = {k: sum(t[k] for t in turns) for k in ("reused_exact", "reused_approx", "prefilled")}
    return {"turns": len(turns), "prompt_tokens": prompt, **totals,
            **{f"{k}_share": v / prompt if prompt else 0.0 for k, v in totals.items()}}


def per_agent(run: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, list[dict[str, Any]]] = {}
    for name, wl in run["workloads"].items():
        for t in wl["turns"]:
            found.setdefault(f"{name}/{t['agent']}", []).append(t)
    return {key: shares(turns) for key, turns in found.items()}


def all_turns(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for wl in run["workloads"].values() for t in wl["turns"]]


# -- the benchmark ---------------------------------------------------------------------------------


def workloads_of(names: Sequence[str], seed: int, quick: bool) -> list[Workload]:
    return [build(name, seed, quick) for name in names]


@dataclass(frozen=True)
class PeerConfig:
    """How to run the ``vllm`` variant: vLLM's interpreter and where its files go."""

    python: str
    models_dir: Path | None = None  # the vLLM-ready checkpoint copy (default: <its venv>/kvbaton-models)
    log_path: Path | None = None  # the server's output (default: a temporary folder)
    startup_timeout: float = VLLM_STARTUP_TIMEOUT_S


def run_dtype(dtype: str, names: Sequence[str], repeats: int, tf_passes: int, max_tokens: int, quick: bool,
              variants: Sequence[str], peer_config: PeerConfig | None = None) -> dict[str, Any]:
    """Every chosen variant of ``dtype``, alternating, then the teacher-forced passes; its rows. A vLLM
    server (``peer_config``, float32) lives only while the alternating repeats run."""
    with sigterm_as_exit():  # SIGTERM too ends in the `finally` that stops the server
        return _run_dtype(dtype, names, repeats, tf_passes, max_tokens, quick, variants, peer_config)


def _run_dtype(dtype: str, names: Sequence[str], repeats: int, tf_passes: int, max_tokens: int, quick: bool,
               variants: Sequence[str], peer_config: PeerConfig | None) -> dict[str, Any]:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    use_vllm = peer_config is not None and "vllm" in variants and dtype == VLLM_DTYPE
    cached = connect(dtype, prefix_cache=True, quick=quick)
    plain = connect(dtype, prefix_cache=False, quick=quick) if "text" in variants else None
    peer: VllmPeer | None = None
    record.watch_kv(f"engine {dtype}", record.pool_bytes(cached.engine))
    if plain is not None:
        record.watch_kv(f"engine {dtype} text", record.pool_bytes(plain.engine))
    try:
        reuse_kw = supports_reuse(cached)
        chosen = [v for v in variants if v in ("exact", "text") or (v in APPROXIMATE and reuse_kw)
                  or (v == "vllm" and use_vllm)]
        skipped = [v for v in variants if v not in chosen and v != "vllm"]
        base = workloads_of(names, 0, quick)
        peer_info: dict[str, Any] | None = None
        if use_vllm:
            assert peer_config is not None
            peer = VllmPeer(peer_config.python, Path(cached.engine.loaded.path), peer_config.models_dir,
                            peer_config.log_path, peer_config.startup_timeout)
            print(f"agents: starting vLLM ({peer_config.python}); its log: {peer.log_path or 'a temporary file'}",
                  flush=True)
            peer_info = dict(peer.start())
            print(f"agents: vLLM {peer_info['version']} ready in {peer_info['startup_s']:.0f} s", flush=True)
            peer.warm_up(cached.tokenize(warmup_prompt(quick)), WARMUP_TOKENS)
            peer_info["same_prompt_ids_as_kvbaton"] = same_rendering(peer, cached, base)
            peer_info["server_cpu_s_during_kvbaton"] = 0.0
            peer_info["kvbaton_variants_s"] = 0.0
        client_of = {v: plain if v == "text" else cached for v in chosen}
        progress = tqdm(total=repeats * len(chosen), desc=f"agents {dtype}", unit="variant run")

        def side(v: str) -> Callable[[], dict[str, Any]]:
            def go() -> dict[str, Any]:
                if v == "vllm":
                    assert peer is not None
                    out = run_vllm(peer, cached, base, max_tokens)
                else:
                    cpu = peer.cpu_seconds() if peer is not None else 0.0
                    out = run_variant(client_of[v], v, base, sampling, reuse_kw)
                    if peer is not None and peer_info is not None:  # an idle server should not compete
                        peer_info["server_cpu_s_during_kvbaton"] += peer.cpu_seconds() - cpu
                        peer_info["kvbaton_variants_s"] += out["seconds"]
                progress.update()
                return out
            return go

        runs = alternating(repeats, {v: side(v) for v in chosen})
        progress.close()
        if peer is not None:  # the teacher-forced passes below are kvbaton's alone
            peer.stop()
        exact_ref = runs["exact"][0]
        tf: dict[str, list[dict[str, Any]]] = {v: [] for v in chosen if v in APPROXIMATE and tf_passes > 0}
        tf_seconds: dict[str, list[float]] = {v: [] for v in tf}
        kls: dict[str, list[float]] = {v: [] for v in tf}
        if tf:
            for p in tqdm(range(tf_passes), desc=f"agents {dtype} teacher-forced", unit="pass"):
                wls = base if p == 0 else workloads_of(names, p, quick)
                ref = exact_ref if p == 0 else run_variant(cached, "exact", wls, sampling, reuse_kw)
                teachers = {name: [t["text"] for t in ref["workloads"][name]["turns"]] for name in names}
                for v in tf:
                    forced = run_variant(cached, v, wls, sampling, reuse_kw, teachers=teachers, kl=p == 0)
                    kls[v] += [t["kl"] for w in forced["workloads"].values() for t in w["turns"] if "kl" in t]
                    tf[v] += [{**c, "pass": p} for c in compare(forced, ref, max_tokens)]
                    tf_seconds[v].append(forced["seconds"])
        rows = []
        for v in chosen:
            first = runs[v][0]
            row: dict[str, Any] = {"dtype": dtype, "variant": v, "label": LABELS[v], "repeats": repeats}
            measured(row, "end_to_end_s", [r["seconds"] for r in runs[v]])
            for name in names:
                measured(row, f"{name}_s", [r["workloads"][name]["seconds"] for r in runs[v]])
            turns = all_turns(first)
            row.update({
                "shares": shares(turns),
                "downstream_shares": {name: shares([t for t in first["workloads"][name]["turns"] if t["index"] > 0])
                                      for name in names},
                "per_agent": per_agent(first),
                "results_not_exact": sum(not t["exact"] for t in turns),
                "segments": dict(sum((Counter(t["segments"]) for t in turns), Counter())),
                "free_running": agreement(compare(first, exact_ref, max_tokens)),
                "teacher_forced": agreement(tf[v]) if v in tf else None,
                "teacher_forced_turns": tf.get(v),
                "teacher_forced_seconds": tf_seconds.get(v),
                "kl": kl_summary(kls.get(v)),
                "run_detail": first,
            })
            if v == "vllm":
                server = [t["server_s"] for t in turns]
                row["vllm"] = {
                    "turn_seconds": sum(t["seconds"] for t in turns),
                    "server_seconds": sum(server) if all(s is not None for s in server) else None,
                    "cached_tokens_reported": all(t["cached_tokens_reported"] for t in turns),
                    "token_ids_from": sorted({t["token_ids_from"] for t in turns}),
                }
            rows.append(row)
        by = {r["variant"]: r for r in rows}
        for r in rows:  # ratios of medians: the other variant's time over this one's (above 1: this one is faster)
            for ref in ("text", "exact", "vllm"):
                other = by.get(ref)
                r[f"speedup_vs_{ref}"] = other["end_to_end_s"] / r["end_to_end_s"] if other else None
            r["speedup_by_workload"] = {name: {f"vs_{ref}": by[ref][f"{name}_s"] / r[f"{name}_s"]
                                               for ref in ("text", "exact", "vllm") if ref in by} for name in names}
        cold(cached)  # the last checks the audit sampled run (untimed), so its record below is complete
        audit = getattr(cached.stats(), "audit", None)
        documents = {wl.name: len(cached.tokenize(wl.document)) for wl in base}
        personas = {wl.name: {a.name: len(cached.tokenize(a.persona)) for a in wl.agents.values()} for wl in base}
        return {"rows": rows, "reuse_supported": reuse_kw, "skipped_variants": skipped,
                "document_tokens": documents, "persona_tokens": personas, "peer": peer_info,
                "audit": audit.model_dump() if audit is not None else None}
    finally:
        if peer is not None:
            peer.stop()
        cached.close()
        if plain is not None:
            plain.close()


def run(dtypes: Sequence[str] = DEFAULT_DTYPES, names: Sequence[str] = tuple(WORKLOADS), repeats: int = DEFAULT_REPEATS,
        tf_passes: int = DEFAULT_TF_PASSES, max_tokens: int = 32, quick: bool = False,
        variants: Sequence[str] = KVBATON_VARIANTS, peer: PeerConfig | None = None) -> dict[str, Any]:
    """``peer``: run the ``vllm`` variant too (float32 only), added to ``variants`` when missing."""
    if "exact" not in variants:
        raise ValueError("the exact variant is the fidelity reference: it always runs")
    if "vllm" in variants and peer is None:
        raise ValueError("the vllm variant needs a PeerConfig (--peer-vllm)")
    if peer is not None:
        variants = list(dict.fromkeys([*variants, "vllm"]))
    per_dtype = {d: run_dtype(d, names, repeats, tf_passes, max_tokens, quick, variants, peer) for d in dtypes}
    first = per_dtype[dtypes[0]]
    wls = workloads_of(names, 0, quick)
    if peer is None:
        peer_record: dict[str, Any] = {"engine": "vllm", "ran": False,
                                       "reason": "not asked for (--peer-vllm PYTHON or $" + VLLM_PYTHON_ENV + ")"}
    elif VLLM_DTYPE in dtypes:
        peer_record = dict(per_dtype[VLLM_DTYPE]["peer"] or {})
    else:
        peer_record = {"engine": "vllm", "ran": False, "reason": VLLM_SKIPPED_DTYPE}
    if peer is not None:
        peer_record["skipped_dtypes"] = {d: VLLM_SKIPPED_DTYPE for d in dtypes if d != VLLM_DTYPE}
    return {
        "benchmark": "agents",
        "dtypes": list(dtypes),
        "workloads": list(names),
        "turns_per_workload": {wl.name: len(wl.turns) for wl in wls},
        "workload_meta": {wl.name: wl.meta for wl in wls},
        "document_tokens": first["document_tokens"],
        "persona_tokens": first["persona_tokens"],
        "max_tokens": max_tokens,
        "repeats": repeats,
        "tf_passes": tf_passes,
        "min_tf_turns": MIN_TF_TURNS,
        "reuse_supported": all(p["reuse_supported"] for p in per_dtype.values()),
        "skipped_variants": sorted({v for p in per_dtype.values() for v in p["skipped_variants"]}),
        "kl": {"measured": True, "reason": KL_NOTE},
        "peer": peer_record,
        "audit": {d: p["audit"] for d, p in per_dtype.items()},
        "rows": [r for p in per_dtype.values() for r in p["rows"]],
    }


# -- tables --------------------------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value else "-"


def table(payload: dict[str, Any]) -> str:
    names = payload["workloads"]
    peer = any(r.get("speedup_vs_vllm") for r in payload["rows"])
    columns = ["dtype", "variant", "end-to-end s", "vs text", "vs exact", *(["vs vLLM"] if peer else []),
               *(f"{n} s" for n in names), "reused exact", "reused approx", "prefilled", "TF 1st token",
               f"TF {payload['max_tokens']}-token prefix", "TF turns", "free-running same text"]
    rows = []
    for r in payload["rows"]:
        s, tf = r["shares"], r.get("teacher_forced")
        rows.append([r["dtype"], r["variant"], cell(r, "end_to_end_s", 2), _ratio(r.get("speedup_vs_text")),
                     _ratio(r.get("speedup_vs_exact")) if r["variant"] != "exact" else "-",
                     *([_ratio(r.get("speedup_vs_vllm")) if r["variant"] != "vllm" else "-"] if peer else []),
                     *(cell(r, f"{n}_s", 2) for n in names), _pct(s["reused_exact_share"]),
                     _pct(s["reused_approx_share"]), _pct(s["prefilled_share"]),
                     _pct(tf["first_token"]) if tf else "-", _pct(tf["prefix"]) if tf else "-",
                     f"{tf['turns']} ({tf['turns_approximated']} approx.)" if tf else "-",
                     _pct(r["free_running"]["same_text"]) if r["variant"] != "exact" else "-"])
    title = "Prompt tokens per agent, reused exactly / approximately / prefilled (first repeat):"
    parts = [format_table(columns, rows), "", title, "", agent_table(payload)]
    return "\n".join(parts)


def agent_table(payload: dict[str, Any]) -> str:
    variants = list(dict.fromkeys(r["variant"] for r in payload["rows"]))
    by = {(r["dtype"], r["variant"]): r for r in payload["rows"]}
    rows = []
    for dtype in payload["dtypes"]:
        keys = list(by[(dtype, "exact")]["per_agent"]) if (dtype, "exact") in by else []
        for key in keys:
            cells = []
            for v in variants:
                a = by.get((dtype, v), {}).get("per_agent", {}).get(key)
                cells.append("-" if a is None else f"{_pct(a['reused_exact_share'])} / {_pct(a['reused_approx_share'])}"
                             f" / {_pct(a['prefilled_share'])}")
            turns = by[(dtype, "exact")]["per_agent"][key]
            rows.append([dtype, key, turns["turns"], round(turns["prompt_tokens"] / turns["turns"]), *cells])
    return format_table(["dtype", "workload/agent", "turns", "prompt tok/turn", *variants], rows)


def notes(payload: dict[str, Any]) -> list[str]:
    """Lines under the table in docs/results.md."""
    lines = [
        "documents: " + ", ".join(f"{k} {v} tokens" for k, v in payload["document_tokens"].items())
        + f"; {payload['max_tokens']} greedy tokens per turn; turns per repetition: "
        + ", ".join(f"{k} {v}" for k, v in payload["turns_per_workload"].items()),
    ]
    for r in payload["rows"]:
        tf = r.get("teacher_forced")
        if tf:
            enough = tf["turns"] >= payload.get("min_tf_turns", MIN_TF_TURNS)
            kl = r.get("kl")
            if kl:
                lines.append(f"{r['dtype']} {r['variant']}: KL(dense || approximate) after {kl['turns']} approximated "
                             f"turns: mean {kl['mean']:.4f}, median {kl['median']:.4f}, max {kl['max']:.4f} nats")
            lines.append(f"{r['dtype']} {r['variant']}: teacher-forced first-token agreement {_pct(tf['first_token'])} "
                         f"over {tf['turns']} reusing-agent turns ({tf['turns_approximated']} approximated) — "
                         + ("enough turns for a first-token claim" if enough else
                            f"**fewer than {payload.get('min_tf_turns', MIN_TF_TURNS)} turns: no first-token claim**"))
    for dtype, audit in (payload.get("audit") or {}).items():
        if audit:
            inside = sum(w.get("background_forwards", 0) for r in payload["rows"] if r["dtype"] == dtype
                         for w in r["run_detail"]["workloads"].values())
            lines.append(f"{dtype}: the fidelity audit checked {audit['checked']} approximate answers against dense "
                         f"prefill ({audit['agreed']} agreed, {audit['dropped']} dropped); it waits for a quiet engine, "
                         f"so the checks ran between workloads, untimed ({inside} of its forwards fell inside the "
                         "timed first repeat)")
    if payload.get("skipped_variants"):
        lines.append("not run: " + ", ".join(payload["skipped_variants"]) + " (this engine's generate() has no reuse= "
                     "keyword)")
    lines += peer_notes(payload)
    lines.append("KL: " + payload.get("kl", {}).get("reason", KL_NOTE))
    return lines


def peer_notes(payload: dict[str, Any]) -> list[str]:
    """What the ``vllm`` row is, how it ran, and what favours either side."""
    peer = payload.get("peer") or {}
    if not peer.get("ran"):
        return [f"vllm: not in this run: {peer.get('reason', 'no --peer-vllm')}"] if peer else []
    row = next((r for r in payload["rows"] if r["variant"] == "vllm"), None)
    same = peer.get("same_prompt_ids_as_kvbaton") or {}
    env = ", ".join(f"{k}={v}" for k, v in (peer.get("env") or {}).items())
    server = peer.get("server_command") or []
    lines = [
        f"vllm: vLLM {peer.get('version')} (CPU build, torch {peer.get('torch')}), its OpenAI-compatible server started "
        f"by this run: `{' '.join(server)}` with {env}; {VLLM_DTYPE} only; ready in {peer['startup_s']:.0f} s "
        "(not counted); prompts are kvbaton's `chat_tokens` ids, greedy, EOS ignored, after the same ~2.4K-token warm-up request; "
        "vLLM's own rendering of the same chats gives " + ("the same ids" if same and all(same.values()) else
                                                            f"**different ids** ({same})"),
        f"vllm: cold start: {peer.get('cold_start')}",
    ]
    if row is not None:
        v = row.get("vllm") or {}
        timing = "vllm: its seconds are the client's, HTTP on 127.0.0.1 included (kvbaton runs in-process)"
        if v.get("server_seconds") is not None and v.get("turn_seconds"):
            timing += (f"; vLLM's own per-request timings (queue + prefill + decode) are "
                       f"{_pct(v['server_seconds'] / v['turn_seconds'])} of them (first repeat)")
        lines.append(timing)
        reuse = ("vLLM's `usage.prompt_tokens_details.cached_tokens`, counted as exact reuse"
                 if v.get("cached_tokens_reported") else "**vLLM reported no cached_tokens: its reuse reads 0**")
        lines.append(f"vllm: reused = {reuse}; output token ids from {', '.join(v.get('token_ids_from') or ['?'])}; "
                     f"free-running same text as kvbaton exact in {_pct(row['free_running']['same_text'])} of "
                     f"{row['free_running']['turns']} reusing-agent turns, same first token in "
                     f"{_pct(row['free_running']['first_token'])}")
    if peer.get("kvbaton_variants_s"):
        lines.append(f"vllm: the idle server used {peer['server_cpu_s_during_kvbaton']:.1f} CPU-seconds while the kvbaton "
                     f"variants ran ({peer['kvbaton_variants_s']:.0f} s)")
    for dtype, why in (peer.get("skipped_dtypes") or {}).items():
        lines.append(f"vllm: not run for {dtype}: {why}")
    return lines


def main(argv: list[str] | None = None) -> None:
    from kvbaton.bench.headline import targets

    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench agents", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=list(DEFAULT_DTYPES), choices=["float32", "bfloat16"],
                        help="engine dtypes, one client each (default: both)")
    parser.add_argument("--only", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS), metavar="WORKLOAD",
                        help=f"workloads to run (default all: {', '.join(WORKLOADS)})")
    parser.add_argument("--variants", nargs="+", default=list(KVBATON_VARIANTS), choices=list(VARIANTS),
                        help="variants to run (exact always runs: it is the fidelity reference; vllm runs whenever "
                             "--peer-vllm is given)")
    parser.add_argument("--peer-vllm", metavar="PYTHON", default=os.environ.get(VLLM_PYTHON_ENV) or None,
                        help=f"the python of a venv with vLLM's CPU build (scripts/peer_vllm.sh builds one): adds the "
                             f"variant vllm, its OpenAI server started from it, float32 only (default: "
                             f"${VLLM_PYTHON_ENV} if set, else no vllm; '' turns it off)")
    parser.add_argument("--vllm-models", type=Path, default=None,
                        help="where the vLLM-ready copy of the checkpoint is made once (default: <vLLM venv>/kvbaton-models)")
    parser.add_argument("--vllm-startup-timeout", type=float, default=VLLM_STARTUP_TIMEOUT_S,
                        help=f"seconds to wait for the vLLM server's /health (default {VLLM_STARTUP_TIMEOUT_S:.0f})")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed repetitions of every variant, alternating (default {DEFAULT_REPEATS}; "
                             "1 with --quick)")
    parser.add_argument("--tf-passes", type=int, default=None,
                        help=f"teacher-forced passes of each approximate variant, pass p on documents of seed p "
                             f"(default {DEFAULT_TF_PASSES}: 63 reusing-agent turns; 1 with --quick; 0: none)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="greedy tokens per turn, EOS ignored (default 32; 4 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: short documents, fewer turns, 1 repeat, 1 teacher-forced pass")
    record.add_arguments(parser, "agents")
    args = parser.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else DEFAULT_REPEATS)
    tf_passes = args.tf_passes if args.tf_passes is not None else (1 if args.quick else DEFAULT_TF_PASSES)
    max_tokens = args.max_tokens if args.max_tokens is not None else (4 if args.quick else 32)
    if repeats < 1 or tf_passes < 0 or max_tokens < 1:
        parser.error("--repeats and --max-tokens must be >= 1, --tf-passes >= 0")
    if "vllm" in args.variants and not args.peer_vllm:
        parser.error(f"the vllm variant needs --peer-vllm PYTHON (or ${VLLM_PYTHON_ENV})")
    variants = list(dict.fromkeys(["exact", *(v for v in args.variants if v != "vllm")]))
    args.quick_record = args.quick_record or args.quick  # a smoke run is never published
    with record.Recording.from_args("agents", args, argv) as rec:
        peer = None
        if args.peer_vllm:
            peer = PeerConfig(args.peer_vllm, args.vllm_models, rec.out_dir / "vllm-server.log",
                              args.vllm_startup_timeout)
        payload = run(args.dtypes, args.only, repeats, tf_passes, max_tokens, args.quick, variants, peer)
        print(table(payload))
        print()
        for line in notes(payload):
            print(f"- {line}")
        print()
        for target in targets(payload):
            print(target.line())
        print(f"\nwritten: {rec.write(payload)}")
