"""What the agents benchmark prints and docs/results.md shows: its table, the per-agent table of
reuse shares, and the notes under them (fidelity claims, the audit, how the vLLM peer ran).

Reads records only (the payload of :func:`kvbaton.bench.agents.run`, or a committed record).
"""

from __future__ import annotations

from typing import Any

from kvbaton.bench.agents_fidelity import KL_NOTE, MIN_TF_TURNS
from kvbaton.bench.common import format_table
from kvbaton.bench.spread import cell
from kvbaton.bench.vllm_peer import VLLM_DTYPE


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value else "-"


def table(payload: dict[str, Any]) -> str:
    names = payload["workloads"]
    peer = any(r.get("speedup_vs_vllm") for r in payload["rows"])
    columns = ["dtype", "variant", "end-to-end s", "vs text", "vs exact", *(["vs vLLM"] if peer else []),
               *(f"{n} s" for n in names), "reused exact", "reused approx", "prefilled", "TF 1st token",
               f"TF {payload['max_tokens']}-token prefix", "TF turns", "free-running same text"]
    rows = []
    for r in payload["rows"]:
        s, tf = r["shares"], r.get("teacher_forced")
        rows.append([r["dtype"], r["variant"], cell(r, "end_to_end_s", 2), _ratio(r.get("speedup_vs_text")),
                     _ratio(r.get("speedup_vs_exact")) if r["variant"] != "exact" else "-",
                     *([_ratio(r.get("speedup_vs_vllm")) if r["variant"] != "vllm" else "-"] if peer else []),
                     *(cell(r, f"{n}_s", 2) for n in names), _pct(s["reused_exact_share"]),
                     _pct(s["reused_approx_share"]), _pct(s["prefilled_share"]),
                     _pct(tf["first_token"]) if tf else "-", _pct(tf["prefix"]) if tf else "-",
                     f"{tf['turns']} ({tf['turns_approximated']} approx.)" if tf else "-",
                     _pct(r["free_running"]["same_text"]) if r["variant"] != "exact" else "-"])
    title = "Prompt tokens per agent, reused exactly / approximately / prefilled (first repeat):"
    parts = [format_table(columns, rows), "", title, "", agent_table(payload)]
    return "\n".join(parts)


def agent_table(payload: dict[str, Any]) -> str:
    variants = list(dict.fromkeys(r["variant"] for r in payload["rows"]))
    by = {(r["dtype"], r["variant"]): r for r in payload["rows"]}
    rows = []
    for dtype in payload["dtypes"]:
        keys = list(by[(dtype, "exact")]["per_agent"]) if (dtype, "exact") in by else []
        for key in keys:
            cells = []
            for v in variants:
                a = by.get((dtype, v), {}).get("per_agent", {}).get(key)
                cells.append("-" if a is None else f"{_pct(a['reused_exact_share'])} / {_pct(a['reused_approx_share'])}"
                             f" / {_pct(a['prefilled_share'])}")
            turns = by[(dtype, "exact")]["per_agent"][key]
            rows.append([dtype, key, turns["turns"], round(turns["prompt_tokens"] / turns["turns"]), *cells])
    return format_table(["dtype", "workload/agent", "turns", "prompt tok/turn", *variants], rows)


def notes(payload: dict[str, Any]) -> list[str]:
    """Lines under the table in docs/results.md."""
    lines = [
        "documents: " + ", ".join(f"{k} {v} tokens" for k, v in payload["document_tokens"].items())
        + f"; {payload['max_tokens']} greedy tokens per turn; turns per repetition: "
        + ", ".join(f"{k} {v}" for k, v in payload["turns_per_workload"].items()),
    ]
    for r in payload["rows"]:
        tf = r.get("teacher_forced")
        if tf:
            enough = tf["turns"] >= payload.get("min_tf_turns", MIN_TF_TURNS)
            kl = r.get("kl")
            if kl:
                lines.append(f"{r['dtype']} {r['variant']}: KL(dense || approximate) after {kl['turns']} approximated "
                             f"turns: mean {kl['mean']:.4f}, median {kl['median']:.4f}, max {kl['max']:.4f} nats")
            lines.append(f"{r['dtype']} {r['variant']}: teacher-forced first-token agreement {_pct(tf['first_token'])} "
                         f"over {tf['turns']} reusing-agent turns ({tf['turns_approximated']} approximated) — "
                         + ("enough turns for a first-token claim" if enough else
                            f"**fewer than {payload.get('min_tf_turns', MIN_TF_TURNS)} turns: no first-token claim**"))
        rejected = r.get("rejections")
        if rejected and rejected["turns"]:
            lines.append(f"{r['dtype']} {r['variant']}: the confidence gate rejected {rejected['turns']} teacher-forced "
                         f"turns ({rejected['tokens_discarded']} token-forwards thrown away); their time to first token "
                         f"over exact's for the same prompt: median {rejected['ttft_over_exact_median']:.2f}x, max "
                         f"{rejected['ttft_over_exact_max']:.2f}x")
    for dtype, audit in (payload.get("audit") or {}).items():
        if audit:
            inside = sum(w.get("background_forwards", 0) for r in payload["rows"] if r["dtype"] == dtype
                         for w in r["run_detail"]["workloads"].values())
            lines.append(f"{dtype}: the fidelity audit checked {audit['checked']} approximate answers against dense "
                         f"prefill ({audit['agreed']} agreed, {audit['dropped']} dropped); it waits for a quiet engine, "
                         f"so the checks ran between workloads, untimed ({inside} of its forwards fell inside the "
                         "timed first repeat)")
    if payload.get("skipped_variants"):
        lines.append("not run: " + ", ".join(payload["skipped_variants"]) + " (this engine's generate() has no reuse= "
                     "keyword)")
    lines += peer_notes(payload)
    lines.append("KL: " + payload.get("kl", {}).get("reason", KL_NOTE))
    return lines


