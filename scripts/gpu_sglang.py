"""GPU check of the SGLang plugin (issue 10): the ``kvbaton`` eviction policy vs SGLang's ``lru``.

Starts ``kvbaton serve --engine sglang`` once per policy, runs a 6-agent cyclic workflow twice
around (each agent: its fixed prompt, the previous agent's output, a short generation) under a KV
budget smaller than the agents' prompts together, and prints end-to-end time, cached prompt tokens
and the lru/kvbaton ratios. Run through scripts/gpu_sglang.sh (the time limit lives there).

A cycle is LRU's worst case: the prompt it evicts is always the one needed next. The kvbaton
policy evicts the agent farthest from running (steps-to-execution from the step graph).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kvbaton
from kvbaton.bench.processes import free_port, wait_healthy

SGLANG_VERSION = "0.5.23"


def random_llama(out: Path, context: int, *, hidden: int = 2048, layers: int = 16, heads: int = 16,
                 kv_heads: int = 8, intermediate: int = 5632) -> Path:
    """A random-weight Llama (about 1B parameters, bf16) and a word-level tokenizer, made locally:
    big enough that prefill is a visible cost on an H200, with nothing downloaded."""
    if (out / "config.json").is_file():
        return out
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = 32000
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=context,
                         bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    fast.save_pretrained(tmp)
    tmp.rename(out)
    del model
    return out


def default_model() -> Path | None:
    """The default model's safetensors checkpoint, if this machine has converted it."""
    try:
        from kvbaton.backend.dirs import cache_dir
    except ImportError:
        return None
    found = sorted((cache_dir() / "models").glob("SmolLM2-135M-Instruct-*/model.safetensors"))
    return found[-1].parent if found else None


