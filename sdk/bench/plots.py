"""PNG plots of benchmark results (matplotlib, headless).

``plot(payload, path)`` draws one benchmark's JSON payload: a dedicated figure for the benchmarks
known here, else a generic one (every numeric column of ``payload["rows"]`` against the first), so
that benchmarks registered later get a plot too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: files only

import matplotlib.pyplot as plt

MIB = 1024 * 1024
Figure = Any


def _lines(ax: Any, xs: list[Any], series: dict[str, list[float]], xlabel: str, ylabel: str, log: bool = False) -> None:
    for label, ys in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()


def _ttft(payload: dict[str, Any], fig: Figure) -> None:
    rows = payload["rows"]
    xs = [r["context_tokens"] for r in rows]
    ax = fig.add_subplot(1, 1, 1)
    series = {"(a) text replay": [r["replay_s"] for r in rows], "(b) resume handle": [r["resume_s"] for r in rows],
              "(c) question-only floor": [r["floor_s"] for r in rows]}
    _lines(ax, xs, series, "context tokens", "TTFT (s)", log=True)
    ax.set_title("TTFT vs context length")


def _scaling(payload: dict[str, Any], fig: Figure) -> None:
    rows = payload["rows"]
    xs = [r["agents"] for r in rows]
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    _lines(left, xs, {"text replay": [r["text_wall_s"] for r in rows],
                      "handles": [r["handles_wall_s"] for r in rows]}, "agents (k)", "round wall time (s)")
    left.set_title(f"k agents on one {payload['context_tokens']}-token context")
    _lines(right, xs, {"text replay": [r["text_peak_kv_bytes"] / MIB for r in rows],
                       "handles": [r["handles_peak_kv_bytes"] / MIB for r in rows]}, "agents (k)", "KV held (MiB)")
    right.set_title("KV held when all agents answered")


def _branching(payload: dict[str, Any], fig: Figure) -> None:
    rows = payload["rows"]
    xs = [r["branches"] for r in rows]
    ax = fig.add_subplot(1, 1, 1)
    bpb = (rows[0]["forks_kv_bytes"] / rows[0]["forks_kv_blocks"]) if rows and rows[0]["forks_kv_blocks"] else 0
    series = {"copies (text passing)": [r["copies_kv_bytes"] / MIB for r in rows],
              "forks (handles)": [r["forks_kv_bytes"] / MIB for r in rows]}
    if bpb:
        series["forks, ideal"] = [r["forks_ideal_blocks"] * bpb / MIB for r in rows]
    _lines(ax, xs, series, "branch factor b", "peak KV (MiB)")
    ax.set_title(f"Peak KV vs branch factor (depth {payload.get('depth', '?')})")


def _workflow(payload: dict[str, Any], fig: Figure) -> None:
    rows = payload["rows"]
    ax = fig.add_subplot(1, 1, 1)
    ax.barh([f"({r['variant']}) {r['label']}" for r in rows], [r["end_to_end_s"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("end-to-end time (s)")
    ax.set_title(f"{payload.get('agents', '?')}-agent workflow, tight KV budget", fontsize=10)


def _adapter_overhead(payload: dict[str, Any], fig: Figure) -> None:
    per_call = payload.get("ms_per_call")
    if not isinstance(per_call, dict):
        _generic(payload, fig)
        return
    ax = fig.add_subplot(1, 1, 1)
    ax.bar(list(per_call), list(per_call.values()))
    ax.set_ylabel("ms per LLM call")
    ax.set_title("LangGraph framework overhead per LLM call (no model time)")


def _serve(payload: dict[str, Any], fig: Figure) -> None:
    rows = payload["rows"]
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for reuse in ("on", "off"):
        mine = [r for r in rows if r["reuse"] == reuse]
        xs = [r["clients"] for r in mine]
        label = "handle reuse" if reuse == "on" else "text replay"
        left.plot(xs, [r["requests_per_s"] for r in mine], marker="o", label=label)
        right.plot(xs, [r["ttft_p50_s"] for r in mine], marker="o", label=label)
    for ax, ylabel in ((left, "requests / s"), (right, "TTFT p50 (s)")):
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    left.set_title("kvbaton serve throughput")
    right.set_title("kvbaton serve TTFT")


def _engine(payload: dict[str, Any], fig: Figure) -> None:
    rows = [r for r in payload["rows"] if _numeric(r.get("ratio"))]
    ax = fig.add_subplot(1, 1, 1)
    ax.barh([f"{r['dtype']} {r['metric']}" for r in rows], [r["ratio"] for r in rows])
    ax.axvline(1.0, color="gray", linestyle="--")
    ax.invert_yaxis()
    ax.set_xlabel("kvbaton / plain transformers (higher is better)")
    ax.set_title("Engine speed vs plain transformers")


def _transfer(payload: dict[str, Any], fig: Figure) -> None:
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    cross = payload.get("crossover") or []
    caps = list(dict.fromkeys(r.get("bandwidth_cap_bytes_per_s") for r in cross))
    for cap in caps:
        mine = [r for r in cross if r.get("bandwidth_cap_bytes_per_s") == cap]
        label = "link" if cap is None else f"cap {cap:.0e} B/s"
        xs = [r["context_tokens"] for r in mine]
        left.plot(xs, [r["transfer_s"] for r in mine], marker="o", label=f"transfer, {label}")
    recompute = {r["context_tokens"]: r["recompute_s"] for r in cross}
    if recompute:
        left.plot(list(recompute), list(recompute.values()), marker="s", color="black", label="recompute")
    left.set_xlabel("context tokens")
    left.set_ylabel("seconds")
    left.set_yscale("log")
    left.grid(True, alpha=0.3)
    left.legend(fontsize=7)
    left.set_title("KV transfer vs recompute")
    fork = payload.get("fork") or []
    _lines(right, [r["k"] for r in fork], {"handles (fork across workers)": [r["handles_s"] for r in fork],
                                          "text replay": [r["replay_s"] for r in fork]}, "branches k", "wall time (s)")
    right.set_title("Fork across workers vs replay")


def _correction(payload: dict[str, Any], fig: Figure) -> None:
    rows = payload["rows"]
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        xs = [r["shared_tokens"] for r in mine]
        left.plot(xs, [r["ttft_mean_s"] for r in mine], marker="o", label=method)
        right.plot(xs, [100 * r["first_token_agreement"] for r in mine], marker="o", label=method)
    right.axhline(95, color="grey", linestyle="--", linewidth=1, label="target 95%")
    for ax, ylabel in ((left, "TTFT mean (s)"), (right, "first token agreeing with dense (%)")):
        ax.set_xlabel("shared segment tokens")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    left.set_title("Segment reuse behind a different prefix: speed")
    right.set_title("... and fidelity")


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _generic(payload: dict[str, Any], fig: Figure) -> None:
    """Every numeric column of ``rows`` against the first column (bars when it is not numeric)."""
    rows = [r for r in payload.get("rows", []) if isinstance(r, dict)]
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(str(payload.get("benchmark", "benchmark")))
    if not rows:
        ax.text(0.5, 0.5, "no rows to plot", ha="center", va="center")
        return
    keys = list(rows[0])
    x_key = keys[0]
    ys = [k for k in keys[1:] if all(_numeric(r.get(k)) for r in rows)]
    xs = [r.get(x_key) for r in rows]
    if all(_numeric(x) for x in xs):
        _lines(ax, xs, {k: [r[k] for r in rows] for k in ys[:8]}, x_key, "value")
    else:
        width = 0.8 / max(len(ys[:4]), 1)
        for i, k in enumerate(ys[:4]):
            ax.bar([j + i * width for j in range(len(rows))], [r[k] for r in rows], width, label=k)
        ax.set_xticks(range(len(rows)), [str(x) for x in xs], rotation=20, ha="right")
        ax.legend()


PLOTTERS: dict[str, Callable[[dict[str, Any], Figure], None]] = {
    "ttft": _ttft,
    "scaling": _scaling,
    "branching": _branching,
    "workflow": _workflow,
    "adapter_overhead": _adapter_overhead,
    "serve": _serve,
    "engine": _engine,
    "transfer": _transfer,
    "correction": _correction,
}


def plot(payload: dict[str, Any], path: str | Path) -> Path:
    """Draw ``payload`` (a benchmark's JSON) to the PNG ``path``."""
    name = str(payload.get("benchmark", ""))
    wide = name in ("scaling", "serve", "transfer", "correction", "workflow")
    fig = plt.figure(figsize=(11 if wide else 7, 4.5))
    try:
        PLOTTERS.get(name, _generic)(payload, fig)
        machine = payload.get("machine") or {}
        if machine:
            fig.text(0.01, 0.01, f"{machine.get('cpu', '')}, {machine.get('date', '')}", fontsize=7, alpha=0.6)
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
        return out
    finally:
        plt.close(fig)
