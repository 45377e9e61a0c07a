"""Moving a handle between workers: KV transfer or recompute from lineage, as the cost model says.

For a handle of ``L`` tokens the calibrated :class:`~.costmodel.CostModel` predicts a transfer
(latency + bytes / bandwidth + resume overhead) and a recompute on the destination (its prefill of
the tokens its prefix cache does not hold) and the cheaper runs; every decision is recorded with
its predictions and the time it took. Invariants: after a move the handle lives on the destination
only (same id, one more ``transfer`` lineage step); a transfer that fails falls back to recompute,
since the lineage always spells the tokens. Transfers run in parallel: over the object store each is
its own fetch; over a collective group each has its own tag (:mod:`.transfer`), and only NCCL, which
ignores tags, keeps one transfer per ordered pair of workers at a time.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from kvbaton.errors import KvbatonError
from kvbaton.handle import Handle, LineageStep, Op, Placement
from kvbaton.types import PlacementDecision

from .calibration import next_tag, send_and_receive
from .costmodel import CostModel
from .remote import WorkerLost, WorkerRef


@dataclass
class Group:
    """The collective group formed inside the workers: its backend and the ranks still in it (a worker
    Ray restarted has left it: torch.distributed takes no new member, so its moves use the object store)."""

    backend: str
    members: set[int]
    _pairs: dict[tuple[int, int], threading.Lock] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def joins(self, src: int, dst: int) -> bool:
        return src in self.members and dst in self.members

    def pair(self, src: int, dst: int) -> threading.Lock | None:
        """NCCL: the lock of the ordered pair (it ignores tags); gloo: none needed."""
        if self.backend != "nccl":
            return None
        with self._lock:
            return self._pairs.setdefault((src, dst), threading.Lock())


def transfer_kv(src: WorkerRef, dst: WorkerRef, moved: Handle, group: Group | None) -> Handle:
    """Move ``moved``'s blocks from ``src`` to ``dst`` (collective group when both are in it, else the
    object store); the handle as ``dst`` holds it. ``src`` still holds its copy."""
    if group is not None and group.joins(src.rank, dst.rank):
        tag = next_tag()
        lock = group.pair(src.rank, dst.rank)
        if lock is not None:
            lock.acquire()
        try:
            _, new = send_and_receive(lambda: src.invoke("send_handle", moved.id, dst.rank, tag),
                                      lambda: dst.invoke("receive_handle", moved, src.rank, tag))
        finally:
            if lock is not None:
                lock.release()
        return new  # type: ignore[no-any-return]
    return dst.invoke("fetch_handle", src.actor, moved)  # type: ignore[no-any-return]

log = logging.getLogger(__name__)


class Mover:
    def __init__(self, costs: CostModel, block_size: int, bytes_per_block: int) -> None:
        self.costs = costs
        self.group: Group | None = None
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block

    def move(
        self, meta: Handle, src: WorkerRef | None, dst: WorkerRef, reason: str, method: str = "auto"
    ) -> Handle:
        """Bring the handle ``meta`` from ``src`` (None or dead: lost) to ``dst`` by transfer or recompute;
        the handle as ``dst`` now holds it. ``method`` forces one ("transfer" / "recompute") instead of
        the cost model's choice (benchmarks)."""
        hid = meta.id
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
                new = transfer_kv(src, dst, moved, self.group)
                try:  # a move: the handle lives on dst only from now on
                    src.call("release", [hid])
                except (KvbatonError, WorkerLost):
                    pass
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
            cached = self._cached_on(dst, meta)
            started = time.perf_counter()
            # The lineage says how it moved: a recompute is dense prefill (exact again), not a transfer.
            moved = moved.model_copy(update={"lineage": meta.lineage + (LineageStep(op=Op.RECOMPUTE, parent=hid),)})
            new = dst.call("adopt", moved)
            # Observed prefills refit the worker's prefill line (costmodel): it follows the real lengths.
            self.costs.observe_prefill(dst.rank, tokens - cached, time.perf_counter() - started)
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
        return new

    def _cached_on(self, worker: WorkerRef, meta: Handle) -> int:
        """Tokens of ``meta`` the worker's prefix cache holds (0 without a cache): a recompute there skips them."""
        if not worker.info.get("prefix_cache", True) or meta.num_tokens < self.block_size:
            return 0
        try:
            return int(worker.call("cached_prefix", meta.token_ids()))
        except KvbatonError:
            return 0
