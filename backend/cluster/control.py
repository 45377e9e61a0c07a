"""The control plane of a cluster: its workers, its handle table and router, its cost model.

:class:`Control` starts one worker actor per device (:mod:`.launch`), watches them (:mod:`.liveness`:
Ray restarts a worker that dies, and it rejoins with what every worker must have: the tenant
partition, the registered agents, the latest STE hints), keeps the handle table and places requests
(:mod:`.routing`: tickets), moves handles (:mod:`.moves`, as the calibrated cost model says) and
answers the cluster-wide calls (stats, events, hints). It never sees a request's tokens: an ingress
(:class:`.coordinator.Cluster`) opens a ticket here, calls the worker itself and reads its stream
from the worker directly.

One ingress runs its control in its own process. Several ingresses (``kvbaton serve --cluster-name
NAME`` and ``--attach NAME``) share one: a named Ray actor (:class:`ControlActor`) in the ``kvbaton``
namespace, owned by the ingress that started the cluster; its answers are data (``("ok", value)`` or a
typed error, as a worker's), so every ingress sees the same typed errors. :data:`CONTROL_CALLS` is
what an ingress may call.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from kvbaton.errors import HandleNotFound, HandleReleased, IncompatibleHandle, ServerError
from kvbaton.handle import Handle
from kvbaton.types import AgentInfo, Events, Stats

from ..config import EngineConfig
from ..dirs import cache_dir
from ..events import EventRing, check_since
from ..handles import Identity
from ..hosting import HEALTHY
from ..tenants import TenantPartition
from . import launch
from .calibration import measure_call_overhead, measure_link, measure_prefill
from .costmodel import PREFILL_PROBE_TOKENS, Calibration, CostModel, load_cached, store_cached
from .liveness import Liveness
from .moves import Mover
from .placement import Placer
from .remote import LOST_ERRORS, WorkerLost, WorkerRef, answer
from .routing import Router, Ticket
from .stats import cluster_stats
from .worker import Worker, error_reply

log = logging.getLogger(__name__)

CONTROL_PREFIX = "kvbaton-cluster-"  # a shared control's actor name: this, then the cluster's name


@dataclass(frozen=True)
class ModelInfo:
    """What the server reads of ``engine.loaded``."""

    name: str
    fingerprint: str
    tokenizer_fingerprint: str
    max_context: int
    vocab_size: int


@dataclass(frozen=True)
class Joined:
    """What an ingress needs to serve the cluster: the model, the KV geometry, each worker as ``(rank,
    device, actor, info, alive)``, the secret of tenant ids (every ingress names a token's tenant alike)
    and the engine config every worker runs (as JSON)."""

    model: ModelInfo
    block_size: int
    bytes_per_block: int
    workers: list[tuple[int, str, Any, dict[str, Any], bool]]
    tenant_salt: bytes
    config_json: str


class Control:
    """One worker actor per entry of ``devices`` running engines of ``config`` (see
    :class:`.coordinator.Cluster`, whose options these are)."""

    def __init__(self, config: EngineConfig, devices: Sequence[str], *, ray_address: str | None, transport: str,
                 placement_strategy: str, bandwidth_cap: float | None, calibrate: bool,
                 calibration_cache: str | os.PathLike[str] | None, balance_slack: int, worker_log_level: str,
                 worker_threads: int | None, startup_timeout: float, heartbeat_timeout: float, max_restarts: int,
                 gpu_share: float) -> None:
        self.config = config
        self.devices = list(devices)
        self.bandwidth_cap = bandwidth_cap
        self.costs = CostModel()
        self.tenant_salt = secrets.token_bytes(32)
        # The workers' events, merged here as they are read (each tagged with its worker's rank).
        self.event_ring = EventRing()
        self._event_cursors: dict[int, int] = {}
        self._events_lock = threading.Lock()
        # What every worker must have, again after a restart: the tenant partition, agents, hints.
        self._replay_lock = threading.Lock()
        self._partition = TenantPartition()
        self._agents: dict[str, tuple[Any, bool]] = {}
        self._hints: dict[str, float] | None = None
        self.workers: list[WorkerRef] = []  # by rank
        self.router = Router(Placer(slack=balance_slack), self.workers)
        self._liveness = Liveness(self.workers, heartbeat_timeout, self._rejoin)
        self._pg = None
        self._started_ray = launch.connect(ray_address, devices)
        try:
            self._pg = launch.reserve(devices, placement_strategy, startup_timeout, gpu_share)
            args = (config.to_json(), bandwidth_cap, worker_log_level, str(cache_dir()))
            for rank, device in enumerate(devices):
                actor = launch.start_worker(Worker, self._pg, rank, device, args=(rank, device, *args),
                                            threads=worker_threads, max_restarts=max_restarts, gpu_share=gpu_share)
                self.workers.append(WorkerRef(rank, device, actor, self.router.worker_lost))
            infos = ray.get([w.actor.info.remote() for w in self.workers], timeout=startup_timeout)
            for w, info in zip(self.workers, infos, strict=True):
                w.joined(info)
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
        self.model = ModelInfo(
            name=first["model"], fingerprint=first["fingerprint"],
            tokenizer_fingerprint=first.get("tokenizer_fingerprint", ""),
            max_context=first["max_context"], vocab_size=first["vocab_size"],
        )
        self.router.table.identity = Identity(self.model.name, self.model.fingerprint, where="this server")
        self.block_size: int = first["block_size"]
        self.bytes_per_block: int = first["bytes_per_block"]
        self.router.mover = Mover(self.costs, self.block_size, self.bytes_per_block)
        for w in self.workers:  # persistence: the handles the workers kept from an earlier run
            self._release_stale(w, self.router.rejoined(w.rank, w.call("held")))
        try:
            self.router.mover.group = launch.form_group(self.workers, self.devices, transport)
        except BaseException:
            self.close()
            raise
        path = cache_dir() / "calibration.json" if calibration_cache == "default" else (
            Path(calibration_cache) if calibration_cache else None
        )
        self._calibration_path = path
        if calibrate and len(self.workers) > 1:
            self.calibrate()
        self._liveness.start()
        log.info("cluster ready: %d workers on %s (nodes %s, KV transport %s)", len(self.workers),
                 ", ".join(w.device for w in self.workers), sorted({w.info["node_ip"] for w in self.workers}),
                 self.transport())

    def joined(self) -> Joined:
        return Joined(self.model, self.block_size, self.bytes_per_block,
                      [(w.rank, w.device, w.actor, w.info, w.alive) for w in self.workers], self.tenant_salt,
                      self.config.to_json())

    def transport(self) -> str:
        group = self.router.mover.group if self.router.mover is not None else None
        return f"collective ({group.backend})" if group is not None else "object store"

    def _rejoin(self, worker: WorkerRef) -> None:
        """Ray restarted ``worker``: it gets what every worker has (partition, agents, hints, link
        pacing), leaves the collective group (which takes no new member), and serves again with the
        handles it kept (persistence)."""
        try:
            info = ray.get(worker.actor.info.remote(), timeout=60)
        except (ray.exceptions.GetTimeoutError, *LOST_ERRORS):
            return  # still restarting: the next answer to a ping tries again
        with self._replay_lock:
            reply = worker.actor.call
            answer(ray.get(reply.remote("partition_tenants", (self._partition,))))
            for name, (prompt, prefill) in self._agents.items():
                answer(ray.get(reply.remote("register_agent", (name, prompt), {"prefill": prefill})))
            if self._hints is not None:
                answer(ray.get(reply.remote("hints", (self._hints,))))
            if self.bandwidth_cap:
                answer(ray.get(reply.remote("set_bandwidth_cap", (self.bandwidth_cap,))))
            held = answer(ray.get(reply.remote("held")))
        group = self.router.mover.group if self.router.mover is not None else None
        if group is not None:
            group.members.discard(worker.rank)
        with self._events_lock:  # a new engine numbers its events from the start again
            self._event_cursors.pop(worker.rank, None)
        worker.joined(info)
        self._release_stale(worker, self.router.rejoined(worker.rank, held))
        log.warning("worker %d (%s) rejoined (pid %s, node %s) with %d handles", worker.rank, worker.device,
                    info["pid"], info["node_ip"], len(held))

    def _release_stale(self, worker: WorkerRef, ids: list[str]) -> None:
        if ids:
            try:
                worker.call("release", ids)
            except (WorkerLost, HandleNotFound, HandleReleased):
                pass

    def healthy(self) -> tuple[bool, str]:
        """Serves while at least one worker is alive; degraded (the reason names the workers down and
        why) while some are not."""
        down = [w for w in self.workers if not w.alive]
        if len(down) == len(self.workers):
            return False, f"every worker is down (0 of {len(self.workers)} alive)"
        if down:
            why = "; ".join(f"worker {w.rank} ({w.device}) {w.lost_reason or 'died'}" for w in down)
            return True, f"degraded: {len(self.workers) - len(down)} of {len(self.workers)} workers alive; {why}"
        return True, HEALTHY

    def alive(self) -> list[int]:
        """The ranks of the workers serving now."""
        return [w.rank for w in self.workers if w.alive]

    # -- tickets and handles (see .routing) -----------------------------------------------------------
    def begin_on_handle(self, hid: str) -> Ticket:
        return self.router.begin_on_handle(hid)

    def begin_on_handles(self, hids: Sequence[str]) -> Ticket:
        return self.router.begin_on_handles(hids)

    def begin_anywhere(self, tokens: Sequence[int] | None) -> Ticket:
        return self.router.begin_anywhere(tokens)

    def started(self, ticket: Ticket) -> None:
        self.router.started(ticket)

    def done(self, ticket: Ticket, handles: list[Handle], owner: str | None = None) -> None:
        self.router.done(ticket, handles, owner)

    def failed(self, ticket: Ticket, lost: bool) -> None:
        self.router.failed(ticket, lost)

    def transfer(self, hid: str, device: int | str, method: str) -> Handle:
        return self.router.transfer(hid, device, method)

    def describe(self, hid: str) -> Handle:
        return self.router.describe(hid)

    def owner_of(self, hid: str) -> tuple[str | None, int] | None:
        return self.router.owner_of(hid)

    def release(self, hids: list[str]) -> None:
        for rank, ids in self.router.release(hids).items():  # all or nothing
            worker = self.workers[rank]
            if worker.alive:
                try:
                    worker.call("release", ids)
                except (WorkerLost, HandleNotFound, HandleReleased):
                    pass

    # -- calibration ----------------------------------------------------------------------------
    def _calibration_key(self) -> str:
        return json.dumps({
            "model": self.model.fingerprint, "devices": [w.device for w in self.workers],
            "hosts": [w.info.get("node_ip") for w in self.workers], "block_size": self.block_size,
            "cap": self.bandwidth_cap, "transport": self.transport(),
        }, sort_keys=True)

    def calibrate(self, force: bool = False, prefill_tokens: Sequence[int] = PREFILL_PROBE_TOKENS) -> Calibration:
        """Measure (or load from the cache) link latency/bandwidth and each worker's prefill speed (probed
        at ``prefill_tokens`` fresh tokens)."""
        key = self._calibration_key()
        force = force or bool(os.environ.get("KVBATON_RECALIBRATE"))
        cached = None if force else load_cached(self._calibration_path, key)
        if cached is not None and set(cached.prefill_per_token_s) >= {w.rank for w in self.workers}:
            self.costs.calibration = cached
            return cached
        latency, bandwidth = self._measure_link()
        overhead = measure_call_overhead(self.workers[0])
        fixed, per_token = measure_prefill(self.router.live_workers(), prefill_tokens)
        cal = Calibration(latency, bandwidth, overhead, fixed, per_token)
        self.costs.calibration = cal
        store_cached(self._calibration_path, key, cal)
        log.info("calibrated: latency %.2f ms, bandwidth %.1f MB/s, prefill %s tokens/s", latency * 1e3,
                 bandwidth / 1e6, {r: round(1 / v) if v else None for r, v in per_token.items()})
        return cal

    def _measure_link(self) -> tuple[float, float]:
        live = self.router.live_workers()
        group = self.router.mover.group if self.router.mover is not None else None
        collective = group is not None and group.joins(live[0].rank, live[1].rank)
        return measure_link(live[0], live[1], collective, self.bandwidth_cap, self.bytes_per_block)

    def set_bandwidth_cap(self, cap: float | None) -> Calibration:
        """Pace KV sends at ``cap`` bytes/s (None: unpaced) and re-measure the link (tests, benchmarks)."""
        for w in self.router.live_workers():
            w.call("set_bandwidth_cap", cap)
        self.bandwidth_cap = cap
        latency, bandwidth = self._measure_link()
        cal = self.costs.calibration or Calibration(latency, bandwidth, 0.0)
        cal.latency_s, cal.bandwidth_bytes_per_s = latency, bandwidth
        self.costs.calibration = cal
        return cal

    def predict_recompute(self, rank: int, tokens: int) -> float:
        """The cost model's prediction of a recompute of ``tokens`` fresh tokens on worker ``rank``."""
        return self.costs.predict_recompute(rank, tokens)

    # -- what every worker gets ---------------------------------------------------------------------
    def _broadcast(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The first live worker's answer to a call made on every live worker."""
        answers = self._gather(method, *args, **kwargs)
        return answers[0] if answers else None

    def _gather(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Every live worker's answer to the call (those lost meanwhile give none)."""
        out = []
        for w in self.router.live_workers():
            try:
                out.append(w.call(method, *args, **kwargs))
            except WorkerLost:
                continue
        return out

    def partition_tenants(self, partition: TenantPartition) -> None:
        with self._replay_lock:
            self._partition = partition
            self._broadcast("partition_tenants", partition)

    def register_agent(self, name: str, fixed_prompt: Any, prefill: bool) -> AgentInfo:
        with self._replay_lock:
            info: AgentInfo = self._broadcast("register_agent", name, fixed_prompt, prefill=prefill)
            self._agents[str(name)] = (fixed_prompt, prefill)
        return info

    def unregister_agent(self, name: str) -> bool:
        with self._replay_lock:
            self._agents.pop(str(name), None)
            return any(self._gather("unregister_agent", name))

    def hints(self, steps: dict[str, float]) -> dict[str, float]:
        # Every worker gets every hint: each evicts and prefetches its own blocks by the same workflow.
        with self._replay_lock:
            result: dict[str, float] = self._broadcast("hints", steps)
            self._hints = steps
        return result

    def flush_cache(self) -> None:
        self._broadcast("flush_cache")

    # -- observation ------------------------------------------------------------------------------
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
        router = self.router
        group = router.mover.group if router.mover is not None else None
        return cluster_stats(self.workers, per, router.held(), router.placer, group, self.costs, self.bandwidth_cap,
                             router.retries, len(router.table))

    def events(self, since: int = 0) -> Events:
        """The workers' events after ``since``, merged in the order the control read them (each with
        its ``worker`` rank; ``seq`` is the control's). Workers are read on each call: a worker's ring
        may lose events between two reads, counted in ``dropped``."""
        check_since(since)
        with self._events_lock:  # one reader at a time, so no worker event is copied twice
            dropped = 0
            for w in self.workers:
                if not w.alive:
                    continue
                try:
                    page: Events = w.call("events", self._event_cursors.get(w.rank, 0))
                except WorkerLost:
                    continue
                dropped += page.dropped
                for e in sorted(page.events, key=lambda e: e.time):
                    self.event_ring.emit(e.kind, **{**e.model_dump(exclude={"seq", "kind"}), "worker": w.rank})
                self._event_cursors[w.rank] = page.next
            out = self.event_ring.since(since)
        return out.model_copy(update={"dropped": out.dropped + dropped})

    def kill_worker(self, rank: int) -> None:
        """Kill a worker's process outright (SIGKILL), as a crash would (Ray restarts it): for fault tests."""
        import signal

        pid = self.workers[rank].pid
        if pid is not None:
            os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        self._liveness.close()
        for w in self.workers:
            w.closing = True
        if ray.is_initialized():  # a clean exit: the engines save what persistence keeps
            closing = [w.actor.call.remote("close") for w in self.workers if w.alive]
            try:
                ray.wait(closing, num_returns=len(closing), timeout=60)
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
        launch.stop([w.actor for w in self.workers], self._pg, self._started_ray)


CONTROL_CALLS = frozenset({
    "joined", "transport", "healthy", "alive", "begin_on_handle", "begin_on_handles", "begin_anywhere", "started",
    "done", "failed", "transfer", "describe", "owner_of", "release", "calibrate", "set_bandwidth_cap",
    "predict_recompute", "partition_tenants", "register_agent", "unregister_agent", "hints", "flush_cache",
    "stats", "events", "kill_worker", "close",
})


@ray.remote(num_cpus=0, max_concurrency=256)
class ControlActor:
    """A :class:`Control` that several ingresses share (named ``CONTROL_PREFIX + name``). Its threads
    wait on handle leases and worker calls, hence many of them; it answers with data, never raises."""

    def __init__(self, config_json: str, devices: list[str], options: dict[str, Any], log_level: str) -> None:
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.control = Control(EngineConfig.from_json(config_json), devices, **options)

    def call(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> tuple[Any, ...]:
        try:
            if method not in CONTROL_CALLS:
                raise ServerError(f"unknown control call {method!r}")
            return ("ok", getattr(self.control, method)(*args, **(kwargs or {})))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller as data
            return error_reply(exc, "the cluster's control")


class RemoteControl:
    """An ingress's view of a shared :class:`ControlActor`: its calls, answered or raised as typed errors
    (``ServerUnavailable`` once the actor is gone: the ingress that owned it stopped)."""

    def __init__(self, actor: Any, timeout: float) -> None:
        self.actor, self.timeout = actor, timeout

    def __getattr__(self, method: str) -> Any:
        if method not in CONTROL_CALLS:
            raise AttributeError(method)

        def call(*args: Any, **kwargs: Any) -> Any:
            from kvbaton.errors import ServerUnavailable

            try:
                reply = ray.get(self.actor.call.remote(method, args, kwargs), timeout=self.timeout)
            except LOST_ERRORS as exc:  # its start failed (the reason is Ray's message), or its owner stopped
                raise ServerUnavailable(f"the cluster's control is gone: {str(exc)[:800]}") from exc
            except ray.exceptions.GetTimeoutError as exc:
                raise ServerUnavailable(f"the cluster's control did not answer {method} in {self.timeout:.0f} s") from exc
            return answer(reply)

        return call

