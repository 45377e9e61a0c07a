"""Explicit composition of shared segments: the ``compose``, restricted ``merge`` and ``fidelity`` operators.

``compose`` assembles ``prefix + segments + suffix`` from existing K/V, each segment placed by the
:class:`~.place.Placer` (exact copy, re-alignment, selective recomputation, anchor correction, dense)
under the confidence gate. ``merge`` never blends divergent K/V of the same positions. ``fidelity``
measures a handle against dense prefill of its tokens.

Invariants: a composition that approximated anything says so (``exact_len`` on its state,
``exact=False`` on its handle) and its approximate blocks never enter the prefix cache; the
sources' blocks stay pinned while they are read, whatever happens to their handles meanwhile.

The :class:`Composer` works over narrow interfaces passed in when it is built: the KV manager (rows
and blocks), the handle table, input validation, the placer, and :class:`Requests`, the request runtime
that admits, computes and registers its states and runs the whole requests a measurement needs (a dense
reference, a greedy continuation). It calls nothing above them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from kvbaton.errors import InvalidRequest, MergeConflict
from kvbaton.handle import Handle, HandleLike, LineageStep, Op, Segment, common_prefix_length
from kvbaton.stream import TokenStream
from kvbaton.types import Composition, Fidelity, SamplingParams, SegmentReport

from ..cache.kv_manager import KVManager
from ..cache.sequence import KVState
from ..handles import HandleTable
from ..inputs import Context, Inputs
from ..tenants import check_label
from .correction import AnchorPool, CorrectionConfig
from .place import Placer
from .plan import Compute, Filled, Program, compute_all, top2_margin

MODES = ("auto", "blend", "rotate", "dense")
_REFERENCES = 16  # remembered dense continuations of reference handles


SCORE_CHUNK = 512
"""Rows of logits a prompt's scoring computes at once (``Engine.prompt_logprobs``): each row is a vocabulary of
fp32 logits (~0.2 MB for the default model), so a chunk bounds the memory whatever the prompt's length."""


class Requests(Protocol):
    """The request runtime a composition runs with (:class:`~..runtime.lifecycle.Lifecycle`): running a
    prompt program (its handle registered, or the state left to the caller), publishing and releasing states,
    and whole generations."""

    def run(self, state: KVState, program: Program[Filled], *, attach: bool = True, register: bool = False,
            count: bool = True) -> tuple[Handle | None, Any]: ...

    def publish(self, state: KVState) -> Handle: ...

    def release(self, state: KVState) -> None: ...

    def stream(self, state: KVState, params: SamplingParams) -> TokenStream: ...

    def logits_after_each(self, state: KVState) -> torch.Tensor: ...


