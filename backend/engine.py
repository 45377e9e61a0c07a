"""The kvbaton engine: the KV cache of one model on one device, behind the handle operators.

It implements :class:`kvbaton.ops.EngineOps` and is a coordinator: each operator validates its
input (:mod:`.inputs`), derives the new state from its parent under the engine lock (sharing the
parent's blocks, :mod:`.kv_manager`), and hands it to the request lifecycle (:mod:`.lifecycle`:
admission, chunked prefill and the decode loop, through the batching :mod:`.scheduler`), which
registers the result in the handle table (:mod:`.handles`). Composition of segments, merge and
fidelity live in :mod:`.compose`; the stats assembly in :mod:`.stats`.

Operators return new, immutable handles; their inputs stay valid until released. Copy-on-write
keeps forks safe: a write into a partially filled block that another handle also references first
copies that block. Every operation validates its input completely before taking blocks or running
the model, so bad input never costs compute or leaks memory.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from kvbaton.capabilities import KVBATON, Capabilities
from kvbaton.errors import InvalidRequest
from kvbaton.handle import Handle, LineageStep, Op, Placement, Positions, Segment, common_prefix_length
from kvbaton.ops import Messages, check_agent, check_reuse, ste_map
from kvbaton.stream import TokenStream
from kvbaton.types import AgentInfo, Composition, Events, Fidelity, Result, Reuse, SamplingParams, SegmentReport, Stats

from .attention import ATTN_IMPLEMENTATION
from .audit import FidelityAudit
from .block_pool import BlockPool, PoolShape, blocks_for_budget
from .compose import Composer, correction_config, top2_margin
from .correction import AnchorPool, CorrectionConfig
from .events import EventRing, ste_of
from .eviction import EvictionPolicy
from .handles import HandleTable, Identity
from .inputs import Context, Inputs
from .kv_manager import KVManager, prefix_cache_for
from .lifecycle import Lifecycle
from .loader import LoadedModel, load_model
from .model_runner import ModelRunner
from .prefetch import Prefetcher
from .rotary import RopeShifter
from .scheduler import Scheduler
from .spans import MIN_SPAN, TAIL, SpanIndex
from .sequence import KVState
from .stats import engine_stats
from .persist import Persistence, block_keys, state_dir
from .tiers import claim_tiers

log = logging.getLogger(__name__)

DEFAULT_KV_BUDGET = "1GiB"
DEFAULT_BLOCK_SIZE = 16
DEFAULT_PREFILL_CHUNK = 512
DEFAULT_MAX_BATCH_TOKENS = 2048  # per forward, as vLLM's and SGLang's default step budgets
DEFAULT_LOOKAHEAD = 2
MAX_FORK = 1024
DEFAULT_AUDIT_FRACTION = 0.05  # every 20th approximate answer is checked against dense prefill

HandleLike = Handle | str


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
        correction: CorrectionConfig | Mapping[str, Any] | None = None,
        fast_decode: bool = True,
        reuse: Reuse = "exact",
        audit_fraction: float = DEFAULT_AUDIT_FRACTION,
        chat_template: str | None = None,
        event_capacity: int = 4096,
        persist: bool = False,
    ) -> None:
        check_reuse(reuse)
        self.reuse: Reuse = reuse
        if block_size < 1 or prefill_chunk < 1 or max_batch_tokens < 1 or lookahead < 0:
            raise InvalidRequest("block_size, prefill_chunk and max_batch_tokens must be positive, lookahead >= 0")
        if tiers and not prefix_cache:
            raise InvalidRequest("slow tiers hold evicted prefix-cache blocks: they need prefix_cache=True")
        self.correction = correction_config(correction) or CorrectionConfig()
        # Tier directories first: a bad spec or an unwritable directory fails before the model loads.
        claimed = claim_tiers(tiers)
        disk = next((t.dir.path for t in claimed if t.dir is not None), None)
        if persist and disk is None:
            for tier in claimed:
                tier.release()
            raise InvalidRequest(
                "persist=True keeps handles in a disk tier's directory: configure one, e.g. 'disk:4GiB'"
            )
        self._ste: dict[str, float] = {}  # the agents' steps-to-execution, read live by the eviction policies
        self._ste_before_run: dict[str, float] = {}  # each hinted agent's STE just before a hint marked it running
        self.event_ring = EventRing(event_capacity)  # what requests, evictions and prefetches did (events.py)
        try:
            self.loaded: LoadedModel = load_model(model, dtype=dtype, device=device,
                                                  attn_implementation=ATTN_IMPLEMENTATION)
            lm = self.loaded
            shape = PoolShape(lm.num_layers, lm.num_kv_heads, lm.head_dim, block_size, lm.dtype)
            self.pool = BlockPool(shape, blocks_for_budget(kv_budget, shape.bytes_per_block), lm.device)
            self.cache = prefix_cache_for(self.pool, self._ste, eviction, claimed, tier_eviction) if prefix_cache else None
        except BaseException:
            for tier in claimed:  # from here on the cache owns them (and closes them)
                tier.release()
            raise
        if self.cache is not None:
            weakref.finalize(self, self.cache.close)  # removes disk-tier files, at exit too
            self.cache.on_evict = self._evicted
        self.runner = ModelRunner(lm, self.pool, fast_decode=fast_decode)
        self.scheduler = Scheduler(self.runner, max_batch_tokens=max(max_batch_tokens, prefill_chunk))
        # The worker threads keep the pool alive: stop them when an unclosed engine is collected.
        weakref.finalize(self, self.scheduler.close)
        self.tokenizer = lm.tokenizer
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        self.lookahead = lookahead
        self.positions = Positions(rope_type=lm.rope_type, rope_theta=lm.rope_theta, rope_parameters=lm.rope_parameters)
        self.shifter = RopeShifter.from_model(lm.model, lm.rope_type, lm.rope_parameters)
        self._lock = threading.RLock()
        self.handles: HandleTable[KVState] = HandleTable(Identity(
            model=lm.name, fingerprint=lm.fingerprint, tokenizer_fingerprint=lm.tokenizer_fingerprint,
            positions=self.positions, placement=Placement(device=str(lm.device), tier="device"),
            runs=f"{lm.name!r} in {lm.dtype}",
        ))
        # The live handles are what a reservation may spill when the pool is full (spill.py).
        self.kv = KVManager(self.pool, self.cache, self._lock, live=self.handles.states)
        # The prefix-cache scope of a request's agent: one scope "" (everyone reuses everyone's
        # prefixes) unless ``isolate_prefix_cache`` keeps tenants apart (a multi-tenant server).
        self.cache_scope: Callable[[str | None], str | None] = _one_cache_scope
        self.kv.scope = lambda state: self.cache_scope(state.agent)
        self.prefetcher: Prefetcher | None = None
        if self.cache is not None and self.cache.tiers and prefetch:
            self.prefetcher = Prefetcher(self.kv, self._ste)
            self.prefetcher.on_prefetch = self._prefetched
            weakref.finalize(self, self.prefetcher.close)
        self.inputs = Inputs(lm, chat_template)
        self.requests = Lifecycle(self.kv, self.scheduler, self.handles, lm, prefill_chunk, self.event_ring)
        self.requests.predicted = self._predicted
        # Cross-prefix reuse: every live exact state is indexed by content (spans.py). ``span_scope``
        # maps a request's agent to the scope its spans may come from (None: no cross-prefix reuse);
        # a multi-tenant server sets it to the agent's tenant.
        self.span_scope: Callable[[str | None], str | None] = lambda agent: ""
        self.spans = SpanIndex(live=self.handles.find)
        self.requests.on_register = self._index
        self.requests.on_drop = self.spans.remove
        if not 0 <= audit_fraction <= 1:
            raise InvalidRequest(f"audit_fraction must be in [0, 1], got {audit_fraction!r}")
        # The audit thread must not keep an unclosed engine alive: it holds a proxy, and is stopped
        # when the engine is collected.
        self.audit = FidelityAudit(functools.partial(Engine._dense_argmax, weakref.proxy(self)), audit_fraction)
        weakref.finalize(self, self.audit.close)
        # A proxy: the composer calls the public operators without keeping the engine alive.
        self.composer = Composer(
            self.kv, self.handles, self.requests, self.inputs, self.shifter, weakref.proxy(self), self.correction,
            lm.num_kv_heads, lm.head_dim,
        )
        # Handles of an earlier run of this configuration come back spilled: K/V from saved blocks or lineage.
        self.persistence: Persistence | None = None
        if persist:
            assert disk is not None
            self.persistence = Persistence(state_dir(disk), fingerprint=lm.fingerprint, dtype=str(lm.dtype),
                                           block_size=block_size)
            self._restore()
        elif disk is not None and state_dir(disk).exists():
            log.warning("%s holds handles persisted by an earlier run: they are kept, not served (start with "
                        "persist on to serve them)", state_dir(disk))
        log.info("engine ready: model=%s dtype=%s device=%s blocks=%d x %d tokens",
                 lm.name, dtype, device, self.pool.num_blocks, block_size)

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

    def healthy(self) -> tuple[bool, str]:
        """An in-process engine serves while its process runs."""
        return True, "ok"

    def capabilities(self) -> Capabilities:
        """What this engine does exactly, corrects, recomputes or cannot do."""
        return KVBATON

    # -- handle operators ---------------------------------------------------------------------
    def materialize(self, context: Context, *, agent: str | None = None) -> Handle:
        tokens = self.inputs.tokens(context, what="context")
        self.inputs.check_context(len(tokens))
        state = self.kv.share(None, 0, tokens, LineageStep(op=Op.MATERIALIZE, token_ids=tuple(tokens)))
        return self.requests.prefill(state, agent)

    def extend(self, handle: HandleLike, context: Context, *, agent: str | None = None) -> Handle:
        tokens = self.inputs.tokens(context, what="context")
        return self.requests.prefill(self._behind(handle, tokens, Op.EXTEND), agent)

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
               agent: str | None = None) -> Result:
        return self.resume_stream(handle, suffix, sampling, agent=agent).until_done()

    def resume_stream(self, handle: HandleLike, suffix: Context = "", sampling: SamplingParams | None = None, *,
                      agent: str | None = None) -> TokenStream:
        params = sampling or SamplingParams()
        tokens = self.inputs.tokens(suffix, what="suffix", allow_empty=True)
        return self.requests.stream(self._behind(handle, tokens, Op.RESUME, params.max_tokens), params, agent)

    def complete(self, prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None,
                 reuse: Reuse | None = None) -> Result:
        return self.complete_stream(prompt, sampling, agent=agent, reuse=reuse).until_done()

    def complete_stream(
        self, prompt: Context, sampling: SamplingParams | None = None, *, agent: str | None = None,
        reuse: Reuse | None = None,
    ) -> TokenStream:
        """Plain completion of raw text or tokens, no handle and no chat template (``reuse`` as for generate)."""
        params = sampling or SamplingParams()
        tokens = self.inputs.tokens(prompt, what="prompt")
        self.inputs.check_context(len(tokens), params.max_tokens)
        return self._generation(tokens, None, params, agent, reuse)

    def generate(
        self, messages: Messages, *, handle: HandleLike | None = None, sampling: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None, agent: str | None = None, reuse: Reuse | None = None,
    ) -> Result:
        return self.generate_stream(
            messages, handle=handle, sampling=sampling, tools=tools, agent=agent, reuse=reuse
        ).until_done()

    def generate_stream(
        self, messages: Messages, *, handle: HandleLike | None = None, sampling: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None, agent: str | None = None, reuse: Reuse | None = None,
    ) -> TokenStream:
        """Chat-templated generation reusing ``handle``'s K/V (or the prefix cache's) for the longest
        common token prefix; with ``reuse="auto"``/``"rotate"`` also spans that other agents computed
        behind a different prefix (docs/segments.md, "Automatic reuse")."""
        params = sampling or SamplingParams()
        prompt = self.chat_tokens(messages, tools=tools)
        self.inputs.check_context(len(prompt), params.max_tokens)
        return self._generation(prompt, handle, params, agent, reuse)

    def _generation(
        self, prompt: list[int], handle: HandleLike | None, params: SamplingParams, agent: str | None,
        reuse: Reuse | None,
    ) -> TokenStream:
        check_reuse(reuse)
        check_agent(agent)
        policy = reuse or self.reuse
        scope = self.span_scope(agent) if policy != "exact" else None
        with self._lock:
            parent = self.handles.get(handle) if handle is not None else None
            keep = common_prefix_length(parent.token_ids, prompt) if parent is not None else 0
            if scope is not None:
                # The agent's own earlier approximate turn: resume it rather than re-prefill its transcript.
                own, n = self.spans.approximate_prefix(prompt, scope)
                if own is not None and n >= max(keep, self.kv.cached_prefix(prompt, self.cache_scope(agent))) + MIN_SPAN:
                    parent, keep = own, n
            if parent is None:
                state = self.kv.share(None, 0, prompt, LineageStep(op=Op.GENERATE, token_ids=tuple(prompt)))
            else:
                step = LineageStep(
                    op=Op.GENERATE, parent=parent.id, keep=None if keep == parent.num_tokens else keep,
                    token_ids=tuple(prompt[keep:]),
                )
                state = self.kv.share(parent, keep, prompt[keep:], step)
        prepare = None if scope is None else functools.partial(self._place_spans, policy=policy, scope=scope)
        return self.requests.stream(state, params, agent, prepare)

    def _place_spans(
        self, state: KVState, *, policy: Reuse, scope: str
    ) -> tuple[torch.Tensor, list[SegmentReport]]:
        """Cross-prefix reuse for an admitted request: place the spans of its prompt that live states of
        ``scope`` hold (after its exact prefix), compute the rest, and, under ``"auto"``, recompute
        densely from the first approximated token when the next token looks unsure (lock not held)."""
        with self._lock:
            # The prompt's last TAIL tokens are always computed (the last one: the request needs its logits).
            end = max(state.num_cached, state.num_tokens - TAIL)
            found = self.spans.find(state.token_ids, state.num_cached, end, scope)
            pinned = [b for m in found for b in m.source.blocks]
            self.kv.pin(pinned)  # the sources may be released meanwhile: keep their K/V readable
        try:
            mode = "blend" if policy == "auto" else "rotate"
            reports = self.composer.place_all(
                state, [(m.source, m.start, m.start + m.length, m.offset) for m in found], mode
            )
            logits = self.requests.compute(state)
            approximated = [r.offset + r.tokens_cached for r in reports if r.outcome in ("rotated", "blended")]
            if approximated and policy == "auto":
                margin = top2_margin(logits)
                threshold = self.audit.margin_for(state.agent, self.correction.blend_min_margin)
                if margin < threshold:
                    reports = self.composer.recompute_unsure(state, reports, margin, threshold, min(approximated))
                    assert state.last_logits is not None
                    logits = state.last_logits
            if state.exact_len is not None:  # answered from approximate K/V: maybe checked, in the background
                self.audit.submit(state.agent, state.token_ids, int(logits.argmax()))
            return logits, reports
        finally:
            self.kv.unpin(pinned)

    def _dense_argmax(self, prompt: list[int]) -> int:
        """The next-token argmax after ``prompt`` on the exact path (the fidelity audit's reference), as
        background work: it never delays a request by more than one small chunk."""
        with self.scheduler.background():
            result = self.complete(prompt, SamplingParams(max_tokens=1), reuse="exact")
        self.release(result.handle)
        return result.token_ids[0]

    def _index(self, state: KVState) -> None:
        """A new live state's spans become sources for other requests of its scope (lock held)."""
        scope = self.span_scope(state.agent)
        if scope is not None:
            self.spans.add(state, scope)

    def release(self, handles: HandleLike | Iterable[HandleLike]) -> None:
        with self._lock:
            released = self.handles.release(handles)  # all or nothing
            for _, state in released:
                self.kv.drop(state)
                self.spans.remove(state.id)
        if self.persistence is not None:  # durable: a released handle never comes back
            self.persistence.journal.release([hid for hid, _ in released])

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

    def _evicted(self, nodes: list[Any], tier: str) -> None:
        """An eviction round of the prefix cache, with the steps-to-execution that ranked it (lock held)."""
        assert self.cache is not None
        owners = {agent for node in nodes for agent in node.owners}
        self.event_ring.emit("evict", blocks=len(nodes), tier=tier, policy=self.cache.policy.name,
                             steps_to_execution=ste_of(owners, self._ste))

    def _predicted(self, agent: str | None) -> float | None:
        """The steps-to-execution the hints gave ``agent`` just before it ran (None: unknown)."""
        if not isinstance(agent, str):
            return None
        with self._lock:
            value = self._ste_before_run.get(agent)
        return None if value is None or math.isinf(value) else value

    def _prefetched(self, agent: str, loaded: dict[str, int]) -> None:
        for tier, blocks in loaded.items():
            self.event_ring.emit("prefetch", agent=agent, blocks=blocks, tier=tier)

    def _behind(self, handle: HandleLike, tokens: list[int], op: Op, max_new_tokens: int = 0) -> KVState:
        """A new state: ``handle``'s tokens (their K/V shared) followed by ``tokens``."""
        with self._lock:
            parent = self.handles.get(handle)
            self.inputs.check_context(parent.num_tokens + len(tokens), max_new_tokens)
            step = LineageStep(op=op, parent=parent.id, token_ids=tuple(tokens))
            return self.kv.share(parent, parent.num_tokens, tokens, step)

    # -- composition of shared segments (compose.py) --------------------------------------------
    def compose(
        self, prefix: HandleLike | Context | None = None, segments: Sequence[Segment | Handle] = (),
        suffix: Context | None = None, *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        """Assemble ``prefix + segments + suffix`` from existing K/V (see :meth:`.compose.Composer.compose`)."""
        return self.composer.compose(prefix, segments, suffix, agent=agent, mode=mode, correction=correction)

    def merge(
        self, parts: Sequence[Segment | Handle], *, agent: str | None = None, mode: str = "auto",
        correction: Mapping[str, Any] | None = None,
    ) -> Composition:
        """Restricted merge: never blends divergent K/V of the same positions (see :meth:`.compose.Composer.merge`)."""
        return self.composer.merge(parts, agent=agent, mode=mode, correction=correction)

    def fidelity(self, handle: HandleLike, max_tokens: int = 32, *, reference: HandleLike | None = None) -> Fidelity:
        """A handle's continuation against dense prefill of its tokens (see :meth:`.compose.Composer.fidelity`)."""
        return self.composer.fidelity(handle, max_tokens, reference=reference)

    def anchor_pool(self, correction: CorrectionConfig | Mapping[str, Any] | None = None) -> AnchorPool:
        """The anchor pools used with ``correction`` settings (the engine's own by default)."""
        return self.composer.anchor_pool(correction)

    def next_token_logits(self, handle: HandleLike, suffix: Context = "") -> torch.Tensor:
        """fp32 next-token logits after ``handle`` + ``suffix``, computed on the reuse path.

        Used to measure fidelity against dense prefill; nothing is kept afterwards.
        """
        return self.composer.next_token_logits(handle, suffix)

    def kv_rows(self, handle: HandleLike, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a live handle's positions ``start..start+n-1`` (for measurements and tests)."""
        return self.composer.read_rows(handle, start, n)

    # -- workflow awareness ---------------------------------------------------------------------
    def register_agent(self, name: str, fixed_prompt: Context | Messages, *, prefill: bool = False) -> AgentInfo:
        """Declare an agent's fixed prompt (system prompt, tools, few-shot) for workflow-aware caching.

        ``fixed_prompt`` is text, token ids, or chat messages (rendered without the generation
        prompt, so it is a prefix of the agent's requests). The radix nodes spelling it take the
        agent's steps-to-execution. With ``prefill=True`` it is computed into the cache now.
        """
        check_agent(name)
        if name is None:
            raise InvalidRequest("agent name is required")
        tokens = self.inputs.prompt_or_messages(fixed_prompt, "fixed_prompt")
        self.inputs.check_context(len(tokens))
        with self._lock:
            if self.cache is not None:  # in the agent's own scope: prefetch loads its path there
                self.cache.register_agent(name, tokens, self.cache_scope(name) or "")
        if prefill:
            self.release(self.materialize(tokens, agent=name))
        return AgentInfo(name=name, fixed_tokens=len(tokens))

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
            self._ste_before_run = before
            self._ste.clear()
            self._ste.update(ste)
            if self.prefetcher is not None:
                due = sorted((v, a) for a, v in ste.items() if v <= self.lookahead)
                self.prefetcher.submit([a for _, a in due])
        return dict(ste)

    def flush_cache(self) -> None:
        """Drop every cached prefix not pinned by a live handle (device and slow tiers)."""
        with self._lock:
            if self.cache is not None:
                self.cache.flush()

    def cached_prefix(self, tokens: Sequence[int], agent: str | None = None) -> int:
        """How many leading ``tokens`` the prefix cache holds on the device for ``agent``'s requests
        (what a prefill of them would skip): lets a multi-device coordinator predict a recompute's real cost."""
        return self.kv.cached_prefix(tokens, self.cache_scope(agent))

    def isolate_prefix_cache(self, isolate: bool = True) -> None:
        """Keep tenants' prefix caches apart (``isolate``), or share one (the default).

        Isolated, a request of agent ``t/a`` (a multi-tenant server's name of tenant ``t``'s agent
        ``a``; ``t/`` for its agentless requests) reuses, waits on and loads back only prefix-cache
        blocks that requests of tenant ``t`` put there; a request whose tenant is unknown (no agent,
        or one without ``/``: engine-internal work, a handle moved in from another worker) neither
        reads nor feeds the cache.

        Changing it drops the prefix cache (what it holds is in the old scopes, where no request would
        look) and puts a persistent engine's saved blocks back in their new scopes: call it before serving."""
        scope = tenant_cache_scope if isolate else _one_cache_scope
        if scope is self.cache_scope:
            return
        with self._lock:
            self.cache_scope = scope
            if self.cache is not None:
                self.cache.flush()
            restored = [s for hid, s in self.handles.items() if hid in self.kv.spiller.spilled]
        if self.persistence is not None:
            for state in restored:
                self._place_saved(state)

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
        *, agent: str | None = None,
    ) -> Handle:
        """Register ``handle`` (same id and lineage) in this engine.

        With ``kv``: its first ``num_cached`` tokens' K/V, block by block, as :meth:`export_kv` gives
        them (another engine of the same model). Without: recompute it from its lineage tokens.
        """
        if not isinstance(handle, Handle):
            raise InvalidRequest("adopt needs a Handle with its lineage")
        self.handles.id_of(handle)  # the compatibility check
        tokens = self.inputs.tokens(handle.token_ids(), what="lineage")
        if len(tokens) != handle.num_tokens or not 0 <= num_cached <= len(tokens):
            raise InvalidRequest(f"handle {handle.id} lineage does not spell its {handle.num_tokens} tokens")
        if handle.id in self.handles:
            raise InvalidRequest(f"handle {handle.id} already lives in this engine")
        state = KVState(id=handle.id, token_ids=tokens, blocks=[], num_cached=0, lineage=handle.lineage)
        if kv is None or num_cached == 0:
            return self.requests.prefill(state, agent)  # recomputed densely: exact again
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
        if self.persistence is None:
            raise InvalidRequest("persistence is off: build the engine with persist=True and a disk tier")
        handles = list(handles)
        for handle in handles:
            self.handles.get(handle)  # live here, or the typed error
        self.persistence.journal.add(owner, handles)

    def _restore(self) -> None:
        """Register the journal's handles as spilled, and put their saved blocks in the prefix cache."""
        assert self.persistence is not None
        journal, store, bs = self.persistence.journal, self.persistence.blocks, self.block_size
        gone, needed = [], set()
        for entry in journal.live():
            handle = entry.handle
            try:
                self.handles.identity.check(handle)  # type: ignore[union-attr]
                tokens = self.inputs.tokens(handle.token_ids(), what="lineage")
                if len(tokens) != handle.num_tokens or handle.id in self.handles:
                    raise InvalidRequest(f"handle {handle.id} lineage does not spell its {handle.num_tokens} tokens")
            except Exception as exc:  # noqa: BLE001 - one bad record costs its handle, not the start
                log.warning("persisted handle %s is dropped: %s", handle.id, exc)
                gone.append(handle.id)
                continue
            # A server journals its tenant as the owner: "tenant/" is that tenant's agentless request, so the
            # handle's blocks go to (and are found in) its tenant's prefix-cache scope.
            agent = entry.agent or (f"{entry.owner}/" if entry.owner else None)
            state = KVState(id=handle.id, token_ids=tokens, blocks=[], num_cached=0, lineage=handle.lineage,
                            agent=agent)
            with self._lock:
                self.handles.add(handle.id, state)
                self.kv.spiller.spilled.add(handle.id)
            needed.update(block_keys(tokens, bs, len(tokens) // bs))
            self._place_saved(state)
        journal.release(gone)
        store.keep_only(needed)
        log.info("restored %d persisted handle(s)", len(journal.live()))

    def _place_saved(self, state: KVState) -> None:
        """Put the saved blocks of a restored (spilled) handle in the prefix cache, in its scope: its next
        use attaches them there. A block never saved or unreadable stops it: the rest is recomputed."""
        assert self.persistence is not None
        store, bs = self.persistence.blocks, self.block_size
        keys = block_keys(state.token_ids, bs, len(state.token_ids) // bs)

        def read(i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
            if keys[i] not in store:
                return None  # never saved (a crash, a full disk): recomputed from the lineage
            try:
                return store.get(keys[i])
            except Exception as exc:  # noqa: BLE001 - missing or corrupted: recomputed, never used
                log.warning("%s; those tokens will be recomputed", exc)
                return None

        self.kv.cache_blocks(state.token_ids, len(keys), read, self.kv.scope(state))

    def _save(self) -> None:
        """Save the full blocks of every journaled live handle the store lacks; delete the others."""
        assert self.persistence is not None
        store, bs, needed = self.persistence.blocks, self.block_size, set()
        failed: Exception | None = None
        for entry in self.persistence.journal.live():
            state = self.handles.find(entry.handle.id)
            if state is None:
                continue
            keys = block_keys(state.token_ids, bs, len(state.token_ids) // bs)
            needed.update(keys)
            for i, key in enumerate(keys):
                if failed is not None or key in store:
                    continue
                data = self.kv.full_block(state, i)
                if data is None:
                    break  # recomputed from the lineage after the restart
                try:
                    store.put(key, *data)
                except Exception as exc:  # noqa: BLE001 - a full disk (safetensors' own error type)
                    failed = exc
        if failed is not None:
            log.warning("saving the live handles' blocks stopped (%s): the rest are recomputed after the restart",
                        failed)
        store.keep_only(needed)

    def close(self) -> None:
        """Stop the prefetch worker and delete slow-tier files. Live handles become unusable; with
        persistence on, the journaled ones are saved first and come back at the next start."""
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        with self._lock:
            if self.persistence is not None:
                try:
                    self._save()
                finally:
                    self.persistence.close()
                    self.persistence = None
            if self.cache is not None:
                self.cache.close()
            for state in self.handles.states():
                self.kv.drop(state)
                self.handles.discard(state.id)
            self.spans.clear()
        self.audit.close()
        self.composer.close()
        self.scheduler.close()


def _one_cache_scope(agent: str | None) -> str:
    """One prefix-cache scope for every request (an embedded engine, a single-tenant server)."""
    return ""


def tenant_cache_scope(agent: str | None) -> str | None:
    """The prefix-cache scope of a multi-tenant server's engine agent name ``tenant/agent``: its tenant
    (None, no prefix cache, when the name has no tenant part: whose the state is is unknown)."""
    return agent.split("/", 1)[0] if agent and "/" in agent else None
