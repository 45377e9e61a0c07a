"""Placement: K/V computed behind one prefix, put behind another — the step of cross-prefix reuse.

A span ``start..end`` of a source state is placed at ``offset`` of an admitted state (its blocks
reserved, the source's blocks pinned): copied exactly when the tokens before it are the same as in
its source; otherwise re-aligned to the new positions (RoPE shift, :mod:`.rotary`) and, by mode,
left so (``"rotate"``), its most-deviating tokens recomputed behind the new prefix (``"blend"``:
selective recomputation), corrected by an anchor pool (``"auto"``, :mod:`.correction`), or
recomputed densely (``"dense"``, and wherever re-alignment cannot be exact). The confidence gate
recomputes densely everything approximated when the next token's top-2 margin is small.

:class:`Placer` serves explicit composition (:mod:`.compose`) and automatic reuse: :class:`AutoReuse`
is a request's ``reuse="auto"``/``"rotate"``/``"correct"`` step — find the prompt's spans in the span
index, place them (blend, re-align, anchor-correct), compute the rest, gate the answer (the margins
raised per agent by the fidelity :mod:`.audit`) and hand an approximate answer to the audit. Under
``"auto"`` the gate is decided early where it can be: on a probe that computes only the rest of the
prompt behind the re-aligned spans, before the blend is paid for (:meth:`Placer.fill`), so a
rejection costs little more than the dense prefill it falls back to; what a rejection threw away is
counted (:class:`Filled`).

One way: the request lifecycle runs the step and passes a :class:`Forward`, the forwards placement
needs over the state; placement never calls back up, and imports nothing from the lifecycle or the
engine (``tests/test_import_layers.py``).

Invariants: whatever is approximated moves ``state.exact_len`` down to it, and so does anything
written behind approximate K/V, which is never reported exact; the sources' blocks stay pinned while
they are read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from kvbaton.types import Reuse, SegmentReport

from ..cache.kv_manager import KVManager
from ..cache.sequence import KVState
from .audit import FidelityAudit
from .correction import AnchorPool, CorrectionConfig, correction_config, from_canonical, to_canonical
from .rotary import RopeShifter
from .spans import TAIL, SpanIndex, usable

APPROXIMATE = ("rotated", "corrected", "blended")
# How each reuse policy places a span: selective recomputation, re-alignment only, anchor-pool correction.
POLICY_MODES = {"auto": "blend", "rotate": "rotate", "correct": "auto"}
_ROTATED = "keys re-aligned to the new positions; no correction (mode='rotate')"
# Automatic reuse places a span only where its source read it at about the same position: a span read
# ``start`` tokens into its source and placed ``offset`` tokens into a prompt differs from it in at least
# ``|offset - start|`` of the tokens it attends to. Beyond this many, its K/V miss (or hold) too much context:
# a map-reduce reducer whose document is stitched from four parts, each read behind only a persona, took
# another first token than dense prefill in 8 of 8 documents with the parts re-aligned (and blended at 10%),
# sometimes with a margin the gate let through; persona swaps (tens of tokens) stay far below it.
MAX_CONTEXT_GAP = 256
# reuse="auto" probes (computes the prompt's tokens outside the spans behind them) only when that is at most
# this share of what a rejection prefills densely: so a rejection costs at most this much more than dense
# prefill (the target of docs/results.md, agents). Beyond it the reusable share is small anyway.
PROBE_SHARE = 0.25


class Forward(Protocol):
    """The forwards placement runs over an admitted state (blocks reserved; the engine lock not held),
    provided by the request runtime (:class:`~..runtime.lifecycle.Lifecycle`)."""

    def compute(self, state: KVState) -> torch.Tensor:
        """Compute every uncached token; the next-token logits."""
        ...

    def compute_until(self, state: KVState, until: int) -> torch.Tensor | None:
        """Compute positions up to ``until`` (stale ones first); the logits after the last (None: none computed)."""
        ...

    def deviation(self, state: KVState, start: int, n: int) -> torch.Tensor:
        """Per-token deviation of the placed K/V at ``start..start+n-1`` from their recomputation."""
        ...

    def recompute_at(self, state: KVState, positions: list[int]) -> None:
        """Recompute the K/V of these cached positions in the state's next forward."""
        ...

    def kv_alone(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``tokens`` prefilled on their own from position 0 (a context-free reference)."""
        ...


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
    def fill(self, forward: Forward, state: KVState, policy: Reuse, partition: str) -> Filled:
        """Cross-prefix reuse for an admitted request: place the spans of its prompt that sources of
        ``partition`` hold (after its exact prefix) as ``policy`` says, compute the rest, and, unless the
        policy is ``"rotate"``, recompute densely from the first approximated token when the next token
        looks unsure (the confidence gate; lock not held). Returns the next-token logits, what was placed
        and what the gate threw away."""
        with self._lock:
            # The prompt's last TAIL tokens are always computed (the last one: the request needs its logits).
            end = max(state.num_cached, state.num_tokens - TAIL)
            found = self._spans.find(state.token_ids, state.num_cached, end, partition)
            far = [m for m in found if abs(m.offset - m.start) > MAX_CONTEXT_GAP]  # computed with the rest
            found = [m for m in found if abs(m.offset - m.start) <= MAX_CONTEXT_GAP]
            pinned = [b for m in found for b in m.source.blocks]
            self._kv.pin(pinned)  # the sources may be released meanwhile: keep their K/V readable
        try:
            work = _Work(forward, self._kv.pool.shape.num_layers)
            spans = [(m.source, m.start, m.start + m.length, m.offset) for m in found]
            if policy == "auto" and spans and self.correction.blend_ratio > 0:
                logits, reports = self._blend_gated(work, state, spans)
            else:
                reports = self.place_all(work, state, spans, POLICY_MODES[policy])
                logits = work.compute(state)
                approximated = [r.offset + r.tokens_cached for r in reports if r.outcome in APPROXIMATE]
                if approximated and policy != "rotate":
                    gate = self.correction.blend_min_margin if policy == "auto" else self.correction.min_margin
                    threshold = self._audit.margin_for(state.agent, gate)
                    margin = top2_margin(logits)
                    if margin < threshold:
                        why = f"next-token margin {margin:.2f} < min_margin {threshold:g} after approximation"
                        reports = self._reject(work, state, reports, min(approximated), why)
                        logits = _last(state)
            if state.exact_len is not None:  # answered from approximate K/V: maybe checked, in the background
                self._audit.submit(state.agent, state.token_ids, int(logits.argmax()))
            if far:
                reports = self._with_far(state, reports, far)
            return Filled(logits, reports, round(work.discarded))
        finally:
            self._kv.unpin(pinned)

    def _blend_gated(
        self, work: _Work, state: KVState, spans: Sequence[tuple[KVState, int, int, int]]
    ) -> tuple[torch.Tensor, list[SegmentReport]]:
        """``reuse="auto"``: selective recomputation under a confidence gate that is decided early and cheaply.

        1. Every span is re-aligned into place and the rest of the prompt (the tokens between the spans
           and the tail) computed behind them: the *probe*, a forward of those tokens only.
        2. A probe whose next-token margin is below ``probe_min_margin`` is a close call the model is unsure
           of with or without the approximation: the prompt is prefilled densely from the first placed span
           at once, having spent only the probe (early rejection).
        3. Otherwise the spans are blended as :meth:`place_all` does (one deviation pass over the first two
           layers, each span's most-deviating share recomputed together with the tokens after the first
           span), and the answer is kept when its margin is at least ``blend_min_margin`` (raised for an
           agent the audit found short) and its next token is the probe's: two approximations of unequal
           fidelity that disagree say the approximation decides the answer. Else everything is prefilled
           densely (late rejection, which costs the probe and the blend on top of the dense prefill)."""
        cfg = self.correction
        fallback = state.num_tokens - spans[0][3]  # what a rejection prefills densely
        probe_tokens = fallback - sum(end - start for _, start, end, _ in spans)
        if probe_tokens > PROBE_SHARE * fallback:
            why = (f"the confidence gate's probe would compute {probe_tokens} of the {fallback} tokens from the first "
                   f"span on (more than {PROBE_SHARE:.0%}): a rejection would cost more than the dense prefill it "
                   f"falls back to, so it was prefilled")
            reports = [self._report(i, src, start, end, offset, "recomputed", why, 0, 0, state)
                       for i, (src, start, end, offset) in enumerate(spans)]
            return work.compute(state), reports
        reports = self.place_all(work, state, spans, "rotate")
        probe = work.compute(state)
        rotated = [r for r in reports if r.outcome == "rotated"]
        if not rotated:  # nothing re-aligned (exact copies, or recomputed): nothing to gate
            return probe, reports
        first = min(r.offset + r.tokens_cached for r in rotated)
        margin = top2_margin(probe)
        threshold = self._audit.margin_for(state.agent, cfg.probe_min_margin)
        if margin < threshold:
            why = f"next-token margin {margin:.2f} < probe_min_margin {threshold:g} with the spans re-aligned"
            reports = self._reject(work, state, reports, first, why)
            return _last(state), reports
        # Selective recomputation: the spans' most-deviating tokens, and everything after the first span that
        # is no span token (computed behind the re-aligned spans by the probe), behind the blended spans.
        last = max(r.offset + r.tokens_cached + r.tokens_reused for r in rotated)
        deviation = work.deviation(state, first, last - first)
        stale: list[int] = []
        placed: set[int] = set()
        blended = []
        for r in reports:
            if r.outcome != "rotated":
                blended.append(r)
                continue
            lo = r.offset + r.tokens_cached
            n = r.tokens_reused
            picked = most_deviating(deviation[lo - first : lo - first + n], cfg.blend_ratio, lo)
            stale.extend(picked)
            placed.update(range(lo, lo + n))
            blended.append(r.model_copy(update={"outcome": "blended", "reason": _blended(len(picked), n),
                                                "tokens_reused": n - len(picked)}))
        stale.extend(p for p in range(first, state.num_tokens) if p not in placed)
        work.recompute_at(state, sorted(set(stale)))
        logits = work.compute(state)
        blend_margin = top2_margin(logits)
        gate = self._audit.margin_for(state.agent, cfg.blend_min_margin)
        agree = int(logits.argmax()) == int(probe.argmax())
        if blend_margin < gate or not agree:
            why = (f"next-token margin {blend_margin:.2f} < min_margin {gate:g} after blending" if blend_margin < gate
                   else "the blended and the re-aligned K/V give different next tokens")
            blended = self._reject(work, state, blended, first, why)
            return _last(state), blended
        return logits, blended

    def _with_far(self, state: KVState, reports: list[SegmentReport], far: Sequence[Any]) -> list[SegmentReport]:
        """``reports`` and one for each span found but prefilled densely (``MAX_CONTEXT_GAP``), by offset."""
        for m in far:
            gap = abs(m.offset - m.start)
            why = (f"read {m.start} tokens into its source and {m.offset} here: at least {gap} tokens of the context "
                   f"it attends to differ (more than {MAX_CONTEXT_GAP}), so it was prefilled")
            reports.append(self._report(0, m.source, m.start, m.start + m.length, m.offset, "recomputed", why, 0, 0,
                                        state))
        reports.sort(key=lambda r: r.offset)
        return [r.model_copy(update={"index": i}) for i, r in enumerate(reports)]

    # -- the confidence gate ---------------------------------------------------------------------
    def _reject(
        self, work: _Work, state: KVState, reports: list[SegmentReport], start: int, why: str
    ) -> list[SegmentReport]:
        """The gate rejected the approximation: what was computed from ``start`` on is discarded (counted) and
        recomputed densely."""
        work.discard_from(start)
        return self.recompute_unsure(work, state, reports, start, f"low confidence: {why}; ")

    def recompute_unsure(
        self, forward: Forward, state: KVState, reports: list[SegmentReport], start: int, why: str,
    ) -> list[SegmentReport]:
        """Confidence gate: prefill densely everything from ``start``, the first position this request
        approximated (lock not held); ``why`` heads each recomputed segment's reason. Those blocks are
        private to ``state`` (written by this request), so they are overwritten in place; an approximate
        prefix shared with a parent stays as it is."""
        inherited = state.exact_len is not None and state.exact_len < start
        state.num_cached, state.last_logits = start, None
        state.stale.clear()
        if not inherited:
            state.exact_len = None
        forward.compute_until(state, state.num_tokens)
        return [
            r.model_copy(update={
                "outcome": "recomputed", "reason": why + r.reason, "tokens_reused": 0, "exact": not inherited,
            })
            if r.offset + r.tokens_cached >= start else r
            for r in reports
        ]

    # -- placing spans -------------------------------------------------------------------------
    def place(
        self, forward: Forward, state: KVState, index: int, src: KVState, start: int, end: int, offset: int,
        mode: str, anchors: AnchorPool | None = None, slot: str | None = None,
    ) -> SegmentReport:
        """Fill positions ``offset..`` of ``state`` (admitted, blocks reserved) with segment ``start..end``
        of ``src`` (its blocks pinned), computing densely what lies before it; the lock is not held.

        Leading tokens the state already has (prefix cache, its parent) are kept and only the rest is
        placed. Whatever is approximated moves ``state.exact_len`` down to it, and so does anything
        written behind approximate K/V, which is never reported exact."""
        anchors = anchors or self.anchor_pool()
        n = end - start
        cached = min(max(0, state.num_cached - offset), n)
        if cached == n:
            return self._report(index, src, start, end, offset, "exact", "found in the prefix cache", 0, cached,
                                state)
        report = self._place_rest(forward, state, index, src, start + cached, end, offset + cached, mode, anchors,
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

    def place_all(
        self, forward: Forward, state: KVState, spans: Sequence[tuple[KVState, int, int, int]], mode: str,
    ) -> list[SegmentReport]:
        """Place several segments of one prompt, each ``(source, start, end, offset)``, ascending and behind
        ``state``'s cached tokens (sources pinned, lock not held), in ``"blend"`` or ``"rotate"`` mode: every
        segment's K/V are moved into place and re-aligned first; then ONE pass of the first two layers over
        everything after the cached tokens picks each blended segment's most-deviating tokens, and the
        tokens between the segments ride along with those in the state's next forward (``stale``), with the
        rest of the prompt. The K/V are those :meth:`place` one segment at a time would give (layer 0's K/V
        depend on token and position only, so the selection sees the same inputs), but a prompt quoting
        several short spans costs two passes, not one forward per gap and per span.

        Falls back to :meth:`place` one by one where that is not the case (another mode, a blend ratio of
        0, an unshiftable RoPE, a segment with the same tokens before it as in its source)."""
        cfg = self.anchor_pool().config
        begin = state.num_cached
        plain = mode not in ("blend", "rotate") or (mode == "blend" and cfg.blend_ratio <= 0) \
            or not self.shifter.shiftable() or any(
                offset < begin or end > usable(src)
                or (start == offset and src.token_ids[:start] == state.token_ids[:offset])
                for src, start, end, offset in spans)
        if plain or not spans:
            return [self.place(forward, state, i, src, start, end, offset, mode)
                    for i, (src, start, end, offset) in enumerate(spans)]
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
            deviation = forward.deviation(state, begin, state.num_cached - begin)
            for i, (src, start, end, offset) in enumerate(spans):
                n = end - start
                picked = most_deviating(deviation[offset - begin : offset - begin + n], cfg.blend_ratio, offset)
                stale.extend(picked)
                reports.append(self._report(i, src, start, end, offset, "blended", _blended(len(picked), n),
                                            n - len(picked), 0, state))
        forward.recompute_at(state, sorted(stale))
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
        self, forward: Forward, state: KVState, index: int, src: KVState, start: int, end: int, offset: int,
        mode: str, anchors: AnchorPool, slot: str,
    ) -> SegmentReport:
        """Place ``start..end`` of ``src`` at ``offset``, where ``state`` has no K/V yet (lock not held)."""
        n = end - start
        kv, shifter = self._kv, self.shifter

        def report(outcome: str, reason: str, reused: int, **extra: Any) -> SegmentReport:
            return self._report(index, src, start, end, offset, outcome, reason, reused, 0, state, **extra)

        def dense(reason: str, **extra: Any) -> SegmentReport:
            forward.compute_until(state, offset + n)
            return report("recomputed", reason, 0, **extra)

        forward.compute_until(state, offset)  # the dense part before this segment
        available = min(end, src.num_cached) - start  # a resumed source may not have its last token's K/V yet
        if available <= 0:
            return dense("the source has no K/V for these tokens yet")
        same_context = start == offset and src.token_ids[:start] == state.token_ids[:offset]
        if same_context and (src.exact_len is None or src.exact_len >= start + available):
            kv.copy_rows(src, start, state, offset, available)
            return report("exact", "same tokens before it as in its source", available)
        if mode == "dense":
            return dense("mode='dense'")
        if not shifter.shiftable():
            return dense(f"RoPE type {shifter.rope_type!r} cannot be re-aligned exactly")
        if mode == "rotate":
            kv.copy_rows(src, start, state, offset, available, shifter.rotation(start, offset, available))
            return report("rotated", _ROTATED, available)
        cfg = anchors.config
        if mode == "blend" and cfg.blend_ratio > 0:
            kv.copy_rows(src, start, state, offset, available, shifter.rotation(start, offset, available))
            picked = most_deviating(forward.deviation(state, offset, available), cfg.blend_ratio, offset)
            # Recomputed in the state's next forward, with the tokens after the segment (``Forward.recompute_at``).
            forward.recompute_at(state, picked)
            return report("blended", _blended(len(picked), available), available - len(picked))
        k, v = kv.read_rows(src, start, available)
        if cfg.chained:  # KVCMAS: the source agent's own cache is the reference
            ref_k, ref_v, ref_start, key = k, v, start, (slot, src.agent, state.agent)
        else:  # context-free reference: the segment prefilled on its own
            ref_k, ref_v = forward.kv_alone(src.token_ids[start : start + available])
            ref_start, key = 0, (slot, state.agent)
        reference = to_canonical(shifter.shift(ref_k, ref_start, 0), ref_v)
        estimate = anchors.estimate(key, reference)
        if estimate.delta is None:
            out = dense(estimate.reason, anchors=estimate.anchors, entropy=estimate.entropy)
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


@dataclass(frozen=True)
class Filled:
    """What a request's reuse step did: the next-token logits, the spans placed, and the work the confidence
    gate threw away (token-forwards; a pass over the first layers counts as its share of the layers)."""

    logits: torch.Tensor
    segments: list[SegmentReport]
    discarded: int = 0


@dataclass(frozen=True)
class AutoReuse:
    """One request's cross-prefix reuse (``policy`` ``"auto"``, ``"rotate"`` or ``"correct"``, spans of
    ``partition``): the step the lifecycle runs in place of computing an admitted prompt, with itself as the
    :class:`Forward`."""

    placer: Placer
    policy: Reuse
    partition: str

    def fill(self, forward: Forward, state: KVState) -> Filled:
        """Place, compute, gate (see :meth:`Placer.fill`)."""
        return self.placer.fill(forward, state, self.policy, self.partition)


class _Work:
    """The :class:`Forward` of one request's reuse step, counting what it computes at which positions, so
    that a rejection can say how much of it was thrown away."""

    def __init__(self, forward: Forward, num_layers: int) -> None:
        self._forward = forward
        self._layers = num_layers
        self._done: list[tuple[list[int], range, float]] = []  # (stale positions, new positions, weight)
        self.discarded = 0.0

    def compute(self, state: KVState) -> torch.Tensor:
        self._note(state, state.num_tokens)
        return self._forward.compute(state)

    def compute_until(self, state: KVState, until: int) -> torch.Tensor | None:
        self._note(state, until)
        return self._forward.compute_until(state, until)

    def deviation(self, state: KVState, start: int, n: int) -> torch.Tensor:
        # layer 0 and layer 1's value projection: about two of the model's layers
        self._done.append(([], range(start, start + n), min(1.0, 2 / self._layers)))
        return self._forward.deviation(state, start, n)

    def recompute_at(self, state: KVState, positions: list[int]) -> None:
        self._forward.recompute_at(state, positions)

    def kv_alone(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._forward.kv_alone(tokens)

    def discard_from(self, start: int) -> None:
        """Everything computed so far at positions from ``start`` on is thrown away."""
        for stale, new, weight in self._done:
            self.discarded += weight * (sum(p >= start for p in stale) + len(range(max(new.start, start), new.stop)))
        self._done.clear()

    def _note(self, state: KVState, until: int) -> None:
        self._done.append((list(state.stale), range(state.num_cached, until), 1.0))


def _last(state: KVState) -> torch.Tensor:
    assert state.last_logits is not None
    return state.last_logits


def most_deviating(deviation: torch.Tensor, ratio: float, offset: int) -> list[int]:
    """Positions (ascending, from ``offset``) of the ``ratio`` share, at least one, of a placed segment's
    tokens whose deviation is largest: the ones selective recomputation recomputes."""
    m = min(len(deviation), max(1, math.ceil(ratio * len(deviation))))
    return sorted((torch.topk(deviation, m).indices + offset).tolist())


def _blended(recomputed: int, tokens: int) -> str:
    return (f"keys re-aligned to the new positions; the {recomputed} of {tokens} tokens whose layer-1 values "
            "deviated most were recomputed behind the new prefix")


def top2_margin(logits: torch.Tensor) -> float:
    """Top-1 minus top-2 logit: how close the next greedy token is to flipping."""
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])
