"""PNG plots of benchmark results (matplotlib, headless).

``plot(payload, path)`` draws one benchmark's record: a dedicated figure for the benchmarks known
here, else a generic one (every numeric column of ``payload["rows"]`` against the first), so that
benchmarks registered later get a plot too. Conventions: measured values are medians with the
[min–max] spread of the repeats as error bars; count axes (agents, branches, clients) have integer
ticks; tick labels carry units; reference lines ("ideal", targets) are dashed and drawn beneath.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: files only

import matplotlib.pyplot as plt
from kvbaton.bench.common import rate
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

MIB = 1024 * 1024
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
LINESTYLES = ("-", "--", "-.", ":")
Figure = Any
Series = dict[str, tuple[list[float], Any]]  # label -> (medians, error bars or None)


def _spread(rows: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list[float], Any]:
    """Medians of ``key`` and matplotlib's asymmetric error bars from each row's [min, max] (None
    when no row has repeats of it)."""
    ys = [float(r[key]) * scale for r in rows]
    pairs = [(r.get("spread") or {}).get(key) for r in rows]
    if not any(pairs):
        return ys, None
    low = [y - (p[0] * scale if p else y) for y, p in zip(ys, pairs)]
    high = [(p[1] * scale if p else y) - y for y, p in zip(ys, pairs)]
    return ys, [low, high]


def _unit_axis(axis: Any, unit: str, log: bool) -> None:
    """Plain numbers with their unit on the ticks (``2 s``, not ``2×10^0``)."""
    fmt = FuncFormatter(lambda v, _pos: f"{v:g} {unit}".rstrip())
    if log:
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_minor_formatter(NullFormatter())
    axis.set_major_formatter(fmt)


def _count_axis(ax: Any, xs: list[Any]) -> None:
    """A count axis (agents, branches, clients): integer ticks, every measured count labelled."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if all(isinstance(x, int) for x in xs) and len(xs) <= 12:
        if len(xs) > 2 and min(xs) > 0 and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.xaxis.set_minor_formatter(NullFormatter())


