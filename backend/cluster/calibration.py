"""Measuring a cluster for its cost model: the link between two workers and each worker's prefill.

The measurements feed :class:`~.costmodel.Calibration` (the transfer-or-recompute rule). A probe
runs a send on one worker and its matching receive on the other at the same time
(:func:`send_and_receive`, also how a KV transfer runs), under the cluster's transfer lock so no
real transfer shares the link meanwhile. Prefill is probed with fresh random tokens (never cached)
at two lengths, and fitted as ``fixed + per_token * L``.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .costmodel import PREFILL_PROBE_TOKENS, fit_line
from .worker import WorkerClient

LINK_PROBE_BYTES = 32 * 2**20


def send_and_receive(send: Callable[[], Any], receive: Callable[[], Any]) -> tuple[Any, Any]:
    """Run the two sides of a point-to-point exchange together (each blocks until the other runs)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fa, fb = pool.submit(send), pool.submit(receive)
        return fa.result(), fb.result()


def measure_link(
    src: WorkerClient, dst: WorkerClient, transfer_lock: threading.Lock, bandwidth_cap: float | None,
    bytes_per_block: int,
) -> tuple[float, float]:
    """The link's latency (s) and bandwidth (bytes/s) from ``src`` to ``dst``."""
    big = int(min(LINK_PROBE_BYTES, bandwidth_cap * 0.3)) if bandwidth_cap else LINK_PROBE_BYTES
    big = max(big, bytes_per_block)

    def probe(nbytes: int) -> float:
        with transfer_lock:
            t0 = time.perf_counter()
            send_and_receive(lambda: src.call("send_probe", nbytes, dst.rank),
                             lambda: dst.call("recv_probe", nbytes, src.rank))
            return time.perf_counter() - t0

    probe(1)  # connection set-up happens on first use
    small = sorted(probe(1) for _ in range(3))[1]
    large = min(probe(big) for _ in range(2))
    return small, (big - 1) / max(large - small, 1e-6)


def measure_call_overhead(worker: WorkerClient) -> float:
    """Seconds one control round trip takes (what a transferred handle's resume costs on top)."""
    start = time.perf_counter()
    for _ in range(3):
        worker.call("ping")
    return (time.perf_counter() - start) / 3


def measure_prefill(workers: Sequence[WorkerClient]) -> tuple[dict[int, float], dict[int, float]]:
    """Each worker's prefill time as ``fixed + per_token * L``: the fixed and per-token seconds by rank."""
    fixed: dict[int, float] = {}
    per_token: dict[int, float] = {}
    for w in workers:
        w.call("probe_prefill", 8, seed=w.rank)  # warm-up
        points = []
        for i, n in enumerate(PREFILL_PROBE_TOKENS):
            t0 = time.perf_counter()
            w.call("probe_prefill", n, seed=1000 * (w.rank + 1) + i + int(time.time()))
            points.append((float(n), time.perf_counter() - t0))
        fixed[w.rank], per_token[w.rank] = fit_line(points)
    return fixed, per_token
