"""The coordinator of a multi-device server: one worker process per device, one engine interface.

:class:`Cluster` offers the :class:`~kvbaton.backend.Engine` methods the server and the embedded
client use (``materialize``, ``resume_stream``, ``release``, ``stats``...), so ``kvbaton serve
--devices cpu,cpu`` and ``EmbeddedClient(engine=Cluster(...))`` work unchanged. It keeps, for every
handle, its latest metadata (lineage included) and the worker holding its KV, and:

- routes each request (:mod:`.placement`): to the handle's worker, or the worker with the longest
  cached prefix, balanced by queue length;
- brings a handle to another worker when placement or an explicit :meth:`transfer` asks, by KV
  transfer over torch.distributed (:mod:`.transfer`) or by recompute from lineage, whichever the
  calibrated cost model (:mod:`.costmodel`) predicts cheaper; the decision, predicted and actual
  times go into ``stats().cluster``;
- survives worker failures: requests in flight on a dead worker are re-run on another one (a
  stream that already sent text is continued only when its sampling is deterministic), and handles
  that lived only there are recomputed from their lineage on next use.

A dead worker is not restarted (the process group cannot take a new member); the cluster goes on
with the others.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import json
import logging
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any, TypeVar

from kvbaton.capabilities import KVBATON, Capabilities
from kvbaton.errors import HandleNotFound, HandleReleased, IncompatibleHandle, InvalidRequest, KvbatonError, ServerError
from kvbaton.handle import Handle, LineageStep, Op, Placement, Segment
from kvbaton.ops import Context, HandleLike, Messages, ste_map
from kvbaton.stream import TokenStream
from kvbaton.types import (
    AgentInfo,
    ClusterStats,
    Composition,
    PlacementDecision,
    Result,
    SamplingParams,
    Stats,
    StreamChunk,
    WorkerStats,
)

from .costmodel import Calibration, CostModel, fit_line, load_cached, store_cached
from .handles import HandleTable, Identity
from .loader import cache_dir
from .placement import Placer
from .worker import (
    CLUSTER_KEY_ENV,
    DEFAULT_CLUSTER_KEY,
    DIST_BACKEND_ENV,
    WorkerClient,
    WorkerLost,
    cluster_key,
    default_backend,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

STARTUP_TIMEOUT_S = 600.0
PROBE_PREFILL_TOKENS = (32, 256)


@dataclass(frozen=True)
class ModelInfo:
    """What the server reads of ``engine.loaded``."""

    name: str
    fingerprint: str
    tokenizer_fingerprint: str
    max_context: int
    vocab_size: int


@dataclass(eq=False)
class _Placed:
    """A live handle of the cluster: its latest metadata (lineage included), the worker holding its
    KV (None: lost with its worker, recomputed from lineage on next use), and the lock serializing
    moves of it."""

    meta: Handle
    rank: int | None
    lock: threading.Lock = field(default_factory=threading.Lock)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


class Cluster:
    """Workers on ``devices`` (ranks ``0..len(devices)-1``, this machine) plus, for multi-node,
    ranks ``len(devices)..world_size-1`` started elsewhere (``kvbaton serve --rank R``) that join
    through ``master_addr:master_port`` (torch.distributed) and ``master_addr:control_port``."""

    def __init__(
        self,
        devices: Sequence[str] = ("cpu", "cpu"),
        model: str | None = None,
        *,
        engine_options: dict[str, Any] | None = None,
        world_size: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        control_port: int | None = None,
        bandwidth_cap: float | None = None,
        calibrate: bool = True,
        calibration_cache: str | os.PathLike[str] | None = "default",
        balance_slack: int = 1,
        worker_log_level: str = "warning",
        worker_threads: int | None = None,
        startup_timeout: float = STARTUP_TIMEOUT_S,
    ) -> None:
        devices = list(devices)
        if not devices:
            raise InvalidRequest("a cluster needs at least one local device")
        world = world_size if world_size is not None else len(devices)
        if world < len(devices):
            raise InvalidRequest(f"world size {world} is smaller than the {len(devices)} local devices")
        addr = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        if not _is_loopback(addr) and os.environ.get(CLUSTER_KEY_ENV, DEFAULT_CLUSTER_KEY) == DEFAULT_CLUSTER_KEY:
            raise InvalidRequest(f"a multi-node cluster needs a shared secret in ${CLUSTER_KEY_ENV} on every node")
        port = master_port or int(os.environ.get("MASTER_PORT") or 0) or free_port()
        ctl = control_port or int(os.environ.get("KVBATON_CONTROL_PORT") or 0) or (port + 1 if world > len(devices) else free_port())
        self.devices = devices
        self.world_size = world
        self.master = (addr, port)
        self.control = (addr, ctl)
        self.bandwidth_cap = bandwidth_cap
        self.placer = Placer(slack=balance_slack)
        self.costs = CostModel()
        self.retries = 0
        self._lock = threading.RLock()
        self._transfer_lock = threading.Lock()
        self._table: HandleTable[_Placed] = HandleTable()  # its identity is known once the workers joined
        self._procs: list[subprocess.Popen[bytes]] = []
        self.workers: list[WorkerClient] = []
        # Single node: a fresh secret per cluster, handed to the workers we start (nobody else can
        # pose as a worker or the coordinator). Multi-node: the shared $KVBATON_CLUSTER_KEY.
        local = world == len(devices) and CLUSTER_KEY_ENV not in os.environ
        self._key = secrets.token_hex(16).encode() if local else cluster_key()
        self._listener = Listener(self.control, authkey=self._key)
        try:
            self._start_local(model, engine_options or {}, worker_log_level, worker_threads)
            self._accept(startup_timeout)
        except BaseException:
            self.close()
            raise
        first = self.workers[0].info
        for w in self.workers[1:]:
            if w.info["fingerprint"] != first["fingerprint"] or w.info["block_size"] != first["block_size"]:
                self.close()
                raise IncompatibleHandle(
                    f"worker {w.rank} runs model fingerprint {w.info['fingerprint']} / block size "
                    f"{w.info['block_size']}, worker 0 {first['fingerprint']} / {first['block_size']}: "
                    "every worker must serve the same model, dtype and block size"
                )
        self.loaded = ModelInfo(
            name=first["model"], fingerprint=first["fingerprint"],
            tokenizer_fingerprint=first.get("tokenizer_fingerprint", ""),
            max_context=first["max_context"], vocab_size=first["vocab_size"],
        )
        self._table.identity = Identity(model=self.loaded.name, fingerprint=self.loaded.fingerprint, where="this server")
        self.block_size: int = first["block_size"]
        self.bytes_per_block: int = first["bytes_per_block"]
        path = cache_dir() / "calibration.json" if calibration_cache == "default" else (
            Path(calibration_cache) if calibration_cache else None
        )
        self._calibration_path = path
        if calibrate and len(self.workers) > 1:
            self.calibrate()
        log.info("cluster ready: %d workers on %s", len(self.workers), ", ".join(w.device for w in self.workers))

    @property
    def max_context(self) -> int | None:
        """The model's context length in tokens."""
        return self.loaded.max_context

    def capabilities(self) -> Capabilities:
        """Every worker runs kvbaton's own engine."""
        return KVBATON

    # -- startup ------------------------------------------------------------------------------
    def _start_local(
        self, model: str | None, engine_options: dict[str, Any], log_level: str, threads: int | None
    ) -> None:
        env = {**os.environ, "MASTER_ADDR": self.master[0], "MASTER_PORT": str(self.master[1]),
               CLUSTER_KEY_ENV: self._key.decode()}
        if threads:  # CPU workers sharing one machine: keep their OpenMP pools from oversubscribing it
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        for rank, device in enumerate(self.devices):
            cmd = [
                sys.executable, "-m", "kvbaton.backend.worker", "--rank", str(rank), "--world-size",
                str(self.world_size), "--device", device, "--control", f"{self.control[0]}:{self.control[1]}",
                "--engine-options", json.dumps(engine_options), "--log-level", log_level,
            ]
            if model is not None:
                cmd += ["--model", model]
            if self.bandwidth_cap:
                cmd += ["--bandwidth-cap", str(self.bandwidth_cap)]
            if self.world_size == len(self.devices) and not os.environ.get(DIST_BACKEND_ENV):
                cmd += ["--backend", default_backend(self.devices)]
            self._procs.append(subprocess.Popen(cmd, env=env))

    def _accept(self, timeout: float) -> None:
        arrivals: queue.Queue[Any] = queue.Queue()

        def accept() -> None:
            for _ in range(self.world_size):
                try:
                    conn = self._listener.accept()
                    arrivals.put((conn, conn.recv()))
                except Exception as exc:  # noqa: BLE001 - closed listener or a peer without the key
                    arrivals.put(exc)
                    return

        threading.Thread(target=accept, name="kvbaton-cluster-accept", daemon=True).start()
        deadline = time.monotonic() + timeout
        joined: dict[int, WorkerClient] = {}
        while len(joined) < self.world_size:
            for proc in self._procs:
                if proc.poll() is not None:
                    raise ServerError(f"a worker process exited during startup (code {proc.returncode})")
            try:
                item = arrivals.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise ServerError(f"only {len(joined)} of {self.world_size} workers joined in {timeout:.0f} s")
                continue
            if isinstance(item, Exception):
                raise ServerError(f"worker rendezvous failed: {item}")
            conn, (kind, hello) = item
            if kind != "hello" or hello["rank"] in joined or not 0 <= hello["rank"] < self.world_size:
                raise ServerError(f"unexpected worker greeting {kind!r} {hello!r}")
            joined[hello["rank"]] = WorkerClient(conn, hello, self._worker_lost)
            log.info("worker %d joined: %s on %s (pid %s)", hello["rank"], hello["device"], hello["host"], hello["pid"])
        self.workers = [joined[r] for r in range(self.world_size)]

    # -- calibration ----------------------------------------------------------------------------
    def _calibration_key(self) -> str:
        return json.dumps({
            "model": self.loaded.fingerprint, "devices": [w.device for w in self.workers],
            "hosts": [w.host for w in self.workers], "block_size": self.block_size, "cap": self.bandwidth_cap,
        }, sort_keys=True)

    def calibrate(self, force: bool = False) -> Calibration:
        """Measure (or load from the cache) link latency/bandwidth and each worker's prefill speed."""
        key = self._calibration_key()
        force = force or bool(os.environ.get("KVBATON_RECALIBRATE"))
        cached = None if force else load_cached(self._calibration_path, key)
        if cached is not None and set(cached.prefill_per_token_s) >= {w.rank for w in self.workers}:
            self.costs.calibration = cached
            return cached
        latency, bandwidth = self._measure_link()
        start = time.perf_counter()
        for _ in range(3):
            self.workers[0].call("ping")
        overhead = (time.perf_counter() - start) / 3
        fixed: dict[int, float] = {}
        per_token: dict[int, float] = {}
        for w in self.live_workers():
            w.call("probe_prefill", 8, seed=w.rank)  # warm-up
            points = []
            for i, n in enumerate(PROBE_PREFILL_TOKENS):
                t0 = time.perf_counter()
                w.call("probe_prefill", n, seed=1000 * (w.rank + 1) + i + int(time.time()))
                points.append((float(n), time.perf_counter() - t0))
            fixed[w.rank], per_token[w.rank] = fit_line(points)
        cal = Calibration(latency, bandwidth, overhead, fixed, per_token)
        self.costs.calibration = cal
        store_cached(self._calibration_path, key, cal)
        log.info("calibrated: latency %.2f ms, bandwidth %.1f MB/s, prefill %s tokens/s", latency * 1e3,
                 bandwidth / 1e6, {r: round(1 / v) if v else None for r, v in per_token.items()})
        return cal

    def _measure_link(self) -> tuple[float, float]:
        live = self.live_workers()
        src, dst = live[0], live[1]
        big = int(min(32 * 2**20, self.bandwidth_cap * 0.3)) if self.bandwidth_cap else 32 * 2**20
        big = max(big, self.bytes_per_block)

        def probe(nbytes: int) -> float:
            with self._transfer_lock:
                t0 = time.perf_counter()
                self._both(lambda: src.call("send_probe", nbytes, dst.rank), lambda: dst.call("recv_probe", nbytes, src.rank))
                return time.perf_counter() - t0

        probe(1)  # connection set-up happens on first use
        small = sorted(probe(1) for _ in range(3))[1]
        large = min(probe(big) for _ in range(2))
        bandwidth = (big - 1) / max(large - small, 1e-6)
        return small, bandwidth

    def set_bandwidth_cap(self, cap: float | None) -> Calibration:
        """Pace KV sends at ``cap`` bytes/s (None: unpaced) and re-measure the link (tests, benchmarks)."""
        for w in self.live_workers():
            w.call("set_bandwidth_cap", cap)
        self.bandwidth_cap = cap
        latency, bandwidth = self._measure_link()
        cal = self.costs.calibration or Calibration(latency, bandwidth, 0.0)
        cal.latency_s, cal.bandwidth_bytes_per_s = latency, bandwidth
        self.costs.calibration = cal
        return cal

    # -- workers --------------------------------------------------------------------------------
    def live_workers(self) -> list[WorkerClient]:
        live = [w for w in self.workers if w.alive]
        if not live:
            raise ServerError("every worker is down")
        return live

    def _worker_lost(self, worker: WorkerClient) -> None:
        with self._lock:
            lost = [placed for placed in self._table.states() if placed.rank == worker.rank]
            for placed in lost:
                placed.rank = None
        self.placer.forget_worker(worker.rank)
        log.error("worker %d lost: %d handles will be recomputed from lineage on next use", worker.rank, len(lost))

    def _worker(self, device: int | str) -> WorkerClient:
        if isinstance(device, bool):
            raise InvalidRequest(f"invalid device {device!r}")
        if isinstance(device, str) and device.removeprefix("worker:").isdigit():
            device = int(device.removeprefix("worker:"))
        if isinstance(device, int):
            if not 0 <= device < len(self.workers):
                raise InvalidRequest(f"no worker {device}: this server has workers 0..{len(self.workers) - 1}")
            worker = self.workers[device]
        else:
            matches = [w for w in self.workers if w.device == device]
            if len(matches) != 1:
                raise InvalidRequest(
                    f"device {device!r} names {len(matches)} workers ({', '.join(w.device for w in self.workers)}): "
                    "use the worker rank (an integer) instead"
                )
            worker = matches[0]
        if not worker.alive:
            raise InvalidRequest(f"worker {worker.rank} ({worker.device}) is down")
        return worker

    @staticmethod
    def _both(a: Callable[[], Any], b: Callable[[], Any]) -> tuple[Any, Any]:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            fa, fb = pool.submit(a), pool.submit(b)
            return fa.result(), fb.result()

    # -- handle bookkeeping ---------------------------------------------------------------------
    def _hid(self, handle: HandleLike) -> str:
        return self._table.id_of(handle)

    def _known(self, hid: str) -> _Placed:
        return self._table.get(hid)

    def _record(self, rank: int, handles: Iterable[Handle]) -> None:
        with self._lock:
            for h in handles:
                placed = self._table.find(h.id)
                if placed is None:
                    self._table.add(h.id, _Placed(h, rank))
                else:  # moved: same handle (and lock), new metadata and worker
                    placed.meta, placed.rank = h, rank
        for h in handles:
            self.placer.remember(rank, h.token_ids())

    def _on_handle(self, handle: Handle | str, start: Callable[[WorkerClient, str], T]) -> T:
        """Run ``start`` on the worker that should serve a request on ``handle`` (moving or
        recomputing it there first when placement says so), retrying when a worker dies."""
        hid = self._hid(handle)
        for _ in range(len(self.workers) + 1):
            with self._known(hid).lock:
                placed = self._known(hid)
                with self._lock:
                    rank = placed.rank
                holder = self.workers[rank] if rank is not None else None
                target = self.placer.for_handle(holder, self.workers)
                try:
                    if target is not holder:
                        self._move(hid, holder, target, "lost" if holder is None or not holder.alive else "balance")
                    return start(target, hid)
                except WorkerLost:
                    self.retries += 1
                    continue
        raise ServerError("no worker could serve the request")

    def _anywhere(self, tokens: Sequence[int] | None, start: Callable[[WorkerClient], T]) -> T:
        if not any(w.info.get("prefix_cache", True) for w in self.workers):
            tokens = None  # no prefix cache anywhere: locality of prompts means nothing
        for _ in range(len(self.workers) + 1):
            worker = self.placer.for_tokens(tokens, self.live_workers())
            try:
                return start(worker)
            except WorkerLost:
                self.retries += 1
        raise ServerError("no worker could serve the request")

    def _move(
        self, hid: str, src: WorkerClient | None, dst: WorkerClient, reason: str, method: str = "auto"
    ) -> Handle:
        """Bring ``hid`` to ``dst`` by transfer or recompute (handle lock held). ``method`` forces
        one ("transfer" / "recompute") instead of the cost model's choice (benchmarks)."""
        meta = self._known(hid).meta
        tokens = meta.num_tokens
        nbytes = -(-tokens // self.block_size) * self.bytes_per_block
        moved = meta.model_copy(update={
            "lineage": meta.lineage + (LineageStep(op=Op.TRANSFER, parent=hid),),
            "placement": Placement(device=dst.device, worker=dst.rank),
        })
        if src is not None and src.alive:
            cached = self._cached_on(dst, meta) if method == "auto" else 0
            choice, predicted_transfer, predicted_recompute = self.costs.choose(dst.rank, tokens, nbytes, cached)
            if method != "auto":
                choice = method
        else:
            choice, predicted_transfer = "recompute", None
            predicted_recompute = self.costs.predict_recompute(dst.rank, tokens - self._cached_on(dst, meta))
        start = time.perf_counter()
        new: Handle | None = None
        if choice == "transfer":
            assert src is not None
            try:
                with self._transfer_lock:
                    _, new = self._both(
                        lambda: src.call("send_handle", hid, dst.rank),
                        lambda: dst.call("recv_handle", moved, src.rank),
                    )
            except WorkerLost:
                if not dst.alive:
                    raise
                choice = "recompute"  # the source died mid-transfer: its KV is gone, the lineage is not
                log.warning("transfer of %s from worker %d failed; recomputing on %d", hid[:8], src.rank, dst.rank)
            except KvbatonError as exc:
                log.warning("transfer of %s failed (%s); recomputing on worker %d", hid[:8], exc, dst.rank)
                choice = "recompute"
                # the receiver may have adopted it before the sender's release failed, or not at all
                try:
                    dst.call("release", hid)
                except KvbatonError:
                    pass
        if choice == "recompute":
            new = dst.call("adopt", moved)
            if src is not None and src.alive:
                try:
                    src.call("release", hid)
                except (KvbatonError, WorkerLost):
                    pass
        assert new is not None
        self.costs.record(PlacementDecision(
            handle=hid, src=src.rank if src is not None else None, dst=dst.rank, reason=reason, tokens=tokens,
            bytes=nbytes, predicted_transfer_s=predicted_transfer, predicted_recompute_s=predicted_recompute,
            choice=choice, actual_s=time.perf_counter() - start,
        ))
        self._record(dst.rank, [new])
        return new

    def _cached_on(self, worker: WorkerClient, meta: Handle) -> int:
        """Tokens of ``meta`` the worker's prefix cache holds (0 without a cache): a recompute there skips them."""
        if not worker.info.get("prefix_cache", True) or meta.num_tokens < self.block_size:
            return 0
        try:
            return int(worker.call("cached_prefix", meta.token_ids()))
        except KvbatonError:
            return 0

    # -- operators ------------------------------------------------------------------------------
    def _prompt_tokens(self, context: Any) -> Any:
        """Token ids of text (tokenized on a worker), so that routing can match prefixes."""
        if isinstance(context, str) and len(self.live_workers()) > 1:
            return self.tokenize(context)
        return context

    def materialize(self, context: Any, *, agent: str | None = None) -> Handle:
        tokens = self._prompt_tokens(context)

        def run(w: WorkerClient) -> Handle:
            handle: Handle = w.call("materialize", tokens, agent=agent)
            self._record(w.rank, [handle])
            return handle

        return self._anywhere(tokens if isinstance(tokens, list) else None, run)

    def extend(self, handle: Handle | str, context: Any, *, agent: str | None = None) -> Handle:
        def run(w: WorkerClient, hid: str) -> Handle:
            new: Handle = w.call("extend", hid, context, agent=agent)
            self._record(w.rank, [new])
            return new

        return self._on_handle(handle, run)

    def fork(self, handle: Handle | str, k: int = 2) -> list[Handle]:
        def run(w: WorkerClient, hid: str) -> list[Handle]:
            children: list[Handle] = w.call("fork", hid, k)
            self._record(w.rank, children)
            return children

        return self._on_handle(handle, run)

    def transfer(self, handle: Handle | str, device: int | str, *, method: str = "auto") -> Handle:
        """Move ``handle`` to the worker ``device`` (a rank, or a device name that is unique), by KV
        transfer or recompute as the cost model chooses; ``method="transfer"``/``"recompute"`` forces one."""
        if method not in ("auto", "transfer", "recompute"):
            raise InvalidRequest(f"method must be 'auto', 'transfer' or 'recompute', got {method!r}")
        hid = self._hid(handle)
        dst = self._worker(device)
        for _ in range(len(self.workers) + 1):
            placed = self._known(hid)
            with placed.lock:
                with self._lock:
                    rank, current = placed.rank, placed.meta
                holder = self.workers[rank] if rank is not None else None
                if holder is dst:
                    return current
                try:
                    return self._move(hid, holder, dst, "explicit" if holder is not None else "lost", method)
                except WorkerLost:
                    self.retries += 1
                    if not dst.alive:
                        raise InvalidRequest(f"worker {dst.rank} ({dst.device}) went down") from None
        raise ServerError("the transfer could not be completed")

    def _on_handles(self, handles: Sequence[Handle | str], start: Callable[[WorkerClient], T]) -> T:
        """Run ``start`` on one worker holding every handle in ``handles`` (compose, merge and
        fidelity read several handles' K/V at once): the one already holding the most tokens; the
        others are brought there first (transfer or recompute, as the cost model says)."""
        hids = sorted({self._hid(h) for h in handles})
        for _ in range(len(self.workers) + 1):
            locks = [self._known(hid).lock for hid in hids]
            for lock in locks:  # sorted ids: a fixed order, so two such calls cannot deadlock
                lock.acquire()
            try:
                placed = {hid: self._known(hid) for hid in hids}
                with self._lock:
                    where = {hid: p.rank for hid, p in placed.items()}
                    sizes = {hid: p.meta.num_tokens for hid, p in placed.items()}
                held: dict[int, int] = {}
                for hid, rank in where.items():
                    if rank is not None and self.workers[rank].alive:
                        held[rank] = held.get(rank, 0) + sizes[hid]
                target = (self.workers[max(held, key=lambda r: (held[r], -r))] if held
                          else self.placer.least_loaded(self.workers))
                try:
                    for hid, rank in where.items():
                        holder = self.workers[rank] if rank is not None else None
                        if holder is not target:
                            alive = holder is not None and holder.alive
                            self._move(hid, holder, target, "colocate" if alive else "lost")
                    return start(target)
                except WorkerLost:
                    self.retries += 1
            finally:
                for lock in reversed(locks):
                    lock.release()
        raise ServerError("no worker could serve the request")

    def compose(self, prefix: Handle | Context | None = None, segments: Sequence[Segment | Handle] = (),
                suffix: Context | None = None, *, agent: str | None = None, mode: str = "auto",
                correction: Mapping[str, Any] | None = None) -> Composition:
        correction = _plain(correction)
        refs = [s if isinstance(s, Handle) else s.handle for s in segments]
        if isinstance(prefix, Handle):
            refs.append(prefix)

        def run(w: WorkerClient) -> Composition:
            out: Composition = w.call("compose", prefix, list(segments), suffix, agent=agent, mode=mode,
                                      correction=correction)
            self._record(w.rank, [out.handle])
            return out

        return self._on_handles(refs, run)

    def merge(self, parts: Sequence[Segment | Handle], *, agent: str | None = None, mode: str = "auto",
              correction: Mapping[str, Any] | None = None) -> Composition:
        correction = _plain(correction)
        refs = [p if isinstance(p, Handle) else p.handle for p in parts]

        def run(w: WorkerClient) -> Composition:
            out: Composition = w.call("merge", list(parts), agent=agent, mode=mode, correction=correction)
            self._record(w.rank, [out.handle])
            return out

        return self._on_handles(refs, run)

    def fidelity(self, handle: Handle | str, max_tokens: int = 32, *, reference: Handle | str | None = None) -> Any:
        refs = [handle] if reference is None else [handle, reference]
        return self._on_handles(refs, lambda w: w.call(
            "fidelity", self._hid(handle), max_tokens, reference=None if reference is None else self._hid(reference)
        ))

    def describe(self, handle: HandleLike) -> Handle:
        placed = self._known(self._hid(handle))
        with self._lock:
            return placed.meta

    def resume(self, handle: Handle | str, suffix: Any = "", sampling: SamplingParams | None = None, *,
               agent: str | None = None) -> Result:
        return self.resume_stream(handle, suffix, sampling, agent=agent).until_done()

    def resume_stream(self, handle: Handle | str, suffix: Any = "", sampling: SamplingParams | None = None, *,
                      agent: str | None = None) -> TokenStream:
        params = sampling or SamplingParams()
        return self._stream(params, lambda: self._on_handle(
            handle, lambda w, hid: (w, w.stream("resume_stream", hid, suffix, params, agent=agent))
        ))

    def complete(self, prompt: Any, sampling: SamplingParams | None = None, *, agent: str | None = None) -> Result:
        return self.complete_stream(prompt, sampling, agent=agent).until_done()

    def complete_stream(self, prompt: Any, sampling: SamplingParams | None = None, *,
                        agent: str | None = None) -> TokenStream:
        params = sampling or SamplingParams()
        tokens = self._prompt_tokens(prompt)
        return self._stream(params, lambda: self._anywhere(
            tokens if isinstance(tokens, list) else None,
            lambda w: (w, w.stream("complete_stream", tokens, params, agent=agent)),
        ))

    def generate(self, messages: Any, *, handle: Handle | str | None = None, sampling: SamplingParams | None = None,
                 tools: list[dict[str, Any]] | None = None, agent: str | None = None) -> Result:
        return self.generate_stream(messages, handle=handle, sampling=sampling, tools=tools, agent=agent).until_done()

    def generate_stream(self, messages: Any, *, handle: Handle | str | None = None,
                        sampling: SamplingParams | None = None, tools: list[dict[str, Any]] | None = None,
                        agent: str | None = None) -> TokenStream:
        params = sampling or SamplingParams()
        if handle is not None:
            return self._stream(params, lambda: self._on_handle(
                handle, lambda w, hid: (w, w.stream(
                    "generate_stream", messages, handle=hid, sampling=params, tools=tools, agent=agent
                ))
            ))
        tokens = self.chat_tokens(messages, tools=tools) if len(self.live_workers()) > 1 else None
        return self._stream(params, lambda: self._anywhere(tokens, lambda w: (w, w.stream(
            "generate_stream", messages, sampling=params, tools=tools, agent=agent
        ))))

    def _stream(
        self, params: SamplingParams, start: Callable[[], tuple[WorkerClient, Iterator[StreamChunk | Result]]]
    ) -> TokenStream:
        """A stream that is re-run on another worker when its worker dies. Chunks already delivered
        are skipped in the re-run, which is exact only for deterministic sampling (greedy or seeded);
        otherwise a stream that already produced text fails with ``ServerError``."""
        deterministic = params.temperature == 0 or params.seed is not None
        worker, items = start()

        def chunks() -> Generator[StreamChunk, None, Result]:
            nonlocal worker, items
            delivered = 0
            try:
                while True:
                    skip = delivered
                    try:
                        for item in items:
                            if isinstance(item, Result):
                                if item.handle is not None:
                                    self._record(worker.rank, [item.handle])
                                return item
                            if skip:
                                skip -= 1
                                continue
                            delivered += 1
                            yield item
                    except WorkerLost:
                        if delivered and not deterministic:
                            raise ServerError(
                                f"worker {worker.rank} died mid-stream; non-deterministic sampling cannot be resumed"
                            ) from None
                        self.retries += 1
                        log.warning("worker %d died during a stream; re-running it elsewhere", worker.rank)
                        worker, items = start()
            finally:
                close = getattr(items, "close", None)
                if close is not None:
                    close()

        return TokenStream(chunks())

    def release(self, handles: Handle | str | Iterable[Handle | str]) -> None:
        by_worker: dict[int, list[str]] = {}
        with self._lock:
            for hid, placed in self._table.release(handles):  # all or nothing
                if placed.rank is not None:
                    by_worker.setdefault(placed.rank, []).append(hid)
        for rank, ids in by_worker.items():
            worker = self.workers[rank]
            if worker.alive:
                try:
                    worker.call("release", ids)
                except (WorkerLost, HandleNotFound, HandleReleased):
                    pass

    # -- whole-cluster calls ----------------------------------------------------------------------
    def _any(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._anywhere(None, lambda w: w.call(method, *args, **kwargs))

    def _broadcast(self, method: str, *args: Any, **kwargs: Any) -> Any:
        out = None
        for w in self.live_workers():
            try:
                value = w.call(method, *args, **kwargs)
            except WorkerLost:
                continue
            out = value if out is None else out
        return out

    def tokenize(self, text: str) -> list[int]:
        return list(self._any("tokenize", text))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return str(self._any("detokenize", list(token_ids) if not isinstance(token_ids, list) else token_ids))

    def chat_tokens(self, messages: Any, *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        return list(self._any("chat_tokens", messages, tools=tools, add_generation_prompt=add_generation_prompt))

    def register_agent(self, name: str, fixed_prompt: Any, *, prefill: bool = False) -> AgentInfo:
        info: AgentInfo = self._broadcast("register_agent", name, fixed_prompt, prefill=prefill)
        return info

    def hints(
        self, steps: Mapping[str, float] | Any, *, running: Iterable[str] = (), finished: Iterable[str] = ()
    ) -> dict[str, float]:
        result: dict[str, float] = self._broadcast("hints", ste_map(steps, running, finished))
        return result

    def flush_cache(self) -> None:
        self._broadcast("flush_cache")

    def stats(self) -> Stats:
        per: dict[int, Stats] = {}
        for w in self.workers:
            if w.alive:
                try:
                    per[w.rank] = w.call("stats")
                except WorkerLost:
                    pass
        if not per:
            raise ServerError("every worker is down")
        with self._lock:
            held = {w.rank: 0 for w in self.workers}
            for placed in self._table.states():
                if placed.rank is not None:
                    held[placed.rank] += 1
        cal = self.costs.calibration
        cluster = ClusterStats(
            workers=[
                WorkerStats(
                    rank=w.rank, device=w.device, alive=w.alive, pid=w.pid, host=w.host, queue=w.queue,
                    handles=held[w.rank], stats=per.get(w.rank),
                    prefill_tokens_per_s=(1 / cal.prefill_per_token_s[w.rank])
                    if cal and cal.prefill_per_token_s.get(w.rank) else None,
                )
                for w in self.workers
            ],
            bandwidth_bytes_per_s=cal.bandwidth_bytes_per_s if cal else None,
            latency_s=cal.latency_s if cal else None,
            bandwidth_cap_bytes_per_s=self.bandwidth_cap,
            transfers=self.costs.transfers,
            recomputes=self.costs.recomputes,
            retries=self.retries,
            decisions=list(self.costs.decisions),
        )
        first = next(iter(per.values()))
        total = lambda field: sum(getattr(s, field) for s in per.values())
        agents: dict[str, Any] = {}
        for s in per.values():
            for name, value in s.agents.items():
                agents.setdefault(name, value)
        return Stats(
            model=first.model, device=",".join(w.device for w in self.workers), dtype=first.dtype,
            block_size=first.block_size, bytes_per_block=first.bytes_per_block,
            **{f: total(f) for f in (
                "blocks_total", "blocks_used", "blocks_free", "blocks_shared", "blocks_cached", "blocks_cache_only",
                "pool_bytes_total", "pool_bytes_used", "pool_bytes_free", "tokens_reused", "tokens_prefilled",
                "tokens_generated",
            )},
            handles_live=len(self._table), agents=agents, cluster=cluster,
        )

    def kill_worker(self, rank: int) -> None:
        """Kill a local worker process outright (SIGKILL), as a crash would: for fault tests."""
        self._procs[rank].kill()

    def close(self) -> None:
        for w in self.workers:
            w.close()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        try:
            self._listener.close()
        except OSError:
            pass

    def __enter__(self) -> Cluster:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain(correction: Mapping[str, Any] | None) -> Any:
    """A correction mapping as a plain dict, which pickles to the worker whatever mapping it was."""
    return dict(correction) if isinstance(correction, Mapping) else correction