def _lines(ax: Any, xs: list[Any], series: Series, xlabel: str, ylabel: str, log: bool = False,
           unit: str = "", counts: bool = False, ideal: dict[str, list[float]] | None = None) -> None:
    """Measured series (median, [min–max] error bars) over dashed, grey "ideal" lines drawn beneath."""
    for label, ys in (ideal or {}).items():
        ax.plot(xs, ys, linestyle="--", color="grey", linewidth=1.2, zorder=1, label=label)
    for i, (label, (ys, err)) in enumerate(series.items()):
        # A marker and line style per series: where two coincide (equal peak KV), both stay visible.
        ax.errorbar(xs, ys, yerr=err, marker=MARKERS[i % len(MARKERS)], linestyle=LINESTYLES[i % len(LINESTYLES)],
                    capsize=3, zorder=3 + i, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    if unit:
        _unit_axis(ax.yaxis, unit, log)
    if counts:
        _count_axis(ax, xs)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _ttft(payload: dict[str, Any], fig: Figure) -> None:
    rows = payload["rows"]
    xs = [r["context_tokens"] for r in rows]
    ax = fig.add_subplot(1, 1, 1)
    series = {"(a) text replay, prefix cache off": _spread(rows, "replay_s")}
    if all("replay_cached_s" in r for r in rows):  # records before it have no (a')
        series["(a') text replay, prefix cache on"] = _spread(rows, "replay_cached_s")
    series |= {"(b) resume handle": _spread(rows, "resume_s"), "(c) question-only floor": _spread(rows, "floor_s")}
    _lines(ax, xs, series, "context tokens", "TTFT", log=True, unit="s")
    ax.set_title("TTFT vs context length (median, bars: min–max)")


def _scaling(payload: dict[str, Any], fig: Figure) -> None:
    rows = payload["rows"]
    xs = [r["agents"] for r in rows]
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    sides = {"text": "text replay, prefix cache off", "cached": "text replay, prefix cache on", "handles": "handles"}
    sides = {side: label for side, label in sides.items() if all(f"{side}_wall_s" in r for r in rows)}
    _lines(left, xs, {label: _spread(rows, f"{side}_wall_s") for side, label in sides.items()},
           "agents (k)", "round wall time", unit="s", counts=True)
    left.set_title(f"k agents on one {payload['context_tokens']}-token context")
    _lines(right, xs, {label: _spread(rows, f"{side}_peak_kv_bytes", 1 / MIB) for side, label in sides.items()},
           "agents (k)", "peak KV (sampled)", unit="MiB", counts=True)
    right.set_title("KV pool high-water mark per round")


def _branching(payload: dict[str, Any], fig: Figure) -> None:
    rows = payload["rows"]
    xs = [r["branches"] for r in rows]
    ax = fig.add_subplot(1, 1, 1)
    bpb = payload.get("bytes_per_block") or 0
    series = {"copies (text passing), prefix cache off": _spread(rows, "copies_peak_kv_bytes", 1 / MIB)}
    if all("cached_peak_kv_bytes" in r for r in rows):  # records before it have no cached copies
        series["copies (text passing), prefix cache on"] = _spread(rows, "cached_peak_kv_bytes", 1 / MIB)
    series["forks (handles)"] = _spread(rows, "forks_peak_kv_bytes", 1 / MIB)
    ideal = {"forks, ideal footprint": [r["forks_ideal_blocks"] * bpb / MIB for r in rows]} if bpb else None
    _lines(ax, xs, series, "branch factor b", "peak KV (sampled)", unit="MiB", counts=True, ideal=ideal)
    ax.set_title(f"Peak KV vs branch factor (depth {payload.get('depth', '?')})")


def _workflow(payload: dict[str, Any], fig: Figure) -> None:
    rows = payload["rows"]
    ax = fig.add_subplot(1, 1, 1)
    values, err = _spread(rows, "end_to_end_s")
    ax.barh([f"({r['variant']}) {r['label']}" for r in rows], values, xerr=err, capsize=3)
    ax.invert_yaxis()
    ax.set_xlabel("end-to-end time, all rounds (median, bars: min–max)")
    _unit_axis(ax.xaxis, "s", log=False)
    ax.set_title(f"{payload.get('agents', '?')}-agent workflow, tight KV budget", fontsize=10)


def _adapter_overhead(payload: dict[str, Any], fig: Figure) -> None:
    per_call = payload.get("ms_per_call")
    if not isinstance(per_call, dict):
        _generic(payload, fig)
        return
    ax = fig.add_subplot(1, 1, 1)
    rows = payload.get("rows") or [{"variant": k, "ms_per_call": v} for k, v in per_call.items()]
    values, err = _spread(rows, "ms_per_call")
    ax.bar([r["variant"] for r in rows], values, yerr=err, capsize=3)
    ax.set_ylabel("per LLM call (median, bars: min–max)")
    _unit_axis(ax.yaxis, "ms", log=False)
    ax.set_title("LangGraph framework overhead per LLM call (no model time)")


def _serve(payload: dict[str, Any], fig: Figure) -> None:
    rows = payload["rows"]
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    labels = {"on": "handle reuse", "off": "text replay, prefix cache off", "cache": "text replay, prefix cache on"}
    for i, reuse in enumerate(dict.fromkeys(r["reuse"] for r in rows)):
        mine = [r for r in rows if r["reuse"] == reuse]
        xs = [r["clients"] for r in mine]
        style = {"marker": MARKERS[i % len(MARKERS)], "linestyle": LINESTYLES[i % len(LINESTYLES)], "capsize": 3,
                 "zorder": 3 + i, "label": labels.get(reuse, reuse)}
        left.errorbar(xs, *_spread(mine, "requests_per_s"), **style)
        right.errorbar(xs, *_spread(mine, "ttft_p50_s"), **style)
    clients = sorted({r["clients"] for r in rows})
    for ax, ylabel, unit in ((left, "throughput", "req/s"), (right, "TTFT p50", "s")):
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        _unit_axis(ax.yaxis, unit, log=False)
        _count_axis(ax, clients)
        ax.grid(True, alpha=0.3)
        ax.legend()
    left.set_title("kvbaton serve throughput")
    right.set_title("kvbaton serve TTFT")


def _ingress(payload: dict[str, Any], fig: Figure) -> None:
    rows = payload["rows"]
    sides = [r["side"] for r in rows]
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for ax, key, scale in ((left, "small_s", 1e3), (right, "wall_s", 1.0)):
        values, err = _spread(rows, key, scale)
        ax.bar(sides, values, yerr=err, capsize=3)
    for ax, ylabel, unit, title in (
        (left, "materialize + resume 1 token + release", "ms", "a small request triple (median, bars: min–max)"),
        (right, f"{payload['agents']} agents at once", "s", "a concurrent batch, wall time"),
    ):
        ax.set_ylabel(ylabel)
        _unit_axis(ax.yaxis, unit, log=False)
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=15)
        ax.grid(True, axis="y", alpha=0.3)


