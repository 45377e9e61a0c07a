"""Moving a handle's KV blocks between workers over a torch.distributed process group.

The sender streams only the blocks the handle's cached tokens occupy, one block at a time (K then
V), preceded by a small header (cached tokens, block count). Gloo carries CPU tensors, NCCL device
tensors; the pool's blocks are copied to the wire device as needed. An optional bandwidth cap
(bytes/s) paces the sender, so that tests and benchmarks can emulate a slow interconnect on one
machine; it is applied to the cost model's calibration too, since that goes through the same path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from kvbaton.errors import HandleNotFound
from kvbaton.handle import Handle

from ..engine import Engine


class Link:
    """This worker's side of the block transport: its process group backend and optional pacing."""

    def __init__(self, backend: str, device: torch.device, bandwidth_cap: float | None = None) -> None:
        self.backend = backend
        # NCCL moves device memory; gloo moves host memory.
        self.wire = device if backend == "nccl" else torch.device("cpu")
        self.bandwidth_cap = bandwidth_cap
        self.bytes_sent = 0
        self.bytes_received = 0

    def _pace(self, started: float, sent: int) -> None:
        cap = self.bandwidth_cap
        if cap:
            ahead = sent / cap - (time.perf_counter() - started)
            if ahead > 0:
                time.sleep(ahead)

    def send_tensors(self, tensors: Iterator[torch.Tensor], dst: int) -> int:
        started, sent = time.perf_counter(), 0
        for t in tensors:
            dist.send(t.to(self.wire).contiguous(), dst)
            sent += t.numel() * t.element_size()
            self._pace(started, sent)
        self.bytes_sent += sent
        return sent

    # -- handles ------------------------------------------------------------------------------
    def send_handle(self, engine: Engine, handle_id: str, dst: int) -> int:
        """Send a live handle's blocks to worker ``dst``; returns the bytes sent."""
        try:
            _, num_cached, blocks = engine.export_kv(handle_id)
        except BaseException:
            # Tell the receiver there is nothing coming, so it does not wait forever.
            dist.send(torch.tensor([-1, 0], dtype=torch.int64).to(self.wire), dst)
            raise
        n_blocks = -(-num_cached // engine.block_size)
        header = torch.tensor([num_cached, n_blocks], dtype=torch.int64)
        dist.send(header.to(self.wire), dst)

        def tensors() -> Iterator[torch.Tensor]:
            with _closing(blocks):
                for k, v in blocks:
                    yield k
                    yield v

        return self.send_tensors(tensors(), dst)

    def recv_handle(self, engine: Engine, handle: Handle, src: int) -> Handle:
        """Receive blocks sent by :meth:`send_handle` on worker ``src`` and adopt ``handle`` with them."""
        header = torch.empty(2, dtype=torch.int64, device=self.wire)
        dist.recv(header, src)
        num_cached, n_blocks = (int(x) for x in header.cpu())
        if num_cached < 0:
            raise HandleNotFound(f"worker {src} could not export handle {handle.id}")
        ps = engine.pool.shape
        shape = (ps.num_layers, ps.num_kv_heads, ps.block_size, ps.head_dim)
        done = 0

        def recv_block() -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal done
            k = torch.empty(shape, dtype=ps.dtype, device=self.wire)
            v = torch.empty(shape, dtype=ps.dtype, device=self.wire)
            dist.recv(k, src)
            dist.recv(v, src)
            done += 1
            self.bytes_received += k.nbytes + v.nbytes
            return k, v

        def blocks() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            while done < n_blocks:
                yield recv_block()  # written into the pool before the next one arrives

        try:
            return engine.adopt(handle, blocks(), num_cached)
        finally:
            while done < n_blocks:  # adoption failed: drain, so the sender never blocks forever
                recv_block()

    # -- calibration probes -----------------------------------------------------------------------
    def send_probe(self, nbytes: int, dst: int) -> None:
        self.send_tensors(iter([torch.zeros(max(1, nbytes), dtype=torch.uint8)]), dst)

    def recv_probe(self, nbytes: int, src: int) -> None:
        buf = torch.empty(max(1, nbytes), dtype=torch.uint8, device=self.wire)
        dist.recv(buf, src)


class _closing:
    """Close a generator on exit (unpins the exported blocks even when a send fails)."""

    def __init__(self, gen: Iterator[object]) -> None:
        self.gen = gen

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        close = getattr(self.gen, "close", None)
        if close is not None:
            close()
