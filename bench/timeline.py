"""A workflow's timeline as a PNG (matplotlib, headless): one lane per agent, one bar per request
phase, from the engine's request events (``client.events()``), with runs side by side on one time
scale (``kvbaton run debate --plot out.png``: kvbaton and the text baseline).

The bars are those of the dashboard (docs/dashboard.md): queued/admission in grey, the prefill
split by where its prompt came from (reused exactly, reused approximately, prefilled), decode in
blue; seconds from each run's first request on the x axis.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: files only

import matplotlib.pyplot as plt
from kvbaton.types import Event
from matplotlib.patches import Patch

COLORS = {"queued": "#c9ced8", "exact": "#2e9e5b", "approximate": "#7bc8a4", "prefilled": "#f08c3a",
          "decode": "#4c8bf5"}
LABELS = {"queued": "queued / admission", "exact": "prefill: reused exactly",
          "approximate": "prefill: reused approximately", "prefilled": "prefill: prefilled", "decode": "decode"}


def lanes(runs: Mapping[str, Sequence[Event]]) -> list[str]:
    """The agents of every run, in order of first appearance."""
    out: list[str] = []
    for events in runs.values():
        for e in sorted(_requests(events), key=lambda e: e.t_queued or 0.0):
            if _lane(e) not in out:
                out.append(_lane(e))
    return out


def plot_timeline(runs: Mapping[str, Sequence[Event]], path: str | Path, title: str = "") -> Path:
    """Write the runs' timelines side by side (same lanes, same time scale) to ``path``."""
    names = lanes(runs)
    if not names:
        raise ValueError("no request events to plot")
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 1.2 + 0.45 * len(names)), sharey=True,
                             sharex=True, squeeze=False)
    drawn: set[str] = set()
    # A phase shorter than this is not visible at the figure's size (a few pixels of the shared time axis).
    visible = 0.004 * max(_span(_requests(events)) for events in runs.values())
    for ax, (label, events) in zip(axes[0], runs.items(), strict=True):
        requests = _requests(events)
        t0 = min((e.t_queued for e in requests if e.t_queued is not None), default=0.0)
        end = _span(requests)
        for e in requests:
            drawn |= _bars(ax, names.index(_lane(e)), e, t0, visible)
        reused = sum(e.tokens_reused for e in requests)
        prompt = reused + sum(e.tokens_prefilled for e in requests)
        ax.set_title(f"{label}: {end:.1f} s, {len(requests)} calls, "
                     f"{reused / prompt if prompt else 0:.0%} of prompt tokens reused", fontsize=10)
        ax.set_xlabel("seconds since the run's first request")
        ax.grid(axis="x", color="#eceef2")
        ax.set_axisbelow(True)
    axes[0][0].set_yticks(range(len(names)), names)
    axes[0][0].set_ylim(len(names) - 0.5, -0.5)
    shown = [k for k in COLORS if k in drawn]  # the legend names only what the bars show
    fig.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in shown], loc="lower center",
               ncol=max(1, len(shown)), frameon=False, fontsize=9)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08 if len(names) > 3 else 0.14, 1, 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _requests(events: Sequence[Event]) -> list[Event]:
    return [e for e in events if e.kind == "request" and e.t_queued is not None and e.t_done is not None]


def _span(requests: Sequence[Event]) -> float:
    """Seconds from the first request's submission to the last one's end."""
    starts = [e.t_queued for e in requests if e.t_queued is not None]
    ends = [e.t_done for e in requests if e.t_done is not None]
    return max(ends) - min(starts) if starts and ends else 0.0


def _lane(e: Event) -> str:
    return e.agent or "(no agent)"


def _bars(ax: Any, lane: int, e: Event, t0: float, visible: float = 0.0) -> set[str]:
    """One request's phases in its lane; the prefill bar's height is split by where its prompt came
    from. Returns the kinds (``COLORS`` keys) it drew (a thin queue bar, one shorter than ``visible``
    seconds, is drawn but not counted: the legend would name a color no one can see)."""
    assert e.t_queued is not None and e.t_done is not None
    admitted = e.t_admitted if e.t_admitted is not None else e.t_queued
    first = e.t_first_token if e.t_first_token is not None else e.t_done
    drawn = set()
    ax.barh(lane, admitted - e.t_queued, left=e.t_queued - t0, height=0.15, color=COLORS["queued"])
    if admitted - e.t_queued >= max(visible, 1e-9):
        drawn.add("queued")
    prompt = e.tokens_reused + e.tokens_prefilled
    bottom = lane - 0.35
    for kind, n in (("exact", e.tokens_reused - e.tokens_approximate), ("approximate", e.tokens_approximate),
                    ("prefilled", e.tokens_prefilled)):
        if prompt and n > 0:
            h = 0.7 * n / prompt
            ax.barh(bottom + h / 2, first - admitted, left=admitted - t0, height=h, color=COLORS[kind])
            drawn.add(kind)
            bottom += h
    if e.t_first_token is not None:
        ax.barh(lane, e.t_done - first, left=first - t0, height=0.5, color=COLORS["decode"])
        drawn.add("decode")
    return drawn
