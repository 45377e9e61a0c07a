"""``EngineConfig``: every knob of one engine, declared once and validated before anything loads.

``Engine(model, kv_budget=...)``, ``kvbaton.connect(model=..., kv_budget=...)``, ``kvbaton serve``
and a cluster's workers all build one :class:`EngineConfig` (the way nano-vllm's ``Config`` and
SGLang's ``ServerArgs`` hold theirs): the engine reads its knobs from it, ``kvbaton serve`` derives
its engine options from the fields' :class:`Flag` (one table, no second declaration), and a cluster
sends it to its worker processes as JSON (:meth:`EngineConfig.to_json`).

Invariants: a config that exists is valid: a bad knob is an ``InvalidRequest`` naming it, raised
when the config is built, before any directory is claimed or any weight is read; configs are frozen
(change one with :func:`dataclasses.replace`, which validates again); importing this module loads
neither torch nor the engine (the command line builds its parser from it), the few checks that need
them import them when a config is built.

GPU defaults (issue 50): three knobs default by device, resolved when the config is built (a knob given
explicitly is kept): ``dtype`` is bfloat16 on CUDA and float32 elsewhere; ``kv_budget`` is 90% of the GPU
memory free once the weights are loaded on CUDA (as vLLM's ``gpu_memory_utilization``, but of what the
weights leave; spelled ``"90%"``, stored as ``"90% of cuda:N"`` so that the share is of the engine's own
device) and 1GiB elsewhere; ``max_batch_tokens`` (the chunk a lone prompt is prefilled in) is 16384 on
CUDA, where a long prompt in few large chunks runs at the matrix units' speed, and 2048 elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbaton.errors import InvalidRequest
from kvbaton.ops import check_reuse
from kvbaton.types import REUSE_POLICIES, Reuse

from .events import DEFAULT_CAPACITY as DEFAULT_EVENT_CAPACITY

if TYPE_CHECKING:
    from .cache.eviction import EvictionPolicy
    from .reuse.correction import CorrectionConfig

DEFAULT_KV_BUDGET = "1GiB"
DEFAULT_BLOCK_SIZE = 16
DEFAULT_PREFILL_CHUNK = 512
DEFAULT_MAX_BATCH_TOKENS = 2048  # per forward, as vLLM's and SGLang's default step budgets
# On CUDA (see the module): the dtype, the KV budget as a share of free memory, the step budget.
CUDA_DTYPE = "bfloat16"
CUDA_KV_SHARE = "90%"
CUDA_MAX_BATCH_TOKENS = 16384
DEFAULT_LOOKAHEAD = 2
MAX_SPECULATE = 16  # draft tokens per decode row
DEFAULT_AUDIT_FRACTION = 0.05  # every 20th approximate answer is checked against dense prefill
DTYPES = ("auto", "float32", "bfloat16", "float16")
EVICTION_POLICIES = ("ste", "lru")
SPAN_PARTITIONS = ("session", "tenant")


@dataclass(frozen=True)
class Flag:
    """How ``kvbaton serve`` spells a knob: its ``--help`` section (``group``), the help text
    (argparse's ``%(default)s`` shows the knob's default) and the flag's form: ``value`` (``--knob
    VALUE``, typed as the default), ``switch`` (``--knob`` turns on a knob that is off by default),
    ``negate`` (``--no-knob`` turns off one that is on), ``append`` (repeatable, one value each)."""

    group: str
    help: str
    form: str = "value"
    name: str | None = None  # the flag without its dashes, when it is not the knob's name
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    def flag(self, knob: str) -> str:
        base = self.name or knob.replace("_", "-")
        return f"--no-{base}" if self.form == "negate" else f"--{base}"


def _flag(group: str, help: str, **form: Any) -> dict[str, Flag]:
    """A field's metadata: how ``kvbaton serve`` spells the knob (``Flag``)."""
    return {"flag": Flag(group, help, **form)}


ENGINE, CACHE, REUSE = "engine", "cache", "reuse"  # the --help sections of kvbaton serve


