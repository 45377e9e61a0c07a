"""The CUDA runner: decode steps replayed from CUDA graphs, prefill through FlashAttention-class kernels.

A :class:`~kvbaton.backend.compute.runner.ModelRunner` over :func:`.step.step` (the forward as one pure tensor
function over static input buffers, weights fused once per model):

- **Decode rows**: a step whose chunks are decode steps and short prefill chunks (up to
  :data:`SMALL_CHUNK_ROWS` tokens each, :data:`BUCKETS`' largest in all: a resume's question, a few tokens of a
  turn) runs each token as one row of the decode step, at its own position, seeing every key up to its own:
  each layer writes every row's K/V before any row attends, so a chunk's rows come out causal, as the CPU's
  fused step runs chunks of a few tokens. It replays a CUDA graph captured once per row-count bucket
  (:data:`BUCKETS`, as nano-vLLM and vLLM do) at start-up: the rows are padded to their bucket (padding rows
  write no K/V and attend to nothing), their inputs are copied into the graph's buffers with one upload, and
  the whole step (every layer's matrix products, the paged decode kernel, the LM head) is one launch: a short
  prefill costs what a decode step costs. More rows, or a runner with graphs off (:attr:`use_graphs`), run the
  same step eagerly. Graphs are captured when the runner is built, before any request can run a CUDA
  operation on another thread during a capture.
- **Prefill**, chunked prefill and batches that mix them with decode steps go as ONE varlen forward of every
  chunk (the scheduler bounds its tokens by ``max_batch_tokens``): fresh prompts from position 0 attend over
  the step's own K/V (bf16/fp16: SDPA's cuDNN or FlashAttention backend, no K/V read back from the pool),
  chunks behind cached tokens by FlashAttention-2 varlen over each sequence's keys (bf16/fp16), else the
  Triton varlen kernel reading the pool (fp32; sparse chunks at explicit positions, selective recomputation,
  whose tokens sit among cached ones).
- The deviation probe (cross-prefix reuse) and positions past the model's rotary table run the eager runner's
  code path (:class:`~kvbaton.backend.compute.eager.EagerRunner`: the Hugging Face model with SDPA over the
  pool), which also keeps every capability of the model the step does not cover.

fp32 is token-identical to the eager runner and to transformers (the Triton kernels multiply in full fp32);
the GPU benchmark (``python -m kvbaton.bench gpu``) checks both, graphs against eager too.

The same step runs on any device through :class:`StepRunner` with the torch reference stages, which is
how its math is tested on CPU. Nothing here touches CUDA at import time, so it imports on every machine.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...cache.block_pool import BlockPool
from ...models.paths import CUDA_GRAPHS, model_refusal
from ..attention import SDPA
from ..eager import EagerRunner, separate
from ..loader import LoadedModel
from ..runner import Chunk, ModelRunner, RunnerUnavailable
from .ops import TorchOps, TritonOps, triton_missing
from .step import StepBatch, StepOps, StepWeights, step, step_weights

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Prefill chunks of up to this many tokens run as rows of the decode step (graph-replayed on CUDA): a row reads its
# sequence's context once, and the rows of one chunk read the same K/V side by side (neighbouring programs of the
# decode kernel), so a few dozen rows stay cheap even at long context.
SMALL_CHUNK_ROWS = 32
# KVBATON_CUDA_RUNNER=0: CUDA runs the eager runner (A/B checks); KVBATON_CUDA_GRAPHS=0: the step eagerly.
RUNNER_ENV, GRAPHS_ENV = "KVBATON_CUDA_RUNNER", "KVBATON_CUDA_GRAPHS"


def unavailable_reason(loaded: LoadedModel) -> str | None:
    """Why the CUDA runner cannot run ``loaded`` here (None: it can)."""
    if loaded.device.type != "cuda":
        return f"the model is on {loaded.device.type}, not on a CUDA device"
    if not torch.cuda.is_available():
        return "no CUDA device here (torch.cuda.is_available() is False)"
    if os.environ.get(RUNNER_ENV, "1") == "0":
        return f"turned off by {RUNNER_ENV}=0"
    # The registry says which families the step implements (the others run on the eager runner, exactly).
    return model_refusal(CUDA_GRAPHS, loaded.model, loaded.arch) or triton_missing()


@dataclass
class _Span:
    """Where one chunk's logits are among the step's logit rows."""

    first: int
    end: int
    every: bool  # the chunk wants logits of all its tokens


def _slots(table: Sequence[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    return np.asarray(table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


class _Upload:
    """Host int32 arrays to the device in one copy each: through a reused pinned buffer on CUDA (the next upload
    first waits for the last copy out of it), as a plain tensor elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: torch.Tensor | None = None
        self._done: torch.cuda.Event | None = None

    def host(self, array: np.ndarray) -> torch.Tensor:
        source = torch.from_numpy(array)
        if self.device.type != "cuda":
            return source
        if self._pinned is None or self._pinned.numel() < source.numel():
            if self._done is not None:
                self._done.synchronize()
            self._pinned = torch.empty(max(source.numel(), 4096) * 2, dtype=torch.int32, pin_memory=True)
        elif self._done is not None:
            self._done.synchronize()
        staged = self._pinned[: source.numel()]
        staged.copy_(source)
        return staged

    def copied(self) -> None:
        """Mark the pinned buffer as being read by copies already enqueued."""
        if self.device.type == "cuda":
            self._done = self._done or torch.cuda.Event()
            self._done.record()

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        staged = self.host(array)
        if self.device.type != "cuda":
            return staged
        out = staged.to(self.device, non_blocking=True)
        self.copied()
        return out


