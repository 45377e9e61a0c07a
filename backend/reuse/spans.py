"""The span index: where known token spans have exact K/V, found by content at any position.

Cross-prefix reuse (docs/segments.md, "Automatic reuse") needs to find, in a new prompt, the tokens
another agent already computed behind ITS OWN system prompt: a shared document, a task, an upstream
agent's reply. A common-prefix lookup (the radix cache) cannot: the prompts differ from their second
message on. The index keys sources by *content-defined anchors*: a position is an anchor when the
hash of the ``NGRAM`` tokens starting there falls on the sampling grid (``hash % STRIDE == 0``), so
the same tokens give the same anchors wherever they sit and whatever precedes them (the chat
template's role tokens and a message's leading words simply match or not). A lookup hashes the
prompt's n-grams past its exact prefix, meets an anchor, checks the tokens and grows the match both
ways as far as the tokens agree (CacheBlend keys chunks by content the same way; content-defined
anchors also find a document quoted inside a longer message).

What is indexed is what the engine holds, not only what handles pin. A source is a live exact state
(the request lifecycle, given the index when it is built, :meth:`SpanIndex.index`-es every state it
registers), and stays one after its handle is released for as long as the prefix cache keeps its
exact full blocks: :meth:`SpanIndex.release` turns it into a view of those cache blocks
(:class:`CachedSources`), ending at the last full block the cache holds (a released handle's partial
last block is not cached). The cache tells the views which device blocks it lets go (evicted,
offloaded, flushed: ``CacheEvents.dropped``), and a view ends before the first block it lost, so a
block id the pool hands out again for other tokens is never read as the old ones. A view's blocks
are owned by the cache; placement pins them while it reads them, as it pins a live source's.

Bounded and owned: at most ``capacity`` anchors (the oldest go first) and ``MAX_CACHED`` views.
Partitioned: an entry answers only requests of the same partition (a tenant on a multi-tenant server, a
session or workflow run when the request names one; ``partition_of`` maps a state to it), so one
tenant's or run's prompts never shape another's answers.

Only exact K/V are sources (an approximation is never copied into another context). Approximate
states are remembered separately, for one use only: the same conversation's next turn resumes from
its own approximate state (a common prefix) instead of re-prefilling its transcript, also after its
handle was released, for as long as the KV manager keeps the state (``KVManager.retain``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvbaton.handle import common_prefix_length

from ..cache.sequence import KVState

NGRAM = 16  # tokens hashed per anchor: shorter matches are not worth placing anyway
STRIDE = 8  # about one anchor per STRIDE positions
MIN_SPAN = 32  # shorter matches are computed: approximating a quoted reply of ~30 tokens cost fidelity
# The prompt's last tokens (the question, the chat template's turn header) are always computed densely:
# they are what the next token depends on most.
TAIL = 32
DEFAULT_CAPACITY = 1 << 17  # anchors (~1M tokens of indexed context), a few tens of MB at most
HOLDERS = 4  # sources remembered per anchor (newest first): one gone leaves the others
MAX_APPROXIMATE = 256  # approximate states remembered for their own next turn
MAX_CACHED = 4096  # released sources remembered as views of the prefix cache's blocks


@dataclass(frozen=True)
class SpanMatch:
    """Prompt positions ``offset..offset+length-1`` equal ``source`` positions ``start..``."""

    offset: int
    source: KVState
    start: int
    length: int


def usable(state: KVState) -> int:
    """How many leading tokens of ``state`` have exact K/V in the pool."""
    return state.num_cached if state.exact_len is None else min(state.num_cached, state.exact_len)


class CachedSources:
    """Released sources, each a view of the prefix cache's blocks that still spell its leading tokens.

    A view is a :class:`KVState` of its own (its handle's id, tokens, agent and tenant; the cache's
    blocks, which it does not reference-count). A leaf: the prefix cache tells it of every device
    block it lets go (:meth:`dropped`, through ``CacheEvents``), and every view reading such a block is
    replaced by a shorter one ending before it (a placement that is reading the old view keeps it
    whole: it pinned its blocks); a view shorter than :data:`MIN_SPAN` goes. Not thread-safe (the
    engine lock guards it, as it guards the cache)."""

    def __init__(self, block_size: int, capacity: int = MAX_CACHED) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._views: OrderedDict[str, KVState] = OrderedDict()
        self._readers: dict[int, set[str]] = {}  # cache block -> the views reading it
        self._gone: list[str] = []  # views dropped since the index last asked (it forgets their anchors)

    def __len__(self) -> int:
        return len(self._views)

    def get(self, source_id: str) -> KVState | None:
        return self._views.get(source_id)

    def add(self, state: KVState, blocks: Sequence[int]) -> None:
        """``state`` was released; the cache holds ``blocks``, its leading full blocks' K/V."""
        n = len(blocks) * self.block_size
        if n < MIN_SPAN:
            self._gone.append(state.id)
            return
        view = KVState(id=state.id, token_ids=state.token_ids[:n], blocks=list(blocks), num_cached=n, lineage=(),
                       agent=state.agent, tenant=state.tenant, session=state.session)
        self._put(view)
        while len(self._views) > self.capacity:
            self._remove(next(iter(self._views)))

    def discard(self, source_id: str) -> None:
        if source_id in self._views:
            self._remove(source_id, gone=False)

    def dropped(self, blocks: Iterable[int]) -> None:
        """The prefix cache no longer holds these device blocks: no view reads them from now on."""
        for block in blocks:
            for source_id in self._readers.pop(block, ()):
                view = self._views.get(source_id)
                if view is None or block not in view.blocks:
                    continue
                keep = view.blocks.index(block)
                self._remove(source_id, gone=keep * self.block_size < MIN_SPAN)
                if keep * self.block_size >= MIN_SPAN:
                    n = keep * self.block_size
                    self._put(KVState(id=view.id, token_ids=view.token_ids[:n], blocks=view.blocks[:keep],
                                      num_cached=n, lineage=(), agent=view.agent, tenant=view.tenant,
                                      session=view.session))

    def take_gone(self) -> list[str]:
        """The ids of the views dropped since the last call."""
        gone, self._gone = self._gone, []
        return gone

    def clear(self) -> None:
        self._gone.extend(self._views)
        self._views.clear()
        self._readers.clear()

    def _put(self, view: KVState) -> None:
        self._views[view.id] = view
        for block in view.blocks:
            self._readers.setdefault(block, set()).add(view.id)

    def _remove(self, source_id: str, gone: bool = True) -> None:
        view = self._views.pop(source_id)
        for block in view.blocks:
            readers = self._readers.get(block)
            if readers is not None:
                readers.discard(source_id)
                if not readers:
                    del self._readers[block]
        if gone:
            self._gone.append(source_id)


