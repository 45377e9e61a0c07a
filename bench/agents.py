"""Persona-first multi-agent workloads: exact reuse, approximate reuse and text replay side by side.

Every agent puts its own persona (system prompt) first and the shared document after it
(:mod:`kvbaton.bench.workloads`: ``debate``, ``chain``, ``fanout``, ``mapreduce``, and the shapes
``debate_released``, ``debate_openai``, ``mapreduce_langgraph``), so exact prefix reuse finds an
agent's own earlier turns but never another agent's reading of the document; approximate reuse
(``reuse="auto"`` / ``"rotate"`` / ``"correct"``) may place it from another agent's cache, re-aligned
to the new positions (``auto`` also recomputes its most-deviating tokens, or everything when the
answer looks unsure; ``rotate`` does no correction; ``correct`` adds the anchor pools' chained
low-rank correction, KVCMAS's method, recomputing where no anchors fit yet).

Variants, side by side (``alternating`` repeats), per dtype:

- ``exact``: ``client.generate(messages, agent=..., reuse="exact")``: prefix cache, exact only;
- ``auto``, ``rotate``, ``correct``: the same with ``reuse="auto"`` / ``"rotate"`` / ``"correct"``;
- ``text``: text replay: ``client.complete(<the same chat's prompt tokens>)`` on an engine without a
  prefix cache, so every turn prefills everything.

One embedded client per dtype serves exact/auto/rotate/correct (a second one, without a prefix cache,
serves text); every variant and every workload inside it starts cold: the prefix cache flushed, the
default anchor pool cleared, no handle alive. A workload's result handles stay alive until the
workload ends (as a workflow holds them), then all are released; ``debate_released`` releases each
turn's handle as soon as the turn is done (the README's pattern). The shapes over HTTP
(``debate_openai``: the OpenAI client against ``kvbaton serve``, the server managing the handles;
``mapreduce_langgraph``: a LangGraph ``Send`` app of unchanged ``ChatOpenAI`` nodes, ``wrap(app)``-ed)
run on a ``kvbaton serve`` started cold for each variant run (:mod:`kvbaton.bench.agents_serve`). Greedy decoding, EOS ignored: every turn generates
exactly ``--max-tokens`` tokens.

Reported per dtype and variant: end-to-end seconds (min/median/max over ``--repeats``), the share of
prompt tokens reused exactly / approximately / prefilled (from ``Result.timings``, per agent too),
and fidelity against the ``exact`` variant:

- teacher-forced: each approximate variant runs again with every turn given the exact run's prompt
  (its transcript); its first generated token and its greedy tokens are compared with the exact
  run's output of that turn (first-token agreement, mean share of tokens identical before the first
  divergence). ``--tf-passes`` passes, pass ``p`` on documents of seed ``p``; only turns after each
  workload's first count (the first agent has no other agent's cache to reuse): a first-token claim
  needs at least 60 such turns (the default, 3 passes x 21 turns, gives 63);
- free-running: the share of turns whose whole text equals the exact run's (seed 0, first repeat).

KL: on the first teacher-forced pass, every approximated turn's handle (prompt and answer) is
measured with ``fidelity(handle, max_tokens=1)``: KL(dense || approximate) of the next-token
distribution against a dense prefill of the same tokens (untimed; a dense reference per turn costs a
full prefill, so later passes skip it).

Until ``reuse=`` exists on ``Client.generate`` (detected at run time), only ``exact`` and ``text``
run and the record says so.

Peer: ``--peer-vllm PYTHON`` (default ``$KVBATON_VLLM_PYTHON``; not run without either) adds the variant
``vllm``: vLLM's CPU build with automatic prefix caching, started by this benchmark as its
OpenAI-compatible server (``PYTHON -m vllm.entrypoints.openai.api_server``, a subprocess of that
interpreter on 127.0.0.1, stopped when the benchmark ends, also on Ctrl-C), on the same local checkpoint
(a copy re-keyed where vLLM needs it: :func:`vllm_checkpoint`), fp32 only. It runs the same workloads
turn by turn through ``POST /v1/completions`` with the prompt as the token ids of
``client.chat_tokens(messages)`` (vLLM's own chat rendering is checked against them, and recorded),
greedy, EOS ignored, after the same ~2.4K-token warm-up request; every workload starts with
``POST /reset_prefix_cache`` (the server's dev mode). Its reused share is vLLM's
``usage.prompt_tokens_details.cached_tokens``; its seconds include the HTTP round trip (the record
keeps vLLM's own per-request timings beside them). It takes part in the alternating repeats like the
kvbaton variants, and its free-running text is compared with ``exact``'s.

Modules: this one runs the variants; :mod:`kvbaton.bench.vllm_peer` is the vLLM peer,
:mod:`kvbaton.bench.agents_fidelity` the fidelity and share bookkeeping, :mod:`kvbaton.bench.agents_table`
the table and notes it prints (and docs/results.md shows).
"""

