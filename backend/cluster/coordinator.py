"""The ingress of a multi-device server: one engine interface over worker actors on Ray.

:class:`Cluster` implements :class:`kvbaton.ops.EngineOps` and the hosted-engine contract
(:class:`..hosting.HostedEngine`) as :class:`~kvbaton.backend.Engine` does, so ``kvbaton serve
--devices cpu,cpu`` and ``EmbeddedClient(engine=Cluster(...))`` work unchanged. Every worker is a Ray
actor (:mod:`.worker`) running an engine of the cluster's one :class:`..config.EngineConfig` on its
own device; the workers, the handle table and the placement of requests belong to the cluster's
**control** (:mod:`.control`). For each request the ingress:

- opens a ticket at the control (:mod:`.routing`): the worker that runs it, the handle's worker or
  the one with the longest cached prefix, balanced by load; the control first brings the handles
  there when placement says so (KV transfer or recompute, as the calibrated cost model predicts cheaper);
- calls that worker's actor itself, and reads a stream's chunks from it directly (:mod:`.remote`):
  tokens never pass through the control;
- ends the ticket with the handles the request made (and their tenant), or runs it again elsewhere
  when its worker died (a stream that already sent text only when its sampling is deterministic,
  :mod:`.streams`).

One ingress runs its control in its own process. With ``name`` the control is a named Ray actor
instead, and :meth:`Cluster.attach` gives other processes (other ``kvbaton serve --attach NAME``) an
ingress over the same workers and handles: no request or token stream then passes through one process.
Requests carry their tenant to the workers (:class:`..tenants.AgentRef`) and to the control, which
records the tenant of each handle, so that every ingress authorizes as the one that made it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

try:
    import ray  # the backend's one dependency beyond the engine's
except ImportError as exc:  # pragma: no cover - the cluster and test extras install it
    raise ImportError("multi-device serving runs its workers on Ray: pip install 'kvbaton[cluster]'") from exc
from kvbaton.capabilities import KVBATON, Capabilities
from kvbaton.errors import InvalidRequest, ServerError, ServerUnavailable
from kvbaton.handle import Handle, Segment
from kvbaton.ops import Context, HandleLike, check_reuse, ste_map
from kvbaton.stream import TokenStream
from kvbaton.types import AgentInfo, Composition, Events, Result, Reuse, SamplingParams, Stats, StreamChunk

from ..config import EngineConfig
from ..handles import Identity, handle_id
from ..hosting import ConfiguredEngine, check_partition
from ..tenants import Agent, AgentRef, TenantPartition
from . import launch
from .control import CONTROL_PREFIX, Control, ControlActor, Joined, RemoteControl
from .costmodel import PREFILL_PROBE_TOKENS, Calibration
from .liveness import DEFAULT_TIMEOUT_S
from .remote import WorkerLost, WorkerRef
from .routing import Ticket
from .streams import recomputing_stream
from .worker import handles_of

if TYPE_CHECKING:
    from ..cache.persist import Persistence

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
CONTROL_TIMEOUT_S = 900.0  # a control call waits at most a lease (300 s) and a move: never forever
TRANSPORTS = ("auto", "collective", "object-store")

T = TypeVar("T")


class Cluster(ConfiguredEngine):
    """One worker actor per entry of ``devices`` (``"cpu"``, ``"cuda"``/``"cuda:N"``: a GPU of its own),
    on this machine (a private Ray instance) or on the Ray cluster at ``ray_address``.

    Each worker runs an engine of ``config`` on its own device (``model`` and ``engine_options``, the
    knobs of :class:`..config.EngineConfig`, change it). ``transport``: how KV moves between workers
    (``auto``: the collective group where every worker has a GPU of its own, NCCL, else Ray's object
    store; ``collective``: a group always, gloo on CPU; ``object-store``). ``placement_strategy``:
    the placement group's (``PACK`` by default; ``STRICT_SPREAD``: one worker per node).
    ``heartbeat_timeout``: a worker answering no liveness ping for this long is restarted. ``name``:
    other processes may serve this cluster too (:meth:`attach`); it lives as long as this object."""

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
        name: str | None = None,
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
        options: dict[str, Any] = {
            "ray_address": ray_address, "transport": transport, "placement_strategy": placement_strategy,
            "bandwidth_cap": bandwidth_cap, "calibrate": calibrate,
            "calibration_cache": os.fspath(calibration_cache) if calibration_cache is not None else None,
            "balance_slack": balance_slack, "worker_log_level": worker_log_level, "worker_threads": worker_threads,
            "startup_timeout": startup_timeout, "heartbeat_timeout": heartbeat_timeout,
            "max_restarts": max_restarts, "gpu_share": gpu_share,
        }
        self.name = name
        self._actor: Any = None
        self._started_ray = False
        if name is None:
            self._control: Any = Control(self.config, devices, **options)
        else:
            self._started_ray = launch.connect(ray_address, devices)
            try:
                self._actor = ControlActor.options(
                    name=CONTROL_PREFIX + name, namespace=launch.NAMESPACE, runtime_env=launch.runtime_env(None),
                ).remote(self.config.to_json(), devices, {**options, "ray_address": None}, worker_log_level)
            except ValueError as exc:  # Ray: the name is taken
                self.close()
                raise InvalidRequest(f"a kvbaton cluster named {name!r} already runs on this Ray cluster: "
                                     "attach to it, or choose another name", param="name") from exc
            self._control = RemoteControl(self._actor, CONTROL_TIMEOUT_S)
        try:
            self._join(self._control.joined())
        except BaseException:
            self.close()
            raise

    @classmethod
    def attach(cls, name: str, *, ray_address: str | None = None, timeout: float = 60.0) -> Cluster:
        """Another ingress over the cluster started as ``Cluster(..., name=name)`` (``kvbaton serve
        --cluster-name NAME``) on the Ray cluster at ``ray_address`` (None: the one this process is
        connected to, else ``auto``). It serves with the cluster's engine config (what the workers run);
        ``timeout``: how long its first call waits for the control. Closing it leaves the cluster running."""
        self = cls.__new__(cls)
        self.name = name
        self._started_ray = False
        if not ray.is_initialized():
            ray.init(address=ray_address or "auto", namespace=launch.NAMESPACE, log_to_driver=False,
                     **({} if (ray_address or "").startswith("ray://") else {"include_dashboard": False}))
            self._started_ray = True
        try:
            actor = ray.get_actor(CONTROL_PREFIX + name, namespace=launch.NAMESPACE)
        except ValueError as exc:
            self._actor = None
            self.close()
            raise InvalidRequest(f"no kvbaton cluster named {name!r} on this Ray cluster: start one with "
                                 f"kvbaton serve --devices ... --cluster-name {name}") from exc
        self._actor = None  # not ours: closing this ingress leaves it running
        self._control = RemoteControl(actor, timeout)
        try:
            self._join(self._control.joined())
        except BaseException:
            self.close()
            raise
        self._control.timeout = CONTROL_TIMEOUT_S
        return self

    def _join(self, joined: Joined) -> None:
        self.config = EngineConfig.from_json(joined.config_json)  # what the workers run (an attached ingress's too)
        self.loaded = joined.model
        self.block_size = joined.block_size
        self.bytes_per_block = joined.bytes_per_block
        self.tenant_salt = joined.tenant_salt
        self._identity = Identity(self.loaded.name, self.loaded.fingerprint, where="this server")
        if isinstance(self._control, Control):
            self.workers = self._control.workers  # the control's own: it watches them
        else:  # this process's view: down when a call here fails, alive again when the control places on it
            self.workers = []
            for rank, device, actor, info, alive in joined.workers:
                w = WorkerRef(rank, device, actor, lambda _w: None)
                w.info, w.alive = info, alive
                self.workers.append(w)
        self.devices = [w.device for w in self.workers]
        self._next_any = 0
        self._any_lock = threading.Lock()

    @property
    def transport(self) -> str:
        return str(self._control.transport())

    @property
    def max_context(self) -> int | None:
        """The model's context length in tokens."""
        return self.loaded.max_context

    def healthy(self) -> tuple[bool, str]:
        """Serves while at least one worker is alive; degraded (the reason names the workers down and
        why) while some are not."""
        try:
            ok, why = self._control.healthy()
        except ServerUnavailable as exc:  # an attached ingress whose cluster stopped
            return False, exc.message
        return bool(ok), str(why)

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
        self._control.partition_tenants(partition)

    @property
    def persistence(self) -> Persistence | None:
        """None: the server keeps no journal of a cluster's tenants. With ``persist`` each worker keeps its
        own (its handles survive a restart of its actor, and of the cluster: the handle table is rebuilt
        from the workers), but which tenant owns a handle does not survive a restart of the control."""
        return None

    def handle_owner(self, hid: str) -> tuple[str | None, int] | None:
        """(the tenant that made it, its tokens) of a live handle of the cluster, whichever ingress made
        it; None for an id not live. A server asks it of a handle it did not make (several ingresses)."""
        owner = self._control.owner_of(hid)
        return (owner[0], int(owner[1])) if owner is not None else None

    # -- calibration ----------------------------------------------------------------------------
    def calibrate(self, force: bool = False, prefill_tokens: Sequence[int] = PREFILL_PROBE_TOKENS) -> Calibration:
        """Measure (or load from the cache) link latency/bandwidth and each worker's prefill speed (probed
        at ``prefill_tokens`` fresh tokens)."""
        return self._control.calibrate(force, tuple(prefill_tokens))  # type: ignore[no-any-return]

    def set_bandwidth_cap(self, cap: float | None) -> Calibration:
        """Pace KV sends at ``cap`` bytes/s (None: unpaced) and re-measure the link (tests, benchmarks)."""
        return self._control.set_bandwidth_cap(cap)  # type: ignore[no-any-return]

    def predict_recompute(self, rank: int, tokens: int) -> float:
        """The cost model's prediction of a recompute of ``tokens`` fresh tokens on worker ``rank``."""
        return float(self._control.predict_recompute(rank, tokens))

    # -- requests: a ticket at the control, the call on the worker --------------------------------------
    def _hid(self, handle: HandleLike) -> str:
        return handle_id(handle, self._identity)

    def _placed(self, ticket: Ticket) -> WorkerRef:
        worker = self.workers[ticket.rank]
        if not worker.alive:
            worker.revive()  # the control, which watches the workers, placed it here
        return worker

    def _start(self, begin: Callable[[], Ticket], call: Callable[[WorkerRef, Ticket], T]) -> tuple[Ticket, WorkerRef, T]:
        """Open a ticket and run ``call`` on its worker; again on another worker when this one died (that
        ticket failed). The ticket returned is open: the caller ends it."""
        for _ in range(len(self.workers) + 1):
            ticket = begin()
            worker = self._placed(ticket)
            try:
                return ticket, worker, call(worker, ticket)
            except WorkerLost:
                self._control.failed(ticket, True)
            except BaseException:
                self._control.failed(ticket, False)
                raise
        raise ServerError("no worker could serve the request")

    def _run(self, begin: Callable[[], Ticket], call: Callable[[WorkerRef, Ticket], T], agent: Agent | None) -> T:
        """A request on the worker its ticket names, the ticket ended with the handles it made."""
        ticket, _, out = self._start(begin, call)
        self._control.done(ticket, list(handles_of(out)), _tenant(agent))
        return out

    def _on_handle(self, handle: HandleLike) -> Callable[[], Ticket]:
        hid = self._hid(handle)
        return lambda: self._control.begin_on_handle(hid)  # type: ignore[no-any-return]

    def _on_handles(self, handles: Iterable[HandleLike]) -> Callable[[], Ticket]:
        hids = sorted({self._hid(h) for h in handles})
        return lambda: self._control.begin_on_handles(hids)  # type: ignore[no-any-return]

    def _anywhere(self, tokens: Any) -> Callable[[], Ticket]:
        prompt = tokens if isinstance(tokens, list) else None
        return lambda: self._control.begin_anywhere(prompt)  # type: ignore[no-any-return]

    def _prompt_tokens(self, context: Any) -> Any:
        """Token ids of text (tokenized on a worker), so that routing can match prefixes."""
        if isinstance(context, str) and len(self.workers) > 1:
            return self.tokenize(context)
        return context

    def materialize(self, context: Any, *, agent: Agent | None = None) -> Handle:
        tokens = self._prompt_tokens(context)
        return self._run(self._anywhere(tokens), lambda w, t: w.call("materialize", tokens, agent=agent), agent)

    def extend(self, handle: Handle | str, context: Any, *, agent: Agent | None = None) -> Handle:
        return self._run(self._on_handle(handle), lambda w, t: w.call("extend", t.hids[0], context, agent=agent),
                         agent)

    def fork(self, handle: Handle | str, k: int = 2) -> list[Handle]:
        return self._run(self._on_handle(handle), lambda w, t: w.call("fork", t.hids[0], k), None)

    def transfer(self, handle: Handle | str, device: int | str, *, method: str = "auto") -> Handle:
        """Move ``handle`` to the worker ``device`` (a rank, or a device name that is unique), by KV
        transfer or recompute as the cost model chooses; ``method="transfer"``/``"recompute"`` forces one."""
        if method not in ("auto", "transfer", "recompute"):
            raise InvalidRequest(f"method must be 'auto', 'transfer' or 'recompute', got {method!r}")
        return self._control.transfer(self._hid(handle), device, method)  # type: ignore[no-any-return]

    def compose(self, prefix: Handle | Context | None = None, segments: Sequence[Segment | Handle] = (),
                suffix: Context | None = None, *, agent: Agent | None = None, mode: str = "auto",
                correction: Mapping[str, Any] | None = None) -> Composition:
        correction = _plain(correction)
        refs = [s if isinstance(s, Handle) else s.handle for s in segments]
        if isinstance(prefix, Handle):
            refs.append(prefix)
        return self._run(self._on_handles(refs), lambda w, t: w.call(
            "compose", prefix, list(segments), suffix, agent=agent, mode=mode, correction=correction), agent)

    def merge(self, parts: Sequence[Segment | Handle], *, agent: Agent | None = None, mode: str = "auto",
              correction: Mapping[str, Any] | None = None) -> Composition:
        correction = _plain(correction)
        refs = [p if isinstance(p, Handle) else p.handle for p in parts]
        return self._run(self._on_handles(refs), lambda w, t: w.call(
            "merge", list(parts), agent=agent, mode=mode, correction=correction), agent)

    def fidelity(self, handle: Handle | str, max_tokens: int = 32, *, reference: Handle | str | None = None) -> Any:
        refs = [handle] if reference is None else [handle, reference]
        hid = self._hid(handle)
        ref = None if reference is None else self._hid(reference)
        return self._run(self._on_handles(refs), lambda w, t: w.call("fidelity", hid, max_tokens, reference=ref),
                         None)

    def describe(self, handle: HandleLike) -> Handle:
        return self._control.describe(self._hid(handle))  # type: ignore[no-any-return]

    def resume(self, handle: Handle | str, suffix: Any = "", sampling: SamplingParams | None = None, *,
               agent: Agent | None = None) -> Result:
        return self.resume_stream(handle, suffix, sampling, agent=agent).until_done()

    def resume_stream(self, handle: Handle | str, suffix: Any = "", sampling: SamplingParams | None = None, *,
                      agent: Agent | None = None) -> TokenStream:
        params = sampling or SamplingParams()
        return self._stream(params, self._on_handle(handle), agent, lambda w, t: w.stream(
            "resume_stream", t.hids[0], suffix, params, agent=agent))

    def complete(self, prompt: Any, sampling: SamplingParams | None = None, *, agent: Agent | None = None,
                 reuse: Reuse | None = None) -> Result:
        return self.complete_stream(prompt, sampling, agent=agent, reuse=reuse).until_done()

    def complete_stream(self, prompt: Any, sampling: SamplingParams | None = None, *,
                        agent: Agent | None = None, reuse: Reuse | None = None) -> TokenStream:
        # Each worker's span index holds what ran on it: cross-prefix reuse happens within a worker.
        check_reuse(reuse)
        params = sampling or SamplingParams()
        tokens = self._prompt_tokens(prompt)
        return self._stream(params, self._anywhere(tokens), agent, lambda w, t: w.stream(
            "complete_stream", tokens, params, agent=agent, reuse=reuse))

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
            return self._stream(params, self._on_handle(handle), agent, lambda w, t: w.stream(
                "generate_stream", messages, handle=t.hids[0], sampling=params, tools=tools, agent=agent,
                reuse=reuse))
        tokens = self.chat_tokens(messages, tools=tools) if len(self.workers) > 1 else None
        return self._stream(params, self._anywhere(tokens), agent, lambda w, t: w.stream(
            "generate_stream", messages, sampling=params, tools=tools, agent=agent, reuse=reuse))

    def _stream(self, params: SamplingParams, begin: Callable[[], Ticket], agent: Agent | None,
                call: Callable[[WorkerRef, Ticket], Iterator[StreamChunk | Result]]) -> TokenStream:
        owner = _tenant(agent)

        def start() -> tuple[WorkerRef, Iterator[StreamChunk | Result]]:
            ticket, worker, items = self._start(begin, call)
            self._control.started(ticket)  # admitted: its handles may move again
            return worker, _Ticketed(items, ticket, self._control, owner)

        def retried(worker: WorkerRef) -> None:
            log.warning("worker %d died during a stream; re-running it elsewhere", worker.rank)

        return recomputing_stream(params, start, retried)

    def release(self, handles: Handle | str | Iterable[Handle | str]) -> None:
        items = [handles] if isinstance(handles, Handle | str) else list(handles)
        self._control.release([self._hid(h) for h in items])  # all or nothing

    # -- whole-cluster calls ----------------------------------------------------------------------
    def _any(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A call any worker answers alike (tokenizer): the next live one in turn, another if it died."""
        for _ in range(2):
            live = [w for w in self.workers if w.alive]
            for _ in range(len(live)):
                with self._any_lock:
                    worker = live[self._next_any % len(live)]
                    self._next_any += 1
                try:
                    return worker.call(method, *args, **kwargs)
                except WorkerLost:
                    continue
            for rank in self._control.alive():  # this process's view may lag the control's
                self.workers[rank].revive()
        raise ServerError("every worker is down")

    def tokenize(self, text: str) -> list[int]:
        return list(self._any("tokenize", text))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return str(self._any("detokenize", list(token_ids) if not isinstance(token_ids, list) else token_ids))

    def chat_tokens(self, messages: Any, *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        return list(self._any("chat_tokens", messages, tools=tools, add_generation_prompt=add_generation_prompt))

    def register_agent(self, name: str, fixed_prompt: Any, *, prefill: bool = False) -> AgentInfo:
        return self._control.register_agent(name, fixed_prompt, prefill)  # type: ignore[no-any-return]

    def unregister_agent(self, name: str) -> bool:
        return bool(self._control.unregister_agent(name))

    def hints(
        self, steps: Mapping[str, float] | Any, *, running: Iterable[str] = (), finished: Iterable[str] = ()
    ) -> dict[str, float]:
        return self._control.hints(dict(ste_map(steps, running, finished)))  # type: ignore[no-any-return]

    def flush_cache(self) -> None:
        self._control.flush_cache()

    def stats(self) -> Stats:
        return self._control.stats()  # type: ignore[no-any-return]

    def events(self, since: int = 0) -> Events:
        """The workers' events after ``since``, merged in the order the control read them (each with its
        ``worker`` rank; ``seq`` is the control's, shared by every ingress)."""
        return self._control.events(since)  # type: ignore[no-any-return]

    def kill_worker(self, rank: int) -> None:
        """Kill a worker's process outright (SIGKILL), as a crash would (Ray restarts it): for fault tests."""
        self._control.kill_worker(rank)

    def close(self) -> None:
        """Stop the cluster (its control and workers), or, for an ingress that attached, only this ingress."""
        control = getattr(self, "_control", None)
        if isinstance(control, Control):
            control.close()
        elif self._actor is not None:
            try:
                control.close()  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
            launch.stop([self._actor], None, False)
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False

    def __enter__(self) -> Cluster:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Ticketed(Iterator[StreamChunk | Result]):
    """A worker's stream that ends its ticket at the control when it ends (with the handle its result
    carries), fails (its worker died: ``lost``) or is closed by its consumer."""

    def __init__(self, items: Iterator[StreamChunk | Result], ticket: Ticket, control: Any, owner: str | None) -> None:
        self._items, self._ticket, self._control, self._owner = items, ticket, control, owner
        self._ended = False

    def _end(self, handles: Sequence[Handle] = (), *, failed: bool = False, lost: bool = False) -> None:
        if self._ended:
            return
        self._ended = True
        if failed:
            self._control.failed(self._ticket, lost)
        else:
            self._control.done(self._ticket, list(handles), self._owner)

    def __next__(self) -> StreamChunk | Result:
        try:
            item = next(self._items)
        except StopIteration:
            self._end()
            raise
        except WorkerLost:
            self._end(failed=True, lost=True)
            raise
        except BaseException:
            self._end(failed=True)
            raise
        if isinstance(item, Result):
            self._end([item.handle] if item.handle is not None else [])
        return item

    def close(self) -> None:
        close = getattr(self._items, "close", None)
        if close is not None:
            close()
        self._end()


def _tenant(agent: Agent | None) -> str | None:
    """The tenant of a request's agent (None: none named), the owner of the handles it makes."""
    return agent.tenant if isinstance(agent, AgentRef) else None


def _plain(correction: Mapping[str, Any] | None) -> Any:
    """A correction mapping as a plain dict, which pickles to the worker whatever mapping it was."""
    return dict(correction) if isinstance(correction, Mapping) else correction
