"""Releasing every handle returns the pool to empty, whatever the workload did."""

from __future__ import annotations

import pytest
from kvbaton import HandleReleased, SamplingParams


def test_mixed_workload_leaves_no_blocks_behind(engine, corpus_tokens):
    handles = []
    root = engine.materialize(corpus_tokens[:70])
    handles.append(root)
    kids = engine.fork(root, 3)
    handles += kids
    handles.append(engine.extend(kids[0], corpus_tokens[70:99]))
    for kid in kids[1:]:
        handles.append(engine.resume(kid, corpus_tokens[99:105], SamplingParams(max_tokens=5)).handle)
    handles.append(engine.generate([{"role": "user", "content": "Hi"}], sampling=SamplingParams(max_tokens=4)).handle)
    stream = engine.resume_stream(root, " and", SamplingParams(max_tokens=20))
    next(stream)
    stream.close()  # abandoned mid-generation
    unread = engine.resume_stream(root, " or", SamplingParams(max_tokens=4))
    del unread  # never iterated at all
    assert engine.stats().blocks_used > 0

    engine.release(handles)

    stats = engine.stats()
    assert stats.handles_live == 0
    assert stats.blocks_shared == 0
    # What is left is the prefix cache's own copy of full blocks, evictable at any time...
    assert stats.blocks_used == stats.blocks_cached == stats.blocks_cache_only
    engine.flush_cache()
    assert engine.stats().blocks_used == 0  # ...and nothing else.


def test_release_is_all_or_nothing(engine):
    a, b = engine.materialize("one"), engine.materialize("two")
    engine.release(a)
    with pytest.raises(HandleReleased):
        engine.release([b, a])
    assert engine.stats().handles_live == 1  # b survived the failed call
    engine.release(b)
    assert engine.stats().blocks_used == engine.stats().blocks_cache_only


def test_released_parent_does_not_affect_children(engine, corpus_tokens):
    parent = engine.materialize(corpus_tokens[:40])
    (child,) = engine.fork(parent, 1)
    expected = engine.resume(parent, [], SamplingParams(max_tokens=8)).token_ids
    engine.release(parent)
    assert engine.resume(child, [], SamplingParams(max_tokens=8)).token_ids == expected
