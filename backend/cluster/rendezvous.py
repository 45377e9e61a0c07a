"""Cluster start-up: the worker processes of this machine, and every worker joining the coordinator.

The coordinator listens on its control address (``multiprocessing.connection``, authenticated with
the cluster key); each worker, started here or on another node (``kvbaton serve --rank R``),
connects and greets it with a ``hello`` naming its rank. Invariants: every rank in
``0..world_size-1`` joins exactly once before the cluster serves anything; a local worker that
exits during start-up, a bad greeting or the timeout fails the whole start-up (:class:`ServerError`).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Listener
from typing import TYPE_CHECKING, Any

from kvbaton.errors import ServerError

from .worker import CLUSTER_KEY_ENV, DIST_BACKEND_ENV, WorkerClient, default_backend

if TYPE_CHECKING:
    from ..config import EngineConfig

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def start_local_workers(
    devices: Sequence[str], world_size: int, master: tuple[str, int], control: tuple[str, int], key: bytes, *,
    config: EngineConfig, log_level: str, threads: int | None, bandwidth_cap: float | None,
) -> list[subprocess.Popen[bytes]]:
    """One worker process per local device, ranks ``0..len(devices)-1``, each an engine of ``config``
    on its own device."""
    env = {**os.environ, "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), CLUSTER_KEY_ENV: key.decode()}
    if threads:  # CPU workers sharing one machine: keep their OpenMP pools from oversubscribing it
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    settings = config.to_json()
    procs = []
    for rank, device in enumerate(devices):
        cmd = [
            sys.executable, "-m", "kvbaton.backend.cluster.worker", "--rank", str(rank), "--world-size",
            str(world_size), "--device", device, "--control", f"{control[0]}:{control[1]}",
            "--config", settings, "--log-level", log_level,
        ]
        if bandwidth_cap:
            cmd += ["--bandwidth-cap", str(bandwidth_cap)]
        if world_size == len(devices) and not os.environ.get(DIST_BACKEND_ENV):
            cmd += ["--backend", default_backend(list(devices))]
        procs.append(subprocess.Popen(cmd, env=env))
    return procs


def accept_workers(
    listener: Listener, procs: Sequence[subprocess.Popen[bytes]], world_size: int, timeout: float,
    on_lost: Callable[[WorkerClient], None],
) -> list[WorkerClient]:
    """Wait until every rank has joined; the workers by rank."""
    arrivals: queue.Queue[Any] = queue.Queue()

    def accept() -> None:
        for _ in range(world_size):
            try:
                conn = listener.accept()
                arrivals.put((conn, conn.recv()))
            except Exception as exc:  # noqa: BLE001 - closed listener or a peer without the key
                arrivals.put(exc)
                return

    threading.Thread(target=accept, name="kvbaton-cluster-accept", daemon=True).start()
    deadline = time.monotonic() + timeout
    joined: dict[int, WorkerClient] = {}
    while len(joined) < world_size:
        for proc in procs:
            if proc.poll() is not None:
                raise ServerError(f"a worker process exited during startup (code {proc.returncode})")
        try:
            item = arrivals.get(timeout=0.5)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise ServerError(f"only {len(joined)} of {world_size} workers joined in {timeout:.0f} s") from None
            continue
        if isinstance(item, Exception):
            raise ServerError(f"worker rendezvous failed: {item}")
        conn, (kind, hello) = item
        if kind != "hello" or hello["rank"] in joined or not 0 <= hello["rank"] < world_size:
            raise ServerError(f"unexpected worker greeting {kind!r} {hello!r}")
        joined[hello["rank"]] = WorkerClient(conn, hello, on_lost)
        log.info("worker %d joined: %s on %s (pid %s)", hello["rank"], hello["device"], hello["host"], hello["pid"])
    return [joined[r] for r in range(world_size)]