@dataclass(frozen=True)
class EngineConfig:
    """The knobs of one engine (docs/engine.md, docs/cache.md, docs/server.md describe each)."""

    model: str | None = field(default=None, metadata=_flag(
        ENGINE, "default model, or a local Hugging Face checkpoint dir"))
    dtype: str = field(default=None, metadata=_flag(  # type: ignore[assignment]  # None: by device
        ENGINE, "compute dtype; auto = bf16 where the hardware has it natively (default: bfloat16 on CUDA, float32 "
        "elsewhere)", choices=DTYPES))
    device: str = field(default="cpu", metadata=_flag(ENGINE, "torch device (default %(default)s)"))
    kv_budget: int | str = field(default=None, metadata=_flag(  # type: ignore[assignment]  # None: by device
        ENGINE, 'KV pool size: "512MiB", "2GB", "800 blocks", or "90%%" of the GPU memory free once the weights '
        f'are loaded (default: {CUDA_KV_SHARE.replace("%", "%%")} on CUDA, {DEFAULT_KV_BUDGET} elsewhere)'))
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata=_flag(
        ENGINE, "tokens per KV block (default %(default)s)"))
    prefill_chunk: int = field(default=DEFAULT_PREFILL_CHUNK, metadata=_flag(
        ENGINE, "most tokens per prefill forward while other requests are active; bounds how long a prompt "
        "stalls them (default %(default)s)"))
    max_batch_tokens: int = field(default=None, metadata=_flag(  # type: ignore[assignment]  # None: by device
        ENGINE, "most tokens in one forward, and the chunk of a prompt prefilled while no other request is "
        f"active (default: {CUDA_MAX_BATCH_TOKENS} on CUDA, {DEFAULT_MAX_BATCH_TOKENS} elsewhere)"))
    fast_decode: bool = field(default=True, metadata=_flag(
        ENGINE, "decode through the model's own forward instead of kvbaton's fused decode step (saves the "
        "packed copy of the weights; docs/engine.md)", form="negate"))
    speculate: int = field(default=0, metadata=_flag(
        ENGINE, "draft tokens per greedy decode step, looked up in the sequence's own earlier tokens (prompt "
        "lookup; exact: only tokens greedy decoding picks are kept); 0 = off (default %(default)s)"))
    chat_template: str | None = field(default=None, metadata=_flag(
        ENGINE, "Jinja chat template (a file, or the template itself) replacing the tokenizer's for every chat "
        "rendering: OpenAI and native routes, chat_tokens, agents' fixed prompts", metavar="FILE_OR_TEMPLATE"))
    prefix_cache: bool = field(default=True, metadata=_flag(CACHE, "disable the radix prefix cache", form="negate"))
    eviction: str | EvictionPolicy = field(default="ste", metadata=_flag(
        CACHE, "eviction order: steps-to-execution (default) or least recently used", choices=EVICTION_POLICIES))
    tiers: tuple[str, ...] = field(default=(), metadata=_flag(
        CACHE, 'slow tier below the device, e.g. "host:8GiB" or "disk:32GiB" (repeatable, in order)',
        form="append", name="tier", metavar="KIND:SIZE"))
    tier_eviction: str | None = None  # the slow tiers' own eviction order (default: the device's)
    prefetch: bool = True  # load agents due within ``lookahead`` steps back from the slow tiers
    lookahead: int = field(default=DEFAULT_LOOKAHEAD, metadata=_flag(
        CACHE, "prefetch agents due within this many steps (default %(default)s)"))
    # Persistence (docs/server.md#persistence): handles survive restarts in the first disk tier's directory.
    persist: bool = field(default=False, metadata=_flag(
        CACHE, "keep live handles across restarts and crashes (needs a --tier disk:SIZE[:PATH]; with --devices, "
        "each worker keeps its own journal): the same tenants get the same handle ids back, their K/V loaded from "
        "checksummed blocks or recomputed from lineage", form="switch"))
    reuse: Reuse = field(default="exact", metadata=_flag(
        REUSE, "reuse policy of requests that name none (kvbaton.reuse, reuse, X-Kvbaton-Reuse): exact = "
        "common-prefix reuse only, greedy output identical to dense prefill (default); auto = also spans other "
        "agents computed behind another prefix, re-aligned and partly recomputed, answers marked approximate; "
        "rotate = re-alignment only; correct = re-alignment plus the anchor pools' chained low-rank correction "
        "(every worker of --devices too; no effect with --engine sglang)",
        choices=REUSE_POLICIES))
    span_partition: str = field(default="session", metadata=_flag(
        REUSE, "where approximate reuse looks for spans: session = only the request's own session (workflow run: "
        "X-Kvbaton-Session, kvbaton.session, the OpenAI user) when it names one, else its tenant's; tenant = every "
        "session of its tenant (default %(default)s)", choices=SPAN_PARTITIONS))
    correction: CorrectionConfig | None = None  # anchor-pool settings (a mapping of their fields is accepted)
    audit_fraction: float = DEFAULT_AUDIT_FRACTION  # the share of approximate answers checked in the background
    event_capacity: int = DEFAULT_EVENT_CAPACITY  # events the ring keeps

    def __post_init__(self) -> None:
        # Normal forms first (a frozen dataclass sets them through object.__setattr__), then the checks.
        if self.model is not None and not isinstance(self.model, str):
            object.__setattr__(self, "model", _path_text(self.model))
        object.__setattr__(self, "tiers", _tiers(self.tiers))
        _device_defaults(self)
        object.__setattr__(self, "correction", _correction(self.correction))
        _validate(self)

    @property
    def disk_tier(self) -> bool:
        """Whether a slow tier is on disk (where persistence keeps its state)."""
        return any(spec.partition(":")[0] == "disk" for spec in self.tiers)

    @classmethod
    def build(cls, base: EngineConfig | None = None, **knobs: Any) -> EngineConfig:
        """``base`` (default: every knob's default) with ``knobs`` changed; validated. An unknown knob
        is a ``TypeError``, as an unknown keyword argument of any call."""
        return dataclasses.replace(base, **knobs) if base is not None else cls(**knobs)

    # -- to a worker process and back ------------------------------------------------------------
    def to_json(self) -> str:
        """The config as JSON, for a worker process (:meth:`from_json` reads it back)."""
        from .cache.eviction import EvictionPolicy

        if isinstance(self.eviction, EvictionPolicy):
            raise InvalidRequest("eviction: a policy object cannot be sent to another process; use 'ste' or 'lru'")
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["tiers"] = list(self.tiers)
        values["correction"] = dataclasses.asdict(self.correction) if self.correction is not None else None
        return json.dumps(values)

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        values = json.loads(text)
        if not isinstance(values, dict):
            raise InvalidRequest("an engine config is a JSON object of its knobs")
        return cls(**values)