from __future__ import annotations

import argparse
import inspect
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvbaton import SamplingParams
from kvbaton.bench import record
from kvbaton.bench.agents_fidelity import (
    KL_NOTE,
    MIN_TF_TURNS,
    agreement,
    all_turns,
    compare,
    kl_summary,
    per_agent,
    rejection_summary,
    rejections,
    shares,
)
from kvbaton.bench.agents_serve import run_served, served, warm_up
from kvbaton.bench.agents_table import notes, table
from kvbaton.bench.common import alternating
from kvbaton.bench.spread import measured
from kvbaton.bench.vllm_peer import (
    VLLM_DTYPE,
    VLLM_PYTHON_ENV,
    VLLM_SKIPPED_DTYPE,
    VLLM_STARTUP_TIMEOUT_S,
    PeerConfig,
    VllmPeer,
    run_vllm,
    same_rendering,
    sigterm_as_exit,
)
from kvbaton.bench.workloads import WARMUP_TOKENS, WORKLOADS, Workload, build, run_workload, warmup_prompt
from tqdm.auto import tqdm

KVBATON_VARIANTS = ("exact", "auto", "rotate", "correct", "text")
VARIANTS = (*KVBATON_VARIANTS, "vllm")  # vllm: only with --peer-vllm
APPROXIMATE = ("auto", "rotate", "correct")
LABELS = {
    "exact": "exact reuse (prefix cache)",
    "auto": "reuse='auto' (re-align, recompute the most-deviating tokens)",
    "rotate": "reuse='rotate' (re-align only)",
    "correct": "reuse='correct' (re-align, chained low-rank anchor correction, KVCMAS)",
    "text": "text replay (no prefix cache)",
    "vllm": "vLLM CPU build, automatic prefix caching (OpenAI server, token-id prompts)",
}
DEFAULT_DTYPES = ("float32", "bfloat16")
DEFAULT_REPEATS = 2
DEFAULT_TF_PASSES = 3
KV_BUDGET = "4GiB"


# -- the engine side -----------------------------------------------------------------------------------


def supports_reuse(client: Any) -> bool:
    """Whether ``client.generate`` takes ``reuse=`` (the keyword lands with approximate reuse)."""
    try:
        if "reuse" in inspect.signature(client.generate).parameters:
            return True
    except (TypeError, ValueError):
        pass
    try:  # a keyword taken through **options would show only by working
        probe = client.generate([{"role": "user", "content": "Hi"}], sampling=SamplingParams(max_tokens=1),
                                reuse="exact")
    except Exception:  # noqa: BLE001 - TypeError, or the sampling validator refusing an unknown field
        return False
    client.release(probe.handle)
    return True


