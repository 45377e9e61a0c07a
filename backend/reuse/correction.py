"""Correction of a shared segment's context deviation (KVCOMM / KVCMAS-style anchor pools).

The same segment behind two different prefixes has different K/V in every layer but the first: its
tokens attended to different context. For a segment that appears behind agent B's prefix, with a
*reference* K/V at hand (chained: the source agent A's exact cache of the segment; non-chained: the
segment prefilled on its own), the K/V behind B's prefix is estimated as

    reference + sum_i w_i * delta_i,   w = softmax(-(d_i / min_j d_j - 1) / temperature)

where each anchor i is an earlier segment of the same key (chained: the slot and the agent it was read
from, shared by every reader; non-chained: the slot and its reader) with its reference and the
observed ``delta_i = dense - reference``, and ``d_i`` is the distance between the new reference and
anchor i's. Layer 0 gets no delta: its K/V depend only on the token and its position.

The gate decides between correcting and prefilling densely: fewer than ``min_anchors`` anchors, a
best anchor farther than ``max_distance``, or weights whose normalized entropy exceeds
``entropy_threshold`` (no anchor clearly matches) mean dense prefill, whose exact result then becomes
a new anchor. The pool of each key is bounded; the least used of the oldest anchors leave first.

Anchors are stored as low-rank factors (``torch.svd_lowrank``, rank 32 by default: the deltas have an
effective rank well below the 192 dimensions of a layer's K or V), or full-dimensional for the KVCOMM
ablation. Everything here works on *canonical* tensors: one matrix ``[tokens, kv_heads * head_dim]``
per (layer >= 1, K or V), keys re-aligned to start at position 0, stacked as ``[matrices, tokens, dims]``.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Hashable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from kvbaton.errors import InvalidRequest

log = logging.getLogger(__name__)
Method = Literal["lowrank", "full"]
_DISTANCE_ROWS = 256  # token rows sampled to compare references: plenty to rank anchors, cheap at 4K tokens


@dataclass(frozen=True)
class CorrectionConfig:
    """Anchor-pool settings. ``chained=True`` uses the source agent's cache as the reference (KVCMAS);
    ``False`` prefills the segment on its own as reference (KVCOMM's context-free base)."""

    method: Method = "lowrank"
    chained: bool = True
    rank: int = 32
    pool_size: int = 10
    # Defaults measured on SmolLM2 with varied documents (docs/segments.md): deltas of different documents
    # agree only on average, so weights stay near uniform (the entropy gate is available but off) and
    # enough anchors must be averaged before the estimate beats plain re-alignment.
    min_anchors: int = 4
    entropy_threshold: float = 1.0
    temperature: float = 1.0
    max_distance: float = 0.75
    # Confidence gate, checked after the composition: when the next token's top-2 logit margin is
    # below this, an approximation could flip the answer, so the approximated part is recomputed
    # densely (0 turns it off). Measured in docs/results.md: flips happen at small margins.
    min_margin: float = 0.75
    # Selective recomputation (CacheBlend-style, works cold): after re-alignment, at least this share of a
    # segment's tokens — those whose layer-1 values deviate most from recomputation — is recomputed behind
    # the new prefix; ``reuse="auto"`` recomputes more where more deviate (``deviation_threshold``).
    # ``compose(mode="blend")`` recomputes exactly this share. 0 turns it off (auto then prefills such segments).
    blend_ratio: float = 0.10
    # reuse="auto" decides each span from its measured deviation (docs/segments.md, "The decision rule"): a
    # token whose layer-1 values moved by more than this (relative squared distance) from what the prompt's
    # own context gives is recomputed; a span with more than ``max_recompute`` of its tokens above it is
    # prefilled instead. Tuned on the workload family's tune split (the largest threshold that kept question
    # accuracy within 2 points of dense there), reported on its report split (docs/segments.md).
    deviation_threshold: float = 0.001
    max_recompute: float = 0.5
    # A span read this many tokens from where a prompt places it misses (or holds) too much context: prefilled
    # without measuring (plan.MAX_CONTEXT_GAP; the map-reduce reducer's stitched parts).
    max_context_gap: int = 256
    # The confidence gate after an explicit blend (compose(mode="blend")). Blending leaves the next-token
    # distribution much closer to dense than rotation or anchors, so a smaller margin is already safe.
    blend_min_margin: float = 0.25

    def __post_init__(self) -> None:
        if self.method not in ("lowrank", "full"):
            raise InvalidRequest(f"correction method must be 'lowrank' or 'full', got {self.method!r}")
        if self.rank < 1 or self.pool_size < 1 or self.min_anchors < 1:
            raise InvalidRequest("rank, pool_size and min_anchors must be positive")
        if not 0 <= self.entropy_threshold <= 1 or self.temperature <= 0 or self.max_distance <= 0:
            raise InvalidRequest("entropy_threshold must be in [0, 1]; temperature and max_distance > 0")
        if self.min_margin < 0:
            raise InvalidRequest("min_margin must be >= 0 (0 turns the confidence gate off)")
        if not 0 <= self.blend_ratio <= 1 or self.blend_min_margin < 0:
            raise InvalidRequest("blend_ratio must be in [0, 1] and blend_min_margin >= 0")
        if self.deviation_threshold < 0 or not 0 <= self.max_recompute <= 1 or self.max_context_gap < 0:
            raise InvalidRequest("deviation_threshold and max_context_gap must be >= 0, max_recompute in [0, 1]")


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


class Factors:
    """A stack of matrices ``[m, n, d]``, kept whole or as rank-``r`` factors ``left @ right^T``."""

    def __init__(self, x: torch.Tensor, rank: int | None) -> None:
        self.tokens = x.shape[1]
        if rank is None or rank >= min(x.shape[1], x.shape[2]):
            self.full: torch.Tensor | None = x.clone()
            self.left = self.right = None
        else:
            # Truncated SVD through the small side: the top eigenvectors of the d x d Gram matrix are
            # the right singular vectors. One bmm and a batched eigh: several times faster on CPU than
            # torch.svd_lowrank's QR iterations on [tokens, rank] panels, and exact (not randomized).
            xf = x.float()
            _, vecs = torch.linalg.eigh(torch.bmm(xf.transpose(1, 2), xf))
            v = vecs[:, :, -rank:]  # eigh sorts ascending
            self.full = None
            self.left = torch.bmm(xf, v).to(x.dtype)  # [m, n, r] = U * S
            self.right = v.to(x.dtype)  # [m, d, r]

    def rows(self, index: torch.Tensor | slice) -> torch.Tensor:
        """The reconstructed rows ``index`` of every matrix: ``[m, len(index), d]``."""
        if self.full is not None:
            return self.full[:, index]
        assert self.left is not None and self.right is not None
        return torch.bmm(self.left[:, index], self.right.transpose(1, 2))

    @property
    def nbytes(self) -> int:
        parts = [self.full] if self.full is not None else [self.left, self.right]
        return sum(p.numel() * p.element_size() for p in parts if p is not None)


@dataclass(eq=False)
class Anchor:
    reference: Factors
    delta: Factors
    serial: int
    uses: int = 0

    @property
    def tokens(self) -> int:
        return self.reference.tokens

    @property
    def nbytes(self) -> int:
        return self.reference.nbytes + self.delta.nbytes


@dataclass
class Estimate:
    """The gate's decision for one segment: ``delta`` covers its first ``tokens`` tokens, or is None."""

    delta: torch.Tensor | None
    tokens: int
    anchors: int
    entropy: float | None
    reason: str


@dataclass
class AnchorPool:
    """Bounded anchor pools, one per key (chained: slot and source agent; non-chained: slot and reader)."""

    config: CorrectionConfig = field(default_factory=CorrectionConfig)
    _pools: dict[Hashable, list[Anchor]] = field(default_factory=dict)
    _serial: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _worker: ThreadPoolExecutor | None = None
    _pending: list[Future[None]] = field(default_factory=list)

    def estimate(self, key: Hashable, reference: torch.Tensor) -> Estimate:
        """Decide whether to correct a segment with canonical ``reference`` ``[m, n, d]``."""
        cfg = self.config
        with self._lock:
            anchors = list(self._pools.get(key, ()))
        if len(anchors) < cfg.min_anchors:
            return Estimate(None, 0, len(anchors), None, f"{len(anchors)} anchor(s) for this slot and source, "
                            f"{cfg.min_anchors} needed")
        n = reference.shape[1]
        dist = torch.tensor([_distance(reference, a) for a in anchors], dtype=torch.float64)
        best = float(dist.min())
        if best > cfg.max_distance:
            return Estimate(None, 0, len(anchors), None,
                            f"nearest anchor too far (relative distance {best:.3f} > {cfg.max_distance})")
        weights = torch.softmax(-(dist / max(best, 1e-12) - 1.0) / cfg.temperature, dim=0)
        entropy = _normalized_entropy(weights)
        if entropy > cfg.entropy_threshold:
            return Estimate(None, 0, len(anchors), entropy,
                            f"ambiguous anchors (weight entropy {entropy:.2f} > {cfg.entropy_threshold})")
        picked = [(float(w), a) for w, a in zip(weights, anchors, strict=True) if w >= 0.01]
        total = sum(w for w, _ in picked)
        covered = min(n, *(a.tokens for _, a in picked))
        delta = torch.zeros_like(reference[:, :covered])
        for w, anchor in picked:
            delta += (w / total) * anchor.delta.rows(slice(0, covered)).to(delta.dtype)
            anchor.uses += 1
        return Estimate(delta, covered, len(anchors), entropy, f"{len(picked)} anchor(s), weight entropy {entropy:.2f}")

    def add(self, key: Hashable, reference: torch.Tensor, exact: torch.Tensor, *, wait: bool = False) -> None:
        """Store a densely computed segment as a new anchor of ``key`` (canonical tensors).

        The factorization runs on a background thread, off the request's path (as in KVCMAS, anchor
        construction is not part of the generating hop's TTFT); ``flush()`` waits for it.
        """
        with self._lock:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbaton-anchors")
            future = self._worker.submit(self._build, key, reference, exact)
            future.add_done_callback(_log_failure)
            self._pending = [f for f in self._pending if not f.done()] + [future]
        if wait:
            future.result()

    def flush(self) -> None:
        """Wait until every anchor handed to :meth:`add` is in its pool."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True, cancel_futures=True)

    def _build(self, key: Hashable, reference: torch.Tensor, exact: torch.Tensor) -> None:
        cfg = self.config
        rank = cfg.rank if cfg.method == "lowrank" else None
        anchor_ref = Factors(reference, rank)
        anchor_delta = Factors(exact - reference, rank)
        with self._lock:
            self._serial += 1
            pool = self._pools.setdefault(key, [])
            pool.append(Anchor(anchor_ref, anchor_delta, self._serial))
            if len(pool) > cfg.pool_size:
                # The least used among the older half leaves: new anchors get a chance to prove useful.
                older = sorted(pool, key=lambda a: a.serial)[: max(1, len(pool) // 2)]
                pool.remove(min(older, key=lambda a: (a.uses, a.serial)))

    def anchors(self, key: Hashable) -> int:
        with self._lock:
            return len(self._pools.get(key, ()))

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for pool in self._pools.values() for a in pool)

    @property
    def num_anchors(self) -> int:
        with self._lock:
            return sum(len(pool) for pool in self._pools.values())

    def clear(self) -> None:
        with self._lock:
            self._pools.clear()


def _log_failure(future: Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("building a correction anchor failed; the pool goes on without it", exc_info=future.exception())


def _distance(reference: torch.Tensor, anchor: Anchor) -> float:
    """Relative squared distance between two references over their common tokens (sampled rows)."""
    m = min(reference.shape[1], anchor.tokens)
    step = max(1, m // _DISTANCE_ROWS)
    rows = torch.arange(0, m, step, device=reference.device)
    ours = reference[:, rows].float()
    theirs = anchor.reference.rows(rows).float()
    return float((ours - theirs).pow(2).sum() / ours.pow(2).sum().clamp_min(1e-12))


def _normalized_entropy(weights: torch.Tensor) -> float:
    if len(weights) < 2:
        return 0.0
    w = weights.clamp_min(1e-30)
    return float(-(w * w.log()).sum() / math.log(len(weights)))


def to_canonical(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Layers 1.. of K and V (``[layers, kv_heads, tokens, head_dim]``) as ``[2*(layers-1), tokens, dims]``."""
    def flat(x: torch.Tensor) -> torch.Tensor:
        layers, heads, tokens, dim = x[1:].shape
        return x[1:].permute(0, 2, 1, 3).reshape(layers, tokens, heads * dim)

    return torch.cat((flat(k), flat(v)), dim=0).float()


def from_canonical(c: torch.Tensor, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`to_canonical`: K and V of layers 1.. as ``[layers-1, kv_heads, tokens, head_dim]``."""
    layers = c.shape[0] // 2
    tokens = c.shape[1]
    x = c.reshape(2, layers, tokens, heads, dim).permute(0, 1, 3, 2, 4)
    return x[0], x[1]
