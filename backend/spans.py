"""The span index: where known token spans have exact K/V, found by content at any position.

Cross-prefix reuse (docs/segments.md, "Automatic reuse") needs to find, in a new prompt, the tokens
another agent already computed behind ITS OWN system prompt: a shared document, a task, an upstream
agent's reply. A common-prefix lookup (the radix cache) cannot: the prompts differ from their second
message on. The index keys live states by *content-defined anchors*: a position is an anchor when
the hash of the ``NGRAM`` tokens starting there falls on the sampling grid (``hash % STRIDE == 0``),
so the same tokens give the same anchors wherever they sit and whatever precedes them (the chat
template's role tokens and a message's leading words simply match or not). A lookup hashes the
prompt's n-grams past its exact prefix, meets an anchor, checks the tokens and grows the match both
ways as far as the tokens agree (CacheBlend keys chunks by content the same way; content-defined
anchors also find a document quoted inside a longer message).

Bounded and owned: at most ``capacity`` anchors (the oldest go first); an entry names a live state
and dies with it (:meth:`remove` on release; a lookup also skips states that lost their K/V).
Scoped: an entry answers only requests of the same scope (a tenant on a multi-tenant server), so
one tenant's prompts never shape another's answers.

Only exact K/V are sources (an approximation is never copied into another context). Approximate
states are remembered separately, for one use only: the same conversation's next turn resumes from
its own approximate state (a common prefix) instead of re-prefilling its transcript.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbaton.handle import common_prefix_length

from .sequence import KVState

NGRAM = 16  # tokens hashed per anchor: shorter matches are not worth placing anyway
STRIDE = 8  # about one anchor per STRIDE positions
MIN_SPAN = 32  # shorter matches are computed: approximating a quoted reply of ~30 tokens cost fidelity
# The prompt's last tokens (the question, the chat template's turn header) are always computed densely:
# they are what the next token depends on most.
TAIL = 32
DEFAULT_CAPACITY = 1 << 17  # anchors (~1M tokens of indexed context), a few tens of MB at most
HOLDERS = 4  # live states remembered per anchor (newest first): one released leaves the others
MAX_APPROXIMATE = 256  # approximate states remembered for their own next turn


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


class SpanIndex:
    """Content-defined anchors of live exact states; not thread-safe (the engine lock guards it)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, live: Callable[[str], KVState | None] = lambda _: None) -> None:
        self.capacity = capacity
        self._live = live  # state id -> the live state, None once released
        self._anchors: OrderedDict[tuple[str, int], list[tuple[KVState, int]]] = OrderedDict()
        self._keys: dict[str, list[tuple[str, int]]] = {}  # state id -> its anchors
        self._approximate: OrderedDict[str, tuple[KVState, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._anchors)

    def add(self, state: KVState, scope: str) -> None:
        """Index the exact part of a new live state (its anchors replace older ones of the same content)."""
        if state.exact_len is not None:
            self._approximate[state.id] = (state, scope)
            self._approximate.move_to_end(state.id)
            while len(self._approximate) > MAX_APPROXIMATE:
                self._approximate.popitem(last=False)
        tokens, end = state.token_ids, usable(state)
        keys = []
        for p in range(0, end - NGRAM + 1):
            h = hash(tuple(tokens[p : p + NGRAM]))
            if h % STRIDE:
                continue
            key = (scope, h)
            holders = [e for e in self._anchors.get(key, ()) if e[0].id != state.id]
            self._anchors[key] = [(state, p), *holders[: HOLDERS - 1]]
            self._anchors.move_to_end(key)
            keys.append(key)
        if keys:
            self._keys[state.id] = keys
        while len(self._anchors) > self.capacity:
            self._anchors.popitem(last=False)

    def remove(self, state_id: str) -> None:
        """Forget a released state."""
        self._approximate.pop(state_id, None)
        for key in self._keys.pop(state_id, ()):
            holders = self._anchors.get(key)
            if holders is None:
                continue
            rest = [e for e in holders if e[0].id != state_id]
            if rest:
                self._anchors[key] = rest
            else:
                del self._anchors[key]

    def clear(self) -> None:
        self._anchors.clear()
        self._keys.clear()
        self._approximate.clear()

    def find(self, tokens: Sequence[int], begin: int, end: int, scope: str) -> list[SpanMatch]:
        """Maximal spans of ``tokens[begin:end]`` that live exact states of ``scope`` hold, in order,
        non-overlapping, each at least :data:`MIN_SPAN` tokens."""
        matches: list[SpanMatch] = []
        p = begin
        while p + NGRAM <= end:
            h = hash(tuple(tokens[p : p + NGRAM]))
            best: SpanMatch | None = None
            for source, sp in self._anchors.get((scope, h), ()) if h % STRIDE == 0 else ():
                src_end = usable(source) if self._live(source.id) is source else 0
                src = source.token_ids
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

    def approximate_prefix(self, tokens: Sequence[int], scope: str) -> tuple[KVState | None, int]:
        """The live approximate state of ``scope`` sharing the longest prefix with ``tokens``, and that length."""
        best: KVState | None = None
        best_len = 0
        for state, state_scope in list(self._approximate.values()):
            if state_scope != scope or self._live(state.id) is not state:
                continue
            n = common_prefix_length(state.token_ids[: state.num_cached], tokens)
            if n > best_len:
                best, best_len = state, n
        return best, best_len
