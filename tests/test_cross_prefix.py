"""Automatic cross-prefix reuse: agents that put their own system prompt first still reuse the KV of
what another agent already read (the span index + ``reuse=`` policies), never silently.

- a reviewer behind its own system prompt reuses the reader's document, and the result says how;
- ``reuse="exact"`` (the default) never changes greedy output against dense prefill;
- an approximate answer is marked on the Result (``exact``, ``tokens_approximate``, ``segments``);
- partial prefix hits inside a segment keep the cached part and place only the remainder;
- the span index is partitioned (tenants, and sessions: a run never places another run's spans) and bounded;
- a released source stays one for as long as the prefix cache holds its blocks, never longer (issue 40);
- ``reuse="exact"`` is exact, whatever handle it is given;
- an agent resumes its own approximate turn instead of re-prefilling its transcript, also after releasing
  it (kept as a cache that gives way to any request needing its blocks);
- the silent spots of issue 19 each have a regression test here.
"""

from __future__ import annotations

import math

import kvbaton
import pytest
from conftest import dense_greedy
from kvbaton.backend import Engine
from kvbaton.backend.cache.sequence import KVState
from kvbaton.backend.reuse.audit import FidelityAudit
from kvbaton.backend.reuse.spans import MIN_SPAN, TAIL, SpanIndex
from kvbaton.backend.tenants import AgentRef
from kvbaton.bench.corpus import document
from kvbaton.errors import InvalidRequest

READER = "You are the reader. Summarize the notes for the team in plain words."
REVIEWER = "You are a strict reviewer who points out risks, missing owners and vague decisions."
GREEDY = kvbaton.SamplingParams(max_tokens=6, ignore_eos=True)


