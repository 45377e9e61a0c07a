"""Constrained decoding: a request's ``response_format`` enforced token by token.

A response format (JSON, a JSON schema) is compiled by llguidance (the grammar library vLLM and
SGLang use; a Rust wheel, no torch dependency) against the model's tokenizer. Each constrained
request gets its own :class:`Constraint`, a matcher that says, before each sampling step, which
tokens keep the output valid (the others' logits become -inf), and follows each sampled token.

The mask is applied to one request's own next-token logits in its lifecycle, after the (batched,
possibly fused) forward: batching and the fused decode path are untouched, and constrained and
unconstrained requests share forwards.

A JSON schema is compiled strictly (:func:`strict_schema`), as vLLM's and SGLang's grammar
backends do by default: an object that lists its properties admits no other key unless the schema
says so, and the JSON is compact (no free whitespace), so a small model cannot grow an answer until
``max_tokens``.

Invariants: a schema that does not compile is ``InvalidRequest`` before the request takes a block;
a constrained request ends ``"stop"`` only where its grammar accepts (it ended, or the model chose
end-of-sequence where the grammar allows it), otherwise ``"length"``; the tokenizer's grammar view
is built once per process, on first use; compiled grammars are cached by format within a bound of
count and size (``GRAMMARS``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch
from kvbaton.errors import InvalidRequest
from kvbaton.types import ResponseFormat, SamplingParams

from ..compute.loader import LoadedModel

# Compact JSON: a 135M model given free whitespace can loop on it until max_tokens.
_JSON_OPTIONS = {"whitespace_flexible": False}
_ANY_JSON_OBJECT = {"type": "object"}
# Keywords whose values are subschemas (each, or each of a list / of an object's values); allOf's
# branches are left as written (closing each would refuse what only their combination allows).
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
              "unevaluatedItems")
_SUBSCHEMAS = ("prefixItems", "anyOf", "oneOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema: Any) -> Any:
    """``schema`` compiled strictly, as vLLM's and SGLang's grammar backends (xgrammar) do by default:
    an object that lists its ``properties`` and says nothing of others gets ``additionalProperties:
    false`` (a small model otherwise adds keys until ``max_tokens``), and a tuple (``prefixItems``)
    no more items. What a schema says explicitly (``additionalProperties: true``, a schema of them,
    ``items``) is kept: that is the opt-out. ``schema`` itself is not changed."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = strict_schema(out[key])
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(s) for name, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = strict_schema(out["additionalProperties"])
    if "properties" in out and not {"additionalProperties", "unevaluatedProperties", "patternProperties"} & set(out):
        out["additionalProperties"] = False
    if "prefixItems" in out and "items" not in out and "unevaluatedItems" not in out:
        out["items"] = False
    return out


class _GrammarCache:
    """Compiled grammars by response format, least recently used dropped beyond ``max_entries`` or
    ``max_bytes`` (formats and grammars counted by their length: a schema may be as big as a request
    body, and every distinct one would otherwise stay for the life of the process)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._lock = threading.Lock()
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self.bytes = 0

    def get(self, format_json: str) -> str:
        with self._lock:
            grammar = self._grammars.get(format_json)
            if grammar is not None:
                self._grammars.move_to_end(format_json)
                return grammar
        grammar = _compile(format_json)  # outside the lock: compiles run in parallel
        size = len(format_json) + len(grammar)
        with self._lock:
            if size <= self.max_bytes and format_json not in self._grammars:
                self._grammars[format_json] = grammar
                self.bytes += size
                while len(self._grammars) > self.max_entries or self.bytes > self.max_bytes:
                    old, dropped = self._grammars.popitem(last=False)
                    self.bytes -= len(old) + len(dropped)
        return grammar

    def __len__(self) -> int:
        return len(self._grammars)


GRAMMARS = _GrammarCache(max_entries=256, max_bytes=64 * 2**20)


def _compile(format_json: str) -> str:
    """llguidance's grammar of a response format (given as its JSON, the cache's key)."""
    fmt = ResponseFormat.model_validate_json(format_json)
    schema = _ANY_JSON_OBJECT if fmt.type == "json_object" else strict_schema((fmt.json_schema or {}).get("schema", {}))
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except ValueError as exc:
        raise InvalidRequest(f"Invalid value for 'response_format': its schema is not valid: {exc}",
                             param="response_format") from None


class Constraint:
    """One request's matcher: the allowed next tokens, and where the output stands."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int) -> None:
        self._matcher = matcher
        self._vocab = vocab

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (``[vocab]``) with every token the grammar does not allow next set to -inf."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self._vocab].astype(bool))
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def advance(self, token: int) -> None:
        """Follow a sampled token (one the mask allowed)."""
        if not self._matcher.consume_token(token):  # cannot happen after mask(): a bug, never a silent wrong answer
            raise RuntimeError(f"constrained decoding: token {token} rejected: {self._matcher.get_error()}")

    @property
    def ended(self) -> bool:
        """The grammar admits nothing more: the output is complete."""
        return self._matcher.is_stopped()


# The grammar view of each tokenizer: built once per process (about 0.4 s), like the models themselves
# (loader.load_model), and shared by every engine on that tokenizer.
_tokenizers: dict[tuple[str, int], llguidance.LLTokenizer] = {}
_tokenizers_lock = threading.Lock()


def _llg_tokenizer(loaded: LoadedModel) -> llguidance.LLTokenizer:
    key = (loaded.tokenizer_fingerprint, loaded.vocab_size)
    with _tokenizers_lock:
        if key not in _tokenizers:
            _tokenizers[key] = llguidance.hf.from_tokenizer(
                loaded.tokenizer, n_vocab=loaded.vocab_size, eos_token=sorted(loaded.eos_token_ids)
            )
        return _tokenizers[key]


class Constraints:
    """The response formats of one loaded model: compiles them and starts a :class:`Constraint` per
    request; the grammar's view of the tokenizer also says each token's own bytes (``token_bytes``)."""

    def __init__(self, loaded: LoadedModel) -> None:
        self._loaded = loaded

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (a byte-level BPE fragment's too; a special token's text)."""
        return bytes(_llg_tokenizer(self._loaded).decode_bytes([token_id]))

    def start(self, params: SamplingParams) -> Constraint | None:
        """The constraint of a request (None: unconstrained). Raises InvalidRequest for a bad schema."""
        fmt = params.response_format
        if fmt is None or fmt.type == "text":
            return None
        grammar = GRAMMARS.get(fmt.model_dump_json())  # key order kept: JSON properties are generated in schema order
        matcher = llguidance.LLMatcher(_llg_tokenizer(self._loaded), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"Invalid value for 'response_format': it cannot be enforced: {matcher.get_error()}",
                                 param="response_format")
        return Constraint(matcher, self._loaded.vocab_size)
