"""vLLM (CPU build) as a peer on kvbaton's persona-first debate workload.

Runs workload (i), ``debate`` of sdk/bench/workloads.py (3 debaters + a judge over a ~2300-token
document, 3 rounds, 32 greedy tokens per turn, EOS ignored), on ``vllm.LLM`` with automatic prefix
caching, on the same local SmolLM2-135M-Instruct safetensors checkpoint kvbaton uses (its loader's
cache, asked of the project's venv), fp32, after the same warm-up request the kvbaton benchmark
sends. Prompts are rendered with the model's chat template exactly as kvbaton renders them (template
to text, then tokens without special tokens added) and passed to vLLM as token ids; the first turn's
ids are checked against kvbaton's own ``chat_tokens``.

Every repeat starts cold (``reset_prefix_cache``) and is timed end to end. ``--with-kvbaton`` runs
``python -m kvbaton.bench agents --only debate --dtypes float32 --variants exact auto`` in the
project's venv once per repeat, alternating with vLLM, and prints both side by side.

Run it through scripts/peer_vllm.sh (it builds the vLLM venv and sets VLLM_CPU_KVCACHE_SPACE=4,
VLLM_CPU_NUM_OF_RESERVED_CPU=0). Needs no kvbaton install in the vLLM venv: the workloads module is
loaded by file path.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS_PY = ROOT / "sdk" / "bench" / "workloads.py"

# Run in the project's venv: kvbaton's model path, and its token ids of the first prompt.
KVBATON_PROBE = """
import json, sys
from kvbaton.backend import Engine
from kvbaton.backend.loader import convert_default_model
messages = json.load(sys.stdin)
engine = Engine(kv_budget="16 blocks")
print(json.dumps({"model_dir": str(convert_default_model()), "prompt_token_ids": engine.chat_tokens(messages),
                  "kvbaton_model": engine.loaded.name}))
