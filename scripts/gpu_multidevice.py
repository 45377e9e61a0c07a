"""GPU check of the multi-device backend (issue 7), for one run of at most 8 minutes on one H200.

1. Block copy bandwidth of the KV pool on cuda: device->host (pageable and pinned) and
   host(pinned)->device, for the default model's block shape and a Llama-8B block shape.
2. Exactness on cuda: two workers on the GPU (one GPU: they share it, and gloo moves blocks through
   host memory; with one GPU per worker the same code uses NCCL). A handle materialized on worker
   A, moved to worker B (forced KV transfer, forced recompute, and the cost model's choice) and
   resumed there gives the same greedy tokens as (a) resuming it on A and (b) dense prefill with
   plain transformers on cuda.
3. TTFT table, default model (fp32) and a random-weight Llama-8B-shaped model (bf16, timing only):
   text replay vs resume on the handle's worker vs transfer+resume vs recompute+resume on the
   other worker, with the cost model's predictions.

Usage: python scripts/gpu_multidevice.py [--results-dir results] [--budget-s 460]
Exit status 1 when an exactness check fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from kvbaton import SamplingParams
from kvbaton.backend.cache.block_pool import BlockPool, PoolShape
from kvbaton.backend.cluster import Cluster
from kvbaton.backend.compute.loader import convert_default_model, load_model
from kvbaton.bench.common import format_table, machine_info, write_results
from kvbaton.bench.corpus import QUESTIONS, document

START = time.monotonic()
DEVICE = "cuda"  # --smoke-cpu switches it


def elapsed() -> float:
    return time.monotonic() - START


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


# -- 1. copy bandwidth ---------------------------------------------------------------------------


def copy_bandwidth(name: str, shape: PoolShape, blocks: int = 256, repeats: int = 5) -> dict[str, Any]:
    pool = BlockPool(shape, blocks, "cuda")
    pool.k.normal_()
    pool.v.normal_()
    bs = shape.block_size
    host_k = torch.empty((shape.num_layers, shape.num_kv_heads, bs, shape.head_dim), dtype=shape.dtype)
    pinned_k = host_k.pin_memory()
    pinned_v = torch.empty_like(host_k).pin_memory()
    nbytes = blocks * shape.bytes_per_block

    def timed(fn: Any) -> float:
        fn()  # warm-up
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def d2h_pageable() -> None:
        for b in range(blocks):
            k, v = pool.read_block(b)
            k.to("cpu")
            v.to("cpu")

    def d2h_pinned() -> None:
        for b in range(blocks):
            s = b * bs
            pinned_k.copy_(pool.k[:, :, s: s + bs], non_blocking=True)
            pinned_v.copy_(pool.v[:, :, s: s + bs], non_blocking=True)

    def h2d_pinned() -> None:
        for b in range(blocks):
            pool.write_block(b, pinned_k, pinned_v)

    row = {
        "shape": name, "bytes_per_block": shape.bytes_per_block, "blocks": blocks,
        "d2h_pageable_GBps": nbytes / timed(d2h_pageable) / 1e9,
        "d2h_pinned_GBps": nbytes / timed(d2h_pinned) / 1e9,
        "h2d_pinned_GBps": nbytes / timed(h2d_pinned) / 1e9,
    }
    return row


# -- 2. exactness ----------------------------------------------------------------------------------


@torch.inference_mode()
def dense_greedy(model: Any, tokens: list[int], n: int) -> list[int]:
    """Dense prefill then ``n`` greedy steps with transformers' own cache (the reference)."""
    device = next(model.parameters()).device
    out = model(torch.tensor([tokens], device=device), use_cache=True)
    cache, logits = out.cache if hasattr(out, "cache") else out.past_key_values, out.logits[0, -1]
    generated: list[int] = []
    for step in range(n):
        token = int(torch.argmax(logits))
        generated.append(token)
        if step + 1 < n:
            kwargs = {"cache": cache} if hasattr(out, "cache") else {"past_key_values": cache}
            out = model(torch.tensor([[token]], device=device), use_cache=True, **kwargs)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            logits = out.logits[0, -1]
    return generated


