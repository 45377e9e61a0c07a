"""What every example measures and prints: per-agent TTFT, tokens reused vs prefilled, peak KV and
total time, in kvbaton mode (KV handles, prefix cache, hints) and in two text-passing baselines.

:class:`MeteredClient` sits between the example's framework (LangGraph, AutoGen, plain SDK calls)
and a real embedded client: it records each generation's engine timings and samples the pool after
every call. In the baselines it releases each result's handle at once, because text passing keeps
no KV between calls. The ``text`` baseline's engine runs without the prefix cache, so every prompt
is prefilled in full (the cost a plain OpenAI-style server pays without prefix caching); the
``cached`` baseline's engine has its prefix cache on, so a prompt that repeats an earlier one's
start reuses it (what a text-passing app gets from a prefix-caching server: vLLM's, SGLang's, or
kvbaton's own with no handles). Every printed speed-up names the baseline it is over.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kvbaton
from kvbaton.bench.common import format_table
from kvbaton.client import Client, Context, HandleLike, Messages
from kvbaton.handle import Handle
from kvbaton.stepgraph import StepGraph
from kvbaton.stream import TokenStream
from kvbaton.types import AgentInfo, Event, Events, Result, SamplingParams, Stats

KVBATON = "kvbaton"
TEXT = "text"
CACHED = "cached"
MODE_LABELS = {KVBATON: "kvbaton (KV handles)", TEXT: "text passing, no prefix cache (baseline)",
               CACHED: "text passing, prefix cache on (baseline)"}
SHORT = {TEXT: "text", CACHED: "text+cache"}  # the baselines' column names
MIB = 1024 * 1024


def add_common_arguments(parser: argparse.ArgumentParser, *, max_tokens: int, context_words: int | None = None,
                         context: str = "the shared context") -> None:
    """``--baseline``, ``--plot``, ``--max-tokens`` and ``--quiet``, the same in every example; with
    ``context_words``, ``--context-words`` too (the size of ``context``, the document the agents share)."""
    if context_words is not None:
        parser.add_argument("--context-words", type=int, default=context_words,
                            help=f"size of {context} in words (~1.3 tokens per word; default {context_words})")
    parser.add_argument(
        "--baseline", choices=["none", "text", "cached", "both", "all"], default=None,
        help="none: kvbaton mode only (default); text: only the text-passing baseline on an engine without "
        "prefix cache (no KV handles, no prefix reuse); cached: only text passing on an engine with its prefix "
        "cache on (what a prefix-caching server gives); both: kvbaton and text side by side, with ratios (the "
        "default with --plot); all: kvbaton and both baselines",
    )
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help="write the run's timeline (one lane per agent, kvbaton and the text baseline side "
                        "by side) to this PNG")
    parser.add_argument("--max-tokens", type=int, default=max_tokens,
                        help=f"tokens generated per agent turn (default {max_tokens}; the model is tiny, "
                        "short outputs keep the run short)")
    parser.add_argument("--quiet", action="store_true", help="do not print the agents' outputs as they come")


def run_example(
    name: str, doc: str | None, argv: list[str] | None, *, max_tokens: int,
    run_mode: Callable[[str, argparse.Namespace], Report],
    arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None,
    check: Callable[[argparse.Namespace], str | None] = lambda args: None,
    context_words: int | None = None, context: str = "the shared context",
) -> dict[str, Any]:
    """An example's ``main``: its own ``arguments`` plus the common ones (``--context-words`` with
    ``context_words``: :func:`add_common_arguments`), a ``check`` of them (an error message, or None),
    ``run_mode`` for every mode ``--baseline`` asks for, then the reports."""
    parser = argparse.ArgumentParser(prog=f"kvbaton run {name}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    arguments(parser)
    add_common_arguments(parser, max_tokens=max_tokens, context_words=context_words, context=context)
    args = parser.parse_args(argv)
    args.baseline = args.baseline or ("both" if args.plot else "none")
    problem = check(args)
    if problem:
        parser.error(problem)
    reports = {mode: run_mode(mode, args) for mode in modes_of(args.baseline)}
    out = finish(name, reports)
    if args.plot:
        from kvbaton.bench.timeline import plot_timeline

        path = plot_timeline({MODE_LABELS[m]: r.events for m, r in reports.items()}, args.plot, title=name)
        print(f"timeline: {path}")
        out["plot"] = str(path)
    return out


def modes_of(baseline: str) -> list[str]:
    return {"none": [KVBATON], "text": [TEXT], "cached": [CACHED], "both": [KVBATON, TEXT],
            "all": [KVBATON, TEXT, CACHED]}[baseline]


def connect(mode: str, **options: Any) -> MeteredClient:
    """An embedded client for ``mode``: the text baseline gets an engine without prefix cache, the
    cached baseline one with it (both keep no handles: :class:`MeteredClient`)."""
    inner = kvbaton.connect(prefix_cache=(mode != TEXT), **options)
    # One small unrecorded request first, so that neither mode's first agent pays the warm-up.
    warm = inner.complete("Warm-up: " + "kvbaton " * 60, max_tokens=2, ignore_eos=True)
    inner.release(warm.handle)
    return MeteredClient(inner, keep_handles=(mode == KVBATON))


@dataclass(frozen=True)
class Call:
    """One engine call: who made it and what it cost."""

    agent: str
    op: str
    ttft_s: float
    reused: int
    prefilled: int
    generated: int


@dataclass
class Report:
    """One run of an example in one mode."""

    mode: str
    total_s: float
    calls: list[Call]
    peak_kv_bytes: int
    peak_kv_blocks: int
    outputs: dict[str, str] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)  # the engine's events of the run (its timeline)

    @property
    def reused(self) -> int:
        return sum(c.reused for c in self.calls)

    @property
    def prefilled(self) -> int:
        return sum(c.prefilled for c in self.calls)

    @property
    def mean_ttft_s(self) -> float:
        values = [c.ttft_s for c in self.calls if c.op != "prefill"]
        return statistics.fmean(values) if values else 0.0

    def agents(self) -> dict[str, list[Call]]:
        out: dict[str, list[Call]] = {}
        for c in self.calls:
            out.setdefault(c.agent, []).append(c)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "total_s": self.total_s,
            "peak_kv_bytes": self.peak_kv_bytes,
            "peak_kv_blocks": self.peak_kv_blocks,
            "tokens_reused": self.reused,
            "tokens_prefilled": self.prefilled,
            "mean_ttft_s": self.mean_ttft_s,
            "per_agent": {
                agent: {
                    "calls": len(calls),
                    "ttft_mean_s": statistics.fmean(c.ttft_s for c in calls),
                    "tokens_reused": sum(c.reused for c in calls),
                    "tokens_prefilled": sum(c.prefilled for c in calls),
                    "tokens_generated": sum(c.generated for c in calls),
                }
                for agent, calls in self.agents().items()
            },
            "outputs": self.outputs,
        }


class MeteredClient(Client):
    """A :class:`kvbaton.Client` over another one that records every call (see the module doc).

    ``keep_handles=False`` (the baseline) releases each generation's handle right after the call.
    Streaming calls pass through unrecorded (no example streams). :meth:`report` frees whatever the
    run still holds and returns the measurements."""

    def __init__(self, inner: Client, *, keep_handles: bool) -> None:
        self.inner = inner
        self.keep_handles = keep_handles
        self.calls: list[Call] = []
        self.held: list[Handle] = []
        self.peak_bytes = 0
        self.peak_blocks = 0
        self._lock = threading.Lock()
        self._start = time.perf_counter()
        self._since = 0

    @property
    def engine(self) -> Any:  # for code that reads the embedded engine (e.g. create_app)
        return getattr(self.inner, "engine", None)

    # -- measurement -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the clock (after model loading and any other setup the mode does not pay for)."""
        self._start = time.perf_counter()
        self._since = self.inner.events().next  # the run's events are those after this one

    def sample(self) -> Stats:
        stats = self.inner.stats()
        with self._lock:
            if stats.pool_bytes_used > self.peak_bytes:
                self.peak_bytes, self.peak_blocks = stats.pool_bytes_used, stats.blocks_used
        return stats

    def note_footprint(self, tokens: int) -> None:
        """A call whose KV was freed before it could be sampled (a server that keeps no handles): its
        own blocks are a lower bound of the pool's use during the call."""
        stats = self.inner.stats()
        blocks = -(-tokens // stats.block_size)
        with self._lock:
            if blocks * stats.bytes_per_block > self.peak_bytes:
                self.peak_bytes, self.peak_blocks = blocks * stats.bytes_per_block, blocks

    def record(self, agent: str | None, op: str, ttft_s: float, reused: int, prefilled: int, generated: int) -> None:
        with self._lock:
            self.calls.append(Call(agent or "-", op, ttft_s, reused, prefilled, generated))

    def _result(self, result: Result, agent: str | None, op: str) -> Result:
        t = result.timings
        self.record(agent, op, t.ttft_s, t.tokens_reused, t.tokens_prefilled, t.tokens_generated)
        self.sample()  # the result's handle still holds this call's KV: its peak is included
        if self.keep_handles:
            self._hold([result.handle])
        else:
            self.inner.release(result.handle)
        return result

    def _hold(self, handles: list[Handle]) -> None:
        with self._lock:
            self.held.extend(handles)

    def _prefill(self, fn: Any, agent: str | None, op: str) -> Any:
        before = self.inner.stats()
        start = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
        after = self.sample()
        self.record(agent, op, seconds, after.tokens_reused - before.tokens_reused,
                    after.tokens_prefilled - before.tokens_prefilled, 0)
        return out

    def report(self, mode: str, outputs: Mapping[str, str] | None = None) -> Report:
        total = time.perf_counter() - self._start
        with self._lock:
            held, self.held = self.held, []
        live = [h for h in held if h is not None]
        for h in live:
            try:
                self.inner.release(h)
            except kvbaton.KvbatonError:
                pass  # released by the example already
        events = self.inner.events(self._since).events
        return Report(mode, total, list(self.calls), self.peak_bytes, self.peak_blocks, dict(outputs or {}), events)

    # -- kvbaton.Client ------------------------------------------------------------------------------
    def materialize(self, context: Context, *, agent: str | None = None) -> Handle:
        handle = self._prefill(lambda: self.inner.materialize(context, agent=agent), agent, "prefill")
        self._hold([handle])
        return handle

    def fork(self, handle: HandleLike, k: int = 2) -> list[Handle]:
        handles = self.inner.fork(handle, k)
        self._hold(handles)
        self.sample()
        return handles

    def extend(self, handle: HandleLike, context: Context, *, agent: str | None = None) -> Handle:
        out = self._prefill(lambda: self.inner.extend(handle, context, agent=agent), agent, "prefill")
        self._hold([out])
        return out

    def resume(self, handle: HandleLike, suffix: Context = "", *, sampling: SamplingParams | None = None,
               agent: str | None = None, **options: Any) -> Result:
        result = self.inner.resume(handle, suffix, sampling=sampling, agent=agent, **options)
        return self._result(result, agent, "resume")

    def resume_stream(self, handle: HandleLike, suffix: Context = "", *, sampling: SamplingParams | None = None,
                      agent: str | None = None, **options: Any) -> TokenStream:
        return self.inner.resume_stream(handle, suffix, sampling=sampling, agent=agent, **options)

    def complete(self, prompt: Context, *, sampling: SamplingParams | None = None, agent: str | None = None,
                 **options: Any) -> Result:
        return self._result(self.inner.complete(prompt, sampling=sampling, agent=agent, **options), agent, "complete")

    def complete_stream(self, prompt: Context, *, sampling: SamplingParams | None = None, agent: str | None = None,
                        **options: Any) -> TokenStream:
        return self.inner.complete_stream(prompt, sampling=sampling, agent=agent, **options)

    def generate(self, messages: Messages, *, handle: HandleLike | None = None,
                 tools: list[dict[str, Any]] | None = None, sampling: SamplingParams | None = None,
                 agent: str | None = None, **options: Any) -> Result:
        result = self.inner.generate(messages, handle=handle, tools=tools, sampling=sampling, agent=agent, **options)
        return self._result(result, agent, "generate")

    def generate_stream(self, messages: Messages, *, handle: HandleLike | None = None,
                        tools: list[dict[str, Any]] | None = None, sampling: SamplingParams | None = None,
                        agent: str | None = None, **options: Any) -> TokenStream:
        return self.inner.generate_stream(messages, handle=handle, tools=tools, sampling=sampling, agent=agent,
                                          **options)

    def release(self, handles: HandleLike | Iterable[HandleLike]) -> None:
        items = [handles] if isinstance(handles, Handle | str) else list(handles)
        ids = {getattr(h, "id", h) for h in items}
        with self._lock:
            self.held = [h for h in self.held if h.id not in ids]
        self.inner.release(items)

    def stats(self) -> Stats:
        return self.inner.stats()

    def events(self, since: int = 0) -> Events:
        return self.inner.events(since)

    def tokenize(self, text: str) -> list[int]:
        return self.inner.tokenize(text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.inner.detokenize(token_ids)

    def chat_tokens(self, messages: Messages, *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        return self.inner.chat_tokens(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def register_agent(self, name: str, fixed_prompt: Context | Messages, *, prefill: bool = False) -> AgentInfo:
        if not prefill:
            return self.inner.register_agent(name, fixed_prompt)
        # prefilled now, into the prefix cache: counted, under one label for all agents
        return self._prefill(lambda: self.inner.register_agent(name, fixed_prompt, prefill=True),
                             "(registered prompts)", "prefill")

    def hints(self, steps: Mapping[str, float] | StepGraph, *, running: Iterable[str] = (),
              finished: Iterable[str] = ()) -> dict[str, float]:
        return self.inner.hints(steps, running=running, finished=finished)

    def close(self) -> None:
        self.inner.close()


# -- printing -----------------------------------------------------------------------------------------


def say(quiet: bool, agent: str, text: str, width: int = 110) -> None:
    """One line per agent turn (the run's progress)."""
    if not quiet:
        line = " ".join(text.split())
        print(f"  [{agent}] {line[:width]}{'...' if len(line) > width else ''}", flush=True)


def agent_table(report: Report) -> str:
    rows = []
    for agent, calls in report.agents().items():
        rows.append([agent, len(calls), 1000 * statistics.fmean(c.ttft_s for c in calls),
                     sum(c.reused for c in calls), sum(c.prefilled for c in calls), sum(c.generated for c in calls)])
    return format_table(["agent", "calls", "TTFT mean ms", "tokens reused", "tokens prefilled", "generated"], rows)


def summary_line(report: Report) -> str:
    return (f"total {report.total_s:.2f} s | mean TTFT {1000 * report.mean_ttft_s:.1f} ms | reused "
            f"{report.reused} / prefilled {report.prefilled} tokens | peak KV "
            f"{report.peak_kv_bytes / MIB:.1f} MiB ({report.peak_kv_blocks} blocks)")


def print_report(report: Report) -> None:
    print(f"\n== {MODE_LABELS[report.mode]} ==")
    print(agent_table(report))
    print(summary_line(report))


def comparison(reports: Mapping[str, Report]) -> str:
    """kvbaton beside each baseline that ran, with baseline/kvbaton ratios (> 1: kvbaton is better)."""
    k = reports[KVBATON]
    bases = [m for m in (TEXT, CACHED) if m in reports]

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "-"

    metrics: list[tuple[str, Callable[[Report], float], bool]] = [
        ("total time s", lambda r: r.total_s, True),
        ("mean TTFT ms", lambda r: 1000 * r.mean_ttft_s, True),
        ("tokens prefilled", lambda r: r.prefilled, True),
        ("tokens reused", lambda r: r.reused, False),
        ("peak KV MiB", lambda r: r.peak_kv_bytes / MIB, True),
    ]
    rows = []
    for label, value, has_ratio in metrics:
        row: list[Any] = [label, value(k)]
        for b in bases:
            row += [value(reports[b]), ratio(value(reports[b]), value(k)) if has_ratio else "-"]
        rows.append(row)
    columns = ["metric", "kvbaton", *(x for b in bases for x in (SHORT[b], f"{SHORT[b]} / kvbaton"))]
    return format_table(columns, rows)


def finish(name: str, reports: Mapping[str, Report]) -> dict[str, Any]:
    """Print every mode's report (and the comparison when kvbaton and a baseline ran); return them as plain data."""
    for report in reports.values():
        print_report(report)
    out: dict[str, Any] = {"example": name, "modes": {m: r.to_dict() for m, r in reports.items()}}
    bases = [m for m in (TEXT, CACHED) if m in reports]
    if KVBATON in reports and bases:
        print(f"\n== {name}: kvbaton vs " + " and vs ".join(MODE_LABELS[b].removesuffix(" (baseline)")
                                                           for b in bases) + " ==")
        print(comparison(reports))
        if CACHED not in reports:
            print("(the text baseline runs without a prefix cache; --baseline all adds text passing with the "
                  "prefix cache on, the baseline of a prefix-caching server)")
        k = reports[KVBATON]
        same = all(reports[b].outputs == k.outputs for b in bases)
        print(f"same outputs in every mode (greedy decoding): {'yes' if same else 'NO'}")
        out["same_outputs"] = same
        out["ratios"] = {}
        for b in bases:
            t = reports[b]
            out["ratios"] |= {
                f"total_time_{b}_over_kvbaton": t.total_s / k.total_s if k.total_s else None,
                f"mean_ttft_{b}_over_kvbaton": t.mean_ttft_s / k.mean_ttft_s if k.mean_ttft_s else None,
                f"prefilled_{b}_over_kvbaton": t.prefilled / k.prefilled if k.prefilled else None,
            }
    return out
