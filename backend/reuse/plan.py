"""Reuse as a plan: what a prompt's found spans become, decided by pure functions, and what it needs computed.

Cross-prefix reuse decides, for each span the span index found in a prompt, whether it is placed (copied
exactly, re-aligned, blended) or prefilled, and why (:func:`plan_spans`); which of a blended span's tokens
are recomputed (:func:`most_deviating`); and whether an approximated answer is kept (:func:`margin_verdict`).
These are pure: given the same inputs they give the same :class:`Plan`, and they run nothing.

Running a plan needs the model. The placement programs (:mod:`.place`, :mod:`.compose`) are generators that
*yield* what they need — :class:`Compute` (the request's positions up to ``until``), :class:`Deviation`
(the re-aligned K/V's distance from their real context), :class:`Alone` (K/V of tokens prefilled on their
own) — and receive the result. The scheduler runs each need as ordinary work of its loop (prefill chunks
packed with other requests' rows, under the step's token budget); a program never calls the runtime.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from kvbaton.types import SegmentReport

from ..cache.sequence import KVState
from .spans import SpanMatch

T = TypeVar("T")

# Automatic reuse places a span only where its source read it at about the same position: a span read
# ``start`` tokens into its source and placed ``offset`` tokens into a prompt differs from it in at least
# ``|offset - start|`` of the tokens it attends to. Beyond this many, its K/V miss (or hold) too much context:
# a map-reduce reducer whose document is stitched from four parts, each read behind only a persona, took
# another first token than dense prefill in 8 of 8 documents with the parts re-aligned (and blended at 10%),
# sometimes with a margin the gate let through; persona swaps (tens of tokens) stay far below it.
MAX_CONTEXT_GAP = 256
# -- what a program needs computed ------------------------------------------------------------------
@dataclass(frozen=True)
class Compute:
    """Compute the request's positions up to ``until`` (its stale positions first); sent back: the next-token
    logits after position ``until - 1`` (None when the last computed token was a stale one), or with
    ``all_logits`` the logits after each newly computed token ``[n, vocab]``."""

    until: int
    all_logits: bool = False


@dataclass(frozen=True)
class Deviation:
    """Sent back: ``[n]``, how far the placed K/V at positions ``start..start+n-1`` are from what the
    request's real context gives them (``ModelRunner.deviation``)."""

    start: int
    n: int


@dataclass(frozen=True)
class Alone:
    """Sent back: ``(k, v)`` of ``tokens`` prefilled on their own from position 0 (a context-free reference)."""

    tokens: tuple[int, ...]


Need = Compute | Deviation | Alone
Program = Generator[Need, Any, T]


@dataclass(frozen=True)
class Filled:
    """What a request's prompt program did: the next-token logits, the spans placed, the work the confidence
    gate threw away (token-forwards; a pass over the first layers counts as its share of the layers), and
    anything else its caller asked for (``extra``)."""

    logits: torch.Tensor | None
    segments: list[SegmentReport] = field(default_factory=list)
    discarded: int = 0
    extra: Any = None


def compute_all(state: KVState) -> Program[Filled]:
    """The plain prompt program: every uncached token computed densely."""
    logits = yield Compute(state.num_tokens)
    return Filled(logits)


# -- the decisions ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """The spans a prompt places (``place``, ascending) and those it prefills with the reason (``prefill``);
    ``blend``: each placed span's fate is decided from its measured deviation (:func:`blend_decision`)."""

    place: tuple[SpanMatch, ...]
    prefill: tuple[tuple[SpanMatch, str], ...]
    blend: bool


def context_gap(span: SpanMatch) -> int:
    """At least this many of the tokens a span attends to differ between its source and the prompt."""
    return abs(span.offset - span.start)


def plan_spans(found: Sequence[SpanMatch], policy: str, blend: bool, max_gap: int = MAX_CONTEXT_GAP) -> Plan:
    """The plan of automatic reuse (``policy`` ``"auto"``, ``"rotate"`` or ``"correct"``; ``blend``: selective
    recomputation is on) for the spans ``found`` in a prompt: a span placed farther than ``max_gap`` tokens
    from where its source read it is prefilled (its K/V miss too much of the context they are used in); under
    ``"auto"`` with blending, every other span is decided after its deviation is measured."""
    near = tuple(m for m in found if context_gap(m) <= max_gap)
    prefill = tuple((m, _far(m, max_gap)) for m in found if context_gap(m) > max_gap)
    return Plan(near, prefill, policy == "auto" and blend and bool(near))


def _far(span: SpanMatch, max_gap: int) -> str:
    return (f"read {span.start} tokens into its source and {span.offset} here: at least {context_gap(span)} tokens "
            f"of the context it attends to differ (more than {max_gap}), so it was prefilled")


def blend_decision(deviation: torch.Tensor, offset: int, ratio: float, threshold: float,
                   max_share: float) -> tuple[list[int] | None, str]:
    """What selective recomputation does with one re-aligned span, from the cause: how far its tokens' layer-1
    values moved from what the prompt's own context gives them (``deviation``, one per token, the span at
    ``offset``). Every token above ``threshold`` is recomputed, and at least the ``ratio`` share that deviates
    most (an adaptive share, as CacheBlend's selection); a span with more than ``max_share`` of its tokens above
    the threshold missed too much of its new context for recomputation to fix cheaply and is prefilled
    (None). Decided before any of the prompt is computed, so a prefilled span costs its prefill and the
    deviation pass (two of the model's layers), nothing thrown away. The reason says which and why."""
    n = len(deviation)
    over = int((deviation > threshold).sum())
    if over > max_share * n:
        return None, (f"{over} of its {n} tokens' layer-1 values deviate by more than {threshold:g} from its new "
                      f"context (more than {max_share:.0%}): too much to recompute selectively, so it was prefilled")
    picked = most_deviating(deviation, max(ratio, over / n if n else 0.0), offset)
    return picked, (f"keys re-aligned to the new positions; the {len(picked)} of {n} tokens whose layer-1 values "
                    f"deviated most ({over} above {threshold:g}) were recomputed behind the new prefix")


def most_deviating(deviation: torch.Tensor, ratio: float, offset: int) -> list[int]:
    """Positions (ascending, from ``offset``) of the ``ratio`` share, at least one, of a placed segment's
    tokens whose deviation is largest: the ones selective recomputation recomputes."""
    m = min(len(deviation), max(1, math.ceil(ratio * len(deviation))))
    return sorted((torch.topk(deviation, m).indices + offset).tolist())


def top2_margin(logits: torch.Tensor) -> float:
    """Top-1 minus top-2 logit: how close the next greedy token is to flipping."""
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def margin_verdict(logits: torch.Tensor, threshold: float, stage: str) -> str | None:
    """Why an approximated answer is rejected (None: kept): its next-token margin is below ``threshold``."""
    margin = top2_margin(logits)
    if margin < threshold:
        return f"next-token margin {margin:.2f} < {stage} {threshold:g}"
    return None