def exactness(cluster: Cluster, corpus: list[int], lengths: list[int], n: int = 16) -> list[dict[str, Any]]:
    reference = load_model(attn_implementation="sdpa", device=DEVICE).model
    suffix = cluster.tokenize("\n\nQuestion: " + QUESTIONS[0] + "\nAnswer:")
    greedy = SamplingParams(max_tokens=n)
    rows = []
    for length in lengths:
        context = corpus[:length]
        dense = dense_greedy(reference, context + suffix, n)
        for method in ("transfer", "recompute", "auto"):
            handle = cluster.materialize(context)
            src = handle.placement.worker
            same = cluster.resume(handle, suffix, greedy)
            cluster.release(same.handle)
            cluster.transfer(handle, 1 - src, method=method)
            moved = cluster.resume(handle, suffix, greedy)
            decision = [d for d in cluster.stats().cluster.decisions if d.handle == handle.id][-1]
            rows.append({
                "context_tokens": length, "method": method, "choice": decision.choice,
                "equal_to_same_worker": moved.token_ids == same.token_ids,
                "equal_to_dense": moved.token_ids == dense,
            })
            cluster.release([handle, moved.handle])
            log(f"exactness L={length} {method}: {rows[-1]}")
    return rows


# -- 3. TTFT -------------------------------------------------------------------------------------


def ttft(cluster: Cluster, corpus: list[int], lengths: list[int], repeats: int = 3) -> list[dict[str, Any]]:
    question = cluster.tokenize("\n\nQuestion: " + QUESTIONS[0] + "\nAnswer:")
    first = SamplingParams(max_tokens=1, ignore_eos=True)
    warm = cluster.materialize(corpus[:64])
    cluster.release(cluster.resume(warm, question, first).handle)
    cluster.release(warm)
    rows = []
    for length in lengths:
        context = corpus[:length]
        cells: dict[str, list[float]] = {"replay": [], "resume": [], "transfer": [], "recompute": []}
        moves: dict[str, list[float]] = {"transfer": [], "recompute": []}
        predicted: dict[str, float | None] = {}
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = cluster.complete(context + question, first)
            cells["replay"].append(time.perf_counter() - t0)
            cluster.release(r.handle)
            handle = cluster.materialize(context)
            t0 = time.perf_counter()
            r = cluster.resume(handle, question, first)
            cells["resume"].append(time.perf_counter() - t0)
            cluster.release([handle, r.handle])
            for method in ("transfer", "recompute"):
                handle = cluster.materialize(context)
                t0 = time.perf_counter()
                cluster.transfer(handle, 1 - handle.placement.worker, method=method)
                t1 = time.perf_counter()
                r = cluster.resume(handle, question, first)
                cells[method].append(time.perf_counter() - t0)
                moves[method].append(t1 - t0)
                d = [d for d in cluster.stats().cluster.decisions if d.handle == handle.id][-1]
                predicted = {"transfer": d.predicted_transfer_s, "recompute": d.predicted_recompute_s}
                cluster.release([handle, r.handle])
        med = {k: statistics.median(v) for k, v in cells.items()}
        rows.append({
            "context_tokens": length,
            **{f"{k}_s": v for k, v in med.items()},
            "move_transfer_s": statistics.median(moves["transfer"]),
            "move_recompute_s": statistics.median(moves["recompute"]),
            "predicted_transfer_s": predicted["transfer"],
            "predicted_recompute_s": predicted["recompute"],
        })
        log(f"ttft L={length}: {rows[-1]}")
    return rows


def ttft_table(rows: list[dict[str, Any]]) -> str:
    return format_table(
        ["context", "replay s", "resume s", "transfer+resume s", "recompute+resume s", "move: transfer s",
         "move: recompute s", "pred. transfer s", "pred. recompute s"],
        [[r["context_tokens"], r["replay_s"], r["resume_s"], r["transfer_s"], r["recompute_s"], r["move_transfer_s"],
          r["move_recompute_s"], r["predicted_transfer_s"], r["predicted_recompute_s"]] for r in rows],
    )


# -- the random Llama-8B-shaped checkpoint ------------------------------------------------------------

LLAMA_8B: dict[str, Any] = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 16384, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
}