class Composer:
    def __init__(
        self, kv: KVManager, handles: HandleTable[KVState], requests: Requests, inputs: Inputs, placer: Placer,
    ) -> None:
        self._kv = kv
        self._lock: threading.RLock = kv.lock  # sources are looked up and pinned atomically
        self._handles = handles
        self._life = requests
        self._inputs = inputs
        self._placer = placer
        self._references: OrderedDict[tuple[str, int], tuple[list[int], torch.Tensor]] = OrderedDict()

    # -- compose ----------------------------------------------------------------------------------
    def compose(
        self, prefix: HandleLike | Context | None = None, segments: Sequence[Segment | Handle] = (),
        suffix: Context | None = None, *, agent: str | None = None, tenant: str | None = None, mode: str = "auto",
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
        settings for this call (each distinct setting keeps its own pools). ``agent`` is the request's
        agent as the engine shows it (its label), ``tenant`` its tenant (the result's cache partition follows it).
        """
        t0 = time.perf_counter()
        if mode not in MODES:
            raise InvalidRequest(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        check_label(agent)
        pool = self._placer.anchor_pool(correction)
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
                src = self._handles.get(part.handle).view()  # a release meanwhile leaves what is pinned readable
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
            state.agent, state.tenant = agent, tenant  # the tenant's: its prefix-cache partition follows it
            pinned = [b for src, *_ in sources for b in src.blocks]
            self._kv.pin(pinned)  # the sources may be released meanwhile: keep their K/V readable
        try:
            handle, prompted = self._life.run(
                state, self._placed(state, sources, offsets, mode, pool), register=True)
        finally:
            self._kv.unpin(pinned)
        assert handle is not None
        reports, margin, reused = prompted.segments, prompted.extra, prompted.reused
        return Composition(
            handle=handle,
            segments=reports,
            exact=state.exact_len is None,
            tokens_reused=reused,
            tokens_prefilled=state.num_tokens - reused,
            compose_s=time.perf_counter() - t0,
            margin=margin,
        )

    def _placed(
        self, state: KVState, sources: Sequence[tuple[KVState, int, int, str]], offsets: Sequence[int], mode: str,
        pool: AnchorPool,
    ) -> Program[Filled]:
        """The composition's program: each segment placed in turn, the rest computed, the confidence gate."""
        reports = []
        for i, ((src, start, end, slot), offset) in enumerate(zip(sources, offsets, strict=True)):
            reports.append((yield from self._placer.place(state, i, src, start, end, offset, mode, pool, slot)))
        logits = yield Compute(state.num_tokens)
        margin = None
        if state.exact_len is not None:
            if logits is None and mode in ("auto", "blend"):
                # The prompt ends inside an approximated segment: recompute its last token for the logits.
                state.num_cached -= 1
                logits = yield Compute(state.num_tokens)
            if logits is not None:
                margin = top2_margin(logits)
            cfg = pool.config
            threshold = cfg.blend_min_margin if mode == "blend" else cfg.min_margin
            if margin is not None and mode in ("auto", "blend") and margin < threshold:
                why = (f"low confidence: next-token margin {margin:.2f} < min_margin {threshold:g} "
                       "after approximation; ")
                reports = yield from self._placer.recompute_unsure(state, reports, state.exact_len, why)
        return Filled(logits, reports, extra=margin)

    def read_rows(self, handle: HandleLike, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a live handle's positions ``start..start+n-1``: ``[layers, kv_heads, n, head_dim]``."""
        with self._lock:
            return self._kv.read_rows(self._handles.get(handle), start, n)

    # -- merge ------------------------------------------------------------------------------------
    def merge(
        self, parts: Sequence[Segment | Handle], *, agent: str | None = None, tenant: str | None = None,
        mode: str = "auto", correction: CorrectionConfig | Mapping[str, Any] | None = None,
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
                # The longest handle, forked: its blocks shared, nothing computed.
                fork = self._kv.share(longest, longest.num_tokens, [], LineageStep(op=Op.FORK, parent=longest.id))
                self._handles.add(fork.id, fork)
                child = self._life.publish(fork)
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
        return self.compose(segments=segs, agent=agent, tenant=tenant, mode=mode, correction=correction)

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
            source = dense.id if dense is not None else ref.id  # type: ignore[union-attr]
            try:
                theirs = self._continuation(source, greedy)
                known = (theirs, torch.log_softmax(self.logits_along(source, theirs[:-1]), -1))
            finally:
                if dense is not None:
                    self._life.release(dense)
            if ref is not None:
                with self._lock:
                    self._references[(ref.id, max_tokens)] = known
                    while len(self._references) > _REFERENCES:
                        self._references.popitem(last=False)
        dense_tokens, p = known
        ours = self._continuation(handle, greedy)
        q = torch.log_softmax(self.logits_along(handle, dense_tokens[:-1]), dim=-1)
        kl = (p.exp() * (p - q)).sum(dim=-1).clamp_min(0.0)  # >= 0; identical distributions give float noise
        agree = common_prefix_length(ours, dense_tokens)
        return Fidelity(
            tokens=max_tokens,
            first_token_agrees=bool(ours[:1] == dense_tokens[:1]),
            greedy_agreement=agree / max_tokens,
            kl_mean=float(kl.mean()),
            kl_first=float(kl[0]),
            dense_token_ids=dense_tokens,
            handle_token_ids=ours,
        )

    def _continuation(self, handle: HandleLike, params: SamplingParams) -> list[int]:
        """The tokens a generation right after a live handle gives (as ``resume`` with no suffix; its
        result handle released)."""
        with self._lock:
            parent = self._handles.get(handle)
            self._inputs.check_context(parent.num_tokens, params.max_tokens)
            state = self._kv.share(parent, parent.num_tokens, [], LineageStep(op=Op.RESUME, parent=parent.id))
        result = self._life.stream(state, params).until_done()
        self._life.release(state)
        return result.token_ids

    def _dense_reference(self, tokens: list[int]) -> KVState:
        """A fresh dense prefill of ``tokens`` that neither reads nor feeds the prefix cache (registered:
        release it)."""
        state = self._kv.share(None, 0, tokens, LineageStep(op=Op.MATERIALIZE, token_ids=tuple(tokens)))
        state.cacheable = False
        self._life.run(state, compute_all(state), attach=False, register=True, count=False)
        return state

    def logits_along(self, handle: HandleLike, tokens: Sequence[int]) -> torch.Tensor:
        """Next-token logits after the handle and after each of ``tokens``: ``[len(tokens) + 1, vocab]``."""
        with self._lock:
            parent = self._handles.get(handle)
            last = parent.num_tokens - 1
            state = self._kv.share(parent, last, [parent.token_ids[last], *tokens], LineageStep(op=Op.RESUME))
            state.num_cached = min(state.num_cached, last)
        try:
            return self._life.logits_after_each(state)[-(len(tokens) + 1) :]
        finally:
            self._kv.drop(state)

    def score_prompt(self, prompt: Context, each: Callable[[torch.Tensor, list[int]], None]) -> list[int]:
        """A prompt's tokens; ``each(logits, targets)`` gets, in order, the logits after each token but the last
        and the tokens they predict (tokens 1..n-1), at most :data:`SCORE_CHUNK` rows at a time, from a dense
        prefill that neither reads nor feeds the prefix cache. Each chunk's K/V stays while the next is computed
        behind it; nothing is kept after."""
        tokens = self._inputs.tokens(prompt, what="prompt")
        with self._lock:
            self._inputs.check_context(len(tokens))
        states: list[KVState] = []
        try:
            for start in range(0, len(tokens), SCORE_CHUNK):
                chunk = tokens[start:start + SCORE_CHUNK]
                parent = states[-1] if states else None
                step = LineageStep(op=Op.EXTEND if parent else Op.MATERIALIZE, token_ids=tuple(chunk))
                with self._lock:
                    state = self._kv.share(parent, start, chunk, step)
                    state.cacheable = False
                states.append(state)
                logits = self._life.logits_after_each(state)
                targets = tokens[start + 1:start + len(chunk) + 1]
                each(logits[: len(targets)], targets)
        finally:
            for state in reversed(states):
                self._kv.drop(state)
        return tokens

    def next_token_logits(self, handle: HandleLike, suffix: Context = "") -> torch.Tensor:
        """fp32 next-token logits after ``handle`` + ``suffix``, computed on the reuse path (nothing kept)."""
        tokens = self._inputs.tokens(suffix, what="suffix", allow_empty=True)
        with self._lock:
            parent = self._handles.get(handle)
            self._inputs.check_context(parent.num_tokens + len(tokens))
            state = self._kv.share(parent, parent.num_tokens, tokens, LineageStep(op=Op.RESUME, parent=parent.id))
        try:
            self._life.run(state, compute_all(state), attach=False)
            assert state.last_logits is not None
            return state.last_logits.clone()
        finally:
            self._kv.drop(state)


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
