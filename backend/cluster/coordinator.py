"""The ingress of a multi-device server: one engine interface over worker actors on Ray.

:class:`Cluster` implements :class:`kvbaton.ops.EngineOps` and the hosted-engine contract
(:class:`..hosting.HostedEngine`) as :class:`~kvbaton.backend.Engine` does, so ``kvbaton serve
--devices cpu,cpu`` and ``EmbeddedClient(engine=Cluster(...))`` work unchanged. Every worker is a Ray
actor (:mod:`.worker`) running an engine of the cluster's one :class:`..config.EngineConfig` on its
own device, placed by a placement group (:mod:`.launch`); requests carry their tenant to the workers
(:class:`..tenants.AgentRef`). The cluster:

- routes each request (:mod:`.routing`, :mod:`.placement`): to the handle's worker, or the worker
  with the longest cached prefix, balanced by queue length; the request then goes to that actor
  directly, and a stream's chunks come from it to the reader directly (:mod:`.remote`);
- brings a handle to another worker when placement or an explicit :meth:`transfer` asks, by KV
  transfer (:mod:`.transfer`: the collective group formed inside the actors, or Ray's object store)
  or by recompute from lineage, whichever the calibrated cost model (:mod:`.costmodel`) predicts
  cheaper; transfers run in parallel; the decision, predicted and actual times go into ``stats().cluster``;
- survives worker failures with Ray: an actor that dies is restarted by Ray and rejoins
  (:mod:`.liveness`: also a hung actor is killed, so that Ray restarts it); requests in flight on it
  are run again elsewhere (a stream that already sent text is continued only when its sampling is
  deterministic, :mod:`.streams`), and handles that lived only there are recomputed from their
  lineage on next use, or live there again when it comes back with them (persistence: each worker
  keeps its own journal, and the handle table is rebuilt from the workers' journals at start and at
  every rejoin); ``healthy`` reports the cluster degraded while a worker is down.

STE hints, registered agents and the tenant partition go to every worker, and again to a worker
that rejoins. The measurements for the cost model live in :mod:`.calibration`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import ray  # noqa: F401 - the backend's one dependency beyond the engine's
except ImportError as exc:  # pragma: no cover - the cluster and test extras install it
    raise ImportError("multi-device serving runs its workers on Ray: pip install 'kvbaton[cluster]'") from exc
from kvbaton.capabilities import KVBATON, Capabilities
from kvbaton.errors import HandleNotFound, HandleReleased, IncompatibleHandle, InvalidRequest, ServerError
from kvbaton.handle import Handle, Segment
from kvbaton.ops import Context, HandleLike, check_reuse, ste_map
from kvbaton.stream import TokenStream
from kvbaton.types import AgentInfo, Composition, Events, Result, Reuse, SamplingParams, Stats, StreamChunk

from ..config import EngineConfig
from ..dirs import cache_dir
from ..events import EventRing, check_since
from ..handles import Identity
from ..hosting import HEALTHY, ConfiguredEngine, check_partition
from ..tenants import Agent, TenantPartition
from . import launch
from .calibration import measure_call_overhead, measure_link, measure_prefill
from .costmodel import PREFILL_PROBE_TOKENS, Calibration, CostModel, load_cached, store_cached
from .liveness import DEFAULT_TIMEOUT_S, Liveness
from .moves import Mover
from .placement import Placer
from .remote import LOST_ERRORS, WorkerLost, WorkerRef, answer
from .routing import Router
from .stats import cluster_stats
from .streams import recomputing_stream
from .worker import Worker

if TYPE_CHECKING:
    from ..cache.persist import Persistence

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
TRANSPORTS = ("auto", "collective", "object-store")


@dataclass(frozen=True)
class ModelInfo:
    """What the server reads of ``engine.loaded``."""

    name: str
    fingerprint: str
    tokenizer_fingerprint: str
    max_context: int
    vocab_size: int


class Cluster(ConfiguredEngine):
    """One worker actor per entry of ``devices`` (``"cpu"``, ``"cuda"``/``"cuda:N"``: a GPU of its own),
    on this machine (a private Ray instance) or on the Ray cluster at ``ray_address``.

    Each worker runs an engine of ``config`` on its own device (``model`` and ``engine_options``, the
    knobs of :class:`..config.EngineConfig`, change it). ``transport``: how KV moves between workers
    (``auto``: the collective group where every worker has a GPU of its own, NCCL, else Ray's object
    store; ``collective``: a group always, gloo on CPU; ``object-store``). ``placement_strategy``:
    the placement group's (``PACK`` by default; ``STRICT_SPREAD``: one worker per node).
    ``heartbeat_timeout``: a worker answering no liveness ping for this long is restarted."""

    def __init__(
        self,
        devices: Sequence[str] = ("cpu", "cpu"),
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        engine_options: dict[str, Any] | None = None,
        ray_address: str | None = None,
        transport: str = "auto",
        placement_strategy: str = "PACK",
        bandwidth_cap: float | None = None,
        calibrate: bool = True,
        calibration_cache: str | os.PathLike[str] | None = "default",
        balance_slack: int = 1,
        worker_log_level: str = "warning",
        worker_threads: int | None = None,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        heartbeat_timeout: float = DEFAULT_TIMEOUT_S,
        max_restarts: int = launch.DEFAULT_MAX_RESTARTS,
        gpu_share: float = 1.0,
    ) -> None:
        overrides = {"model": model, **(engine_options or {})} if model is not None else dict(engine_options or {})
        self.config = EngineConfig.build(config, **overrides)
        if not heartbeat_timeout > 0:
            raise InvalidRequest(f"the heartbeat timeout must be > 0 seconds, got {heartbeat_timeout}",
                                 param="heartbeat_timeout")
        if transport not in TRANSPORTS:
            raise InvalidRequest(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}",
                                 param="transport")
        devices = list(devices)
        if not devices:
            raise InvalidRequest("a cluster needs at least one device")
        self.devices = devices
        self.bandwidth_cap = bandwidth_cap
        self.costs = CostModel()
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
        self._router = Router(Placer(slack=balance_slack), self.workers)
        self._liveness = Liveness(self.workers, heartbeat_timeout, self._rejoin)
        self._pg = None
        self._started_ray = launch.connect(ray_address, devices)
        try:
            self._pg = launch.reserve(devices, placement_strategy, startup_timeout, gpu_share)
            args = (self.config.to_json(), bandwidth_cap, worker_log_level, str(cache_dir()))
            for rank, device in enumerate(devices):
                actor = launch.start_worker(Worker, self._pg, rank, device, args=(rank, device, *args),
                                            threads=worker_threads, max_restarts=max_restarts, gpu_share=gpu_share)
                self.workers.append(WorkerRef(rank, device, actor, self._router.worker_lost))
            import ray

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
        self.loaded = ModelInfo(
            name=first["model"], fingerprint=first["fingerprint"],
            tokenizer_fingerprint=first.get("tokenizer_fingerprint", ""),
            max_context=first["max_context"], vocab_size=first["vocab_size"],
        )
        self._router.table.identity = Identity(self.loaded.name, self.loaded.fingerprint, where="this server")
        self.block_size: int = first["block_size"]
        self.bytes_per_block: int = first["bytes_per_block"]
        self._router.mover = Mover(self.costs, self.block_size, self.bytes_per_block)
        for w in self.workers:  # persistence: the handles the workers kept from an earlier run
            self._release_stale(w, self._router.rejoined(w.rank, w.call("held")))
        try:
            self._router.mover.group = launch.form_group(self.workers, self.devices, transport)
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
                 self.transport)

    @property
    def transport(self) -> str:
        group = self._router.mover.group if self._router.mover is not None else None
        return f"collective ({group.backend})" if group is not None else "object store"

    def _rejoin(self, worker: WorkerRef) -> None:
        """Ray restarted ``worker``: it gets what every worker has (partition, agents, hints, link
        pacing), leaves the collective group (which takes no new member), and serves again with the
        handles it kept (persistence)."""
        import ray

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
        group = self._router.mover.group if self._router.mover is not None else None
        if group is not None:
            group.members.discard(worker.rank)
        worker.restarts += 1
        with self._events_lock:  # a new engine numbers its events from the start again
            self._event_cursors.pop(worker.rank, None)
        worker.joined(info)
        self._release_stale(worker, self._router.rejoined(worker.rank, held))
        log.warning("worker %d (%s) rejoined (pid %s, node %s) with %d handles", worker.rank, worker.device,
                    info["pid"], info["node_ip"], len(held))

    def _release_stale(self, worker: WorkerRef, ids: list[str]) -> None:
        if ids:
            try:
                worker.call("release", ids)
            except (WorkerLost, HandleNotFound, HandleReleased):
                pass

    @property
    def max_context(self) -> int | None:
        """The model's context length in tokens."""
        return self.loaded.max_context

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

    def capabilities(self) -> Capabilities:
        """Every worker runs kvbaton's own engine."""
        return KVBATON

    # -- the hosted-engine contract (hosting.py) ----------------------------------------------------
    @property
    def partitionable(self) -> TenantPartition:
        """Every worker keeps its prefix cache per tenant on request. Spans are not offered: each worker
        would partition its own span index, but cross-prefix reuse has not been checked across tenants on a
        cluster, so a multi-tenant server keeps a cluster's requests exact (unless spans are shared)."""
        return TenantPartition(prefix_cache=True, spans=False)

    def partition_tenants(self, partition: TenantPartition) -> None:
        """Keep tenants apart on every worker (see :meth:`Engine.partition_tenants`)."""
        check_partition(self, partition, self.partitionable)
        with self._replay_lock:
            self._partition = partition
            self._broadcast("partition_tenants", partition)

    @property
    def persistence(self) -> Persistence | None:
        """None: the server keeps no journal of a cluster's tenants. With ``persist`` each worker keeps its
        own (its handles survive a restart of its actor, and of the cluster: the handle table is rebuilt
        from the workers), but which tenant owns a handle does not survive a restart of the ingress."""
        return None

    # -- calibration ----------------------------------------------------------------------------
    def _calibration_key(self) -> str:
        return json.dumps({
            "model": self.loaded.fingerprint, "devices": [w.device for w in self.workers],
            "hosts": [w.info.get("node_ip") for w in self.workers], "block_size": self.block_size,
            "cap": self.bandwidth_cap, "transport": self.transport,
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
        fixed, per_token = measure_prefill(self._router.live_workers(), prefill_tokens)
        cal = Calibration(latency, bandwidth, overhead, fixed, per_token)
        self.costs.calibration = cal
        store_cached(self._calibration_path, key, cal)
        log.info("calibrated: latency %.2f ms, bandwidth %.1f MB/s, prefill %s tokens/s", latency * 1e3,
                 bandwidth / 1e6, {r: round(1 / v) if v else None for r, v in per_token.items()})
        return cal

    def _measure_link(self) -> tuple[float, float]:
        live = self._router.live_workers()
        group = self._router.mover.group if self._router.mover is not None else None
        collective = group is not None and group.joins(live[0].rank, live[1].rank)
        return measure_link(live[0], live[1], collective, self.bandwidth_cap, self.bytes_per_block)

    def set_bandwidth_cap(self, cap: float | None) -> Calibration:
        """Pace KV sends at ``cap`` bytes/s (None: unpaced) and re-measure the link (tests, benchmarks)."""
        for w in self._router.live_workers():
            w.call("set_bandwidth_cap", cap)
        self.bandwidth_cap = cap
        latency, bandwidth = self._measure_link()
        cal = self.costs.calibration or Calibration(latency, bandwidth, 0.0)
        cal.latency_s, cal.bandwidth_bytes_per_s = latency, bandwidth
        self.costs.calibration = cal
        return cal

    # -- operators ------------------------------------------------------------------------------
    def _prompt_tokens(self, context: Any) -> Any:
        """Token ids of text (tokenized on a worker), so that routing can match prefixes."""
        if isinstance(context, str) and len(self._router.live_workers()) > 1:
            return self.tokenize(context)
        return context

    def materialize(self, context: Any, *, agent: Agent | None = None) -> Handle:
        tokens = self._prompt_tokens(context)

        def run(w: WorkerRef) -> Handle:
            handle: Handle = w.call("materialize", tokens, agent=agent)
            self._router.record(w.rank, [handle])
            return handle

        return self._router.anywhere(tokens if isinstance(tokens, list) else None, run)

    def extend(self, handle: Handle | str, context: Any, *, agent: Agent | None = None) -> Handle:
        def run(w: WorkerRef, hid: str) -> Handle:
            new: Handle = w.call("extend", hid, context, agent=agent)
            self._router.record(w.rank, [new])
            return new

        return self._router.on_handle(handle, run)

    def fork(self, handle: Handle | str, k: int = 2) -> list[Handle]:
        def run(w: WorkerRef, hid: str) -> list[Handle]:
            children: list[Handle] = w.call("fork", hid, k)
            self._router.record(w.rank, children)
            return children

        return self._router.on_handle(handle, run)

    def transfer(self, handle: Handle | str, device: int | str, *, method: str = "auto") -> Handle:
        """Move ``handle`` to the worker ``device`` (a rank, or a device name that is unique), by KV
        transfer or recompute as the cost model chooses; ``method="transfer"``/``"recompute"`` forces one."""
        if method not in ("auto", "transfer", "recompute"):
            raise InvalidRequest(f"method must be 'auto', 'transfer' or 'recompute', got {method!r}")
        return self._router.transfer(handle, device, method)

    def compose(self, prefix: Handle | Context | None = None, segments: Sequence[Segment | Handle] = (),
                suffix: Context | None = None, *, agent: Agent | None = None, mode: str = "auto",
                correction: Mapping[str, Any] | None = None) -> Composition:
        correction = _plain(correction)
        refs = [s if isinstance(s, Handle) else s.handle for s in segments]
        if isinstance(prefix, Handle):
            refs.append(prefix)

        def run(w: WorkerRef) -> Composition:
            out: Composition = w.call("compose", prefix, list(segments), suffix, agent=agent, mode=mode,
                                      correction=correction)
            self._router.record(w.rank, [out.handle])
            return out

        return self._router.on_handles(refs, run)

    def merge(self, parts: Sequence[Segment | Handle], *, agent: Agent | None = None, mode: str = "auto",
              correction: Mapping[str, Any] | None = None) -> Composition:
        correction = _plain(correction)
        refs = [p if isinstance(p, Handle) else p.handle for p in parts]

        def run(w: WorkerRef) -> Composition:
            out: Composition = w.call("merge", list(parts), agent=agent, mode=mode, correction=correction)
            self._router.record(w.rank, [out.handle])
            return out

        return self._router.on_handles(refs, run)

    def fidelity(self, handle: Handle | str, max_tokens: int = 32, *, reference: Handle | str | None = None) -> Any:
        refs = [handle] if reference is None else [handle, reference]
        hid = self._router.hid
        return self._router.on_handles(refs, lambda w: w.call(
            "fidelity", hid(handle), max_tokens, reference=None if reference is None else hid(reference)
        ))

    def describe(self, handle: HandleLike) -> Handle:
        placed = self._router.known(self._router.hid(handle))
        with self._router.lock:
            return placed.meta

    def resume(self, handle: Handle | str, suffix: Any = "", sampling: SamplingParams | None = None, *,
               agent: Agent | None = None) -> Result:
        return self.resume_stream(handle, suffix, sampling, agent=agent).until_done()

    def resume_stream(self, handle: Handle | str, suffix: Any = "", sampling: SamplingParams | None = None, *,
                      agent: Agent | None = None) -> TokenStream:
        params = sampling or SamplingParams()
        return self._stream(params, lambda: self._router.on_handle(
            handle, lambda w, hid: (w, w.stream("resume_stream", hid, suffix, params, agent=agent))
        ))

    def complete(self, prompt: Any, sampling: SamplingParams | None = None, *, agent: Agent | None = None,
                 reuse: Reuse | None = None) -> Result:
        return self.complete_stream(prompt, sampling, agent=agent, reuse=reuse).until_done()

    def complete_stream(self, prompt: Any, sampling: SamplingParams | None = None, *,
                        agent: Agent | None = None, reuse: Reuse | None = None) -> TokenStream:
        # Each worker's span index holds what ran on it: cross-prefix reuse happens within a worker.
        check_reuse(reuse)
        params = sampling or SamplingParams()
        tokens = self._prompt_tokens(prompt)
        return self._stream(params, lambda: self._router.anywhere(
            tokens if isinstance(tokens, list) else None,
            lambda w: (w, w.stream("complete_stream", tokens, params, agent=agent, reuse=reuse)),
        ))

    def generate(self, messages: Any, *, handle: Handle | str | None = None, sampling: SamplingParams | None = None,
                 tools: list[dict[str, Any]] | None = None, agent: Agent | None = None,
                 reuse: Reuse | None = None) -> Result:
        return self.generate_stream(
            messages, handle=handle, sampling=sampling, tools=tools, agent=agent, reuse=reuse
        ).until_done()

    def generate_stream(self, messages: Any, *, handle: Handle | str | None = None,
                        sampling: SamplingParams | None = None, tools: list[dict[str, Any]] | None = None,
                        agent: Agent | None = None, reuse: Reuse | None = None) -> TokenStream:
        check_reuse(reuse)
        params = sampling or SamplingParams()
        if handle is not None:
            return self._stream(params, lambda: self._router.on_handle(
                handle, lambda w, hid: (w, w.stream(
                    "generate_stream", messages, handle=hid, sampling=params, tools=tools, agent=agent, reuse=reuse
                ))
            ))
        tokens = self.chat_tokens(messages, tools=tools) if len(self._router.live_workers()) > 1 else None
        return self._stream(params, lambda: self._router.anywhere(tokens, lambda w: (w, w.stream(
            "generate_stream", messages, sampling=params, tools=tools, agent=agent, reuse=reuse
        ))))

    def _stream(
        self, params: SamplingParams, start: Callable[[], tuple[WorkerRef, Iterator[StreamChunk | Result]]]
    ) -> TokenStream:
        def retried(worker: WorkerRef) -> None:
            self._router.retries += 1
            log.warning("worker %d died during a stream; re-running it elsewhere", worker.rank)

        return recomputing_stream(params, start, lambda w, h: self._router.record(w.rank, [h]), retried)

    def release(self, handles: Handle | str | Iterable[Handle | str]) -> None:
        for rank, ids in self._router.release(handles).items():  # all or nothing
            worker = self.workers[rank]
            if worker.alive:
                try:
                    worker.call("release", ids)
                except (WorkerLost, HandleNotFound, HandleReleased):
                    pass

    # -- whole-cluster calls ----------------------------------------------------------------------
    def _any(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._router.anywhere(None, lambda w: w.call(method, *args, **kwargs))

    def _broadcast(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The first live worker's answer to a call made on every live worker."""
        answers = self._gather(method, *args, **kwargs)
        return answers[0] if answers else None

    def _gather(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Every live worker's answer to the call (those lost meanwhile give none)."""
        out = []
        for w in self._router.live_workers():
            try:
                out.append(w.call(method, *args, **kwargs))
            except WorkerLost:
                continue
        return out

    def tokenize(self, text: str) -> list[int]:
        return list(self._any("tokenize", text))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return str(self._any("detokenize", list(token_ids) if not isinstance(token_ids, list) else token_ids))

    def chat_tokens(self, messages: Any, *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        return list(self._any("chat_tokens", messages, tools=tools, add_generation_prompt=add_generation_prompt))

    def register_agent(self, name: str, fixed_prompt: Any, *, prefill: bool = False) -> AgentInfo:
        with self._replay_lock:
            info: AgentInfo = self._broadcast("register_agent", name, fixed_prompt, prefill=prefill)
            self._agents[str(name)] = (fixed_prompt, prefill)
        return info

    def unregister_agent(self, name: str) -> bool:
        with self._replay_lock:
            self._agents.pop(str(name), None)
            return any(self._gather("unregister_agent", name))

    def hints(
        self, steps: Mapping[str, float] | Any, *, running: Iterable[str] = (), finished: Iterable[str] = ()
    ) -> dict[str, float]:
        # Every worker gets every hint: each evicts and prefetches its own blocks by the same workflow.
        steps = ste_map(steps, running, finished)
        with self._replay_lock:
            result: dict[str, float] = self._broadcast("hints", steps)
            self._hints = steps
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
        router = self._router
        return cluster_stats(self.workers, per, router.held(), self.costs, self.bandwidth_cap, router.retries,
                             len(router.table))

    def events(self, since: int = 0) -> Events:
        """The workers' events after ``since``, merged in the order the coordinator read them (each
        with its ``worker`` rank; ``seq`` is the coordinator's). Workers are read on each call: a
        worker's ring may lose events between two reads, counted in ``dropped``."""
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
        import ray

        if ray.is_initialized():  # a clean exit: the engines save what persistence keeps
            closing = [w.actor.call.remote("close") for w in self.workers if w.alive]
            try:
                ray.wait(closing, num_returns=len(closing), timeout=60)
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
        launch.stop([w.actor for w in self.workers], self._pg, self._started_ray)

    def __enter__(self) -> Cluster:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain(correction: Mapping[str, Any] | None) -> Any:
    """A correction mapping as a plain dict, which pickles to the worker whatever mapping it was."""
    return dict(correction) if isinstance(correction, Mapping) else correction
