"""The kvbaton engine: the KV cache of one model on one device, behind the handle operators.

It implements :class:`kvbaton.ops.EngineOps` and is a coordinator: each operator validates its
input (:mod:`.inputs`), derives the new state from its parent under the engine lock (sharing the
parent's blocks, :mod:`.kv_manager`), and hands it to the request lifecycle (:mod:`.lifecycle`:
admission, chunked prefill and the decode loop, through the batching :mod:`.scheduler`), which
registers the result in the handle table (:mod:`.handles`). Cross-prefix reuse is a step the engine
hands a request (:class:`.reuse.place.AutoReuse`), which the lifecycle runs; composition of segments,
merge and fidelity live in :mod:`.reuse.compose`; the stats assembly in :mod:`.stats`; handles that
survive a restart in :mod:`.cache.persist`. Its knobs are one :class:`.config.EngineConfig`; what a server and a
cluster use of it beyond the operators is :mod:`.hosting` (a request's tenant arrives there as an
:class:`.tenants.AgentRef`, and the prefix-cache and span partitions follow the engine's tenant partition).

Wired one way: every part is given what it uses when it is built (the span index, the audit, the
event ring), and none calls back into the engine.

Operators return new, immutable handles; their inputs stay valid until released. Copy-on-write
keeps forks safe: a write into a partially filled block that another handle also references first
copies that block. Every operation validates its input completely before taking blocks or running
the model, so bad input never costs compute or leaks memory.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from kvbaton.capabilities import KVBATON, Capabilities
from kvbaton.errors import InvalidRequest
from kvbaton.handle import Handle, HandleLike, LineageStep, Op, Placement, Positions, Segment
from kvbaton.ops import Messages, check_reuse, ste_map
from kvbaton.stream import TokenStream
from kvbaton.types import (
    MAX_TOP_LOGPROBS,
    AgentInfo,
    Composition,
    Events,
    Fidelity,
    PromptTokenLogprob,
    Result,
    Reuse,
    SamplingParams,
    Stats,
)

from .cache.block_pool import BlockPool, PoolShape, blocks_for_budget
from .cache.kv_manager import KVManager, prefix_cache_for
from .cache.persist import Persistence, PersistentHandles
from .cache.prefetch import Prefetcher
from .cache.radix import RadixCache
from .cache.sequence import KVState
from .cache.tiers import TierSpec, claim_tiers
from .compute.attention import ATTN_IMPLEMENTATION
from .compute.loader import LoadedModel, load_model
from .compute.selector import select_runner
from .config import EngineConfig
from .events import CacheEvents, EventRing
from .handles import HandleTable, Identity
from .hosting import ConfiguredEngine, check_partition
from .inputs import Context, Inputs
from .reuse.audit import FidelityAudit
from .reuse.compose import Composer
from .reuse.correction import AnchorPool, CorrectionConfig
from .reuse.place import AutoReuse, Placer
from .reuse.rotary import RopeShifter
from .reuse.spans import SpanIndex
from .runtime.lifecycle import Lifecycle
from .runtime.sampler import scored_tokens, unscored_token
from .runtime.scheduler import Scheduler
from .stats import engine_stats
from .tenants import Agent, AgentRef, Partitions, TenantPartition, check_agent_of

log = logging.getLogger(__name__)

MAX_FORK = 1024


class Engine(ConfiguredEngine):
    """In-process inference engine with a paged, refcounted KV pool. Thread-safe.

    Implements :class:`kvbaton.ops.EngineOps` and the hosted-engine contract of a server and a
    cluster's worker (:class:`.hosting.WorkerEngine`). Its knobs are one :class:`.config.EngineConfig`
    (``self.config``), validated before anything is claimed or loaded."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **knobs: Any) -> None:
        """``Engine(model, kv_budget=..., ...)``: the knobs of :class:`.config.EngineConfig`, or
        ``Engine(config=...)`` (knobs given with it change it)."""
        overrides = {"model": model, **knobs} if model is not None else knobs
        self.config = EngineConfig.build(config, **overrides)
        self.correction = self.config.correction or CorrectionConfig()
        self._ste: dict[str, float] = {}  # the agents' steps-to-execution, read live by the eviction policies
        self._ste_before_run: dict[str, float] = {}  # each hinted agent's STE just before a hint marked it running
        self.event_ring = EventRing(self.config.event_capacity)  # what requests, evictions and prefetches did
        # Cross-prefix reuse: exact sources indexed by content (spans.py), live handles and what the prefix cache
        # keeps of released ones, in the span partition of the request that made them (None: no cross-prefix reuse).
        # One cache partition and one span partition until a server asks (partition_tenants).
        self.partitions = Partitions(by_session=self.config.span_partition == "session")
        self.spans = SpanIndex(partition_of=self.partitions.spans, block_size=self.config.block_size)
        # What the prefix cache and prefetch tell it; the blocks the cache lets go end the span index's views.
        self._cache_events = CacheEvents(self.event_ring, self._ste, self.spans.cached.dropped)
        # Tier directories first: an unwritable one fails before the model loads.
        claimed = claim_tiers(self.config.tiers, persist=self.config.persist)
        try:
            self.loaded: LoadedModel = load_model(self.config.model, dtype=self.config.dtype, device=self.config.device,
                                                  attn_implementation=ATTN_IMPLEMENTATION)
            self._build_memory(claimed)
        except BaseException:
            for tier in claimed:  # from here on the cache owns them (and closes them)
                tier.release()
            raise
        self._build_runtime()
        self._build_reuse()
        self._open_persistence(claimed)
        log.info("engine ready: model=%s dtype=%s device=%s blocks=%d x %d tokens",
                 self.loaded.name, self.config.dtype, self.config.device, self.pool.num_blocks, self.block_size)

    # -- build steps (in this order) --------------------------------------------------------------
    def _build_memory(self, claimed: list[TierSpec]) -> None:
        """The block pool of the configured budget, and the prefix cache over it with its slow tiers."""
        lm, c = self.loaded, self.config
        self.block_size = c.block_size
        shape = PoolShape(lm.num_layers, lm.num_kv_heads, lm.head_dim, c.block_size, lm.dtype)
        self.pool = BlockPool(shape, blocks_for_budget(c.kv_budget, shape.bytes_per_block), lm.device)
        self.cache: RadixCache | None = None
        if c.prefix_cache:
            self.cache = prefix_cache_for(self.pool, self._ste, c.eviction, claimed, c.tier_eviction,
                                          self._cache_events)
            weakref.finalize(self, self.cache.close)  # removes disk-tier files, at exit too

    def _build_runtime(self) -> None:
        """The forward pass and its batching, the handle table, the KV manager, prefetch, the request
        lifecycle."""
        lm, c = self.loaded, self.config
        self.runner = select_runner(lm, self.pool, fast_decode=c.fast_decode)
        self.tokenizer = lm.tokenizer
        self.positions = Positions(rope_type=lm.rope_type, rope_theta=lm.rope_theta, rope_parameters=lm.rope_parameters)
        self.shifter = RopeShifter.from_model(lm.model, lm.rope_type, lm.rope_parameters)
        self._lock = threading.RLock()
        self.handles: HandleTable[KVState] = HandleTable(Identity(
            model=lm.name, fingerprint=lm.fingerprint, tokenizer_fingerprint=lm.tokenizer_fingerprint,
            positions=self.positions, placement=Placement(device=str(lm.device), tier="device"),
            runs=f"{lm.name!r} in {lm.dtype}",
        ))
        # The live handles are what a reservation may spill when the pool is full (spill.py); a state's
        # prefix-cache partition follows its tenant as the engine's partition says.
        self.kv = KVManager(self.pool, self.cache, self._lock, live=self.handles.states,
                            partition=self.partitions.cache)
        self.prefetcher: Prefetcher | None = None
        if self.cache is not None and self.cache.tiers and c.prefetch:
            self.prefetcher = Prefetcher(self.kv, self._ste, self._cache_events)
            weakref.finalize(self, self.prefetcher.close)
        self.inputs = Inputs(lm, c.chat_template)
        # The one loop that runs every request; its thread keeps the pool alive: stop it when an unclosed
        # engine is collected.
        self.scheduler = Scheduler(self.runner, self.kv, max_batch_tokens=c.max_batch_tokens,
                                   prefill_chunk=c.prefill_chunk, speculate=c.speculate)
        weakref.finalize(self, self.scheduler.close)
        # The lifecycle keeps the index in step with the live states and reads the hints' predictions.
        self.requests = Lifecycle(self.kv, self.scheduler, self.handles, lm, self.event_ring, self.spans,
                                  self._ste_before_run)

    def _build_reuse(self) -> None:
        """Cross-prefix reuse: the fidelity audit (its dense re-checks are lifecycle requests, run as
        background work on the scheduler), the placer and the composer."""
        self.audit = FidelityAudit(self.requests.first_token, self.config.audit_fraction)
        weakref.finalize(self, self.audit.close)
        self.placer = Placer(self.kv, self.shifter, self.correction, self.spans, self.audit,
                             self.loaded.num_kv_heads, self.loaded.head_dim)
        self.composer = Composer(self.kv, self.handles, self.requests, self.inputs, self.placer)

    def _open_persistence(self, claimed: list[TierSpec]) -> None:
        """Handles of an earlier run of this configuration come back spilled: K/V from saved blocks or lineage."""
        disk = next((t.dir for t in claimed if t.dir is not None), None)
        self._persisted: PersistentHandles | None = PersistentHandles.open(
            disk, self.config.persist, self.handles, self.kv, fingerprint=self.loaded.fingerprint,
            dtype=str(self.loaded.dtype), tokens_of=lambda h: self.inputs.tokens(h.token_ids(), what="lineage"),
        )

    # -- the hosted-engine contract (hosting.py) ----------------------------------------------------
    @property
    def partitionable(self) -> TenantPartition:
        """Both the prefix cache and the span index are partitioned per tenant on request."""
        return TenantPartition(prefix_cache=True, spans=True)

    def partition_tenants(self, partition: TenantPartition) -> None:
        """Keep tenants apart as ``partition`` says (see :class:`.tenants.TenantPartition`).

        Changing the prefix cache's partition drops the prefix cache (what it holds is in the old partitions,
        where no request would look) and puts a persistent engine's saved blocks back in their new partitions:
        call it before serving. Spans already indexed keep the partition they were indexed in."""
        check_partition(self, partition, self.partitionable)
        with self._lock:
            flush = partition.prefix_cache != self.partitions.current.prefix_cache
            self.partitions.current = partition
            if flush and self.cache is not None:
                self.cache.flush()
        if flush and self._persisted is not None:
            self._persisted.place_saved(self._persisted.spilled())

    @property
    def persistence(self) -> Persistence | None:
        return self._persisted.persistence if self._persisted is not None else None

    def _share(
        self, ref: AgentRef, parent: KVState | None, keep: int, added: Sequence[int], step: LineageStep
    ) -> KVState:
        """A new state of ``ref``'s request (its partitions follow its tenant): ``parent``'s first ``keep``
        tokens (their K/V shared), then ``added``."""
        state = self.kv.share(parent, keep, added, step)
        state.tenant, state.session = ref.tenant, ref.session
        return state

    @property
    def placement(self) -> Placement:
        return self.handles.identity.placement  # type: ignore[union-attr,return-value]

    @placement.setter
    def placement(self, value: Placement) -> None:
        """A worker process names its rank in the placement of every handle it makes from now on."""
        self.handles.identity = dataclasses.replace(self.handles.identity, placement=value)  # type: ignore[type-var]

    @property
    def max_context(self) -> int | None:
        """The model's context length in tokens."""
        return self.loaded.max_context

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The checkpoint's ``generation_config.json`` sampling (temperature, top-p, top-k) where it says to sample
        (``do_sample``), as transformers' ``generate`` and vLLM's server apply them to a request that sets none;
        empty for a greedy checkpoint. The SDK's ``SamplingParams()`` stays greedy; the OpenAI routes use these."""
        found = self.loaded.generation_defaults
        if not found.get("do_sample"):
            return {}
        defaults = {"temperature": found.get("temperature", 1.0)}
        defaults.update({k: found[k] for k in ("top_p", "top_k") if found.get(k) is not None})
        return defaults

    def healthy(self) -> tuple[bool, str]:
        """An in-process engine serves while its process runs."""
        return True, "ok"

    def capabilities(self) -> Capabilities:
        """What this engine does exactly, corrects, recomputes or cannot do."""
        return KVBATON

    # -- handle operators ---------------------------------------------------------------------
    def materialize(self, context: Context, *, agent: Agent | None = None) -> Handle:
        ref = AgentRef.of(agent)
        tokens = self.inputs.tokens(context, what="context")
        self.inputs.check_context(len(tokens))
        state = self._share(ref, None, 0, tokens, LineageStep(op=Op.MATERIALIZE, token_ids=tuple(tokens)))
        return self.requests.prefill(state, ref)

    def extend(self, handle: HandleLike, context: Context, *, agent: Agent | None = None) -> Handle:
        ref = AgentRef.of(agent)
        tokens = self.inputs.tokens(context, what="context")
        return self.requests.prefill(self._behind(ref, handle, tokens, Op.EXTEND), ref)

    def fork(self, handle: HandleLike, k: int = 2) -> list[Handle]:
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_FORK:
            raise InvalidRequest(f"fork count must be an integer in 1..{MAX_FORK}, got {k!r}")
        with self._lock:
            parent = self.handles.get(handle)
            children = []
            for _ in range(k):
                child = self.kv.share(parent, parent.num_tokens, [], LineageStep(op=Op.FORK, parent=parent.id))
                self.handles.add(child.id, child)
                children.append(self.requests.publish(child))
            return children

    def resume(self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None, *,
               agent: Agent | None = None) -> Result:
        return self.resume_stream(handle, suffix, sampling, agent=agent).until_done()

    def resume_stream(self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None, *,
                      agent: Agent | None = None) -> TokenStream:
        ref = AgentRef.of(agent)
        params = sampling or SamplingParams()
        tokens = self.inputs.tokens(suffix, what="suffix", allow_empty=True)
        return self.requests.stream(self._behind(ref, handle, tokens, Op.RESUME, params.max_tokens), params, ref)

    def complete(self, prompt: Context, sampling: SamplingParams | None = None, *, agent: Agent | None = None,
                 reuse: Reuse | None = None) -> Result:
        return self.complete_stream(prompt, sampling, agent=agent, reuse=reuse).until_done()

    def complete_stream(
        self, prompt: Context, sampling: SamplingParams | None = None, *, agent: Agent | None = None,
        reuse: Reuse | None = None,
    ) -> TokenStream:
        """Plain completion of raw text or tokens, no handle and no chat template (``reuse`` as for generate)."""
        params = sampling or SamplingParams()
        tokens = self.inputs.tokens(prompt, what="prompt")
        self.inputs.check_context(len(tokens), params.max_tokens)
        return self._generation(tokens, None, params, agent, reuse)

    def generate(
        self, messages: Messages, *, handle: HandleLike | None = None, sampling: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None, agent: Agent | None = None, reuse: Reuse | None = None,
    ) -> Result:
        return self.generate_stream(
            messages, handle=handle, sampling=sampling, tools=tools, agent=agent, reuse=reuse
        ).until_done()

    def generate_stream(
        self, messages: Messages, *, handle: HandleLike | None = None, sampling: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None, agent: Agent | None = None, reuse: Reuse | None = None,
    ) -> TokenStream:
        """Chat-templated generation reusing ``handle``'s K/V (or the prefix cache's) for the longest
        common token prefix; with ``reuse="auto"``/``"rotate"`` also spans that other agents computed
        behind a different prefix (docs/segments.md, "Automatic reuse")."""
        params = sampling or SamplingParams()
        prompt = self.chat_tokens(messages, tools=tools)
        self.inputs.check_context(len(prompt), params.max_tokens)
        return self._generation(prompt, handle, params, agent, reuse)

    def _generation(
        self, prompt: list[int], handle: HandleLike | None, params: SamplingParams, agent: Agent | None,
        reuse: Reuse | None,
    ) -> TokenStream:
        check_reuse(reuse)
        ref = AgentRef.of(agent)
        policy = reuse or self.config.reuse
        partition = self.partitions.spans(ref) if policy != "exact" else None
        with self._lock:
            parent = self.handles.get(handle) if handle is not None else None
            parent, keep = self.placer.starting_point(prompt, parent, policy, partition,
                                                      self.partitions.cache(ref))
            if parent is None:
                state = self._share(ref, None, 0, prompt, LineageStep(op=Op.GENERATE, token_ids=tuple(prompt)))
            else:
                step = LineageStep(
                    op=Op.GENERATE, parent=parent.id, keep=None if keep == parent.num_tokens else keep,
                    token_ids=tuple(prompt[keep:]),
                )
                state = self._share(ref, parent, keep, prompt[keep:], step)
                if self.kv.is_retained(parent):  # a released turn's state: this, its next turn, takes it
                    self.kv.unretain(parent)
                    self.spans.forget_approximate(parent.id)
        reuse_step = None if partition is None else AutoReuse(self.placer, policy, partition)
        return self.requests.stream(state, params, ref, reuse_step)

    def release(self, handles: HandleLike | Iterable[HandleLike]) -> None:
        with self._lock:
            released = self.handles.release(handles)  # all or nothing
            for _, state in released:
                # An approximate state stays, as a cache, for its own next turn; its exact cached blocks stay sources.
                retain = self.spans.is_approximate(state) and bool(state.blocks)
                self.spans.release(state, self.kv.held_by_cache(state), retained=retain)
                if retain:
                    self.kv.retain(state)
                else:
                    self.kv.drop(state)
        if self._persisted is not None:  # durable: a released handle never comes back
            self._persisted.released([hid for hid, _ in released])

    def describe(self, handle: HandleLike) -> Handle:
        """The current metadata of a live handle."""
        with self._lock:
            return self.requests.publish(self.handles.get(handle))

    def stats(self) -> Stats:
        with self._lock:
            stats = engine_stats(self.loaded, self.kv, self.requests.counters, len(self.handles), self._ste)
        return stats.model_copy(update={"audit": self.audit.stats()})

    def events(self, since: int = 0) -> Events:
        """The events after sequence number ``since`` (requests, evictions, prefetches; events.py)."""
        return self.event_ring.since(since)

    def _behind(self, ref: AgentRef, handle: HandleLike, tokens: list[int], op: Op, max_new_tokens: int = 0) -> KVState:
        """A new state of ``ref``'s request: ``handle``'s tokens (their K/V shared) followed by ``tokens``."""
        with self._lock:
            parent = self.handles.get(handle)
            self.inputs.check_context(parent.num_tokens + len(tokens), max_new_tokens)
            step = LineageStep(op=op, parent=parent.id, token_ids=tuple(tokens))
            return self._share(ref, parent, parent.num_tokens, tokens, step)

    # -- composition of shared segments (compose.py) --------------------------------------------
    def compose(
        self, prefix: HandleLike | Context | None = None, segments: Sequence[Segment | Handle] = (),
        suffix: Context | None = None, *, agent: Agent | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        """Assemble ``prefix + segments + suffix`` from existing K/V (see :meth:`.compose.Composer.compose`)."""
        ref = AgentRef.of(agent)
        check_agent_of(ref)
        return self.composer.compose(prefix, segments, suffix, agent=ref.label, tenant=ref.tenant, mode=mode,
                                     correction=correction)

    def merge(
        self, parts: Sequence[Segment | Handle], *, agent: Agent | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        """Restricted merge: never blends divergent K/V of the same positions (see :meth:`.compose.Composer.merge`)."""
        ref = AgentRef.of(agent)
        check_agent_of(ref)
        return self.composer.merge(parts, agent=ref.label, tenant=ref.tenant, mode=mode, correction=correction)

    def fidelity(self, handle: HandleLike, max_tokens: int = 32, *, reference: HandleLike | None = None) -> Fidelity:
        """A handle's continuation against dense prefill of its tokens (see :meth:`.compose.Composer.fidelity`)."""
        return self.composer.fidelity(handle, max_tokens, reference=reference)

    def anchor_pool(self, correction: CorrectionConfig | Mapping[str, Any] | None = None) -> AnchorPool:
        """The anchor pools used with ``correction`` settings (the engine's own by default)."""
        return self.placer.anchor_pool(correction)

    def prompt_logprobs(self, prompt: Context, top_logprobs: int = 0) -> list[PromptTokenLogprob]:
        """Each token of ``prompt`` with its log probability after those before it (the first: None) and the
        ``top_logprobs`` likeliest there, at temperature 1: lm-eval's scoring (``echo`` + ``logprobs`` on
        ``/v1/completions``). A dense prefill of the prompt alone, in chunks (``reuse.compose.SCORE_CHUNK``
        rows of logits at a time, so any prompt that fits the context is scored); nothing is kept."""
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs is 0..{MAX_TOP_LOGPROBS}, got {top_logprobs}", param="top_logprobs")
        vocab, scored = self.requests.constraints.token_bytes, []
        tokens = self.composer.score_prompt(prompt, lambda logits, targets: scored.extend(
            scored_tokens(logits, targets, top_logprobs, vocab)))
        return [unscored_token(tokens[0], vocab), *scored]

    def next_token_logits(self, handle: HandleLike, suffix: Context = "") -> torch.Tensor:
        """fp32 next-token logits after ``handle`` + ``suffix``, computed on the reuse path.

        Used to measure fidelity against dense prefill; nothing is kept afterwards.
        """
        return self.composer.next_token_logits(handle, suffix)

    def kv_rows(self, handle: HandleLike, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a live handle's positions ``start..start+n-1`` (for measurements and tests)."""
        return self.composer.read_rows(handle, start, n)

    # -- workflow awareness ---------------------------------------------------------------------
    def register_agent(self, name: Agent, fixed_prompt: Context | Messages, *, prefill: bool = False) -> AgentInfo:
        """Declare an agent's fixed prompt (system prompt, tools, few-shot) for workflow-aware caching.

        ``fixed_prompt`` is text, token ids, or chat messages (rendered without the generation
        prompt, so it is a prefix of the agent's requests). The radix nodes spelling it take the
        agent's steps-to-execution (hints name it by its label). With ``prefill=True`` it is computed
        into the cache now.
        """
        ref = AgentRef.of(name)
        check_agent_of(ref)
        if ref.name is None:
            raise InvalidRequest("agent name is required")
        tokens = self.inputs.prompt_or_messages(fixed_prompt, "fixed_prompt")
        self.inputs.check_context(len(tokens))
        info = AgentInfo(name=ref.label, fixed_tokens=len(tokens))
        with self._lock:
            if self.cache is not None:  # in the agent's own partition: prefetch loads its path there
                self.cache.register_agent(info.name, tokens, self.partitions.cache(ref) or "")
        if prefill:  # computed into that partition now
            self.release(self.materialize(tokens, agent=ref))
        return info

    def unregister_agent(self, name: Agent) -> bool:
        """Forget an agent's registration: its fixed prompt's token ids, and the priority its nodes had
        in the cache; whether it was registered."""
        ref = AgentRef.of(name)
        check_agent_of(ref)
        with self._lock:
            return self.cache.unregister_agent(ref.label) if self.cache is not None else False

    def hints(
        self, steps: Mapping[str, float] | Any, *, running: Iterable[str] = (), finished: Iterable[str] = ()
    ) -> dict[str, float]:
        """Update the agents' steps-to-execution and prefetch those due within the look-ahead.

        ``steps`` is a ``{agent: STE}`` mapping or a step graph (see :func:`kvbaton.ops.ste_map`).
        """
        ste = ste_map(steps, running, finished)
        with self._lock:
            # What the step graph predicted for the agents now running (their events say it).
            before: dict[str, float] = {}
            for agent, value in ste.items():
                if value == 0:  # running now: keep what the last hint said before it ran
                    prev = self._ste.get(agent, math.inf)
                    before[agent] = prev if prev != 0 else self._ste_before_run.get(agent, math.inf)
            self._ste_before_run.clear()  # in place: the lifecycle reads this map
            self._ste_before_run.update(before)
            self._ste.clear()
            self._ste.update(ste)
            if self.prefetcher is not None:
                due = sorted((v, a) for a, v in ste.items() if v <= self.config.lookahead)
                self.prefetcher.submit([a for _, a in due])
        return dict(ste)

    def flush_cache(self) -> None:
        """Drop every cached prefix not pinned by a live handle (device and slow tiers)."""
        with self._lock:
            if self.cache is not None:
                self.cache.flush()
            self.kv.drop_retained()

    def cached_prefix(self, tokens: Sequence[int], agent: Agent | None = None) -> int:
        """How many leading ``tokens`` the prefix cache holds on the device for ``agent``'s requests
        (what a prefill of them would skip): lets a multi-device coordinator predict a recompute's real cost."""
        return self.kv.cached_prefix(tokens, self.partitions.cache(AgentRef.of(agent)))

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

    def export_kv(self, handle: HandleLike) -> tuple[Handle, int, Iterator[tuple[torch.Tensor, torch.Tensor]]]:
        """A live handle's metadata, how many of its tokens have K/V, and an iterator over copies of
        those blocks' K/V, one block at a time (pinned until the iterator ends or is closed)."""
        with self._lock:
            state = self.handles.get(handle)
            return self.requests.publish(state), state.num_cached, self.kv.export(state)

    def adopt(
        self, handle: Handle, kv: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None, num_cached: int = 0,
        *, agent: Agent | None = None,
    ) -> Handle:
        """Register ``handle`` (same id and lineage) in this engine.

        With ``kv``: its first ``num_cached`` tokens' K/V, block by block, as :meth:`export_kv` gives
        them (another engine of the same model). Without: recompute it from its lineage tokens.
        """
        if not isinstance(handle, Handle):
            raise InvalidRequest("adopt needs a Handle with its lineage")
        ref = AgentRef.of(agent)
        self.handles.id_of(handle)  # the compatibility check
        tokens = self.inputs.tokens(handle.token_ids(), what="lineage")
        if len(tokens) != handle.num_tokens or not 0 <= num_cached <= len(tokens):
            raise InvalidRequest(f"handle {handle.id} lineage does not spell its {handle.num_tokens} tokens")
        if handle.id in self.handles:
            raise InvalidRequest(f"handle {handle.id} already lives in this engine")
        state = KVState(id=handle.id, token_ids=tokens, blocks=[], num_cached=0, lineage=handle.lineage,
                        tenant=ref.tenant)
        if kv is None or num_cached == 0:
            return self.requests.prefill(state, ref)  # recomputed densely: exact again
        if not handle.exact:
            state.exact_len = 0  # approximate K/V (compose) stay out of the prefix cache wherever they go
        try:
            self.kv.fill(state, kv, num_cached)
            return self.requests.register(state)
        except BaseException:
            self.requests.abandon(state)
            raise

    # -- tokenization (inputs.py) -----------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.inputs.tokenize(text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.inputs.detokenize(token_ids)

    def chat_tokens(
        self, messages: Messages, *, tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the model's chat template (see :meth:`Inputs.chat_tokens`)."""
        return self.inputs.chat_tokens(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    # -- persistence (persist.py) ------------------------------------------------------------------
    def persist_handles(self, handles: Iterable[Handle], *, owner: str | None = None) -> None:
        """Journal live exact handles (for ``owner``, a server's tenant): they come back after a
        restart of this configuration, until released. A server journals every handle it records;
        in process, call this for the handles to keep. Approximate handles are not journaled."""
        if self._persisted is None:
            raise InvalidRequest("persistence is off: build the engine with persist=True and a disk tier")
        self._persisted.add(handles, owner)

    def close(self) -> None:
        """Stop the prefetch worker and delete slow-tier files. Live handles become unusable; with
        persistence on, the journaled ones are saved first and come back at the next start."""
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        with self._lock:
            if self._persisted is not None:
                try:
                    self._persisted.close()  # the journaled live handles' blocks saved first
                finally:
                    self._persisted = None
            if self.cache is not None:
                self.cache.close()
            for state in self.handles.states():
                self.kv.drop(state)
                self.handles.discard(state.id)
            self.kv.drop_retained()
            self.spans.clear()
        self.audit.close()
        self.placer.close()
        self.scheduler.close()

