"""kvbaton's engine surface over an in-process SGLang engine (``engine="sglang"``).

The SDK's clients and ``kvbaton serve`` call these methods exactly as they call
:class:`kvbaton.backend.Engine`. A handle here is a token prefix: SGLang keeps the KV in its radix
tree, so ``fork`` is a shared prefix (nothing copied), ``resume`` is a generation over the prefix
tokens plus the suffix, and SGLang reuses whatever of the prefix its tree still holds. The cached
token count SGLang reports is checked against the handle: anything short of it was evicted and
prefilled again (still exact, only slower): counted as prefilled in ``Stats``, and logged.

What SGLang cannot do, this engine does not pretend to: a segment at a new position is prefilled
densely, and a live handle does not pin its KV (see :data:`kvbaton.capabilities.SGLANG`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvbaton.capabilities import SGLANG, Capabilities
from kvbaton.errors import InvalidRequest, MergeConflict, ModelNotFound
from kvbaton.handle import Handle, LineageStep, Op, Placement, Positions, Segment, common_prefix_length, new_handle_id
from kvbaton.ops import check_agent, check_reuse, ste_map
from kvbaton.stream import TokenStream
from kvbaton.types import (
    AgentInfo,
    ChatMessage,
    Composition,
    Events,
    Result,
    Reuse,
    SamplingParams,
    SegmentReport,
    Stats,
    StreamChunk,
    Timings,
)

from ..events import check_since
from ..handles import HandleTable, Identity
from ..hosting import check_partition
from ..tenants import Agent, AgentRef, TenantPartition
from . import SGLANG_VERSION
from .budget import kv_tokens_for_budget
from .table import WorkflowHint, make_envelope

log = logging.getLogger("kvbaton.sglang")

@dataclass
class _State:
    token_ids: list[int]
    lineage: tuple[LineageStep, ...]


class SglangEngine:
    """An ``sglang.Engine`` (scheduler and model in SGLang's own processes) behind kvbaton's API.

    ``eviction="kvbaton"`` (default) selects the plugin's steps-to-execution policy, ``"lru"`` SGLang's
    own; ``host_tier_gb`` enables SGLang's HiCache host tier (prefetched for agents due within
    ``lookahead`` steps). Other keywords pass through to ``sglang.Engine``.
    """

    def __init__(
        self,
        model: str | None,
        *,
        kv_budget: str | int | None = None,
        eviction: str = "kvbaton",
        lookahead: int = 2,
        host_tier_gb: int | None = None,
        page_size: int = 1,
        dtype: str = "auto",
        log_level: str = "error",
        **sglang_options: Any,
    ) -> None:
        if not model:
            raise InvalidRequest('engine="sglang" needs model=<local Hugging Face checkpoint dir>')
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{model!r} is not a local Hugging Face checkpoint (no config.json)")
        try:
            import sglang
        except ImportError as exc:
            raise InvalidRequest(
                f"engine='sglang' needs sglang=={SGLANG_VERSION} in this Python (docs/sglang.md: installing)"
            ) from exc
        if eviction not in ("kvbaton", "lru"):
            raise InvalidRequest(f"unknown eviction policy {eviction!r} for SGLang: use 'kvbaton' or 'lru'")
        if eviction == "kvbaton":
            _check_plugin_visible()
        config = json.loads((path / "config.json").read_text())
        options: dict[str, Any] = {
            "model_path": str(path),
            "radix_eviction_policy": eviction,
            "page_size": page_size,
            "dtype": dtype,
            "log_level": log_level,
            "incremental_streaming_output": True,  # chunks are disjoint: each carries only new tokens
        }
        if eviction == "kvbaton":
            options["radix_eviction_policy_config"] = {"lookahead": lookahead}
        if kv_budget is not None:
            options["max_total_tokens"] = kv_tokens_for_budget(kv_budget, config)
        if host_tier_gb:
            options.update(enable_hierarchical_cache=True, hicache_size=int(host_tier_gb))
        options.update(sglang_options)
        self.eviction = eviction
        self.lookahead = lookahead
        self.sgl = sglang.Engine(**options)
        self.tokenizer = self.sgl.tokenizer_manager.tokenizer
        max_context = config.get("max_position_embeddings")
        self.loaded = SimpleNamespace(name=path.name, max_context=max_context, device="cuda", dtype=dtype)
        weights = sorted((p.name, p.stat().st_size) for p in path.glob("*.safetensors"))
        self.fingerprint = _digest({"config": config, "weights": weights, "dtype": dtype, "engine": "sglang"})
        self.tokenizer_fingerprint = _digest(
            {n: (path / n).read_text() for n in ("tokenizer.json", "tokenizer_config.json") if (path / n).is_file()}
        )
        self.positions = Positions(
            rope_type=str((config.get("rope_scaling") or {}).get("rope_type", "default")),
            rope_theta=float(config.get("rope_theta", 10000.0)),
        )
        self.placement = Placement(device="cuda", tier="device")
        self.page_size = page_size
        self.kv_tokens = options.get("max_total_tokens")
        self._lock = threading.Lock()
        # sglang.Engine's synchronous API drives one asyncio loop (run_until_complete) and one RPC
        # socket: one thread at a time. Streams take it per chunk, so concurrent requests still batch.
        self._sgl_lock = threading.Lock()
        self._table: HandleTable[_State] = HandleTable(Identity(
            model=self.loaded.name, fingerprint=self.fingerprint, tokenizer_fingerprint=self.tokenizer_fingerprint,
            positions=self.positions, placement=self.placement, runs="SGLang",
        ))
        self._agents: dict[str, list[int]] = {}
        self._ste: dict[str, float] = {}
        self._counters = {"tokens_reused": 0, "tokens_prefilled": 0, "tokens_generated": 0}

    # -- what this engine can do ------------------------------------------------------------------

    def healthy(self) -> tuple[bool, str]:
        """SGLang's scheduler runs in this process's engine: it serves while the process runs."""
        return True, "ok"

    def capabilities(self) -> Capabilities:
        return SGLANG

    @property
    def max_context(self) -> int | None:
        """The model's context length in tokens, when its config says."""
        return self.loaded.max_context

    # -- the hosted-engine contract (hosting.py) ----------------------------------------------------

    @property
    def model_name(self) -> str:
        return str(self.loaded.name)

    @property
    def default_reuse(self) -> Reuse:
        """SGLang reuses common prefixes only: every request is served exactly."""
        return "exact"

    @property
    def partitionable(self) -> TenantPartition:
        """Nothing: SGLang's radix tree is one for every request, and there is no span index."""
        return TenantPartition()

    def partition_tenants(self, partition: TenantPartition) -> None:
        check_partition(self, partition, self.partitionable)

    @property
    def persistence(self) -> None:
        """Handles do not survive a restart of SGLang."""
        return None

    # -- tokens -----------------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def chat_tokens(
        self, messages: Sequence[ChatMessage | dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        plain = [m.model_dump() if isinstance(m, ChatMessage) else dict(m) for m in messages]
        text = self.tokenizer.apply_chat_template(
            plain, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return self.tokenize(text)

    def _tokens(self, context: str | Sequence[int], what: str) -> list[int]:
        tokens = self.tokenize(context) if isinstance(context, str) else [int(t) for t in context]
        if not tokens and what != "suffix":
            raise InvalidRequest(f"{what} is empty")
        return tokens

    # -- handles ----------------------------------------------------------------------------------

    def _lookup(self, handle: Handle | str) -> _State:
        return self._table.get(handle)

    def _new(self, tokens: list[int], lineage: tuple[LineageStep, ...]) -> Handle:
        handle_id = new_handle_id()
        self._table.add(handle_id, _State(tokens, lineage))
        return self._table.identity.handle(handle_id, len(tokens), lineage)  # type: ignore[union-attr]

    def describe(self, handle: Handle | str) -> Handle:
        """The current metadata of a live handle."""
        handle_id = self._table.id_of(handle)
        state = self._lookup(handle_id)
        return self._table.identity.handle(handle_id, len(state.token_ids), state.lineage)  # type: ignore[union-attr]

    def materialize(self, context: str | Sequence[int], *, agent: Agent | None = None) -> Handle:
        tokens = self._tokens(context, "context")
        self._prefill(tokens, agent, reusable=0)
        return self._new(tokens, (LineageStep(op=Op.MATERIALIZE, token_ids=tuple(tokens)),))

    def extend(self, handle: Handle | str, context: str | Sequence[int], *, agent: Agent | None = None) -> Handle:
        parent_id = handle.id if isinstance(handle, Handle) else handle
        parent = self._lookup(handle)
        added = self._tokens(context, "context")
        tokens = parent.token_ids + added
        self._prefill(tokens, agent, reusable=len(parent.token_ids))
        step = LineageStep(op=Op.EXTEND, parent=parent_id, token_ids=tuple(added))
        return self._new(tokens, parent.lineage + (step,))

    def fork(self, handle: Handle | str, k: int = 2) -> list[Handle]:
        if not isinstance(k, int) or k < 1:
            raise InvalidRequest(f"fork needs k >= 1, got {k!r}")
        parent_id = handle.id if isinstance(handle, Handle) else handle
        parent = self._lookup(handle)
        # The prefix is in SGLang's radix tree already: k handles naming it share it, nothing copied.
        step = LineageStep(op=Op.FORK, parent=parent_id)
        return [self._new(list(parent.token_ids), parent.lineage + (step,)) for _ in range(k)]

    def release(self, handles: Handle | str | Iterable[Handle | str]) -> None:
        # All or nothing, with kvbaton's errors. The KV stays in SGLang's tree as evictable cache; only the name goes.
        self._table.release(handles)

    # -- shared segments: SGLang cannot re-align or correct cached keys, so this is dense prefill -----

    def compose(self, prefix: Handle | str | Sequence[int] | None = None, segments: Sequence[Segment | Handle] = (),
                suffix: str | Sequence[int] | None = None, *, agent: Agent | None = None, mode: str = "auto",
                correction: Mapping[str, Any] | None = None) -> Composition:
        """``prefix + segments + suffix`` prefilled by SGLang: a segment is reused exactly when its
        tokens sit at the same positions behind the same tokens as in its source (SGLang's radix tree
        finds it), and prefilled densely otherwise, whatever ``mode`` asks: never approximate KV."""
        if mode not in ("auto", "rotate", "dense"):
            raise InvalidRequest(f"unknown compose mode {mode!r}: use 'auto', 'rotate' or 'dense'")
        agent = AgentRef.of(agent).label
        check_agent(agent)
        start_time = time.perf_counter()
        parent_id: str | None = None
        if isinstance(prefix, Handle):  # as in kvbaton's engine: a string prefix is text
            parent_id = prefix.id
            tokens = list(self._lookup(prefix).token_ids)
        else:
            tokens = self._tokens(prefix, "suffix") if prefix is not None else []
        head = len(tokens)
        placed: list[tuple[Segment, int, list[int]]] = []
        for item in segments:
            seg = item if isinstance(item, Segment) else Segment(handle=item)
            lo, hi = seg.bounds()
            source = self._lookup(seg.handle).token_ids
            if not 0 <= lo < hi <= len(source):
                raise InvalidRequest(f"segment {lo}..{hi} is outside handle {seg.handle.id} ({len(source)} tokens)")
            placed.append((seg, len(tokens), source))
            tokens += source[lo:hi]
        tokens += self._tokens(suffix, "suffix") if suffix is not None else []
        if not tokens:
            raise InvalidRequest("compose needs at least one token")
        with self._sgl_lock:
            out = self.sgl.generate(input_ids=tokens, sampling_params={"max_new_tokens": 0},
                                    kv_hints=self._hints_for(tokens, agent))
        cached = int(out["meta_info"].get("cached_tokens", 0))
        self._account(len(tokens), cached, 0, 0)
        reports = []
        for i, (seg, offset, source) in enumerate(placed):
            lo, hi = seg.bounds()
            reused = max(0, min(hi - lo, cached - offset))
            if offset == lo and tokens[:offset] == source[:lo]:
                outcome = "exact"
                reason = "same tokens before it: reused from SGLang's radix tree"
                if reused < hi - lo:
                    reason += f" except {hi - lo - reused} tokens it no longer held (prefilled again)"
            else:
                outcome = "recomputed"
                reason = "SGLang cannot re-align or correct cached KV: prefilled densely behind the new prefix"
            reports.append(SegmentReport(index=i, source=seg.handle.id, start=lo, end=hi, offset=offset,
                                         outcome=outcome, reason=reason, tokens_reused=reused))
        step = LineageStep(op=Op.COMPOSE, parent=parent_id, token_ids=tuple(tokens[head:] if parent_id else tokens))
        base = self._lookup(parent_id).lineage if parent_id else ()
        handle = self._new(tokens, base + (step,))
        return Composition(handle=handle, segments=reports, exact=True, tokens_reused=cached,
                           tokens_prefilled=len(tokens) - cached, compose_s=time.perf_counter() - start_time)

    def merge(self, parts: Sequence[Segment | Handle], *, agent: Agent | None = None, mode: str = "auto",
              correction: Mapping[str, Any] | None = None) -> Composition:
        """kvbaton's restricted merge: prefix-compatible handles give the longest; segments are
        concatenated through :meth:`compose`; divergent tokens at the same positions raise MergeConflict."""
        items = list(parts)
        if not items:
            raise InvalidRequest("merge needs at least one handle or segment")
        if not all(isinstance(p, Handle) for p in items):
            return self.compose(segments=items, agent=agent, mode=mode)
        start_time = time.perf_counter()
        states = [(p, self._lookup(p)) for p in items]
        longest_handle, longest = max(states, key=lambda hs: len(hs[1].token_ids))
        for handle, state in states:
            common = common_prefix_length(state.token_ids, longest.token_ids)
            if common < len(state.token_ids):
                raise MergeConflict(f"handles {handle.id} and {longest_handle.id} diverge at token {common}: "
                                    "compose explicit segments instead, or reduce the texts with a generate call")
        (child,) = self.fork(longest_handle, 1)
        reports = [SegmentReport(index=i, source=h.id, start=0, end=len(st.token_ids), offset=0, outcome="exact",
                                 reason="prefix-compatible", tokens_reused=len(st.token_ids))
                   for i, (h, st) in enumerate(states)]
        return Composition(handle=child, segments=reports, exact=True, tokens_reused=child.num_tokens,
                           tokens_prefilled=0, compose_s=time.perf_counter() - start_time)

    def fidelity(self, handle: Handle | str, max_tokens: int = 32, *, reference: Handle | str | None = None) -> Any:
        raise InvalidRequest("fidelity is unsupported on the SGLang engine: its handles are always dense prefill "
                             "of their tokens (nothing approximate to measure)")

    def transfer(self, handle: Handle | str, device: int | str) -> Handle:
        raise InvalidRequest("transfer is unsupported on the SGLang engine: SGLang places KV on its own devices")

    # -- generation -------------------------------------------------------------------------------

    def resume(self, handle: Handle | str, suffix: str | Sequence[int] = "", sampling: SamplingParams | None = None,
               *, agent: Agent | None = None) -> Result:
        return self.resume_stream(handle, suffix, sampling, agent=agent).until_done()

    def resume_stream(self, handle: Handle | str, suffix: str | Sequence[int] = "",
                      sampling: SamplingParams | None = None, *, agent: Agent | None = None) -> TokenStream:
        parent_id = handle.id if isinstance(handle, Handle) else handle
        parent = self._lookup(handle)
        added = self._tokens(suffix, "suffix")
        tokens = parent.token_ids + added
        step = LineageStep(op=Op.RESUME, parent=parent_id, token_ids=tuple(added))
        return self._stream(tokens, parent.lineage + (step,), sampling or SamplingParams(), agent,
                            reusable=len(parent.token_ids))

    # ``reuse``: SGLang reuses common prefixes only, so every policy is served exactly (and marked exact).
    def complete(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None, *,
                 agent: Agent | None = None, reuse: Reuse | None = None) -> Result:
        return self.complete_stream(prompt, sampling, agent=agent, reuse=reuse).until_done()

    def complete_stream(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None, *,
                        agent: Agent | None = None, reuse: Reuse | None = None) -> TokenStream:
        check_reuse(reuse)
        tokens = self._tokens(prompt, "prompt")
        step = LineageStep(op=Op.GENERATE, token_ids=tuple(tokens))
        return self._stream(tokens, (step,), sampling or SamplingParams(), agent, reusable=0)

    def generate(self, messages: Sequence[ChatMessage | dict[str, Any]], *, handle: Handle | str | None = None,
                 sampling: SamplingParams | None = None, tools: list[dict[str, Any]] | None = None,
                 agent: Agent | None = None, reuse: Reuse | None = None) -> Result:
        return self.generate_stream(
            messages, handle=handle, sampling=sampling, tools=tools, agent=agent, reuse=reuse
        ).until_done()

    def generate_stream(self, messages: Sequence[ChatMessage | dict[str, Any]], *,
                        handle: Handle | str | None = None, sampling: SamplingParams | None = None,
                        tools: list[dict[str, Any]] | None = None, agent: Agent | None = None,
                        reuse: Reuse | None = None) -> TokenStream:
        check_reuse(reuse)
        prompt = self.chat_tokens(messages, tools=tools)
        if handle is None:
            lineage: tuple[LineageStep, ...] = (LineageStep(op=Op.GENERATE, token_ids=tuple(prompt)),)
            reusable = 0
        else:
            parent_id = handle.id if isinstance(handle, Handle) else handle
            parent = self._lookup(handle)
            keep = common_prefix_length(parent.token_ids, prompt)
            step = LineageStep(op=Op.GENERATE, parent=parent_id, keep=None if keep == len(parent.token_ids) else keep,
                               token_ids=tuple(prompt[keep:]))
            lineage, reusable = parent.lineage + (step,), keep
        return self._stream(prompt, lineage, sampling or SamplingParams(), agent, reusable=reusable)

    def _sampling(self, params: SamplingParams) -> dict[str, Any]:
        if (params.response_format is not None and params.response_format.type != "text") or params.logprobs:
            # Not wired to SGLang's own grammar backend and logprobs yet: refused, never ignored.
            raise InvalidRequest("response_format and logprobs are not supported on the SGLang backend yet")
        out: dict[str, Any] = {
            "max_new_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "ignore_eos": params.ignore_eos,
        }
        if params.min_tokens:
            out["min_new_tokens"] = params.min_tokens
        if params.top_k:
            out["top_k"] = params.top_k
        if params.stop:
            out["stop"] = list(params.stop)
        if params.seed is not None:
            out["sampling_seed"] = params.seed
        return out

    def _hints_for(self, tokens: list[int], agent: str | None) -> dict[str, Any] | None:
        """The kv_hints envelope of a request: the running agent (STE 0) and its fixed prompt."""
        if agent is None or self.eviction != "kvbaton":
            return None
        fixed = self._agents.get(agent, [])
        fixed_len = len(fixed) if fixed and tokens[: len(fixed)] == fixed else 0
        hint = WorkflowHint(agent=agent, fixed_tokens=fixed_len, running=(agent,))
        return make_envelope(hint, uuid.uuid4().hex)

    def _account(self, prompt_len: int, cached: int, generated: int, reusable: int) -> None:
        with self._lock:
            self._counters["tokens_reused"] += cached
            self._counters["tokens_prefilled"] += prompt_len - cached
            self._counters["tokens_generated"] += generated
        # A handle's prefix SGLang no longer held (evicted): prefilled again, exactly. SGLang matches
        # whole pages and always runs the prompt's last token, so that much is never expected.
        expected = min(reusable, prompt_len - 1) // self.page_size * self.page_size
        if cached < expected:
            log.debug("SGLang held %d of a handle's %d prefix tokens; the rest were prefilled again", cached, expected)

    def _rpc(self, method: str, body: dict[str, Any]) -> None:
        # Python's json writes inf as Infinity, which the plugin's json reads back.
        with self._sgl_lock:
            self.sgl.collective_rpc(method, payload=json.dumps(body))

    def _prefill(self, tokens: list[int], agent: Agent | None, *, reusable: int) -> None:
        agent = AgentRef.of(agent).label  # SGLang's hints name an agent by its label
        check_agent(agent)
        with self._sgl_lock:
            out = self.sgl.generate(input_ids=tokens, sampling_params={"max_new_tokens": 0},
                                    kv_hints=self._hints_for(tokens, agent))
        self._account(len(tokens), int(out["meta_info"].get("cached_tokens", 0)), 0, reusable)

    def _stream(self, tokens: list[int], lineage: tuple[LineageStep, ...], params: SamplingParams,
                agent: Agent | None, *, reusable: int) -> TokenStream:
        agent = AgentRef.of(agent).label
        check_agent(agent)
        if self.loaded.max_context and len(tokens) + params.max_tokens > self.loaded.max_context:
            from kvbaton.errors import ContextTooLong

            raise ContextTooLong(f"{len(tokens)} prompt + {params.max_tokens} new tokens exceed the model's "
                                 f"context of {self.loaded.max_context}")
        return TokenStream(self._chunks(tokens, lineage, params, agent, reusable))

    def _chunks(self, tokens: list[int], lineage: tuple[LineageStep, ...], params: SamplingParams,
                agent: str | None, reusable: int) -> Generator[StreamChunk, None, Result]:
        start = time.perf_counter()
        ttft: float | None = None
        output: list[int] = []
        text = ""
        meta: dict[str, Any] = {}
        rid = uuid.uuid4().hex
        with self._sgl_lock:
            stream = self.sgl.generate(input_ids=tokens, sampling_params=self._sampling(params), stream=True,
                                       kv_hints=self._hints_for(tokens, agent), rid=rid)
        done = False
        try:
            while True:
                with self._sgl_lock:
                    chunk = next(stream, None)
                if chunk is None:
                    done = True
                    break
                meta = chunk.get("meta_info", meta)
                new_ids = list(chunk.get("output_ids") or [])
                if not new_ids:
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - start
                output.extend(new_ids)
                full = self.detokenize(output)
                piece, text = full[len(text):], full
                yield StreamChunk(text=piece, token_ids=new_ids)
        finally:
            if not done:  # closed early: stop the generation in SGLang too
                with self._sgl_lock:
                    self.sgl.tokenizer_manager.abort_request(rid=rid)
        total = time.perf_counter() - start
        cached = int(meta.get("cached_tokens", 0))
        self._account(len(tokens), cached, len(output), reusable)
        finish = (meta.get("finish_reason") or {}).get("type", "length")
        # As kvbaton's engine does: the generated tokens extend the request's own lineage step.
        last = lineage[-1]
        lineage = lineage[:-1] + (last.model_copy(update={"token_ids": last.token_ids + tuple(output)}),)
        handle = self._new(tokens + output, lineage)
        return Result(
            text=text, token_ids=output, handle=handle, finish_reason="stop" if finish == "stop" else "length",
            timings=Timings(ttft_s=ttft if ttft is not None else total, total_s=total, tokens_reused=cached,
                            tokens_prefilled=len(tokens) - cached, tokens_generated=len(output)),
        )

    # -- workflow hints ---------------------------------------------------------------------------

    def register_agent(self, name: Agent, fixed_prompt: Any, *, prefill: bool = False) -> AgentInfo:
        ref = AgentRef.of(name)
        if ref.name is None:
            raise InvalidRequest("agent name is required")
        name = ref.label
        check_agent(name)
        if isinstance(fixed_prompt, Sequence) and fixed_prompt and isinstance(fixed_prompt[0], ChatMessage | dict):
            tokens = self.chat_tokens(fixed_prompt, add_generation_prompt=False)
        else:
            tokens = self._tokens(fixed_prompt, "fixed_prompt")
        self._agents[name] = tokens
        if self.eviction == "kvbaton":
            self._rpc("kvbaton_agent", {"agent": name, "tokens": tokens})
        if prefill:
            self.release(self.materialize(tokens, agent=name))
        return AgentInfo(name=name, fixed_tokens=len(tokens))

    def unregister_agent(self, name: Agent) -> bool:
        label = AgentRef.of(name).label
        if self._agents.pop(label, None) is None:
            return False
        if self.eviction == "kvbaton":
            self._rpc("kvbaton_agent", {"agent": label, "tokens": []})  # no fixed prompt: nothing of it is held
        return True

    def hints(
        self, steps: Mapping[str, float] | Any, *, running: Iterable[str] = (), finished: Iterable[str] = ()
    ) -> dict[str, float]:
        self._ste = ste_map(steps, running, finished)
        if self.eviction == "kvbaton":
            self._rpc("kvbaton_hints", {"steps": self._ste, "replace": True})
        return dict(self._ste)

    # -- accounting -------------------------------------------------------------------------------

    def stats(self) -> Stats:
        with self._lock:
            counters = dict(self._counters)
            live = len(self._table)
        total = self.kv_tokens or 0
        return Stats(
            model=self.loaded.name, device="cuda", dtype=self.loaded.dtype, block_size=self.page_size,
            blocks_total=total // self.page_size, blocks_used=0, blocks_free=0, blocks_shared=0,
            bytes_per_block=0, pool_bytes_total=0, pool_bytes_used=0, pool_bytes_free=0, handles_live=live,
            tokens_reused=counters["tokens_reused"], tokens_prefilled=counters["tokens_prefilled"],
            tokens_generated=counters["tokens_generated"],
        )

    def events(self, since: int = 0) -> Events:
        """Always empty: the requests run inside SGLang's own scheduler, which exposes no per-request
        phase times or cache evictions to the plugin; ``capacity`` 0 says that no events are kept
        (docs/dashboard.md). Use SGLang's own metrics for its timeline."""
        check_since(since)
        return Events(events=[], next=since, dropped=0, capacity=0)

    def flush_cache(self) -> None:
        with self._sgl_lock:
            self.sgl.flush_cache()

    def close(self) -> None:
        sgl = getattr(self, "sgl", None)
        if sgl is not None:
            sgl.shutdown()
            self.sgl = None


def _check_plugin_visible() -> None:
    """SGLang's scheduler processes find the plugin only through the installed entry point."""
    import os
    from importlib.metadata import entry_points

    target = "kvbaton.backend.sglang_plugin:register"
    if not any(ep.value == target for ep in entry_points(group="sglang.srt.plugins")):
        raise InvalidRequest(
            "SGLang cannot see the kvbaton plugin (no sglang.srt.plugins entry point): install kvbaton in this "
            "environment (pip install -e .); a stale kvbaton.egg-info in the working directory can hide it"
        )
    allowed = os.environ.get("SGLANG_PLUGINS", "")
    if allowed and "kvbaton" not in {name.strip() for name in allowed.split(",")}:
        raise InvalidRequest(f"SGLANG_PLUGINS={allowed!r} excludes the kvbaton plugin")


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:32]