engine.close()
"""


def vllm_checkpoint(src: Path, root: Path) -> Path:
    """``src`` as vLLM loads it correctly: the same weights, re-keyed where needed.

    kvbaton's converted checkpoint stores the tied embedding once, as ``lm_head.weight``, and its
    config has ``architectures: null``; vLLM's Llama would then leave ``embed_tokens`` unloaded
    (garbage output). The copy under ``root`` adds ``model.embed_tokens.weight`` (the same tensor)
    and names the architecture; tokenizer and other files are copied as they are. Made once.
    """
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((src / "config.json").read_text())
    files = sorted(src.glob("*.safetensors"))
    keys = set()
    for f in files:
        with safe_open(str(f), "pt") as st:
            keys |= set(st.keys())
    if "model.embed_tokens.weight" in keys and config.get("architectures"):
        return src
    dst = root / src.name
    if (dst / ".complete").is_file():
        return dst
    tmp = root / f".{src.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, tmp / f.name)
    config["architectures"] = config.get("architectures") or ["LlamaForCausalLM"]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            tensors.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118 - a safetensors handle, not a dict
    if "model.embed_tokens.weight" not in tensors:
        tensors["model.embed_tokens.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / ".complete").write_text(f"re-keyed copy of {src}\n")
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


def load_workloads() -> Any:
    spec = importlib.util.spec_from_file_location("kvbaton_bench_workloads", WORKLOADS_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def kvbaton_python() -> str:
    return os.environ.get("KVBATON_PYTHON") or str(ROOT / ".venv" / "bin" / "python")


def git_short() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"], check=False,
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or "nogit"
    except (OSError, subprocess.TimeoutExpired):
        return "nogit"


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def fmt(s: dict[str, float] | None) -> str:
    return "-" if not s else f"{s['median']:.2f} [{s['min']:.2f}–{s['max']:.2f}]"


class VllmPeer:
    """One ``vllm.LLM`` and the debate turn loop on it."""

    def __init__(self, model_dir: str, max_tokens: int) -> None:
        import vllm

        self.vllm = vllm
        self.llm = vllm.LLM(model=model_dir, dtype="float32", gpu_memory_utilization=0.5, enable_prefix_caching=True,
                            enforce_eager=True)
        self.tokenizer = self.llm.get_tokenizer()
        self.params = vllm.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """kvbaton's rendering: the chat template to text, then tokens without added special tokens."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _generate(self, ids: list[int], params: Any) -> Any:
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=ids)
        return self.llm.generate([prompt], params, use_tqdm=False)[0]

    def warm_up(self, prompt: str, tokens: int) -> None:
        """The kvbaton benchmark's warm-up: one short plain completion, then a cold cache."""
        ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
        self._generate(ids, self.vllm.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        self.llm.reset_prefix_cache()

    def run(self, workloads: Any, workload: Any) -> dict[str, Any]:
        self.llm.reset_prefix_cache()  # every repeat starts cold, like every kvbaton variant
        turns: list[dict[str, Any]] = []

        def generate_fn(agent: str, messages: list[dict[str, str]]) -> str:
            start = time.perf_counter()
            ids = self.render(messages)
            out = self._generate(ids, self.params)
            completion = out.outputs[0]
            turns.append({"index": len(turns), "agent": agent, "seconds": time.perf_counter() - start,
                          "prompt_tokens": len(ids), "cached_tokens": getattr(out, "num_cached_tokens", None),
                          "generated": len(completion.token_ids), "token_ids": list(completion.token_ids),
                          "text": completion.text})
            return completion.text

        start = time.perf_counter()
        workloads.run_workload(workload, generate_fn)
        return {"seconds": time.perf_counter() - start, "turns": turns}


def run_kvbaton(repeat: int, results_dir: Path, max_tokens: int) -> dict[str, Any]:
    """One timed repeat of kvbaton's exact and auto variants of the debate, in the project's venv."""
    out_dir = results_dir / "kvbaton"
    run_id = f"repeat{repeat}"
    cmd = [kvbaton_python(), "-m", "kvbaton.bench", "agents", "--only", "debate", "--dtypes", "float32",
           "--variants", "exact", "auto", "--repeats", "1", "--tf-passes", "0", "--max-tokens", str(max_tokens),
           "--results-dir", str(out_dir), "--run-id", run_id]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    rec = json.loads((out_dir / run_id / "agents.json").read_text())
    return {"record": str(out_dir / run_id / "agents.json"), "reuse_supported": rec.get("reuse_supported"),
            "rows": {r["variant"]: {"seconds": r["end_to_end_s"], "shares": r["shares"],
                                    "texts": [t["text"] for t in r["run_detail"]["workloads"]["debate"]["turns"]]}
                     for r in rec["rows"]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/peer_vllm.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed cold runs of the debate (default 3)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="greedy tokens per turn (default: the workload's 32)")
    parser.add_argument("--seed", type=int, default=0, help="document seed of the debate (default 0)")
    parser.add_argument("--with-kvbaton", action="store_true",
                        help="alternate every vLLM repeat with one of kvbaton's exact and auto variants")
    parser.add_argument("--model-dir", default=None, help="checkpoint dir (default: the one kvbaton's loader caches)")
    parser.add_argument("--vllm-models", type=Path, default=Path(sys.prefix) / "kvbaton-models",
                        help="where a vLLM-ready copy of the checkpoint is made when needed (default: in this venv)")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "results",
                        help="the JSON goes to DIR/<UTC time>-<commit>-vllm/peer_vllm.json (default results)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    workloads = load_workloads()
    max_tokens = args.max_tokens or workloads.MAX_TOKENS
    debate = workloads.debate(seed=args.seed)
    first_prompt = debate.messages(0, [])

    probe = subprocess.run([kvbaton_python(), "-c", KVBATON_PROBE], input=json.dumps(first_prompt), text=True,
                           capture_output=True, cwd=ROOT, check=False)
    if probe.returncode != 0:
        print(probe.stderr, file=sys.stderr)
        raise SystemExit(f"peer_vllm: could not ask kvbaton ({kvbaton_python()}) for its model; set KVBATON_PYTHON")
    kv = json.loads(probe.stdout.strip().splitlines()[-1])
    source_dir = args.model_dir or kv["model_dir"]
    model_dir = str(vllm_checkpoint(Path(source_dir), args.vllm_models))
    print(f"peer_vllm: model {source_dir}" + (f" (vLLM loads the re-keyed copy {model_dir})"
                                              if model_dir != source_dir else ""), flush=True)

    started = time.perf_counter()
    peer = VllmPeer(model_dir, max_tokens)
    startup_s = time.perf_counter() - started
    template_ok = peer.render(first_prompt) == kv["prompt_token_ids"]
    print(f"peer_vllm: vLLM ready in {startup_s:.1f} s; first prompt {len(kv['prompt_token_ids'])} tokens, "
          f"same token ids as kvbaton: {template_ok}", flush=True)
    peer.warm_up(workloads.WARMUP_PROMPT, workloads.WARMUP_TOKENS)

    run_dir = args.results_dir / f"{dt.datetime.now(dt.UTC).strftime('%Y%m%dT%H%M%SZ')}-{git_short()}-vllm"
    run_dir.mkdir(parents=True, exist_ok=True)
    vllm_runs: list[dict[str, Any]] = []
    kvbaton_runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        run = peer.run(workloads, debate)
        vllm_runs.append(run)
        print(f"repeat {repeat + 1}/{args.repeats}: vLLM debate end-to-end {run['seconds']:.2f} s "
              f"({len(run['turns'])} turns)", flush=True)
        if args.with_kvbaton:
            kvbaton_runs.append(run_kvbaton(repeat, run_dir, max_tokens))
            print(f"repeat {repeat + 1}/{args.repeats}: kvbaton " + ", ".join(
                f"{v} {r['seconds']:.2f} s" for v, r in kvbaton_runs[-1]["rows"].items()), flush=True)

    import torch
    import vllm

    turns = vllm_runs[0]["turns"]
    prompt = sum(t["prompt_tokens"] for t in turns)
    cached = sum(t["cached_tokens"] or 0 for t in turns)
    result: dict[str, Any] = {
        "benchmark": "peer_vllm", "workload": "debate", "seed": args.seed, "max_tokens": max_tokens,
        "command": [sys.argv[0], *(sys.argv[1:] if argv is None else argv)],
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "env": {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU")},
        "cores": os.cpu_count(), "load_after": os.getloadavg(),
        "model_dir": source_dir, "vllm_model_dir": model_dir, "kvbaton_model": kv["kvbaton_model"], "dtype": "float32",
        "startup_s": startup_s, "same_prompt_ids_as_kvbaton": template_ok,
        "document_tokens": len(peer.tokenizer.encode(debate.document, add_special_tokens=False)),
        "vllm_seconds": [r["seconds"] for r in vllm_runs],
        "vllm_end_to_end_s": spread([r["seconds"] for r in vllm_runs]),
        "vllm_prompt_tokens": prompt, "vllm_cached_tokens": cached,
        "vllm_cached_share": cached / prompt if prompt else None, "vllm_turns": turns,
    }
    print("\n| engine | end-to-end s, median [min–max] | prompt tokens from cache | same text as kvbaton exact |")
    print("|---|---|---|---|")
    same = None
    if kvbaton_runs:
        variants = list(kvbaton_runs[0]["rows"])
        result["kvbaton"] = {v: {"seconds": [k["rows"][v]["seconds"] for k in kvbaton_runs],
                                 "end_to_end_s": spread([k["rows"][v]["seconds"] for k in kvbaton_runs]),
                                 "shares": kvbaton_runs[0]["rows"][v]["shares"]} for v in variants}
        result["kvbaton_records"] = [k["record"] for k in kvbaton_runs]
        result["kvbaton_reuse_supported"] = kvbaton_runs[0]["reuse_supported"]
        exact_texts = kvbaton_runs[0]["rows"]["exact"]["texts"]
        same = sum(a == t["text"] for a, t in zip(exact_texts, turns, strict=True)) / len(turns)
        result["vllm_same_text_as_kvbaton_exact"] = same
    print(f"| vLLM {vllm.__version__} (prefix caching) | {fmt(result['vllm_end_to_end_s'])} | "
          f"{100 * (result['vllm_cached_share'] or 0):.0f}% | {'-' if same is None else f'{100 * same:.0f}%'} |")
    for v, k in (result.get("kvbaton") or {}).items():
        s = k["shares"]
        print(f"| kvbaton {v} | {fmt(k['end_to_end_s'])} | "
              f"{100 * (s['reused_exact_share'] + s['reused_approx_share']):.0f}% | - |")
    path = run_dir / "peer_vllm.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