def _engine(payload: dict[str, Any], fig: Figure) -> None:
    rows = [r for r in payload["rows"] if _numeric(r.get("ratio"))]
    ax = fig.add_subplot(1, 1, 1)
    ax.axvline(1.0, color="gray", linestyle="--", zorder=1)
    bars = ax.barh([f"{r['dtype']} {r['metric']}" for r in rows], [r["ratio"] for r in rows], zorder=2)
    ax.bar_label(bars, [f"{r['ratio']:.2f}x" for r in rows], padding=3, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max([r["ratio"] for r in rows], default=1.0) * 1.15)  # room for the value labels
    # Two short lines: the y labels take half the figure's width, so one long line would be cut off.
    ax.set_xlabel("kvbaton advantage over plain transformers\n(ratio of medians, higher is better; dashed: 1x)")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}x"))
    ax.set_title("Engine speed vs plain transformers")


def _transfer(payload: dict[str, Any], fig: Figure) -> None:
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    cross = payload.get("crossover") or []
    swept = [r for r in cross if r.get("cell", "sweep") == "sweep"]
    caps = list(dict.fromkeys(r.get("bandwidth_cap_bytes_per_s") for r in swept))
    for cap in caps:
        mine = [r for r in swept if r.get("bandwidth_cap_bytes_per_s") == cap]
        label = "unpaced loopback link" if cap is None else f"sender paced to {rate(cap)}"
        xs = [r["context_tokens"] for r in mine]
        left.errorbar(xs, *_spread(mine, "transfer_s"), marker="o", capsize=3, label=f"transfer, {label}")
    at = [r for r in cross if r.get("cell") == "crossover"]  # paced to the model's predicted break-even speed
    for factor in sorted({r["crossover_factor"] for r in at}):
        mine = [r for r in at if r["crossover_factor"] == factor]
        left.errorbar([r["context_tokens"] for r in mine], *_spread(mine, "transfer_s"), marker="D", linestyle=":",
                      capsize=3, label=f"transfer, paced to {factor:g} x the predicted crossover")
    first = [r for r in swept if r.get("bandwidth_cap_bytes_per_s") == caps[0]] if caps else []
    if first:  # recompute does not depend on the link: one series
        left.errorbar([r["context_tokens"] for r in first], *_spread(first, "recompute_s"), marker="s",
                      color="black", capsize=3, label="recompute")
    left.set_xlabel("context tokens")
    left.set_ylabel("time (median, bars: min–max)")
    left.set_yscale("log")
    _unit_axis(left.yaxis, "s", log=True)
    left.grid(True, alpha=0.3)
    # Under the panel, in two columns: up to nine series would cover the lines inside it.
    left.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    left.set_title("KV transfer vs recompute (slow links: paced sender)", fontsize=10)
    fork = payload.get("fork") or []
    _lines(right, [r["k"] for r in fork], {"handles (fork across workers)": _spread(fork, "handles_s"),
                                          "text replay": _spread(fork, "replay_s")}, "branches k", "wall time",
           unit="s", counts=True)
    right.set_title("Fork across workers vs replay")


CORRECTION_METHODS = {  # the record's method names (the benchmark's --methods) -> legend text
    "dense": "dense prefill (reference)",
    "rotate": "rotation only",
    "full": "full-dimensional anchors",
    "lowrank": "low-rank anchors",
    "lowrank_chained": "low-rank anchors, chained (default gate)",
    "lowrank_chained_nogate": "low-rank anchors, chained, no gate",
}