def peer_notes(payload: dict[str, Any]) -> list[str]:
    """What the ``vllm`` row is, how it ran, and what favours either side."""
    peer = payload.get("peer") or {}
    if not peer.get("ran"):
        return [f"vllm: not in this run: {peer.get('reason', 'no --peer-vllm')}"] if peer else []
    row = next((r for r in payload["rows"] if r["variant"] == "vllm"), None)
    same = peer.get("same_prompt_ids_as_kvbaton") or {}
    env = ", ".join(f"{k}={v}" for k, v in (peer.get("env") or {}).items())
    server = peer.get("server_command") or []
    lines = [
        f"vllm: vLLM {peer.get('version')} (CPU build, torch {peer.get('torch')}), its OpenAI-compatible server started "
        f"by this run: `{' '.join(server)}` with {env}; {VLLM_DTYPE} only; ready in {peer['startup_s']:.0f} s "
        "(not counted); prompts are kvbaton's `chat_tokens` ids, greedy, EOS ignored, after the same ~2.4K-token warm-up request; "
        "vLLM's own rendering of the same chats gives " + ("the same ids" if same and all(same.values()) else
                                                            f"**different ids** ({same})"),
        f"vllm: cold start: {peer.get('cold_start')}",
    ]
    fanned = [name for name, meta in (payload.get("workload_meta") or {}).items() if meta.get("via") == "langgraph"]
    if fanned:
        lines.append(f"vllm: {', '.join(fanned)}: the map turns are sent at once, as the LangGraph app's `Send` fan-out "
                     "sends them to kvbaton, then the reducer" if peer.get("maps_at_once") else
                     f"vllm: {', '.join(fanned)}: the map turns were sent one after another (kvbaton's LangGraph app "
                     "sends them at once): this record's vLLM times for it are not comparable")
    if row is not None:
        v = row.get("vllm") or {}
        timing = "vllm: its seconds are the client's, HTTP on 127.0.0.1 included (kvbaton runs in-process)"
        if v.get("server_seconds") is not None and v.get("turn_seconds"):
            timing += (f"; vLLM's own per-request timings (queue + prefill + decode) are "
                       f"{_pct(v['server_seconds'] / v['turn_seconds'])} of them (first repeat)")
        lines.append(timing)
        reuse = ("vLLM's `usage.prompt_tokens_details.cached_tokens`, counted as exact reuse"
                 if v.get("cached_tokens_reported") else "**vLLM reported no cached_tokens: its reuse reads 0**")
        lines.append(f"vllm: reused = {reuse}; output token ids from {', '.join(v.get('token_ids_from') or ['?'])}; "
                     f"free-running same text as kvbaton exact in {_pct(row['free_running']['same_text'])} of "
                     f"{row['free_running']['turns']} reusing-agent turns, same first token in "
                     f"{_pct(row['free_running']['first_token'])}")
    if peer.get("kvbaton_variants_s"):
        lines.append(f"vllm: the idle server used {peer['server_cpu_s_during_kvbaton']:.1f} CPU-seconds while the kvbaton "
                     f"variants ran ({peer['kvbaton_variants_s']:.0f} s)")
    for dtype, why in (peer.get("skipped_dtypes") or {}).items():
        lines.append(f"vllm: not run for {dtype}: {why}")
    return lines