def knob_flags() -> list[tuple[str, Any, Flag]]:
    """``(knob, default, flag)`` of every knob ``kvbaton serve`` takes, in declaration order."""
    return [(f.name, f.default, f.metadata["flag"]) for f in dataclasses.fields(EngineConfig) if "flag" in f.metadata]


# -- defaults by device ---------------------------------------------------------------------------


def _device_defaults(c: EngineConfig) -> None:
    """``dtype``, ``kv_budget`` and ``max_batch_tokens`` left unset take their device's default (see the module);
    a share of free memory is tied to the config's own device; a count given as digits (a command-line flag
    whose default is unset) becomes an int."""
    _device(c.device)
    cuda = c.device.startswith("cuda")
    if c.dtype is None:
        object.__setattr__(c, "dtype", CUDA_DTYPE if cuda else "float32")
    if c.kv_budget is None:
        object.__setattr__(c, "kv_budget", CUDA_KV_SHARE if cuda else DEFAULT_KV_BUDGET)
    if isinstance(c.kv_budget, str) and c.kv_budget.strip().partition(" of ")[0].strip().endswith("%"):
        if not cuda:
            raise _bad("kv_budget", f"kv_budget: a share of free GPU memory ({c.kv_budget!r}) needs a CUDA device, "
                       f"not {c.device!r}: give bytes, e.g. '2GiB'")
        share = c.kv_budget.strip().partition(" of ")[0].strip()
        object.__setattr__(c, "kv_budget", f"{share} of {c.device}")
    if c.max_batch_tokens is None:
        object.__setattr__(c, "max_batch_tokens", CUDA_MAX_BATCH_TOKENS if cuda else DEFAULT_MAX_BATCH_TOKENS)
    if isinstance(c.max_batch_tokens, str) and c.max_batch_tokens.strip().isdigit():
        object.__setattr__(c, "max_batch_tokens", int(c.max_batch_tokens))


# -- validation -----------------------------------------------------------------------------------