class StepRunner:
    """A :class:`~kvbaton.backend.compute.runner.ModelRunner` over :func:`.step.step`, eagerly, on any device
    (see the module; :class:`CudaGraphRunner` adds the graphs). ``fallback`` runs the deviation probe and
    positions past the rotary table."""

    def __init__(self, loaded: LoadedModel, pool: BlockPool, ops: StepOps, fallback: ModelRunner,
                 weights: StepWeights | None = None, *, fall_back_on_error: bool = False,
                 small_chunk_rows: int = 0) -> None:
        self.loaded, self.pool, self.ops, self.fallback = loaded, pool, ops, fallback
        # Chunks of up to this many tokens run as decode rows (see the module); 0: only one-token chunks do.
        self.small_chunk_rows = small_chunk_rows
        self.max_rows = BUCKETS[-1]
        self.weights = weights or step_weights(loaded)
        self.device = loaded.device
        self.block_size = pool.block_size
        self._upload = _Upload(self.device)
        # Forwards by path, for benchmarks: a graph replayed, the step run eagerly, the fallback; "rows": forwards
        # that ran prefill chunks as decode rows (graph-replayed or eager).
        self.forwards = {"graph": 0, "eager step": 0, "fallback": 0, "rows": 0}
        # With ``fall_back_on_error``, a forward the step cannot run (a kernel that fails to compile on this GPU)
        # sends it and every later one to the fallback, logged once; ``failed`` says why.
        self._fall_back_on_error = fall_back_on_error
        self.failed: str | None = None

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        if self.failed is not None or any(self._last_position(c) >= self.weights.max_positions for c in chunks):
            self.forwards["fallback"] += 1
            return self.fallback.forward(chunks)
        if not self._fall_back_on_error:
            return self._forward(chunks)
        try:
            return self._forward(chunks)
        except Exception as exc:  # the same chunks again on the eager runner (writes are idempotent)
            self.failed = f"{type(exc).__name__}: {exc}"
            log.exception("the CUDA runner's step failed: this runner's forwards go to the eager runner from now on")
            self.forwards["fallback"] += 1
            return self.fallback.forward(chunks)

    def _forward(self, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        sizes = [len(c.token_ids) for c in chunks]
        if all(n == 1 for n in sizes) or (sum(sizes) <= self.max_rows and max(sizes) <= self.small_chunk_rows):
            if max(sizes) > 1:
                self.forwards["rows"] += 1
            logits = self._decode(chunks)
            # Rows of one fresh tensor, not a copy each (a kernel and an allocation per sequence per step): a
            # decode step's logits are sampled and dropped (the lifecycle copies a row it keeps with a state).
            out, row = [], 0
            for chunk, n in zip(chunks, sizes):
                out.append(logits[row : row + n] if chunk.all_logits else logits[row + n - 1])
                row += n
            return out
        batch, spans = self._prefill_batch(chunks)
        self.forwards["eager step"] += 1
        logits = step(self.weights, self.pool.k, self.pool.v, batch, self.ops)
        return separate([logits[s.first : s.end] if s.every else logits[s.first] for s in spans])

    def deviation(self, blocks: Sequence[int], start: int, token_ids: Sequence[int]) -> torch.Tensor:
        return self.fallback.deviation(blocks, start, token_ids)

    @staticmethod
    def _last_position(chunk: Chunk) -> int:
        return chunk.positions[-1] if chunk.positions is not None else chunk.start + len(chunk.token_ids) - 1

    # -- decode -----------------------------------------------------------------------------------
    def _decode(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of chunks run as decode rows, one per token in order (eager here; graphs in
        the subclass)."""
        n = sum(len(c.token_ids) for c in chunks)
        head, tables = self._decode_inputs(chunks, n)
        width = tables.shape[1]
        ints = self._upload.to_device(np.concatenate([head.reshape(-1), tables.reshape(-1)]))
        ids, positions, slots, lens = ints[: 4 * n].view(4, n)
        batch = StepBatch(input_ids=ids, positions=positions, slots=slots, block_tables=ints[4 * n :].view(n, width),
                          context_lens=lens, block_size=self.block_size)
        self.forwards["eager step"] += 1
        return step(self.weights, self.pool.k, self.pool.v, batch, self.ops)

    def _decode_inputs(self, chunks: Sequence[Chunk], size: int) -> tuple[np.ndarray, np.ndarray]:
        """Host inputs of the chunks' tokens as decode rows, padded to ``size`` rows: ``[4, size]`` (ids,
        positions, slots, context lengths; padding rows: slot -1, length 0) and the block tables ``[rows,
        width]`` (a chunk's rows share its table)."""
        bs = self.block_size
        head = np.zeros((4, size), dtype=np.int32)
        head[2] = -1
        tables, counts = [], []
        row = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            if n == 1:  # a decode step: the common case, without arrays
                p = self._last_position(chunk)
                table = chunk.blocks[: p // bs + 1]
                head[:, row] = (chunk.token_ids[0], p, table[-1] * bs + p % bs, p + 1)
            else:
                pos = (np.arange(chunk.start, chunk.start + n) if chunk.positions is None
                       else np.asarray(chunk.positions))
                table = chunk.blocks[: int(pos[-1]) // bs + 1]
                head[0, row : row + n] = chunk.token_ids
                head[1, row : row + n] = pos
                head[2, row : row + n] = _slots(table, pos, bs)
                head[3, row : row + n] = pos + 1
            tables.append(table)
            counts.append(n)
            row += n
        width = max(len(t) for t in tables)
        out = np.zeros((row, width), dtype=np.int32)
        row = 0
        for table, n in zip(tables, counts):
            out[row : row + n, : len(table)] = table
            row += n
        return head, out

    # -- prefill ----------------------------------------------------------------------------------
    def _prefill_batch(self, chunks: Sequence[Chunk]) -> tuple[StepBatch, list[_Span]]:
        """One varlen batch of every chunk (rows packed in chunk order), with one upload."""
        bs = self.block_size
        # Fresh prompts from position 0 (and the ops can attend over the step's own K/V): nothing to gather.
        local = self.ops.local_prefill and all(c.positions is None and c.start == 0 for c in chunks)
        gather = self.ops.gathers and not local
        ids, positions, slots, tables, lens, rows, kv = [], [], [], [], [], [], []
        spans: list[_Span] = []
        cu_q, cu_k = [0], [0]
        dense = True
        for chunk in chunks:
            n = len(chunk.token_ids)
            if chunk.positions is None:
                pos = np.arange(chunk.start, chunk.start + n, dtype=np.int64)
            else:
                pos = np.asarray(chunk.positions, dtype=np.int64)
                dense = dense and bool(pos[-1] - pos[0] == n - 1)
            length = int(pos[-1]) + 1
            table = list(chunk.blocks[: (length - 1) // bs + 1])
            ids.append(np.asarray(chunk.token_ids, dtype=np.int64))
            positions.append(pos)
            slots.append(_slots(table, pos, bs))
            tables.append(table)
            lens.append(length)
            first = len(rows)
            rows.extend(range(cu_q[-1], cu_q[-1] + n) if chunk.all_logits else [cu_q[-1] + n - 1])
            spans.append(_Span(first, len(rows), chunk.all_logits))
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + length)
            if gather:
                kv.append(_slots(table, np.arange(length, dtype=np.int64), bs))
        width = max(len(t) for t in tables)
        table_array = np.zeros((len(tables), width), dtype=np.int64)
        for i, table in enumerate(tables):
            table_array[i, : len(table)] = table
        parts = [np.concatenate(ids), np.concatenate(positions), np.concatenate(slots), np.asarray(lens),
                 np.asarray(cu_q), np.asarray(rows), table_array.reshape(-1)]
        if gather:
            parts += [np.asarray(cu_k), np.concatenate(kv)]
        sizes = [len(p) for p in parts]
        ints = self._upload.to_device(np.concatenate(parts).astype(np.int32))
        views = torch.split(ints, sizes)
        batch = StepBatch(
            input_ids=views[0], positions=views[1], slots=views[2], context_lens=views[3], cu_q=views[4],
            logit_rows=views[5], block_tables=views[6].view(len(tables), width), block_size=bs,
            max_q=max(len(c.token_ids) for c in chunks), dense=dense,
            cu_k=views[7] if gather else None, kv_slots=views[8] if gather else None, max_k=max(lens), local=local,
            q_bounds=tuple(cu_q))
        return batch, spans


class _DecodeGraph:
    """One bucket's captured decode step over static buffers (inputs, block tables, logits)."""

    def __init__(self, runner: StepRunner, size: int, width: int, pool: tuple[int, int]) -> None:
        self.size, self.width = size, width
        device = runner.device
        self.ints = torch.zeros(4 * size + size * width, dtype=torch.int32, device=device)
        ids, positions, slots, lens = self.ints[: 4 * size].view(4, size)
        slots.fill_(-1)  # until the first replay's inputs: every row is padding
        self.tables = self.ints[4 * size :].view(size, width)
        self.batch = StepBatch(input_ids=ids, positions=positions, slots=slots, block_tables=self.tables,
                               context_lens=lens, block_size=runner.block_size)
        run = lambda: step(runner.weights, runner.pool.k, runner.pool.v, self.batch, runner.ops)
        # A warm-up on a side stream compiles the kernels and sets up cuBLAS outside the capture.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a prefetch copy) do not invalidate this capture.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.logits = run()

    def replay(self, upload: _Upload, head: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        n, width = tables.shape
        staged = upload.host(np.concatenate([head.reshape(-1), tables.reshape(-1)]))
        self.ints[: 4 * self.size].copy_(staged[: 4 * self.size], non_blocking=True)
        self.tables[:n, :width].copy_(staged[4 * self.size :].view(n, width), non_blocking=True)
        upload.copied()
        self.graph.replay()
        return self.logits


class CudaGraphRunner(StepRunner):
    """The CUDA :class:`~kvbaton.backend.compute.runner.ModelRunner`: :class:`StepRunner` with the Triton and
    FlashAttention kernels, and decode replayed from a CUDA graph per batch bucket (see the module)."""

    def __init__(self, loaded: LoadedModel, pool: BlockPool, *, graphs: bool | None = None) -> None:
        reason = unavailable_reason(loaded)
        if reason is not None:
            raise RunnerUnavailable(f"the CUDA graph runner is unavailable: {reason}")
        # On the GPU the model keeps one copy of its fused weights: its q/k/v and gate/up become views of them.
        super().__init__(loaded, pool, TritonOps(loaded.dtype, loaded.device), EagerRunner(loaded, pool, SDPA),
                         step_weights(loaded, share=True), fall_back_on_error=True, small_chunk_rows=SMALL_CHUNK_ROWS)
        self.use_graphs = os.environ.get(GRAPHS_ENV, "1") != "0" if graphs is None else graphs
        self.width = min(pool.num_blocks, -(-self.weights.max_positions // pool.block_size))
        self._graphs: dict[int, _DecodeGraph] = {}
        self.capture_s = 0.0
        self.capture_error: str | None = None
        if self.use_graphs:
            try:
                self._capture()
            except Exception as exc:  # decode then runs the same step eagerly: slower, not wrong
                self.capture_error = f"{type(exc).__name__}: {exc}"
                self.use_graphs = False
                self._graphs.clear()
                log.exception("CUDA graph capture failed: decode steps run eagerly")

    def _capture(self) -> None:
        """Capture every bucket, largest first, in one memory pool (a smaller bucket reuses the larger's)."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in sorted(BUCKETS, reverse=True):
                self._graphs[size] = _DecodeGraph(self, size, self.width, pool)
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - started
        log.info("CUDA graphs captured for decode batches of %s sequences in %.2f s (kernels: %s)",
                 ", ".join(map(str, BUCKETS)), self.capture_s, self.ops.name)

    def _decode(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        n = sum(len(c.token_ids) for c in chunks)
        if not self.use_graphs or not self._graphs or n > BUCKETS[-1]:
            return super()._decode(chunks)
        graph = self._graphs[next(b for b in BUCKETS if b >= n)]
        head, tables = self._decode_inputs(chunks, graph.size)
        self.forwards["graph"] += 1
        # A copy: the graph's output buffer is overwritten by the next replay, and these logits outlive it.
        return graph.replay(self._upload, head, tables)[:n].clone()


def reference_runner(loaded: LoadedModel, pool: BlockPool) -> StepRunner:
    """The step with the torch reference stages, eagerly, on the model's device (CPU tests of the math)."""
    return StepRunner(loaded, pool, TorchOps(), EagerRunner(loaded, pool, SDPA))
