"""A worker: one :class:`~kvbaton.backend.Engine` on one device, as a Ray actor.

The ingress (:mod:`.coordinator`) creates one actor per device in a placement group
(:mod:`.launch`) and calls it through Ray; Ray restarts an actor whose process dies, and the
restarted actor loads its engine again (with persistence on, its handles come back from its own
journal). Calls run in the actor's threads (the engine is thread-safe and batches concurrent
requests); ``ping`` and ``cancel`` run in their own concurrency group, so a busy worker still answers.

Every answer is data, never a raised exception: ``("ok", value)`` or ``("err", code, message)`` for
a call; a stream (a Ray streaming generator, consumed by the ingress directly: the chunks go from
this actor to the process that reads them, through nobody else) yields ``("started",)`` once the
engine admitted the request, then ``("chunk", c)``... and ends with ``("done", result)``,
``("err", code, message)`` or ``("cancelled",)``. A stream cancelled by its consumer releases the
handle its generation made (nobody will own it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray
from kvbaton.errors import KvbatonError, ServerError
from kvbaton.handle import Handle
from kvbaton.ops import OPERATORS, STREAM_OPERATORS

from ..config import EngineConfig
from ..hosting import WORKER_CALLS

log = logging.getLogger(__name__)

DIST_BACKEND_ENV = "KVBATON_DIST_BACKEND"

# The methods the ingress may call by name: the operators of the contract (kvbaton.ops), plus what a
# cluster needs of an engine beyond them (hosting.WorkerEngine: metadata, adoption of moved handles,
# cache probes, the tenant partition).
STREAM_METHODS = STREAM_OPERATORS
ENGINE_METHODS = (OPERATORS - STREAM_OPERATORS) | WORKER_CALLS
# Operators whose answers carry new handles: journaled on the worker when persistence is on.
_MAKERS = frozenset({"materialize", "extend", "fork", "resume", "complete", "generate", "compose", "merge", "adopt"})


def default_backend(devices: list[str]) -> str:
    """NCCL when every worker has a CUDA device of its own, gloo otherwise (CPU workers, several
    workers sharing one GPU, mixed CPU/GPU: gloo moves the blocks through host memory)."""
    cuda = [d for d in devices if d.startswith("cuda")]
    if len(cuda) == len(devices) and len({d if ":" in d else "cuda:0" for d in cuda}) == len(devices):
        return "nccl"
    return "gloo"


def worker_config(config: EngineConfig, rank: int, device: str, state_root: str | None) -> EngineConfig:
    """The engine config of worker ``rank``: its device, and with persistence its own disk-tier
    directory (``<root>/worker-<rank>``), since every worker keeps its own journal."""
    changes: dict[str, Any] = {"device": device}
    if config.persist:
        tiers = []
        for spec in config.tiers:
            kind, _, rest = spec.partition(":")
            if kind == "disk":
                size, _, path = rest.partition(":")
                base = Path(path) if path else Path(state_root or ".") / "tiers"
                spec = f"disk:{size}:{base / f'worker-{rank}'}"
            tiers.append(spec)
        changes["tiers"] = tuple(tiers)
    return dataclasses.replace(config, **changes)


def error_reply(exc: BaseException, who: str) -> tuple[str, str, str]:
    """A failure of ``who``'s call as data: its typed error, or an internal error naming it."""
    if isinstance(exc, KvbatonError):
        return ("err", exc.code, exc.message)
    log.exception("%s: call failed", who)
    return ("err", "internal_error", f"{who}: {type(exc).__name__}: {exc}")


def handles_of(value: Any) -> list[Handle]:
    """The handles an operator's answer carries."""
    if isinstance(value, Handle):
        return [value]
    if isinstance(value, list):
        return [h for h in value if isinstance(h, Handle)]
    handle = getattr(value, "handle", None)
    return [handle] if isinstance(handle, Handle) else []


