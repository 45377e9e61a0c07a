"""GPU check of the Ray multi-device backend (issue 48): KV transfer exactness between two workers.

Two worker actors on the GPU(s) this machine has, on a private Ray instance:

- two GPUs or more: a worker on each, KV moved over NCCL (the collective group formed inside the
  actors) and over Ray's object store;
- one GPU: two workers sharing it (two processes, half a GPU each in Ray's accounting). NCCL refuses
  two ranks on one device ("Duplicate GPU detected"), so the collective group is gloo there (through
  host memory), and the object store as well; the NCCL check needs a second GPU and says so.

For each transport: a handle materialized on worker A is forked; one child is resumed on A (the
reference), one is moved to B by KV transfer and resumed there, one is moved by recompute and resumed
there; all three give the same greedy fp32 tokens, and the same as dense prefill with plain
transformers on the same GPU. The calibrated link is recorded. ``--smoke-cpu`` runs the same logic on
two CPU workers (gloo), for a machine without a GPU.

Usage: python scripts/gpu_multidevice.py [--results-dir results] [--smoke-cpu]
Exit status 1 when an exactness check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from kvbaton import SamplingParams
from kvbaton.bench.corpus import document

SUFFIX = "\n\nQuestion: what is the main point of these notes?\nAnswer:"
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def plan(smoke_cpu: bool) -> tuple[list[str], float, list[str], str | None]:
    """Devices, GPU share per worker, transports to check, and why NCCL is not among them (None: it is)."""
    if smoke_cpu:
        return ["cpu", "cpu"], 1.0, ["collective", "object-store"], "--smoke-cpu: no GPU asked for"
    if not torch.cuda.is_available():
        return [], 0.0, [], "no CUDA device here: the NCCL check was skipped"
    if torch.cuda.device_count() >= 2:
        return ["cuda", "cuda"], 1.0, ["collective", "object-store"], None
    return (["cuda", "cuda"], 0.5, ["collective", "object-store"],
            "one GPU: NCCL refuses two ranks on one device, so the two workers sharing it use gloo")


def dense_greedy(model: Any, tokens: list[int], n: int, device: str) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([tokens], device=device), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n)
    return [int(t) for t in out[0, len(tokens):]]


def check(cluster: Any, context: list[int], suffix: list[int]) -> dict[str, Any]:
    root = cluster.materialize(context)
    a = root.placement.worker
    b = 1 - a
    same, moved, recomputed = cluster.fork(root, 3)
    reference = cluster.resume(same, suffix, GREEDY)
    t0 = time.perf_counter()
    cluster.transfer(moved, b, method="transfer")
    transfer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cluster.transfer(recomputed, b, method="recompute")
    recompute_s = time.perf_counter() - t0
    via_transfer = cluster.resume(moved, suffix, GREEDY)
    via_recompute = cluster.resume(recomputed, suffix, GREEDY)
    assert via_transfer.handle.placement.worker == b and via_recompute.handle.placement.worker == b
    cluster.release([root, same, moved, recomputed, reference.handle, via_transfer.handle, via_recompute.handle])
    return {"reference": reference.token_ids, "transfer": via_transfer.token_ids,
            "recompute": via_recompute.token_ids, "transfer_s": transfer_s, "recompute_s": recompute_s,
            "kv_bytes": cluster.stats().cluster.decisions[-2].bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("--smoke-cpu", action="store_true", help="two CPU workers (gloo): no GPU needed")
    parser.add_argument("--context-tokens", type=int, default=600)
    args = parser.parse_args(argv)
    devices, share, transports, no_nccl = plan(args.smoke_cpu)
    record: dict[str, Any] = {"check": "gpu_multidevice", "devices": devices, "gpu_share": share,
                              "nccl_skipped": no_nccl, "torch": torch.__version__,
                              "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    if no_nccl:
        log(no_nccl)
    if not devices:
        print(json.dumps(record, indent=1))
        return 0
    from kvbaton.backend.cluster import Cluster
    from kvbaton.backend.compute.loader import load_model

    device = "cuda" if devices[0] == "cuda" else "cpu"
    model = load_model(attn_implementation="sdpa").model.to(device=device, dtype=torch.float32).eval()
    ok = True
    record["runs"] = []
    for transport in transports:
        log(f"two workers on {devices} (GPU share {share}), transport {transport}")
        with Cluster(devices, engine_options={"dtype": "float32", "kv_budget": "1GiB"}, transport=transport,
                     gpu_share=share, calibration_cache=None, worker_threads=2 if device == "cpu" else None) as c:
            context = c.tokenize(document(int(args.context_tokens * 1.2), seed=48))[: args.context_tokens]
            suffix = c.tokenize(SUFFIX)
            run = check(c, context, suffix)
            dense = dense_greedy(model, context + suffix, GREEDY.max_tokens, device)
            cal = c.stats().cluster
            run.update({"transport": c.transport, "dense": dense,
                        "link_bandwidth_bytes_per_s": cal.bandwidth_bytes_per_s, "link_latency_s": cal.latency_s})
            run["exact"] = run["reference"] == run["transfer"] == run["recompute"] == dense
            ok &= run["exact"]
            log(f"{c.transport}: exact={run['exact']} transfer {run['transfer_s']:.3f} s, recompute "
                f"{run['recompute_s']:.3f} s, link {cal.bandwidth_bytes_per_s / 1e9:.2f} GB/s")
            record["runs"].append(run)
    out = Path(args.results_dir) / f"gpu_multidevice-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    log(f"record: {out}; all exact: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
