"""Placement: K/V computed behind one prefix, put behind another — the step of cross-prefix reuse.

A span ``start..end`` of a source state is placed at ``offset`` of an admitted state (its blocks
reserved, the source's blocks pinned): copied exactly when the tokens before it are the same as in
its source; otherwise re-aligned to the new positions (RoPE shift, :mod:`.rotary`) and, by mode,
left so (``"rotate"``), its most-deviating tokens recomputed behind the new prefix (``"blend"``:
selective recomputation), corrected by an anchor pool (``"auto"``, :mod:`.correction`), or
recomputed densely (``"dense"``, and wherever re-alignment cannot be exact).

:class:`Placer` serves explicit composition (:mod:`.compose`) and automatic reuse: :class:`AutoReuse`
is a request's ``reuse="auto"``/``"rotate"``/``"correct"`` step — find the prompt's spans in the span
index, place them and compute the rest. ``"auto"`` decides each span from the cause: how far its tokens'
layer-1 values moved from what the prompt's own context gives them, measured once after re-alignment;
a span is blended with as many tokens recomputed as deviate (at least ``blend_ratio``), or prefilled when
too many deviate, before anything of the prompt is computed (:meth:`Placer._blend`). Explicit composition
and ``"correct"`` keep a confidence gate on the answer's next-token margin (raised per agent by the fidelity
:mod:`.audit`); what it throws away is counted (:class:`Filled`). Every approximate answer goes to the audit.

One way: the decisions are the pure functions of :mod:`.plan`, and every placement method here is a
*program*: a generator that yields what it needs computed (:class:`~.plan.Compute`, :class:`~.plan.Deviation`,
:class:`~.plan.Alone`) and receives the result. The scheduler runs each need as ordinary work of its loop;
placement never calls the runtime, and imports nothing from it or the engine (``tests/test_import_layers.py``).

Invariants: whatever is approximated moves ``state.exact_len`` down to it, and so does anything
written behind approximate K/V, which is never reported exact; the sources' blocks stay pinned while
they are read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from kvbaton.handle import common_prefix_length
from kvbaton.types import Reuse, SegmentReport

from ..cache.kv_manager import KVManager
from ..cache.sequence import KVState
from .audit import FidelityAudit
from .correction import AnchorPool, CorrectionConfig, correction_config, from_canonical, to_canonical
from .plan import (
    Alone,
    Compute,
    Deviation,
    Filled,
    Program,
    blend_decision,
    margin_verdict,
    most_deviating,
    plan_spans,
    top2_margin,
)
from .rotary import RopeShifter
from .spans import MIN_SPAN, TAIL, SpanIndex, SpanMatch, usable

APPROXIMATE = ("rotated", "corrected", "blended")
# How each reuse policy places a span: selective recomputation, re-alignment only, anchor-pool correction.
POLICY_MODES = {"auto": "blend", "rotate": "rotate", "correct": "auto"}
_ROTATED = "keys re-aligned to the new positions; no correction (mode='rotate')"
Span = tuple[KVState, int, int, int]  # (source, start, end, offset)


class Placer:
    """Places spans of live states into admitted ones; owns the anchor pools of the correction."""

    def __init__(
        self, kv: KVManager, shifter: RopeShifter, correction: CorrectionConfig, spans: SpanIndex,
        audit: FidelityAudit, kv_heads: int, head_dim: int,
    ) -> None:
        self._kv = kv
        self._lock = kv.lock  # spans are looked up and their sources pinned atomically
        self.shifter = shifter
        self.correction = correction
        self._spans = spans
        self._audit = audit
        self._kv_heads, self._head_dim = kv_heads, head_dim
        self._anchor_pools: dict[CorrectionConfig, AnchorPool] = {}

    def anchor_pool(self, correction: CorrectionConfig | Mapping[str, Any] | None = None) -> AnchorPool:
        """The anchor pools used with ``correction`` settings (the engine's own by default)."""
        cfg = correction_config(correction) or self.correction
        with self._lock:
            return self._anchor_pools.setdefault(cfg, AnchorPool(cfg))

    def close(self) -> None:
        with self._lock:
            pools = list(self._anchor_pools.values())
        for pool in pools:
            pool.close()

    # -- automatic reuse -------------------------------------------------------------------------
    def starting_point(
        self, prompt: Sequence[int], parent: KVState | None, policy: Reuse, partition: str | None,
        cache_partition: str | None,
    ) -> tuple[KVState | None, int]:
        """Where a generation's prompt starts (lock held): the state whose K/V it shares and how many of its
        tokens. The given parent's common prefix (under ``"exact"``, never past an approximate handle's exact
        part), or, under automatic reuse (``partition``), the agent's own earlier approximate turn when it
        shares more: resumed rather than its transcript prefilled again."""
        keep = common_prefix_length(parent.token_ids, prompt) if parent is not None else 0
        if policy == "exact" and parent is not None and parent.exact_len is not None:
            keep = min(keep, parent.exact_len)  # exact asked: an approximate handle's rest is recomputed densely
        if partition is not None:
            own, n = self._spans.approximate_prefix(prompt, partition, self._kv.is_retained)
            if own is not None and n >= max(keep, self._kv.cached_prefix(prompt, cache_partition)) + MIN_SPAN:
                return own, n
        return parent, keep


    def fill(self, state: KVState, policy: Reuse, partition: str) -> Program[Filled]:
        """Cross-prefix reuse for an admitted request (a program): place the spans of its prompt that sources
        of ``partition`` hold (after its exact prefix) as the plan (:func:`.plan.plan_spans`) and ``policy``
        say, and compute the rest. Under ``"auto"`` each span's fate is decided from its measured deviation
        (:meth:`_blend`); ``"correct"`` keeps its confidence gate (recompute densely from the first
        approximated token when the next token looks unsure). Returns the next-token logits and what was
        placed (and, for ``"correct"``, what its gate threw away)."""
        with self._lock:
            # The prompt's last TAIL tokens are always computed (the last one: the request needs its logits).
            end = max(state.num_cached, state.num_tokens - TAIL)
            # Views of the sources: a release meanwhile leaves what is pinned readable.
            found = [dataclasses.replace(m, source=m.source.view())
                     for m in self._spans.find(state.token_ids, state.num_cached, end, partition)]
            plan = plan_spans(found, policy, self.correction.blend_ratio > 0, self.correction.max_context_gap)
            pinned = [b for m in plan.place for b in m.source.blocks]
            self._kv.pin(pinned)  # the sources may be released meanwhile: keep their K/V readable
        try:
            work = _Work(self._kv.pool.shape.num_layers)
            spans = [(m.source, m.start, m.start + m.length, m.offset) for m in plan.place]
            if plan.blend:
                logits, reports = yield from self._blend(work, state, spans)
            else:
                reports = yield from self.place_all(state, spans, POLICY_MODES[policy], work)
                logits = yield from work.compute(state)
                approximated = [r.offset + r.tokens_cached for r in reports if r.outcome in APPROXIMATE]
                if approximated and policy == "correct":
                    why = margin_verdict(logits, self._audit.margin_for(state.agent, self.correction.min_margin),
                                         "min_margin")
                    if why is not None:
                        reports = yield from self._reject(work, state, reports, min(approximated),
                                                          f"{why} after approximation")
                        logits = _last(state)
            if state.exact_len is not None:  # answered from approximate K/V: maybe checked, in the background
                self._audit.submit(state.agent, state.token_ids, int(logits.argmax()))
            if plan.prefill:
                reports = self._with_prefilled(state, reports, plan.prefill)
            return Filled(logits, reports, round(work.discarded))
        finally:
            self._kv.unpin(pinned)

    def _blend(self, work: _Work, state: KVState, spans: Sequence[Span]) -> Program[tuple[Any, list]]:
        """``reuse="auto"``: selective recomputation decided from the cause, per span, before anything is computed.

        Every span is re-aligned into place; one pass of the first two layers over everything from the first span
        on measures how far each token's layer-1 values moved from what this prompt's context gives them (layer 0
        is exact: its K/V depend on token and position only). Each span is then blended or prefilled as
        :func:`.plan.blend_decision` says from its deviation (the threshold lowered for an agent the audit found
        short), and the prompt's remaining tokens — the blended spans' recomputed ones, the prefilled spans, the
        tokens between and after the spans — are computed in one forward behind the kept K/V. No answer is
        computed twice: nothing is thrown away."""
        cfg = self.correction
        inherited = state.exact_len  # an approximate parent's: it stays approximate whatever happens here
        reports = yield from self.place_all(state, spans, "rotate", work)
        rotated = [r for r in reports if r.outcome == "rotated"]
        if not rotated:  # nothing re-aligned (exact copies, or recomputed): nothing to decide
            return (yield from work.compute(state)), reports
        first = min(r.offset + r.tokens_cached for r in rotated)
        last = max(r.offset + r.tokens_cached + r.tokens_reused for r in rotated)
        deviation = yield from work.deviation(first, last - first)
        threshold = cfg.deviation_threshold / self._audit.margin_for(state.agent, 1.0)
        stale: list[int] = []
        placed: set[int] = set()
        kept: list[int] = []  # where the blended spans start
        decided = []
        for r in reports:
            if r.outcome != "rotated":
                decided.append(r)
                continue
            lo, n = r.offset + r.tokens_cached, r.tokens_reused
            picked, why = blend_decision(deviation[lo - first : lo - first + n], lo, cfg.blend_ratio, threshold,
                                         cfg.max_recompute)
            placed.update(range(lo, lo + n))
            if picked is None:
                stale.extend(range(lo, lo + n))
                decided.append(r.model_copy(update={"outcome": "recomputed", "reason": why, "tokens_reused": 0}))
            else:
                stale.extend(picked)
                kept.append(lo)
                decided.append(r.model_copy(update={"outcome": "blended", "reason": why,
                                                    "tokens_reused": n - len(picked)}))
        stale.extend(p for p in range(first, state.num_cached) if p not in placed)  # what follows: computed anyway
        # Everything before the first blended span is recomputed densely now: approximate only from there on.
        bounds = [b for b in (inherited, min(kept, default=None)) if b is not None]
        state.exact_len = min(bounds) if bounds else None
        stale = sorted(set(stale) | set(state.stale))  # with the tokens before and between the spans (place_all)
        state.stale.clear()
        recompute_at(state, stale)
        logits = yield from work.compute(state)
        return logits, [r.model_copy(update={"exact": r.outcome not in APPROXIMATE and (
            state.exact_len is None or state.exact_len >= r.offset)}) for r in decided]

    def _with_prefilled(
        self, state: KVState, reports: list[SegmentReport], prefilled: Sequence[tuple[SpanMatch, str]],
    ) -> list[SegmentReport]:
        """``reports`` and one for each span found but prefilled densely (the plan says why), by offset."""
        for m, why in prefilled:
            reports.append(self._report(0, m.source, m.start, m.start + m.length, m.offset, "recomputed", why, 0, 0,
                                        state))
        reports.sort(key=lambda r: r.offset)
        return [r.model_copy(update={"index": i}) for i, r in enumerate(reports)]

    # -- the confidence gate ---------------------------------------------------------------------
    def _reject(
        self, work: _Work, state: KVState, reports: list[SegmentReport], start: int, why: str
    ) -> Program[list[SegmentReport]]:
        """The gate rejected the approximation: what was computed from ``start`` on is discarded (counted) and
        recomputed densely."""
        work.discard_from(start)
        return (yield from self.recompute_unsure(state, reports, start, f"low confidence: {why}; "))

    def recompute_unsure(
        self, state: KVState, reports: list[SegmentReport], start: int, why: str,
    ) -> Program[list[SegmentReport]]:
        """Confidence gate: prefill densely everything from ``start``, the first position this request
        approximated; ``why`` heads each recomputed segment's reason. Those blocks are private to ``state``
        (written by this request), so they are overwritten in place; an approximate prefix shared with a
        parent stays as it is."""
        inherited = state.exact_len is not None and state.exact_len < start
        state.num_cached, state.last_logits = start, None
        state.stale.clear()
        if not inherited:
            state.exact_len = None
        yield Compute(state.num_tokens)
        return [
            r.model_copy(update={
                "outcome": "recomputed", "reason": why + r.reason, "tokens_reused": 0, "exact": not inherited,
            })
            if r.offset + r.tokens_cached >= start else r
            for r in reports
        ]

    # -- placing spans -------------------------------------------------------------------------
    def place(
        self, state: KVState, index: int, src: KVState, start: int, end: int, offset: int, mode: str,
        anchors: AnchorPool | None = None, slot: str | None = None, work: _Work | None = None,
    ) -> Program[SegmentReport]:
        """Fill positions ``offset..`` of ``state`` (admitted, blocks reserved) with segment ``start..end``
        of ``src`` (its blocks pinned), computing densely what lies before it.

        Leading tokens the state already has (prefix cache, its parent) are kept and only the rest is
        placed. Whatever is approximated moves ``state.exact_len`` down to it, and so does anything
        written behind approximate K/V, which is never reported exact."""
        anchors = anchors or self.anchor_pool()
        n = end - start
        cached = min(max(0, state.num_cached - offset), n)
        if cached == n:
            return self._report(index, src, start, end, offset, "exact", "found in the prefix cache", 0, cached,
                                state)
        report = yield from self._place_rest(work or _Work(self._kv.pool.shape.num_layers), state, index, src,
                                             start + cached, end, offset + cached, mode, anchors,
                                             slot or f"segment{index}")
        report = report.model_copy(update={"start": start, "offset": offset, "tokens_cached": cached})
        if report.outcome in APPROXIMATE and (state.exact_len is None or state.exact_len > offset + cached):
            state.exact_len = offset + cached
        if state.exact_len is not None and state.exact_len < offset + cached:
            report = report.model_copy(update={"exact": False})
        if cached and report.outcome == "recomputed":
            report = report.model_copy(update={"reason": f"{cached} leading tokens found in the prefix cache; "
                                                         f"the rest: {report.reason}"})
        return report

    def place_all(self, state: KVState, spans: Sequence[Span], mode: str,
                  work: _Work | None = None) -> Program[list[SegmentReport]]:
        """Place several segments of one prompt, each ``(source, start, end, offset)``, ascending and behind
        ``state``'s cached tokens (sources pinned), in ``"blend"`` or ``"rotate"`` mode: every segment's K/V
        are moved into place and re-aligned first; then ONE pass of the first two layers over everything
        after the cached tokens picks each blended segment's most-deviating tokens, and the tokens between
        the segments ride along with those in the state's next forward (``stale``), with the rest of the
        prompt. The K/V are those :meth:`place` one segment at a time would give (layer 0's K/V depend on
        token and position only, so the selection sees the same inputs), but a prompt quoting several short
        spans costs two passes, not one forward per gap and per span.

        Falls back to :meth:`place` one by one where that is not the case (another mode, a blend ratio of
        0, an unshiftable RoPE, a segment with the same tokens before it as in its source)."""
        cfg = self.anchor_pool().config
        work = work or _Work(self._kv.pool.shape.num_layers)
        begin = state.num_cached
        plain = mode not in ("blend", "rotate") or (mode == "blend" and cfg.blend_ratio <= 0) \
            or not self.shifter.shiftable() or any(
                offset < begin or end > usable(src)
                or (start == offset and src.token_ids[:start] == state.token_ids[:offset])
                for src, start, end, offset in spans)
        if plain or not spans:
            reports = []
            for i, (src, start, end, offset) in enumerate(spans):
                reports.append((yield from self.place(state, i, src, start, end, offset, mode, work=work)))
            return reports
        stale: list[int] = []
        for src, start, end, offset in spans:
            stale.extend(range(state.num_cached, offset))  # the tokens before it: computed with the rest
            state.num_cached = offset
            n = end - start
            self._kv.copy_rows(src, start, state, offset, n, self.shifter.rotation(start, offset, n))
        if state.exact_len is None or state.exact_len > spans[0][3]:
            state.exact_len = spans[0][3]
        reports = []
        if mode == "rotate":
            for i, (src, start, end, offset) in enumerate(spans):
                reports.append(self._report(i, src, start, end, offset, "rotated", _ROTATED, end - start, 0, state))
        else:
            deviation = yield from work.deviation(begin, state.num_cached - begin)
            for i, (src, start, end, offset) in enumerate(spans):
                n = end - start
                picked = most_deviating(deviation[offset - begin : offset - begin + n], cfg.blend_ratio, offset)
                stale.extend(picked)
                reports.append(self._report(i, src, start, end, offset, "blended", _blended(len(picked), n),
                                            n - len(picked), 0, state))
        recompute_at(state, sorted(stale))
        return reports

    def _report(
        self, index: int, src: KVState, start: int, end: int, offset: int, outcome: str, reason: str, reused: int,
        cached: int, state: KVState, **extra: Any,
    ) -> SegmentReport:
        return SegmentReport(
            index=index, source=src.id, start=start, end=end, offset=offset, outcome=outcome,  # type: ignore[arg-type]
            reason=reason, tokens_reused=reused, tokens_cached=cached,
            exact=outcome not in APPROXIMATE and (state.exact_len is None or state.exact_len >= offset), **extra,
        )

    def _place_rest(
        self, work: _Work, state: KVState, index: int, src: KVState, start: int, end: int, offset: int,
        mode: str, anchors: AnchorPool, slot: str,
    ) -> Program[SegmentReport]:
        """Place ``start..end`` of ``src`` at ``offset``, where ``state`` has no K/V yet."""
        n = end - start
        kv, shifter = self._kv, self.shifter

        def report(outcome: str, reason: str, reused: int, **extra: Any) -> SegmentReport:
            return self._report(index, src, start, end, offset, outcome, reason, reused, 0, state, **extra)

        def dense(reason: str, **extra: Any) -> Program[SegmentReport]:
            yield from work.compute(state, offset + n)
            return report("recomputed", reason, 0, **extra)

        yield from work.compute(state, offset)  # the dense part before this segment
        available = min(end, src.num_cached) - start  # a resumed source may not have its last token's K/V yet
        if available <= 0:
            return (yield from dense("the source has no K/V for these tokens yet"))
        same_context = start == offset and src.token_ids[:start] == state.token_ids[:offset]
        if same_context and (src.exact_len is None or src.exact_len >= start + available):
            kv.copy_rows(src, start, state, offset, available)
            return report("exact", "same tokens before it as in its source", available)
        if mode == "dense":
            return (yield from dense("mode='dense'"))
        if not shifter.shiftable():
            return (yield from dense(shifter.reason or "the keys cannot be re-aligned exactly"))
        if mode == "rotate":
            kv.copy_rows(src, start, state, offset, available, shifter.rotation(start, offset, available))
            return report("rotated", _ROTATED, available)
        cfg = anchors.config
        if mode == "blend" and cfg.blend_ratio > 0:
            kv.copy_rows(src, start, state, offset, available, shifter.rotation(start, offset, available))
            deviation = yield from work.deviation(offset, available)
            picked = most_deviating(deviation, cfg.blend_ratio, offset)
            recompute_at(state, picked)  # recomputed in the state's next forward, with the tokens after it
            return report("blended", _blended(len(picked), available), available - len(picked))
        k, v = kv.read_rows(src, start, available)
        if cfg.chained:  # KVCMAS: the source agent's own cache is the reference
            # anchors of what was read (the slot, from whom), shared by every agent that reads it: a new
            # reader starts with what earlier readers' dense fallbacks measured, not with none
            ref_k, ref_v, ref_start, key = k, v, start, (slot, src.agent)
        else:  # context-free reference: the segment prefilled on its own
            ref_k, ref_v = yield Alone(tuple(src.token_ids[start : start + available]))
            ref_start, key = 0, (slot, state.agent)
        reference = to_canonical(shifter.shift(ref_k, ref_start, 0), ref_v)
        estimate = anchors.estimate(key, reference)
        if estimate.delta is None:
            out = yield from dense(estimate.reason, anchors=estimate.anchors, entropy=estimate.entropy)
            if state.exact_len is None:  # behind approximate K/V the "dense" target is itself off: no anchor
                exact_k, exact_v = kv.read_rows(state, offset, available)
                anchors.add(key, reference, to_canonical(shifter.shift(exact_k, offset, 0), exact_v))
            return out
        m = estimate.tokens
        k_rest, v_rest = from_canonical(reference[:, :m] + estimate.delta, self._kv_heads, self._head_dim)
        k_all = torch.cat((shifter.shift(ref_k[:1, :, :m], ref_start, 0), k_rest.to(ref_k.dtype)), dim=0)
        v_all = torch.cat((ref_v[:1, :, :m], v_rest.to(ref_v.dtype)), dim=0)
        kv.write_rows(state, offset, shifter.shift(k_all, 0, offset), v_all)
        return report("corrected", estimate.reason, m, anchors=estimate.anchors, entropy=estimate.entropy)


class AutoReuse:
    """One request's cross-prefix reuse (``policy`` ``"auto"``, ``"rotate"`` or ``"correct"``, spans of
    ``partition``): the program the runtime runs in place of computing an admitted prompt."""

    def __init__(self, placer: Placer, policy: Reuse, partition: str) -> None:
        self.placer, self.policy, self.partition = placer, policy, partition

    def program(self, state: KVState) -> Program[Filled]:
        """Place, compute, gate (see :meth:`Placer.fill`)."""
        return self.placer.fill(state, self.policy, self.partition)


def recompute_at(state: KVState, positions: list[int]) -> None:
    """Recompute the K/V of the (ascending) cached ``positions`` behind everything before them (selective
    recomputation), in the state's next forward together with the tokens after them: the same K/V as a
    forward of their own (every query sees the keys up to its own position, each layer's new K/V written
    before they are read), one pass over the weights fewer."""
    assert all(p < state.num_cached for p in positions) and (not state.stale or state.stale[-1] < positions[0])
    state.stale.extend(positions)
    state.last_logits = None


class _Work:
    """What one request's reuse program computes at which positions, so that a rejection can say how much of
    it was thrown away: each need goes through here on its way out."""

    def __init__(self, num_layers: int) -> None:
        self._layers = num_layers
        self._done: list[tuple[list[int], range, float]] = []  # (stale positions, new positions, weight)
        self.discarded = 0.0

    def compute(self, state: KVState, until: int | None = None) -> Program[Any]:
        until = state.num_tokens if until is None else until
        self._done.append((list(state.stale), range(state.num_cached, until), 1.0))
        return (yield Compute(until))

    def deviation(self, start: int, n: int) -> Program[torch.Tensor]:
        # layer 0 and layer 1's value projection: about two of the model's layers
        self._done.append(([], range(start, start + n), min(1.0, 2 / self._layers)))
        return (yield Deviation(start, n))

    def discard_from(self, start: int) -> None:
        """Everything computed so far at positions from ``start`` on is thrown away."""
        for stale, new, weight in self._done:
            self.discarded += weight * (sum(p >= start for p in stale) + len(range(max(new.start, start), new.stop)))
        self._done.clear()


def _last(state: KVState) -> torch.Tensor:
    assert state.last_logits is not None
    return state.last_logits


def _blended(recomputed: int, tokens: int) -> str:
    return (f"keys re-aligned to the new positions; the {recomputed} of {tokens} tokens whose layer-1 values "
            "deviated most were recomputed behind the new prefix")


__all__ = ["APPROXIMATE", "AutoReuse", "Filled", "Placer", "most_deviating", "recompute_at", "top2_margin"]
