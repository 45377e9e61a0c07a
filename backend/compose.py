"""Composition of shared segments: ``compose``, restricted ``merge`` and ``fidelity``.

``compose`` assembles ``prefix + segments + suffix`` from existing K/V: a segment behind the same
tokens as in its source is copied exactly; one at a new place is re-aligned (RoPE shift) and, in
``mode="auto"``, corrected by an anchor pool or recomputed when the pool is unsure, in
``mode="blend"`` its most-deviating tokens recomputed (selective recomputation); a confidence
gate recomputes everything approximated when the next token's top-2 margin is small. ``merge``
never blends divergent K/V of the same positions. ``fidelity`` measures a handle against dense
prefill of its tokens.

Invariants: a composition that approximated anything says so (``exact_len`` on its state,
``exact=False`` on its handle) and its approximate blocks never enter the prefix cache; the
sources' blocks stay pinned while they are read, whatever happens to their handles meanwhile.

The :class:`Composer` works over a narrow engine interface, passed in: the KV manager (rows and
blocks), the handle table, the request lifecycle (compute, register), input validation, the RoPE
shifter, and the engine's public operators for the whole requests it runs (a dense reference, a
greedy continuation).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from kvbaton.errors import InvalidRequest, MergeConflict
from kvbaton.handle import Handle, LineageStep, Op, Segment, common_prefix_length
from kvbaton.ops import check_agent
from kvbaton.types import Composition, Fidelity, Result, SamplingParams, SegmentReport

from .correction import AnchorPool, CorrectionConfig, from_canonical, to_canonical
from .handles import HandleTable
from .inputs import Context, Inputs
from .kv_manager import KVManager
from .lifecycle import Lifecycle
from .rotary import RopeShifter
from .sequence import KVState
from .spans import usable

HandleLike = Handle | str
MODES = ("auto", "blend", "rotate", "dense")
_APPROXIMATE = ("rotated", "corrected", "blended")
_REFERENCES = 16  # remembered dense continuations of reference handles


class Operators(Protocol):
    """The engine's public operators a composition runs whole requests with."""

    def materialize(self, context: Context, *, agent: str | None = None) -> Handle: ...

    def fork(self, handle: HandleLike, k: int = 2) -> list[Handle]: ...

    def resume(self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None) -> Result: ...

    def release(self, handles: HandleLike) -> None: ...


