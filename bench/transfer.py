"""Multi-device: KV transfer vs recompute between workers, and fork across workers vs text replay.

All measured in one run on one cluster of Ray worker actors (default: two CPU workers on a private
Ray instance, KV through Ray's object store; ``--transport collective`` for a gloo/NCCL group,
``--ray-address`` for a running Ray cluster):

(1) crossover: a handle of L tokens lives on worker 0 and is needed on worker 1. Measured side by
    side: moving its KV blocks over the cluster's transport (transfer) and recomputing it from lineage on
    worker 1 (recompute), for each context length and each bandwidth cap (slow links are EMULATED:
    the transfer is paced to the cap over the real link; "none" = the unpaced link).
    Also shown: the cost model's predictions and choice, and whether that choice was the faster one
    measured. Then, per length, cells at the model's own crossover: the link speed at which its
    calibrated line predicts transfer and recompute to take equally long (bytes / (predicted
    recompute - link latency - resume overhead), from the line as the sweep left it), times each of
    ``--crossover-factors`` (0.8, 1, 1.25: just on either side of it and on it), where a wrong
    prediction flips the choice.
(2) fork across workers: a shared context, k = 1, 2, 4, 8, 16 branches each resuming with its own
    short suffix, all at once. Handles: materialize once, fork k, resume the children (placement
    spreads them over the workers, moving KV as the cost model says). Text replay: k plain
    completions of context + suffix. Total wall time and peak KV bytes per worker.

The prefix cache is off in the workers, so recompute and replay really recompute. Every crossover
cell runs ``--repeats`` times per method (median [min–max]; all repeats in the record). Each row
also states the cost model's prediction error (predicted / measured - 1, for both methods), and the
record holds a least-squares refit of the prefill line over every measured recompute
(``recompute_refit``), with its error per row: how far the startup calibration is from the line the
measurements themselves give.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from kvbaton import SamplingParams
from kvbaton.backend.cluster.costmodel import fit_line, prediction_error
from kvbaton.bench import record
from kvbaton.bench.common import NOT_MEASURED, format_table, parallel, rate
from kvbaton.bench.corpus import document
from kvbaton.bench.spread import cell, measured
from tqdm.auto import tqdm

DEFAULT_LENGTHS = (128, 512, 1024, 2048)
DEFAULT_CAPS = ("none", "1e8", "3e7", "1e7", "3e6")
DEFAULT_KS = (1, 2, 4, 8, 16)
DEFAULT_CROSSOVER_FACTORS = (0.8, 1.0, 1.25)


def descendants_cpu_s(root: int | None = None) -> float:
    """CPU seconds used so far by this process's grandchildren and deeper (Ray's worker actors and agents,
    children of its raylet): the kernel never counts them as this process's waited-for children, so a
    record would take them for other load on the machine (:func:`kvbaton.bench.record.note_own_cpu`).
    The direct children (raylet, GCS) are waited for when Ray shuts down and count as this run's anyway."""
    root = os.getpid() if root is None else root
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick

    def depth(pid: int) -> int:
        d = 0
        while pid in parents and d < 64:
            pid = parents[pid]
            d += 1
            if pid == root:
                return d
        return 0

    return sum(seconds for pid, seconds in cpu.items() if depth(pid) >= 2)


def _cap(text: str) -> float | None:
    return None if text.lower() in ("none", "0", "") else float(text)


def worker_bytes(cluster: Any) -> record.Poll:
    """The poll of a cluster's KV pools: bytes in use per worker rank, in one stats call."""
    return lambda: {w.rank: w.stats.pool_bytes_used for w in cluster.stats().cluster.workers if w.stats is not None}


def per_worker(sampler: record.PeakSampler) -> dict[int, int]:
    return {int(key.split(":")[1]): v for key, v in sampler.peak.items()}