class Server:
    def __init__(self, model: Path, policy: str, budget_tokens: int, log: Path, extra: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--engine", "sglang", "--model", str(model.resolve()),
               "--kv-budget", f"{budget_tokens} tokens", "--eviction", "ste" if policy == "kvbaton" else "lru",
               "--dtype", "bfloat16", "--port", str(self.port), "--log-level", "warning",
               "--sglang-arg", "disable_cuda_graph=true", *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with log.open("wb") as out:
            # its own session: stopping it stops SGLang's scheduler and detokenizer processes too
            # cwd outside the checkout: `python -m` puts cwd on sys.path, and a kvbaton.egg-info left
            # there would hide the installed plugin entry point from SGLang's processes.
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         cwd=log.parent.resolve())

    def wait(self, timeout: float) -> None:
        try:
            wait_healthy(self.url, self.proc, timeout, stop=self.stop, interval=1,
                         output=lambda: self.log.read_text()[-4000:])
        except RuntimeError as exc:
            raise SystemExit(str(exc)) from exc

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def workflow(url: str, agents: int, rounds: int, fixed_len: int, dyn_len: int, decode: int, vocab: int,
             engine: str = "sglang") -> dict[str, Any]:
    rng = random.Random(0)
    names = [f"agent{i}" for i in range(agents)]
    fixed = {n: [rng.randrange(3, vocab) for _ in range(fixed_len)] for n in names}
    graph = kvbaton.StepGraph()
    graph.add_entry(names[0])
    for i, name in enumerate(names):
        graph.add_edge(name, names[(i + 1) % agents])
    per_round: list[dict[str, int]] = []
    with kvbaton.connect(url, timeout=300) as client:
        caps = client.capabilities()
        assert caps.engine == engine, caps
        for name in names:
            client.register_agent(name, fixed[name])
        client.complete([5, 6, 7], max_tokens=1)  # warm-up, not timed
        history = [rng.randrange(3, vocab) for _ in range(dyn_len)]
        start = time.perf_counter()
        for r in range(rounds):
            cached = prompt = 0
            for i, name in enumerate(names):
                client.hints(graph, running=[name])
                tokens = fixed[name] + [3 + r * agents + i] + history[-dyn_len:]
                result = client.complete(tokens, agent=name, max_tokens=decode, ignore_eos=True)
                cached += result.timings.tokens_reused
                prompt += len(tokens)
                history = history + result.token_ids
            per_round.append({"cached_tokens": cached, "prompt_tokens": prompt})
        elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "rounds": per_round,
            "cached_tokens": sum(r["cached_tokens"] for r in per_round),
            "prompt_tokens": sum(r["prompt_tokens"] for r in per_round)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help='HF checkpoint dir; "default": the default model\'s safetensors if converted here; '
                        "unset: a random-weight ~1B Llama made locally")
    parser.add_argument("--agents", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fixed", type=int, default=6144, help="tokens of each agent's fixed prompt")
    parser.add_argument("--dynamic", type=int, default=256, help="tokens of history each agent sees")
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--budget", type=float, default=0.6,
                        help="KV pool as a fraction of all fixed prompts together (< 1: they do not all fit)")
    parser.add_argument("--startup-timeout", type=float, default=180)
    parser.add_argument("--results-dir", default="results")
    args = parser.parse_args()

    try:
        import sglang
    except ImportError:
        print(f"needs sglang=={SGLANG_VERSION} in this Python (docs/sglang.md: installing; make test-sglang builds .venv-sglang)")
        return 2
    if sglang.__version__ != SGLANG_VERSION:
        print(f"needs sglang=={SGLANG_VERSION} (docs/sglang.md), found {sglang.__version__}")
        return 2
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    context = args.fixed + args.dynamic + args.decode + 64
    if args.model == "default":
        model = default_model()
        if model is None:
            print("the default model is not converted on this machine; omit --model for a random Llama")
            return 2
    elif args.model:
        model = Path(args.model)
    else:
        t = time.perf_counter()
        model = random_llama(out / "gpu_sglang_llama", max(8192, context))
        print(f"random-weight Llama ready in {time.perf_counter() - t:.0f}s: {model}", flush=True)
    config = json.loads((model / "config.json").read_text())
    if context > config.get("max_position_embeddings", context):
        print(f"{context} tokens per request exceed the model's context; lower --fixed")
        return 2
    budget = int(args.budget * args.agents * args.fixed)
    if budget < context + 1024:
        print(f"a KV budget of {budget} tokens cannot hold one request of {context}; raise --budget")
        return 2

    report: dict[str, Any] = {"model": str(model), "agents": args.agents, "rounds": args.rounds, "fixed": args.fixed,
                              "dynamic": args.dynamic, "decode": args.decode, "kv_budget_tokens": budget,
                              "fixed_prompts_tokens": args.agents * args.fixed, "policies": {}}
    for policy in ("kvbaton", "lru"):
        server = Server(model, policy, budget, out / f"gpu_sglang_{policy}.log", [])
        try:
            t = time.perf_counter()
            server.wait(args.startup_timeout)
            print(f"[{policy}] server up in {time.perf_counter() - t:.0f}s", flush=True)
            run = workflow(server.url, args.agents, args.rounds, args.fixed, args.dynamic, args.decode,
                           int(config["vocab_size"]))
        finally:
            server.stop()
        report["policies"][policy] = run
        rounds = ", ".join(f"round {i + 1}: {r['cached_tokens']}/{r['prompt_tokens']}" for i, r in enumerate(run["rounds"]))
        print(f"[{policy}] {run['seconds']:.2f}s end to end; cached prompt tokens {rounds}", flush=True)

    k, lru = report["policies"]["kvbaton"], report["policies"]["lru"]
    report["time_ratio_lru_over_kvbaton"] = lru["seconds"] / k["seconds"]
    report["cached_tokens_kvbaton_minus_lru"] = k["cached_tokens"] - lru["cached_tokens"]
    print()
    print(f"{'policy':8} {'end-to-end s':>12} {'cached tokens':>14} {'prompt tokens':>14} {'hit rate':>9}")
    for name, run in report["policies"].items():
        print(f"{name:8} {run['seconds']:12.2f} {run['cached_tokens']:14d} {run['prompt_tokens']:14d} "
              f"{run['cached_tokens'] / run['prompt_tokens']:9.1%}")
    print(f"lru / kvbaton end-to-end time: {report['time_ratio_lru_over_kvbaton']:.2f}x "
          f"(KV budget {budget} tokens for {args.agents * args.fixed} tokens of fixed prompts)")
    (out / "gpu_sglang.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
