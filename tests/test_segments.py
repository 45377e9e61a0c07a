"""Shared segments behind different prefixes: re-alignment, correction, composition, restricted merge."""

from __future__ import annotations

import kvbaton
import pytest
import torch
from conftest import dense_greedy
from kvbaton.backend.reuse.correction import AnchorPool, CorrectionConfig
from kvbaton.backend.reuse.rotary import check_shiftable
from kvbaton.bench.corpus import document
from kvbaton.errors import IncompatibleHandle, InvalidRequest, MergeConflict, UnsupportedPositions

SYSTEM_A = "You are a careful planner. Read the notes and make a numbered plan."
SYSTEM_B = "You are a strict reviewer. Point out risks and missing owners in the notes."
QUESTION = "<|im_start|>user\nWhat is the most important risk?<|im_end|>\n<|im_start|>assistant\n"


def system(engine, text: str) -> list[int]:
    return engine.chat_tokens([{"role": "system", "content": text}], add_generation_prompt=False)


def shared_doc(engine, seed: int, n: int = 160) -> list[int]:
    return engine.tokenize("<|im_start|>user\n" + document(n, seed=seed))[:n]


def rows(engine, handle, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A peek at a handle's K/V rows (every layer)."""
    return engine.kv_rows(handle, start, n)


def greedy(engine, handle, n: int = 8) -> list[int]:
    result = engine.resume(handle, "", kvbaton.SamplingParams(max_tokens=n, ignore_eos=True))
    engine.release(result.handle)
    return result.token_ids


def test_rotation_moves_keys_exactly_at_layer_zero(engine):
    sys_a, sys_b, doc = system(engine, SYSTEM_A), system(engine, SYSTEM_B), shared_doc(engine, 1)
    assert len(sys_a) != len(sys_b)  # so the segment really moves
    source = engine.materialize(sys_a + doc)
    composed = engine.compose(sys_b, [source.segment(len(sys_a), len(sys_a) + len(doc))], mode="rotate")
    dense = engine.materialize(sys_b + doc)
    k, v = rows(engine, composed.handle, len(sys_b), len(doc))
    k_ref, v_ref = rows(engine, dense, len(sys_b), len(doc))
    torch.testing.assert_close(k[0], k_ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(v[0], v_ref[0], atol=1e-5, rtol=0)
    assert composed.segments[0].outcome == "rotated"
    assert not composed.exact and not composed.handle.exact


def test_segment_at_the_prompt_start_is_exact_through_the_whole_model(engine, reference):
    doc = shared_doc(engine, 2)
    alone = engine.materialize(doc)
    suffix = engine.tokenize(QUESTION)
    composed = engine.compose(segments=[alone.segment(0, len(doc))], suffix=suffix)
    assert composed.exact and composed.segments[0].outcome == "exact"
    assert composed.tokens_reused >= len(doc)
    expected, _ = dense_greedy(reference, doc + suffix, 8)
    assert greedy(engine, composed.handle) == expected


def test_every_segment_forced_dense_equals_dense_prefill(engine, reference):
    sys_a, sys_b = system(engine, SYSTEM_A), system(engine, SYSTEM_B)
    doc1, doc2 = shared_doc(engine, 3, 96), shared_doc(engine, 4, 64)
    a = engine.materialize(sys_a + doc1 + doc2)
    suffix = engine.tokenize(QUESTION)
    composed = engine.compose(
        sys_b,
        [a.segment(len(sys_a), len(sys_a) + len(doc1)), a.segment(len(sys_a) + len(doc1), len(sys_a) + len(doc1) + len(doc2))],
        suffix,
        mode="dense",
    )
    assert composed.exact and composed.handle.exact
    assert [s.outcome for s in composed.segments] == ["recomputed", "recomputed"]
    assert composed.handle.token_ids() == sys_b + doc1 + doc2 + suffix
    expected, _ = dense_greedy(reference, sys_b + doc1 + doc2 + suffix, 8)
    assert greedy(engine, composed.handle) == expected


def _compose_three(engine, cfg: dict) -> list:
    """Compose the same slot behind a reviewer's prefix for three documents; the compositions."""
    sys_a, sys_b = system(engine, SYSTEM_A), system(engine, SYSTEM_B)
    out = []
    for seed in range(3):
        doc = shared_doc(engine, 10 + seed, 64)
        a = engine.materialize(sys_a + doc, agent="planner")
        out.append(engine.compose(
            sys_b, [a.segment(len(sys_a), len(sys_a) + len(doc), slot="notes")], QUESTION, agent="reviewer",
            correction=cfg,
        ))
        engine.anchor_pool(cfg).flush()  # anchors are built in the background
    return out


def test_gate_falls_back_to_dense_until_two_anchors_then_corrects(engine):
    # Any match is accepted once two anchors exist; the confidence gate is off.
    cfg = {"min_anchors": 2, "max_distance": 100.0, "min_margin": 0.0}
    outcomes = [(c.segments[0].outcome, c.segments[0].anchors, c.exact) for c in _compose_three(engine, cfg)]
    assert outcomes[0] == ("recomputed", 0, True)
    assert outcomes[1] == ("recomputed", 1, True)
    assert outcomes[2][:2] == ("corrected", 2) and outcomes[2][2] is False
    assert engine.anchor_pool(cfg).num_anchors == 2  # accepted corrections are not added back


def test_a_new_reader_uses_the_anchors_earlier_readers_of_the_slot_made(engine):
    # Anchors belong to what is read (the slot, from whom), not to a source->target pair: two reviewers'
    # dense fallbacks warm the pool, and a critic reading the slot for the first time is corrected.
    cfg = {"min_anchors": 2, "max_distance": 100.0, "min_margin": 0.0}
    sys_a, sys_b = system(engine, SYSTEM_A), system(engine, SYSTEM_B)
    outcomes = []
    for seed, reader in enumerate(("reviewer", "auditor", "critic")):
        doc = shared_doc(engine, 20 + seed, 64)
        a = engine.materialize(sys_a + doc, agent="planner")
        out = engine.compose(sys_b, [a.segment(len(sys_a), len(sys_a) + len(doc), slot="notes")], QUESTION,
                             agent=reader, correction=cfg)
        engine.anchor_pool(cfg).flush()
        outcomes.append((reader, out.segments[0].outcome, out.segments[0].anchors))
    assert outcomes == [("reviewer", "recomputed", 0), ("auditor", "recomputed", 1), ("critic", "corrected", 2)]


def test_confidence_gate_recomputes_a_correction_whose_next_token_is_unsure(engine, reference):
    kept = _compose_three(engine, {"min_anchors": 2, "max_distance": 100.0, "min_margin": 0.0})[2]
    assert kept.segments[0].outcome == "corrected" and kept.margin is not None and kept.margin > 0
    # The same composition with a gate above its margin: recomputed densely, exact, and it says why.
    engine.flush_cache()  # the dense fallbacks above are in the prefix cache: start from nothing again
    gated = _compose_three(engine, {"min_anchors": 2, "max_distance": 100.0, "min_margin": kept.margin + 1})[2]
    report = gated.segments[0]
    assert report.outcome == "recomputed" and report.tokens_reused == 0
    assert report.reason.startswith("low confidence: next-token margin")
    assert gated.exact and gated.handle.exact and gated.margin == pytest.approx(kept.margin, abs=1e-4)
    expected, _ = dense_greedy(reference, gated.handle.token_ids(), 8)
    assert greedy(engine, gated.handle) == expected
    with pytest.raises(InvalidRequest):
        CorrectionConfig(min_margin=-1)


def test_fallback_reports_why(engine):
    sys_a, sys_b, doc = system(engine, SYSTEM_A), system(engine, SYSTEM_B), shared_doc(engine, 5, 48)
    a = engine.materialize(sys_a + doc)
    out = engine.compose(sys_b, [a.segment(len(sys_a), len(sys_a) + len(doc))])
    assert out.segments[0].outcome == "recomputed"
    assert "needed" in out.segments[0].reason


def test_anchor_pool_stays_bounded():
    pool = AnchorPool(CorrectionConfig(pool_size=3, rank=4))
    for i in range(10):
        ref = torch.randn(4, 20 + i, 16)
        pool.add("slot", ref, ref + 0.1 * torch.randn_like(ref), wait=True)
    assert pool.anchors("slot") == 3 and pool.num_anchors == 3
    full = AnchorPool(CorrectionConfig(pool_size=3, method="full"))
    ref = torch.randn(4, 512, 192)
    full.add("slot", ref, ref + 1, wait=True)
    pool = AnchorPool(CorrectionConfig(pool_size=3, rank=32))
    pool.add("slot", ref, ref + 1, wait=True)
    assert full.nbytes > 3.7 * pool.nbytes  # low rank: the pool stops scaling with full dimensions


def test_approximate_kv_never_reaches_the_prefix_cache(engine, reference):
    sys_a, sys_b, doc = system(engine, SYSTEM_A), system(engine, SYSTEM_B), shared_doc(engine, 6, 128)
    suffix = engine.tokenize(QUESTION)
    a = engine.materialize(sys_a + doc)
    composed = engine.compose(sys_b, [a.segment(len(sys_a), len(sys_a) + len(doc))], suffix, mode="rotate")
    greedy(engine, composed.handle)  # resuming an approximate handle must not publish its blocks either
    fresh = engine.materialize(sys_b + doc + suffix)
    assert fresh.exact
    expected, _ = dense_greedy(reference, sys_b + doc + suffix, 8)
    assert greedy(engine, fresh) == expected
    child = engine.resume(composed.handle, "", kvbaton.SamplingParams(max_tokens=2)).handle
    assert not child.exact  # tokens computed behind approximate K/V stay flagged


def test_fidelity_of_exact_and_rotated_handles(engine):
    sys_a, sys_b, doc = system(engine, SYSTEM_A), system(engine, SYSTEM_B), shared_doc(engine, 7, 96)
    suffix = engine.tokenize(QUESTION)
    a = engine.materialize(sys_a + doc)
    # Composed before the dense handle exists: the prefix cache would hold the segment exactly.
    rotated = engine.compose(sys_b, [a.segment(len(sys_a), len(sys_a) + len(doc))], suffix, mode="rotate")
    assert rotated.segments[0].outcome == "rotated"
    dense = engine.materialize(sys_b + doc + suffix)
    same = engine.fidelity(dense, 6)
    assert same.first_token_agrees and same.greedy_agreement == 1.0 and abs(same.kl_mean) < 1e-4
    report = engine.fidelity(rotated.handle, 6, reference=dense)
    assert 0 <= report.greedy_agreement <= 1 and report.kl_mean >= 0 and len(report.dense_token_ids) == 6
    assert report.dense_token_ids == same.dense_token_ids


def test_restricted_merge(engine):
    doc = shared_doc(engine, 8, 64)
    short = engine.materialize(doc[:32])
    long = engine.extend(short, doc[32:])
    merged = engine.merge([long, short])
    assert merged.exact and merged.handle.token_ids() == doc and merged.tokens_prefilled == 0
    other = engine.materialize(doc[:16] + engine.tokenize(" something else entirely"))
    with pytest.raises(MergeConflict):
        engine.merge([long, other])
    with pytest.raises(MergeConflict):
        engine.merge([long.segment(0, 40), long.segment(30, 64)])
    concat = engine.merge([long.segment(32, 64), long.segment(0, 32)], mode="dense")
    assert concat.handle.token_ids() == doc[32:] + doc[:32]


def test_typed_errors(engine):
    doc = shared_doc(engine, 9, 32)
    h = engine.materialize(doc)
    foreign = h.model_copy(update={"model_fingerprint": "0" * 16})
    with pytest.raises(IncompatibleHandle):
        engine.compose(segments=[foreign.segment(0, 8)])
    with pytest.raises(InvalidRequest):
        engine.compose(segments=[h.segment(0, 64)])  # past the end
    with pytest.raises(InvalidRequest):
        engine.compose()
    with pytest.raises(InvalidRequest):
        engine.compose(segments=[h], mode="bogus")
    with pytest.raises(InvalidRequest):
        engine.compose(segments=[h], correction={"rank": 0})
    for rope in ("dynamic", "yarn", "longrope"):
        with pytest.raises(UnsupportedPositions):
            check_shiftable(rope)
    check_shiftable("llama3")


def test_compose_over_http(server):
    with kvbaton.connect(server.url, timeout=120) as client:
        a = client.materialize("Notes: the blue team shipped the parser. ")
        seg = a.segment(2, a.num_tokens, slot="notes")
        out = client.compose("You review. ", [seg], " Verdict:", mode="rotate")
        assert out.segments[0].outcome == "rotated" and not out.handle.exact
        fid = client.fidelity(out.handle, 4)
        assert len(fid.dense_token_ids) == 4
        with pytest.raises(MergeConflict):
            client.merge([a.segment(0, 4), a.segment(2, 6)])
        client.release([a, out.handle])


def test_selective_recomputation_rides_along_with_the_next_forward(engine):
    """A blended segment's recomputed tokens are computed in the state's next forward, together with the
    tokens after them (``place.recompute_at``), not in a forward of their own: the K/V and the logits are the
    same either way (each query sees the keys up to its own position; every layer writes its new K/V before
    reading), one pass over the weights fewer."""
    from kvbaton.backend.reuse.place import recompute_at
    from kvbaton.backend.reuse.plan import Compute, Filled
    from kvbaton.handle import LineageStep, Op

    sys_a, sys_b, doc = system(engine, SYSTEM_A), system(engine, SYSTEM_B), shared_doc(engine, 4)
    tail = engine.tokenize(QUESTION)
    source = engine.materialize(sys_a + doc)
    src_state = engine.handles.get(source)
    offset = len(sys_b)
    picked = [offset + i for i in (2, 9, 40, len(doc) - 1)]

    def program(state, deferred):
        yield Compute(offset)
        engine.kv.copy_rows(src_state, len(sys_a), state, offset, len(doc),
                            engine.placer.shifter.rotation(len(sys_a), offset, len(doc)))
        recompute_at(state, picked)
        assert state.stale == picked
        if not deferred:  # a forward of the recomputed tokens alone, first
            yield Compute(state.num_cached)
            assert state.stale == []
        return Filled((yield Compute(state.num_tokens)))

    out = []
    for deferred in (True, False):
        tokens = sys_b + doc + tail
        state = engine.kv.share(None, 0, tokens, LineageStep(op=Op.COMPOSE, token_ids=tuple(tokens)))
        state.cacheable = False
        try:
            engine.requests.run(state, program(state, deferred), attach=False)
            assert state.stale == [] and state.num_cached == len(tokens)
            out.append((state.last_logits, *engine.kv.read_rows(state, 0, len(tokens))))
        finally:
            engine.kv.drop(state)
    engine.release(source)
    for ours, theirs in zip(out[0], out[1], strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_moving_rows_layer_by_layer_equals_reading_shifting_and_writing(engine):
    """``copy_rows`` with a rotation (a re-aligned segment, moved one layer at a time inside the pool)
    gives the rows a whole-segment read, shift and write would."""
    sys_a, sys_b, doc = system(engine, SYSTEM_A), system(engine, SYSTEM_B), shared_doc(engine, 5)
    source = engine.materialize(sys_a + doc)
    src_state = engine.handles.get(source)
    composed = engine.compose(sys_b, [source.segment(len(sys_a), len(sys_a) + len(doc))], mode="rotate")
    k_src, v_src = engine.kv.read_rows(src_state, len(sys_a), len(doc))
    k, v = rows(engine, composed.handle, len(sys_b), len(doc))
    assert torch.equal(k, engine.placer.shifter.shift(k_src, len(sys_a), len(sys_b)))
    assert torch.equal(v, v_src)
    engine.release([composed.handle, source])


def test_placing_every_span_at_once_equals_placing_them_one_by_one(engine):
    """A prompt quoting several spans behind a new prefix: ``place_all`` moves them all, selects each one's
    most-deviating tokens in one two-layer pass and computes the tokens between them in the prompt's
    forward, giving the reports, K/V and logits that placing the spans one at a time gives."""
    from kvbaton.backend.reuse.plan import Compute, Filled
    from kvbaton.handle import LineageStep, Op

    sys_a, sys_b, doc = system(engine, SYSTEM_A), system(engine, SYSTEM_B), shared_doc(engine, 6, 200)
    source = engine.materialize(sys_a + doc)
    src = engine.handles.get(source)
    between, tail = engine.tokenize(" Also weigh this part:"), engine.tokenize(QUESTION)
    tokens = sys_b + doc[:80] + between + doc[120:200] + tail
    second = len(sys_b) + 80 + len(between)
    spans = [(src, len(sys_a), len(sys_a) + 80, len(sys_b)), (src, len(sys_a) + 120, len(sys_a) + 200, second)]
    def program(state, at_once):
        if at_once:
            reports = yield from engine.placer.place_all(state, spans, "blend")
        else:
            reports = []
            for i, span in enumerate(spans):
                reports.append((yield from engine.placer.place(state, i, *span, mode="blend")))
        return Filled((yield Compute(state.num_tokens)), reports)

    out = []
    for at_once in (True, False):
        state = engine.kv.share(None, 0, tokens, LineageStep(op=Op.COMPOSE, token_ids=tuple(tokens)))
        state.cacheable = False
        try:
            _, prompted = engine.requests.run(state, program(state, at_once), attach=False)
            assert state.exact_len == len(sys_b)
            out.append(([(r.outcome, r.offset, r.tokens_reused, r.exact) for r in prompted.segments],
                        state.last_logits, *engine.kv.read_rows(state, 0, len(tokens))))
        finally:
            engine.kv.drop(state)
    engine.release(source)
    assert out[0][0] == out[1][0] == [("blended", len(sys_b), 72, False), ("blended", second, 72, False)]
    for ours, theirs in zip(out[0][1:], out[1][1:], strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_a_compose_racing_the_release_of_its_source_succeeds_or_says_the_source_is_gone(engine):
    """A fault audit released a source while a compose read it: 22 of 205 races ended in a 500 (``IndexError``:
    the compose pinned the source's blocks but read the released handle's emptied block list). A compose reads
    views of its sources taken when it pins them: it succeeds on what it pinned, or the source was gone before
    (a typed error); never anything else."""
    import threading

    from kvbaton.errors import HandleNotFound, HandleReleased

    sys_a, sys_b, doc = system(engine, SYSTEM_A), system(engine, SYSTEM_B), shared_doc(engine, 9, 96)
    outcomes = []
    for _ in range(10):
        source = engine.materialize(sys_a + doc)
        segment = source.segment(len(sys_a), len(sys_a) + len(doc))
        start = threading.Barrier(2)
        result: dict[str, object] = {}

        def compose():
            start.wait(30)
            try:
                result["out"] = engine.compose(sys_b, [segment], mode="rotate")
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                result["out"] = exc

        racer = threading.Thread(target=compose)
        racer.start()
        start.wait(30)
        engine.release(source)
        racer.join(120)
        out = result["out"]
        assert isinstance(out, kvbaton.Composition | HandleReleased | HandleNotFound), repr(out)
        if isinstance(out, kvbaton.Composition):
            assert out.handle.num_tokens == len(sys_b) + len(doc)
            engine.release(out.handle)
        outcomes.append(type(out).__name__)
    assert engine.stats().handles_live == 0
