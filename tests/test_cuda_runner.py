"""The CUDA runner's step function, tested on CPU: run eagerly in fp32 with the torch reference stages
(``cuda/ops.TorchOps``, what the Triton kernels are checked against in test_cuda_kernels.py), it gives
the eager runner's logits and greedy tokens on the real default model, for packed prefill chunks (fresh, behind
cached tokens, at sparse positions), short chunks run as rows of the decode step, fresh prompts attending over
their own keys, and batched decode steps of sequences with different context lengths; a decode batch padded to
a graph bucket changes nothing. Graph capture itself needs a GPU (the GPU benchmark)."""

from __future__ import annotations

import copy

import pytest
import torch
from kvbaton.backend.cache.block_pool import BlockPool
from kvbaton.backend.compute.cuda.ops import TorchOps
from kvbaton.backend.compute.cuda.runner import StepRunner, reference_runner
from kvbaton.backend.compute.cuda.step import StepBatch, step
from kvbaton.backend.compute.runner import Chunk
from kvbaton.backend.compute.selector import select_runner

BS = 16


def _pools(engine) -> tuple[BlockPool, BlockPool]:
    return BlockPool(engine.pool.shape, 96), BlockPool(engine.pool.shape, 96)


def _scattered(pool: BlockPool, count: int, lengths: list[int]) -> list[list[int]]:
    """Block tables of sequences taken in turns, so no table is one run of consecutive blocks."""
    need = [-(-n // BS) for n in lengths]
    tables: list[list[int]] = [[] for _ in lengths]
    for round_ in range(max(need)):
        for i, n in enumerate(need):
            if round_ < n:
                tables[i] += pool.allocate(1)
    pool.allocate(count) if count else None
    return tables


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == torch.float32
        assert (a - b).abs().max() < 2e-3 * b.abs().max(), float((a - b).abs().max())
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_the_step_gives_the_eager_runners_logits_and_greedy_tokens(engine, corpus_tokens):
    loaded = engine.loaded
    eager_pool, step_pool = _pools(engine)
    eager, ours = select_runner(loaded, eager_pool), reference_runner(loaded, step_pool)
    assert isinstance(ours, StepRunner)
    lengths = [37, 120, 16, 75]
    prompts = [corpus_tokens[i * 200 : i * 200 + n] for i, n in enumerate(lengths)]
    tables = _scattered(eager_pool, 0, [n + 8 for n in lengths])
    assert _scattered(step_pool, 0, [n + 8 for n in lengths]) == tables
    # Prefill: the first pieces of every prompt packed in one forward, then the rest behind them (chunked).
    firsts = [Chunk(t, 0, p[: len(p) // 2]) for t, p in zip(tables, prompts)]
    _close(ours.forward(firsts), eager.forward(firsts))
    rests = [Chunk(t, len(p) // 2, p[len(p) // 2 :], all_logits=i == 1) for i, (t, p) in enumerate(zip(tables, prompts))]
    logits = ours.forward(rests)
    _close(logits, eager.forward(rests))
    assert logits[1].shape == (len(prompts[1]) - len(prompts[1]) // 2, loaded.vocab_size)
    # Batched greedy decode of sequences with different context lengths: the same tokens, step after step.
    tokens = [int(lg[-1].argmax()) if lg.dim() == 2 else int(lg.argmax()) for lg in logits]
    for offset in range(6):
        chunks = [Chunk(t, len(p) + offset, [tok]) for t, p, tok in zip(tables, prompts, tokens)]
        got, want = ours.forward(chunks), eager.forward(chunks)
        _close(got, want)
        tokens = [int(g.argmax()) for g in got]
    # What each runner wrote into its pool agrees too.
    for table, prompt in zip(tables, prompts):
        slots = eager_pool.slots(table, 0, len(prompt) + 6)
        k_step, v_step = step_pool.read_rows(slots)
        k_eager, v_eager = eager_pool.read_rows(slots)
        assert (k_step - k_eager).abs().max() < 1e-3 and (v_step - v_eager).abs().max() < 1e-3


def test_a_sparse_chunk_recomputes_its_positions_as_the_eager_runner_does(engine, corpus_tokens):
    loaded = engine.loaded
    eager_pool, step_pool = _pools(engine)
    eager, ours = select_runner(loaded, eager_pool), reference_runner(loaded, step_pool)
    prompt = corpus_tokens[:90]
    (table,) = _scattered(eager_pool, 0, [90])
    _scattered(step_pool, 0, [90])
    for runner in (eager, ours):
        runner.forward([Chunk(table, 0, prompt)])
    positions = [3, 40, 41, 77, 89]
    chunk = Chunk(table, 3, [prompt[p] for p in positions], positions=positions)
    _close(ours.forward([chunk]), eager.forward([chunk]))


def test_a_decode_batch_padded_to_a_bucket_computes_the_same_rows_and_writes_nothing_else(engine, corpus_tokens):
    loaded = engine.loaded
    _, pool = _pools(engine)
    ours = reference_runner(loaded, pool)
    tables = _scattered(pool, 0, [50, 20, 33])
    prompts = [corpus_tokens[:49], corpus_tokens[100:119], corpus_tokens[300:332]]
    ours.forward([Chunk(t, 0, p) for t, p in zip(tables, prompts)])
    chunks = [Chunk(t, len(p), [7]) for t, p in zip(tables, prompts)]
    k_before, v_before = pool.k.clone(), pool.v.clone()
    padded = {}
    for size in (3, 8):  # exactly the batch, and padded to a bucket of 8 as a graph replays it
        head, table_array = ours._decode_inputs(chunks, size)
        width = table_array.shape[1]
        full = torch.zeros(size, width, dtype=torch.int32)
        full[: len(chunks)] = torch.from_numpy(table_array)
        ids, positions, slots, lens = torch.from_numpy(head)
        batch = StepBatch(input_ids=ids, positions=positions, slots=slots, block_tables=full, context_lens=lens,
                          block_size=BS)
        pool.k.copy_(k_before)
        pool.v.copy_(v_before)
        with torch.inference_mode():
            padded[size] = step(ours.weights, pool.k, pool.v, batch, ours.ops)
        written = (pool.k != k_before).any(-1).any(0).any(0).nonzero().flatten().tolist()
        assert written == sorted(t[len(p) // BS] * BS + len(p) % BS for t, p in zip(tables, prompts))
    _close(list(padded[8][:3]), list(padded[3]))  # a matrix product's rounding may differ with its row count


def test_short_chunks_run_as_decode_rows_with_the_eager_runners_logits(engine, corpus_tokens):
    """A resume's question, a sparse recomputation and decode steps in one forward, every token one row of the
    decode step (what a CUDA graph replays): each chunk's rows see each other causally, as prefill does."""
    loaded = engine.loaded
    eager_pool, step_pool = _pools(engine)
    eager = select_runner(loaded, eager_pool)
    ours = StepRunner(loaded, step_pool, TorchOps(), select_runner(loaded, step_pool), small_chunk_rows=12)
    prompts = [corpus_tokens[:70], corpus_tokens[400:433], corpus_tokens[900:960]]
    tables = _scattered(eager_pool, 0, [100, 50, 70])
    _scattered(step_pool, 0, [100, 50, 70])
    first = [Chunk(t, 0, p) for t, p in zip(tables, prompts)]
    _close(ours.forward(first), eager.forward(first))
    rows_before = ours.forwards["rows"]
    question = corpus_tokens[2000:2012]  # 12 tokens behind 70 cached, across a block edge
    positions = [5, 30, 31, 59]  # sparse: recomputed among cached ones
    mixed = [Chunk(tables[0], 70, question, all_logits=True), Chunk(tables[1], 33, [prompts[1][-1]]),
             Chunk(tables[2], 5, [prompts[2][p] for p in positions], positions=positions)]
    got, want = ours.forward(mixed), eager.forward(mixed)
    assert ours.forwards["rows"] == rows_before + 1 and got[0].shape == (12, loaded.vocab_size)
    _close(got, want)
    slots = eager_pool.slots(tables[0], 0, 82)
    k_rows, v_rows = step_pool.read_rows(slots)
    k_eager, v_eager = eager_pool.read_rows(slots)
    assert (k_rows - k_eager).abs().max() < 1e-3 and (v_rows - v_eager).abs().max() < 1e-3
    too_long = [Chunk(tables[0], 82, corpus_tokens[3000:3013])]  # 13 > 12 tokens: the prefill step
    _close(ours.forward(too_long), eager.forward(too_long))
    assert ours.forwards["rows"] == rows_before + 1


def test_fresh_prompts_attend_over_their_own_keys_as_over_the_pool(engine, corpus_tokens):
    """A batch of fresh prompts (from position 0) attends over the step's own K/V, never read back from the pool
    (TorchOps(local=True): the math the CUDA ops run there), with the eager runner's logits and pool contents;
    a chunk behind cached tokens in the batch sends it back to the pool-reading path."""
    loaded = engine.loaded
    eager_pool, step_pool = _pools(engine)
    eager = select_runner(loaded, eager_pool)
    ops = TorchOps(local=True)
    ours = StepRunner(loaded, step_pool, ops, select_runner(loaded, step_pool))
    seen = []
    prefill_local = ops.prefill_local
    ops.prefill_local = lambda *args: seen.append(args[3].q_bounds) or prefill_local(*args)  # type: ignore[method-assign]
    prompts = [corpus_tokens[:45], corpus_tokens[500:600], corpus_tokens[1000:1017]]
    tables = _scattered(eager_pool, 0, [64, 110, 40])
    _scattered(step_pool, 0, [64, 110, 40])
    fresh = [Chunk(t, 0, p, all_logits=i == 2) for i, (t, p) in enumerate(zip(tables, prompts))]
    _close(ours.forward(fresh), eager.forward(fresh))
    assert seen == [(0, 45, 145, 162)] * len(ours.weights.layers)
    for table, prompt in zip(tables, prompts):
        slots = eager_pool.slots(table, 0, len(prompt))
        k_ours, v_ours = step_pool.read_rows(slots)
        k_eager, v_eager = eager_pool.read_rows(slots)
        assert (k_ours - k_eager).abs().max() < 1e-3 and (v_ours - v_eager).abs().max() < 1e-3
    behind = [Chunk(tables[0], 45, corpus_tokens[45:60]), Chunk(tables[2], 0, corpus_tokens[1000:1030])]
    _close(ours.forward(behind), eager.forward(behind))
    assert len(seen) == len(ours.weights.layers)  # not local: the pool-reading prefill


@pytest.mark.unit
def test_decode_splits_give_few_sequences_more_splits():
    from kvbaton.backend.compute.cuda.ops import MAX_SPLITS, decode_splits

    assert decode_splits(1, 8) == MAX_SPLITS
    assert decode_splits(128, 8) == 1
    assert [decode_splits(n, 8) for n in (1, 2, 4, 8, 16, 32)] == sorted(
        [decode_splits(n, 8) for n in (1, 2, 4, 8, 16, 32)], reverse=True)


def test_the_step_on_the_triton_kernels_gives_the_reference_logits(engine, corpus_tokens):
    """The step with the CUDA stages (Triton's interpreter runs the kernels on CPU where there is no GPU):
    prefill packed, behind cached tokens across a block edge, then batched decode, as with the torch reference.
    On the model's first three layers: the interpreter runs every program of every launch in Python (the
    whole model's math is checked against the eager runner above, with the reference the kernels match)."""
    pytest.importorskip("triton", reason="Triton is not installed (CI has no Triton and no CUDA)")
    from kvbaton.backend.compute.attention import SDPA
    from kvbaton.backend.compute.cuda.ops import TritonOps
    from kvbaton.backend.compute.cuda.step import step_weights
    from kvbaton.backend.compute.eager import EagerRunner

    loaded = engine.loaded
    weights = copy.copy(step_weights(loaded))
    weights.layers = weights.layers[:3]
    triton_pool, reference_pool = _pools(engine)
    ours = StepRunner(loaded, triton_pool, TritonOps(torch.float32, torch.device("cpu"), flash=False),
                      EagerRunner(loaded, triton_pool, SDPA), weights, small_chunk_rows=4)
    reference = StepRunner(loaded, reference_pool, TorchOps(), EagerRunner(loaded, reference_pool, SDPA), weights)
    prompts = [corpus_tokens[:21], corpus_tokens[500:512]]
    tables = _scattered(triton_pool, 0, [24, 16])
    _scattered(reference_pool, 0, [24, 16])
    first = [Chunk(tables[0], 0, prompts[0][:15]), Chunk(tables[1], 0, prompts[1])]
    _close(ours.forward(first), reference.forward(first))
    behind = [Chunk(tables[0], 15, prompts[0][15:])]  # across a block edge, behind 15 cached tokens
    got = ours.forward(behind)
    _close(got, reference.forward(behind))
    tokens = [int(got[0].argmax()), 11]
    for offset in range(2):
        chunks = [Chunk(t, len(p) + offset, [tok]) for t, p, tok in zip(tables, prompts, tokens)]
        got = ours.forward(chunks)
        _close(got, reference.forward(chunks))
        tokens = [int(g.argmax()) for g in got]
    rows = [Chunk(tables[1], len(prompts[1]) + 2, corpus_tokens[700:702], all_logits=True)]  # 2 rows, a block edge
    _close(ours.forward(rows), reference.forward(rows))
    assert ours.forwards["rows"] == 1
    k_ours, v_ours = triton_pool.read_rows(triton_pool.slots(tables[0], 0, 23))
    k_ref, v_ref = reference_pool.read_rows(reference_pool.slots(tables[0], 0, 23))
    assert (k_ours[:3] - k_ref[:3]).abs().max() < 1e-4 and (v_ours[:3] - v_ref[:3]).abs().max() < 1e-4


def test_a_step_that_fails_sends_this_and_every_later_forward_to_the_eager_runner(engine, corpus_tokens):
    """What the CUDA runner does when a kernel cannot run on a GPU: the eager runner's answer, and the reason."""
    from kvbaton.backend.compute.attention import SDPA
    from kvbaton.backend.compute.eager import EagerRunner

    class Broken(TorchOps):
        def decode(self, *args, **kwargs):
            raise RuntimeError("no kernel for this GPU")

    loaded = engine.loaded
    pool, reference_pool = _pools(engine)
    ours = StepRunner(loaded, pool, Broken(), EagerRunner(loaded, pool, SDPA), fall_back_on_error=True)
    reference = select_runner(loaded, reference_pool)
    (table,) = _scattered(pool, 0, [40])
    _scattered(reference_pool, 0, [40])
    prompt = corpus_tokens[:30]
    _close(ours.forward([Chunk(table, 0, prompt)]), reference.forward([Chunk(table, 0, prompt)]))
    assert ours.failed is None
    step_chunk = [Chunk(table, 30, [5])]
    _close(ours.forward(step_chunk), reference.forward(step_chunk))
    assert ours.failed == "RuntimeError: no kernel for this GPU" and ours.forwards["fallback"] == 1
    ours.forward([Chunk(table, 31, [6])])
    assert ours.forwards["fallback"] == 2