@ray.remote(max_concurrency=64, concurrency_groups={"control": 4})
class Worker:
    """One engine of ``config`` (as JSON) on ``device``; ``rank`` is its place in the cluster."""

    def __init__(self, rank: int, device: str, config_json: str, bandwidth_cap: float | None = None,
                 log_level: str = "warning", state_root: str | None = None) -> None:
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from kvbaton.handle import Placement

        from ..engine import Engine
        from .transfer import Link

        self.rank = rank
        self.device = device
        # Under Ray a GPU worker sees its own GPU(s) only (CUDA_VISIBLE_DEVICES): it is cuda:0 here.
        local = "cuda:0" if device.startswith("cuda") and ray.get_gpu_ids() else device
        config = worker_config(EngineConfig.from_json(config_json), rank, local, state_root)
        self.engine = Engine(config=config)
        self.engine.placement = Placement(device=device, tier="device", worker=rank)
        self.persist = self.engine.persistence is not None
        self.link = Link(self.engine, bandwidth_cap)
        self._cancelled: dict[str, threading.Event] = {}  # by stream id (unique across ingresses)

    # -- control (own concurrency group: answered while every call thread is busy) ------------------
    @ray.method(concurrency_group="control")
    def ping(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def cancel(self, sid: str) -> None:
        event = self._cancelled.get(sid)
        if event is not None:
            event.set()

    def info(self) -> dict[str, Any]:
        """What the ingress needs to know of this worker (sent at start and at every rejoin)."""
        engine = self.engine
        lm = engine.loaded
        ctx = ray.get_runtime_context()
        return {
            "rank": self.rank, "device": self.device, "pid": os.getpid(), "host": socket.gethostname(),
            "node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "model": lm.name, "fingerprint": lm.fingerprint, "tokenizer_fingerprint": lm.tokenizer_fingerprint,
            "max_context": lm.max_context, "vocab_size": lm.vocab_size, "block_size": engine.block_size,
            "prefix_cache": engine.cache is not None, "bytes_per_block": engine.pool.shape.bytes_per_block,
            "persist": self.persist, "restarts": ctx.was_current_actor_reconstructed,
        }

    # -- engine calls ---------------------------------------------------------------------------
    def call(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> tuple[Any, ...]:
        try:
            value = self._handler(method)(*args, **(kwargs or {}))
            if self.persist and method in _MAKERS:
                self._journal(handles_of(value))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller as data
            return error_reply(exc, f"worker {self.rank}")
        return ("ok", value)

    def _handler(self, method: str) -> Callable[..., Any]:
        if method in ENGINE_METHODS:
            return getattr(self.engine, method)  # type: ignore[no-any-return]
        handlers: dict[str, Callable[..., Any]] = {
            "probe_prefill": self._probe_prefill,
            "set_bandwidth_cap": self._set_bandwidth_cap,
            "held": self._held,
            "close": self.engine.close,
        }
        if method not in handlers:
            raise ServerError(f"unknown worker method {method!r}")
        return handlers[method]

    def _journal(self, handles: list[Handle]) -> None:
        """With persistence, this worker's handles are journaled here, so that a restarted actor has
        them again (the cluster's tenants are the ingress's; the worker keeps no owner)."""
        if handles:
            self.engine.persist_handles(handles)

    def _held(self) -> list[Handle]:
        """The journaled handles this worker holds (after a restart: those it came back with)."""
        persistence = self.engine.persistence
        return [e.handle for e in persistence.journal.live()] if persistence is not None else []

    def stream(self, sid: str, method: str, args: tuple[Any, ...] = (),
               kwargs: dict[str, Any] | None = None) -> Iterator[tuple[Any, ...]]:
        """A stream as a Ray streaming generator (see the module docstring)."""
        cancelled = self._cancelled[sid] = threading.Event()
        try:
            if method not in STREAM_METHODS:
                raise ServerError(f"unknown stream method {method!r}")
            stream = getattr(self.engine, method)(*args, **(kwargs or {}))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller as data
            self._cancelled.pop(sid, None)
            yield error_reply(exc, f"worker {self.rank}")
            return
        try:
            yield ("started",)
            for chunk in stream:
                if cancelled.is_set():
                    break
                yield ("chunk", chunk)
            result = stream.result
            if cancelled.is_set():  # the consumer left: nobody will own what the generation made
                if result is not None and result.handle is not None:
                    self.engine.release(result.handle.id)
                yield ("cancelled",)
                return
            if self.persist and result is not None and result.handle is not None:
                self._journal([result.handle])
            yield ("done", result)
        except BaseException as exc:  # noqa: BLE001
            yield error_reply(exc, f"worker {self.rank}")
        finally:
            stream.close()
            self._cancelled.pop(sid, None)

    # -- moving KV (transfer.py) ------------------------------------------------------------------
    def export_blocks(self, handle_id: str) -> tuple[int, list[Any]]:
        return self.link.export(handle_id)

    def fetch_handle(self, source: Any, handle: Handle) -> tuple[Any, ...]:
        """Adopt ``handle`` with its blocks fetched from the worker actor ``source`` (object store)."""
        return self._answer(lambda: self.link.fetch(source, handle), journal=True)

    def group_address(self) -> str:
        """``ip:port`` where this worker, rank 0 of the collective group, can accept the others."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def join_group(self, backend: str, address: str, rank: int, world: int) -> tuple[Any, ...]:
        return self._answer(lambda: self.link.join_group(backend, address, rank, world))

    def send_handle(self, handle_id: str, dst: int, tag: int) -> tuple[Any, ...]:
        return self._answer(lambda: self.link.send(handle_id, dst, tag))

    def receive_handle(self, handle: Handle, src: int, tag: int) -> tuple[Any, ...]:
        return self._answer(lambda: self.link.receive(handle, src, tag), journal=True)

    def probe_blob(self, nbytes: int) -> Any:
        import numpy as np

        return np.zeros(max(1, nbytes), dtype=np.uint8)

    def fetch_probe(self, source: Any, nbytes: int) -> float:
        """Seconds to fetch ``nbytes`` made on ``source`` through the object store (paced like a move)."""
        start = time.perf_counter()
        blob = ray.get(source.probe_blob.remote(nbytes))
        self.link._pace(start, blob.nbytes)
        return time.perf_counter() - start

    def send_probe(self, nbytes: int, dst: int, tag: int) -> tuple[Any, ...]:
        return self._answer(lambda: self.link.send_probe(nbytes, dst, tag))

    def receive_probe(self, nbytes: int, src: int, tag: int) -> tuple[Any, ...]:
        return self._answer(lambda: self.link.receive_probe(nbytes, src, tag))

    def _answer(self, fn: Callable[[], Any], journal: bool = False) -> tuple[Any, ...]:
        try:
            value = fn()
            if journal and self.persist:
                self._journal(handles_of(value))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller as data
            return error_reply(exc, f"worker {self.rank}")
        return ("ok", value)

    def _set_bandwidth_cap(self, cap: float | None) -> None:
        self.link.bandwidth_cap = cap

    def _probe_prefill(self, n: int, seed: int) -> float:
        """Seconds to prefill ``n`` fresh (uncached) tokens, measured in the engine."""
        rng = random.Random(seed)
        tokens = [rng.randrange(100, self.engine.loaded.vocab_size) for _ in range(n)]
        start = time.perf_counter()
        handle = self.engine.materialize(tokens)
        seconds = time.perf_counter() - start
        self.engine.release(handle)
        return seconds