def _cell(cluster: Any, corpus: list[int], cap: float | None, length: int, repeats: int,
          offset: int) -> tuple[dict[str, Any], int]:
    """One crossover cell: transfer and recompute of fresh ``length``-token handles over a link paced
    to ``cap`` (None: unpaced), ``repeats`` times each; the row and the next corpus offset."""
    cal = cluster.set_bandwidth_cap(cap)
    link = {"link_bandwidth_bytes_per_s": cal.bandwidth_bytes_per_s, "link_latency_s": cal.latency_s,
            "resume_overhead_s": cal.resume_overhead_s}  # as measured for this cap: what the model predicts with
    times: dict[str, list[float]] = {"transfer": [], "recompute": []}
    decision = None
    for _ in range(repeats):
        for method in ("transfer", "recompute"):
            # Fresh tokens each time: nothing of them is anywhere but in this handle.
            offset = (offset + 97) % max(1, len(corpus) - length)
            handle = cluster.materialize(corpus[offset: offset + length])
            src = handle.placement.worker
            start = time.perf_counter()
            cluster.transfer(handle, 1 - src, method=method)
            times[method].append(time.perf_counter() - start)
            decision = [d for d in cluster.stats().cluster.decisions if d.handle == handle.id][-1]
            cluster.release(handle)
    assert decision is not None
    choice = "transfer" if decision.predicted_transfer_s < decision.predicted_recompute_s else "recompute"
    row: dict[str, Any] = {"cell": "sweep", "bandwidth_cap_bytes_per_s": cap, "context_tokens": length,
                           "kv_bytes": decision.bytes, **link}
    measured(row, "transfer_s", times["transfer"])
    measured(row, "recompute_s", times["recompute"])
    row.update({
        "predicted_transfer_s": decision.predicted_transfer_s,
        "predicted_recompute_s": decision.predicted_recompute_s,
        "transfer_error": prediction_error(decision.predicted_transfer_s, row["transfer_s"]),
        "recompute_error": prediction_error(decision.predicted_recompute_s, row["recompute_s"]),
        "model_choice": choice,
        "faster_measured": "transfer" if row["transfer_s"] < row["recompute_s"] else "recompute",
        "recompute_over_transfer": row["recompute_s"] / row["transfer_s"],
    })
    return row, offset


def crossover_speed(row: dict[str, Any]) -> float | None:
    """The link speed (bytes/s) at which the cost model predicts transfer and recompute of ``row``'s
    handle to take equally long: ``bytes / (predicted recompute - latency - resume overhead)``, with
    the row's own prediction and link measurement. None when recompute is predicted cheaper than the
    fixed costs of any transfer (no link is fast enough)."""
    spare = row["predicted_recompute_s"] - row["link_latency_s"] - row["resume_overhead_s"]
    return row["kv_bytes"] / spare if spare > 0 else None


def crossover(cluster: Any, corpus: list[int], lengths: tuple[int, ...], caps: tuple[str, ...],
              repeats: int, factors: tuple[float, ...] = DEFAULT_CROSSOVER_FACTORS) -> list[dict[str, Any]]:
    rows = []
    offset = 0
    cells = [(cap, length) for cap in caps for length in lengths]
    for cap, length in tqdm(cells, desc="transfer vs recompute", unit="cell"):
        row, offset = _cell(cluster, corpus, _cap(cap), length, repeats, offset)
        rows.append(row)
    # At the model's own crossover: from each length's latest prediction (the line refits online as
    # recomputes are observed) and the unpaced link's fixed costs.
    unpaced = cluster.set_bandwidth_cap(None)
    targets = []
    for length in lengths:
        latest = [r for r in rows if r["context_tokens"] == length][-1]
        speed = crossover_speed({**latest, "link_latency_s": unpaced.latency_s,
                                 "resume_overhead_s": unpaced.resume_overhead_s})
        targets += [(length, speed, f) for f in factors] if speed is not None else []
    for length, speed, factor in tqdm(targets, desc="at the predicted crossover", unit="cell"):
        row, offset = _cell(cluster, corpus, speed * factor, length, repeats, offset)
        row.update({"cell": "crossover", "crossover_factor": factor, "predicted_crossover_bytes_per_s": speed})
        rows.append(row)
    cluster.set_bandwidth_cap(None)
    return rows


