"""The kvbaton engine: owns the KV cache of one model on one device and implements the handle operators.

Operators (each returns new, immutable handles; inputs stay valid until released):

- ``materialize(context)``: prefill a context, return a handle to its KV.
- ``fork(handle, k)``: ``k`` handles aliasing every block of ``handle`` (zero copy).
- ``extend(handle, context)``: prefill more context behind a handle.
- ``resume(handle, suffix, sampling)``: prefill the suffix and generate; the result carries a
  handle covering prefix + suffix + generated tokens.
- ``generate(messages, handle=None)``: chat-templated generation reusing a handle's KV for the
  longest common token prefix; ``complete(prompt)``: plain completion without a handle.
- ``release(handle)``: drop the handle's block references.

Copy-on-write keeps forks safe: a write into a partially filled block that another handle also
references first copies that block. Every operation validates its input completely before
taking blocks or running the model, so bad input never costs compute or leaks memory.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any

import torch
from kvbaton.capabilities import KVBATON, Capabilities
from kvbaton.errors import (
    ContextTooLong,
    HandleNotFound,
    HandleReleased,
    IncompatibleHandle,
    InvalidRequest,
    MergeConflict,
    PoolExhausted,
)
from kvbaton.handle import (
    Handle,
    LineageStep,
    Op,
    Placement,
    Positions,
    Segment,
    common_prefix_length,
    new_handle_id,
)
from kvbaton.stream import TokenStream
from kvbaton.types import (
    AgentInfo,
    AgentStats,
    CacheStats,
    ChatMessage,
    Composition,
    Fidelity,
    Result,
    SamplingParams,
    SegmentReport,
    Stats,
    StreamChunk,
    Timings,
)

from .attention import ATTN_IMPLEMENTATION
from .block_pool import BlockPool, PoolShape, blocks_for_budget
from .correction import AnchorPool, CorrectionConfig, from_canonical, to_canonical
from .detokenizer import Detokenizer
from .eviction import EvictionPolicy, make_policy
from .loader import LoadedModel, cache_dir, load_model
from .model_runner import Chunk, ModelRunner
from .prefetch import Prefetcher
from .radix import NodeState, RadixCache
from .rotary import RopeShifter
from .sampler import make_generator, sample
from .scheduler import Scheduler
from .sequence import KVState
from .tiers import TierDataError, make_tier

log = logging.getLogger(__name__)

DEFAULT_KV_BUDGET = "1GiB"
DEFAULT_BLOCK_SIZE = 16
DEFAULT_PREFILL_CHUNK = 512
DEFAULT_MAX_BATCH_TOKENS = 2048  # per forward, as vLLM's and SGLang's default step budgets
DEFAULT_LOOKAHEAD = 2
MAX_FORK = 1024
_RELEASED_MEMORY = 1_000_000  # remembered released ids, so late users get HandleReleased, not NotFound

HandleLike = Handle | str
Context = str | Sequence[int]


class Engine:
    """In-process inference engine with a paged, refcounted KV pool. Thread-safe."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        kv_budget: int | str = DEFAULT_KV_BUDGET,
        block_size: int = DEFAULT_BLOCK_SIZE,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        prefix_cache: bool = True,
        eviction: str | EvictionPolicy = "ste",
        tiers: Sequence[str] = (),
        tier_eviction: str | None = None,
        prefetch: bool = True,
        lookahead: int = DEFAULT_LOOKAHEAD,
        correction: CorrectionConfig | dict[str, Any] | None = None,
        fast_decode: bool = True,
    ) -> None:
        if block_size < 1 or prefill_chunk < 1 or max_batch_tokens < 1 or lookahead < 0:
            raise InvalidRequest("block_size, prefill_chunk and max_batch_tokens must be positive, lookahead >= 0")
        if tiers and not prefix_cache:
            raise InvalidRequest("slow tiers hold evicted prefix-cache blocks: they need prefix_cache=True")
        self.loaded: LoadedModel = load_model(
            model, dtype=dtype, device=device, attn_implementation=ATTN_IMPLEMENTATION
        )
        lm = self.loaded
        shape = PoolShape(lm.num_layers, lm.num_kv_heads, lm.head_dim, block_size, lm.dtype)
        self.pool = BlockPool(shape, blocks_for_budget(kv_budget, shape.bytes_per_block), lm.device)
        self.runner = ModelRunner(lm, self.pool, fast_decode=fast_decode)
        self.scheduler = Scheduler(self.runner, max_batch_tokens=max(max_batch_tokens, prefill_chunk))
        # The worker threads keep the pool alive: stop them when an unclosed engine is collected.
        weakref.finalize(self, self.scheduler.close)
        self.tokenizer = lm.tokenizer
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        self.positions = Positions(
            rope_type=lm.rope_type, rope_theta=lm.rope_theta, rope_parameters=lm.rope_parameters
        )
        self.placement = Placement(device=str(lm.device), tier="device")
        self.correction = _correction_config(correction) or CorrectionConfig()
        self._anchor_pools: dict[CorrectionConfig, AnchorPool] = {}
        self._references: OrderedDict[tuple[str, int], tuple[list[int], torch.Tensor]] = OrderedDict()
        self.shifter = RopeShifter.from_model(lm.model, lm.rope_type, lm.rope_parameters)
        self._states: dict[str, KVState] = {}
        self._released: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.RLock()
        self._loaded = threading.Condition(self._lock)  # signalled when slow-tier blocks arrive
        self._tokens_reused = 0
        self._tokens_prefilled = 0
        self._tokens_generated = 0
        self.lookahead = lookahead
        self._ste: dict[str, float] = {}
        self._ttft: dict[str, list[float]] = {}
        self._tier_hits: dict[str, int] = {}
        self._blocks_loaded_reactive = 0
        self._prefetch_hits = 0
        self.cache: RadixCache | None = None
        self.prefetcher: Prefetcher | None = None
        if prefix_cache:
            policy = eviction if isinstance(eviction, EvictionPolicy) else make_policy(eviction, self._ste)
            slow = [make_tier(t, shape.bytes_per_block, lm.device, cache_dir() / "tiers") for t in tiers]
            tier_policy = make_policy(tier_eviction, self._ste) if tier_eviction else None
            self.cache = RadixCache(self.pool, policy, slow, tier_policy)
            if slow and prefetch:
                self.prefetcher = Prefetcher(self.cache, self._lock, self._loaded, self._ste)
                weakref.finalize(self, self.prefetcher.close)
            weakref.finalize(self, self.cache.close)  # removes disk-tier files
        log.info(
            "engine ready: model=%s dtype=%s device=%s blocks=%d x %d tokens",
            lm.name, dtype, device, self.pool.num_blocks, block_size,
        )

    @property
    def max_context(self) -> int | None:
        """The model's context length in tokens."""
        return self.loaded.max_context

    def capabilities(self) -> Capabilities:
        """What this engine does exactly, corrects, recomputes or cannot do."""
        return KVBATON

    # -- public operators ---------------------------------------------------------------------
    def materialize(self, context: Context, *, agent: str | None = None) -> Handle:
        tokens = self._tokens(context, what="context")
        self._check_context(len(tokens))
        with self._lock:
            state = self._new_state(None, 0, tokens, LineageStep(op=Op.MATERIALIZE, token_ids=tuple(tokens)))
        return self._prefill_registered(state, agent)

    def extend(self, handle: HandleLike, context: Context, *, agent: str | None = None) -> Handle:
        tokens = self._tokens(context, what="context")
        with self._lock:
            parent = self._lookup(handle)
            self._check_context(parent.num_tokens + len(tokens))
            step = LineageStep(op=Op.EXTEND, parent=parent.id, token_ids=tuple(tokens))
            state = self._new_state(parent, parent.num_tokens, tokens, step)
        return self._prefill_registered(state, agent)

    def fork(self, handle: HandleLike, k: int = 2) -> list[Handle]:
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_FORK:
            raise InvalidRequest(f"fork count must be an integer in 1..{MAX_FORK}, got {k!r}")
        with self._lock:
            parent = self._lookup(handle)
            children = []
            for _ in range(k):
                child = self._new_state(parent, parent.num_tokens, [], LineageStep(op=Op.FORK, parent=parent.id))
                self._states[child.id] = child
                children.append(self._handle(child))
            return children

    def resume(
        self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None,
        *, agent: str | None = None,
    ) -> Result:
        return self.resume_stream(handle, suffix, sampling, agent=agent).until_done()

    def resume_stream(
        self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None,
        *, agent: str | None = None,
    ) -> TokenStream:
        params = sampling or SamplingParams()
        tokens = self._tokens(suffix, what="suffix", allow_empty=True)
        with self._lock:
            parent = self._lookup(handle)
            self._check_context(parent.num_tokens + len(tokens), params.max_tokens)
            step = LineageStep(op=Op.RESUME, parent=parent.id, token_ids=tuple(tokens))
            state = self._new_state(parent, parent.num_tokens, tokens, step)
        return self._stream(state, params, agent)

    def complete(
        self, prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None
    ) -> Result:
        return self.complete_stream(prompt, sampling, agent=agent).until_done()

    def complete_stream(
        self, prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None
    ) -> TokenStream:
        """Plain completion of raw text or tokens, no handle and no chat template."""
        params = sampling or SamplingParams()
        tokens = self._tokens(prompt, what="prompt")
        self._check_context(len(tokens), params.max_tokens)
        with self._lock:
            state = self._new_state(None, 0, tokens, LineageStep(op=Op.GENERATE, token_ids=tuple(tokens)))
        return self._stream(state, params, agent)

    def generate(
        self,
        messages: Sequence[ChatMessage | dict[str, Any]],
        *,
        handle: HandleLike | None = None,
        sampling: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None,
        agent: str | None = None,
    ) -> Result:
        return self.generate_stream(messages, handle=handle, sampling=sampling, tools=tools, agent=agent).until_done()

    def generate_stream(
        self,
        messages: Sequence[ChatMessage | dict[str, Any]],
        *,
        handle: HandleLike | None = None,
        sampling: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None,
        agent: str | None = None,
    ) -> TokenStream:
        params = sampling or SamplingParams()
        prompt = self.chat_tokens(messages, tools=tools)
        self._check_context(len(prompt), params.max_tokens)
        with self._lock:
            if handle is None:
                state = self._new_state(None, 0, prompt, LineageStep(op=Op.GENERATE, token_ids=tuple(prompt)))
            else:
                parent = self._lookup(handle)
                keep = common_prefix_length(parent.token_ids, prompt)
                step = LineageStep(
                    op=Op.GENERATE,
                    parent=parent.id,
                    keep=None if keep == parent.num_tokens else keep,
                    token_ids=tuple(prompt[keep:]),
                )
                state = self._new_state(parent, keep, prompt[keep:], step)
        return self._stream(state, params, agent)

    def release(self, handles: HandleLike | Iterable[HandleLike]) -> None:
        items = [handles] if isinstance(handles, Handle | str) else list(handles)
        with self._lock:
            states = [self._lookup(h) for h in items]  # all or nothing
            if len({s.id for s in states}) != len(states):
                raise InvalidRequest("the same handle is listed twice")
            for state in states:
                self._drop(state)
                self._released[state.id] = None
                if len(self._released) > _RELEASED_MEMORY:
                    self._released.popitem(last=False)

    def stats(self) -> Stats:
        with self._lock:
            pool = self.pool
            bpb = pool.shape.bytes_per_block
            cached = self.cache.cached_blocks() if self.cache is not None else set()
            return Stats(
                model=self.loaded.name,
                device=str(pool.device),
                dtype=str(self.loaded.dtype).removeprefix("torch."),
                block_size=pool.block_size,
                blocks_total=pool.num_blocks,
                blocks_used=pool.num_used,
                blocks_free=pool.num_free,
                bytes_per_block=bpb,
                pool_bytes_total=pool.num_blocks * bpb,
                pool_bytes_used=pool.num_used * bpb,
                pool_bytes_free=pool.num_free * bpb,
                handles_live=len(self._states),
                tokens_reused=self._tokens_reused,
                tokens_prefilled=self._tokens_prefilled,
                tokens_generated=self._tokens_generated,
                blocks_shared=self._blocks_shared(cached),
                blocks_cached=len(cached),
                blocks_cache_only=sum(1 for b in cached if pool.refcount(b) == 1),
                cache=self._cache_stats(),
                agents={
                    a: AgentStats(requests=len(t), ttft_mean_s=sum(t) / len(t), ttft_p90_s=_p90(t))
                    for a, t in self._ttft.items()
                },
            )

    def _blocks_shared(self, cached: set[int]) -> int:
        """Blocks referenced by more than one handle or request (the cache's own reference aside)."""
        return sum(1 for b in range(self.pool.num_blocks) if self.pool.refcount(b) - (b in cached) > 1)

    def _cache_stats(self) -> CacheStats | None:
        cache = self.cache
        if cache is None:
            return None
        prefetched = self.prefetcher.blocks_prefetched if self.prefetcher else 0
        return CacheStats(
            policy=cache.policy.name,
            tiers=[t.name for t in cache.tiers],
            hits_blocks=dict(self._tier_hits),
            nodes_on_device=cache.device_nodes,
            nodes_per_tier={t.name: cache.nodes_in_tier(i) for i, t in enumerate(cache.tiers)},
            bytes_offloaded=cache.bytes_offloaded,
            bytes_prefetched=self.prefetcher.bytes_prefetched if self.prefetcher else 0,
            bytes_loaded_on_demand=self._blocks_loaded_reactive * self.pool.shape.bytes_per_block,
            blocks_prefetched=prefetched,
            prefetch_hits=self._prefetch_hits,
            prefetch_hit_rate=self._prefetch_hits / prefetched if prefetched else 0.0,
            tier_errors=cache.tier_errors,
            steps_to_execution=dict(self._ste),
        )

    def next_token_logits(self, handle: HandleLike, suffix: Context = "") -> torch.Tensor:
        """fp32 next-token logits after ``handle`` + ``suffix``, computed on the reuse path.

        Used to measure fidelity against dense prefill; nothing is kept afterwards.
        """
        tokens = self._tokens(suffix, what="suffix", allow_empty=True)
        with self._lock:
            parent = self._lookup(handle)
            self._check_context(parent.num_tokens + len(tokens))
            state = self._new_state(parent, parent.num_tokens, tokens, LineageStep(op=Op.RESUME, parent=parent.id))
        try:
            with self._lock:
                self._reserve(state, state.num_tokens)
            return self._compute(state).clone()
        finally:
            with self._lock:
                self._drop(state)

    # -- workflow awareness ---------------------------------------------------------------------
    def register_agent(
        self, name: str, fixed_prompt: Context | Sequence[ChatMessage | dict[str, Any]], *, prefill: bool = False
    ) -> AgentInfo:
        """Declare an agent's fixed prompt (system prompt, tools, few-shot) for workflow-aware caching.

        ``fixed_prompt`` is text, token ids, or chat messages (rendered without the generation
        prompt, so it is a prefix of the agent's requests). The radix nodes spelling it take the
        agent's steps-to-execution. With ``prefill=True`` it is computed into the cache now.
        """
        _check_agent(name)
        if name is None:
            raise InvalidRequest("agent name is required")
        if isinstance(fixed_prompt, Sequence) and fixed_prompt and isinstance(fixed_prompt[0], ChatMessage | dict):
            tokens = self.chat_tokens(fixed_prompt, add_generation_prompt=False)  # type: ignore[arg-type]
        else:
            tokens = self._tokens(fixed_prompt, what="fixed_prompt")  # type: ignore[arg-type]
        self._check_context(len(tokens))
        with self._lock:
            if self.cache is not None:
                self.cache.register_agent(name, tokens)
        if prefill:
            self.release(self.materialize(tokens, agent=name))
        return AgentInfo(name=name, fixed_tokens=len(tokens))

    def hints(
        self,
        steps: Any,
        running: Iterable[str] = (),
        finished: Iterable[str] = (),
    ) -> dict[str, float]:
        """Update the agents' steps-to-execution and prefetch those due within the look-ahead.

        ``steps`` is a ``{agent: STE}`` mapping or a step graph (anything with
        ``steps_to_execution(running, finished)``, e.g. :class:`kvbaton.StepGraph`).
        """
        if hasattr(steps, "steps_to_execution"):
            ste = dict(steps.steps_to_execution(running=tuple(running), finished=tuple(finished)))
        elif isinstance(steps, dict):
            ste = dict(steps)
            for agent in running:
                ste[agent] = 0
        else:
            raise InvalidRequest("hints need a {agent: steps} mapping or a step graph")
        for agent, value in ste.items():
            _check_agent(agent)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise InvalidRequest(f"steps-to-execution of {agent!r} must be a number >= 0, got {value!r}")
        with self._lock:
            self._ste.clear()
            self._ste.update({a: float(v) for a, v in ste.items()})
            if self.prefetcher is not None:
                due = sorted((v, a) for a, v in self._ste.items() if v <= self.lookahead)
                self.prefetcher.submit([a for _, a in due])
        return dict(self._ste)

    def flush_cache(self) -> None:
        """Drop every cached prefix not pinned by a live handle (device and slow tiers)."""
        with self._lock:
            if self.cache is not None:
                self.cache.flush()

    def close(self) -> None:
        """Stop the prefetch worker and delete slow-tier files. Live handles become unusable."""
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        with self._lock:
            if self.cache is not None:
                self.cache.close()
            for state in list(self._states.values()):
                self._drop(state)
            pools = list(self._anchor_pools.values())
        for pool in pools:
            pool.close()
        self.scheduler.close()

    # -- composition of shared segments (re-alignment, correction, restricted merge) ------------------
    def compose(
        self,
        prefix: HandleLike | Context | None = None,
        segments: Sequence[Segment | Handle] = (),
        suffix: Context | None = None,
        *,
        agent: str | None = None,
        mode: str = "auto",
        correction: CorrectionConfig | dict[str, Any] | None = None,
    ) -> Composition:
        """Assemble ``prefix + segments + suffix`` from existing K/V, prefilling only what must be.

        ``prefix`` is a handle (its K/V are shared, zero copy), text or token ids; each segment is a
        :class:`~kvbaton.Segment` (or a whole handle) whose K/V are reused: exactly when the tokens before
        it are the same as in its source, otherwise re-aligned to the new positions and, in ``mode="auto"``,
        corrected for the new context by the anchor pool or recomputed densely when the gate is unsure.
        ``mode="rotate"`` re-aligns without correction (an explicit approximation); ``mode="dense"``
        recomputes every segment that is not exact. Approximate results are flagged (``exact=False`` on
        the handle) and never enter the prefix cache. ``correction`` overrides the engine's anchor-pool
        settings for this call (each distinct setting keeps its own pools).
        """
        t0 = time.perf_counter()
        if mode not in ("auto", "rotate", "dense"):
            raise InvalidRequest(f"mode must be 'auto', 'rotate' or 'dense', got {mode!r}")
        _check_agent(agent)
        pool = self.anchor_pool(correction)
        parts = [_as_segment(s) for s in segments]
        suffix_tokens = [] if suffix is None else self._tokens(suffix, what="suffix", allow_empty=True)
        with self._lock:
            parent = self._lookup(prefix) if isinstance(prefix, Handle) else None
            if parent is not None:
                prefix_tokens = list(parent.token_ids)
            elif prefix is None:
                prefix_tokens = []
            else:
                prefix_tokens = self._tokens(prefix, what="prefix", allow_empty=True)  # type: ignore[arg-type]
            sources: list[tuple[KVState, int, int, str]] = []
            tokens = list(prefix_tokens)
            offsets = []
            for i, part in enumerate(parts):
                src = self._lookup(part.handle)
                start, end = part.bounds()
                if not start < end <= src.num_tokens:
                    raise InvalidRequest(
                        f"segment {i} covers tokens {start}..{end} of a handle with {src.num_tokens} tokens"
                    )
                sources.append((src, start, end, part.slot or f"segment{i}"))
                offsets.append(len(tokens))
                tokens.extend(src.token_ids[start:end])
            tokens.extend(suffix_tokens)
            if not tokens:
                raise InvalidRequest("nothing to compose: give a prefix, segments or a suffix")
            self._check_context(len(tokens))
            added = tokens[len(prefix_tokens) :] if parent is not None else tokens
            step = LineageStep(op=Op.COMPOSE, parent=parent.id if parent else None, token_ids=tuple(added))
            state = (
                self._new_state(parent, parent.num_tokens, added, step)
                if parent is not None
                else self._new_state(None, 0, tokens, step)
            )
            state.agent = agent
            pinned = [b for src, *_ in sources for b in src.blocks]
            self.pool.incref(pinned)  # the sources may be released meanwhile: keep their K/V readable
        try:
            with self._lock:
                self._attach_cached(state)
                self._reserve(state, state.num_tokens)
            reused_before = state.num_cached
            reports = []
            for i, ((src, start, end, slot), offset) in enumerate(zip(sources, offsets, strict=True)):
                report = self._place_segment(state, i, src, start, end, slot, offset, mode, pool)
                if report.outcome in ("rotated", "corrected") and state.exact_len is None:
                    state.exact_len = offset
                reports.append(report)
            logits = self._compute_until(state, state.num_tokens)
            margin = None
            if state.exact_len is not None:
                if logits is None and mode == "auto":
                    # The prompt ends inside an approximated segment: recompute its last token for the logits.
                    state.num_cached -= 1
                    logits = self._compute_until(state, state.num_tokens)
                if logits is not None:
                    top = torch.topk(logits, 2).values
                    margin = float(top[0] - top[1])
                if margin is not None and mode == "auto" and margin < pool.config.min_margin:
                    reports = self._recompute_unsure(state, reports, margin, pool.config.min_margin)
            # Segments found in the prefix cache are already counted in reused_before.
            reused = reused_before + sum(r.tokens_reused for r in reports if r.offset >= reused_before)
            with self._lock:
                self._cache_insert(state)
                self._tokens_reused += reused
                self._tokens_prefilled += state.num_tokens - reused
                self._states[state.id] = state
                handle = self._handle(state)
        except BaseException:
            with self._lock:
                self._drop(state)
            raise
        finally:
            with self._lock:
                self.pool.decref(pinned)
        return Composition(
            handle=handle,
            segments=reports,
            exact=state.exact_len is None,
            tokens_reused=reused,
            tokens_prefilled=state.num_tokens - reused,
            compose_s=time.perf_counter() - t0,
            margin=margin,
        )

    def _recompute_unsure(
        self, state: KVState, reports: list[SegmentReport], margin: float, threshold: float
    ) -> list[SegmentReport]:
        """Confidence gate: prefill densely everything from the first approximated position (lock not held).

        Those blocks are private to ``state`` (written by this composition), so they are overwritten in place.
        """
        start = state.exact_len
        assert start is not None
        state.num_cached, state.exact_len, state.last_logits = start, None, None
        self._compute_until(state, state.num_tokens)
        why = f"low confidence: next-token margin {margin:.2f} < min_margin {threshold:g} after correction; "
        return [
            r.model_copy(update={"outcome": "recomputed", "reason": why + r.reason, "tokens_reused": 0})
            if r.offset >= start else r
            for r in reports
        ]

    def anchor_pool(self, correction: CorrectionConfig | dict[str, Any] | None = None) -> AnchorPool:
        """The anchor pools used with ``correction`` settings (the engine's own by default)."""
        cfg = _correction_config(correction) or self.correction
        with self._lock:
            return self._anchor_pools.setdefault(cfg, AnchorPool(cfg))

    def merge(
        self, parts: Sequence[Segment | Handle], *, agent: str | None = None, mode: str = "auto",
        correction: CorrectionConfig | dict[str, Any] | None = None,
    ) -> Composition:
        """Restricted merge: never blends divergent K/V of the same positions.

        Whole handles must be prefix-compatible (each a prefix of the longest, which is the result);
        segments are concatenated through :meth:`compose` and must not overlap in a common source.
        Text-level reduction is an ordinary ``generate`` call over the parts' texts.
        """
        items = list(parts)
        if not items:
            raise InvalidRequest("merge needs at least one handle or segment")
        if all(isinstance(p, Handle) for p in items):
            with self._lock:
                states = [self._lookup(p) for p in items]  # type: ignore[arg-type]
                longest = max(states, key=lambda s: s.num_tokens)
                for st in states:
                    common = common_prefix_length(st.token_ids, longest.token_ids)
                    if common < st.num_tokens:
                        raise MergeConflict(
                            f"handles {st.id} and {longest.id} diverge at token {common}: their K/V for the same "
                            "positions differ and are never blended; compose explicit segments instead, or "
                            "reduce the texts with a generate call"
                        )
            t0 = time.perf_counter()
            (child,) = self.fork(longest.id, 1)
            report = [
                SegmentReport(
                    index=i, source=st.id, start=0, end=st.num_tokens, offset=0, outcome="exact",
                    reason="prefix-compatible", tokens_reused=st.num_tokens,
                )
                for i, st in enumerate(states)
            ]
            return Composition(
                handle=child, segments=report, exact=child.exact, tokens_reused=child.num_tokens,
                tokens_prefilled=0, compose_s=time.perf_counter() - t0,
            )
        segs = [_as_segment(p) for p in items]
        for i, a in enumerate(segs):
            for b in segs[i + 1 :]:
                (sa, ea), (sb, eb) = a.bounds(), b.bounds()
                if a.handle.id == b.handle.id and sa < eb and sb < ea:
                    raise MergeConflict(
                        f"segments {sa}..{ea} and {sb}..{eb} of handle {a.handle.id} overlap: the same positions "
                        "would appear twice"
                    )
        return self.compose(segments=segs, agent=agent, mode=mode, correction=correction)

    def fidelity(self, handle: HandleLike, max_tokens: int = 32, *, reference: HandleLike | None = None) -> Fidelity:
        """Compare a handle's continuation with dense prefill of the same tokens (greedy; KL along dense).

        The dense side is a fresh prefill that bypasses the prefix cache, or ``reference``: an exact handle
        of the same tokens (its continuation is remembered, so several candidates compare cheaply).
        """
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= 4096:
            raise InvalidRequest("max_tokens must be an integer in 1..4096")
        with self._lock:
            tokens = list(self._lookup(handle).token_ids)
            ref = self._lookup(reference) if reference is not None else None
            if ref is not None and (ref.token_ids != tokens or ref.exact_len is not None):
                raise InvalidRequest("the reference must be an exact handle of the same tokens")
            known = self._references.get((ref.id, max_tokens)) if ref is not None else None
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if known is None:
            dense = self._dense_reference(tokens) if ref is None else None
            source: HandleLike = dense if dense is not None else ref.id  # type: ignore[union-attr]
            try:
                theirs = self.resume(source, "", greedy)
                self.release(theirs.handle)
                known = (theirs.token_ids, torch.log_softmax(self._logits_along(source, theirs.token_ids[:-1]), -1))
            finally:
                if dense is not None:
                    self.release(dense)
            if ref is not None:
                with self._lock:
                    self._references[(ref.id, max_tokens)] = known
                    while len(self._references) > 16:
                        self._references.popitem(last=False)
        dense_tokens, p = known
        ours = self.resume(handle, "", greedy)
        self.release(ours.handle)
        q = torch.log_softmax(self._logits_along(handle, dense_tokens[:-1]), dim=-1)
        kl = (p.exp() * (p - q)).sum(dim=-1)
        agree = common_prefix_length(ours.token_ids, dense_tokens)
        return Fidelity(
            tokens=max_tokens,
            first_token_agrees=bool(ours.token_ids[:1] == dense_tokens[:1]),
            greedy_agreement=agree / max_tokens,
            kl_mean=float(kl.mean()),
            kl_first=float(kl[0]),
            dense_token_ids=dense_tokens,
            handle_token_ids=ours.token_ids,
        )

    def _dense_reference(self, tokens: list[int]) -> Handle:
        """A fresh dense prefill of ``tokens`` that neither reads nor feeds the prefix cache."""
        with self._lock:
            state = self._new_state(None, 0, tokens, LineageStep(op=Op.MATERIALIZE, token_ids=tuple(tokens)))
            state.cacheable = False
            self._reserve(state, state.num_tokens)
        try:
            self._compute(state)
        except BaseException:
            with self._lock:
                self._drop(state)
            raise
        with self._lock:
            self._states[state.id] = state
            return self._handle(state)

    def _logits_along(self, handle: HandleLike, tokens: Sequence[int]) -> torch.Tensor:
        """Next-token logits after the handle and after each of ``tokens``: ``[len(tokens) + 1, vocab]``."""
        with self._lock:
            parent = self._lookup(handle)
            last = parent.num_tokens - 1
            state = self._new_state(parent, last, [parent.token_ids[last], *tokens], LineageStep(op=Op.RESUME))
            state.num_cached = min(state.num_cached, last)
        try:
            with self._lock:
                self._reserve(state, state.num_tokens)
            return self.scheduler.run(
                Chunk(list(state.blocks), state.num_cached, state.token_ids[state.num_cached :], all_logits=True)
            )[-(len(tokens) + 1) :]
        finally:
            with self._lock:
                self._drop(state)

    def _place_segment(
        self, state: KVState, index: int, src: KVState, start: int, end: int, slot: str, offset: int, mode: str,
        anchors: AnchorPool,
    ) -> SegmentReport:
        """Fill positions ``offset..`` of ``state`` with segment ``start..end`` of ``src`` (lock not held)."""
        n = end - start

        def report(outcome: str, reason: str, reused: int, **extra: Any) -> SegmentReport:
            return SegmentReport(
                index=index, source=src.id, start=start, end=end, offset=offset, outcome=outcome,  # type: ignore[arg-type]
                reason=reason, tokens_reused=reused, **extra,
            )

        def dense(reason: str, **extra: Any) -> SegmentReport:
            self._compute_until(state, offset + n)
            return report("recomputed", reason, 0, **extra)

        if state.num_cached >= offset + n:
            return report("exact", "found in the prefix cache", n)
        if state.num_cached > offset:
            return dense("partly found in the prefix cache; the rest was prefilled")
        self._compute_until(state, offset)  # the dense part before this segment
        available = min(end, src.num_cached) - start  # a resumed source may not have its last token's K/V yet
        if available <= 0:
            return dense("the source has no K/V for these tokens yet")
        same_context = start == offset and src.token_ids[:start] == state.token_ids[:offset]
        if same_context and (src.exact_len is None or src.exact_len >= start + available):
            self._copy_rows(src, start, state, offset, available)
            return report("exact", "same tokens before it as in its source", available)
        if mode == "dense":
            return dense("mode='dense'")
        if not self.shifter.shiftable():
            return dense(f"RoPE type {self.shifter.rope_type!r} cannot be re-aligned exactly")
        k, v = self._read_rows(src, start, available)
        if mode == "rotate":
            self._write_rows(state, offset, self.shifter.shift(k, start, offset), v)
            return report("rotated", "keys re-aligned to the new positions; no correction (mode='rotate')", available)
        cfg = anchors.config
        if cfg.chained:  # KVCMAS: the source agent's own cache is the reference
            ref_k, ref_v, ref_start, key = k, v, start, (slot, src.agent, state.agent)
        else:  # context-free reference: the segment prefilled on its own
            ref_k, ref_v = self._segment_base(src.token_ids[start : start + available])
            ref_start, key = 0, (slot, state.agent)
        reference = to_canonical(self.shifter.shift(ref_k, ref_start, 0), ref_v)
        estimate = anchors.estimate(key, reference)
        if estimate.delta is None:
            out = dense(estimate.reason, anchors=estimate.anchors, entropy=estimate.entropy)
            exact_k, exact_v = self._read_rows(state, offset, available)
            anchors.add(key, reference, to_canonical(self.shifter.shift(exact_k, offset, 0), exact_v))
            return out
        m = estimate.tokens
        k_rest, v_rest = from_canonical(reference[:, :m] + estimate.delta, self.loaded.num_kv_heads, self.loaded.head_dim)
        k_all = torch.cat((self.shifter.shift(ref_k[:1, :, :m], ref_start, 0), k_rest.to(ref_k.dtype)), dim=0)
        v_all = torch.cat((ref_v[:1, :, :m], v_rest.to(ref_v.dtype)), dim=0)
        self._write_rows(state, offset, self.shifter.shift(k_all, 0, offset), v_all)
        return report("corrected", estimate.reason, m, anchors=estimate.anchors, entropy=estimate.entropy)

    def _segment_base(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of ``tokens`` prefilled on their own from position 0 (the non-chained reference)."""
        base = self.materialize(tokens)
        try:
            with self._lock:
                return self._read_rows(self._lookup(base), 0, len(tokens))
        finally:
            self.release(base)

    def _read_rows(self, state: KVState, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.read_rows(self.pool.slots(state.blocks, start, start + n))

    def _write_rows(self, state: KVState, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V rows at the state's next uncached positions (blocks reserved, privately owned)."""
        assert start == state.num_cached
        n = k.shape[2]
        self.pool.write_rows(self.pool.slots(state.blocks, start, start + n), k, v)
        state.num_cached = start + n
        state.last_logits = None

    def _copy_rows(self, src: KVState, start: int, dst: KVState, offset: int, n: int) -> None:
        k, v = self._read_rows(src, start, n)
        self._write_rows(dst, offset, k, v)

    def describe(self, handle: HandleLike) -> Handle:
        """The current metadata of a live handle."""
        with self._lock:
            return self._handle(self._lookup(handle))

    # -- moving state between engines (multi-device) ------------------------------------------------
    def transfer(self, handle: HandleLike, device: int | str) -> Handle:
        """One engine is one device: a transfer to it (rank 0 or its device name) is a no-op, any
        other target an error. Multi-device servers (``kvbaton serve --devices``) move KV for real."""
        dev = self.pool.device
        names = {0, "0", "worker:0", str(dev)} | ({dev.type} if dev.index in (None, 0) else set())
        if isinstance(device, bool) or device not in names:
            raise InvalidRequest(
                f"this engine has one device ({dev}): cannot transfer to {device!r}; "
                "transfers between devices need a multi-device server (kvbaton serve --devices ...)"
            )
        return self.describe(handle)

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the prefix cache holds on the device (what a prefill of
        them would skip): lets a multi-device coordinator predict a recompute's real cost."""
        with self._lock:
            if self.cache is None:
                return 0
            path = self.cache.match(list(tokens), len(tokens) - 1, touch=False)
            device = 0
            for node in path:
                if node.state is not NodeState.DEVICE:
                    break
                device += 1
            return device * self.block_size

    def export_kv(self, handle: HandleLike) -> tuple[Handle, int, Iterator[tuple[torch.Tensor, torch.Tensor]]]:
        """A live handle's metadata, how many of its tokens have K/V, and an iterator over copies of
        those blocks' K/V, one block at a time. The blocks stay pinned until the iterator ends or is
        closed, so a concurrent release cannot recycle them mid-export."""
        with self._lock:
            state = self._lookup(handle)
            num_cached = state.num_cached
            blocks = list(state.blocks[: -(-num_cached // self.block_size)])
            self.pool.incref(blocks)
            meta = self._handle(state)

        def read() -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
            try:
                for block in blocks:
                    yield self.pool.read_block(block)
            finally:
                with self._lock:
                    self.pool.decref(blocks)

        return meta, num_cached, read()

    def adopt(
        self,
        handle: Handle,
        kv: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None,
        num_cached: int = 0,
        *,
        agent: str | None = None,
    ) -> Handle:
        """Register ``handle`` (same id and lineage) in this engine.

        With ``kv``: its first ``num_cached`` tokens' K/V, block by block, as :meth:`export_kv` gives
        them (another engine of the same model). Without: recompute it from its lineage tokens.
        """
        if not isinstance(handle, Handle):
            raise InvalidRequest("adopt needs a Handle with its lineage")
        self._check_compatible(handle)
        tokens = self._tokens(handle.token_ids(), what="lineage")
        if len(tokens) != handle.num_tokens or not 0 <= num_cached <= len(tokens):
            raise InvalidRequest(f"handle {handle.id} lineage does not spell its {handle.num_tokens} tokens")
        state = KVState(id=handle.id, token_ids=tokens, blocks=[], num_cached=0, lineage=handle.lineage)
        with self._lock:
            if handle.id in self._states:
                raise InvalidRequest(f"handle {handle.id} already lives in this engine")
            self._released.pop(handle.id, None)
        if kv is None or num_cached == 0:
            return self._prefill_registered(state, agent)  # recomputed densely: exact again
        if not handle.exact:
            state.exact_len = 0  # approximate K/V (compose) stay out of the prefix cache wherever they go
        try:
            with self._lock:
                self._reserve(state, num_cached)
            count = 0
            for i, (k, v) in enumerate(kv):
                if i >= len(state.blocks):
                    raise InvalidRequest(f"more KV blocks than {num_cached} tokens need")
                self.pool.write_block(state.blocks[i], k.to(self.pool.device), v.to(self.pool.device))
                count += 1
            if count != len(state.blocks):
                raise InvalidRequest(f"got {count} KV blocks, {num_cached} tokens need {len(state.blocks)}")
            state.num_cached = num_cached
            with self._lock:
                self._cache_insert(state)
                self._states[state.id] = state
                return self._handle(state)
        except BaseException:
            with self._lock:
                self._drop(state)
            raise

    # -- tokenization ---------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequest(f"text must be a string, got {type(text).__name__}")
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except (TypeError, UnicodeError) as exc:  # e.g. lone surrogates, which no tokenizer can encode
            raise InvalidRequest(f"text cannot be tokenized: {exc}") from None

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(self._tokens(list(token_ids), "token_ids", allow_empty=True)))

    def chat_tokens(
        self,
        messages: Sequence[ChatMessage | dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the model's chat template.

        With ``add_generation_prompt`` (the default) they end ready for the assistant's reply;
        without, they are a prefix of any longer conversation, the shape to materialize shared context in.
        """
        if isinstance(messages, str | bytes) or not messages:
            raise InvalidRequest("messages must be a non-empty list of {role, content} messages")
        try:
            rendered = [
                (m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m)).model_dump(exclude_none=True)
                for m in messages
            ]
        except Exception as exc:  # pydantic's ValidationError, or a non-mapping item
            raise InvalidRequest(f"invalid chat message: {exc}") from exc
        text = self.tokenizer.apply_chat_template(
            rendered, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return self.tokenize(text)

    # -- internals ----------------------------------------------------------------------------
    def _tokens(self, value: Context, what: str, allow_empty: bool = False) -> list[int]:
        if isinstance(value, str):
            tokens = self.tokenize(value)
        elif isinstance(value, bytes) or not isinstance(value, Sequence | torch.Tensor):
            raise InvalidRequest(f"{what} must be text or a sequence of token ids, got {type(value).__name__}")
        else:
            try:
                tokens = [operator.index(t) for t in value]
            except TypeError:
                raise InvalidRequest(f"{what} token ids must be integers") from None
            vocab = self.loaded.vocab_size
            bad = next((t for t in tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequest(f"{what} has token id {bad} outside the vocabulary 0..{vocab - 1}")
        if not tokens and not allow_empty:
            raise InvalidRequest(f"{what} is empty")
        return tokens

    def _check_context(self, prompt_tokens: int, max_new_tokens: int = 0) -> None:
        limit = self.loaded.max_context
        if prompt_tokens + max_new_tokens > limit:
            raise ContextTooLong(
                f"{prompt_tokens} prompt tokens + max_tokens {max_new_tokens} exceed the model's "
                f"context of {limit} tokens"
            )

    def _lookup(self, handle: HandleLike) -> KVState:
        if isinstance(handle, Handle):
            self._check_compatible(handle)
            handle_id = handle.id
        elif isinstance(handle, str):
            handle_id = handle
        else:
            raise InvalidRequest(f"expected a Handle or a handle id, got {type(handle).__name__}")
        state = self._states.get(handle_id)
        if state is not None:
            return state
        if handle_id in self._released:
            raise HandleReleased(f"handle {handle_id} was released")
        raise HandleNotFound(f"no handle {handle_id} in this engine")

    def _check_compatible(self, handle: Handle) -> None:
        lm = self.loaded
        if handle.model_fingerprint != lm.fingerprint:
            raise IncompatibleHandle(
                f"handle {handle.id} was made by model {handle.model!r} (fingerprint {handle.model_fingerprint}); "
                f"this engine runs {lm.name!r} in {lm.dtype} (fingerprint {lm.fingerprint})"
            )
        if handle.tokenizer_fingerprint != lm.tokenizer_fingerprint:
            raise IncompatibleHandle(f"handle {handle.id} was tokenized by a different tokenizer")
        if handle.positions != self.positions:
            raise IncompatibleHandle(
                f"handle {handle.id} has positional layout {handle.positions.model_dump()}, "
                f"this engine needs {self.positions.model_dump()}"
            )

    def _new_state(
        self, parent: KVState | None, keep: int, added: Sequence[int], step: LineageStep
    ) -> KVState:
        """A state sharing the K/V of ``parent``'s first ``keep`` tokens, followed by ``added``."""
        if parent is None:
            return KVState(id=new_handle_id(), token_ids=list(added), blocks=[], num_cached=0, lineage=(step,))
        cached = min(keep, parent.num_cached)
        logits = parent.last_logits if keep == parent.num_tokens and cached == keep and not added else None
        if not added and logits is None:
            cached = min(cached, keep - 1)  # the last token must run again to produce next-token logits
        blocks = parent.blocks[: -(-cached // self.block_size)] if cached > 0 else []
        self.pool.incref(blocks)
        # Tokens computed behind approximate K/V are approximate too; behind an exact prefix they are exact.
        approximate = parent.exact_len is not None and keep > parent.exact_len
        return KVState(
            id=new_handle_id(),
            token_ids=parent.token_ids[:keep] + list(added),
            blocks=list(blocks),
            num_cached=cached,
            lineage=parent.lineage + (step,),
            last_logits=logits,
            exact_len=parent.exact_len if approximate else None,
            cacheable=parent.cacheable,
        )

    def _handle(self, state: KVState) -> Handle:
        lm = self.loaded
        return Handle(
            id=state.id,
            model=lm.name,
            model_fingerprint=lm.fingerprint,
            tokenizer_fingerprint=lm.tokenizer_fingerprint,
            num_tokens=state.num_tokens,
            positions=self.positions,
            lineage=state.lineage,
            placement=self.placement,
            exact=state.exact_len is None,
        )

    def _reserve(self, state: KVState, num_tokens: int) -> None:
        """Make ``state`` own writable blocks for positions ``num_cached..num_tokens-1``, or raise."""
        bs = self.block_size
        write_at = state.num_cached
        cow = write_at % bs != 0 and write_at < num_tokens and self.pool.refcount(state.blocks[write_at // bs]) > 1
        missing = max(0, -(-num_tokens // bs) - len(state.blocks))
        needed = missing + int(cow)
        if needed > self.pool.num_free and self.cache is not None:
            self.cache.evict(needed - self.pool.num_free)
        if needed > self.pool.num_free:
            raise PoolExhausted(
                f"KV pool exhausted: the request needs {needed} more blocks of {bs} tokens, "
                f"{self.pool.num_free} of {self.pool.num_blocks} are free; release handles or raise kv_budget"
            )
        if cow:
            shared = state.blocks[write_at // bs]
            (private,) = self.pool.allocate(1)
            self.pool.copy_block(shared, private, write_at % bs)
            self.pool.decref([shared])
            state.blocks[write_at // bs] = private
        if missing:
            state.blocks.extend(self.pool.allocate(missing))

    def _compute(self, state: KVState) -> torch.Tensor:
        """Run the model over the state's uncached tokens (blocks reserved); return last logits.

        Called WITHOUT the engine lock: the work goes through the batching scheduler, chunk by
        chunk, so other requests' steps are packed into the same forwards.
        """
        logits = self._compute_until(state, state.num_tokens)
        assert logits is not None
        return logits

    def _compute_until(self, state: KVState, until: int) -> torch.Tensor | None:
        """Like :meth:`_compute`, for positions up to ``until`` only (None: nothing was computed)."""
        logits = state.last_logits if until == state.num_tokens else None
        if until - state.num_cached <= self.prefill_chunk:  # one chunk: decode steps, short prompts
            if state.num_cached < until:
                logits = self._compute_chunk(state, until)
        else:
            with self.scheduler.prefilling():
                while state.num_cached < until:
                    size = self.scheduler.chunk_tokens(self.prefill_chunk)
                    logits = self._compute_chunk(state, min(until, state.num_cached + size))
        state.last_logits = logits if until == state.num_tokens else None
        return logits

    def _compute_chunk(self, state: KVState, end: int) -> torch.Tensor:
        start = state.num_cached
        logits = self.scheduler.run(Chunk(list(state.blocks), start, state.token_ids[start:end]))
        state.num_cached = end
        return logits

    def _prefill_registered(self, state: KVState, agent: str | None = None) -> Handle:
        """Prefill a new state and register it; free it again on failure. Call without the lock."""
        try:
            _check_agent(agent)
            state.agent = agent
            with self._lock:
                self._attach_cached(state)
                self._reserve(state, state.num_tokens)
            reused = state.num_cached
            self._compute(state)
            with self._lock:
                self._cache_insert(state)
                self._tokens_reused += reused
                self._tokens_prefilled += state.num_tokens - reused
                self._states[state.id] = state
                return self._handle(state)
        except BaseException:
            with self._lock:
                self._drop(state)
            raise

    def _trim(self, state: KVState) -> None:
        keep = -(-state.num_tokens // self.block_size)
        if len(state.blocks) > keep:
            self.pool.decref(state.blocks[keep:])
            del state.blocks[keep:]

    def _attach_cached(self, state: KVState) -> None:
        """Take the longest cached prefix of the state's tokens from the radix cache (lock held).

        Blocks waiting in a slow tier are loaded back first (reactively); blocks a prefetch is
        still loading are waited for with the lock released, so ready requests run meanwhile. A
        block that cannot be read back is forgotten and its tokens are recomputed.
        """
        cache = self.cache
        if cache is None or state.num_tokens - 1 <= state.num_cached:
            return
        while True:
            path = cache.match(state.token_ids, state.num_tokens - 1)
            if len(path) * self.block_size <= state.num_cached:
                return
            if any(n.state is NodeState.LOADING for n in path):
                self._loaded.wait(timeout=1.0)
                continue
            if not any(n.state is NodeState.SLOW for n in path):
                break
            started = cache.begin_load(path)
            try:
                for node in started:
                    if node.state is not NodeState.LOADING:  # dropped with a failed ancestor
                        continue
                    tier = cache.tiers[node.tier].name  # type: ignore[index]
                    try:
                        data = cache.read(node)
                    except TierDataError as exc:
                        log.warning("%s; recomputing those tokens", exc)
                        data = None
                    if cache.finish_load(node, data):
                        self._tier_hits[tier] = self._tier_hits.get(tier, 0) + 1
                        self._blocks_loaded_reactive += 1
            finally:
                for node in started:  # whatever happened, nobody may wait on these forever
                    cache.finish_load(node, None)
                self._loaded.notify_all()
            if not started:
                break
        device = []
        for node in path:
            if node.state is not NodeState.DEVICE:
                break
            device.append(node)
        if len(device) * self.block_size <= state.num_cached:
            return
        for node in device:
            if node.prefetched:
                node.prefetched = False
                self._prefetch_hits += 1
        self._tier_hits["device"] = self._tier_hits.get("device", 0) + len(device)
        blocks = [n.block for n in device]
        self.pool.incref(blocks)  # type: ignore[arg-type]
        self.pool.decref(state.blocks)
        state.blocks = blocks  # type: ignore[assignment]
        state.num_cached = len(blocks) * self.block_size
        state.last_logits = None

    def _cache_insert(self, state: KVState) -> None:
        """Offer the state's full blocks to the prefix cache: only those whose K/V are exact."""
        if self.cache is not None and state.cacheable:
            exact = state.num_cached if state.exact_len is None else min(state.num_cached, state.exact_len)
            self.cache.insert(state.token_ids, state.blocks, exact // self.block_size)

    def _drop(self, state: KVState) -> None:
        self.pool.decref(state.blocks)
        state.blocks = []
        state.last_logits = None
        self._states.pop(state.id, None)

    def _stream(self, state: KVState, params: SamplingParams, agent: str | None = None) -> TokenStream:
        try:
            _check_agent(agent)
        except InvalidRequest:
            with self._lock:
                self._drop(state)
            raise
        state.agent = agent
        chunks = self._decode(state, params, agent)
        next(chunks)  # run up to the sentinel so that closing the stream, even unread, frees the state
        return TokenStream(chunks)  # type: ignore[arg-type]

    def _decode(
        self, state: KVState, params: SamplingParams, agent: str | None = None
    ) -> Generator[StreamChunk | None, None, Result]:
        """Prefill the uncached prompt, then generate token by token, yielding text as it becomes final.

        The lock is taken per model step, never across a ``yield``, so an idle stream consumer
        cannot block other requests. Blocks for the whole request are reserved up front: a request
        that starts always finishes.
        """
        prompt_len = state.num_tokens
        generated: list[int] = []
        registered = False
        try:
            yield None  # sentinel, consumed by _stream
            t0 = time.perf_counter()
            with self._lock:
                self._attach_cached(state)
                reused = state.num_cached
                # The last generated token is never written: it stays pending for the next user.
                self._reserve(state, prompt_len + params.max_tokens - 1)
            logits = self._compute(state)
            with self._lock:
                self._cache_insert(state)
                self._tokens_reused += reused
                self._tokens_prefilled += prompt_len - reused
            rng = make_generator(params, self.loaded.device)
            detok = Detokenizer(self.tokenizer, params.stop)
            ttft = 0.0
            finish: str | None = None
            with self.scheduler.decoding():  # lets the scheduler wait for our next step
                while finish is None:
                    token = sample(logits, params, rng)
                    if not generated:
                        ttft = time.perf_counter() - t0
                        if agent is not None:
                            with self._lock:
                                self._ttft.setdefault(agent, []).append(ttft)
                    generated.append(token)
                    state.token_ids.append(token)
                    state.last_logits = None
                    delta = detok.add(token)
                    if detok.stopped or (token in self.loaded.eos_token_ids and not params.ignore_eos):
                        finish = "stop"
                    elif len(generated) >= params.max_tokens:
                        finish = "length"
                    else:
                        logits = self._compute(state)
                    if finish is not None:
                        delta += detok.flush()
                    yield StreamChunk(text=delta, token_ids=[token])
            with self._lock:
                self._trim(state)
                self._cache_insert(state)
                last = state.lineage[-1]
                state.lineage = state.lineage[:-1] + (
                    last.model_copy(update={"token_ids": last.token_ids + tuple(generated)}),
                )
                self._states[state.id] = state
                self._tokens_generated += len(generated)
                registered = True
                handle = self._handle(state)
        finally:
            if not registered:  # error or abandoned stream: give everything back
                with self._lock:
                    self._drop(state)
        return Result(
            text=detok.text,
            token_ids=generated,
            handle=handle,
            finish_reason=finish,  # type: ignore[arg-type]
            timings=Timings(
                ttft_s=ttft,
                total_s=time.perf_counter() - t0,
                tokens_reused=reused,
                tokens_prefilled=prompt_len - reused,
                tokens_generated=len(generated),
            ),
        )


def _correction_config(value: CorrectionConfig | dict[str, Any] | None) -> CorrectionConfig | None:
    if value is None or isinstance(value, CorrectionConfig):
        return value
    if not isinstance(value, dict):
        raise InvalidRequest("correction must be a CorrectionConfig or a mapping of its fields")
    try:
        return CorrectionConfig(**value)
    except TypeError as exc:
        raise InvalidRequest(f"invalid correction settings: {exc}") from None


def _as_segment(part: Segment | Handle) -> Segment:
    if isinstance(part, Segment):
        return part
    if isinstance(part, Handle):
        return Segment(handle=part)
    raise InvalidRequest(f"segments must be Segment or Handle objects, got {type(part).__name__}")


def _check_agent(agent: str | None) -> None:
    if agent is not None and (not isinstance(agent, str) or not agent or len(agent) > 256):
        raise InvalidRequest("agent must be a non-empty string of at most 256 characters")


def _p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