def _correction(payload: dict[str, Any], fig: Figure) -> None:
    rows = payload["rows"]
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lengths = sorted({r["shared_tokens"] for r in rows})
    # Methods often agree exactly (100 % first token): a small sideways offset per method and a
    # marker and line style of its own keep every line visible where they coincide.
    step = 0.012 * (lengths[-1] - lengths[0] or lengths[-1])
    for i, method in enumerate(methods):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["shared_tokens"])
        xs = [r["shared_tokens"] + (i - (len(methods) - 1) / 2) * step for r in mine]
        style = {"marker": MARKERS[i % len(MARKERS)], "linestyle": LINESTYLES[i % len(LINESTYLES)], "zorder": 3 + i,
                 "label": CORRECTION_METHODS.get(method, method)}
        ys = [r["ttft_mean_s"] for r in mine]
        spread = [(r.get("spread") or {}).get("ttft_s") for r in mine]  # min–max of the prompts' TTFTs
        err = [[y - p[0] if p else 0 for y, p in zip(ys, spread)],
               [p[1] - y if p else 0 for y, p in zip(ys, spread)]] if any(spread) else None
        left.errorbar(xs, ys, yerr=err, capsize=3, **style)
        right.plot(xs, [100 * r["first_token_agreement"] for r in mine], **style)
    right.axhline(95, color="grey", linestyle="--", linewidth=1, label="target 95%", zorder=1)
    for ax, ylabel, unit in ((left, "TTFT per prompt (mean of the prompts, bars: min–max)", "s"),
                             (right, "first token agreeing with dense", "%")):
        ax.set_xlabel("shared segment tokens")
        ax.set_ylabel(ylabel)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        _unit_axis(ax.yaxis, unit, log=False)
        ax.grid(True, alpha=0.3)
    # One legend for both panels, under them: inside either one it would cover a line.
    fig.legend(*right.get_legend_handles_labels(), fontsize=8, ncol=3, loc="lower center", bbox_to_anchor=(0.5, 0.03),
               frameon=False)  # above the run line in the bottom corner
    left.set_title("Segment reuse behind a different prefix: speed")
    right.set_title("... and fidelity")


VARIANT_TICKS = {"vllm": "vLLM CPU\n(prefix cache)"}


def _agents(payload: dict[str, Any], fig: Figure) -> None:
    rows = payload["rows"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    by = {(r["dtype"], r["variant"]): r for r in rows}
    left, middle, right = fig.add_subplot(1, 3, 1), fig.add_subplot(1, 3, 2), fig.add_subplot(1, 3, 3)
    width = 0.8 / max(len(dtypes), 1)
    for i, dtype in enumerate(dtypes):
        mine = [by[(dtype, v)] for v in variants if (dtype, v) in by]
        values, err = _spread(mine, "end_to_end_s")
        xs = [variants.index(r["variant"]) + (i - (len(dtypes) - 1) / 2) * width for r in mine]
        left.bar(xs, values, width, yerr=err, capsize=3, label=dtype, zorder=2)
    left.set_xticks(range(len(variants)), [VARIANT_TICKS.get(v, v) for v in variants])
    auto, peer = by.get(("float32", "auto")), by.get(("float32", "vllm"))
    if auto and peer:  # the peer comparison (medians), pointing at auto's float32 bar
        def top(r: dict[str, Any]) -> float:
            return max([r["end_to_end_s"], *(r.get("runs") or {}).get("end_to_end_s", [])])

        slot = variants.index("auto")
        x = slot + (dtypes.index("float32") - (len(dtypes) - 1) / 2) * width
        # Above every bar of auto's group and its neighbours, so the note cannot read as another bar's.
        near = [top(r) for r in rows if abs(variants.index(r["variant"]) - slot) <= 1]
        left.annotate(f"float32 auto: {peer['end_to_end_s'] / auto['end_to_end_s']:.2f}x\nfaster than vLLM",
                      (x, top(auto)), xytext=(slot, max(near) * 1.12), ha="center", va="bottom", fontsize=7,
                      arrowprops={"arrowstyle": "->", "color": "black", "linewidth": 0.8})
    left.set_ylabel("end-to-end, all workloads (median, bars: min–max)")
    _unit_axis(left.yaxis, "s", log=False)
    left.grid(True, axis="y", alpha=0.3, zorder=0)
    left.legend(fontsize=8)
    left.set_title("Persona-first workloads: time")
    labels = [f"{v}\n{d}" for d in dtypes for v in variants if (d, v) in by]
    cells = [by[(d, v)] for d in dtypes for v in variants if (d, v) in by]
    bottom = [0.0] * len(cells)
    for key, label in (("reused_exact_share", "reused exactly"), ("reused_approx_share", "reused approximately"),
                       ("prefilled_share", "prefilled")):
        heights = [100 * r["shares"][key] for r in cells]
        middle.bar(range(len(cells)), heights, 0.7, bottom=bottom, label=label, zorder=2)
        bottom = [b + h for b, h in zip(bottom, heights)]
    middle.set_xticks(range(len(cells)), labels, fontsize=7)
    middle.set_ylabel("share of prompt tokens (first repeat)")
    middle.set_ylim(0, 125)  # room for the legend above the 100 % stacks
    middle.set_yticks(range(0, 101, 20))
    _unit_axis(middle.yaxis, "%", log=False)
    middle.legend(fontsize=7, loc="upper center", ncol=3)
    middle.set_title("Where prompt K/V came from")
    forced = [r for r in cells if r.get("teacher_forced")]
    if forced:
        width = 0.27
        for j, (key, label) in enumerate((("first_token", "first token (teacher-forced)"),
                                          ("prefix", "greedy prefix (teacher-forced)"))):
            right.bar([i + (j - 1) * width for i in range(len(forced))],
                      [100 * r["teacher_forced"][key] for r in forced], width, label=label, zorder=2)
        right.bar([i + width for i in range(len(forced))], [100 * r["free_running"]["same_text"] for r in forced],
                  width, label="same text (free-running)", zorder=2)
        right.set_xticks(range(len(forced)),
                         [f"{r['variant']}\n{r['dtype']}\n{r['teacher_forced']['turns']} turns" for r in forced],
                         fontsize=7)
        right.legend(fontsize=7, loc="upper center", ncol=2)
    else:
        right.text(0.5, 0.5, "no teacher-forced pass of an approximate variant in this run", ha="center",
                   va="center", fontsize=8, transform=right.transAxes)
        right.set_xticks([])
    right.set_ylim(0, 125)
    right.set_yticks(range(0, 101, 20))
    right.set_ylabel("agreement with the exact variant")
    _unit_axis(right.yaxis, "%", log=False)
    right.set_title("Fidelity of approximate reuse")


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
        _lines(ax, xs, {k: _spread(rows, k) for k in ys[:8]}, x_key, "value")
    else:
        width = 0.8 / max(len(ys[:4]), 1)
        for i, k in enumerate(ys[:4]):
            ax.bar([j + i * width for j in range(len(rows))], [r[k] for r in rows], width, label=k)
        ax.set_xticks(range(len(rows)), [str(x) for x in xs], rotation=20, ha="right")
        ax.legend()


def _soak(payload: dict[str, Any], fig: Figure) -> None:
    """Per phase: requests and errors, and what was left after release_all (which must be 0)."""
    rows = payload["rows"]
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    phases = [str(r["phase"]) for r in rows]
    for ax, series, title in (
        (left, {"requests": [sum(r["requests"].values()) for r in rows],
                "errors": [sum(r["errors"].values()) for r in rows]}, "requests and errors"),
        (right, {"leaked handles": [r["leaked_handles"] for r in rows],
                 "leaked blocks": [r["leaked_blocks"] for r in rows]}, "left after release_all (must be 0)"),
    ):
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series.items()):
            bars = ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(rows))], values, width,
                          label=label, zorder=2)
            ax.bar_label(bars, [str(v) for v in values], padding=2, fontsize=8)  # a zero says "0"
        ax.set_xticks(range(len(rows)), phases)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, max([1, *(v for values in series.values() for v in values)]) * 1.15)
        ax.grid(True, axis="y", alpha=0.3, zorder=0)
        ax.legend(fontsize=8)
        ax.set_title(f"soak: {title}", fontsize=10)