def _validate(c: EngineConfig) -> None:
    """Every knob, one at a time: the first bad one is an ``InvalidRequest`` naming it (``param``)."""
    if c.model is not None and not c.model:
        raise _bad("model", "model: give a model name or a checkpoint directory (None: the default model)")
    if c.dtype not in DTYPES:
        raise _bad("dtype", f"dtype must be 'auto' or one of {sorted(DTYPES[1:])}, got {c.dtype!r}")
    _device(c.device)
    for name in ("block_size", "prefill_chunk", "max_batch_tokens", "event_capacity"):
        _integer(name, getattr(c, name), minimum=1)
    _integer("lookahead", c.lookahead, minimum=0)
    _integer("speculate", c.speculate, minimum=0)
    if c.speculate > MAX_SPECULATE:
        raise _bad("speculate", f"speculate must be at most {MAX_SPECULATE}, got {c.speculate}")
    for name in ("prefix_cache", "prefetch", "fast_decode", "persist"):
        if not isinstance(getattr(c, name), bool):
            raise _bad(name, f"{name} must be True or False, got {getattr(c, name)!r}")
    fraction = c.audit_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 <= fraction <= 1:
        raise _bad("audit_fraction", f"audit_fraction must be in [0, 1], got {fraction!r}")
    _checked("reuse", check_reuse, c.reuse)
    if c.span_partition not in SPAN_PARTITIONS:
        raise _bad("span_partition", f"span_partition must be one of {', '.join(map(repr, SPAN_PARTITIONS))}, "
                   f"got {c.span_partition!r}")
    if c.chat_template is not None and not isinstance(c.chat_template, str):
        raise _bad("chat_template", "chat_template must be the template's text (a Jinja string)")
    _eviction("eviction", c.eviction)
    if c.tier_eviction is not None:
        _eviction("tier_eviction", c.tier_eviction, objects=False)
    _checked("kv_budget", _budget, c.kv_budget)
    from .cache.tiers import parse_tier

    for spec in c.tiers:
        _checked("tiers", parse_tier, spec)
    if c.tiers and not c.prefix_cache:
        raise _bad("tiers", "tiers: slow tiers hold evicted prefix-cache blocks: they need prefix_cache=True")
    if c.persist and not c.disk_tier:
        raise _bad("persist", "persist=True keeps handles in a disk tier's directory: configure one, e.g. 'disk:4GiB'")


def _bad(name: str, message: str) -> InvalidRequest:
    return InvalidRequest(message, param=name)


def _checked(name: str, check: Any, value: Any) -> None:
    """``check(value)``, its ``InvalidRequest`` naming the knob."""
    try:
        check(value)
    except InvalidRequest as exc:
        message = exc.message if exc.message.startswith(name) else f"{name}: {exc.message}"
        raise _bad(name, message) from None


def _integer(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(name, f"{name} must be an integer >= {minimum}, got {value!r}")


def _device(device: Any) -> None:
    message = f"device must be a torch device name such as 'cpu' or 'cuda:0', got {device!r}"
    if not isinstance(device, str) or not device:
        raise _bad("device", message)
    import torch

    try:
        torch.device(device)
    except (RuntimeError, ValueError):
        raise _bad("device", message) from None


def _eviction(name: str, value: Any, objects: bool = True) -> None:
    from .cache.eviction import EvictionPolicy

    if not (objects and isinstance(value, EvictionPolicy)) and value not in EVICTION_POLICIES:
        raise _bad(name, f"{name}: unknown eviction policy {value!r}: use 'ste' or 'lru'")


def _budget(value: Any) -> None:
    from .cache.block_pool import blocks_for_budget, memory_share

    if isinstance(value, bool) or not isinstance(value, int | str) or (isinstance(value, int) and value < 1):
        raise InvalidRequest(f"invalid KV budget {value!r}: use bytes, e.g. '512MiB' or '2GB', or 'N blocks'")
    if isinstance(value, str) and memory_share(value) is not None:
        return  # a share of free GPU memory: measured when the pool is built, after the weights
    blocks_for_budget(value, 1)  # the syntax now; the block count once the model gives a block's size


def _tiers(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise _bad("tiers", f"tiers must be a list of tier specs such as ['disk:4GiB'], got {value!r}")
    return tuple(value)


def _correction(value: Any) -> CorrectionConfig | None:
    if value is None:
        return None
    from .reuse.correction import correction_config

    try:
        return correction_config(dict(value) if isinstance(value, Mapping) else value)
    except InvalidRequest as exc:
        raise _bad("correction", f"correction: {exc.message}") from None


def _path_text(value: Any) -> str:
    if isinstance(value, os.PathLike):
        return os.fspath(value)  # type: ignore[return-value]
    raise _bad("model", f"model must be a model name or a checkpoint directory, got {value!r}")