def connect(dtype: str, prefix_cache: bool, quick: bool = False, correction: dict[str, Any] | None = None) -> Any:
    """An embedded client of ``dtype`` (``correction``: reuse settings other than the defaults), warmed up with the
    shared warm-up request."""
    import kvbaton

    client = kvbaton.connect(dtype=dtype, kv_budget=KV_BUDGET, prefix_cache=prefix_cache,
                             **({"correction": correction} if correction else {}))
    warm = client.complete(warmup_prompt(quick), sampling=SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True))
    client.release(warm.handle)
    return client


def cold(client: Any) -> None:
    """Nothing cached, no anchors learned, no handle alive: the start of every variant and workload."""
    engine = client.engine
    audit = getattr(engine, "audit", None)
    if audit is not None:  # the sampled fidelity checks (on by default) finish before the next timed run
        audit.flush()
    engine.flush_cache()
    try:
        engine.anchor_pool().clear()
    except AttributeError:
        pass
    if client.stats().handles_live:
        raise RuntimeError("a handle outlived its workload: variants would not start cold")


def turn_record(result: Any, agent: str, index: int, seconds: float) -> dict[str, Any]:
    """What one turn cost and produced, from its ``Result``."""
    t = result.timings
    approx = int(getattr(t, "tokens_approximate", 0) or 0)
    segments = getattr(result, "segments", None) or []
    return {
        "index": index, "agent": agent, "seconds": seconds, "ttft_s": t.ttft_s,
        "prompt_tokens": t.tokens_reused + t.tokens_prefilled, "reused_exact": t.tokens_reused - approx,
        "reused_approx": approx, "prefilled": t.tokens_prefilled, "generated": t.tokens_generated,
        "exact": bool(getattr(result, "exact", True)),
        "discarded": int(getattr(t, "tokens_discarded", 0) or 0),  # what a rejected approximation threw away
        "segments": dict(Counter(str(getattr(s, "outcome", "?")) for s in segments)),
        "token_ids": list(result.token_ids), "text": result.text,
    }


def generate_fn(client: Any, variant: str, sampling: SamplingParams, reuse_kw: bool, held: list[Any],
                turns: list[dict[str, Any]], kl: bool = False,
                release: bool = False) -> Callable[[str, list[dict[str, str]]], str]:
    """``generate_fn(agent, messages) -> text`` of one variant; keeps every handle (``release``: releases
    each at once, as the README's first example does) and turn record (with ``kl``, the KL of approximate
    turns against dense prefill, untimed)."""
    def fn(agent: str, messages: list[dict[str, str]]) -> str:
        start = time.perf_counter()
        if variant == "text":
            result = client.complete(client.chat_tokens(messages), sampling=sampling, agent=agent)
        elif reuse_kw:
            result = client.generate(messages, sampling=sampling, agent=agent, reuse=variant)
        else:
            result = client.generate(messages, sampling=sampling, agent=agent)
        seconds = time.perf_counter() - start
        turns.append(turn_record(result, agent, len(turns), seconds))
        if kl and not getattr(result, "exact", True):
            t0 = time.perf_counter()
            turns[-1]["kl"] = client.fidelity(result.handle, max_tokens=1).kl_first
            turns[-1]["seconds_kl"] = time.perf_counter() - t0
        if release:
            t0 = time.perf_counter()
            client.release(result.handle)
            turns[-1]["seconds"] += time.perf_counter() - t0
        else:
            held.append(result.handle)
        return result.text

    return fn