def chat(system: str, doc: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": f"{doc}\n\n{question}"}]


@pytest.fixture
def doc() -> str:
    return document(140, seed=11)


def test_reviewer_behind_its_own_prompt_reuses_the_readers_document(engine, doc):
    reader = engine.generate(chat(READER, doc, "Summarize."), sampling=GREEDY, agent="reader")
    review = engine.generate(chat(REVIEWER, doc, "What is the biggest risk?"), sampling=GREEDY, agent="reviewer",
                             reuse="rotate")
    (span,) = review.segments
    assert span.source == reader.handle.id and span.outcome == "rotated" and not span.exact
    # The whole document, give or take the edges, up to the prompt's last TAIL tokens (always computed).
    prompt = engine.chat_tokens(chat(REVIEWER, doc, "What is the biggest risk?"))
    assert span.end - span.start >= min(len(engine.tokenize(doc)), len(prompt) - TAIL - span.offset) - 8
    assert span.offset + span.end - span.start <= len(prompt) - TAIL
    assert review.timings.tokens_approximate == span.tokens_reused > 0
    assert review.timings.tokens_reused >= review.timings.tokens_approximate
    assert not review.exact and not review.handle.exact


def test_auto_blends_or_falls_back_and_says_which(engine, doc):
    engine.generate(chat(READER, doc, "Summarize."), sampling=GREEDY, agent="reader")
    review = engine.generate(chat(REVIEWER, doc, "What is the biggest risk?"), sampling=GREEDY, agent="reviewer",
                             reuse="auto")
    (span,) = review.segments
    assert span.outcome in ("blended", "recomputed")
    if span.outcome == "blended":  # the tokens that deviated most were recomputed, the rest reused
        assert 0 < span.tokens_reused < span.end - span.start and not review.exact
        assert "recomputed" in span.reason
    else:  # too many of its tokens deviated: prefilled, exact, and the reason says why
        assert "so it was prefilled" in span.reason and review.exact and span.exact


def test_exact_policy_is_token_identical_to_dense_prefill(engine, reference, doc):
    engine.generate(chat(READER, doc, "Summarize."), sampling=GREEDY, agent="reader")
    messages = chat(REVIEWER, doc, "What is the biggest risk?")
    result = engine.generate(messages, sampling=GREEDY, agent="reviewer")  # the default policy is exact
    expected, _ = dense_greedy(reference, engine.chat_tokens(messages), GREEDY.max_tokens)
    assert result.token_ids == expected
    assert result.exact and result.segments == [] and result.timings.tokens_approximate == 0


def test_blend_is_closer_to_dense_than_rotation_alone(engine, doc):
    """Selective recomputation: the K/V of the recomputed tokens are dense-exact, so the whole prompt's
    deviation from dense prefill shrinks (measured on the real model, KL of the next token)."""
    source = engine.materialize(engine.chat_tokens(chat(READER, doc, "Summarize.")))
    messages = chat(REVIEWER, doc, "What is the biggest risk?")
    prompt = engine.chat_tokens(messages)
    reference = engine.materialize(prompt[:-1])
    dense = engine.next_token_logits(reference, prompt[-1:]).log_softmax(-1)
    engine.release(reference)  # not a source of the compositions below
    engine.flush_cache()
    kl = {}
    for mode in ("rotate", "blend"):
        seg = next(iter(engine.spans.find(prompt, 0, len(prompt) - 1, "")))
        assert seg.source.id == source.id
        composed = engine.compose(prompt[: seg.offset], [source.segment(seg.start, seg.start + seg.length)],
                                  prompt[seg.offset + seg.length : -1], mode=mode, correction={"min_margin": 0})
        q = engine.next_token_logits(composed.handle, prompt[-1:]).log_softmax(-1)
        kl[mode] = float((dense.exp() * (dense - q)).sum())
        assert composed.segments[0].outcome == {"rotate": "rotated", "blend": "blended"}[mode]
    assert kl["blend"] < kl["rotate"]


def test_partial_prefix_hit_places_only_the_remainder(engine, doc):
    reader = engine.materialize(engine.chat_tokens(chat(READER, doc, "Summarize.")))
    prompt = engine.chat_tokens(chat(REVIEWER, doc, "What is the biggest risk?"))
    (seg,) = engine.spans.find(prompt, 0, len(prompt) - 1, "")
    # The prefix cache holds the reviewer's prompt up to 40 tokens into the document.
    engine.materialize(prompt[: seg.offset + 40])
    composed = engine.compose(prompt[: seg.offset], [reader.segment(seg.start, seg.start + seg.length)],
                              prompt[seg.offset + seg.length :], mode="rotate")
    report = composed.segments[0]
    cached = report.tokens_cached
    assert 40 - engine.block_size < cached <= 40  # the whole cached blocks of the segment were kept
    assert report.outcome == "rotated" and report.tokens_reused == seg.length - cached  # only the rest placed
    assert (report.start, report.end, report.offset) == (seg.start, seg.start + seg.length, seg.offset)
    assert composed.tokens_reused == seg.offset + cached + report.tokens_reused


def test_dense_segment_behind_an_approximate_one_is_not_reported_exact(engine, doc):
    a = engine.materialize(engine.tokenize(doc + "\n" + document(120, seed=12)))
    n1 = len(engine.tokenize(doc))
    prefix = engine.chat_tokens([{"role": "system", "content": REVIEWER}], add_generation_prompt=False)
    cfg = {"min_margin": 0, "min_anchors": 1, "max_distance": 100.0}
    pool = engine.anchor_pool(cfg)
    first = engine.compose(prefix, [a.segment(0, n1, slot="doc")], "\nRisk?", correction=cfg)
    assert first.segments[0].outcome == "recomputed" and first.segments[0].exact  # no anchor yet: dense, exact
    pool.flush()
    engine.flush_cache()
    mixed = engine.compose(prefix, [a.segment(0, n1, slot="doc"), a.segment(n1, a.num_tokens, slot="fresh")],
                           "\nRisk?", correction=cfg)
    pool.flush()
    corrected, dense = mixed.segments
    assert corrected.outcome == "corrected" and not corrected.exact
    # Recomputed densely, but behind approximate K/V: reported approximate, and never made an anchor.
    assert dense.outcome == "recomputed" and not dense.exact and not mixed.exact
    assert pool.anchors(("fresh", None)) == 0


def test_merge_of_an_approximate_handle_reports_its_parts_honestly(engine, doc):
    source = engine.materialize(engine.tokenize("Notes follow.\n" + doc))
    n = source.num_tokens
    rotated = engine.compose("Reviewer notes:\n", [source.segment(4, n)], mode="rotate").handle
    (short,) = engine.fork(rotated, 1)
    merged = engine.merge([rotated, short])
    assert not merged.exact
    assert all(not part.exact and "approximate" in part.reason for part in merged.segments)
    exact = engine.materialize(engine.tokenize(doc))
    assert all(part.exact for part in engine.merge([exact]).segments)


def test_released_sources_are_forgotten_and_scopes_never_mix(engine, doc):
    from kvbaton.backend.tenants import AgentRef, TenantPartition

    engine.partition_tenants(TenantPartition(spans=True))
    reader = engine.generate(chat(READER, doc, "Summarize."), sampling=GREEDY, agent=AgentRef("tenant-a", "reader"))
    other = engine.generate(chat(REVIEWER, doc, "Risk?"), sampling=GREEDY, agent=AgentRef("tenant-b", "reviewer"),
                            reuse="rotate")
    assert other.segments == [] and other.exact  # another tenant's document is not a source
    engine.flush_cache()  # (the prefix cache would serve tenant B's exact prompt prefix here)
    same = engine.generate(chat(REVIEWER, doc, "Owner?"), sampling=GREEDY, agent=AgentRef("tenant-a", "reviewer"),
                           reuse="rotate")
    assert [s.source for s in same.segments] == [reader.handle.id]
    engine.release([reader.handle, same.handle])
    engine.flush_cache()
    again = engine.generate(chat(REVIEWER, doc, "Who?"), sampling=GREEDY, agent=AgentRef("tenant-a", "critic"),
                            reuse="rotate")
    assert reader.handle.id not in {s.source for s in again.segments}
    engine.release([other.handle, again.handle])
    engine.flush_cache()  # what the cache kept of the released handles goes with it
    assert len(engine.spans) == 0 and len(engine.spans.cached) == 0 and engine.stats().handles_live == 0


def test_span_index_is_bounded():
    index = SpanIndex(capacity=64)
    from kvbaton.backend.cache.sequence import KVState

    for i in range(20):
        state = KVState(id=str(i), token_ids=list(range(i * 1000, i * 1000 + 400)), blocks=[], num_cached=400,
                        lineage=())
        index.add(state, "")
    assert len(index) <= 64


def test_an_agent_resumes_its_own_approximate_turn(engine, doc):
    engine.generate(chat(READER, doc, "Summarize."), sampling=GREEDY, agent="reader")
    first = engine.generate(chat(REVIEWER, doc, "Risk?"), sampling=GREEDY, agent="reviewer", reuse="rotate")
    assert not first.exact
    follow_up = chat(REVIEWER, doc, "Risk?") + [
        {"role": "assistant", "content": first.text}, {"role": "user", "content": "And the owner?"}
    ]
    second = engine.generate(follow_up, sampling=GREEDY, agent="reviewer", reuse="rotate")
    prompt = engine.chat_tokens(follow_up)
    # Its whole first turn (document included) came from its own approximate handle: only the new
    # messages were prefilled, and the answer stays marked approximate.
    assert second.timings.tokens_reused >= first.handle.num_tokens - 4
    assert second.timings.tokens_prefilled < len(prompt) - first.handle.num_tokens + 8
    assert not second.exact and second.timings.tokens_approximate > 0
    # With reuse="exact" the same turn never starts from approximate K/V.
    exact = engine.generate(follow_up, sampling=GREEDY, agent="reviewer", reuse="exact")
    assert exact.exact and exact.timings.tokens_approximate == 0


def test_a_synthesizer_reuses_the_replies_it_quotes_and_computes_its_question(engine, doc):
    """Replies quoted by the next agent behind its own prompt are placed, all spans of the prompt in two
    passes; the prompt's last ``TAIL`` tokens, the question itself, are always computed densely, even
    where another agent's prompt had the same words."""
    reply = kvbaton.SamplingParams(max_tokens=48, ignore_eos=True)
    question = ("Merge the replies into one plan: name an owner and a date for every action, and say which "
                "reply you trust more and why, in at most three sentences.")
    replies = [engine.generate(chat(system, doc, question), sampling=reply, agent=agent)
               for system, agent in ((READER, "reader"), (REVIEWER, "reviewer"))]
    quoted = "\n\n".join(f"{name}: {r.text}" for name, r in zip(("Reader", "Reviewer"), replies, strict=True))
    synthesis = engine.generate(
        [{"role": "system", "content": "You are the synthesizer."},
         {"role": "user", "content": f"Replies:\n{quoted}\n\n{question}"}],
        sampling=GREEDY, agent="synthesizer", reuse="auto")
    placed = {s.source: s for s in synthesis.segments}
    assert {r.handle.id for r in replies} <= set(placed)
    assert all(MIN_SPAN <= s.end - s.start < 48 for s in placed.values())
    prompt_len = synthesis.handle.num_tokens - len(synthesis.token_ids) + 1
    assert all(s.offset + s.end - s.start <= prompt_len - TAIL for s in synthesis.segments)
    assert synthesis.exact == all(s.outcome == "recomputed" for s in synthesis.segments)


def test_reuse_policy_is_validated(engine):
    with pytest.raises(InvalidRequest):
        engine.generate([{"role": "user", "content": "hi"}], reuse="sometimes")
    with pytest.raises(InvalidRequest):
        kvbaton.backend.Engine(reuse="always")
    assert MIN_SPAN >= 16


def test_sampled_audit_checks_approximate_answers_against_dense(doc):
    engine = kvbaton.backend.Engine(kv_budget="384MiB", audit_fraction=1.0)  # every approximate answer checked
    try:
        engine.generate(chat(READER, doc, "Summarize."), sampling=GREEDY, agent="reader")
        for persona in ("You are a strict reviewer.", "You are a kind reviewer."):
            result = engine.generate(chat(persona, doc, "Risk?"), sampling=GREEDY, agent="reviewer", reuse="rotate")
            assert not result.exact
        exact = engine.generate(chat(REVIEWER, doc, "Deadline?"), sampling=GREEDY, agent="reviewer")
        assert exact.exact  # exact answers are never audited
        engine.audit.flush()
        audit = engine.stats().audit
        assert audit.checked == 2 and audit.agents["reviewer"].checked == 2 and 0 <= audit.agreed <= 2
    finally:
        engine.close()


@pytest.mark.unit
def test_audit_raises_the_gate_of_an_agent_that_disagrees_and_stays_bounded():
    audit = FidelityAudit(lambda prompt: 0, fraction=1.0, min_checks=2)
    for i in range(4):
        audit.submit("critic", [1, 2, 3], approximate_argmax=1)  # dense says 0: every check disagrees
        audit.submit("judge", [1, 2, 3], approximate_argmax=0)
        audit.flush()
    stats = audit.stats()
    assert stats.checked == 8 and stats.agreed == 4
    assert audit.margin_for("critic", 0.25) > 0.25 and audit.margin_for("judge", 0.25) == 0.25
    assert stats.agents["critic"].gate_raised >= 2
    audit.close()
    audit.submit("critic", [1], approximate_argmax=1)  # after close: ignored, no thread
    off = FidelityAudit(lambda prompt: 0, fraction=0.0)
    off.submit("a", [1], 0)
    assert off.stats().checked == 0
    sampled = FidelityAudit(lambda prompt: 0, fraction=0.25)
    for _ in range(8):
        sampled.submit("a", [1], 0)
    sampled.flush()
    assert sampled.stats().checked == 2  # every fourth
    sampled.close()


# -- issue 40: released sources, sessions, exact means exact ------------------------------------------


def test_an_agent_resumes_its_own_approximate_turn_after_releasing_it(doc):
    """The README's pattern with ``reuse="auto"``: every turn's handle released at once. The approximate state
    of the reviewer's first turn is kept, as a cache, for its own next turn (before: that turn placed the
    document again from the reader's blocks); the next turn takes it, and nothing is left held."""
    engine = Engine(kv_budget="128MiB", audit_fraction=0)
    try:
        engine.release(engine.generate(chat(READER, doc, "Summarize."), sampling=GREEDY, agent="reader").handle)
        first = engine.generate(chat(REVIEWER, doc, "Risk?"), sampling=GREEDY, agent="reviewer", reuse="rotate")
        assert not first.exact
        engine.release(first.handle)
        assert engine.kv.retained_blocks > 0
        follow_up = chat(REVIEWER, doc, "Risk?") + [
            {"role": "assistant", "content": first.text}, {"role": "user", "content": "And the owner?"}
        ]
        second = engine.generate(follow_up, sampling=GREEDY, agent="reviewer", reuse="rotate")
        assert second.timings.tokens_reused >= first.handle.num_tokens - 4 and not second.exact
        assert engine.kv.retained_blocks == 0  # taken by the next turn: one use only
        # reuse="exact" never starts from a retained approximate state.
        engine.release(second.handle)
        exact = engine.generate(follow_up + [{"role": "assistant", "content": second.text},
                                             {"role": "user", "content": "Who decides?"}], sampling=GREEDY,
                                agent="reviewer", reuse="exact")
        assert exact.exact and exact.timings.tokens_approximate == 0
        engine.release(exact.handle)
        engine.flush_cache()
        assert engine.kv.retained_blocks == 0 and engine.pool.num_free == engine.pool.num_blocks
    finally:
        engine.close()


def test_a_retained_approximate_state_gives_its_blocks_to_a_request_that_needs_them(doc):
    """Retained approximate states are a cache, not a reservation: a request that needs the whole pool
    gets it (they go first, before the prefix cache's exact blocks), and the dropped state is never resumed."""
    engine = Engine(kv_budget="40 blocks", audit_fraction=0)
    try:
        engine.release(engine.generate(chat(READER, doc, "Summarize."), sampling=GREEDY, agent="reader").handle)
        first = engine.generate(chat(REVIEWER, doc, "Risk?"), sampling=GREEDY, agent="reviewer", reuse="rotate")
        engine.release(first.handle)
        assert engine.kv.retained_blocks > 0
        whole_pool = 40 * engine.block_size - 1
        other = engine.materialize(engine.tokenize(document(600, seed=99))[:whole_pool])
        assert engine.kv.retained_blocks == 0
        engine.release(other)
        follow_up = chat(REVIEWER, doc, "Risk?") + [
            {"role": "assistant", "content": first.text}, {"role": "user", "content": "And the owner?"}
        ]
        second = engine.generate(follow_up, sampling=GREEDY, agent="reviewer", reuse="rotate")
        assert second.timings.tokens_reused < first.handle.num_tokens - 4  # not resumed from freed blocks
    finally:
        engine.close()


def test_retained_approximate_states_go_before_the_prefix_caches_exact_blocks(doc):
    """A retained approximate state serves one possible next turn; the prefix cache's exact blocks serve every
    agent: a reservation that needs what the retained states hold takes theirs and leaves the cache whole."""
    engine = Engine(kv_budget="60 blocks", audit_fraction=0)
    try:
        reader = engine.generate(chat(READER, doc, "Summarize."), sampling=GREEDY, agent="reader")
        engine.release(reader.handle)
        first = engine.generate(chat(REVIEWER, doc, "Risk?"), sampling=GREEDY, agent="reviewer", reuse="rotate")
        engine.release(first.handle)
        prompt = engine.chat_tokens(chat(READER, doc, "Summarize."))
        cached = engine.cached_prefix(prompt)
        kept = engine.kv.retained_only_blocks()
        assert kept > 0 and cached > len(prompt) // 2
        # a block short of what is free plus what only the retained states hold (a prefill may reserve one ahead)
        tokens = engine.tokenize(document(900, seed=98))[: (engine.pool.num_free + kept - 1) * engine.block_size - 1]
        other = engine.materialize(tokens)
        assert engine.kv.retained_blocks == 0 and engine.cached_prefix(prompt) == cached
        engine.release(other)
    finally:
        engine.close()


def test_a_released_readers_document_is_reused_while_the_prefix_cache_holds_it(engine, doc):
    """The README's pattern: the reader's handle is released as soon as it answered. Its exact full blocks
    stay in the prefix cache, and so do its spans (before: 0 tokens reused)."""
    reader = engine.generate(chat(READER, doc, "Summarize."), sampling=GREEDY, agent="reader")
    engine.release(reader.handle)
    review = engine.generate(chat(REVIEWER, doc, "What is the biggest risk?"), sampling=GREEDY, agent="reviewer",
                             reuse="rotate")
    (span,) = review.segments
    assert span.source == reader.handle.id and span.outcome == "rotated" and not span.exact
    assert span.end - span.start >= len(engine.tokenize(doc)) - 2 * engine.block_size
    # A released handle's partial last block is not cached: spans end at its last full cached block.
    cached_tokens = (reader.handle.num_tokens - 1) // engine.block_size * engine.block_size
    assert span.end <= cached_tokens
    assert review.timings.tokens_approximate == span.tokens_reused > 0
    assert not review.exact and not review.handle.exact


def test_a_block_the_cache_let_go_is_never_read_as_the_tokens_it_held(doc):
    """Evicting a released source's blocks ends its spans; the pool hands those block ids out again for
    other tokens, and a lookup of the old tokens finds nothing."""
    engine = Engine(kv_budget="40 blocks")
    try:
        reader = engine.generate(chat(READER, doc, "Summarize."), sampling=GREEDY, agent="reader")
        engine.release(reader.handle)
        view = engine.spans.cached.get(reader.handle.id)
        assert view is not None and view.num_cached >= MIN_SPAN
        whole_pool = 40 * engine.block_size - 1
        other = engine.materialize(engine.tokenize(document(600, seed=99))[:whole_pool])
        assert set(view.blocks) & set(engine.handles.get(other).blocks)  # the same ids, other tokens now
        assert engine.spans.cached.get(reader.handle.id) is None
        prompt = engine.chat_tokens(chat(REVIEWER, doc, "What is the biggest risk?"))
        assert engine.spans.find(prompt, 0, len(prompt) - TAIL, "") == []
        engine.release(other)
        review = engine.generate(chat(REVIEWER, doc, "What is the biggest risk?"), sampling=GREEDY,
                                 agent="reviewer", reuse="rotate")
        assert review.segments == [] and review.exact
    finally:
        engine.close()


@pytest.mark.unit
def test_a_view_of_cached_blocks_ends_before_the_first_block_the_cache_drops():
    index = SpanIndex(block_size=16)
    tokens = list(range(1000, 1320))
    state = KVState(id="h", token_ids=tokens, blocks=list(range(20)), num_cached=320, lineage=())
    index.index(state)
    index.release(state, list(range(100, 120)))  # the cache's copies of its 20 full blocks
    prompt = [7] * 40 + tokens
    (found,) = index.find(prompt, 0, len(prompt), "")
    assert found.length == 320 and found.source.blocks == list(range(100, 120))
    index.cached.dropped([110])  # blocks 10.. of it are no longer the cache's
    (found,) = index.find(prompt, 0, len(prompt), "")
    assert found.length == 160 and found.source.blocks == list(range(100, 110))
    index.cached.dropped([101])  # what is left is shorter than a span: the source is gone
    assert index.find(prompt, 0, len(prompt), "") == [] and len(index.cached) == 0
    assert len(index) == 0  # and its anchors with it


def test_approximate_reuse_stays_in_its_session_unless_the_engine_spans_the_tenant(engine, doc):
    """KVCMAS computes a workflow's first agent densely: a request that names its session (a workflow run)
    places only spans of its own session; ``span_partition="tenant"`` shares them across sessions."""
    reader = engine.generate(chat(READER, doc, "Summarize."), sampling=GREEDY, agent=AgentRef(None, "reader", "run-1"))
    fresh = engine.generate(chat(REVIEWER, doc, "Risk?"), sampling=GREEDY,
                            agent=AgentRef(None, "reviewer", "run-2"), reuse="rotate")
    assert fresh.segments == [] and fresh.exact  # another run's document shapes nothing
    # (other personas below: the prefix cache, exact, would serve the reviewer's own prompt prefix)
    unnamed = engine.generate(chat("You are the editor.", doc, "Owner?"), sampling=GREEDY, agent="editor",
                              reuse="rotate")
    assert unnamed.segments == []  # nor does it for a request that names no session
    same = engine.generate(chat("You are the critic.", doc, "Deadline?"), sampling=GREEDY,
                           agent=AgentRef(None, "critic", "run-1"), reuse="rotate")
    assert [s.source for s in same.segments] == [reader.handle.id] and not same.exact
    wide = Engine(kv_budget="128MiB", span_partition="tenant")
    try:
        first = wide.generate(chat(READER, doc, "Summarize."), sampling=GREEDY,
                              agent=AgentRef(None, "reader", "run-1"))
        other = wide.generate(chat(REVIEWER, doc, "Risk?"), sampling=GREEDY,
                              agent=AgentRef(None, "reviewer", "run-2"), reuse="rotate")
        assert [s.source for s in other.segments] == [first.handle.id]
    finally:
        wide.close()
    with pytest.raises(InvalidRequest):
        Engine(span_partition="everywhere")


def test_exact_policy_on_an_approximate_handle_recomputes_its_approximate_part(engine, reference, doc):
    """``generate(handle=<approximate handle>, reuse="exact")`` keeps only the handle's exact prefix and
    prefills the rest densely: token-identical to dense prefill, marked exact."""
    engine.generate(chat(READER, doc, "Summarize."), sampling=GREEDY, agent="reader")
    messages = chat(REVIEWER, doc, "What is the biggest risk?")
    rotated = engine.generate(messages, sampling=GREEDY, agent="reviewer", reuse="rotate")
    assert not rotated.handle.exact
    follow_up = messages + [{"role": "assistant", "content": rotated.text}, {"role": "user", "content": "Owner?"}]
    result = engine.generate(follow_up, handle=rotated.handle, sampling=GREEDY, agent="reviewer", reuse="exact")
    expected, _ = dense_greedy(reference, engine.chat_tokens(follow_up), GREEDY.max_tokens)
    assert result.token_ids == expected
    assert result.exact and result.token_identical and result.timings.tokens_approximate == 0


def test_auto_decides_each_span_before_computing_anything_and_a_prefilled_span_costs_nothing_extra(reference, doc):
    """Issue 46: ``reuse="auto"`` decides each span from its measured deviation before any of the prompt is
    computed. A span whose tokens deviate beyond what selective recomputation fixes is prefilled: the answer is
    dense prefill's, exact, and nothing was computed twice (``tokens_discarded`` 0; the decision cost one pass
    of two layers over the span). A span within it is blended: as many tokens recomputed as deviate, at least
    ``blend_ratio``."""
    messages = chat(REVIEWER, doc, "What is the biggest risk?")
    outcomes = {}
    for name, cfg in (("prefilled", {"deviation_threshold": 0.0, "max_recompute": 0.0}),
                      ("blended", {"deviation_threshold": 1e-3, "max_recompute": 1.0})):
        engine = Engine(kv_budget="128MiB", audit_fraction=0, correction=cfg)
        try:
            engine.generate(chat(READER, doc, "Summarize."), sampling=GREEDY, agent="reader")
            review = engine.generate(messages, sampling=GREEDY, agent="reviewer", reuse="auto")
            (span,) = review.segments
            outcomes[name] = span.outcome
            assert review.timings.tokens_discarded == 0 and engine.stats().tokens_discarded == 0
            placed = span.end - span.start - span.tokens_cached
            # what users see: the tokens found but computed anyway, counted and said why, on the timeline too
            assert review.timings.tokens_recomputed == placed - span.tokens_reused == engine.stats().tokens_recomputed
            (event,) = [e for e in engine.events().events if e.kind == "request" and e.agent == "reviewer"]
            assert event.tokens_recomputed == review.timings.tokens_recomputed and event.reasons == [span.reason]
            if name == "prefilled":
                assert "so it was prefilled" in span.reason and review.exact and span.exact
                prompt = engine.chat_tokens(messages)
                assert review.token_ids == dense_greedy(reference, prompt, GREEDY.max_tokens)[0]
            else:
                recomputed = placed - span.tokens_reused
                assert recomputed >= math.ceil(0.1 * placed) and not review.exact and not span.exact
                assert f"the {recomputed} of {placed} tokens" in span.reason
        finally:
            engine.close()
    assert outcomes == {"prefilled": "recomputed", "blended": "blended"}