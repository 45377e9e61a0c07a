"""fork aliases blocks (zero copy); children diverge through copy-on-write and stay exact."""

from __future__ import annotations

from conftest import dense_greedy
from kvbaton import SamplingParams

GREEDY_16 = SamplingParams(max_tokens=16, ignore_eos=True)


def test_fork_shares_blocks_and_children_are_exact(engine, reference, corpus_tokens):
    prefix = corpus_tokens[:203]  # ends mid-block: children must copy the partial last block
    parent = engine.materialize(prefix)
    before = engine.stats()

    children = engine.fork(parent, 4)

    after_fork = engine.stats()
    assert after_fork.blocks_used == before.blocks_used  # the fork itself copies nothing
    assert after_fork.blocks_shared == before.blocks_used
    suffixes = [engine.tokenize(f"\nQuestion {i}: {q}\nAnswer:") for i, q in enumerate(
        ["Who spoke first?", "What was postponed?", "Name one number.", "Which team is busiest?"]
    )]
    results = [engine.resume(child, sfx, GREEDY_16) for child, sfx in zip(children, suffixes)]
    for sfx, result in zip(suffixes, results):
        expected, _ = dense_greedy(reference, prefix + sfx, 16)
        assert result.token_ids == expected

    # The 12 full prefix blocks are stored once; each continuation owns only its new blocks.
    full_prefix_blocks = len(prefix) // engine.block_size
    own_blocks = sum(
        -(-r.handle.num_tokens // engine.block_size) - full_prefix_blocks for r in results
    )
    stats = engine.stats()
    assert stats.blocks_used == before.blocks_used + own_blocks
    # ...plus the partial last block, still shared by the parent and the four fork handles.
    assert stats.blocks_shared == full_prefix_blocks + 1
    engine.release(children)
    assert engine.stats().blocks_shared == full_prefix_blocks


def test_fork_of_resumed_handle_with_pending_token(engine, reference, corpus_tokens):
    first = engine.resume(engine.materialize(corpus_tokens[:31]), [], GREEDY_16)
    a, b = engine.fork(first.handle, 2)
    ra = engine.resume(a, corpus_tokens[31:40], GREEDY_16)
    rb = engine.resume(b, [], GREEDY_16)
    tokens = corpus_tokens[:31] + first.token_ids
    assert ra.token_ids == dense_greedy(reference, tokens + corpus_tokens[31:40], 16)[0]
    assert rb.token_ids == dense_greedy(reference, tokens, 16)[0]


def test_parent_unchanged_by_children(engine, corpus_tokens):
    parent = engine.materialize(corpus_tokens[:50])
    alone = engine.resume(parent, corpus_tokens[50:60], GREEDY_16).token_ids
    for child in engine.fork(parent, 3):
        engine.resume(child, corpus_tokens[60:75], GREEDY_16)
    assert engine.resume(parent, corpus_tokens[50:60], GREEDY_16).token_ids == alone
