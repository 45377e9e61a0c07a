"""A worker: one process owning one :class:`Engine` on one device, and the client the coordinator
uses to talk to it.

The worker joins two channels:

- the torch.distributed process group of all workers (``MASTER_ADDR``/``MASTER_PORT`` env
  rendezvous; gloo on CPU, NCCL on CUDA), used only to move KV blocks between workers
  (:mod:`.transfer`);
- a control connection to the coordinator (``multiprocessing.connection`` over TCP, authenticated
  with ``$KVBATON_CLUSTER_KEY``), carrying engine calls and their results as pickled messages.

Each call runs in its own thread (the engine is thread-safe and batches concurrent requests).
Streams send their chunks as they come and always end with one terminal message (``done`` with the
result, ``err``, or ``cancelled`` once a cancel stopped them). A stream the coordinator abandons is
kept in its table until that terminal message: a result that was already on its way (the
generation finished as the consumer left) is released on the worker, since nobody will own its
handle. When the control connection closes, the worker exits.

Run as ``python -m kvbaton.backend.cluster.worker --rank R --world-size N --device D --control HOST:PORT
--config JSON`` (the cluster's :class:`..config.EngineConfig`, its device replaced by ``D``); ``kvbaton
serve`` starts workers itself (and ``kvbaton serve --rank R`` for R > 0 runs one).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import logging
import os
import queue
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Client as _connect
from multiprocessing.connection import Connection
from typing import Any

from kvbaton.errors import KvbatonError, ServerError, error_from_code
from kvbaton.ops import OPERATORS, STREAM_OPERATORS
from kvbaton.types import Result, StreamChunk

from ..config import EngineConfig
from ..hosting import WORKER_CALLS

log = logging.getLogger(__name__)

CLUSTER_KEY_ENV = "KVBATON_CLUSTER_KEY"
DIST_BACKEND_ENV = "KVBATON_DIST_BACKEND"
DEFAULT_CLUSTER_KEY = "kvbaton-loopback"  # only acceptable when everything binds loopback
RENDEZVOUS_TIMEOUT_S = 600.0

# The methods the coordinator may call: the operators of the contract (kvbaton.ops), plus what a
# cluster needs of an engine beyond them (hosting.WorkerEngine: metadata, adoption of moved handles,
# cache probes, the tenant partition).
STREAM_METHODS = STREAM_OPERATORS
ENGINE_METHODS = (OPERATORS - STREAM_OPERATORS) | WORKER_CALLS


def default_backend(devices: list[str]) -> str:
    """NCCL when every worker has a CUDA device of its own, gloo otherwise (CPU workers, several
    workers sharing one GPU, mixed CPU/GPU: gloo moves the blocks through host memory)."""
    cuda = [d for d in devices if d.startswith("cuda")]
    if len(cuda) == len(devices) and len({d if ":" in d else "cuda:0" for d in cuda}) == len(devices):
        return "nccl"
    return "gloo"


def cluster_key() -> bytes:
    return os.environ.get(CLUSTER_KEY_ENV, DEFAULT_CLUSTER_KEY).encode()


class WorkerLost(Exception):
    """The worker died or its control connection broke (internal: the coordinator retries)."""


# -- the worker process ---------------------------------------------------------------------------


class WorkerServer:
    """Serves one engine over a control connection."""

    def __init__(self, rank: int, engine: Any, link: Any, conn: Connection) -> None:
        self.rank = rank
        self.engine = engine
        self.link = link
        self.conn = conn
        self._send_lock = threading.Lock()
        self._cancelled: dict[int, threading.Event] = {}
        self._transfer_lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self.conn.send(message)

    def serve_forever(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                log.info("worker %d: control connection closed, exiting", self.rank)
                return
            kind = message[0]
            if kind == "exit":
                return
            if kind == "beat":  # answered here, not in a call's thread: a busy worker still answers at once
                self.send(("beat",))
                continue
            if kind == "cancel":
                event = self._cancelled.get(message[1])
                if event is not None:
                    event.set()
                continue
            _, cid, method, args, kwargs = message
            target = self._stream if kind == "stream" else self._call
            threading.Thread(target=target, args=(cid, method, args, kwargs), daemon=True).start()

    def _fail(self, cid: int, exc: BaseException) -> None:
        if isinstance(exc, KvbatonError):
            self.send(("err", cid, exc.code, exc.message))
        else:
            log.exception("worker %d: call failed", self.rank)
            self.send(("err", cid, "internal_error", f"worker {self.rank}: {type(exc).__name__}: {exc}"))

    def _call(self, cid: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            fn = self._handler(method)
            value = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            self._fail(cid, exc)
            return
        self.send(("ok", cid, value))

    def _stream(self, cid: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cancelled = self._cancelled[cid] = threading.Event()
        try:
            if method not in STREAM_METHODS:
                raise ServerError(f"unknown stream method {method!r}")
            stream = getattr(self.engine, method)(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            self._cancelled.pop(cid, None)
            self._fail(cid, exc)
            return
        self.send(("started", cid))
        try:
            for chunk in stream:
                if cancelled.is_set():
                    break
                self.send(("chunk", cid, chunk))
            if not cancelled.is_set():
                self.send(("done", cid, stream.result))
            else:  # the coordinator left: nobody will own what the generation made
                result = stream.result
                if result is not None and result.handle is not None:
                    self.engine.release(result.handle.id)
                self.send(("cancelled", cid))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            self._fail(cid, exc)
        finally:
            stream.close()
            self._cancelled.pop(cid, None)

    def _handler(self, method: str) -> Callable[..., Any]:
        if method in ENGINE_METHODS:
            return getattr(self.engine, method)  # type: ignore[no-any-return]
        handlers: dict[str, Callable[..., Any]] = {
            "ping": lambda: True,
            "send_handle": self._send_handle,
            "recv_handle": self._recv_handle,
            "send_probe": self.link.send_probe,
            "recv_probe": self.link.recv_probe,
            "probe_prefill": self._probe_prefill,
            "set_bandwidth_cap": self._set_bandwidth_cap,
        }
        if method not in handlers:
            raise ServerError(f"unknown worker method {method!r}")
        return handlers[method]

    def _send_handle(self, handle_id: str, dst: int, release: bool = True) -> int:
        sent = self.link.send_handle(self.engine, handle_id, dst)
        if release:  # a move: the handle now lives on dst only
            self.engine.release(handle_id)
        return int(sent)

    def _recv_handle(self, handle: Any, src: int) -> Any:
        return self.link.recv_handle(self.engine, handle, src)

    def _set_bandwidth_cap(self, cap: float | None) -> None:
        self.link.bandwidth_cap = cap

    def _probe_prefill(self, n: int, seed: int) -> float:
        """Seconds to prefill ``n`` fresh (uncached) tokens, measured in the engine."""
        rng = random.Random(seed)
        vocab = self.engine.loaded.vocab_size
        tokens = [rng.randrange(100, vocab) for _ in range(n)]
        start = time.perf_counter()
        handle = self.engine.materialize(tokens)
        seconds = time.perf_counter() - start
        self.engine.release(handle)
        return seconds


def _hello(rank: int, device: str, engine: Any) -> dict[str, Any]:
    lm = engine.loaded
    return {
        "rank": rank,
        "device": device,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "model": lm.name,
        "fingerprint": lm.fingerprint,
        "tokenizer_fingerprint": lm.tokenizer_fingerprint,
        "max_context": lm.max_context,
        "vocab_size": lm.vocab_size,
        "block_size": engine.block_size,
        "prefix_cache": engine.cache is not None,
        "bytes_per_block": engine.pool.shape.bytes_per_block,
    }


def run_worker(
    rank: int,
    world_size: int,
    device: str,
    control: tuple[str, int],
    config: EngineConfig,
    bandwidth_cap: float | None = None,
    backend: str | None = None,
) -> None:
    """Load the engine of ``config`` on ``device``, join the process group, connect to the coordinator
    and serve until told to stop.

    ``backend``: the torch.distributed backend every worker of the cluster uses (default
    ``$KVBATON_DIST_BACKEND``, else NCCL on CUDA and gloo on CPU)."""
    import torch
    import torch.distributed as dist
    from kvbaton.handle import Placement

    from ..engine import Engine
    from .transfer import Link

    engine = Engine(config=dataclasses.replace(config, device=device))
    engine.placement = Placement(device=str(engine.pool.device), tier="device", worker=rank)
    backend = backend or os.environ.get(DIST_BACKEND_ENV) or default_backend([str(engine.pool.device)])
    if backend == "nccl":
        torch.cuda.set_device(engine.pool.device)
    log.info("worker %d/%d on %s: joining the %s process group at %s:%s", rank, world_size, device, backend,
             os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
    dist.init_process_group(
        backend, init_method="env://", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
    )
    link = Link(backend, engine.pool.device, bandwidth_cap)
    conn = _connect_retry(control)
    conn.send(("hello", _hello(rank, device, engine)))
    try:
        WorkerServer(rank, engine, link, conn).serve_forever()
    finally:
        try:  # the engine's own resources first: slow-tier directories, scheduler threads
            engine.close()
        except Exception:  # noqa: BLE001 - leaving anyway; the next start collects what is left
            log.exception("worker %d: closing the engine failed", rank)
        # Peers may be dead already: skip collective teardown, just leave.
        os._exit(0)


def _connect_retry(control: tuple[str, int], timeout: float = RENDEZVOUS_TIMEOUT_S) -> Connection:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _connect(control, authkey=cluster_key())
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.backend.cluster.worker", description="one kvbaton worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--control", required=True, help="HOST:PORT of the coordinator's control listener")
    parser.add_argument("--config", default="{}", help="the engine's config as JSON (EngineConfig.to_json)")
    parser.add_argument("--bandwidth-cap", type=float, default=None, help="bytes/s pacing of KV sends (tests)")
    parser.add_argument("--backend", default=None, choices=["gloo", "nccl"], help="torch.distributed backend")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, _, port = args.control.rpartition(":")
    run_worker(args.rank, args.world_size, args.device, (host, int(port)), EngineConfig.from_json(args.config),
               args.bandwidth_cap, args.backend)


# -- the coordinator's side -----------------------------------------------------------------------


_STREAM_ENDS = frozenset({"done", "err", "cancelled", "lost"})  # the last message of a stream


class _Pending:
    def __init__(self, streaming: bool) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.items: queue.Queue[tuple[Any, ...]] | None = queue.Queue() if streaming else None
        self.abandoned = False  # a stream its consumer left: waiting for its terminal message


def _made(item: tuple[Any, ...]) -> str | None:
    """The id of the handle a stream's ``done`` message carries, if any."""
    if item[0] != "done":
        return None
    handle = getattr(item[1], "handle", None)
    return handle.id if handle is not None else None


