"""Measuring a cluster for its cost model: the link between two workers and each worker's prefill.

The measurements feed :class:`~.costmodel.Calibration` (the transfer-or-recompute rule). A probe
goes over the transport KV moves take between the two workers: an object-store fetch (the
destination fetching bytes made on the source), or a send and its matching receive over the
collective group run at once (:func:`send_and_receive`, also how a KV transfer runs). Prefill is
probed with fresh random tokens (never cached) at a spread of lengths, and fitted as
``fixed + per_token * L``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from .costmodel import PREFILL_PROBE_TOKENS, fit_line
from .remote import WorkerRef

LINK_PROBE_BYTES = 32 * 2**20

_tags = itertools.count(1)


def next_tag() -> int:
    """A tag of its own for one exchange over the collective group (moves and probes alike)."""
    return next(_tags)


def send_and_receive(send: Callable[[], Any], receive: Callable[[], Any]) -> tuple[Any, Any]:
    """Run the two sides of a point-to-point exchange together (each blocks until the other runs)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fa, fb = pool.submit(send), pool.submit(receive)
        return fa.result(), fb.result()


def measure_link(
    src: WorkerRef, dst: WorkerRef, collective: bool, bandwidth_cap: float | None, bytes_per_block: int,
) -> tuple[float, float]:
    """The link's latency (s) and bandwidth (bytes/s) from ``src`` to ``dst``, over the transport a
    move between them takes (``collective``: their group, else the object store)."""
    big = int(min(LINK_PROBE_BYTES, bandwidth_cap * 0.3)) if bandwidth_cap else LINK_PROBE_BYTES
    big = max(big, bytes_per_block)

    def probe(nbytes: int) -> float:
        t0 = time.perf_counter()
        if collective:
            tag = next_tag()
            send_and_receive(lambda: src.invoke("send_probe", nbytes, dst.rank, tag),
                             lambda: dst.invoke("receive_probe", nbytes, src.rank, tag))
        else:
            dst.raw("fetch_probe", src.actor, nbytes)
        return time.perf_counter() - t0

    probe(1)  # connection set-up happens on first use
    small = sorted(probe(1) for _ in range(3))[1]
    large = min(probe(big) for _ in range(2))
    return small, (big - 1) / max(large - small, 1e-6)


def measure_call_overhead(worker: WorkerRef) -> float:
    """Seconds one call round trip takes (what a transferred handle's resume costs on top)."""
    worker.call("capabilities")
    start = time.perf_counter()
    for _ in range(3):
        worker.call("capabilities")
    return (time.perf_counter() - start) / 3


def measure_prefill(workers: Sequence[WorkerRef], lengths: Sequence[int] = PREFILL_PROBE_TOKENS
                    ) -> tuple[dict[int, float], dict[int, float]]:
    """Each worker's prefill time as ``fixed + per_token * L``: the fixed and per-token seconds by rank.
    The workers are probed at the same time, as they serve (each on its own device; CPU workers of
    one machine share its cores then, as they do serving)."""

    def probe(w: WorkerRef) -> tuple[float, float]:
        w.call("probe_prefill", 8, seed=w.rank)  # warm-up
        points = []
        for i, n in enumerate(lengths):
            t0 = time.perf_counter()
            w.call("probe_prefill", n, seed=1000 * (w.rank + 1) + i + int(time.time()))
            points.append((float(n), time.perf_counter() - t0))
        return fit_line(points)

    with concurrent.futures.ThreadPoolExecutor(max(1, len(workers))) as pool:
        lines = list(pool.map(probe, workers))
    fixed = {w.rank: line[0] for w, line in zip(workers, lines, strict=True)}
    per_token = {w.rank: line[1] for w, line in zip(workers, lines, strict=True)}
    return fixed, per_token