class Composer:
    def __init__(
        self, kv: KVManager, handles: HandleTable[KVState], lifecycle: Lifecycle, inputs: Inputs,
        shifter: RopeShifter, ops: Operators, correction: CorrectionConfig, kv_heads: int, head_dim: int,
    ) -> None:
        self._kv = kv
        self._lock: threading.RLock = kv.lock  # sources are looked up and pinned atomically
        self._handles = handles
        self._life = lifecycle
        self._inputs = inputs
        self.shifter = shifter
        self._ops = ops
        self.correction = correction
        self._kv_heads, self._head_dim = kv_heads, head_dim
        self._anchor_pools: dict[CorrectionConfig, AnchorPool] = {}
        self._references: OrderedDict[tuple[str, int], tuple[list[int], torch.Tensor]] = OrderedDict()

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

    # -- compose ----------------------------------------------------------------------------------
    def compose(
        self, prefix: HandleLike | Context | None = None, segments: Sequence[Segment | Handle] = (),
        suffix: Context | None = None, *, agent: str | None = None, mode: str = "auto",
        correction: CorrectionConfig | Mapping[str, Any] | None = None,
    ) -> Composition:
        """Assemble ``prefix + segments + suffix`` from existing K/V, prefilling only what must be.

        ``prefix`` is a handle (its K/V are shared, zero copy), text or token ids; each segment is a
        :class:`~kvbaton.Segment` (or a whole handle) whose K/V are reused: exactly when the tokens before
        it are the same as in its source, otherwise re-aligned to the new positions and, in ``mode="auto"``,
        corrected for the new context by the anchor pool or recomputed densely when the gate is unsure.
        ``mode="blend"`` re-aligns and recomputes the ``blend_ratio`` share of tokens whose layer-1 values
        deviate most (selective recomputation: needs no anchors, what ``reuse="auto"`` uses), under the same
        confidence gate; ``mode="rotate"`` re-aligns without correction (an explicit approximation);
        ``mode="dense"`` recomputes every segment that is not exact. Leading tokens of a segment already in
        the prefix cache are kept, and only the rest is placed. Approximate results are flagged (``exact=False`` on
        the handle) and never enter the prefix cache. ``correction`` overrides the engine's anchor-pool
        settings for this call (each distinct setting keeps its own pools).
        """
        t0 = time.perf_counter()
        if mode not in MODES:
            raise InvalidRequest(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        check_agent(agent)
        pool = self.anchor_pool(correction)
        parts = [_as_segment(s) for s in segments]
        suffix_tokens = [] if suffix is None else self._inputs.tokens(suffix, what="suffix", allow_empty=True)
        with self._lock:
            parent = self._handles.get(prefix) if isinstance(prefix, Handle) else None
            if parent is not None:
                prefix_tokens = list(parent.token_ids)
            elif prefix is None:
                prefix_tokens = []
            else:
                prefix_tokens = self._inputs.tokens(prefix, what="prefix", allow_empty=True)  # type: ignore[arg-type]
            sources: list[tuple[KVState, int, int, str]] = []
            tokens = list(prefix_tokens)
            offsets = []
            for i, part in enumerate(parts):
                src = self._handles.get(part.handle)
                start, end = part.bounds()
                if not start < end <= src.num_tokens:
                    raise InvalidRequest(
                        f"segment {i} covers tokens {start}..{end} of a handle with {src.num_tokens} tokens"
                    )
                sources.append((src, start, end, part.slot or f"segment{i}"))
                offsets.append(len(tokens))
                tokens.extend(src.token_ids[start:end])
            tokens.extend(suffix_tokens)
            if not tokens:
                raise InvalidRequest("nothing to compose: give a prefix, segments or a suffix")
            self._inputs.check_context(len(tokens))
            added = tokens[len(prefix_tokens) :] if parent is not None else tokens
            step = LineageStep(op=Op.COMPOSE, parent=parent.id if parent else None, token_ids=tuple(added))
            state = self._kv.share(parent, parent.num_tokens if parent else 0, added, step)
            state.agent = agent
            pinned = [b for src, *_ in sources for b in src.blocks]
            self._kv.pin(pinned)  # the sources may be released meanwhile: keep their K/V readable
        try:
            reused_before = self._life.admit(state, state.num_tokens)
            reports = []
            for i, ((src, start, end, slot), offset) in enumerate(zip(sources, offsets, strict=True)):
                reports.append(self.place(state, i, src, start, end, offset, mode, pool, slot))
            logits = self._life.compute_until(state, state.num_tokens)
            margin = None
            if state.exact_len is not None:
                if logits is None and mode in ("auto", "blend"):
                    # The prompt ends inside an approximated segment: recompute its last token for the logits.
                    state.num_cached -= 1
                    logits = self._life.compute_until(state, state.num_tokens)
                if logits is not None:
                    margin = top2_margin(logits)
                cfg = pool.config
                threshold = cfg.blend_min_margin if mode == "blend" else cfg.min_margin
                if margin is not None and mode in ("auto", "blend") and margin < threshold:
                    reports = self.recompute_unsure(state, reports, margin, threshold, state.exact_len)
            # Tokens found in the prefix cache are already counted in reused_before.
            reused = reused_before + sum(r.tokens_reused for r in reports)
            handle = self._life.register(state, reused)
        except BaseException:
            self._life.abandon(state)
            raise
        finally:
            self._kv.unpin(pinned)
        return Composition(
            handle=handle,
            segments=reports,
            exact=state.exact_len is None,
            tokens_reused=reused,
            tokens_prefilled=state.num_tokens - reused,
            compose_s=time.perf_counter() - t0,
            margin=margin,
        )

    def recompute_unsure(
        self, state: KVState, reports: list[SegmentReport], margin: float, threshold: float, start: int
    ) -> list[SegmentReport]:
        """Confidence gate: prefill densely everything from ``start``, the first position this request
        approximated (lock not held). Those blocks are private to ``state`` (written by this request), so
        they are overwritten in place; an approximate prefix shared with a parent stays as it is."""
        inherited = state.exact_len is not None and state.exact_len < start
        state.num_cached, state.last_logits = start, None
        if not inherited:
            state.exact_len = None
        self._life.compute_until(state, state.num_tokens)
        why = f"low confidence: next-token margin {margin:.2f} < min_margin {threshold:g} after approximation; "
        return [
            r.model_copy(update={
                "outcome": "recomputed", "reason": why + r.reason, "tokens_reused": 0, "exact": not inherited,
            })
            if r.offset + r.tokens_cached >= start else r
            for r in reports
        ]

    def place(
        self, state: KVState, index: int, src: KVState, start: int, end: int, offset: int, mode: str,
        anchors: AnchorPool | None = None, slot: str | None = None,
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
        report = self._place_rest(state, index, src, start + cached, end, offset + cached, mode, anchors,
                                  slot or f"segment{index}")
        report = report.model_copy(update={"start": start, "offset": offset, "tokens_cached": cached})
        if report.outcome in _APPROXIMATE and (state.exact_len is None or state.exact_len > offset + cached):
            state.exact_len = offset + cached
        if state.exact_len is not None and state.exact_len < offset + cached:
            report = report.model_copy(update={"exact": False})
        if cached and report.outcome == "recomputed":
            report = report.model_copy(update={"reason": f"{cached} leading tokens found in the prefix cache; "
                                                         f"the rest: {report.reason}"})
        return report

    def place_all(
        self, state: KVState, spans: Sequence[tuple[KVState, int, int, int]], mode: str,
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
            return [self.place(state, i, src, start, end, offset, mode)
                    for i, (src, start, end, offset) in enumerate(spans)]
        stale: list[int] = []
        for src, start, end, offset in spans:
            stale.extend(range(state.num_cached, offset))  # the tokens before it: computed with the rest
            state.num_cached = offset
            self._kv.copy_rows(src, start, state, offset, end - start, self.shifter.rotation(start, offset, end - start))
        if state.exact_len is None or state.exact_len > spans[0][3]:
            state.exact_len = spans[0][3]
        reports = []
        if mode == "rotate":
            for i, (src, start, end, offset) in enumerate(spans):
                reports.append(self._report(i, src, start, end, offset, "rotated", _ROTATED, end - start, 0, state))
        else:
            deviation = self._life.deviation(state, begin, state.num_cached - begin)
            for i, (src, start, end, offset) in enumerate(spans):
                n = end - start
                picked = most_deviating(deviation[offset - begin : offset - begin + n], cfg.blend_ratio, offset)
                stale.extend(picked)
                reports.append(self._report(i, src, start, end, offset, "blended", _blended(len(picked), n),
                                            n - len(picked), 0, state))
        self._life.recompute_at(state, sorted(stale))
        return reports

    def _report(
        self, index: int, src: KVState, start: int, end: int, offset: int, outcome: str, reason: str, reused: int,
        cached: int, state: KVState, **extra: Any,
    ) -> SegmentReport:
        return SegmentReport(
            index=index, source=src.id, start=start, end=end, offset=offset, outcome=outcome,  # type: ignore[arg-type]
            reason=reason, tokens_reused=reused, tokens_cached=cached,
            exact=outcome not in _APPROXIMATE and (state.exact_len is None or state.exact_len >= offset), **extra,
        )

    def _place_rest(
        self, state: KVState, index: int, src: KVState, start: int, end: int, offset: int, mode: str,
        anchors: AnchorPool, slot: str,
    ) -> SegmentReport:
        """Place ``start..end`` of ``src`` at ``offset``, where ``state`` has no K/V yet (lock not held)."""
        n = end - start
        kv, shifter = self._kv, self.shifter

        def report(outcome: str, reason: str, reused: int, **extra: Any) -> SegmentReport:
            return self._report(index, src, start, end, offset, outcome, reason, reused, 0, state, **extra)

        def dense(reason: str, **extra: Any) -> SegmentReport:
            self._life.compute_until(state, offset + n)
            return report("recomputed", reason, 0, **extra)

        self._life.compute_until(state, offset)  # the dense part before this segment
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
            picked = most_deviating(self._life.deviation(state, offset, available), cfg.blend_ratio, offset)
            # Recomputed in the state's next forward, with the tokens after the segment (``Lifecycle``).
            self._life.recompute_at(state, picked)
            return report("blended", _blended(len(picked), available), available - len(picked))
        k, v = kv.read_rows(src, start, available)
        if cfg.chained:  # KVCMAS: the source agent's own cache is the reference
            ref_k, ref_v, ref_start, key = k, v, start, (slot, src.agent, state.agent)
        else:  # context-free reference: the segment prefilled on its own
            ref_k, ref_v = self._segment_base(src.token_ids[start : start + available])
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

    def _segment_base(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of ``tokens`` prefilled on their own from position 0 (the non-chained reference)."""
        base = self._ops.materialize(tokens)
        try:
            return self.read_rows(base, 0, len(tokens))
        finally:
            self._ops.release(base)

    def read_rows(self, handle: HandleLike, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a live handle's positions ``start..start+n-1``: ``[layers, kv_heads, n, head_dim]``."""
        with self._lock:
            return self._kv.read_rows(self._handles.get(handle), start, n)

    # -- merge ------------------------------------------------------------------------------------
    def merge(
        self, parts: Sequence[Segment | Handle], *, agent: str | None = None, mode: str = "auto",
        correction: CorrectionConfig | Mapping[str, Any] | None = None,
    ) -> Composition:
        """Restricted merge: never blends divergent K/V of the same positions.

        Whole handles must be prefix-compatible (each a prefix of the longest, which is the result);
        segments are concatenated through :meth:`compose` and must not overlap in a common source.
        Text-level reduction is an ordinary ``generate`` call over the parts' texts.
        """
        items = list(parts)
        if not items:
            raise InvalidRequest("merge needs at least one handle or segment")
        if all(isinstance(p, Handle) for p in items):
            with self._lock:
                states = [self._handles.get(p) for p in items]  # type: ignore[arg-type]
                longest = max(states, key=lambda s: s.num_tokens)
                for st in states:
                    common = common_prefix_length(st.token_ids, longest.token_ids)
                    if common < st.num_tokens:
                        raise MergeConflict(
                            f"handles {st.id} and {longest.id} diverge at token {common}: their K/V for the same "
                            "positions differ and are never blended; compose explicit segments instead, or "
                            "reduce the texts with a generate call"
                        )
            t0 = time.perf_counter()
            (child,) = self._ops.fork(longest.id, 1)
            report = [_prefix_part(i, st, longest) for i, st in enumerate(states)]
            return Composition(
                handle=child, segments=report, exact=child.exact, tokens_reused=child.num_tokens,
                tokens_prefilled=0, compose_s=time.perf_counter() - t0,
            )
        segs = [_as_segment(p) for p in items]
        for i, a in enumerate(segs):
            for b in segs[i + 1 :]:
                (sa, ea), (sb, eb) = a.bounds(), b.bounds()
                if a.handle.id == b.handle.id and sa < eb and sb < ea:
                    raise MergeConflict(
                        f"segments {sa}..{ea} and {sb}..{eb} of handle {a.handle.id} overlap: the same positions "
                        "would appear twice"
                    )
        return self.compose(segments=segs, agent=agent, mode=mode, correction=correction)

    # -- fidelity ---------------------------------------------------------------------------------
    def fidelity(self, handle: HandleLike, max_tokens: int = 32, *, reference: HandleLike | None = None) -> Fidelity:
        """Compare a handle's continuation with dense prefill of the same tokens (greedy; KL along dense).

        The dense side is a fresh prefill that bypasses the prefix cache, or ``reference``: an exact handle
        of the same tokens (its continuation is remembered, so several candidates compare cheaply).
        """
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= 4096:
            raise InvalidRequest("max_tokens must be an integer in 1..4096")
        with self._lock:
            tokens = list(self._handles.get(handle).token_ids)
            ref = self._handles.get(reference) if reference is not None else None
            if ref is not None and (ref.token_ids != tokens or ref.exact_len is not None):
                raise InvalidRequest("the reference must be an exact handle of the same tokens")
            known = self._references.get((ref.id, max_tokens)) if ref is not None else None
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if known is None:
            dense = self._dense_reference(tokens) if ref is None else None
            source: HandleLike = dense if dense is not None else ref.id  # type: ignore[union-attr]
            try:
                theirs = self._ops.resume(source, "", greedy)
                self._ops.release(theirs.handle)  # type: ignore[arg-type]
                known = (theirs.token_ids, torch.log_softmax(self.logits_along(source, theirs.token_ids[:-1]), -1))
            finally:
                if dense is not None:
                    self._ops.release(dense)
            if ref is not None:
                with self._lock:
                    self._references[(ref.id, max_tokens)] = known
                    while len(self._references) > _REFERENCES:
                        self._references.popitem(last=False)
        dense_tokens, p = known
        ours = self._ops.resume(handle, "", greedy)
        self._ops.release(ours.handle)  # type: ignore[arg-type]
        q = torch.log_softmax(self.logits_along(handle, dense_tokens[:-1]), dim=-1)
        kl = (p.exp() * (p - q)).sum(dim=-1).clamp_min(0.0)  # >= 0; identical distributions give float noise
        agree = common_prefix_length(ours.token_ids, dense_tokens)
        return Fidelity(
            tokens=max_tokens,
            first_token_agrees=bool(ours.token_ids[:1] == dense_tokens[:1]),
            greedy_agreement=agree / max_tokens,
            kl_mean=float(kl.mean()),
            kl_first=float(kl[0]),
            dense_token_ids=dense_tokens,
            handle_token_ids=ours.token_ids,
        )

    def _dense_reference(self, tokens: list[int]) -> Handle:
        """A fresh dense prefill of ``tokens`` that neither reads nor feeds the prefix cache."""
        state = self._kv.share(None, 0, tokens, LineageStep(op=Op.MATERIALIZE, token_ids=tuple(tokens)))
        state.cacheable = False
        try:
            self._kv.reserve(state, state.num_tokens)
            self._life.compute(state)
        except BaseException:
            self._life.abandon(state)
            raise
        return self._life.register(state)

    def logits_along(self, handle: HandleLike, tokens: Sequence[int]) -> torch.Tensor:
        """Next-token logits after the handle and after each of ``tokens``: ``[len(tokens) + 1, vocab]``."""
        with self._lock:
            parent = self._handles.get(handle)
            last = parent.num_tokens - 1
            state = self._kv.share(parent, last, [parent.token_ids[last], *tokens], LineageStep(op=Op.RESUME))
            state.num_cached = min(state.num_cached, last)
        try:
            self._kv.reserve(state, state.num_tokens)
            return self._life.logits_after_each(state)[-(len(tokens) + 1) :]
        finally:
            self._kv.drop(state)

    def next_token_logits(self, handle: HandleLike, suffix: Context = "") -> torch.Tensor:
        """fp32 next-token logits after ``handle`` + ``suffix``, computed on the reuse path (nothing kept)."""
        tokens = self._inputs.tokens(suffix, what="suffix", allow_empty=True)
        with self._lock:
            parent = self._handles.get(handle)
            self._inputs.check_context(parent.num_tokens + len(tokens))
            state = self._kv.share(parent, parent.num_tokens, tokens, LineageStep(op=Op.RESUME, parent=parent.id))
        try:
            self._kv.reserve(state, state.num_tokens)
            return self._life.compute(state).clone()
        finally:
            self._kv.drop(state)


def correction_config(value: CorrectionConfig | Mapping[str, Any] | None) -> CorrectionConfig | None:
    """Anchor-pool settings from a :class:`CorrectionConfig` or a mapping of its fields."""
    if value is None or isinstance(value, CorrectionConfig):
        return value
    if not isinstance(value, Mapping):
        raise InvalidRequest("correction must be a CorrectionConfig or a mapping of its fields")
    try:
        return CorrectionConfig(**value)
    except TypeError as exc:
        raise InvalidRequest(f"invalid correction settings: {exc}") from None


def most_deviating(deviation: torch.Tensor, ratio: float, offset: int) -> list[int]:
    """Positions (ascending, from ``offset``) of the ``ratio`` share, at least one, of a placed segment's
    tokens whose deviation is largest: the ones selective recomputation recomputes."""
    m = min(len(deviation), max(1, math.ceil(ratio * len(deviation))))
    return sorted((torch.topk(deviation, m).indices + offset).tolist())


_ROTATED = "keys re-aligned to the new positions; no correction (mode='rotate')"


def _blended(recomputed: int, tokens: int) -> str:
    return (f"keys re-aligned to the new positions; the {recomputed} of {tokens} tokens whose layer-1 values "
            "deviated most were recomputed behind the new prefix")


def top2_margin(logits: torch.Tensor) -> float:
    """Top-1 minus top-2 logit: how close the next greedy token is to flipping."""
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def _prefix_part(index: int, part: KVState, longest: KVState) -> SegmentReport:
    """One whole handle of a prefix-compatible merge: its positions as the result holds them, which are
    approximate from the longest handle's ``exact_len`` on."""
    approx_from = longest.exact_len
    exact = approx_from is None or approx_from >= part.num_tokens
    return SegmentReport(
        index=index, source=part.id, start=0, end=part.num_tokens, offset=0, outcome="exact",
        reason="prefix-compatible" if exact else
        f"prefix-compatible; the merged K/V are approximate from token {approx_from} on (as in {longest.id})",
        tokens_reused=part.num_tokens, exact=exact,
    )


def _as_segment(part: Segment | Handle) -> Segment:
    if isinstance(part, Segment):
        return part
    if isinstance(part, Handle):
        return Segment(handle=part)
    raise InvalidRequest(f"segments must be Segment or Handle objects, got {type(part).__name__}")