def run_variant(client: Any, variant: str, workloads: Sequence[Workload], sampling: SamplingParams,
                reuse_kw: bool, teachers: dict[str, list[str]] | None = None, kl: bool = False,
                quick: bool = False) -> dict[str, Any]:
    """Every workload once with ``variant``, each from a cold engine: seconds and turn records. Workloads
    run over HTTP (``via`` openai, langgraph) share one server of ``client``'s dtype, started cold for this
    run (:mod:`kvbaton.bench.agents_serve`)."""
    out: dict[str, Any] = {"variant": variant, "workloads": {}}
    for wl in workloads:
        if wl.via != "embedded":
            continue
        cold(client)
        held: list[Any] = []
        turns: list[dict[str, Any]] = []
        background = _background_forwards(client)
        start = time.perf_counter()
        run_workload(wl, generate_fn(client, variant, sampling, reuse_kw, held, turns, kl, release=wl.release),
                     teacher=None if teachers is None else teachers[wl.name])
        # KL measurements are not part of the workload's time.
        seconds = time.perf_counter() - start - sum(t["seconds_kl"] for t in turns if "seconds_kl" in t)
        client.release(held)
        out["workloads"][wl.name] = {"seconds": seconds, "turns": turns,
                                     # the fidelity audit's forwards inside the timed run (it waits for a quiet engine)
                                     "background_forwards": _background_forwards(client) - background}
    remote = [wl for wl in workloads if wl.via != "embedded"]
    if remote:
        with served(str(client.engine.config.dtype), KV_BUDGET, prefix_cache=variant != "text") as url:
            warm_up(url, warmup_prompt(quick), WARMUP_TOKENS)
            out["workloads"].update(run_served(url, variant, remote, sampling.max_tokens, client.tokenize, teachers))
    out["seconds"] = sum(w["seconds"] for w in out["workloads"].values())
    return out


def _background_forwards(client: Any) -> int:
    scheduler = getattr(client.engine, "scheduler", None)
    return int(getattr(scheduler, "background_forwards", 0))


# -- the benchmark ---------------------------------------------------------------------------------


def workloads_of(names: Sequence[str], seed: int, quick: bool) -> list[Workload]:
    return [build(name, seed, quick) for name in names]


def run_dtype(dtype: str, names: Sequence[str], repeats: int, tf_passes: int, max_tokens: int, quick: bool,
              variants: Sequence[str], peer_config: PeerConfig | None = None) -> dict[str, Any]:
    """Every chosen variant of ``dtype``, alternating, then the teacher-forced passes; its rows. A vLLM
    server (``peer_config``, float32) lives only while the alternating repeats run."""
    with sigterm_as_exit():  # SIGTERM too ends in the `finally` that stops the server
        return _run_dtype(dtype, names, repeats, tf_passes, max_tokens, quick, variants, peer_config)