class WorkerClient:
    """The coordinator's connection to one worker. ``queue`` counts calls in flight on it."""

    _ids = itertools.count(1)

    def __init__(self, conn: Connection, hello: dict[str, Any], on_lost: Callable[[WorkerClient], None]) -> None:
        self.conn = conn
        self.info = hello
        self.rank: int = hello["rank"]
        self.device: str = hello["device"]
        self.pid: int | None = hello.get("pid")
        self.host: str | None = hello.get("host")
        self.alive = True
        self.lost_reason: str | None = None  # why it is down, for /health (None: it died)
        self._closing = False
        self._on_lost = on_lost
        self._heard = time.monotonic()  # when the worker last sent anything (heartbeats included)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._reader = threading.Thread(target=self._read, name=f"kvbaton-worker-{self.rank}", daemon=True)
        self._reader.start()

    @property
    def queue(self) -> int:
        return len(self._pending)

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, EOFError, ValueError) as exc:
            self._lost()
            raise WorkerLost(f"worker {self.rank} is unreachable") from exc

    def _start(self, kind: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, _Pending]:
        if not self.alive:
            raise WorkerLost(f"worker {self.rank} is down")
        cid = next(self._ids)
        pending = _Pending(streaming=kind == "stream")
        with self._lock:
            if not self.alive:  # lost between the check above and now
                raise WorkerLost(f"worker {self.rank} is down")
            self._pending[cid] = pending
        try:
            self._send((kind, cid, method, args, kwargs))
        except WorkerLost:
            with self._lock:
                self._pending.pop(cid, None)
            raise
        return cid, pending

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        _, pending = self._start("call", method, args, kwargs)
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        return pending.value

    def stream(self, method: str, *args: Any, **kwargs: Any) -> Iterator[StreamChunk | Result]:
        """Start a stream; returns once the worker has admitted it (or raises its error).

        The iterator yields chunks and, last, the :class:`Result`; closing it early cancels the
        generation on the worker."""
        cid, pending = self._start("stream", method, args, kwargs)
        assert pending.items is not None
        first = pending.items.get()
        if first[0] != "started":
            with self._lock:
                self._pending.pop(cid, None)
            raise _error(first)
        return self._items(cid, pending)

    def _items(self, cid: int, pending: _Pending) -> _StreamItems:
        return _StreamItems(self, cid, pending)

    def _forget(self, cid: int) -> None:
        """Stream ``cid`` ended and its consumer read the end."""
        with self._lock:
            self._pending.pop(cid, None)

    def _abandon(self, cid: int, pending: _Pending) -> None:
        """The consumer left stream ``cid`` before its end: cancel it on the worker; whatever it
        made (a result already sent, or sent before the cancel arrives) is released there."""
        assert pending.items is not None
        with self._lock:  # the reader queues under the same lock: nothing slips between the two
            pending.abandoned = True
            waiting: list[tuple[Any, ...]] = []
            while not pending.items.empty():
                waiting.append(pending.items.get_nowait())
            ended = next((item for item in waiting if item[0] in _STREAM_ENDS), None)
            if ended is not None:
                self._pending.pop(cid, None)
        if ended is not None:
            self._release_orphan(_made(ended))
        elif self.alive:
            try:
                self._send(("cancel", cid))
            except WorkerLost:
                pass

    def _release_orphan(self, hid: str | None) -> None:
        """Release on the worker a handle an abandoned stream made, without waiting for the answer
        (the reader thread calls this; the answer, to an id nobody waits for, is dropped)."""
        if hid is None or not self.alive:
            return
        try:
            self._send(("call", next(self._ids), "release", ([hid],), {}))
        except WorkerLost:
            pass

    def silent_s(self) -> float:
        """Seconds since the worker last sent anything."""
        return time.monotonic() - self._heard

    def beat(self) -> None:
        """Send a heartbeat, unless a send is under way (it would wait on the connection: the silence
        counts either way); never blocks."""
        if not self._send_lock.acquire(blocking=False):
            return
        try:
            self.conn.send(("beat",))
        except (OSError, EOFError, ValueError):
            pass  # the reader notices the connection is gone
        finally:
            self._send_lock.release()

    def hung(self, reason: str) -> None:
        """The worker answers nothing: from now on it is down (as if it died: every call and stream in
        flight on it fails over), and its connection is shut, which wakes a send blocked on it and makes
        the worker exit if it ever wakes up."""
        self.lost_reason = reason
        self._lost()
        try:
            with socket.fromfd(self.conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self._lost()
                return
            self._heard = time.monotonic()
            if message[0] == "beat":
                continue
            kind, cid = message[0], message[1]
            orphan: str | None = None
            with self._lock:
                pending = self._pending.get(cid)
                if pending is not None and pending.items is not None:
                    if not pending.abandoned:
                        pending.items.put((kind, *message[2:]))
                        continue
                    if kind not in _STREAM_ENDS:
                        continue  # a chunk of an abandoned stream
                    self._pending.pop(cid, None)
                    orphan = _made((kind, *message[2:]))
                    pending = None
            if pending is None:
                self._release_orphan(orphan)
                continue
            with self._lock:
                self._pending.pop(cid, None)
            if kind == "ok":
                pending.value = message[2]
            else:
                pending.error = _error((kind, *message[2:]))
            pending.done.set()

    def _lost(self) -> None:
        with self._lock:
            if not self.alive:
                return
            self.alive = False
            pending = list(self._pending.values())
            for cid in [cid for cid, p in self._pending.items() if p.abandoned]:
                del self._pending[cid]  # nobody waits for them, and nothing of theirs is left
        if not self._closing:
            log.error("worker %d (%s, pid %s) is lost%s", self.rank, self.device, self.pid,
                      f": {self.lost_reason}" if self.lost_reason else "")
        for p in pending:
            if p.items is not None:
                p.items.put(("lost",))
            else:
                p.error = WorkerLost(f"worker {self.rank} died")
                p.done.set()
        if not self._closing:
            self._on_lost(self)

    def close(self) -> None:
        self._closing = True
        if self.alive:
            try:
                self._send(("exit",))
            except WorkerLost:
                pass
        try:
            self.conn.close()
        except OSError:
            pass


class _StreamItems(Iterator[StreamChunk | Result]):
    """The chunks of one stream on a worker, then its :class:`Result`. Closing it before the end
    (also before the first item was read) abandons the stream: see :meth:`WorkerClient._abandon`."""

    def __init__(self, client: WorkerClient, cid: int, pending: _Pending) -> None:
        self._client, self._cid, self._pending = client, cid, pending
        self._ended = False

    def __next__(self) -> StreamChunk | Result:
        if self._ended:
            raise StopIteration
        assert self._pending.items is not None
        item = self._pending.items.get()
        if item[0] == "chunk":
            return item[1]  # type: ignore[no-any-return]
        self._ended = True
        self._client._forget(self._cid)
        if item[0] == "done":
            return item[1]  # type: ignore[no-any-return]
        raise _error(item)

    def close(self) -> None:
        if not self._ended:
            self._ended = True
            self._client._abandon(self._cid, self._pending)


def _error(item: tuple[Any, ...]) -> BaseException:
    if item[0] == "lost":
        return WorkerLost("worker died")
    if item[0] == "err":
        return error_from_code(item[1], item[2])
    return ServerError(f"unexpected worker message {item[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