def refit(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Least-squares prefill line over every measured recompute (each repeat a point), and each
    row's error against it: what the calibration would predict had it probed these lengths."""
    points = [(float(r["context_tokens"]), t) for r in rows for t in r["runs"]["recompute_s"]]
    fixed, per_token = fit_line(points)
    for r in rows:
        r["refit_predicted_recompute_s"] = fixed + per_token * r["context_tokens"]
        r["refit_recompute_error"] = prediction_error(r["refit_predicted_recompute_s"], r["recompute_s"])
    return {"fixed_s": fixed, "per_token_s": per_token, "points": len(points)}


def fork_across(cluster: Any, corpus: list[int], context_tokens: int, ks: tuple[int, ...], max_tokens: int,
                suffix_tokens: int) -> list[dict[str, Any]]:
    context = corpus[:context_tokens]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for k in tqdm(ks, desc="fork across workers", unit="k"):
        suffixes = [corpus[-(i + 1) * suffix_tokens: len(corpus) - i * suffix_tokens] for i in range(k)]
        before = len(cluster.stats().cluster.decisions)
        with record.PeakSampler({"worker": worker_bytes(cluster)}) as handles_peak:
            start = time.perf_counter()
            parent = cluster.materialize(context)
            children = cluster.fork(parent, k)
            results = parallel([lambda c=c, s=s: cluster.resume(c, s, params) for c, s in zip(children, suffixes)])
            handles_s = time.perf_counter() - start
        decisions = cluster.stats().cluster.decisions[before:]
        cluster.release([parent, *children, *(r.handle for r in results)])
        with record.PeakSampler({"worker": worker_bytes(cluster)}) as replay_peak:
            start = time.perf_counter()
            replayed = parallel([lambda s=s: cluster.complete(context + s, params) for s in suffixes])
            replay_s = time.perf_counter() - start
        cluster.release([r.handle for r in replayed])
        peak_handles, peak_replay = per_worker(handles_peak), per_worker(replay_peak)
        workers = sorted(set(peak_handles) | set(peak_replay))
        rows.append({
            "k": k,
            "handles_s": handles_s,
            "replay_s": replay_s,
            "replay_over_handles": replay_s / handles_s,
            "moves": len(decisions),
            "moves_transfer": sum(d.choice == "transfer" for d in decisions),
            "peak_kv_bytes_handles": {w: peak_handles.get(w, 0) for w in workers},
            "peak_kv_bytes_replay": {w: peak_replay.get(w, 0) for w in workers},
        })
    return rows


def run(devices: list[str], lengths: tuple[int, ...], caps: tuple[str, ...], ks: tuple[int, ...],
        context_tokens: int, max_tokens: int, suffix_tokens: int, repeats: int, kv_budget: str,
        worker_threads: int | None, balance_slack: int = 1,
        factors: tuple[float, ...] = DEFAULT_CROSSOVER_FACTORS, ray_address: str | None = None,
        transport: str = "auto") -> dict[str, Any]:
    from kvbaton.backend.cluster import Cluster

    need = max([*lengths, context_tokens]) + max(ks) * suffix_tokens + 200
    with Cluster(devices, engine_options={"kv_budget": kv_budget, "prefix_cache": False},
                 calibration_cache=None, worker_threads=worker_threads, balance_slack=balance_slack,
                 ray_address=ray_address, transport=transport) as cluster:
        corpus = cluster.tokenize(document(int(need * 1.2), seed=23))[:need]
        record.watch_kv("cluster", worker_bytes(cluster))
        warm = cluster.materialize(corpus[:32])
        cluster.release(warm)
        cal = cluster.stats().cluster
        cross = crossover(cluster, corpus, lengths, caps, repeats, factors)
        recompute_refit = refit(cross)
        fork = fork_across(cluster, corpus, context_tokens, ks, max_tokens, suffix_tokens)
        model = cluster.loaded.name
        used = cluster.transport
        record.note_own_cpu(descendants_cpu_s())  # the workers' CPU is this run's, not other load
    return {
        "benchmark": "transfer", "model": model, "devices": devices, "worker_threads": worker_threads,
        "backend": "ray", "transport": used,
        "balance_slack": balance_slack,
        "calibration": {"bandwidth_bytes_per_s": cal.bandwidth_bytes_per_s, "latency_s": cal.latency_s,
                        "prefill_tokens_per_s": {w.rank: w.prefill_tokens_per_s for w in cal.workers}},
        "context_tokens": context_tokens, "max_tokens": max_tokens, "suffix_tokens": suffix_tokens,
        "repeats": repeats, "crossover": cross, "recompute_refit": recompute_refit, "fork": fork,
    }


def _predicted(seconds: float | None, error: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.3f} ({error:+.0%})" if error is not None else f"{seconds:.3f}"


def link_of(row: dict[str, Any]) -> str:
    """The link a cell ran over, in words: the unpaced link, a paced sender's rate, or a rate at the
    model's predicted crossover."""
    cap = row.get("bandwidth_cap_bytes_per_s")
    if cap is None:
        return "unpaced"
    if row.get("cell") == "crossover":
        return f"{row['crossover_factor']:g} x crossover = {rate(cap)}"
    return f"paced {rate(cap)}"


def table(payload: dict[str, Any]) -> str:
    cross = format_table(
        ["link (paced: sender-side pacing)", "context", "KV MB", "transfer s", "recompute s",
         "pred. transfer s (error)", "pred. recompute s (error)", "refit recompute s (error)", "model picks",
         "faster"],
        [[link_of(r), r["context_tokens"], r["kv_bytes"] / 1e6, cell(r, "transfer_s"), cell(r, "recompute_s"),
          _predicted(r.get("predicted_transfer_s"), r.get("transfer_error")),
          _predicted(r.get("predicted_recompute_s"), r.get("recompute_error")),
          _predicted(r.get("refit_predicted_recompute_s"), r.get("refit_recompute_error")),
          r["model_choice"], r["faster_measured"]] for r in payload["crossover"]],
    )
    fork = format_table(
        ["k", "handles s", "replay s", "replay/handles", "moves (transfers)", "peak KV MB/worker handles",
         "peak KV MB/worker replay"],
        [[r["k"], r["handles_s"], r["replay_s"], f"{r['replay_over_handles']:.2f}x",
          f"{r['moves']} ({r['moves_transfer']})",
          " / ".join(f"{v / 1e6:.1f}" for v in r["peak_kv_bytes_handles"].values()),
          " / ".join(f"{v / 1e6:.1f}" for v in r["peak_kv_bytes_replay"].values())] for r in payload["fork"]],
    )
    fit = payload.get("recompute_refit")
    line = (f"\n\nprefill line refitted over {fit['points']} measured recomputes: "
            f"{fit['fixed_s']:.3f} s + {fit['per_token_s'] * 1e3:.3f} ms/token") if fit else ""
    if not any(r.get("cell") == "crossover" for r in payload["crossover"]):
        line += ("\n\nCells at the cost model's predicted crossover (the link speed at which it predicts transfer "
                 f"and recompute to take equally long): {NOT_MEASURED}.")
    return f"{cross}{line}\n\n{fork}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench transfer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="cpu,cpu", help="worker devices (default cpu,cpu)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help="context lengths")
    parser.add_argument("--caps", nargs="+", default=list(DEFAULT_CAPS),
                        help="bandwidth caps in bytes/s to sweep; 'none' = unpaced link")
    parser.add_argument("--ks", type=int, nargs="+", default=list(DEFAULT_KS), help="fork branch counts")
    parser.add_argument("--context", type=int, default=1024, help="shared context tokens of the fork phase")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each branch generates")
    parser.add_argument("--suffix", type=int, default=16, help="tokens of each branch's own suffix")
    parser.add_argument("--repeats", type=int, default=2,
                        help="repetitions per crossover cell (all kept; median [min–max] reported)")
    parser.add_argument("--kv-budget", default="1GiB", help="KV pool per worker")
    parser.add_argument("--worker-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="torch threads per CPU worker (default: cores / 2)")
    parser.add_argument("--balance-slack", type=int, default=1,
                        help="queue-length difference before a request moves off its handle's worker (default 1)")
    parser.add_argument("--crossover-factors", type=float, nargs="*", default=list(DEFAULT_CROSSOVER_FACTORS),
                        help="cells per length at these multiples of the link speed the cost model predicts as the "
                        "crossover (default 0.8 1 1.25; none: no such cells)")
    parser.add_argument("--ray-address", default=None,
                        help="run the workers on this Ray cluster (default: a private Ray instance here)")
    parser.add_argument("--transport", default="auto", choices=["auto", "collective", "object-store"],
                        help="how KV moves between workers (default auto: NCCL with a GPU each, else the object store)")
    record.measure_and_write(parser, "transfer", argv, lambda args: run(
        [d.strip() for d in args.devices.split(",")], tuple(args.lengths), tuple(args.caps), tuple(args.ks),
        args.context, args.max_tokens, args.suffix, args.repeats, args.kv_budget, args.worker_threads,
        args.balance_slack, tuple(args.crossover_factors), args.ray_address, args.transport), table)
