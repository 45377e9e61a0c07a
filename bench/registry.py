"""The benchmark registry: every benchmark ``kvbaton bench NAME`` (``python -m kvbaton.bench NAME``)
and ``kvbaton bench all`` run, by name: the module whose ``main(argv)`` runs it, and one line that
says what it measures. A benchmark registered here runs in the suite too (:mod:`kvbaton.bench.suite`).
"""

from __future__ import annotations

BENCHMARKS = {
    "serve": ("kvbaton.bench.serve", "kvbaton serve: throughput and TTFT at 1/8/32 clients, reuse on vs off"),
    "ttft": ("kvbaton.bench.ttft", "TTFT: text replay vs resume from a handle vs the question-only floor"),
    "adapter_overhead": ("kvbaton.bench.adapter_overhead", "LangGraph adapter overhead per LLM call (no model time)"),
    "engine": ("kvbaton.bench.engine", "engine speed vs plain transformers: prefill, decode, batched decode"),
    "host": ("kvbaton.bench.host", "the request loop's host time per sequence per step, and a resume's fixed cost (no model)"),
    "concurrency": ("kvbaton.bench.concurrency", "1/8/32/64 concurrent agents: tokens/s, kvbaton vs vLLM's CPU build"),
    "transfer": ("kvbaton.bench.transfer", "multi-device: KV transfer vs recompute crossover, fork across workers vs replay"),
    "ingress": ("kvbaton.bench.ingress", "multi-device: one cluster through one server vs two (a shared control)"),
    "correction": ("kvbaton.bench.correction", "shared segments behind different prefixes: dense / rotation / anchor correction"),
    "agents": ("kvbaton.bench.agents", "persona-first debate / chain / fan-out: exact vs auto vs rotate reuse vs text replay"),
    "family": ("kvbaton.bench.family_run", "60 generated agent workflows: reuse, decisions, speed, fidelity, QA vs exact"),
    "workflow": ("kvbaton.bench.workflow", "10-agent cyclic workflow: no reuse / LRU / LRU+tier / STE+prefetch"),
    "scaling": ("kvbaton.bench.scaling", "k = 1..16 agents on one shared context: text replay vs forked handles"),
    "branching": ("kvbaton.bench.branching", "peak KV vs branch factor of a tree search: copies vs forks"),
    "soak": ("kvbaton.bench.soak", "64 clients, dropped streams, a full tier, a worker kill, a restart: leaks must be 0"),
    "gpu": ("kvbaton.bench.gpu", "the engine on one GPU vs transformers: exactness, decode, batching, TTFT, workflow"),
}