def _run_dtype(dtype: str, names: Sequence[str], repeats: int, tf_passes: int, max_tokens: int, quick: bool,
               variants: Sequence[str], peer_config: PeerConfig | None) -> dict[str, Any]:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    use_vllm = peer_config is not None and "vllm" in variants and dtype == VLLM_DTYPE
    cached = connect(dtype, prefix_cache=True, quick=quick)
    plain = connect(dtype, prefix_cache=False, quick=quick) if "text" in variants else None
    peer: VllmPeer | None = None
    record.watch_kv(f"engine {dtype}", record.pool_bytes(cached.engine))
    if plain is not None:
        record.watch_kv(f"engine {dtype} text", record.pool_bytes(plain.engine))
    try:
        reuse_kw = supports_reuse(cached)
        chosen = [v for v in variants if v in ("exact", "text") or (v in APPROXIMATE and reuse_kw)
                  or (v == "vllm" and use_vllm)]
        skipped = [v for v in variants if v not in chosen and v != "vllm"]
        base = workloads_of(names, 0, quick)
        peer_info: dict[str, Any] | None = None
        if use_vllm:
            assert peer_config is not None
            peer = VllmPeer(peer_config.python, Path(cached.engine.loaded.path), peer_config.models_dir,
                            peer_config.log_path, peer_config.startup_timeout)
            print(f"agents: starting vLLM ({peer_config.python}); its log: {peer.log_path or 'a temporary file'}",
                  flush=True)
            peer_info = dict(peer.start())
            print(f"agents: vLLM {peer_info['version']} ready in {peer_info['startup_s']:.0f} s", flush=True)
            peer.warm_up(cached.tokenize(warmup_prompt(quick)), WARMUP_TOKENS)
            peer_info["same_prompt_ids_as_kvbaton"] = same_rendering(peer, cached, base)
            peer_info["maps_at_once"] = True  # run_vllm sends a LangGraph map-reduce's map turns at once
            peer_info["server_cpu_s_during_kvbaton"] = 0.0
            peer_info["kvbaton_variants_s"] = 0.0
        client_of = {v: plain if v == "text" else cached for v in chosen}
        progress = tqdm(total=repeats * len(chosen), desc=f"agents {dtype}", unit="variant run")

        def side(v: str) -> Callable[[], dict[str, Any]]:
            def go() -> dict[str, Any]:
                if v == "vllm":
                    assert peer is not None
                    out = run_vllm(peer, cached, base, max_tokens)
                else:
                    cpu = peer.cpu_seconds() if peer is not None else 0.0
                    out = run_variant(client_of[v], v, base, sampling, reuse_kw, quick=quick)
                    if peer is not None and peer_info is not None:  # an idle server should not compete
                        peer_info["server_cpu_s_during_kvbaton"] += peer.cpu_seconds() - cpu
                        peer_info["kvbaton_variants_s"] += out["seconds"]
                progress.update()
                return out
            return go

        runs = alternating(repeats, {v: side(v) for v in chosen})
        progress.close()
        if peer is not None:  # the teacher-forced passes below are kvbaton's alone
            peer.stop()
        exact_ref = runs["exact"][0]
        tf: dict[str, list[dict[str, Any]]] = {v: [] for v in chosen if v in APPROXIMATE and tf_passes > 0}
        tf_seconds: dict[str, list[float]] = {v: [] for v in tf}
        kls: dict[str, list[float]] = {v: [] for v in tf}
        rejected: dict[str, list[dict[str, Any]]] = {v: [] for v in tf}
        if tf:
            for p in tqdm(range(tf_passes), desc=f"agents {dtype} teacher-forced", unit="pass"):
                wls = base if p == 0 else workloads_of(names, p, quick)
                ref = exact_ref if p == 0 else run_variant(cached, "exact", wls, sampling, reuse_kw, quick=quick)
                teachers = {name: [t["text"] for t in ref["workloads"][name]["turns"]] for name in names}
                for v in tf:
                    forced = run_variant(cached, v, wls, sampling, reuse_kw, teachers=teachers, kl=p == 0,
                                         quick=quick)
                    kls[v] += [t["kl"] for w in forced["workloads"].values() for t in w["turns"] if "kl" in t]
                    tf[v] += [{**c, "pass": p} for c in compare(forced, ref, max_tokens)]
                    tf_seconds[v].append(forced["seconds"])
                    rejected[v] += rejections(forced, ref)
        rows = []
        for v in chosen:
            first = runs[v][0]
            row: dict[str, Any] = {"dtype": dtype, "variant": v, "label": LABELS[v], "repeats": repeats}
            measured(row, "end_to_end_s", [r["seconds"] for r in runs[v]])
            for name in names:
                measured(row, f"{name}_s", [r["workloads"][name]["seconds"] for r in runs[v]])
            turns = all_turns(first)
            row.update({
                "shares": shares(turns),
                "downstream_shares": {name: shares([t for t in first["workloads"][name]["turns"] if t["index"] > 0])
                                      for name in names},
                "per_agent": per_agent(first),
                "results_not_exact": sum(not t["exact"] for t in turns),
                "segments": dict(sum((Counter(t["segments"]) for t in turns), Counter())),
                "free_running": agreement(compare(first, exact_ref, max_tokens)),
                "teacher_forced": agreement(tf[v]) if v in tf else None,
                "teacher_forced_turns": tf.get(v),
                "teacher_forced_seconds": tf_seconds.get(v),
                "kl": kl_summary(kls.get(v)),
                "rejections": rejection_summary(rejected[v]) if v in rejected else None,
                "run_detail": first,
            })
            if v == "vllm":
                server = [t["server_s"] for t in turns]
                row["vllm"] = {
                    "turn_seconds": sum(t["seconds"] for t in turns),
                    "server_seconds": sum(server) if all(s is not None for s in server) else None,
                    "cached_tokens_reported": all(t["cached_tokens_reported"] for t in turns),
                    "token_ids_from": sorted({t["token_ids_from"] for t in turns}),
                }
            rows.append(row)
        by = {r["variant"]: r for r in rows}
        for r in rows:  # ratios of medians: the other variant's time over this one's (above 1: this one is faster)
            for ref in ("text", "exact", "vllm"):
                other = by.get(ref)
                r[f"speedup_vs_{ref}"] = other["end_to_end_s"] / r["end_to_end_s"] if other else None
            r["speedup_by_workload"] = {name: {f"vs_{ref}": by[ref][f"{name}_s"] / r[f"{name}_s"]
                                               for ref in ("text", "exact", "vllm") if ref in by} for name in names}
        cold(cached)  # the last checks the audit sampled run (untimed), so its record below is complete
        audit = getattr(cached.stats(), "audit", None)
        documents = {wl.name: len(cached.tokenize(wl.document)) for wl in base}
        personas = {wl.name: {a.name: len(cached.tokenize(a.persona)) for a in wl.agents.values()} for wl in base}
        return {"rows": rows, "reuse_supported": reuse_kw, "skipped_variants": skipped,
                "document_tokens": documents, "persona_tokens": personas, "peer": peer_info,
                "audit": audit.model_dump() if audit is not None else None}
    finally:
        if peer is not None:
            peer.stop()
        cached.close()
        if plain is not None:
            plain.close()


