"""Transfer-or-recompute: the cost rule for bringing a handle to another worker.

Calibrated at startup from real measurements (cached in a JSON file keyed by model, devices and
bandwidth cap): the link's latency and bandwidth between workers, and each worker's prefill time
as ``fixed + per_token * L``. For a handle of ``L`` tokens whose K/V take ``bytes``::

    transfer   = latency + bytes / bandwidth + resume_overhead
    recompute  = prefill(L) on the destination

and the cheaper one is chosen (AAFLOW+'s rule). Every decision is kept with its predicted times
and the time it actually took, and reported in the cluster stats.

The prefill line is a least-squares fit (:func:`fit_line`) over probes of a spread of prompt
lengths (``PREFILL_PROBE_TOKENS``): two short probes under-predict long prompts, whose attention
grows faster than linearly. :meth:`CostModel.observe_prefill` refits it online from observed
prefills (the last ``MAX_OBSERVED`` per worker, once they span ``MIN_SPAN`` x in length), so the
line follows the lengths a workload really has. :func:`prediction_error` is how predictions are
scored (benchmarks report it).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvbaton.types import PlacementDecision

log = logging.getLogger(__name__)

MAX_DECISIONS = 256
CACHE_MAX_AGE_S = 7 * 24 * 3600
# Probe lengths for calibrating a worker's prefill line: a spread up to a long prompt.
PREFILL_PROBE_TOKENS = (32, 128, 512, 1024)
MAX_OBSERVED = 64
MIN_OBSERVED = 4
MIN_SPAN = 4.0  # longest / shortest observed prompt before the observations alone define the line


@dataclass
class Calibration:
    latency_s: float
    bandwidth_bytes_per_s: float
    resume_overhead_s: float
    prefill_fixed_s: dict[int, float] = field(default_factory=dict)  # per worker rank
    prefill_per_token_s: dict[int, float] = field(default_factory=dict)
    measured_at: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Calibration:
        out = cls(**data)  # type: ignore[arg-type]
        # JSON object keys are strings; ranks are ints.
        out.prefill_fixed_s = {int(k): float(v) for k, v in out.prefill_fixed_s.items()}
        out.prefill_per_token_s = {int(k): float(v) for k, v in out.prefill_per_token_s.items()}
        return out


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` through (x, y) points, with ``a, b >= 0``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    b = max(b, 0.0)
    return max(my - b * mx, 0.0), b


def prediction_error(predicted: float | None, actual: float) -> float | None:
    """Relative error of a prediction, ``predicted / actual - 1`` (-0.5: predicted half the time);
    None when nothing was predicted or nothing measurable took place."""
    if predicted is None or actual <= 0:
        return None
    return predicted / actual - 1.0


class CostModel:
    """Predictions from a :class:`Calibration`, and the log of decisions taken with them."""

    def __init__(self, calibration: Calibration | None = None) -> None:
        self.calibration = calibration
        self._lock = threading.Lock()
        self.decisions: deque[PlacementDecision] = deque(maxlen=MAX_DECISIONS)
        self.transfers = 0
        self.recomputes = 0
        self._observed: dict[int, deque[tuple[float, float]]] = {}

    def observe_prefill(self, rank: int, tokens: int, seconds: float) -> bool:
        """Record one measured prefill of ``tokens`` new tokens on worker ``rank``; once the
        observations span enough lengths, refit that worker's prefill line from them. True when the
        line was refitted. (Callers pass the tokens really prefilled: cached ones excluded.)"""
        if tokens <= 0 or seconds <= 0:
            return False
        with self._lock:
            points = self._observed.setdefault(rank, deque(maxlen=MAX_OBSERVED))
            points.append((float(tokens), seconds))
            lengths = [x for x, _ in points]
            c = self.calibration
            if c is None or len(points) < MIN_OBSERVED or max(lengths) < MIN_SPAN * min(lengths):
                return False
            c.prefill_fixed_s[rank], c.prefill_per_token_s[rank] = fit_line(list(points))
            return True

    def predict_transfer(self, nbytes: int) -> float | None:
        c = self.calibration
        if c is None:
            return None
        return c.latency_s + nbytes / c.bandwidth_bytes_per_s + c.resume_overhead_s

    def predict_recompute(self, rank: int, tokens: int) -> float:
        c = self.calibration
        if c is None or rank not in c.prefill_per_token_s:
            return float("inf") if tokens else 0.0
        return c.prefill_fixed_s[rank] + c.prefill_per_token_s[rank] * tokens

    def choose(self, dst: int, tokens: int, nbytes: int, cached: int = 0) -> tuple[str, float | None, float]:
        """``("transfer" | "recompute", predicted transfer s, predicted recompute s)``; ``cached``
        leading tokens are already in the destination's prefix cache (a recompute skips them)."""
        transfer = self.predict_transfer(nbytes)
        recompute = self.predict_recompute(dst, max(0, tokens - cached))
        if transfer is None:  # not calibrated: moving bytes is the safe default
            return "transfer", None, recompute
        return ("transfer" if transfer < recompute else "recompute"), transfer, recompute

    def record(self, decision: PlacementDecision) -> None:
        with self._lock:
            self.decisions.append(decision)
            if decision.choice == "transfer":
                self.transfers += 1
            else:
                self.recomputes += 1
        log.info(
            "placement %s: handle %s worker %s -> %d, %d tokens, predicted transfer %s s / recompute %.4f s, took %.4f s",
            decision.choice, decision.handle[:8], decision.src, decision.dst, decision.tokens,
            "n/a" if decision.predicted_transfer_s is None else f"{decision.predicted_transfer_s:.4f}",
            decision.predicted_recompute_s, decision.actual_s,
        )


# -- the calibration cache ------------------------------------------------------------------------


def load_cached(path: Path | None, key: str) -> Calibration | None:
    if path is None or not path.exists():
        return None
    try:
        entry = json.loads(path.read_text()).get(key)
        if entry is None:
            return None
        cal = Calibration.from_json(entry)
    except (OSError, ValueError, TypeError) as exc:
        log.warning("ignoring unreadable calibration cache %s: %s", path, exc)
        return None
    if time.time() - cal.measured_at > CACHE_MAX_AGE_S:
        return None
    return cal


def store_cached(path: Path | None, key: str, calibration: Calibration) -> None:
    if path is None:
        return
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        data = {}
    data[key] = calibration.to_json()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as exc:
        log.warning("cannot write the calibration cache %s: %s", path, exc)
