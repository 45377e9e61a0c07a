"""A worker's side of moving KV blocks to another worker: two transports, any number at once.

- **object store** (every cluster; across nodes): the source puts its handle's blocks into Ray's
  object store in groups of ``BLOCKS_PER_OBJECT`` (numpy arrays, so they travel without a pickle
  copy) and the destination fetches them group by group, writing each into its pool as it arrives.
  The bytes go from the source's node to the destination's directly (Ray's object transfer), never
  through the ingress.
- **collective**: a torch.distributed group formed inside the actors once they exist (NCCL where every
  worker has a GPU of its own: device to device; gloo otherwise), the sender sending a two-number
  header then each block's K and V. Every transfer has its own tag, so transfers between the same
  pair interleave safely on gloo; NCCL ignores tags, so the ingress keeps one transfer per ordered
  pair there (:mod:`.moves`), never one per cluster.

An optional bandwidth cap (bytes/s) paces the receiving side (object store) or the sender
(collective) to emulate a slower interconnect on one machine; the calibration sees it too.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from kvbaton.errors import HandleNotFound
from kvbaton.handle import Handle

BLOCKS_PER_OBJECT = 8  # blocks per object-store object: a few MiB, so a fetch overlaps the pool writes
GROUP_TIMEOUT_S = 120.0


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host copy numpy can hold (bf16/fp16 as their 16-bit patterns)."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy().copy()
    return t.numpy().copy()


def from_numpy(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    if dtype in (torch.bfloat16, torch.float16):
        t = t.view(dtype)
    return t.to(device)


class Link:
    """One worker's transports: its collective group (when formed) and the pacing of its transfers."""

    def __init__(self, engine: Any, bandwidth_cap: float | None = None) -> None:
        self.engine = engine
        self.bandwidth_cap = bandwidth_cap
        self.backend: str | None = None  # the collective group's backend, once formed
        self.wire = torch.device("cpu")
        self.bytes_sent = 0
        self.bytes_received = 0

    def _pace(self, started: float, moved: int) -> None:
        cap = self.bandwidth_cap
        if cap:
            ahead = moved / cap - (time.perf_counter() - started)
            if ahead > 0:
                time.sleep(ahead)

    # -- object store ---------------------------------------------------------------------------
    def export(self, handle_id: str) -> tuple[int, list[Any]]:
        """Put the handle's blocks into the object store: its cached token count and one object ref
        per group of blocks (K and V stacked)."""
        import ray

        _, num_cached, blocks = self.engine.export_kv(handle_id)
        refs = []
        group: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for k, v in blocks:
                group.append((k, v))
                if len(group) == BLOCKS_PER_OBJECT:
                    refs.append(ray.put(_stack(group)))
                    group = []
            if group:
                refs.append(ray.put(_stack(group)))
        finally:
            close = getattr(blocks, "close", None)
            if close is not None:
                close()
        return num_cached, refs

    def fetch(self, source: Any, handle: Handle) -> Handle:
        """Fetch ``handle``'s blocks from the worker actor ``source`` and adopt it with them."""
        import ray

        num_cached, refs = ray.get(source.export_blocks.remote(handle.id))
        ps = self.engine.pool.shape
        device = self.engine.pool.device
        started, moved = time.perf_counter(), 0

        def blocks() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            nonlocal moved
            for ref in refs:
                ks, vs = ray.get(ref)
                moved += ks.nbytes + vs.nbytes
                self._pace(started, moved)
                for i in range(len(ks)):
                    yield from_numpy(ks[i], ps.dtype, device), from_numpy(vs[i], ps.dtype, device)

        try:
            return self.engine.adopt(handle, blocks(), num_cached)
        finally:
            self.bytes_received += moved

    # -- collective group ---------------------------------------------------------------------------
    def join_group(self, backend: str, address: str, rank: int, world: int) -> None:
        """Join the cluster's torch.distributed group (every worker calls this at once)."""
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(self.engine.pool.device)
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        self.backend = backend
        self.wire = self.engine.pool.device if backend == "nccl" else torch.device("cpu")

    def _send(self, tensors: Iterator[torch.Tensor], dst: int, tag: int) -> int:
        import torch.distributed as dist

        started, sent = time.perf_counter(), 0
        for t in tensors:
            dist.send(t.to(self.wire).contiguous(), dst, tag=tag)
            sent += t.numel() * t.element_size()
            self._pace(started, sent)
        self.bytes_sent += sent
        return sent

    def send(self, handle_id: str, dst: int, tag: int) -> int:
        """Send a live handle's blocks to group rank ``dst``; the bytes sent."""
        import torch.distributed as dist

        try:
            _, num_cached, blocks = self.engine.export_kv(handle_id)
        except BaseException:
            # Tell the receiver nothing is coming, so that it does not wait for the group's timeout.
            dist.send(torch.tensor([-1, 0], dtype=torch.int64).to(self.wire), dst, tag=tag)
            raise
        n_blocks = -(-num_cached // self.engine.block_size)
        dist.send(torch.tensor([num_cached, n_blocks], dtype=torch.int64).to(self.wire), dst, tag=tag)

        def tensors() -> Iterator[torch.Tensor]:
            try:
                for k, v in blocks:
                    yield k
                    yield v
            finally:
                close = getattr(blocks, "close", None)
                if close is not None:
                    close()

        return self._send(tensors(), dst, tag)

    def receive(self, handle: Handle, src: int, tag: int) -> Handle:
        """Receive the blocks :meth:`send` sends from group rank ``src`` and adopt ``handle`` with them."""
        import torch.distributed as dist

        header = torch.empty(2, dtype=torch.int64, device=self.wire)
        dist.recv(header, src, tag=tag)
        num_cached, n_blocks = (int(x) for x in header.cpu())
        if num_cached < 0:
            raise HandleNotFound(f"worker {src} could not export handle {handle.id}")
        ps = self.engine.pool.shape
        shape = (ps.num_layers, ps.num_kv_heads, ps.block_size, ps.head_dim)
        done = 0

        def recv_block() -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal done
            k = torch.empty(shape, dtype=ps.dtype, device=self.wire)
            v = torch.empty(shape, dtype=ps.dtype, device=self.wire)
            dist.recv(k, src, tag=tag)
            dist.recv(v, src, tag=tag)
            done += 1
            self.bytes_received += k.nbytes + v.nbytes
            return k, v

        def blocks() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            while done < n_blocks:
                yield recv_block()  # written into the pool before the next one arrives

        try:
            return self.engine.adopt(handle, blocks(), num_cached)
        finally:
            while done < n_blocks:  # adoption failed: drain, so that the sender never blocks
                recv_block()

    def send_probe(self, nbytes: int, dst: int, tag: int) -> None:
        self._send(iter([torch.zeros(max(1, nbytes), dtype=torch.uint8)]), dst, tag)

    def receive_probe(self, nbytes: int, src: int, tag: int) -> None:
        import torch.distributed as dist

        dist.recv(torch.empty(max(1, nbytes), dtype=torch.uint8, device=self.wire), src, tag=tag)


def _stack(group: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[np.ndarray, np.ndarray]:
    return to_numpy(torch.stack([k for k, _ in group])), to_numpy(torch.stack([v for _, v in group]))
