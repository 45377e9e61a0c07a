"""Concurrent agents on one engine: tokens/s at 1, 8, 32 and 64 agents, kvbaton and vLLM's CPU build side by side.

Each agent puts its own short instruction after a shared document (the document prefilled once before
timing, so both engines' prefix caches hold it) and decodes ``--tokens`` greedy tokens, end-of-sequence
ignored; all agents of a round are sent at once. Throughput is the round's generated tokens over its wall
time (first request sent to last answer), so it includes each agent's own short prefill, as a workflow's
fan-out does. kvbaton runs in process (embedded engine, the scheduler's one loop); vLLM runs its
OpenAI-compatible server (prefix caching on, both cores, its Intel OpenMP preloaded: ``--peer-vllm``, see
scripts/peer_vllm.sh), given the same token ids through ``/v1/completions`` from one thread per agent.
Repeats alternate between the engines; every repeat is kept (median [min-max]).

``--tiny``: the same on a random-weight model of the default's shape family but 2 layers and hidden 128
(the default tokenizer), where host work, not arithmetic, bounds a step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvbaton.bench.spread import cell, measured

AGENTS = (1, 8, 32, 64)


def tiny_checkpoint(root: Path) -> Path:
    """A random-weight llama checkpoint, 2 layers of hidden 128, with the default model's tokenizer (made once)."""
    import torch
    from kvbaton.backend.compute.loader import load_model
    from transformers import LlamaConfig, LlamaForCausalLM

    out = root / "tiny-llama-2x128"
    if (out / "config.json").is_file():
        return out
    default = load_model()
    config = LlamaConfig(vocab_size=default.vocab_size, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    default.tokenizer.save_pretrained(out)
    return out


def _prompts(tokenize: Callable[[str], list[int]], agents: int) -> tuple[list[int], list[list[int]]]:
    from kvbaton.bench.corpus import document

    shared = tokenize(document(400, seed=11))
    return shared, [shared + tokenize(f"\n\nAgent {i}: in one paragraph, what should team {i % 7} do next?")
                    for i in range(agents)]


def _round(call: Callable[[list[int]], Any], prompts: Sequence[list[int]]) -> float:
    """All prompts at once, one thread each; the round's wall time."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(call, prompts))
    return time.perf_counter() - t0


def run(agents: Sequence[int], tokens: int, repeats: int, peer_python: str | None, tiny: bool) -> dict[str, Any]:
    from kvbaton.backend import Engine
    from kvbaton.bench.vllm_peer import VllmPeer, sigterm_as_exit
    from kvbaton.types import SamplingParams

    model = str(tiny_checkpoint(Path(tempfile.gettempdir()) / "kvbaton-bench")) if tiny else None
    engine = Engine(model, kv_budget="2GiB", dtype="float32")
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    shared, _ = _prompts(engine.tokenize, 1)
    engine.release(engine.materialize(shared))  # the document in the prefix cache
    peer = None
    rows = []
    with sigterm_as_exit():
        try:
            if peer_python:
                peer = VllmPeer(peer_python, Path(engine.loaded.path))
                peer.start()
                peer.complete(shared, 1)  # vLLM's prefix cache holds the document too

            def kvbaton(ids: list[int]) -> None:
                engine.release(engine.complete(ids, params).handle)

            def vllm(ids: list[int]) -> None:
                assert peer is not None
                peer.complete(ids, tokens)

            for n in agents:
                _, prompts = _prompts(engine.tokenize, n)
                sides: dict[str, Callable[[list[int]], Any]] = {"kvbaton": kvbaton}
                if peer is not None:
                    sides["vllm"] = vllm
                for call in sides.values():
                    _round(call, prompts[: min(n, 2)])  # warm-up
                seconds: dict[str, list[float]] = {name: [] for name in sides}
                for _ in range(repeats):
                    for name, call in sides.items():
                        seconds[name].append(_round(call, prompts))
                row: dict[str, Any] = {"agents": n, "tokens_each": tokens}
                for name, runs in seconds.items():
                    measured(row, f"{name}_tokens_per_s", [n * tokens / s for s in runs])
                if peer is not None:
                    row["ratio"] = row["kvbaton_tokens_per_s"] / row["vllm_tokens_per_s"]
                rows.append(row)
        finally:
            if peer is not None:
                peer.stop()
            engine.close()
    return {"model": "tiny 2x128 random" if tiny else "SmolLM2-135M-Instruct", "rows": rows,
            "peer": peer.info if peer is not None else None, "target": "kvbaton >= vLLM-CPU at every concurrency"}


def table(payload: dict[str, Any]) -> str:
    from kvbaton.bench.common import format_table

    peer = payload["peer"] is not None
    columns = ["agents", "kvbaton tok/s"] + (["vLLM-CPU tok/s", "kvbaton / vLLM"] if peer else [])
    body = []
    for r in payload["rows"]:
        line = [r["agents"], cell(r, "kvbaton_tokens_per_s", 1)]
        if peer:
            line += [cell(r, "vllm_tokens_per_s", 1), f"{r['ratio']:.2f}x"]
        body.append(line)
    return f"{payload['model']}\n" + format_table(columns, body)


def main(argv: list[str] | None = None) -> None:
    from kvbaton.bench import record

    parser = argparse.ArgumentParser(prog="python -m kvbaton.bench concurrency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, nargs="+", default=list(AGENTS))
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens each agent decodes")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per engine and concurrency (alternating)")
    parser.add_argument("--peer-vllm", default=None, metavar="PYTHON",
                        help="the interpreter of a venv with vLLM's CPU build (scripts/peer_vllm.sh --setup-only)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, hidden-128 random model instead")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 and 4 agents, 8 tokens, 1 repeat")

    def measure(args: argparse.Namespace) -> dict[str, Any]:
        if args.quick:
            return run((1, 4), 8, 1, args.peer_vllm, args.tiny)
        return run(args.agents, args.tokens, args.repeats, args.peer_vllm, args.tiny)

    # The tiny model's runs are a benchmark of their own: published beside the default model's, not over it.
    name = "concurrency_tiny" if "--tiny" in (sys.argv[1:] if argv is None else argv) else "concurrency"
    record.measure_and_write(parser, name, argv, measure, table)


if __name__ == "__main__":
    main()
