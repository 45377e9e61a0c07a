"""vLLM as the agents benchmark's peer: its CPU build's OpenAI-compatible server, started and stopped
by the benchmark, and the workloads run on it turn by turn.

:class:`VllmPeer` starts ``PYTHON -m vllm.entrypoints.openai.api_server`` (a subprocess of vLLM's own
interpreter, ``--peer-vllm PYTHON``) on 127.0.0.1 in its own process group, on a vLLM-ready copy of
the local checkpoint (:func:`vllm_checkpoint`), fp32 only, with automatic prefix caching; it is
stopped when the benchmark ends, also on Ctrl-C or SIGTERM (:func:`sigterm_as_exit`), and a launcher
asks the kernel to stop it if the benchmark dies. :func:`run_vllm` runs the workloads through
``POST /v1/completions`` with the prompt as the token ids of kvbaton's ``chat_tokens`` (vLLM's own
rendering is checked against them: :func:`same_rendering`), greedy, EOS ignored, each workload
after ``POST /reset_prefix_cache``; :func:`vllm_turn_record` puts a turn in the kvbaton variants'
shape (reused = vLLM's ``cached_tokens``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbaton.bench.processes import dies_with_parent, free_port
from kvbaton.bench.record import note_own_cpu
from kvbaton.bench.workloads import Workload, run_workload

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


def _group_cpu(group: int, children: bool) -> float:
    """CPU seconds of the live processes of process group ``group`` (``children``: with what they reaped)."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == group:  # pgrp
            ticks += sum(int(x) for x in fields[11:15 if children else 13])  # utime, stime (cutime, cstime)
    return ticks / os.sysconf("SC_CLK_TCK")


def _reaped_children_cpu() -> float:
    times = os.times()
    return times.children_user + times.children_system


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
        iomp = Path(found["prefix"]) / "lib" / "libiomp5.so"
        if iomp.exists():  # as vLLM's CPU docs advise: the Intel OpenMP its venv ships, preloaded (faster here too)
            env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
        if self.log_path is None:
            self.log_path = Path(tempfile.mkdtemp(prefix="kvbaton-vllm-")) / "vllm-server.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            # SIGTERM when this benchmark's process dies, however it dies; Ctrl-C and normal exits stop it in `finally`.
            self.proc = subprocess.Popen(dies_with_parent([self.python, *args], python=self.python),
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
            "env": {k: env[k] for k in sorted(env) if k.startswith("VLLM_") or k in ("OMP_NUM_THREADS", "LD_PRELOAD")},
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
        # The group's CPU so far, and what of it reaches us as the reaped leader's: its workers, killed with the
        # group, may never be reaped through the leader, and would read as other load in the record.
        used = _group_cpu(group, children=True)
        reaped = _reaped_children_cpu()
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + VLLM_STOP_S
        while time.monotonic() < deadline and _group_alive(group, proc):
            time.sleep(0.2)
        if _group_alive(group, proc):
            _signal_group(group, signal.SIGKILL)
        proc.wait()
        note_own_cpu(used - (_reaped_children_cpu() - reaped))

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system) used so far by the server's live processes."""
        return _group_cpu(self.proc.pid, children=False) if self.proc is not None else 0.0

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
    """Every workload once on vLLM, each from a cold prefix cache; prompts are ``client.chat_tokens``. A
    map-reduce that kvbaton runs as a LangGraph app (``via == "langgraph"``) sends its map turns at once, as
    LangGraph's ``Send`` fan-out does, so vLLM batches them as it would in that app."""
    out: dict[str, Any] = {"variant": "vllm", "workloads": {}}
    for wl in workloads:
        peer.cold()
        records: dict[int, dict[str, Any]] = {}

        def timed(ids: list[int]) -> tuple[dict[str, Any], float]:  # the only part that runs in threads
            start = time.perf_counter()
            body = peer.complete(ids, max_tokens)
            return body, time.perf_counter() - start

        def ask(index: int, messages: list[dict[str, str]], wl: Workload = wl,
                records: dict[int, dict[str, Any]] = records) -> str:
            ids = client.chat_tokens(messages)
            body, seconds = timed(ids)
            records[index] = vllm_turn_record(body, ids, wl.turns[index].agent, index, seconds, client.tokenize)
            return str(records[index]["text"])

        start = time.perf_counter()
        if wl.via == "langgraph":
            maps = [i for i, t in enumerate(wl.turns) if t.part is not None]
            prompts = [client.chat_tokens(wl.messages(i, ())) for i in maps]  # the tokenizer stays on this thread
            with ThreadPoolExecutor(len(maps)) as pool:
                answers = list(pool.map(timed, prompts))
            for i, ids, (body, seconds) in zip(maps, prompts, answers, strict=True):
                records[i] = vllm_turn_record(body, ids, wl.turns[i].agent, i, seconds, client.tokenize)
            last = len(wl.turns) - 1
            ask(last, wl.messages(last, [records[i]["text"] for i in range(last)]))
        else:
            run_workload(wl, lambda agent, messages, records=records: ask(len(records), messages))
        seconds = time.perf_counter() - start
        out["workloads"][wl.name] = {"seconds": seconds, "turns": [records[i] for i in sorted(records)]}
    out["seconds"] = sum(w["seconds"] for w in out["workloads"].values())
    return out


@dataclass(frozen=True)
class PeerConfig:
    """How to run the ``vllm`` variant: vLLM's interpreter and where its files go."""

    python: str
    models_dir: Path | None = None  # the vLLM-ready checkpoint copy (default: <its venv>/kvbaton-models)
    log_path: Path | None = None  # the server's output (default: a temporary folder)
    startup_timeout: float = VLLM_STARTUP_TIMEOUT_S