def run(dtypes: Sequence[str] = DEFAULT_DTYPES, names: Sequence[str] = tuple(WORKLOADS), repeats: int = DEFAULT_REPEATS,
        tf_passes: int = DEFAULT_TF_PASSES, max_tokens: int = 32, quick: bool = False,
        variants: Sequence[str] = KVBATON_VARIANTS, peer: PeerConfig | None = None) -> dict[str, Any]:
    """``peer``: run the ``vllm`` variant too (float32 only), added to ``variants`` when missing."""
    if "exact" not in variants:
        raise ValueError("the exact variant is the fidelity reference: it always runs")
    if "vllm" in variants and peer is None:
        raise ValueError("the vllm variant needs a PeerConfig (--peer-vllm)")
    if peer is not None:
        variants = list(dict.fromkeys([*variants, "vllm"]))
    per_dtype = {d: run_dtype(d, names, repeats, tf_passes, max_tokens, quick, variants, peer) for d in dtypes}
    first = per_dtype[dtypes[0]]
    wls = workloads_of(names, 0, quick)
    if peer is None:
        peer_record: dict[str, Any] = {"engine": "vllm", "ran": False,
                                       "reason": "not asked for (--peer-vllm PYTHON or $" + VLLM_PYTHON_ENV + ")"}
    elif VLLM_DTYPE in dtypes:
        peer_record = dict(per_dtype[VLLM_DTYPE]["peer"] or {})
    else:
        peer_record = {"engine": "vllm", "ran": False, "reason": VLLM_SKIPPED_DTYPE}
    if peer is not None:
        peer_record["skipped_dtypes"] = {d: VLLM_SKIPPED_DTYPE for d in dtypes if d != VLLM_DTYPE}
    return {
        "benchmark": "agents",
        "dtypes": list(dtypes),
        "workloads": list(names),
        "turns_per_workload": {wl.name: len(wl.turns) for wl in wls},
        "workload_meta": {wl.name: wl.meta for wl in wls},
        "document_tokens": first["document_tokens"],
        "persona_tokens": first["persona_tokens"],
        "max_tokens": max_tokens,
        "repeats": repeats,
        "tf_passes": tf_passes,
        "min_tf_turns": MIN_TF_TURNS,
        "reuse_supported": all(p["reuse_supported"] for p in per_dtype.values()),
        "skipped_variants": sorted({v for p in per_dtype.values() for v in p["skipped_variants"]}),
        "kl": {"measured": True, "reason": KL_NOTE},
        "peer": peer_record,
        "audit": {d: p["audit"] for d, p in per_dtype.items()},
        "rows": [r for p in per_dtype.values() for r in p["rows"]],
    }