def random_llama_8b(root: Path) -> Path:
    """A Llama-8B-shaped checkpoint with random bf16 weights and the default model's tokenizer
    (so vocab 49152 instead of 128256: the layers, which dominate time, have 8B shapes)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    src = convert_default_model()
    out = root / "llama8b-random"
    out.mkdir(parents=True, exist_ok=True)
    small = AutoConfig.from_pretrained(src, local_files_only=True)
    config = LlamaConfig(vocab_size=small.vocab_size, bos_token_id=small.bos_token_id,
                         eos_token_id=small.eos_token_id, torch_dtype="bfloat16", **LLAMA_8B)
    config.save_pretrained(out)
    for f in src.iterdir():  # tokenizer and generation config
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    with torch.device("meta"):
        shapes = {k: (v.shape, v.dtype) for k, v in LlamaForCausalLM(config).state_dict().items()}
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = {}
    for name, (shape, _) in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02).cpu()
        tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"))
    log(f"random Llama-8B-shaped checkpoint: {sum(t.numel() for t in tensors.values()) / 1e9:.2f} B params at {out}")
    return out


def smoke_cpu() -> int:
    global DEVICE
    DEVICE = "cpu"
    with Cluster(["cpu", "cpu"], engine_options={"kv_budget": "128MiB", "prefix_cache": False},
                 calibration_cache=None) as cluster:
        corpus = cluster.tokenize(document(300, seed=5))
        rows = exactness(cluster, corpus, [40], n=4)
        print(ttft_table(ttft(cluster, corpus, [64], repeats=1)))
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    small = AutoConfig.from_pretrained(convert_default_model(), local_files_only=True)
    config = LlamaConfig(vocab_size=small.vocab_size, **{**LLAMA_8B, "num_hidden_layers": 1})
    with torch.device("meta"):
        names = list(LlamaForCausalLM(config).state_dict())
    print("8B config ok:", len(names), "tensors per 1 layer;", config.rope_parameters)
    return 0 if all(r["equal_to_same_worker"] and r["equal_to_dense"] for r in rows) else 1


# -- main ------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("--budget-s", type=float, default=460.0, help="skip the 8B part when less time is left")
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="dry run of parts 2-3 on two CPU workers with tiny sizes (checks the script, not the GPU)")
    args = parser.parse_args()
    if args.smoke_cpu:
        return smoke_cpu()
    if not torch.cuda.is_available():
        print("no CUDA device: this script is for a GPU machine", file=sys.stderr)
        return 2
    payload: dict[str, Any] = {"benchmark": "gpu_multidevice", "machine": machine_info()}

    small = load_model(device="cuda")
    shapes = {
        "default model fp32": PoolShape(small.num_layers, small.num_kv_heads, small.head_dim, 16, torch.float32),
        "llama-8B bf16": PoolShape(32, 8, 128, 16, torch.bfloat16),
    }
    payload["copy_bandwidth"] = [copy_bandwidth(n, s) for n, s in shapes.items()]
    print(format_table(["pool blocks", "bytes/block", "D2H pageable GB/s", "D2H pinned GB/s", "H2D pinned GB/s"],
                       [[r["shape"], r["bytes_per_block"], r["d2h_pageable_GBps"], r["d2h_pinned_GBps"],
                         r["h2d_pinned_GBps"]] for r in payload["copy_bandwidth"]]), flush=True)

    ok = True
    with Cluster(["cuda:0", "cuda:0"], engine_options={"kv_budget": "4GiB", "prefix_cache": False},
                 calibration_cache=None) as cluster:
        log(f"default-model cluster up: {cluster.stats().cluster.model_dump(exclude={'workers'})}")
        corpus = cluster.tokenize(document(7000, seed=5))
        rows = exactness(cluster, corpus, [100, 700, 2000])
        payload["exactness"] = rows
        ok = all(r["equal_to_same_worker"] for r in rows)
        dense_ok = all(r["equal_to_dense"] for r in rows)
        print(f"\nexactness on cuda: after transfer == same worker: {'PASS' if ok else 'FAIL'}; "
              f"== dense transformers: {'PASS' if dense_ok else 'FAIL'}", flush=True)
        ok = ok and dense_ok
        payload["ttft_default"] = ttft(cluster, corpus, [512, 2048, 4096])
        print("\nTTFT, default model (fp32), two workers on one GPU:\n" + ttft_table(payload["ttft_default"]), flush=True)

    if elapsed() < args.budget_s - 240:
        with tempfile.TemporaryDirectory(prefix="kvbaton-8b-") as tmp:
            path = random_llama_8b(Path(tmp))
            torch.cuda.empty_cache()
            with Cluster(["cuda:0", "cuda:0"], str(path),
                         engine_options={"kv_budget": "12GiB", "dtype": "bfloat16", "prefix_cache": False},
                         calibration_cache=None) as big:
                log("8B cluster up")
                corpus = big.tokenize(document(9000, seed=6))
                payload["ttft_llama8b"] = ttft(big, corpus, [1024, 4096, 8192], repeats=2)
                print("\nTTFT, random-weight Llama-8B shape (bf16, timing only), two workers on one GPU:\n"
                      + ttft_table(payload["ttft_llama8b"]), flush=True)
    else:
        log("skipping the 8B part: not enough time left in the budget")
    print(f"\nwritten: {write_results(args.results_dir, 'gpu_multidevice', payload)}")
    print(json.dumps({"exact": ok, "seconds": round(elapsed(), 1)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