class SpanIndex:
    """Content-defined anchors of exact sources (live states, and released ones the prefix cache still
    holds); not thread-safe (the engine lock guards it)."""

    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, partition_of: Callable[[KVState], str | None] = lambda state: "",
        block_size: int = 16,
    ) -> None:
        self.capacity = capacity
        self._partition_of = partition_of  # a state's partition (None: it is no source); by default one partition
        self.cached = CachedSources(block_size)  # what the prefix cache tells of the blocks it lets go
        self._anchors: OrderedDict[tuple[str, int], list[tuple[str, int]]] = OrderedDict()  # -> (source id, position)
        self._keys: dict[str, list[tuple[str, int]]] = {}  # source id -> its anchors
        self._live: dict[str, KVState] = {}  # live sources by id
        self._approximate: OrderedDict[str, tuple[KVState, str]] = OrderedDict()

    def __len__(self) -> int:
        """Anchors indexed (those of sources the cache has let go since the last call forgotten first)."""
        self._forget_gone()
        return len(self._anchors)

    def index(self, state: KVState) -> None:
        """A new live state's spans become sources for later requests of its partition (if it has one)."""
        partition = self._partition_of(state)
        if partition is not None:
            self.add(state, partition)

    def add(self, state: KVState, partition: str) -> None:
        """Index the exact part of a new live state (its anchors replace older ones of the same content)."""
        self._forget_gone()
        if state.exact_len is not None:
            self._approximate[state.id] = (state, partition)
            self._approximate.move_to_end(state.id)
            while len(self._approximate) > MAX_APPROXIMATE:
                self._approximate.popitem(last=False)
        self._live[state.id] = state
        tokens, end = state.token_ids, usable(state)
        keys = []
        for p in range(0, end - NGRAM + 1):
            h = hash(tuple(tokens[p : p + NGRAM]))
            if h % STRIDE:
                continue
            key = (partition, h)
            holders = [e for e in self._anchors.get(key, ()) if e[0] != state.id]
            self._anchors[key] = [(state.id, p), *holders[: HOLDERS - 1]]
            self._anchors.move_to_end(key)
            keys.append(key)
        if keys:
            self._keys[state.id] = keys
        while len(self._anchors) > self.capacity:
            self._anchors.popitem(last=False)

    def release(self, state: KVState, cached_blocks: Sequence[int], retained: bool = False) -> None:
        """``state``'s handle was released: its spans stay sources where the prefix cache holds its exact full
        blocks (``cached_blocks``, leading, on the device), up to the last of them. ``retained``: an approximate
        state the KV manager keeps for its own next turn stays findable by :meth:`approximate_prefix`."""
        if not retained:
            self._approximate.pop(state.id, None)
        if self._live.pop(state.id, None) is None:
            return
        if state.id in self._keys:
            self.cached.add(state, cached_blocks)
        self._forget_gone()

    def remove(self, state_id: str) -> None:
        """Forget a source (a state that never answered, a view no longer wanted)."""
        self._approximate.pop(state_id, None)
        self._live.pop(state_id, None)
        self.cached.discard(state_id)
        self._forget(state_id)

    def clear(self) -> None:
        self._anchors.clear()
        self._keys.clear()
        self._live.clear()
        self._approximate.clear()
        self.cached.clear()
        self.cached.take_gone()

    def source(self, source_id: str) -> KVState | None:
        """The source an anchor names now: the live state, or the view of its cached blocks."""
        return self._live.get(source_id) or self.cached.get(source_id)

    def find(self, tokens: Sequence[int], begin: int, end: int, partition: str) -> list[SpanMatch]:
        """Maximal spans of ``tokens[begin:end]`` that exact sources of ``partition`` hold, in order,
        non-overlapping, each at least :data:`MIN_SPAN` tokens."""
        self._forget_gone()
        matches: list[SpanMatch] = []
        p = begin
        while p + NGRAM <= end:
            h = hash(tuple(tokens[p : p + NGRAM]))
            best: SpanMatch | None = None
            for source_id, sp in self._anchors.get((partition, h), ()) if h % STRIDE == 0 else ():
                source = self.source(source_id)
                if source is None:
                    continue
                src_end, src = usable(source), source.token_ids
                if sp + NGRAM > src_end or list(tokens[p : p + NGRAM]) != src[sp : sp + NGRAM]:
                    continue
                a, b = p, sp  # grow backwards, not into the previous match or the exact prefix
                while a > begin and b > 0 and tokens[a - 1] == src[b - 1]:
                    a, b = a - 1, b - 1
                e, f = p + NGRAM, sp + NGRAM
                while e < end and f < src_end and tokens[e] == src[f]:
                    e, f = e + 1, f + 1
                if e - a >= MIN_SPAN and (best is None or e - a > best.length):
                    best = SpanMatch(offset=a, source=source, start=b, length=e - a)
            if best is not None:
                matches.append(best)
                p = begin = best.offset + best.length
                continue
            p += 1
        return matches

    def is_approximate(self, state: KVState) -> bool:
        """Whether ``state`` is an approximate state this index remembers for its own next turn."""
        entry = self._approximate.get(state.id)
        return entry is not None and entry[0] is state

    def forget_approximate(self, state_id: str) -> None:
        self._approximate.pop(state_id, None)

    def approximate_prefix(
        self, tokens: Sequence[int], partition: str, retained: Callable[[KVState], bool] = lambda state: False,
    ) -> tuple[KVState | None, int]:
        """The approximate state of ``partition`` sharing the longest prefix with ``tokens``, and that length:
        a live one, or a released one the KV manager still keeps (``retained``)."""
        best: KVState | None = None
        best_len = 0
        for state, state_partition in list(self._approximate.values()):
            if state_partition != partition or (self._live.get(state.id) is not state and not retained(state)):
                continue
            n = common_prefix_length(state.token_ids[: state.num_cached], tokens)
            if n > best_len:
                best, best_len = state, n
        return best, best_len

    def _forget_gone(self) -> None:
        for source_id in self.cached.take_gone():
            if source_id not in self._live:
                self._forget(source_id)

    def _forget(self, source_id: str) -> None:
        for key in self._keys.pop(source_id, ()):
            holders = self._anchors.get(key)
            if holders is None:
                continue
            rest = [e for e in holders if e[0] != source_id]
            if rest:
                self._anchors[key] = rest
            else:
                del self._anchors[key]