def main(argv: list[str] | None = None) -> None:
    from kvbaton.bench.headline import targets

    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench agents", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=list(DEFAULT_DTYPES), choices=["float32", "bfloat16"],
                        help="engine dtypes, one client each (default: both)")
    parser.add_argument("--only", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS), metavar="WORKLOAD",
                        help=f"workloads to run (default all: {', '.join(WORKLOADS)})")
    parser.add_argument("--variants", nargs="+", default=list(KVBATON_VARIANTS), choices=list(VARIANTS),
                        help="variants to run (exact always runs: it is the fidelity reference; vllm runs whenever "
                             "--peer-vllm is given)")
    parser.add_argument("--peer-vllm", metavar="PYTHON", default=os.environ.get(VLLM_PYTHON_ENV) or None,
                        help=f"the python of a venv with vLLM's CPU build (scripts/peer_vllm.sh builds one): adds the "
                             f"variant vllm, its OpenAI server started from it, float32 only (default: "
                             f"${VLLM_PYTHON_ENV} if set, else no vllm; '' turns it off)")
    parser.add_argument("--vllm-models", type=Path, default=None,
                        help="where the vLLM-ready copy of the checkpoint is made once (default: <vLLM venv>/kvbaton-models)")
    parser.add_argument("--vllm-startup-timeout", type=float, default=VLLM_STARTUP_TIMEOUT_S,
                        help=f"seconds to wait for the vLLM server's /health (default {VLLM_STARTUP_TIMEOUT_S:.0f})")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed repetitions of every variant, alternating (default {DEFAULT_REPEATS}; "
                             "1 with --quick)")
    parser.add_argument("--tf-passes", type=int, default=None,
                        help=f"teacher-forced passes of each approximate variant, pass p on documents of seed p "
                             f"(default {DEFAULT_TF_PASSES}: 63 reusing-agent turns; 1 with --quick; 0: none)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="greedy tokens per turn, EOS ignored (default 32; 4 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: short documents, fewer turns, 1 repeat, 1 teacher-forced pass")
    record.add_arguments(parser, "agents")
    args = parser.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else DEFAULT_REPEATS)
    tf_passes = args.tf_passes if args.tf_passes is not None else (1 if args.quick else DEFAULT_TF_PASSES)
    max_tokens = args.max_tokens if args.max_tokens is not None else (4 if args.quick else 32)
    if repeats < 1 or tf_passes < 0 or max_tokens < 1:
        parser.error("--repeats and --max-tokens must be >= 1, --tf-passes >= 0")
    if "vllm" in args.variants and not args.peer_vllm:
        parser.error(f"the vllm variant needs --peer-vllm PYTHON (or ${VLLM_PYTHON_ENV})")
    variants = list(dict.fromkeys(["exact", *(v for v in args.variants if v != "vllm")]))
    args.quick_record = args.quick_record or args.quick  # a smoke run is never published
    with record.Recording.from_args("agents", args, argv) as rec:
        peer = None
        if args.peer_vllm:
            peer = PeerConfig(args.peer_vllm, args.vllm_models, rec.out_dir / "vllm-server.log",
                              args.vllm_startup_timeout)
        payload = run(args.dtypes, args.only, repeats, tf_passes, max_tokens, args.quick, variants, peer)
        print(table(payload))
        print()
        for line in notes(payload):
            print(f"- {line}")
        print()
        for target in targets(payload):
            print(target.line())
        print(f"\nwritten: {rec.write(payload)}")