PLOTTERS: dict[str, Callable[[dict[str, Any], Figure], None]] = {
    "ttft": _ttft,
    "scaling": _scaling,
    "branching": _branching,
    "workflow": _workflow,
    "adapter_overhead": _adapter_overhead,
    "serve": _serve,
    "ingress": _ingress,
    "engine": _engine,
    "transfer": _transfer,
    "correction": _correction,
    "agents": _agents,
    "soak": _soak,
}


def plot(payload: dict[str, Any], path: str | Path) -> Path:
    """Draw ``payload`` (a benchmark's JSON) to the PNG ``path``."""
    name = str(payload.get("benchmark", ""))
    wide = name in ("scaling", "serve", "transfer", "correction", "workflow", "soak")
    tall = name in ("correction", "transfer")  # a legend under the panels
    fig = plt.figure(figsize=(15 if name == "agents" else 11 if wide else 8 if name == "engine" else 7,
                              5.2 if tall else 4.5))
    try:
        PLOTTERS.get(name, _generic)(payload, fig)
        machine = payload.get("machine") or {}
        if machine:
            run = f"run {payload['run_id']}, " if payload.get("run_id") else ""
            fig.text(0.01, 0.01, f"{run}{machine.get('cpu', '')}, {payload.get('date') or machine.get('date', '')}",
                     fontsize=7, alpha=0.6)
        fig.tight_layout(rect=(0, 0.12 if fig.legends else 0, 1, 1))  # a figure legend sits under the panels
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
        return out
    finally:
        plt.close(fig)
