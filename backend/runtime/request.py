"""A request as data: what the scheduler runs, and what it tells the request's consumer.

A :class:`Request` is one operator call in flight (a prefill, a generation, a reuse plan's prompt, a
background check): its KV state, its sampling parameters, where it stands (:class:`Status`) and an output
queue. The scheduler (:mod:`.scheduler`) is the only one that moves it forward: it admits it, runs its
prompt and decode steps, samples its tokens and lets go of it. The consumer (an SDK call, a server worker,
a stream: :mod:`.output`) only reads the queue, and may ask the scheduler to stop or abort it.

::

    WAITING --admit--> PROMPT (reuse plan / prefill chunks) --> DECODING --> FINISHED
       ^                                                           |
       +------------------- preempted (pool short) ----------------+

Messages on the queue, in order: :class:`Prompted` once the prompt is computed, then one :class:`Emitted` per
sampled token of a generation (the last says why it ended) or :class:`Ended` for a request without one; or
an exception, after which nothing follows.
"""

from __future__ import annotations

import enum
import itertools
import queue
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import torch
from kvbaton.types import SamplingParams, SegmentReport

from ..cache.sequence import KVState
from ..reuse.plan import Need
from .constrained import Constraint

_ARRIVAL = itertools.count()
# A sampled token's log probability as the loop computes it: (token, logprob, [(top token, logprob), ...]);
# the consumer adds the tokens' bytes (sampler.token_logprob), off the loop.
RawLogprob = tuple[int, float, list[tuple[int, float]]]


class Status(enum.Enum):
    WAITING = "waiting"  # queued for admission (blocks for its prompt not reserved yet)
    PROMPT = "prompt"  # admitted: its prompt program (reuse plan, prefill chunks) runs
    DECODING = "decoding"  # one token per step (more with speculation), sampled in postprocess
    FINISHED = "finished"  # the scheduler has let go of it


@dataclass(frozen=True)
class Prompted:
    """The prompt is computed: what reuse did (segments, tokens placed approximately, work discarded)."""

    reused: int  # prompt tokens whose K/V were not computed by this request (cache, parent, placed spans)
    approximate: int  # of those, placed approximately
    discarded: int  # token-forwards the confidence gate threw away
    segments: list[SegmentReport]
    exact: bool  # the prompt's K/V are all exact
    extra: Any = None  # what the program returned beyond that (a composition's margin)
    recomputed: int = 0  # found spans' tokens computed anyway (blended spans' recomputed share, prefilled spans)


@dataclass(frozen=True)
class Emitted:
    """Generated tokens (one per message), and why the generation ended with the last (None: it goes on)."""

    tokens: list[int]
    logprobs: list[RawLogprob] | None = None  # the consumer adds the tokens' bytes (sampler.token_logprob)
    finish: str | None = None


@dataclass(frozen=True)
class Ended:
    """A request without generation is computed (``"prefilled"``)."""

    reason: str


Message = Prompted | Emitted | Ended | BaseException


@dataclass(eq=False)
class Request:
    """One request in flight. Fields below ``out`` are the scheduler's (its thread only writes them)."""

    state: KVState
    program: Generator[Need, Any, Any]  # the prompt: yields what it needs computed, returns a reuse.Filled
    params: SamplingParams | None = None  # None: no generation (materialize, extend, a measurement)
    constraint: Constraint | None = None
    rng: torch.Generator | None = None
    eos: frozenset[int] = frozenset()  # tokens that end it (none with ignore_eos)
    banned: list[int] = field(default_factory=list)  # tokens it may not pick before min_tokens (EOS, ignored or not)
    background: bool = False  # runs only while no other request waits or runs, in small chunks
    tenant: str | None = None
    reused_prefix: int = 0  # tokens attached from the prefix cache or the parent before admission
    parent: Request | None = None  # a reference prefill's: the request whose program asked for it (reuse.plan.Alone)
    out: queue.SimpleQueue[Message] = field(default_factory=queue.SimpleQueue)
    left: threading.Event = field(default_factory=threading.Event)  # set once the scheduler lets go
    arrival: int = field(default_factory=lambda: next(_ARRIVAL))
    t_submitted: float = field(default_factory=time.perf_counter)
    t_admitted: float | None = None  # wall clock (time.time) of admission, for the request's event
    t_first: float | None = None  # perf_counter of the first sampled token
    # -- the scheduler's -------------------------------------------------------------------------
    status: Status = Status.WAITING
    need: Need | None = None  # what the prompt program waits for
    prompted: bool = False  # Prompted was sent (a preempted request recomputes without sending it again)
    generated: int = 0
    stopping: bool = False  # the consumer asked to let go (a stop string): keep the state
    aborting: bool = False  # the consumer left: let go and give every block back
    preemptions: int = 0
    draft: list[int] = field(default_factory=list)  # speculative tokens riding the next decode row
    drafted: int = 0
    accepted: int = 0

    @property
    def generates(self) -> bool:
        return self.params is not None

    @property
    def unread(self) -> int:
        """Messages the consumer has not read yet (a generation pauses when too far ahead)."""
        return self.out.qsize()
